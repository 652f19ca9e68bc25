//! The swap engine: placement, accounting, tickets, and the worker threads.
//!
//! This module holds the [`SwapEngine`] itself, its public API and the per-sequence and
//! per-ticket state; the steps of a transfer live one per file:
//! - `config`: [`EngineConfig`], [`SpillPolicy`], the remote tier's pool, custom tiers;
//! - `placement`: which tier a swap-out lands in, spills that make room, releasing slots;
//! - `jobs`: cutting extents into worker jobs and feeding the worker rings;
//! - `completion`: draining the done rings, finishing tickets, reporting results;
//! - `stats`: [`EngineStats`] and [`TierStats`].

mod completion;
mod config;
mod jobs;
mod placement;
mod stats;

pub use config::{CustomTiers, EngineConfig, RemoteTierConfig, SpillPolicy, CHUNK_BYTES_MIN};
pub use stats::{EngineStats, TierStats};

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fastlane_ring::spsc::{self, Consumer, Producer};
use fastlane_ring::WaitStrategy;

use crate::device::{DeviceAllocator, DeviceMemory};
use crate::error::KvSwapError;
use crate::tier::{HostTier, HostTierIo, NvmeTierIo, RemoteTierIo, SlotSpace, TierIo, TierKind};
use crate::worker::{sum_table, Done, Job, JobOp, Worker, JOB_BLOCKS_MAX};
use crate::{BlockId, SeqId, TenantId, Ticket};

/// A finished transfer, as `poll` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TicketDone {
    /// The ticket.
    pub ticket: Ticket,
    /// Its sequence.
    pub seq: SeqId,
    /// Swap-out or swap-in.
    pub kind: TransferKind,
    /// The outcome. On error nothing was lost: a failed swap-out leaves the sequence
    /// resident (its device blocks hold the data), a failed swap-in leaves the tier copy.
    pub result: Result<(), KvSwapError>,
}

/// Direction of a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferKind {
    /// Device → tier.
    SwapOut,
    /// Tier → device.
    SwapIn,
}

/// Where a sequence is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqPhase {
    /// Its KV lives in device blocks only.
    Resident,
    /// Being copied out.
    SwappingOut,
    /// Swapped out to `tier`.
    Out(TierKind),
    /// Its host copy is being spilled to a lower tier.
    Spilling,
    /// Being copied back in.
    SwappingIn,
}

/// What `lookup` tells about a sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqInfo {
    /// Its tenant.
    pub tenant: TenantId,
    /// Where it is.
    pub phase: SeqPhase,
    /// Blocks in its swapped-out copy (0 when none).
    pub blocks_out: u32,
    /// Device blocks it owns.
    pub device_blocks: u32,
}

#[derive(Debug)]
struct Placement {
    tier: TierKind,
    extents: Vec<(u64, u64)>,
}

impl Placement {
    fn slots(&self) -> u64 {
        self.extents.iter().map(|e| e.1).sum()
    }
}

#[derive(Debug)]
struct Seq {
    tenant: TenantId,
    phase: SeqPhase,
    copy: Option<Placement>,
    blocks_out: u32,
    last_use: u64,
    dropped: bool,
    active: Option<u64>,
}

#[derive(Debug, PartialEq, Eq, Clone, Copy)]
enum Kind {
    Out,
    In,
    Spill { parent: u64 },
}

#[derive(Debug)]
struct TicketState {
    seq: SeqId,
    kind: Kind,
    jobs_left: u32,
    failed: Option<KvSwapError>,
    cancel: Arc<AtomicBool>,
    pinned: Vec<BlockId>,
    /// Out: the slots this ticket owns so far; Spill: the spill-tier slots.
    target: Option<Placement>,
    /// Out: jobs held until a spill frees their host slots, per spill ticket, with the
    /// host extents they take from the victim.
    held: Vec<Held>,
    bytes: u64,
}

