//! Swap tiers: host memory, NVMe (io_uring, O_DIRECT), remote memory (RDMA pool).
//!
//! Space in a tier is counted in *slots* of one device block each; the engine allocates
//! contiguous extents of slots ([`SlotSpace`]) on its control thread, so accounting is exact
//! and never races the data path. A tier's [`TierIo`] moves bytes and lives on its worker
//! thread.

use std::path::PathBuf;
use std::ptr::NonNull;
use std::time::Duration;

use fastlane_block::uring::{UringDevice, UringOptions};
use fastlane_block::{BlockDevice, BlockOp, BlockQueue, BlockRequest, Completion, Segment};
use memmap2::{MmapOptions, MmapRaw};

use crate::error::KvSwapError;

/// Which tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TierKind {
    /// Pre-allocated, page-locked host memory.
    Host,
    /// Extents of a file or block device, O_DIRECT through io_uring.
    Nvme,
    /// Ranges of a remote node's memory pool over RDMA.
    Remote,
}

impl TierKind {
    /// Index into per-tier arrays.
    pub fn index(self) -> usize {
        match self {
            TierKind::Host => 0,
            TierKind::Nvme => 1,
            TierKind::Remote => 2,
        }
    }
}

/// First-fit allocator of slots `[0, slots)`, free extents kept sorted and merged.
#[derive(Debug, Clone)]
pub struct SlotSpace {
    slots: u64,
    free: Vec<(u64, u64)>,
    free_slots: u64,
}

impl SlotSpace {
    /// All free.
    pub fn new(slots: u64) -> SlotSpace {
        let free = if slots > 0 { vec![(0, slots)] } else { Vec::new() };
        SlotSpace { slots, free, free_slots: slots }
    }

    /// Total slots.
    pub fn slots(&self) -> u64 {
        self.slots
    }

    /// Free slots.
    pub fn free_slots(&self) -> u64 {
        self.free_slots
    }

    /// Takes `n` slots as few extents as it can: one extent when a free one is big enough,
    /// otherwise the largest ones first. All or nothing.
    pub fn alloc(&mut self, n: u64, out: &mut Vec<(u64, u64)>) -> bool {
        if n == 0 {
            return true;
        }
        if n > self.free_slots {
            return false;
        }
        if let Some(i) = self.free.iter().position(|&(_, len)| len >= n) {
            let (start, len) = self.free[i];
            if len == n {
                self.free.remove(i);
            } else {
                self.free[i] = (start + n, len - n);
            }
            self.free_slots -= n;
            out.push((start, n));
            return true;
        }
        let mut left = n;
        while left > 0 {
            let (i, _) = self
                .free
                .iter()
                .enumerate()
                .max_by_key(|(_, e)| e.1)
                .expect("free_slots >= n means an extent is left");
            let (start, len) = self.free[i];
            let take = len.min(left);
            if take == len {
                self.free.remove(i);
            } else {
                self.free[i] = (start + take, len - take);
            }
            out.push((start, take));
            left -= take;
        }
        self.free_slots -= n;
        true
    }

    /// Gives an extent back.
    pub fn release(&mut self, start: u64, len: u64) {
        if len == 0 {
            return;
        }
        assert!(start + len <= self.slots, "release outside the tier");
        let i = self.free.partition_point(|e| e.0 < start);
        assert!(i == 0 || self.free[i - 1].0 + self.free[i - 1].1 <= start, "double release");
        assert!(i == self.free.len() || start + len <= self.free[i].0, "double release");
        self.free.insert(i, (start, len));
        if i + 1 < self.free.len() && self.free[i].0 + self.free[i].1 == self.free[i + 1].0 {
            self.free[i].1 += self.free[i + 1].1;
            self.free.remove(i + 1);
        }
        if i > 0 && self.free[i - 1].0 + self.free[i - 1].1 == self.free[i].0 {
            self.free[i - 1].1 += self.free[i].1;
            self.free.remove(i);
        }
        self.free_slots += len;
    }
}

/// A finished tier request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierDone {
    /// The tag it was submitted with.
    pub tag: u64,
    /// Its outcome (errno on failure, -1 when none).
    pub result: Result<(), i32>,
}

