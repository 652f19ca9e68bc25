//! Tier worker threads: pop [`Job`]s from an SPSC ring, move bytes, push [`Done`]s back.
//!
//! A worker owns its tier's [`TierIo`] and a fixed slab of in-flight jobs sized at start;
//! the per-block path allocates nothing.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fastlane_block::Segment;
use fastlane_ring::spsc::{Consumer, PopError, Producer};

use crate::checksum::{checksum, copy_checksum, ChecksumMode};
use crate::device::DeviceMemory;
use crate::tier::{HostTier, TierDone, TierIo};
use crate::BlockId;

/// Most blocks one job moves (a job is one contiguous tier extent).
pub(crate) const JOB_BLOCKS_MAX: usize = 128;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum JobOp {
    /// Device blocks → this tier.
    Out,
    /// This tier → device blocks.
    In,
    /// Host tier slots (`src_slot..`) → this tier (a spill).
    Migrate,
}

#[derive(Debug)]
pub(crate) struct Job {
    pub ticket: u64,
    pub op: JobOp,
    /// First slot in this worker's tier.
    pub slot: u64,
    /// First host slot (Migrate).
    pub src_slot: u64,
    /// Index of the first block in the sequence's swap-out order (for error reports).
    pub index: u32,
    pub count: u32,
    pub blocks: [u32; JOB_BLOCKS_MAX],
    pub cancel: Arc<AtomicBool>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum JobFail {
    Cancelled,
    Checksum { index: u32 },
    Io { errno: i32 },
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Done {
    pub ticket: u64,
    pub bytes: u64,
    pub result: Result<(), JobFail>,
}

/// Per-slot checksums of one tier, written by its worker on store and read on load.
/// Ordering: a slot's entry is written before the worker pushes the job's `Done` (a Release
/// publish in the ring), and the engine issues the job reading it only after popping that
/// `Done` (Acquire) — the ring's publish/consume pair orders the Relaxed accesses.
pub(crate) type SumTable = Arc<[AtomicU64]>;

pub(crate) fn sum_table(slots: u64) -> SumTable {
    (0..slots).map(|_| AtomicU64::new(0)).collect::<Vec<_>>().into()
}

pub(crate) struct Worker {
    pub tier: Box<dyn TierIo>,
    pub device: Arc<dyn DeviceMemory>,
    pub host: Arc<HostTier>,
    pub sums: SumTable,
    pub host_sums: SumTable,
    pub mode: ChecksumMode,
    pub block_bytes: usize,
    pub jobs: Consumer<Job>,
    pub done: Producer<Done>,
}

struct Slot {
    job: Option<Job>,
    staging: Option<Staging>,
}

/// A 4 KiB-aligned host buffer for devices that are not host-addressable.
struct Staging {
    ptr: *mut u8,
    len: usize,
}

impl Staging {
    fn new(len: usize) -> Staging {
        let layout = std::alloc::Layout::from_size_align(len.max(4096), 4096).expect("layout");
        // SAFETY: non-zero size.
        let ptr = unsafe { std::alloc::alloc(layout) };
        assert!(!ptr.is_null(), "staging allocation failed");
        Staging { ptr, len: len.max(4096) }
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let layout = std::alloc::Layout::from_size_align(self.len, 4096).expect("layout");
        // SAFETY: allocated in `new` with this layout; the worker drops its slots only after
        // its tier has nothing in flight.
        unsafe { std::alloc::dealloc(self.ptr, layout) };
    }
}

impl Worker {
    pub fn run(mut self) {
        let depth = self.tier.depth().max(1) as usize;
        let hostable = self.device.block_ptr(BlockId(0)).is_some();
        let mut slots: Vec<Slot> = (0..depth)
            .map(|_| Slot {
                job: None,
                staging: (!hostable).then(|| Staging::new(JOB_BLOCKS_MAX * self.block_bytes)),
            })
            .collect();
        let mut free: Vec<usize> = (0..depth).rev().collect();
        let mut segs = [Segment { addr: std::ptr::null_mut(), len: 0 }; JOB_BLOCKS_MAX];
        let mut finished = [TierDone { tag: 0, result: Ok(()) }; 64];
        let mut carry: Option<Job> = None;
        loop {
            // Start jobs while there is room.
            while let Some(&si) = free.last() {
                let job = match carry.take().map_or_else(|| self.jobs.pop(), Ok) {
                    Ok(j) => j,
                    Err(_) => break,
                };
                if job.cancel.load(Ordering::Relaxed) {
                    self.finish(&job, Err(JobFail::Cancelled));
                    continue;
                }
                let staging = slots[si].staging.as_ref().map(|s| s.ptr);
                match self.start(si as u64, &job, staging, &mut segs) {
                    Started::Done(r) => self.finish(&job, r),
                    Started::InFlight => {
                        free.pop();
                        slots[si].job = Some(job);
                    }
                }
            }
            let n = self.tier.complete(&mut finished);
            for d in &finished[..n] {
                let si = d.tag as usize;
                let job = slots[si].job.take().expect("completion for an idle slot");
                free.push(si);
                let staging = slots[si].staging.as_ref().map(|s| s.ptr);
                let r = match d.result {
                    Ok(()) => self.after_io(&job, staging),
                    Err(errno) => Err(JobFail::Io { errno }),
                };
                self.finish(&job, r);
            }
            if n > 0 {
                continue;
            }
            if self.tier.in_flight() > 0 {
                self.tier.wait(Duration::from_millis(1));
            } else if self.jobs.is_empty() && carry.is_none() {
                // Bounded sleep on the ring (the engine's push wakes it).
                match self.jobs.pop_blocking(Some(Instant::now() + Duration::from_millis(20))) {
                    Ok(job) => carry = Some(job),
                    Err(PopError::Abandoned) => return,
                    Err(PopError::Empty) => {}
                }
            }
        }
    }

    fn finish(&mut self, job: &Job, result: Result<(), JobFail>) {
        let bytes = job.count as u64 * self.block_bytes as u64;
        let mut d = Done { ticket: job.ticket, bytes, result };
        // The engine keeps at most ring-capacity jobs outstanding per worker and the done
        // ring is as large, so this never loops; bounded anyway.
        for _ in 0..1_000_000 {
            match self.done.push(d) {
                Ok(()) => return,
                Err(e) => {
                    d = e.into_inner();
                    if self.done.is_abandoned() {
                        return;
                    }
                    std::thread::yield_now();
                }
            }
        }
        log::error!("kvswap worker: done ring stayed full; dropping completion");
    }

    fn block_ptr(&self, b: u32) -> Option<*mut u8> {
        self.device.block_ptr(BlockId(b))
    }

    #[allow(clippy::needless_range_loop)]
    fn start(
        &mut self,
        tag: u64,
        job: &Job,
        staging: Option<*mut u8>,
        segs: &mut [Segment],
    ) -> Started {
        let bb = self.block_bytes;
        let n = job.count as usize;
        let offset = job.slot * bb as u64;
        if let Some(tier_base) = self.tier.host_ptr(offset) {
            // Host tier: the worker copies, fused with the checksum.
            for i in 0..n {
                // SAFETY: slot job.slot+i is allocated to this job by the engine, inside the
                // host mapping that `self.host` keeps alive.
                let t = unsafe { tier_base.add(i * bb) };
                let b = job.blocks[i];
                let slot = job.slot as usize + i;
                let r = match job.op {
                    JobOp::Out => self.copy_out(b, t, slot),
                    JobOp::In => self.copy_in(b, t, slot, job.index + i as u32),
                    JobOp::Migrate => Err(JobFail::Io { errno: libc::EINVAL }),
                };
                if r.is_err() {
                    return Started::Done(r);
                }
            }
            return Started::Done(Ok(()));
        }
        // An I/O tier: build segments (straight into device memory when it is host-addressable).
        for i in 0..n {
            let addr = match job.op {
                JobOp::Migrate => {
                    let hs = job.src_slot as usize + i;
                    // SAFETY: host slot hs belongs to the migrating sequence, inside the mapping.
                    let p = unsafe { self.host.base().add(hs * bb) };
                    if self.mode != ChecksumMode::Off {
                        // SAFETY: the slot is not written while its sequence migrates (the
                        // engine refuses swap-in and gives the slot away only after Done).
                        let data = unsafe { std::slice::from_raw_parts(p, bb) };
                        if checksum(self.mode, data) != self.host_sums[hs].load(Ordering::Relaxed) {
                            return Started::Done(Err(JobFail::Checksum {
                                index: job.index + i as u32,
                            }));
                        }
                    }
                    let v = self.host_sums[hs].load(Ordering::Relaxed);
                    self.sums[job.slot as usize + i].store(v, Ordering::Relaxed);
                    p
                }
                JobOp::Out | JobOp::In => match (self.block_ptr(job.blocks[i]), staging) {
                    (Some(p), _) => p,
                    // SAFETY: the staging buffer holds JOB_BLOCKS_MAX blocks.
                    (None, Some(s)) => unsafe { s.add(i * bb) },
                    (None, None) => return Started::Done(Err(JobFail::Io { errno: libc::EINVAL })),
                },
            };
            if job.op == JobOp::Out && self.block_ptr(job.blocks[i]).is_none() {
                // SAFETY: the block is pinned by the engine until this job's Done; addr is
                // this slot's staging buffer.
                if unsafe { self.device.read_block(BlockId(job.blocks[i]), addr) }.is_err() {
                    return Started::Done(Err(JobFail::Io { errno: libc::EIO }));
                }
            }
            segs[i] = Segment { addr, len: bb as u32 };
        }
        // Every segment is a pinned device block, this slot's staging buffer, or host slots
        // owned by the migrating sequence; the engine keeps them (Arcs on the device and host
        // memory, pins, slot ownership) until this job's Done, which is pushed only after the
        // tier returned the completion with this tag.
        let r = match job.op {
            // SAFETY: see above; store only reads the segments.
            JobOp::Out | JobOp::Migrate => unsafe { self.tier.store(tag, offset, &segs[..n]) },
            // SAFETY: see above; nobody else touches the pinned destination blocks.
            JobOp::In => unsafe { self.tier.load(tag, offset, &segs[..n]) },
        };
        if let Err(d) = r {
            return Started::Done(Err(JobFail::Io { errno: d.result.err().unwrap_or(-1) }));
        }
        if job.op == JobOp::Out && self.mode != ChecksumMode::Off {
            // Checksums of a store are taken while the device writes: the source does not
            // change until Done (pinned device block or this slot's staging buffer), and Done
            // is pushed only after this loop, so the sums are in place before anyone loads.
            for (i, s) in segs[..n].iter().enumerate() {
                // SAFETY: the segment stays valid and unwritten until this job's Done (above).
                let data = unsafe { std::slice::from_raw_parts(s.addr as *const u8, bb) };
                self.sums[job.slot as usize + i]
                    .store(checksum(self.mode, data), Ordering::Relaxed);
            }
        }
        Started::InFlight
    }

    fn after_io(&mut self, job: &Job, staging: Option<*mut u8>) -> Result<(), JobFail> {
        if job.op != JobOp::In {
            return Ok(());
        }
        let bb = self.block_bytes;
        for i in 0..job.count as usize {
            let b = job.blocks[i];
            let addr = match (self.block_ptr(b), staging) {
                (Some(p), _) => p,
                // SAFETY: inside the staging buffer.
                (None, Some(s)) => unsafe { s.add(i * bb) },
                (None, None) => return Err(JobFail::Io { errno: libc::EINVAL }),
            };
            if self.mode != ChecksumMode::Off {
                // SAFETY: the read completed; the block is pinned for this job (or the staging
                // buffer is this slot's).
                let data = unsafe { std::slice::from_raw_parts(addr, bb) };
                if checksum(self.mode, data)
                    != self.sums[job.slot as usize + i].load(Ordering::Relaxed)
                {
                    return Err(JobFail::Checksum { index: job.index + i as u32 });
                }
            }
            if self.block_ptr(b).is_none() {
                // SAFETY: the destination block is pinned for this job; addr is staging.
                if unsafe { self.device.write_block(BlockId(b), addr) }.is_err() {
                    return Err(JobFail::Io { errno: libc::EIO });
                }
            }
        }
        Ok(())
    }

    fn copy_out(&mut self, b: u32, t: *mut u8, slot: usize) -> Result<(), JobFail> {
        let bb = self.block_bytes;
        let sum = match self.block_ptr(b) {
            // SAFETY: the device block is pinned by the engine (nobody frees or writes it) and
            // the host slot is this job's until Done; both are bb bytes and distinct memory.
            Some(src) => unsafe { copy_checksum(self.mode, src, t, bb) },
            None => {
                // SAFETY: as above; t is bb writable bytes.
                unsafe { self.device.read_block(BlockId(b), t) }
                    .map_err(|_| JobFail::Io { errno: libc::EIO })?;
                // SAFETY: just written, owned by this job.
                checksum(self.mode, unsafe { std::slice::from_raw_parts(t, bb) })
            }
        };
        self.sums[slot].store(sum, Ordering::Relaxed);
        Ok(())
    }

    fn copy_in(&mut self, b: u32, t: *mut u8, slot: usize, index: u32) -> Result<(), JobFail> {
        let bb = self.block_bytes;
        let sum = match self.block_ptr(b) {
            // SAFETY: the destination block is pinned for this job; the host slot holds this
            // sequence's copy and nobody writes it while the swap-in runs.
            Some(dst) => unsafe { copy_checksum(self.mode, t, dst, bb) },
            None => {
                // SAFETY: as above.
                unsafe { self.device.write_block(BlockId(b), t) }
                    .map_err(|_| JobFail::Io { errno: libc::EIO })?;
                // SAFETY: host slot readable, unchanged during the swap-in.
                checksum(self.mode, unsafe { std::slice::from_raw_parts(t, bb) })
            }
        };
        if self.mode != ChecksumMode::Off && sum != self.sums[slot].load(Ordering::Relaxed) {
            return Err(JobFail::Checksum { index });
        }
        Ok(())
    }
}

enum Started {
    Done(Result<(), JobFail>),
    InFlight,
}
