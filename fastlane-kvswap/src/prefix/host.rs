//! The host cache: blocks by key in memory, least recently used evicted first, pinned ones
//! never.

use super::*;

/// A host-cache entry: the block, its recency tick, and how many pins hold it.
#[derive(Debug)]
pub(super) struct Entry {
    pub(super) data: Arc<[u8]>,
    pub(super) tick: u64,
    pub(super) pins: u32,
}

/// Blocks the host cache evicted, for the NVMe tier.
pub(super) type Evicted = Vec<(BlockKey, Arc<[u8]>)>;

/// The host cache: blocks by key, recency by a tick (`order` maps tick → key, oldest first).
/// A pinned entry is not in `order`, so eviction never reaches it.
#[derive(Debug, Default)]
pub(super) struct HostLru {
    pub(super) map: HashMap<BlockKey, Entry>,
    pub(super) order: BTreeMap<u64, BlockKey>,
    pub(super) tick: u64,
    pub(super) bytes: usize,
    /// Bytes and blocks of pinned entries.
    pub(super) pinned: usize,
    pub(super) pinned_blocks: usize,
}

impl HostLru {
    pub(super) fn get(&mut self, key: &BlockKey) -> Option<Arc<[u8]>> {
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
    pub(super) fn insert(
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
    pub(super) fn pin(&mut self, key: &BlockKey) -> bool {
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
    pub(super) fn unpin(&mut self, key: &BlockKey) -> bool {
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
    pub(super) fn remove(&mut self, key: &BlockKey) -> bool {
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