/// Byte mover of one tier, owned by its worker thread.
pub trait TierIo: Send {
    /// Which tier.
    fn kind(&self) -> TierKind;
    /// Bytes it can hold.
    fn capacity_bytes(&self) -> u64;
    /// Requests it can have in flight.
    fn depth(&self) -> u32;
    /// The host address of `offset` when the tier is host memory (copies are then done by
    /// the worker itself, fused with the checksum).
    fn host_ptr(&self, offset: u64) -> Option<*mut u8>;
    /// Starts writing the segments' bytes at `offset`.
    ///
    /// # Safety
    ///
    /// Every segment stays valid and unwritten by anyone else until the completion with
    /// `tag` has been returned by [`TierIo::complete`].
    unsafe fn store(&mut self, tag: u64, offset: u64, segs: &[Segment]) -> Result<(), TierDone>;
    /// Starts reading bytes at `offset` into the segments.
    ///
    /// # Safety
    ///
    /// Every segment stays valid and untouched by anyone else until the completion with
    /// `tag` has been returned by [`TierIo::complete`].
    unsafe fn load(&mut self, tag: u64, offset: u64, segs: &[Segment]) -> Result<(), TierDone>;
    /// Drains finished requests into `out`; returns how many.
    fn complete(&mut self, out: &mut [TierDone]) -> usize;
    /// Blocks until a request finishes or `timeout` passes.
    fn wait(&mut self, timeout: Duration);
    /// Requests in flight.
    fn in_flight(&self) -> u32;
    /// Whether mlock succeeded (host tier); true elsewhere.
    fn locked(&self) -> bool {
        true
    }
}

/// The host tier: one anonymous mapping, pre-faulted and (if allowed) mlock'd.
#[derive(Debug)]
pub struct HostTier {
    /// `None` for a zero-byte tier. Unmapped when the last `Arc` of the tier drops, after
    /// every worker exited: no copy names it then.
    map: Option<MmapRaw>,
    locked: bool,
}

// SAFETY: plain memory owned by the struct; which slots are touched when is decided by the
// engine's slot allocation and job ordering.
unsafe impl Send for HostTier {}
// SAFETY: as above (raw-pointer access only).
unsafe impl Sync for HostTier {}

impl HostTier {
    /// Maps and pre-faults `len` bytes, then tries to mlock them. An mlock refused by
    /// RLIMIT_MEMLOCK is logged and the tier runs unlocked ([`TierIo::locked`] says so).
    pub fn new(len: usize) -> Result<HostTier, KvSwapError> {
        if len == 0 {
            return Ok(HostTier { map: None, locked: true });
        }
        let map = MmapOptions::new()
            .len(len)
            .populate()
            .map_anon()
            .map_err(|e| KvSwapError::setup("mmap host tier", e))?;
        let map = MmapRaw::from(map);
        let locked = match map.lock() {
            Ok(()) => true,
            Err(e) => {
                log::warn!(
                    "kvswap: mlock of the {len}-byte host tier failed ({e}); running unlocked \
                     (raise RLIMIT_MEMLOCK)"
                );
                false
            }
        };
        Ok(HostTier { map: Some(map), locked })
    }

    /// Base address (shared read-only with the spill workers for migrations).
    pub fn base(&self) -> *mut u8 {
        self.map.as_ref().map_or(NonNull::dangling().as_ptr(), MmapRaw::as_mut_ptr)
    }

    /// Size in bytes.
    pub fn len_bytes(&self) -> usize {
        self.map.as_ref().map_or(0, MmapRaw::len)
    }

    /// Whether mlock succeeded.
    pub fn is_locked(&self) -> bool {
        self.locked
    }
}

/// The host tier's worker handle (copies are done by the worker; this only answers where).
#[derive(Debug)]
pub struct HostTierIo {
    pub(crate) tier: std::sync::Arc<HostTier>,
}

impl TierIo for HostTierIo {
    fn kind(&self) -> TierKind {
        TierKind::Host
    }
    fn capacity_bytes(&self) -> u64 {
        self.tier.len_bytes() as u64
    }
    fn depth(&self) -> u32 {
        1
    }
    fn host_ptr(&self, offset: u64) -> Option<*mut u8> {
        // SAFETY: callers only ask for offsets of allocated slots, inside the mapping.
        ((offset as usize) < self.tier.len_bytes())
            .then(|| unsafe { self.tier.base().add(offset as usize) })
    }
    unsafe fn store(&mut self, tag: u64, _: u64, _: &[Segment]) -> Result<(), TierDone> {
        Err(TierDone { tag, result: Err(-1) })
    }
    unsafe fn load(&mut self, tag: u64, _: u64, _: &[Segment]) -> Result<(), TierDone> {
        Err(TierDone { tag, result: Err(-1) })
    }
    fn complete(&mut self, _: &mut [TierDone]) -> usize {
        0
    }
    fn wait(&mut self, _: Duration) {}
    fn in_flight(&self) -> u32 {
        0
    }
    fn locked(&self) -> bool {
        self.tier.locked
    }
}

