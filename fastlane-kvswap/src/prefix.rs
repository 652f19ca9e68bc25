//! A content-addressed store of KV blocks for prefix reuse: an in-process host-memory LRU
//! bounded in bytes, optionally an NVMe tier under it (a file of fixed slots, its own LRU),
//! and optionally a shared [`ClusterTier`] under both.
//!
//! Blocks are named by [`BlockKey`] (chained hashes of a model digest and token ids, see
//! [`cas`](crate::cas)), so a block stored by one sequence is found by any later sequence, on
//! this process or (through the cluster) on another, whose prompt starts with the same tokens.
//!
//! - [`PrefixStore::lookup`] returns the longest run of *leading* hits for a sequence's keys:
//!   each key from the host cache or else the NVMe tier, and from the first key on neither,
//!   the cluster (one pipelined batch). A block read from NVMe is checked against the
//!   CRC32C and length kept in memory for its slot; a block the cluster returns is verified
//!   there (key, length, CRC32C). Either is then inserted into the host cache. A block that
//!   fails verification, an I/O error or any cluster error is a miss, never data.
//! - [`PrefixStore::insert`] puts a block into the host cache at once and queues it for the
//!   cluster; a background thread drains that bounded queue (a full queue drops the put and
//!   counts it), so callers never wait for the network on the way in.
//! - A block the host cache evicts (least recently used, never a pinned one) is *spilled*:
//!   queued for a second background thread that writes it into an NVMe slot, unless it is
//!   already there. That queue is bounded too (full: the spill is dropped and counted); while
//!   a block waits in it, lookups are served from the queued copy. A full NVMe tier reuses its
//!   least recently used slot (that block leaves this process; the cluster may still have it).
//! - Values are `Arc<[u8]>`: a block handed out by `lookup` stays valid after the cache
//!   evicts it, and the same bytes serve the host cache and the queued cluster put or spill.
//!
//! The NVMe file holds payloads only: keys, checksums and recency live in memory, so the
//! file's contents mean nothing to a later process (it starts with an empty index).
//!
//! Every count in [`PrefixStats`] is exact (atomics updated where the event happens).

#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fs::File;
use std::io::{Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
#[cfg(feature = "cluster")]
use std::sync::mpsc::{self, Receiver};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use memmap2::MmapMut;

use crate::cas::BlockKey;
#[cfg(feature = "cluster")]
use crate::cluster::{BlockGet, ClusterTier, MissReason};

/// Puts waiting for the cluster at most (beyond: dropped and counted).
pub const PUT_QUEUE_MAX: usize = 256;
/// Blocks sent to the cluster in one pipelined batch at most.
pub const PUT_BATCH_MAX: usize = 16;
/// Spills waiting for the NVMe tier at most, by default (beyond: dropped and counted).
pub const SPILL_QUEUE_MAX: usize = 64;
/// Alignment of NVMe slots (their size and offset) and of the bounce buffers (`O_DIRECT`).
pub const NVME_ALIGN: usize = 4096;
/// Idle read bounce buffers kept for reuse at most.
const READ_BUFS_KEPT: usize = 4;

/// Settings of a [`PrefixStore`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixStoreConfig {
    /// Bytes of block payload the host cache holds at most (0: no host cache).
    pub host_bytes: usize,
    /// Bytes of every block (a block of another size is refused).
    pub block_bytes: usize,
    /// Puts waiting for the cluster at most.
    pub put_queue_max: usize,
    /// The NVMe tier under the host cache (`None`: blocks the host cache evicts are dropped).
    pub nvme: Option<PrefixNvmeConfig>,
}

/// Settings of the NVMe tier of a [`PrefixStore`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixNvmeConfig {
    /// A file (created with mode 0600 if absent, preallocated to the slots' bytes) or a block
    /// device. Its previous contents are ignored and overwritten.
    pub path: PathBuf,
    /// Bytes of it to use: `bytes / slot` slots, a slot being the block size rounded up to
    /// [`NVME_ALIGN`].
    pub bytes: u64,
    /// Spills queued or being written at most (beyond: dropped and counted).
    pub spill_queue_max: usize,
}

impl PrefixNvmeConfig {
    /// `bytes` of `path`, with the default spill queue ([`SPILL_QUEUE_MAX`]).
    pub fn new(path: impl Into<PathBuf>, bytes: u64) -> PrefixNvmeConfig {
        PrefixNvmeConfig { path: path.into(), bytes, spill_queue_max: SPILL_QUEUE_MAX }
    }
}

/// Counters of a [`PrefixStore`] since it was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PrefixStats {
    /// `lookup` calls.
    pub lookups: u64,
    /// Keys asked for by `lookup`.
    pub blocks_looked_up: u64,
    /// Blocks `lookup` served from the host cache.
    pub host_hits: u64,
    /// Blocks served from the NVMe tier (or its spill queue) and inserted into the host cache
    /// (by `lookup`, `get` and `pin`).
    pub nvme_hits: u64,
    /// Blocks served from the cluster (and inserted into the host cache).
    pub cluster_hits: u64,
    /// Keys asked for by `lookup` and not served by any tier (the first miss of a lookup and
    /// every key after it).
    pub misses: u64,
    /// Cluster values, and NVMe slots, that failed verification (length, CRC32C; for the
    /// cluster also the key) and were misses. A bad NVMe slot leaves the tier.
    pub integrity_misses: u64,
    /// Cluster calls that failed (timeout, connection, cluster down); their keys were misses.
    pub cluster_errors: u64,
    /// Payload bytes received from the cluster as hits.
    pub bytes_in: u64,
    /// Payload bytes the cluster acknowledged storing.
    pub bytes_out: u64,
    /// Blocks inserted into the host cache (by `insert`, an NVMe hit or a cluster hit).
    pub host_inserts: u64,
    /// Blocks evicted from the host cache to make room (least recently used first).
    pub evictions: u64,
    /// Blocks in the host cache now.
    pub host_blocks: u64,
    /// Payload bytes in the host cache now.
    pub host_bytes: u64,
    /// Blocks the cluster acknowledged storing.
    pub cluster_puts: u64,
    /// Puts dropped because the queue to the cluster was full.
    pub puts_dropped: u64,
    /// Puts that failed at the cluster (dropped; the block stays in the host cache).
    pub put_errors: u64,
    /// Blocks the host cache could not take (larger than it, or the rest of it pinned).
    pub host_refused: u64,
    /// Keys asked for by `get` (per-key lookups, not leading runs).
    pub gets: u64,
    /// Keys `get` served (from any tier).
    pub get_hits: u64,
    /// Pins held now (a key pinned twice counts twice).
    pub pins: u64,
    /// Blocks pinned in the host cache now.
    pub pinned_blocks: u64,
    /// Blocks removed by `evict`.
    pub evicted_by_request: u64,
    /// Blocks in the NVMe tier now (written and indexed; not those still queued).
    pub nvme_blocks: u64,
    /// Payload bytes in the NVMe tier now.
    pub nvme_bytes: u64,
    /// Slots of the NVMe tier (0: no NVMe tier).
    pub nvme_capacity_blocks: u64,
    /// Blocks written to the NVMe tier.
    pub nvme_spills: u64,
    /// Spills dropped because the queue to the NVMe tier was full.
    pub nvme_spills_dropped: u64,
    /// Blocks dropped from the NVMe tier to reuse their slot (least recently used first).
    pub nvme_evictions: u64,
    /// NVMe reads and writes that failed (a failed read is a miss and drops the slot, a
    /// failed write drops the spill).
    pub nvme_errors: u64,
}

#[derive(Debug, Default)]
struct Counters {
    lookups: AtomicU64,
    blocks_looked_up: AtomicU64,
    host_hits: AtomicU64,
    nvme_hits: AtomicU64,
    cluster_hits: AtomicU64,
    misses: AtomicU64,
    integrity_misses: AtomicU64,
    cluster_errors: AtomicU64,
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
    host_inserts: AtomicU64,
    evictions: AtomicU64,
    cluster_puts: AtomicU64,
    puts_dropped: AtomicU64,
    put_errors: AtomicU64,
    host_refused: AtomicU64,
    gets: AtomicU64,
    get_hits: AtomicU64,
    pins: AtomicU64,
    evicted_by_request: AtomicU64,
    nvme_spills: AtomicU64,
    nvme_spills_dropped: AtomicU64,
    nvme_evictions: AtomicU64,
    nvme_errors: AtomicU64,
    /// Puts queued and not yet finished (for [`PrefixStore::flush`]).
    pending_puts: AtomicU64,
}

fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// A panic while holding one of the store's locks leaves a consistent map (no partial
/// updates across an unwind point that matter): keep using it.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A host-cache entry: the block, its recency tick, and how many pins hold it.
#[derive(Debug)]
struct Entry {
    data: Arc<[u8]>,
    tick: u64,
    pins: u32,
}

/// Blocks the host cache evicted, for the NVMe tier.
type Evicted = Vec<(BlockKey, Arc<[u8]>)>;

/// The host cache: blocks by key, recency by a tick (`order` maps tick → key, oldest first).
/// A pinned entry is not in `order`, so eviction never reaches it.
#[derive(Debug, Default)]
struct HostLru {
    map: HashMap<BlockKey, Entry>,
    order: BTreeMap<u64, BlockKey>,
    tick: u64,
    bytes: usize,
    /// Bytes and blocks of pinned entries.
    pinned: usize,
    pinned_blocks: usize,
}

impl HostLru {
    fn get(&mut self, key: &BlockKey) -> Option<Arc<[u8]>> {
        let e = self.map.get_mut(key)?;
        if e.pins == 0 {
            self.order.remove(&e.tick);
            self.tick += 1;
            e.tick = self.tick;
            self.order.insert(self.tick, *key);
        }
        Some(e.data.clone())
    }

    /// Inserts (or refreshes) `key`; `true`, with the blocks evicted to make room pushed
    /// onto `evicted`, or `false` when the block cannot fit (larger than the cache, or the
    /// rest of it pinned).
    fn insert(
        &mut self,
        key: BlockKey,
        data: Arc<[u8]>,
        cap: usize,
        evicted: &mut Evicted,
    ) -> bool {
        if self.get(&key).is_some() {
            return true;
        }
        if self.pinned + data.len() > cap {
            return false;
        }
        // Bounded: each pass removes one unpinned entry, and the pinned bytes alone leave
        // room (checked above).
        while self.bytes + data.len() > cap {
            let Some((_, old)) = self.order.pop_first() else { break };
            if let Some(e) = self.map.remove(&old) {
                self.bytes -= e.data.len();
                evicted.push((old, e.data));
            }
        }
        self.tick += 1;
        self.bytes += data.len();
        self.order.insert(self.tick, key);
        self.map.insert(key, Entry { data, tick: self.tick, pins: 0 });
        true
    }

    /// Adds a pin to a cached `key`; `false` when it is not cached.
    fn pin(&mut self, key: &BlockKey) -> bool {
        let Some(e) = self.map.get_mut(key) else { return false };
        if e.pins == 0 {
            self.order.remove(&e.tick);
            self.pinned += e.data.len();
            self.pinned_blocks += 1;
        }
        e.pins += 1;
        true
    }

    /// Removes a pin; `false` when `key` is not cached or not pinned.
    fn unpin(&mut self, key: &BlockKey) -> bool {
        let Some(e) = self.map.get_mut(key) else { return false };
        if e.pins == 0 {
            return false;
        }
        e.pins -= 1;
        if e.pins == 0 {
            self.pinned -= e.data.len();
            self.pinned_blocks -= 1;
            self.tick += 1;
            e.tick = self.tick;
            self.order.insert(self.tick, *key);
        }
        true
    }

    /// Removes an unpinned `key`; `false` when it is absent or pinned.
    fn remove(&mut self, key: &BlockKey) -> bool {
        match self.map.get(key) {
            Some(e) if e.pins == 0 => {}
            _ => return false,
        }
        let Some(e) = self.map.remove(key) else { return false };
        self.order.remove(&e.tick);
        self.bytes -= e.data.len();
        true
    }
}

/// A block in the NVMe tier: its slot, and what a read of it must give back.
#[derive(Debug)]
struct NvmeEntry {
    slot: u32,
    len: u32,
    crc: u32,
    tick: u64,
}

/// The NVMe tier's index and spill queue (one lock; no I/O is done while holding it).
#[derive(Debug, Default)]
struct NvmeState {
    map: HashMap<BlockKey, NvmeEntry>,
    /// Recency: tick → key, oldest first.
    order: BTreeMap<u64, BlockKey>,
    tick: u64,
    /// Payload bytes of the blocks in `map`.
    bytes: u64,
    /// Slots in no entry and not being written.
    free: Vec<u32>,
    /// Per slot, bumped whenever a write claims it: a read that started before sees the
    /// change and discards what it read (the block had left the slot).
    gens: Vec<u64>,
    /// Spills waiting for the writer, oldest first.
    queue: VecDeque<BlockKey>,
    /// Payloads of the spills queued or being written (bounded by the queue limit); lookups
    /// are served from them.
    queued: HashMap<BlockKey, Arc<[u8]>>,
    /// The writer takes no new spill (tests: a stalled device).
    paused: bool,
    /// The store is going away: the writer ends, abandoning the queue.
    closed: bool,
}

impl NvmeState {
    /// Refreshes a written `key`'s recency; `(slot, len, crc)`, or `None` when absent.
    fn touch(&mut self, key: &BlockKey) -> Option<(u32, u32, u32)> {
        let e = self.map.get_mut(key)?;
        self.order.remove(&e.tick);
        self.tick += 1;
        e.tick = self.tick;
        self.order.insert(self.tick, *key);
        Some((e.slot, e.len, e.crc))
    }

    /// Drops a written `key` (its slot becomes free); `false` when absent.
    fn remove(&mut self, key: &BlockKey) -> bool {
        let Some(e) = self.map.remove(key) else { return false };
        self.order.remove(&e.tick);
        self.bytes -= u64::from(e.len);
        self.free.push(e.slot);
        true
    }

    fn gen(&self, slot: u32) -> Option<u64> {
        self.gens.get(slot as usize).copied()
    }
}

/// The NVMe tier: a file of `slots` fixed slots of `slot_bytes`, read and written at slot
/// offsets through page-aligned bounce buffers (so `O_DIRECT` accepts every transfer).
#[derive(Debug)]
struct NvmeTier {
    file: File,
    path: PathBuf,
    /// Opened with `O_DIRECT` (else buffered: the filesystem refused it).
    direct: bool,
    slot_bytes: usize,
    slots: u32,
    queue_max: usize,
    state: Mutex<NvmeState>,
    /// Wakes the writer: a spill queued, the queue resumed, the store closing.
    wake: Condvar,
    /// Idle read bounce buffers (each `slot_bytes`, page aligned).
    bufs: Mutex<Vec<MmapMut>>,
}

/// What a read of the NVMe tier gave.
enum NvmeRead {
    Hit(Arc<[u8]>),
    Miss,
}