/// A spill ticket, the host extents its victim hands over, and the jobs waiting for them.
type Held = (u64, Vec<(u64, u64)>, Vec<Job>);

struct WorkerHandle {
    jobs: Producer<Job>,
    done: Consumer<Done>,
    thread: Option<JoinHandle<()>>,
    outstanding: usize,
    pending: VecDeque<Job>,
    space: SlotSpace,
    capacity: usize,
    locked: bool,
}

/// The KV swap engine. See the crate docs for the model; every method is non-blocking
/// except [`SwapEngine::wait`], which is bounded by its timeout.
pub struct SwapEngine {
    device: Arc<dyn DeviceMemory>,
    alloc: DeviceAllocator,
    block_bytes: usize,
    job_blocks: usize,
    spill: SpillPolicy,
    workers: [Option<WorkerHandle>; 3],
    seqs: HashMap<SeqId, Seq>,
    tickets: HashMap<u64, TicketState>,
    results: HashMap<u64, TicketDone>,
    finished: VecDeque<u64>,
    quotas: HashMap<TenantId, u64>,
    tenant_bytes: HashMap<TenantId, u64>,
    next_ticket: u64,
    clock: u64,
    stats: EngineStats,
    _host: Arc<HostTier>,
}

impl std::fmt::Debug for SwapEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SwapEngine")
            .field("block_bytes", &self.block_bytes)
            .field("seqs", &self.seqs.len())
            .field("tickets", &self.tickets.len())
            .finish()
    }
}

impl SwapEngine {
    /// Builds the engine: maps and locks the host tier, opens the NVMe file (O_DIRECT) and
    /// connects to the remote pool as configured, and starts one worker thread per tier.
    pub fn new(
        config: EngineConfig,
        device: Arc<dyn DeviceMemory>,
    ) -> Result<SwapEngine, KvSwapError> {
        let nvme: Option<Box<dyn TierIo>> = match &config.nvme {
            Some(c) => Some(Box::new(NvmeTierIo::open(c)?)),
            None => None,
        };
        let remote: Option<Box<dyn TierIo>> = match &config.remote {
            Some(c) => Some(Box::new(RemoteTierIo::connect(&c.device, c.addr, c.bytes)?)),
            None => None,
        };
        SwapEngine::with_tiers(config, device, CustomTiers { nvme, remote })
    }

