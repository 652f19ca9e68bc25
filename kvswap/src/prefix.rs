//! A content-addressed store of KV blocks for prefix reuse: an in-process host-memory LRU
//! bounded in bytes, optionally backed by a shared [`ClusterTier`].
//!
//! Blocks are named by [`BlockKey`] (chained hashes of a model digest and token ids, see
//! [`cas`](crate::cas)), so a block stored by one sequence is found by any later sequence, on
//! this process or (through the cluster) on another, whose prompt starts with the same tokens.
//!
//! - [`PrefixStore::lookup`] returns the longest run of *leading* hits for a sequence's keys:
//!   the host cache first, and from the first host miss on the cluster (one pipelined batch);
//!   a block the cluster returns is verified there (key, length, CRC32C) and inserted into the
//!   host cache. A block that fails verification, or any cluster error, is a miss.
//! - [`PrefixStore::insert`] puts a block into the host cache at once and queues it for the
//!   cluster; a background thread drains that bounded queue (a full queue drops the put and
//!   counts it), so callers never wait for the network on the way in.
//! - Values are `Arc<[u8]>`: a block handed out by `lookup` stays valid after the cache
//!   evicts it, and the same bytes serve the host cache and the queued cluster put.
//!
//! Every count in [`PrefixStats`] is exact (atomics updated where the event happens).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
#[cfg(feature = "cluster")]
use std::sync::mpsc::{self, Receiver};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::cas::BlockKey;
#[cfg(feature = "cluster")]
use crate::cluster::{BlockGet, ClusterTier, MissReason};

/// Puts waiting for the cluster at most (beyond: dropped and counted).
pub const PUT_QUEUE_MAX: usize = 256;
/// Blocks sent to the cluster in one pipelined batch at most.
pub const PUT_BATCH_MAX: usize = 16;

/// Settings of a [`PrefixStore`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixStoreConfig {
    /// Bytes of block payload the host cache holds at most (0: no host cache).
    pub host_bytes: usize,
    /// Bytes of every block (a block of another size is refused).
    pub block_bytes: usize,
    /// Puts waiting for the cluster at most.
    pub put_queue_max: usize,
}

/// Counters of a [`PrefixStore`] since it was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PrefixStats {
    /// `lookup` calls.
    pub lookups: u64,
    /// Keys asked for by `lookup`.
    pub blocks_looked_up: u64,
    /// Blocks served from the host cache.
    pub host_hits: u64,
    /// Blocks served from the cluster (and inserted into the host cache).
    pub cluster_hits: u64,
    /// Keys asked for and not served (the first miss of a lookup and every key after it).
    pub misses: u64,
    /// Cluster values that failed verification (key, length, CRC32C) and were misses.
    pub integrity_misses: u64,
    /// Cluster calls that failed (timeout, connection, cluster down); their keys were misses.
    pub cluster_errors: u64,
    /// Payload bytes received from the cluster as hits.
    pub bytes_in: u64,
    /// Payload bytes the cluster acknowledged storing.
    pub bytes_out: u64,
    /// Blocks inserted into the host cache (by `insert` or a cluster hit).
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
}

#[derive(Debug, Default)]
struct Counters {
    lookups: AtomicU64,
    blocks_looked_up: AtomicU64,
    host_hits: AtomicU64,
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
    /// Puts queued and not yet finished (for [`PrefixStore::flush`]).
    pending_puts: AtomicU64,
}

fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// A host-cache entry: the block, its recency tick, and how many pins hold it.
#[derive(Debug)]
struct Entry {
    data: Arc<[u8]>,
    tick: u64,
    pins: u32,
}

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

    /// Inserts (or refreshes) `key`; `Some(blocks evicted to make room)`, or `None` when the
    /// block cannot fit (larger than the cache, or the rest of it pinned).
    fn insert(&mut self, key: BlockKey, data: Arc<[u8]>, cap: usize) -> Option<u64> {
        if self.get(&key).is_some() {
            return Some(0);
        }
        if self.pinned + data.len() > cap {
            return None;
        }
        let mut evicted = 0;
        // Bounded: each pass removes one unpinned entry, and the pinned bytes alone leave
        // room (checked above).
        while self.bytes + data.len() > cap {
            let Some((_, old)) = self.order.pop_first() else { break };
            if let Some(e) = self.map.remove(&old) {
                self.bytes -= e.data.len();
            }
            evicted += 1;
        }
        self.tick += 1;
        self.bytes += data.len();
        self.order.insert(self.tick, key);
        self.map.insert(key, Entry { data, tick: self.tick, pins: 0 });
        Some(evicted)
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

/// Where a block was found by [`PrefixStore::exists`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum Located {
    /// In this process's host cache.
    Host,
    /// In this process's NVMe tier.
    Nvme,
    /// In the shared cluster (a hint: the value is not read, a later get may still miss).
    Cluster,
}

/// The store. `Send + Sync`: one engine thread inserts while another thread looks up.
/// Dropping it lets the cluster writer finish the puts already queued, then joins it.
#[derive(Debug)]
pub struct PrefixStore {
    cfg: PrefixStoreConfig,
    host: Mutex<HostLru>,
    #[cfg(feature = "cluster")]
    cluster: Option<Arc<ClusterTier>>,
    puts: Option<SyncSender<(BlockKey, Arc<[u8]>)>>,
    writer: Option<JoinHandle<()>>,
    counters: Arc<Counters>,
}