/// Where the NVMe tier lives.
#[derive(Debug, Clone)]
pub struct NvmeTierConfig {
    /// A file (created and sized to `bytes` if it is a regular file) or a block device.
    pub path: PathBuf,
    /// Bytes to use from the start of the file/device.
    pub bytes: u64,
    /// io_uring queue depth.
    pub depth: u32,
}

/// The NVMe tier: an io_uring queue on the file/device, opened with O_DIRECT.
pub struct NvmeTierIo {
    _dev: UringDevice,
    queue: Box<dyn BlockQueue>,
    bytes: u64,
    depth: u32,
    max_segments: usize,
    done: [Completion; 64],
}

impl std::fmt::Debug for NvmeTierIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmeTierIo").field("bytes", &self.bytes).finish()
    }
}

impl NvmeTierIo {
    /// Opens (and for a regular file, creates and sizes) the tier's backing store.
    pub fn open(cfg: &NvmeTierConfig) -> Result<NvmeTierIo, KvSwapError> {
        let is_blockdev = std::fs::metadata(&cfg.path)
            .map(|m| std::os::unix::fs::FileTypeExt::is_block_device(&m.file_type()))
            .unwrap_or(false);
        if !is_blockdev {
            let f = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .read(true)
                .write(true)
                .open(&cfg.path)
                .map_err(|e| KvSwapError::setup("open nvme tier file", e))?;
            if f.metadata().map(|m| m.len()).unwrap_or(0) < cfg.bytes {
                f.set_len(cfg.bytes).map_err(|e| KvSwapError::setup("size nvme tier file", e))?;
            }
        }
        let opts = UringOptions { direct: true, read_only: false, max_segments: 256 };
        let dev = UringDevice::open(&cfg.path, opts)
            .map_err(|e| KvSwapError::setup("open nvme tier (O_DIRECT)", e))?;
        let info = dev.info();
        if info.size_bytes < cfg.bytes {
            return Err(KvSwapError::BadConfig {
                detail: format!(
                    "nvme tier {:?} has {} bytes, {} asked",
                    cfg.path, info.size_bytes, cfg.bytes
                ),
            });
        }
        let depth = cfg.depth.clamp(1, 256);
        let queue = dev.open_queue(depth).map_err(|e| KvSwapError::setup("io_uring queue", e))?;
        Ok(NvmeTierIo {
            _dev: dev,
            queue,
            bytes: cfg.bytes,
            depth,
            max_segments: info.max_segments as usize,
            done: [Completion::EMPTY; 64],
        })
    }

    unsafe fn submit(
        &mut self,
        op: BlockOp,
        tag: u64,
        offset: u64,
        segs: &[Segment],
    ) -> Result<(), TierDone> {
        if segs.len() > self.max_segments {
            return Err(TierDone { tag, result: Err(libc::EINVAL) });
        }
        let req = BlockRequest { op, offset, len: 0, segments: segs, tag };
        // SAFETY: forwarded from the caller's contract (segments live and exclusive until
        // this tag's completion is drained in `complete`).
        match unsafe { self.queue.submit(req) } {
            Ok(()) => Ok(()),
            Err(_) => Err(TierDone { tag, result: Err(libc::EAGAIN) }),
        }
    }
}

impl TierIo for NvmeTierIo {
    fn kind(&self) -> TierKind {
        TierKind::Nvme
    }
    fn capacity_bytes(&self) -> u64 {
        self.bytes
    }
    fn depth(&self) -> u32 {
        self.depth
    }
    fn host_ptr(&self, _: u64) -> Option<*mut u8> {
        None
    }
    unsafe fn store(&mut self, tag: u64, offset: u64, segs: &[Segment]) -> Result<(), TierDone> {
        // SAFETY: the caller's contract is the queue's.
        unsafe { self.submit(BlockOp::Write, tag, offset, segs) }
    }
    unsafe fn load(&mut self, tag: u64, offset: u64, segs: &[Segment]) -> Result<(), TierDone> {
        // SAFETY: the caller's contract is the queue's.
        unsafe { self.submit(BlockOp::Read, tag, offset, segs) }
    }
    fn complete(&mut self, out: &mut [TierDone]) -> usize {
        let _ = self.queue.kick();
        let room = out.len().min(self.done.len());
        let n = self.queue.complete(&mut self.done[..room]);
        for (o, c) in out.iter_mut().zip(&self.done[..n]) {
            let result = match c.result {
                Ok(_) => Ok(()),
                Err(fastlane_block::BlockError::Io(e)) => Err(e),
                Err(_) => Err(-1),
            };
            *o = TierDone { tag: c.tag, result };
        }
        n
    }
    fn wait(&mut self, timeout: Duration) {
        let _ = self.queue.wait(Some(timeout));
    }
    fn in_flight(&self) -> u32 {
        self.queue.in_flight()
    }
}