    /// Like [`SwapEngine::new`] with caller-built NVMe/remote tiers (`config.nvme` and
    /// `config.remote` are ignored).
    pub fn with_tiers(
        config: EngineConfig,
        device: Arc<dyn DeviceMemory>,
        tiers: CustomTiers,
    ) -> Result<SwapEngine, KvSwapError> {
        let block_bytes = device.block_bytes();
        if block_bytes == 0 || !block_bytes.is_multiple_of(4096) || block_bytes > u32::MAX as usize
        {
            return Err(KvSwapError::BadConfig { detail: format!("block size {block_bytes}") });
        }
        if config.ring_capacity < 2 {
            return Err(KvSwapError::BadConfig { detail: "ring_capacity < 2".into() });
        }
        let chunk = config.chunk_bytes.max(CHUNK_BYTES_MIN);
        let job_blocks = chunk.div_ceil(block_bytes).clamp(1, JOB_BLOCKS_MAX);
        let host_slots = config.host_bytes / block_bytes as u64;
        let host = Arc::new(HostTier::new((host_slots * block_bytes as u64) as usize)?);
        let host_sums = sum_table(host_slots);
        let mut engine = SwapEngine {
            alloc: DeviceAllocator::new(device.blocks()),
            device: device.clone(),
            block_bytes,
            job_blocks,
            spill: config.spill,
            workers: [None, None, None],
            seqs: HashMap::new(),
            tickets: HashMap::new(),
            results: HashMap::new(),
            finished: VecDeque::new(),
            quotas: HashMap::new(),
            tenant_bytes: HashMap::new(),
            next_ticket: 1,
            clock: 0,
            stats: EngineStats::default(),
            _host: host.clone(),
        };
        let mut ios: Vec<Box<dyn TierIo>> = Vec::new();
        if host_slots > 0 {
            ios.push(Box::new(HostTierIo { tier: host.clone() }));
        }
        ios.extend(tiers.nvme);
        ios.extend(tiers.remote);
        for io in ios {
            let kind = io.kind();
            let slots = if kind == TierKind::Host {
                host_slots
            } else {
                io.capacity_bytes() / block_bytes as u64
            };
            let sums = if kind == TierKind::Host { host_sums.clone() } else { sum_table(slots) };
            let cap = config.ring_capacity;
            let (jp, jc) = spsc::channel_with::<Job>(
                cap,
                WaitStrategy::SpinYieldPark { spins: 64, yields: 16 },
            );
            let (dp, dc) = spsc::channel_with::<Done>(
                cap * 2,
                WaitStrategy::SpinYieldPark { spins: 64, yields: 16 },
            );
            let locked = io.locked();
            let worker = Worker {
                tier: io,
                device: device.clone(),
                host: host.clone(),
                sums: sums.clone(),
                host_sums: host_sums.clone(),
                mode: config.checksum,
                block_bytes,
                jobs: jc,
                done: dp,
            };
            let thread = std::thread::Builder::new()
                .name(format!("kvswap-{kind:?}").to_lowercase())
                .spawn(move || worker.run())
                .map_err(|e| KvSwapError::setup("spawn worker", e))?;
            engine.workers[kind.index()] = Some(WorkerHandle {
                jobs: jp,
                done: dc,
                thread: Some(thread),
                outstanding: 0,
                pending: VecDeque::new(),
                space: SlotSpace::new(slots),
                capacity: cap,
                locked,
            });
        }
        Ok(engine)
    }

    /// Bytes per device block.
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// The device memory.
    pub fn device(&self) -> &Arc<dyn DeviceMemory> {
        &self.device
    }

    /// Registers `seq` under `tenant` (sequences are created on first `alloc_blocks` under
    /// tenant 0 otherwise). Refused with `Busy` while it has a copy or a transfer.
    pub fn register_seq(&mut self, seq: SeqId, tenant: TenantId) -> Result<(), KvSwapError> {
        let clock = self.tick();
        let s = self.seqs.entry(seq).or_insert_with(|| Seq::new(tenant, clock));
        if s.copy.is_some() || s.active.is_some() {
            return Err(KvSwapError::Busy { seq });
        }
        s.tenant = tenant;
        Ok(())
    }

    /// Caps the swapped-out bytes `tenant` may hold across tiers (`None`: no cap).
    pub fn set_quota(&mut self, tenant: TenantId, quota_bytes: Option<u64>) {
        match quota_bytes {
            Some(q) => self.quotas.insert(tenant, q),
            None => self.quotas.remove(&tenant),
        };
    }

    /// Hands `n` free device blocks to `seq` (creating it under tenant 0 if new). All or
    /// nothing. Blocks pinned by an in-flight transfer are never among them.
    pub fn alloc_blocks(&mut self, seq: SeqId, n: u32) -> Result<Vec<BlockId>, KvSwapError> {
        let mut out = Vec::with_capacity(n as usize);
        self.alloc_blocks_into(seq, n, &mut out)?;
        Ok(out)
    }

    /// [`SwapEngine::alloc_blocks`] into a caller's vector.
    pub fn alloc_blocks_into(
        &mut self,
        seq: SeqId,
        n: u32,
        out: &mut Vec<BlockId>,
    ) -> Result<(), KvSwapError> {
        let clock = self.tick();
        if self.seqs.get(&seq).is_some_and(|s| s.dropped) {
            return Err(KvSwapError::UnknownSequence { seq });
        }
        self.alloc.alloc(seq, n, out)?;
        self.seqs.entry(seq).or_insert_with(|| Seq::new(TenantId(0), clock));
        Ok(())
    }