impl PrefixStore {
    /// A store with a host cache only.
    pub fn new(cfg: PrefixStoreConfig) -> PrefixStore {
        PrefixStore {
            cfg,
            host: Mutex::new(HostLru::default()),
            #[cfg(feature = "cluster")]
            cluster: None,
            puts: None,
            writer: None,
            counters: Arc::new(Counters::default()),
        }
    }

    /// A store backed by `cluster`, with its writer thread.
    #[cfg(feature = "cluster")]
    pub fn with_cluster(
        cfg: PrefixStoreConfig,
        cluster: ClusterTier,
    ) -> Result<PrefixStore, std::io::Error> {
        let cluster = Arc::new(cluster);
        let (tx, rx) = mpsc::sync_channel(cfg.put_queue_max.max(1));
        let counters = Arc::new(Counters::default());
        let (c2, k2) = (cluster.clone(), counters.clone());
        let writer = std::thread::Builder::new()
            .name("kvswap-prefix-put".into())
            .spawn(move || write_loop(&c2, &k2, rx))?;
        Ok(PrefixStore {
            cfg,
            host: Mutex::new(HostLru::default()),
            cluster: Some(cluster),
            puts: Some(tx),
            writer: Some(writer),
            counters,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &PrefixStoreConfig {
        &self.cfg
    }

    /// Whether a cluster backs the host cache.
    pub fn has_cluster(&self) -> bool {
        self.puts.is_some()
    }

    fn host(&self) -> std::sync::MutexGuard<'_, HostLru> {
        // A panic while holding the lock leaves a consistent map (no partial updates across
        // an unwind point that matter): keep using it.
        self.host.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The longest run of leading hits for `keys` (a sequence's block keys in order): host
    /// cache first, then the cluster from the first host miss on. Cluster hits are verified
    /// and inserted into the host cache. Blocks one thread at a time on the cluster, bounded
    /// by its timeout.
    pub fn lookup(&self, keys: &[BlockKey]) -> Vec<Arc<[u8]>> {
        let c = &self.counters;
        add(&c.lookups, 1);
        add(&c.blocks_looked_up, keys.len() as u64);
        let mut out = Vec::with_capacity(keys.len());
        {
            let mut h = self.host();
            for k in keys {
                match h.get(k) {
                    Some(d) => out.push(d),
                    None => break,
                }
            }
        }
        add(&c.host_hits, out.len() as u64);
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

    /// Per-key reads (not a leading run): host cache first, then the cluster for the keys
    /// the host missed (one pipelined batch). Cluster hits are verified and inserted into the
    /// host cache. `None` is a miss.
    pub fn get(&self, keys: &[BlockKey]) -> Vec<Option<Arc<[u8]>>> {
        let c = &self.counters;
        add(&c.gets, keys.len() as u64);
        #[cfg_attr(not(feature = "cluster"), allow(unused_mut))]
        let mut out: Vec<Option<Arc<[u8]>>> = {
            let mut h = self.host();
            keys.iter().map(|k| h.get(k)).collect()
        };
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

    /// Where each key is, nearest tier first; `None`: on no tier. Does not refresh recency.
    pub fn exists(&self, keys: &[BlockKey]) -> Vec<Option<Located>> {
        #[cfg_attr(not(feature = "cluster"), allow(unused_mut))]
        let mut out: Vec<Option<Located>> = {
            let h = self.host();
            keys.iter().map(|k| h.map.contains_key(k).then_some(Located::Host)).collect()
        };
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

    /// Removes each key from this process's tiers (host cache); `false` for a key absent
    /// there or pinned. Copies in the shared cluster stay (other engines may use them; the
    /// cluster's own LRU ages them out).
    pub fn evict(&self, keys: &[BlockKey]) -> Vec<bool> {
        let out: Vec<bool> = {
            let mut h = self.host();
            keys.iter().map(|k| h.remove(k)).collect()
        };
        add(&self.counters.evicted_by_request, out.iter().filter(|&&p| p).count() as u64);
        out
    }

    fn insert_host(&self, key: BlockKey, data: Arc<[u8]>) -> bool {
        if data.len() > self.cfg.host_bytes {
            return false;
        }
        let Some(evicted) = self.host().insert(key, data, self.cfg.host_bytes) else {
            add(&self.counters.host_refused, 1);
            return false;
        };
        add(&self.counters.evictions, evicted);
        add(&self.counters.host_inserts, 1);
        true
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

    /// Waits (at most `timeout`) until every queued cluster put has finished; `true` if so.
    pub fn flush(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        // Bounded by the deadline.
        while self.counters.pending_puts.load(Ordering::Acquire) > 0 {
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
        PrefixStats {
            lookups: l(&c.lookups),
            blocks_looked_up: l(&c.blocks_looked_up),
            host_hits: l(&c.host_hits),
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
        }
    }
}

impl Drop for PrefixStore {
    fn drop(&mut self) {
        // Closing the queue ends the writer after what is queued (each put bounded by the
        // cluster's timeout).
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
}