/// The remote tier: one range granted at start from a remote memory pool; transfers are
/// RDMA WRITE/READ through the pool connection's staging buffer, completed inline.
pub struct RemoteTierIo {
    pool: fastlane_rdma::RemotePool,
    range: fastlane_rdma::Range,
    done: Option<TierDone>,
    gone: bool,
}

impl std::fmt::Debug for RemoteTierIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteTierIo").field("bytes", &self.range.len()).finish()
    }
}

/// The errno a remote transfer reports when the peer is gone.
pub const REMOTE_GONE_ERRNO: i32 = libc::ENOTCONN;

impl RemoteTierIo {
    /// Connects to the pool at `addr` on RDMA device `device` and takes `bytes` of it.
    pub fn connect(
        device: &str,
        addr: std::net::SocketAddr,
        bytes: u64,
    ) -> Result<RemoteTierIo, KvSwapError> {
        let dev = fastlane_rdma::Device::open(device)
            .map_err(|e| KvSwapError::setup("rdma device", e))?;
        let mut pool = fastlane_rdma::RemotePool::connect(&dev, addr)
            .map_err(|e| KvSwapError::setup("remote pool connect", e))?;
        let range = pool.grant(bytes).map_err(|e| KvSwapError::setup("remote pool grant", e))?;
        Ok(RemoteTierIo { pool, range, done: None, gone: false })
    }

    fn run(
        &mut self,
        tag: u64,
        offset: u64,
        segs: &[Segment],
        write: bool,
    ) -> Result<(), TierDone> {
        if self.gone {
            return Err(TierDone { tag, result: Err(REMOTE_GONE_ERRNO) });
        }
        let mut off = offset;
        for s in segs {
            let r = if write {
                // SAFETY: the caller keeps the segment valid and unwritten until completion.
                let data = unsafe { std::slice::from_raw_parts(s.addr, s.len as usize) };
                self.pool.write(&self.range, off, data)
            } else {
                // SAFETY: the caller keeps the segment valid and unshared until completion.
                let data = unsafe { std::slice::from_raw_parts_mut(s.addr, s.len as usize) };
                self.pool.read(&self.range, off, data)
            };
            if let Err(e) = r {
                let errno = match e {
                    fastlane_rdma::RdmaError::PeerGone { .. } => {
                        self.gone = true;
                        REMOTE_GONE_ERRNO
                    }
                    _ => libc::EIO,
                };
                log::warn!("kvswap: remote tier transfer failed: {e}");
                return Err(TierDone { tag, result: Err(errno) });
            }
            off += u64::from(s.len);
        }
        self.done = Some(TierDone { tag, result: Ok(()) });
        Ok(())
    }
}

impl TierIo for RemoteTierIo {
    fn kind(&self) -> TierKind {
        TierKind::Remote
    }
    fn capacity_bytes(&self) -> u64 {
        self.range.len()
    }
    fn depth(&self) -> u32 {
        1
    }
    fn host_ptr(&self, _: u64) -> Option<*mut u8> {
        None
    }
    unsafe fn store(&mut self, tag: u64, offset: u64, segs: &[Segment]) -> Result<(), TierDone> {
        self.run(tag, offset, segs, true)
    }
    unsafe fn load(&mut self, tag: u64, offset: u64, segs: &[Segment]) -> Result<(), TierDone> {
        self.run(tag, offset, segs, false)
    }
    fn complete(&mut self, out: &mut [TierDone]) -> usize {
        match (self.done.take(), out.first_mut()) {
            (Some(d), Some(o)) => {
                *o = d;
                1
            }
            (d, _) => {
                self.done = d;
                0
            }
        }
    }
    fn wait(&mut self, _: Duration) {}
    fn in_flight(&self) -> u32 {
        u32::from(self.done.is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_space_first_fit_fragments_and_merges() {
        let mut s = SlotSpace::new(10);
        let mut out = Vec::new();
        assert!(s.alloc(4, &mut out));
        assert!(s.alloc(3, &mut out));
        assert_eq!(out, vec![(0, 4), (4, 3)]);
        s.release(0, 4);
        out.clear();
        assert!(s.alloc(6, &mut out), "4 + 3 free in two extents");
        assert_eq!(out.iter().map(|e| e.1).sum::<u64>(), 6);
        assert_eq!(s.free_slots(), 1);
        assert!(!s.alloc(2, &mut Vec::new()));
        for (a, l) in out {
            s.release(a, l);
        }
        s.release(4, 3);
        assert_eq!(s.free_slots(), 10);
        assert_eq!(s.free, vec![(0, 10)]);
    }
}