    /// [`SwapEngine::alloc_blocks`] restricted to the block ids in `range` (a client's slab
    /// of the device pool: `fastlane kv serve` gives each connection its own).
    pub fn alloc_blocks_in(
        &mut self,
        seq: SeqId,
        n: u32,
        range: std::ops::Range<u32>,
    ) -> Result<Vec<BlockId>, KvSwapError> {
        let clock = self.tick();
        if self.seqs.get(&seq).is_some_and(|s| s.dropped) {
            return Err(KvSwapError::UnknownSequence { seq });
        }
        let mut out = Vec::with_capacity(n as usize);
        self.alloc.alloc_in(seq, n, range, &mut out)?;
        self.seqs.entry(seq).or_insert_with(|| Seq::new(TenantId(0), clock));
        Ok(out)
    }

    /// Processes the completions the workers have posted (results stay for `poll`/`wait`),
    /// then says whether every block in `range` is free and unpinned: no sequence owns one
    /// and no transfer reads or writes one.
    pub fn range_idle(&mut self, range: std::ops::Range<u32>) -> bool {
        self.poll_workers();
        self.alloc.range_idle(range)
    }

    /// The sequence that holds device block `block` (`None`: free, or outside the pool).
    pub fn block_owner(&self, block: BlockId) -> Option<SeqId> {
        self.alloc.owner(block)
    }

    /// Processes the completions the workers have posted (results stay for `poll`/`wait`),
    /// then returns the first of `blocks` that a transfer in flight still reads or writes.
    pub fn first_pinned(&mut self, blocks: &[BlockId]) -> Option<BlockId> {
        self.poll_workers();
        blocks.iter().copied().find(|b| self.alloc.is_pinned(*b))
    }

    /// Hands the named free device blocks to `seq` (creating it under tenant 0 if new), for
    /// an owner whose own block manager decides which blocks a sequence holds (the inference
    /// engine's scheduler): it adopts a sequence's blocks for one transfer and frees them in
    /// the engine when the ticket is done. All or nothing.
    pub fn adopt_blocks(&mut self, seq: SeqId, blocks: &[BlockId]) -> Result<(), KvSwapError> {
        let clock = self.tick();
        if self.seqs.get(&seq).is_some_and(|s| s.dropped) {
            return Err(KvSwapError::UnknownSequence { seq });
        }
        self.alloc.adopt(seq, blocks)?;
        self.seqs.entry(seq).or_insert_with(|| Seq::new(TenantId(0), clock));
        Ok(())
    }

    /// Gives device blocks of `seq` back to the pool. Refused (nothing freed) with
    /// `BlockPinned` while a transfer reads or writes one of them, and with `BlockNotOwned`
    /// for a block that is not `seq`'s.
    pub fn free_blocks(&mut self, seq: SeqId, blocks: &[BlockId]) -> Result<(), KvSwapError> {
        self.alloc.free(seq, blocks)
    }

    /// Marks `seq` as just used (it becomes the last choice for spilling).
    pub fn touch(&mut self, seq: SeqId) -> Result<(), KvSwapError> {
        let c = self.tick();
        let s = self.seq_mut(seq)?;
        s.last_use = c;
        Ok(())
    }

    /// Where `seq` is, or `None` if unknown.
    pub fn lookup(&self, seq: SeqId) -> Option<SeqInfo> {
        let s = self.seqs.get(&seq).filter(|s| !s.dropped)?;
        let device_blocks = (0..self.alloc.total())
            .filter(|b| self.alloc.owner(BlockId(*b)) == Some(seq))
            .count() as u32;
        Some(SeqInfo { tenant: s.tenant, phase: s.phase, blocks_out: s.blocks_out, device_blocks })
    }