impl NvmeTier {
    /// Opens (creating and preallocating a regular file) the tier; also returns the writer's
    /// bounce buffer. Errors name the path and the step.
    fn open(cfg: &PrefixNvmeConfig, block_bytes: usize) -> std::io::Result<(NvmeTier, MmapMut)> {
        use std::io::{Error, ErrorKind};
        let path = cfg.path.clone();
        let err = |what: &str, e: Error| {
            Error::new(e.kind(), format!("prefix cache NVMe tier {}: {what}: {e}", path.display()))
        };
        let invalid = |what: String| err("config", Error::new(ErrorKind::InvalidInput, what));
        if block_bytes == 0 || u32::try_from(block_bytes).is_err() {
            return Err(invalid(format!("block size {block_bytes} is not in 1..4 GiB")));
        }
        let slot_bytes = block_bytes.div_ceil(NVME_ALIGN) * NVME_ALIGN;
        let slots = u32::try_from(cfg.bytes / slot_bytes as u64).unwrap_or(u32::MAX);
        if slots == 0 {
            return Err(invalid(format!(
                "{} bytes hold no slot of {slot_bytes} bytes (one block)",
                cfg.bytes
            )));
        }
        let total = u64::from(slots) * slot_bytes as u64;
        let open = |direct: bool| {
            let mut o = std::fs::OpenOptions::new();
            o.read(true).write(true).create(true).truncate(false).mode(0o600);
            if direct {
                o.custom_flags(libc::O_DIRECT);
            }
            o.open(&cfg.path)
        };
        let (file, direct) = match open(true) {
            Ok(f) => (f, true),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                log::info!(
                    "prefix cache NVMe tier {}: the filesystem refuses O_DIRECT (tmpfs?); \
                     buffered I/O through the page cache",
                    cfg.path.display()
                );
                (open(false).map_err(|e| err("open", e))?, false)
            }
            Err(e) => return Err(err("open (O_DIRECT)", e)),
        };
        let meta = file.metadata().map_err(|e| err("stat", e))?;
        if meta.file_type().is_block_device() {
            let size = (&file).seek(SeekFrom::End(0)).map_err(|e| err("size", e))?;
            if size < total {
                let e = Error::new(ErrorKind::InvalidInput, format!("{size} bytes, {total} asked"));
                return Err(err("device too small", e));
            }
        } else if !meta.file_type().is_file() {
            return Err(invalid("not a regular file or a block device".into()));
        } else {
            preallocate(&file, total, meta.len()).map_err(|e| err("preallocate", e))?;
        }
        let buf = MmapMut::map_anon(slot_bytes).map_err(|e| err("bounce buffer", e))?;
        let state = NvmeState {
            // Lowest slot first (popped from the end).
            free: (0..slots).rev().collect(),
            gens: vec![0; slots as usize],
            ..NvmeState::default()
        };
        let tier = NvmeTier {
            file,
            path: cfg.path.clone(),
            direct,
            slot_bytes,
            slots,
            queue_max: cfg.spill_queue_max,
            state: Mutex::new(state),
            wake: Condvar::new(),
            bufs: Mutex::new(Vec::new()),
        };
        log::info!(
            "prefix cache NVMe tier {}: {slots} slots of {slot_bytes} bytes{}",
            cfg.path.display(),
            if direct { ", O_DIRECT" } else { "" }
        );
        Ok((tier, buf))
    }

    fn state(&self) -> MutexGuard<'_, NvmeState> {
        lock(&self.state)
    }

    fn offset(&self, slot: u32) -> u64 {
        u64::from(slot) * self.slot_bytes as u64
    }

    /// Queues `data` to be written, unless it is there already (then it counts as used now)
    /// or queued. A full queue drops it (counted).
    fn spill(&self, key: BlockKey, data: Arc<[u8]>, c: &Counters) {
        let mut st = self.state();
        if st.closed || st.touch(&key).is_some() || st.queued.contains_key(&key) {
            return;
        }
        if st.queued.len() >= self.queue_max {
            add(&c.nvme_spills_dropped, 1);
            return;
        }
        st.queued.insert(key, data);
        st.queue.push_back(key);
        drop(st);
        self.wake.notify_one();
    }

    /// Reads `key` (a queued spill's payload, or its slot, verified).
    fn read(&self, key: &BlockKey, c: &Counters) -> NvmeRead {
        let (slot, len, crc, gen) = {
            let mut st = self.state();
            if let Some(d) = st.queued.get(key) {
                return NvmeRead::Hit(d.clone());
            }
            let Some((slot, len, crc)) = st.touch(key) else { return NvmeRead::Miss };
            let Some(gen) = st.gen(slot) else { return NvmeRead::Miss };
            (slot, len, crc, gen)
        };
        let got = self.read_slot(slot, len as usize, crc);
        let mut st = self.state();
        if st.gen(slot) != Some(gen) {
            // A write claimed the slot while we read: the block had left the tier (LRU or
            // `evict`) and what we read may be the next one's. An ordinary miss.
            return NvmeRead::Miss;
        }
        match got {
            Ok(Some(d)) => NvmeRead::Hit(d),
            Ok(None) => {
                log::warn!(
                    "prefix cache NVMe tier {}: slot {slot} failed verification (length or \
                     CRC32C); dropped",
                    self.path.display()
                );
                add(&c.integrity_misses, 1);
                if st.map.get(key).is_some_and(|e| e.slot == slot) {
                    st.remove(key);
                }
                NvmeRead::Miss
            }
            Err(e) => {
                log::warn!(
                    "prefix cache NVMe tier {}: reading slot {slot}: {e}; dropped",
                    self.path.display()
                );
                add(&c.nvme_errors, 1);
                if st.map.get(key).is_some_and(|e| e.slot == slot) {
                    st.remove(key);
                }
                NvmeRead::Miss
            }
        }
    }

    /// The payload of `slot` if it is `len` bytes with CRC32C `crc`; `Ok(None)` if not.
    fn read_slot(&self, slot: u32, len: usize, crc: u32) -> std::io::Result<Option<Arc<[u8]>>> {
        if len > self.slot_bytes {
            return Ok(None);
        }
        let mut buf = match lock(&self.bufs).pop() {
            Some(b) => b,
            None => MmapMut::map_anon(self.slot_bytes)?,
        };
        // The whole slot: offset, length and buffer all aligned for O_DIRECT.
        let r = self.file.read_exact_at(&mut buf[..], self.offset(slot));
        let out = match r {
            Ok(()) => {
                let payload = &buf[..len];
                Ok((crc32c::crc32c(payload) == crc).then(|| Arc::from(payload)))
            }
            Err(e) => Err(e),
        };
        let mut bufs = lock(&self.bufs);
        if bufs.len() < READ_BUFS_KEPT {
            bufs.push(buf);
        }
        out
    }

    /// Removes `key` from the tier (written or queued); `false` when it is in neither.
    fn remove(&self, key: &BlockKey) -> bool {
        let mut st = self.state();
        let written = st.remove(key);
        // A spill being written is finished by the writer, which then frees its slot.
        let queued = st.queued.remove(key).is_some();
        if queued {
            st.queue.retain(|k| k != key);
        }
        written || queued
    }

    fn contains(&self, key: &BlockKey) -> bool {
        let st = self.state();
        st.map.contains_key(key) || st.queued.contains_key(key)
    }

    /// Spills queued or being written.
    fn pending(&self) -> usize {
        self.state().queued.len()
    }

    fn close(&self) {
        self.state().closed = true;
        self.wake.notify_all();
    }

    #[cfg(test)]
    fn set_paused(&self, paused: bool) {
        self.state().paused = paused;
        self.wake.notify_all();
    }
}

/// Gives `file` at least `len` bytes of allocated space (`fallocate`; where the filesystem
/// cannot, a sparse `set_len` when it is shorter).
fn preallocate(file: &File, len: u64, now: u64) -> std::io::Result<()> {
    let Ok(off_len) = libc::off_t::try_from(len) else {
        return Err(std::io::Error::from_raw_os_error(libc::EFBIG));
    };
    // Bounded: EINTR is retried a few times.
    for _ in 0..8 {
        // SAFETY:
        // - `file` is borrowed for the call, so its descriptor stays open and valid;
        // - `fallocate` takes no pointer: it cannot read or write this process's memory.
        let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, off_len) };
        if rc == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EOPNOTSUPP | libc::ENOSYS) => {
                if now < len {
                    file.set_len(len)?;
                }
                return Ok(());
            }
            _ => return Err(e),
        }
    }
    Err(std::io::Error::from_raw_os_error(libc::EINTR))
}

/// The NVMe writer thread: queued spills into slots (a free one, else the least recently
/// used block's) until the store closes.
fn spill_loop(tier: &NvmeTier, c: &Counters, mut buf: MmapMut) {
    loop {
        let (key, data, slot) = {
            let mut st = tier.state();
            // Each wait ends on a notify (spill, resume, close) or spuriously; re-checked.
            while !st.closed && (st.queue.is_empty() || st.paused) {
                st = tier.wake.wait(st).unwrap_or_else(PoisonError::into_inner);
            }
            if st.closed {
                return;
            }
            let Some(key) = st.queue.pop_front() else { continue };
            let Some(data) = st.queued.get(&key).cloned() else { continue };
            if st.map.contains_key(&key) {
                // Queued again while its first spill was being written.
                st.queued.remove(&key);
                st.touch(&key);
                continue;
            }
            let slot = match st.free.pop() {
                Some(s) => s,
                None => {
                    // Every slot is in `map` (this thread is the only writer, and it has
                    // none claimed now): reuse the least recently used one.
                    let victim = st.order.pop_first().and_then(|(_, v)| st.map.remove(&v));
                    let Some(e) = victim else {
                        // Unreachable (`order` and `map` hold the same keys); drop the spill
                        // rather than leave it pending.
                        st.queued.remove(&key);
                        continue;
                    };
                    st.bytes -= u64::from(e.len);
                    add(&c.nvme_evictions, 1);
                    e.slot
                }
            };
            if let Some(g) = st.gens.get_mut(slot as usize) {
                *g = g.wrapping_add(1);
            }
            (key, data, slot)
        };
        let crc = crc32c::crc32c(&data);
        let r = match buf.get_mut(..data.len()) {
            Some(dst) => {
                dst.copy_from_slice(&data);
                buf[data.len()..].fill(0);
                tier.file.write_all_at(&buf[..], tier.offset(slot))
            }
            None => Err(std::io::Error::from_raw_os_error(libc::EINVAL)),
        };
        let mut st = tier.state();
        match r {
            Ok(()) if st.queued.remove(&key).is_some() => {
                st.tick += 1;
                let tick = st.tick;
                // `data.len()` fits: it is at most `slot_bytes` (checked by `get_mut` above),
                // which `open` bounded by u32.
                let len = data.len() as u32;
                st.map.insert(key, NvmeEntry { slot, len, crc, tick });
                st.order.insert(tick, key);
                st.bytes += u64::from(len);
                add(&c.nvme_spills, 1);
            }
            // Evicted by request while being written.
            Ok(()) => st.free.push(slot),
            Err(e) => {
                log::warn!(
                    "prefix cache NVMe tier {}: writing slot {slot}: {e}; spill dropped",
                    tier.path.display()
                );
                add(&c.nvme_errors, 1);
                st.queued.remove(&key);
                st.free.push(slot);
            }
        }
    }
}

