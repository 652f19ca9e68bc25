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
//!
//! Where the code is: this file holds the configuration, the counters and [`PrefixStore`]
//! (lookup, insert, pins, the cluster writer); `host.rs` the host LRU; `nvme.rs` the NVMe tier
//! and its spill thread; `tests.rs` the unit tests.

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

mod host;
mod nvme;
#[cfg(test)]
mod tests;

use host::{Evicted, HostLru};
use nvme::{spill_loop, NvmeRead, NvmeTier};

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