    /// Starts copying `blocks` (in this order) of `seq` out of the device. The blocks stay
    /// `seq`'s and are pinned until the ticket finishes; free them after a successful
    /// swap-out to make room. Lands in the host tier; when it is full, the least recently
    /// used swapped-out sequences spill to the NVMe or remote tier as the policy says; when
    /// that is not possible either, straight to a spill tier, else `TierFull`.
    pub fn swap_out(&mut self, seq: SeqId, blocks: &[BlockId]) -> Result<Ticket, KvSwapError> {
        self.poll_workers();
        let clock = self.tick();
        let s = self.seq_ref(seq)?;
        match s.phase {
            SeqPhase::Resident => {}
            SeqPhase::Out(_) | SeqPhase::SwappingOut => {
                return Err(KvSwapError::DoubleSwapOut { seq })
            }
            SeqPhase::Spilling => return Err(KvSwapError::DoubleSwapOut { seq }),
            SeqPhase::SwappingIn => return Err(KvSwapError::Busy { seq }),
        }
        let tenant = s.tenant;
        self.alloc.check_owned(seq, blocks)?;
        let n = blocks.len() as u64;
        let bytes = n * self.block_bytes as u64;
        let used = self.tenant_bytes.get(&tenant).copied().unwrap_or(0);
        if let Some(&q) = self.quotas.get(&tenant) {
            if used + bytes > q {
                return Err(KvSwapError::QuotaExceeded {
                    tenant,
                    used_bytes: used,
                    needed_bytes: bytes,
                    quota_bytes: q,
                });
            }
        }
        let ticket = self.new_ticket();
        let cancel = Arc::new(AtomicBool::new(false));
        let (tier, own, spills) = self.place(seq, n, &cancel)?;
        // Build jobs over own extents first, then the victims' slots.
        let mut state = TicketState {
            seq,
            kind: Kind::Out,
            jobs_left: 0,
            failed: None,
            cancel: cancel.clone(),
            pinned: blocks.to_vec(),
            target: Some(Placement { tier, extents: own.clone() }),
            held: Vec::new(),
            bytes,
        };
        let mut idx = 0usize;
        let mut now = Vec::new();
        self.build_extent_jobs(ticket, JobOp::Out, &own, blocks, &mut idx, &cancel, &mut now);
        for (spill_ticket, victim_extents) in spills {
            let mut jobs = Vec::new();
            self.build_extent_jobs(
                ticket,
                JobOp::Out,
                &victim_extents,
                blocks,
                &mut idx,
                &cancel,
                &mut jobs,
            );
            state.jobs_left += jobs.len() as u32;
            self.tickets.get_mut(&spill_ticket).expect("spill ticket").kind =
                Kind::Spill { parent: ticket };
            state.held.push((spill_ticket, victim_extents, jobs));
        }
        debug_assert_eq!(idx, blocks.len());
        state.jobs_left += now.len() as u32;
        self.alloc.pin(blocks);
        *self.tenant_bytes.entry(tenant).or_insert(0) += bytes;
        let s = self.seqs.get_mut(&seq).expect("checked");
        s.phase = SeqPhase::SwappingOut;
        s.active = Some(ticket);
        s.blocks_out = n as u32;
        s.last_use = clock;
        self.tickets.insert(ticket, state);
        for j in now {
            self.push_job(tier, j);
        }
        self.maybe_finish(ticket);
        Ok(Ticket(ticket))
    }