/// Where a block was found by [`PrefixStore::exists`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum Located {
    /// In this process's host cache.
    Host,
    /// In this process's NVMe tier (or queued for it).
    Nvme,
    /// In the shared cluster (a hint: the value is not read, a later get may still miss).
    Cluster,
}

/// The store. `Send + Sync`: one engine thread inserts while another thread looks up.
/// Dropping it lets the cluster writer finish the puts already queued, then joins it; the
/// NVMe writer finishes the block it is writing and abandons the rest of its queue.
#[derive(Debug)]
pub struct PrefixStore {
    cfg: PrefixStoreConfig,
    host: Mutex<HostLru>,
    nvme: Option<Arc<NvmeTier>>,
    spiller: Option<JoinHandle<()>>,
    #[cfg(feature = "cluster")]
    cluster: Option<Arc<ClusterTier>>,
    puts: Option<SyncSender<(BlockKey, Arc<[u8]>)>>,
    writer: Option<JoinHandle<()>>,
    counters: Arc<Counters>,
}

impl PrefixStore {
    /// A store without a cluster. An NVMe tier in `cfg` that cannot be opened is logged (an
    /// error) and left out: the store runs with its host cache alone ([`PrefixStore::open`]
    /// returns the error instead).
    pub fn new(cfg: PrefixStoreConfig) -> PrefixStore {
        match PrefixStore::open(cfg.clone()) {
            Ok(s) => s,
            Err(e) => {
                log::error!("{e}; the prefix cache runs without its NVMe tier");
                PrefixStore::host_only(PrefixStoreConfig { nvme: None, ..cfg })
            }
        }
    }

    /// A store without a cluster; its NVMe tier (if any) opened and its writer started.
    pub fn open(cfg: PrefixStoreConfig) -> Result<PrefixStore, std::io::Error> {
        let mut s = PrefixStore::host_only(cfg);
        s.start_nvme()?;
        Ok(s)
    }

    fn host_only(cfg: PrefixStoreConfig) -> PrefixStore {
        PrefixStore {
            cfg,
            host: Mutex::new(HostLru::default()),
            nvme: None,
            spiller: None,
            #[cfg(feature = "cluster")]
            cluster: None,
            puts: None,
            writer: None,
            counters: Arc::new(Counters::default()),
        }
    }

    /// Opens the NVMe tier of the configuration (if any) and starts its writer.
    fn start_nvme(&mut self) -> Result<(), std::io::Error> {
        let Some(ncfg) = &self.cfg.nvme else { return Ok(()) };
        let (tier, buf) = NvmeTier::open(ncfg, self.cfg.block_bytes)?;
        let tier = Arc::new(tier);
        let (t2, k2) = (tier.clone(), self.counters.clone());
        let spiller = std::thread::Builder::new()
            .name("kvswap-prefix-nvme".into())
            .spawn(move || spill_loop(&t2, &k2, buf))?;
        self.nvme = Some(tier);
        self.spiller = Some(spiller);
        Ok(())
    }

    /// A store backed by `cluster`, with its writer thread (and the NVMe tier of `cfg`, if
    /// any: an error opening it is returned).
    #[cfg(feature = "cluster")]
    pub fn with_cluster(
        cfg: PrefixStoreConfig,
        cluster: ClusterTier,
    ) -> Result<PrefixStore, std::io::Error> {
        let mut s = PrefixStore::open(cfg)?;
        let cluster = Arc::new(cluster);
        let (tx, rx) = mpsc::sync_channel(s.cfg.put_queue_max.max(1));
        let (c2, k2) = (cluster.clone(), s.counters.clone());
        let writer = std::thread::Builder::new()
            .name("kvswap-prefix-put".into())
            .spawn(move || write_loop(&c2, &k2, rx))?;
        s.cluster = Some(cluster);
        s.puts = Some(tx);
        s.writer = Some(writer);
        Ok(s)
    }

    /// The configuration.
    pub fn config(&self) -> &PrefixStoreConfig {
        &self.cfg
    }

    /// Whether a cluster backs the host cache.
    pub fn has_cluster(&self) -> bool {
        self.puts.is_some()
    }

    /// Whether an NVMe tier is under the host cache.
    pub fn has_nvme(&self) -> bool {
        self.nvme.is_some()
    }

    /// Whether the NVMe tier does `O_DIRECT` I/O (`None`: no NVMe tier; `false`: the
    /// filesystem refused it and the page cache is used).
    pub fn nvme_direct_io(&self) -> Option<bool> {
        self.nvme.as_ref().map(|t| t.direct)
    }