    /// Starts copying `seq`'s swapped-out copy into `blocks` (owned by `seq`, as many as were
    /// swapped out, in the same order). The blocks are pinned until the ticket finishes; the
    /// tier copy is released on success and kept on failure.
    pub fn swap_in(&mut self, seq: SeqId, blocks: &[BlockId]) -> Result<Ticket, KvSwapError> {
        self.poll_workers();
        let clock = self.tick();
        let s = self.seq_ref(seq)?;
        let tier = match s.phase {
            SeqPhase::Out(t) => t,
            SeqPhase::Resident => return Err(KvSwapError::NotSwappedOut { seq }),
            SeqPhase::SwappingOut | SeqPhase::SwappingIn | SeqPhase::Spilling => {
                return Err(KvSwapError::Busy { seq })
            }
        };
        if blocks.len() as u32 != s.blocks_out {
            return Err(KvSwapError::BlockCountMismatch {
                seq,
                expected: s.blocks_out,
                got: blocks.len() as u32,
            });
        }
        self.alloc.check_owned(seq, blocks)?;
        if let Some(b) = blocks.iter().find(|b| self.alloc.is_pinned(**b)) {
            return Err(KvSwapError::BlockPinned { block: *b, seq });
        }
        let extents = s.copy.as_ref().expect("Out has a copy").extents.clone();
        let ticket = self.new_ticket();
        let cancel = Arc::new(AtomicBool::new(false));
        let mut jobs = Vec::new();
        let mut idx = 0usize;
        self.build_extent_jobs(ticket, JobOp::In, &extents, blocks, &mut idx, &cancel, &mut jobs);
        self.alloc.pin(blocks);
        let s = self.seqs.get_mut(&seq).expect("checked");
        s.phase = SeqPhase::SwappingIn;
        s.active = Some(ticket);
        s.last_use = clock;
        let bytes = blocks.len() as u64 * self.block_bytes as u64;
        self.tickets.insert(
            ticket,
            TicketState {
                seq,
                kind: Kind::In,
                jobs_left: jobs.len() as u32,
                failed: None,
                cancel,
                pinned: blocks.to_vec(),
                target: None,
                held: Vec::new(),
                bytes,
            },
        );
        for j in jobs {
            self.push_job(tier, j);
        }
        self.maybe_finish(ticket);
        Ok(Ticket(ticket))
    }

    /// Drains worker completions and appends every user ticket that finished to `out`.
    /// Each ticket's result is delivered once: here or by [`SwapEngine::wait`].
    pub fn poll(&mut self, out: &mut Vec<TicketDone>) -> usize {
        self.poll_workers();
        let mut n = 0;
        while let Some(t) = self.finished.pop_front() {
            if let Some(d) = self.results.remove(&t) {
                out.push(d);
                n += 1;
            }
        }
        n
    }

    /// Waits (bounded by `timeout`) for `ticket` and returns its result. `Timeout` leaves
    /// the transfer running; call again or `cancel`.
    pub fn wait(&mut self, ticket: Ticket, timeout: Duration) -> Result<(), KvSwapError> {
        let deadline = Instant::now() + timeout;
        let mut spins = 0u32;
        loop {
            self.poll_workers();
            if let Some(d) = self.results.remove(&ticket.0) {
                self.finished.retain(|t| *t != ticket.0);
                return d.result;
            }
            if !self.tickets.contains_key(&ticket.0) {
                return Err(KvSwapError::UnknownTicket { ticket: ticket.0 });
            }
            if Instant::now() >= deadline {
                return Err(KvSwapError::Timeout { ticket: ticket.0 });
            }
            spins += 1;
            if spins < 2000 {
                std::hint::spin_loop();
            } else if spins < 2200 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }

    /// Cancels a transfer: jobs not started are skipped, and the ticket finishes with
    /// `Cancelled` once the started ones drain (swap-out: the sequence stays resident;
    /// swap-in: the tier copy stays). A ticket that already finished keeps its result.
    pub fn cancel(&mut self, ticket: Ticket) -> Result<(), KvSwapError> {
        if self.results.contains_key(&ticket.0) {
            return Ok(());
        }
        let st = self
            .tickets
            .get_mut(&ticket.0)
            .ok_or(KvSwapError::UnknownTicket { ticket: ticket.0 })?;
        if matches!(st.kind, Kind::Spill { .. }) {
            return Err(KvSwapError::UnknownTicket { ticket: ticket.0 });
        }
        st.cancel.store(true, Ordering::Relaxed);
        st.failed.get_or_insert(KvSwapError::Cancelled);
        self.drop_held(ticket.0);
        self.maybe_finish(ticket.0);
        Ok(())
    }

    /// Forgets `seq`: cancels its transfer, releases its tier copy and frees its device
    /// blocks (blocks pinned by a transfer are freed when that transfer drains).
    pub fn drop_seq(&mut self, seq: SeqId) -> Result<(), KvSwapError> {
        self.seq_ref(seq)?;
        let s = self.seqs.get_mut(&seq).expect("checked");
        s.dropped = true;
        if let Some(t) = s.active {
            if let Some(st) = self.tickets.get_mut(&t) {
                if !matches!(st.kind, Kind::Spill { .. }) {
                    st.cancel.store(true, Ordering::Relaxed);
                    st.failed.get_or_insert(KvSwapError::Cancelled);
                    self.drop_held(t);
                    self.maybe_finish(t);
                }
            }
        }
        self.reap(seq);
        Ok(())
    }

    /// Transfers (user and internal spills) not finished.
    pub fn in_flight(&self) -> usize {
        self.tickets.len()
    }

    // ---- internals ----

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn new_ticket(&mut self) -> u64 {
        let t = self.next_ticket;
        self.next_ticket += 1;
        t
    }

    fn seq_ref(&self, seq: SeqId) -> Result<&Seq, KvSwapError> {
        self.seqs.get(&seq).filter(|s| !s.dropped).ok_or(KvSwapError::UnknownSequence { seq })
    }

    fn seq_mut(&mut self, seq: SeqId) -> Result<&mut Seq, KvSwapError> {
        self.seqs.get_mut(&seq).filter(|s| !s.dropped).ok_or(KvSwapError::UnknownSequence { seq })
    }
}

impl Seq {
    fn new(tenant: TenantId, clock: u64) -> Seq {
        Seq {
            tenant,
            phase: SeqPhase::Resident,
            copy: None,
            blocks_out: 0,
            last_use: clock,
            dropped: false,
            active: None,
        }
    }
}

impl Drop for SwapEngine {
    fn drop(&mut self) {
        // Closing the job rings lets each worker drain what it started and exit; joining
        // keeps the device and host memory (Arcs held here too) alive until then.
        for w in self.workers.iter_mut().flatten() {
            w.pending.clear();
            let (dead_p, _dead_c) = spsc::channel::<Job>(2);
            drop(std::mem::replace(&mut w.jobs, dead_p));
            if let Some(t) = w.thread.take() {
                let _ = t.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HostDeviceMemory;

    #[test]
    fn host_tier_checksum_catches_a_flipped_byte() {
        let bb = 64 * 1024;
        let dev = Arc::new(HostDeviceMemory::new(bb, 8).unwrap());
        let config = EngineConfig { host_bytes: 8 * bb as u64, ..EngineConfig::default() };
        let mut e = SwapEngine::new(config, dev.clone()).unwrap();
        let b = e.alloc_blocks(SeqId(1), 3).unwrap();
        let t = e.swap_out(SeqId(1), &b).unwrap();
        e.wait(t, Duration::from_secs(10)).unwrap();
        // The copy sits in host slots 0..3 (first fit); flip a byte of the second block.
        // SAFETY: the offset is inside the host tier mapping (8 blocks of `bb` bytes).
        let byte = unsafe { e._host.base().add(bb + 77) };
        // SAFETY: no transfer is in flight, so nothing else touches that byte now.
        unsafe { *byte ^= 0x40 };
        let t = e.swap_in(SeqId(1), &b).unwrap();
        let r = e.wait(t, Duration::from_secs(10));
        let want = KvSwapError::ChecksumMismatch { seq: SeqId(1), index: 1, tier: TierKind::Host };
        assert_eq!(r, Err(want));
        assert_eq!(e.lookup(SeqId(1)).unwrap().phase, SeqPhase::Out(TierKind::Host));
        assert_eq!(e.stats().checksum_failures, 1);
    }
}