    fn host(&self) -> MutexGuard<'_, HostLru> {
        lock(&self.host)
    }

    /// `key` from the NVMe tier (verified), promoted into the host cache; counted.
    fn nvme_get(&self, key: &BlockKey) -> Option<Arc<[u8]>> {
        let tier = self.nvme.as_ref()?;
        match tier.read(key, &self.counters) {
            NvmeRead::Hit(d) => {
                add(&self.counters.nvme_hits, 1);
                self.insert_host(*key, d.clone());
                Some(d)
            }
            NvmeRead::Miss => None,
        }
    }

    /// The longest run of leading hits for `keys` (a sequence's block keys in order): each
    /// key from the host cache or else the NVMe tier (verified, then inserted into the host
    /// cache), and from the first key on neither, the cluster. Cluster hits are verified and
    /// inserted into the host cache. NVMe reads and the cluster call (bounded by its
    /// timeout) are done on the calling thread.
    pub fn lookup(&self, keys: &[BlockKey]) -> Vec<Arc<[u8]>> {
        let c = &self.counters;
        add(&c.lookups, 1);
        add(&c.blocks_looked_up, keys.len() as u64);
        let mut out = Vec::with_capacity(keys.len());
        // Bounded: every pass serves at least one key or ends the run.
        while out.len() < keys.len() {
            let before = out.len();
            {
                let mut h = self.host();
                for k in &keys[out.len()..] {
                    match h.get(k) {
                        Some(d) => out.push(d),
                        None => break,
                    }
                }
            }
            add(&c.host_hits, (out.len() - before) as u64);
            let Some(k) = keys.get(out.len()) else { break };
            match self.nvme_get(k) {
                Some(d) => out.push(d),
                None => break,
            }
        }
        #[cfg(feature = "cluster")]
        if out.len() < keys.len() {
            self.lookup_cluster(&keys[out.len()..], &mut out);
        }
        add(&c.misses, (keys.len() - out.len()) as u64);
        out
    }

    #[cfg(feature = "cluster")]
    fn lookup_cluster(&self, keys: &[BlockKey], out: &mut Vec<Arc<[u8]>>) {
        let Some(cluster) = &self.cluster else { return };
        let c = &self.counters;
        let bb = self.cfg.block_bytes;
        let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; bb]).collect();
        let results = {
            let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
            cluster.get(keys, &mut outs)
        };
        if results.contains(&BlockGet::Miss(MissReason::Error)) {
            add(&c.cluster_errors, 1);
        }
        for ((key, buf), r) in keys.iter().zip(bufs).zip(&results) {
            match r {
                BlockGet::Hit => {
                    let data: Arc<[u8]> = buf.into();
                    add(&c.cluster_hits, 1);
                    add(&c.bytes_in, bb as u64);
                    self.insert_host(*key, data.clone());
                    out.push(data);
                }
                BlockGet::Miss(why) => {
                    if *why == MissReason::Integrity {
                        add(&c.integrity_misses, 1);
                    }
                    break;
                }
            }
        }
        // Integrity failures after the first miss are counted too: they are facts about the
        // cluster's contents, whether or not the run reached them.
        let first_miss = results.iter().position(|r| !r.is_hit()).unwrap_or(results.len());
        let later = results
            .iter()
            .skip(first_miss + 1)
            .filter(|r| **r == BlockGet::Miss(MissReason::Integrity))
            .count();
        add(&c.integrity_misses, later as u64);
    }

    /// Whether the host cache holds `key` (refreshes its recency).
    pub fn contains(&self, key: &BlockKey) -> bool {
        self.host().get(key).is_some()
    }

    /// Per-key reads (not a leading run): host cache first, then the NVMe tier, then the
    /// cluster for the keys both missed (one pipelined batch). NVMe and cluster hits are
    /// verified and inserted into the host cache. `None` is a miss.
    pub fn get(&self, keys: &[BlockKey]) -> Vec<Option<Arc<[u8]>>> {
        let c = &self.counters;
        add(&c.gets, keys.len() as u64);
        let mut out: Vec<Option<Arc<[u8]>>> = {
            let mut h = self.host();
            keys.iter().map(|k| h.get(k)).collect()
        };
        if self.nvme.is_some() {
            for (k, o) in keys.iter().zip(out.iter_mut()) {
                if o.is_none() {
                    *o = self.nvme_get(k);
                }
            }
        }
        #[cfg(feature = "cluster")]
        if let Some(cluster) = &self.cluster {
            let missing: Vec<usize> = (0..keys.len()).filter(|&i| out[i].is_none()).collect();
            if !missing.is_empty() {
                let bb = self.cfg.block_bytes;
                let mkeys: Vec<BlockKey> = missing.iter().map(|&i| keys[i]).collect();
                let mut bufs: Vec<Vec<u8>> = mkeys.iter().map(|_| vec![0u8; bb]).collect();
                let results = {
                    let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
                    cluster.get(&mkeys, &mut outs)
                };
                if results.contains(&BlockGet::Miss(MissReason::Error)) {
                    add(&c.cluster_errors, 1);
                }
                for ((&i, buf), r) in missing.iter().zip(bufs).zip(&results) {
                    match r {
                        BlockGet::Hit => {
                            let data: Arc<[u8]> = buf.into();
                            add(&c.cluster_hits, 1);
                            add(&c.bytes_in, bb as u64);
                            self.insert_host(keys[i], data.clone());
                            out[i] = Some(data);
                        }
                        BlockGet::Miss(MissReason::Integrity) => add(&c.integrity_misses, 1),
                        BlockGet::Miss(_) => {}
                    }
                }
            }
        }
        add(&c.get_hits, out.iter().filter(|o| o.is_some()).count() as u64);
        out
    }

    /// Where each key is, nearest tier first; `None`: on no tier. Does not refresh recency
    /// and reads no NVMe slot (a later get may still find it corrupt).
    pub fn exists(&self, keys: &[BlockKey]) -> Vec<Option<Located>> {
        #[cfg_attr(not(feature = "cluster"), allow(unused_mut))]
        let mut out: Vec<Option<Located>> = {
            let h = self.host();
            keys.iter().map(|k| h.map.contains_key(k).then_some(Located::Host)).collect()
        };
        if let Some(tier) = &self.nvme {
            for (k, o) in keys.iter().zip(out.iter_mut()) {
                if o.is_none() && tier.contains(k) {
                    *o = Some(Located::Nvme);
                }
            }
        }
        #[cfg(feature = "cluster")]
        if let Some(cluster) = &self.cluster {
            let missing: Vec<usize> = (0..keys.len()).filter(|&i| out[i].is_none()).collect();
            if !missing.is_empty() {
                let mkeys: Vec<BlockKey> = missing.iter().map(|&i| keys[i]).collect();
                for (&i, there) in missing.iter().zip(cluster.exists(&mkeys)) {
                    if there {
                        out[i] = Some(Located::Cluster);
                    }
                }
            }
        }
        out
    }

    /// Pins each key in the host cache (a key found only on a lower tier is read into the
    /// host cache first); a pinned block is never evicted until as many `unpin`s. `false`
    /// for a key on no tier, or one the host cache cannot hold (the rest of it pinned).
    pub fn pin(&self, keys: &[BlockKey]) -> Vec<bool> {
        let mut out = vec![false; keys.len()];
        let mut missing = Vec::new();
        {
            let mut h = self.host();
            for (i, k) in keys.iter().enumerate() {
                if h.pin(k) {
                    out[i] = true;
                } else {
                    missing.push(i);
                }
            }
        }
        if !missing.is_empty() {
            let mkeys: Vec<BlockKey> = missing.iter().map(|&i| keys[i]).collect();
            let got = self.get(&mkeys);
            let mut h = self.host();
            for (&i, g) in missing.iter().zip(got) {
                // Read in by `get` (host insert); pin it if it is still there.
                out[i] = g.is_some() && h.pin(&keys[i]);
            }
        }
        add(&self.counters.pins, out.iter().filter(|&&p| p).count() as u64);
        out
    }

    /// Removes one pin from each key; `false` for a key not pinned.
    pub fn unpin(&self, keys: &[BlockKey]) -> Vec<bool> {
        let out: Vec<bool> = {
            let mut h = self.host();
            keys.iter().map(|k| h.unpin(k)).collect()
        };
        let n = out.iter().filter(|&&p| p).count() as u64;
        self.counters.pins.fetch_sub(n, Ordering::Relaxed);
        out
    }

    /// Removes each key from this process's tiers (host cache and NVMe, queued spills
    /// included); `false` for a key on neither, or pinned (a pinned key stays on both).
    /// Copies in the shared cluster stay (other engines may use them; the cluster's own LRU
    /// ages them out).
    pub fn evict(&self, keys: &[BlockKey]) -> Vec<bool> {
        // `Some(removed from host)`, or `None` for a pinned key.
        let host: Vec<Option<bool>> = {
            let mut h = self.host();
            keys.iter()
                .map(|k| match h.map.get(k) {
                    Some(e) if e.pins > 0 => None,
                    _ => Some(h.remove(k)),
                })
                .collect()
        };
        let out: Vec<bool> = keys
            .iter()
            .zip(host)
            .map(|(k, h)| match (h, &self.nvme) {
                (None, _) => false,
                (Some(h), Some(tier)) => tier.remove(k) | h,
                (Some(h), None) => h,
            })
            .collect();
        add(&self.counters.evicted_by_request, out.iter().filter(|&&p| p).count() as u64);
        out
    }

    /// Inserts into the host cache; the blocks it evicts, or the block itself when the host
    /// cache cannot take it, go to the NVMe tier (if any).
    fn insert_host(&self, key: BlockKey, data: Arc<[u8]>) -> bool {
        if data.len() > self.cfg.host_bytes {
            self.spill(key, data);
            return false;
        }
        let mut evicted = Evicted::new();
        let ok = self.host().insert(key, data.clone(), self.cfg.host_bytes, &mut evicted);
        add(&self.counters.evictions, evicted.len() as u64);
        for (k, d) in evicted {
            self.spill(k, d);
        }
        if !ok {
            add(&self.counters.host_refused, 1);
            self.spill(key, data);
            return false;
        }
        add(&self.counters.host_inserts, 1);
        true
    }

    /// Hands a block to the NVMe writer (never waits for the device).
    fn spill(&self, key: BlockKey, data: Arc<[u8]>) {
        if let Some(tier) = &self.nvme {
            tier.spill(key, data, &self.counters);
        }
    }

    /// Stores a block: into the host cache now, to the cluster (if any) by the writer thread.
    /// A block of the wrong size is refused (`false`).
    pub fn insert(&self, key: BlockKey, data: Arc<[u8]>) -> bool {
        if data.len() != self.cfg.block_bytes {
            return false;
        }
        self.insert_host(key, data.clone());
        if let Some(tx) = &self.puts {
            add(&self.counters.pending_puts, 1);
            match tx.try_send((key, data)) {
                Ok(()) => {}
                Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                    self.counters.pending_puts.fetch_sub(1, Ordering::Relaxed);
                    add(&self.counters.puts_dropped, 1);
                }
            }
        }
        true
    }

    /// Waits (at most `timeout`) until every queued cluster put and NVMe spill has finished;
    /// `true` if so.
    pub fn flush(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let nvme_pending = || self.nvme.as_ref().is_some_and(|t| t.pending() > 0);
        // Bounded by the deadline.
        while self.counters.pending_puts.load(Ordering::Acquire) > 0 || nvme_pending() {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }

    /// The counters.
    pub fn stats(&self) -> PrefixStats {
        let c = &self.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let (blocks, bytes, pinned_blocks) = {
            let h = self.host();
            (h.map.len() as u64, h.bytes as u64, h.pinned_blocks as u64)
        };
        let (nvme_blocks, nvme_bytes, nvme_capacity_blocks) = match &self.nvme {
            Some(t) => {
                let st = t.state();
                (st.map.len() as u64, st.bytes, u64::from(t.slots))
            }
            None => (0, 0, 0),
        };
        PrefixStats {
            lookups: l(&c.lookups),
            blocks_looked_up: l(&c.blocks_looked_up),
            host_hits: l(&c.host_hits),
            nvme_hits: l(&c.nvme_hits),
            cluster_hits: l(&c.cluster_hits),
            misses: l(&c.misses),
            integrity_misses: l(&c.integrity_misses),
            cluster_errors: l(&c.cluster_errors),
            bytes_in: l(&c.bytes_in),
            bytes_out: l(&c.bytes_out),
            host_inserts: l(&c.host_inserts),
            evictions: l(&c.evictions),
            host_blocks: blocks,
            host_bytes: bytes,
            cluster_puts: l(&c.cluster_puts),
            puts_dropped: l(&c.puts_dropped),
            put_errors: l(&c.put_errors),
            host_refused: l(&c.host_refused),
            gets: l(&c.gets),
            get_hits: l(&c.get_hits),
            pins: l(&c.pins),
            pinned_blocks,
            evicted_by_request: l(&c.evicted_by_request),
            nvme_blocks,
            nvme_bytes,
            nvme_capacity_blocks,
            nvme_spills: l(&c.nvme_spills),
            nvme_spills_dropped: l(&c.nvme_spills_dropped),
            nvme_evictions: l(&c.nvme_evictions),
            nvme_errors: l(&c.nvme_errors),
        }
    }
}

impl Drop for PrefixStore {
    fn drop(&mut self) {
        // The NVMe writer ends after the block it is writing: its index dies with the store,
        // so the rest of its queue would be written for nobody.
        if let Some(t) = &self.nvme {
            t.close();
        }
        if let Some(s) = self.spiller.take() {
            let _ = s.join();
        }
        // Closing the queue ends the cluster writer after what is queued (each put bounded
        // by the cluster's timeout).
        self.puts = None;
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}

/// The writer thread: batches of queued puts to the cluster until the queue closes.
#[cfg(feature = "cluster")]
fn write_loop(cluster: &ClusterTier, c: &Counters, rx: Receiver<(BlockKey, Arc<[u8]>)>) {
    let mut batch: Vec<(BlockKey, Arc<[u8]>)> = Vec::with_capacity(PUT_BATCH_MAX);
    // Ends when every sender is gone and the queue is empty.
    while let Ok(first) = rx.recv() {
        batch.clear();
        batch.push(first);
        while batch.len() < PUT_BATCH_MAX {
            match rx.try_recv() {
                Ok(item) => batch.push(item),
                Err(_) => break,
            }
        }
        let items: Vec<(BlockKey, &[u8])> = batch.iter().map(|(k, d)| (*k, &d[..])).collect();
        let n = batch.len() as u64;
        match cluster.put(&items) {
            Ok(()) => {
                add(&c.cluster_puts, n);
                add(&c.bytes_out, batch.iter().map(|(_, d)| d.len() as u64).sum());
            }
            Err(e) => {
                log::debug!("prefix store: cluster put of {n} blocks failed: {e}");
                add(&c.put_errors, n);
            }
        }
        // Pairs with the Acquire load in `flush`: the counters above are visible first.
        c.pending_puts.fetch_sub(n, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cas::{prefix_keys, ModelDigest};
    use crate::KvGeometry;

    fn keys(n: usize, seed: u32) -> Vec<BlockKey> {
        let d = ModelDigest::new("test", &KvGeometry::LLAMA31_8B);
        let t: Vec<u32> = (0..n as u32 * 16).map(|i| i ^ seed).collect();
        prefix_keys(&d, &t, 16)
    }

    fn block(i: u8) -> Arc<[u8]> {
        vec![i; 64].into()
    }

    fn store(blocks: usize) -> PrefixStore {
        PrefixStore::new(PrefixStoreConfig {
            host_bytes: blocks * 64,
            block_bytes: 64,
            put_queue_max: 4,
            nvme: None,
        })
    }

    #[test]
    fn longest_leading_run_and_exact_counts() {
        let s = store(16);
        let k = keys(5, 1);
        for (i, key) in k.iter().enumerate().take(3) {
            assert!(s.insert(*key, block(i as u8)));
        }
        // Block 4 cached but block 3 not: the run stops at 3.
        assert!(s.insert(k[4], block(4)));
        let hits = s.lookup(&k);
        assert_eq!(hits.len(), 3);
        for (i, h) in hits.iter().enumerate() {
            assert_eq!(&h[..], &[i as u8; 64][..]);
        }
        assert!(s.lookup(&keys(2, 99)).is_empty());
        let st = s.stats();
        assert_eq!(st.lookups, 2);
        assert_eq!(st.blocks_looked_up, 7);
        assert_eq!(st.host_hits, 3);
        assert_eq!(st.misses, 4);
        assert_eq!(st.cluster_hits, 0);
        assert_eq!(st.host_inserts, 4);
        assert_eq!(st.host_blocks, 4);
        assert_eq!(st.host_bytes, 256);
        assert_eq!(st.evictions, 0);
        assert!(!s.insert(k[0], vec![0u8; 63].into()), "wrong size refused");
        assert!(s.flush(Duration::from_millis(10)), "nothing queued without a cluster");
    }

    #[test]
    fn evicts_least_recently_used_within_the_byte_bound() {
        let s = store(3);
        let k = keys(5, 2);
        for (i, key) in k.iter().enumerate().take(3) {
            s.insert(*key, block(i as u8));
        }
        // Touch block 0: block 1 is now the oldest.
        assert_eq!(s.lookup(&k[..1]).len(), 1);
        s.insert(k[3], block(3));
        assert!(s.contains(&k[0]));
        assert!(!s.contains(&k[1]), "oldest evicted");
        assert!(s.contains(&k[2]));
        assert!(s.contains(&k[3]));
        // Inserting an existing key refreshes it and evicts nothing.
        s.insert(k[2], block(2));
        s.insert(k[4], block(4));
        assert!(!s.contains(&k[0]), "k0 was the oldest after k2's refresh");
        let st = s.stats();
        assert_eq!(st.evictions, 2);
        assert_eq!(st.host_blocks, 3);
        assert_eq!(st.host_bytes, 3 * 64);
        // A zero-byte cache holds nothing.
        let z = store(0);
        z.insert(k[0], block(0));
        assert!(z.lookup(&k[..1]).is_empty());
        assert_eq!(z.stats().host_blocks, 0);
    }

    #[test]
    fn handed_out_blocks_outlive_eviction() {
        let s = store(1);
        let k = keys(2, 3);
        s.insert(k[0], block(7));
        let held = s.lookup(&k[..1]);
        s.insert(k[1], block(8));
        assert!(!s.contains(&k[0]));
        assert_eq!(&held[0][..], &[7u8; 64][..]);
    }

    #[test]
    fn get_exists_pin_unpin_evict() {
        let s = store(3);
        let k = keys(5, 4);
        for (i, key) in k.iter().enumerate().take(3) {
            assert!(s.insert(*key, block(i as u8)));
        }
        // Per-key get: holes do not end the answer.
        let g = s.get(&[k[0], k[3], k[2]]);
        assert_eq!(g.iter().map(Option::is_some).collect::<Vec<_>>(), [true, false, true]);
        assert_eq!(&g[2].as_ref().unwrap()[..], &[2u8; 64][..]);
        assert_eq!(
            s.exists(&[k[1], k[4]]),
            vec![Some(Located::Host), None],
            "exists names the tier"
        );
        // Pin k1 (now the oldest): inserting two more evicts k0 and k2, never k1.
        assert_eq!(s.pin(&[k[1], k[4]]), vec![true, false], "an absent key cannot be pinned");
        assert_eq!(s.pin(&[k[1]]), vec![true], "pins nest");
        s.insert(k[3], block(3));
        s.insert(k[4], block(4));
        assert!(s.contains(&k[1]), "pinned block survives eviction");
        assert!(!s.contains(&k[0]) && !s.contains(&k[2]));
        assert!(!s.evict(&[k[1]])[0], "a pinned block is not evicted on request");
        let st = s.stats();
        assert_eq!((st.pins, st.pinned_blocks, st.host_blocks), (2, 1, 3));
        assert_eq!(s.unpin(&[k[1], k[0]]), vec![true, false]);
        assert_eq!(s.unpin(&[k[1]]), vec![true]);
        assert_eq!(s.unpin(&[k[1]]), vec![false], "no pin left");
        assert_eq!(s.evict(&[k[1], k[0]]), vec![true, false]);
        assert!(!s.contains(&k[1]));
        let st = s.stats();
        assert_eq!((st.pins, st.pinned_blocks, st.evicted_by_request), (0, 0, 1));
        // The failed pin of k4 looked it up too.
        assert_eq!((st.gets, st.get_hits), (4, 2));
        // With every byte pinned, an insert is refused (and counted), not forced in.
        let full = store(2);
        let k = keys(3, 5);
        full.insert(k[0], block(0));
        full.insert(k[1], block(1));
        assert_eq!(full.pin(&k[..2]), vec![true, true]);
        full.insert(k[2], block(2));
        assert!(!full.contains(&k[2]));
        assert!(full.contains(&k[0]) && full.contains(&k[1]));
        assert_eq!(full.stats().host_refused, 1);
    }

    // ---- The NVMe tier ----

    /// A block whose bytes differ along it (a flipped byte anywhere changes the CRC).
    fn nblock(i: u8) -> Arc<[u8]> {
        (0..64u8).map(|j| j.wrapping_mul(31) ^ i).collect::<Vec<u8>>().into()
    }

    fn nvme_store(
        dir: &tempfile::TempDir,
        host_blocks: usize,
        slots: u64,
        queue: usize,
    ) -> PrefixStore {
        PrefixStore::open(PrefixStoreConfig {
            host_bytes: host_blocks * 64,
            block_bytes: 64,
            put_queue_max: 4,
            nvme: Some(PrefixNvmeConfig {
                path: dir.path().join("prefix.nvme"),
                bytes: slots * NVME_ALIGN as u64,
                spill_queue_max: queue,
            }),
        })
        .expect("NVMe tier opens")
    }

    fn flush(s: &PrefixStore) {
        assert!(s.flush(Duration::from_secs(10)), "spills finish");
    }

    /// The slot `key` is written in.
    fn slot_of(s: &PrefixStore, key: &BlockKey) -> u32 {
        s.nvme.as_ref().unwrap().state().map[key].slot
    }

    /// The payload bytes of `slot` in the file, read past the store.
    fn file_bytes(dir: &tempfile::TempDir, slot: u32) -> Vec<u8> {
        let f = File::open(dir.path().join("prefix.nvme")).unwrap();
        let mut b = vec![0u8; 64];
        f.read_exact_at(&mut b, u64::from(slot) * NVME_ALIGN as u64).unwrap();
        b
    }

    #[test]
    fn host_eviction_spills_to_nvme_and_a_hit_comes_back_identical() {
        let dir = tempfile::tempdir().unwrap();
        let s = nvme_store(&dir, 2, 8, 8);
        assert!(s.has_nvme());
        let len = std::fs::metadata(dir.path().join("prefix.nvme")).unwrap().len();
        assert_eq!(len, 8 * NVME_ALIGN as u64, "preallocated to its slots");
        let k = keys(5, 10);
        for (i, key) in k.iter().enumerate().take(3) {
            assert!(s.insert(*key, nblock(i as u8)));
        }
        flush(&s);
        let st = s.stats();
        assert_eq!((st.host_blocks, st.evictions), (2, 1));
        assert_eq!((st.nvme_spills, st.nvme_blocks, st.nvme_bytes), (1, 1, 64));
        assert_eq!(st.nvme_capacity_blocks, 8);
        assert!(!s.contains(&k[0]));
        // On the device, not only in memory: the file holds k0's bytes.
        assert_eq!(file_bytes(&dir, slot_of(&s, &k[0])), &nblock(0)[..]);
        assert_eq!(s.exists(&k[..1]), vec![Some(Located::Nvme)]);
        // A hit from NVMe: identical bytes, promoted into the host cache (evicting k1, which
        // is spilled in turn), still on NVMe.
        let g = s.get(&k[..1]);
        assert_eq!(g[0].as_deref(), Some(&nblock(0)[..]));
        assert!(s.contains(&k[0]), "promoted");
        flush(&s);
        let st = s.stats();
        assert_eq!((st.nvme_hits, st.get_hits, st.host_inserts), (1, 1, 4));
        assert_eq!((st.nvme_spills, st.nvme_blocks), (2, 2), "k1 spilled, k0 stays on NVMe");
        // k3 evicts k2 (written), k4 evicts k0 (already on NVMe: no second write).
        s.insert(k[3], nblock(3));
        s.insert(k[4], nblock(4));
        flush(&s);
        let st = s.stats();
        assert_eq!((st.nvme_spills, st.nvme_blocks, st.evictions), (3, 3, 4));
        assert_eq!(
            s.exists(&k),
            vec![
                Some(Located::Nvme),
                Some(Located::Nvme),
                Some(Located::Nvme),
                Some(Located::Host),
                Some(Located::Host)
            ]
        );
        for (i, key) in k.iter().enumerate().take(3) {
            assert_eq!(s.get(&[*key])[0].as_deref(), Some(&nblock(i as u8)[..]), "block {i}");
        }
        assert_eq!((s.stats().integrity_misses, s.stats().nvme_errors), (0, 0));
    }

    #[test]
    fn a_full_nvme_tier_reuses_its_least_recently_used_slot() {
        let dir = tempfile::tempdir().unwrap();
        let s = nvme_store(&dir, 1, 3, 8);
        let k = keys(5, 11);
        // k0..k3 are evicted in order; the 4th spill takes k0's slot.
        for (i, key) in k.iter().enumerate() {
            s.insert(*key, nblock(i as u8));
        }
        flush(&s);
        let st = s.stats();
        assert_eq!((st.nvme_spills, st.nvme_evictions, st.nvme_blocks), (4, 1, 3));
        assert_eq!(st.nvme_bytes, 3 * 64);
        assert_eq!(
            s.exists(&k),
            vec![
                None,
                Some(Located::Nvme),
                Some(Located::Nvme),
                Some(Located::Nvme),
                Some(Located::Host)
            ]
        );
        // Reading k1 makes it the newest on NVMe; promoting it evicts k4 from the host,
        // whose spill reuses the oldest slot now: k2's.
        assert_eq!(s.get(&k[1..2])[0].as_deref(), Some(&nblock(1)[..]));
        flush(&s);
        let st = s.stats();
        assert_eq!((st.nvme_spills, st.nvme_evictions, st.nvme_blocks), (5, 2, 3));
        assert_eq!(
            s.exists(&k),
            vec![None, Some(Located::Host), None, Some(Located::Nvme), Some(Located::Nvme)]
        );
        assert_eq!(s.get(&k[4..])[0].as_deref(), Some(&nblock(4)[..]));
        assert_eq!(s.get(&k[..1]), vec![None]);
    }

    #[test]
    fn a_corrupted_or_unreadable_slot_is_a_counted_miss_and_leaves_the_tier() {
        let dir = tempfile::tempdir().unwrap();
        let s = nvme_store(&dir, 1, 4, 8);
        let k = keys(3, 12);
        s.insert(k[0], nblock(0));
        s.insert(k[1], nblock(1));
        flush(&s);
        // One byte of k0's payload flipped behind the store's back.
        let slot = slot_of(&s, &k[0]);
        let f =
            std::fs::OpenOptions::new().write(true).open(dir.path().join("prefix.nvme")).unwrap();
        let off = u64::from(slot) * NVME_ALIGN as u64 + 17;
        f.write_all_at(&[nblock(0)[17] ^ 0x40], off).unwrap();
        f.sync_all().unwrap();
        assert!(s.lookup(&k[..1]).is_empty(), "never handed out");
        let st = s.stats();
        assert_eq!((st.integrity_misses, st.nvme_hits, st.misses), (1, 0, 1));
        assert_eq!(st.nvme_blocks, 0, "dropped from the index");
        assert_eq!(s.exists(&k[..1]), vec![None]);
        assert_eq!(s.get(&k[..1]), vec![None], "not read again");
        assert_eq!(s.stats().integrity_misses, 1);
        // An I/O error (the file cut short under the tier) is a miss too, counted apart.
        s.insert(k[2], nblock(2));
        flush(&s);
        assert_eq!(s.exists(&k[1..2]), vec![Some(Located::Nvme)]);
        f.set_len(0).unwrap();
        assert_eq!(s.get(&k[1..2]), vec![None]);
        let st = s.stats();
        assert_eq!((st.nvme_errors, st.integrity_misses, st.nvme_hits), (1, 1, 0));
        assert_eq!((st.nvme_blocks, st.get_hits), (0, 0));
        // The tier goes on working (writes extend the file again).
        s.insert(k[0], nblock(0));
        flush(&s);
        assert_eq!(s.get(&k[2..])[0].as_deref(), Some(&nblock(2)[..]));
    }

    #[test]
    fn exists_names_nvme_and_evict_removes_from_both_tiers() {
        let dir = tempfile::tempdir().unwrap();
        let s = nvme_store(&dir, 2, 4, 8);
        let k = keys(4, 13);
        for (i, key) in k.iter().enumerate().take(3) {
            s.insert(*key, nblock(i as u8));
        }
        // k0 back from NVMe into the host (it stays on NVMe); k1 spilled.
        assert!(s.get(&k[..1])[0].is_some());
        flush(&s);
        assert_eq!(
            s.exists(&k),
            vec![Some(Located::Host), Some(Located::Nvme), Some(Located::Host), None]
        );
        assert_eq!(s.stats().nvme_blocks, 2);
        // A pinned block stays on both tiers.
        assert_eq!(s.pin(&k[..1]), vec![true]);
        assert_eq!(s.evict(&k[..1]), vec![false]);
        assert_eq!(s.stats().nvme_blocks, 2);
        assert_eq!(s.unpin(&k[..1]), vec![true]);
        assert_eq!(s.evict(&[k[0], k[1], k[3]]), vec![true, true, false]);
        assert_eq!(s.exists(&k), vec![None, None, Some(Located::Host), None]);
        let st = s.stats();
        assert_eq!((st.nvme_blocks, st.nvme_bytes, st.evicted_by_request), (0, 0, 2));
        assert_eq!(s.get(&k[..2]), vec![None, None]);
        // A spill still queued is cancelled by evict (and the freed slots are reused).
        s.nvme.as_ref().unwrap().set_paused(true);
        s.insert(k[0], nblock(0));
        s.insert(k[1], nblock(1));
        assert_eq!(s.exists(&k[2..3]), vec![Some(Located::Nvme)], "queued counts as NVMe");
        assert_eq!(s.evict(&k[2..3]), vec![true]);
        s.nvme.as_ref().unwrap().set_paused(false);
        flush(&s);
        assert_eq!(s.exists(&k[2..3]), vec![None]);
        let st = s.stats();
        assert_eq!((st.nvme_blocks, st.nvme_spills, st.evicted_by_request), (0, 2, 3));
    }

    #[test]
    fn lookup_runs_across_host_and_nvme() {
        let dir = tempfile::tempdir().unwrap();
        let s = nvme_store(&dir, 4, 8, 8);
        let k = keys(6, 14);
        let filler = keys(4, 15);
        // k1, k3 spilled by four fillers, which are then evicted from the host: the host
        // holds k0 and k2 with room for two more, NVMe holds k1 and k3.
        s.insert(k[1], nblock(1));
        s.insert(k[3], nblock(3));
        for (i, f) in filler.iter().enumerate() {
            s.insert(*f, nblock(100 + i as u8));
        }
        flush(&s);
        assert_eq!(s.evict(&filler), vec![true; 4]);
        s.insert(k[0], nblock(0));
        s.insert(k[2], nblock(2));
        flush(&s);
        let before = s.stats();
        assert_eq!(
            s.exists(&k[..5]),
            vec![
                Some(Located::Host),
                Some(Located::Nvme),
                Some(Located::Host),
                Some(Located::Nvme),
                None
            ]
        );
        let hits = s.lookup(&k[..5]);
        assert_eq!(hits.len(), 4, "host, NVMe, host, NVMe, then the first miss");
        for (i, h) in hits.iter().enumerate() {
            assert_eq!(&h[..], &nblock(i as u8)[..], "block {i}");
        }
        let st = s.stats();
        assert_eq!(st.host_hits - before.host_hits, 2);
        assert_eq!(st.nvme_hits - before.nvme_hits, 2);
        assert_eq!(st.misses - before.misses, 1);
        assert_eq!(st.host_blocks, 4, "both NVMe hits promoted");
        // A leading miss ends the run, whatever follows; an NVMe miss ends it too.
        assert!(s.lookup(&[k[5], k[0]]).is_empty());
        assert_eq!(s.evict(&k[1..2]), vec![true]);
        assert_eq!(s.lookup(&k[..4]).len(), 1);
        let st2 = s.stats();
        assert_eq!(st2.misses - st.misses, 2 + 3);
        assert_eq!(st2.nvme_hits, st.nvme_hits);
    }

    #[test]
    fn pin_reads_an_nvme_block_in_and_a_block_the_host_refuses_goes_to_nvme() {
        let dir = tempfile::tempdir().unwrap();
        let s = nvme_store(&dir, 1, 4, 8);
        let k = keys(3, 19);
        s.insert(k[0], nblock(0));
        s.insert(k[1], nblock(1));
        flush(&s);
        assert_eq!(s.exists(&k[..2]), vec![Some(Located::Nvme), Some(Located::Host)]);
        assert_eq!(s.pin(&k[..1]), vec![true], "read in from NVMe, then pinned");
        flush(&s);
        assert_eq!(s.exists(&k[..2]), vec![Some(Located::Host), Some(Located::Nvme)]);
        let st = s.stats();
        assert_eq!((st.nvme_hits, st.pinned_blocks, st.nvme_spills), (1, 1, 2));
        // The host cache is all pinned: k2 is refused there and written to NVMe instead.
        assert!(s.insert(k[2], nblock(2)));
        flush(&s);
        let st = s.stats();
        assert_eq!((st.host_refused, st.nvme_spills, st.nvme_blocks), (1, 3, 3));
        assert_eq!(s.exists(&k[2..]), vec![Some(Located::Nvme)]);
        assert_eq!(s.get(&k[2..])[0].as_deref(), Some(&nblock(2)[..]));
        assert_eq!(s.unpin(&k[..1]), vec![true]);
    }

    #[test]
    fn a_full_spill_queue_drops_and_counts() {
        let dir = tempfile::tempdir().unwrap();
        let s = nvme_store(&dir, 1, 8, 2);
        let k = keys(5, 16);
        // A device that takes nothing: two spills wait, the next two are dropped.
        s.nvme.as_ref().unwrap().set_paused(true);
        for (i, key) in k.iter().enumerate() {
            s.insert(*key, nblock(i as u8));
        }
        let st = s.stats();
        assert_eq!((st.evictions, st.nvme_spills_dropped, st.nvme_spills), (4, 2, 0));
        assert!(!s.flush(Duration::from_millis(20)), "spills are still pending");
        // Waiting spills are found (served from the queue).
        assert_eq!(s.exists(&k[..4]), vec![Some(Located::Nvme), Some(Located::Nvme), None, None]);
        s.nvme.as_ref().unwrap().set_paused(false);
        flush(&s);
        let st = s.stats();
        assert_eq!((st.nvme_spills, st.nvme_blocks, st.nvme_spills_dropped), (2, 2, 2));
        assert_eq!(s.get(&k[..1])[0].as_deref(), Some(&nblock(0)[..]));
        // Dropping a store with spills queued and its writer stalled does not hang.
        s.nvme.as_ref().unwrap().set_paused(true);
        s.insert(k[2], nblock(2));
        s.insert(k[3], nblock(3));
        drop(s);
    }

    #[test]
    fn nvme_setup_errors_name_the_file_and_new_runs_without_the_tier() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = |path: PathBuf, bytes: u64| PrefixStoreConfig {
            host_bytes: 64,
            block_bytes: 64,
            put_queue_max: 4,
            nvme: Some(PrefixNvmeConfig::new(path, bytes)),
        };
        let missing = dir.path().join("no-such-dir").join("f");
        let e = PrefixStore::open(cfg(missing.clone(), 1 << 20)).unwrap_err();
        assert!(e.to_string().contains("no-such-dir"), "{e}");
        let e = PrefixStore::open(cfg(dir.path().join("small"), 4095)).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
        assert!(e.to_string().contains("no slot of 4096 bytes"), "{e}");
        let s = PrefixStore::new(cfg(missing, 1 << 20));
        assert!(!s.has_nvme());
        assert_eq!(s.nvme_direct_io(), None);
        assert!(s.insert(keys(1, 17)[0], nblock(1)));
        assert_eq!(s.stats().nvme_capacity_blocks, 0);
    }

    #[test]
    fn nvme_tier_on_tmpfs_round_trips() {
        // tmpfs may refuse O_DIRECT (then buffered I/O); either way blocks round-trip.
        let shm = std::path::Path::new("/dev/shm");
        if !shm.is_dir() {
            return;
        }
        let dir = tempfile::tempdir_in(shm).unwrap();
        let s = nvme_store(&dir, 1, 2, 4);
        assert!(s.nvme_direct_io().is_some());
        let k = keys(2, 18);
        s.insert(k[0], nblock(0));
        s.insert(k[1], nblock(1));
        flush(&s);
        assert_eq!(s.get(&k[..1])[0].as_deref(), Some(&nblock(0)[..]));
        assert_eq!(s.stats().nvme_hits, 1);
    }
}
