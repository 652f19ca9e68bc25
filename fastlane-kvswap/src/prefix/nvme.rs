//! The NVMe tier: a file of fixed slots under the host cache, its index and recency in
//! memory, and the spill thread that writes evicted blocks into it.

use super::*;

/// A block in the NVMe tier: its slot, and what a read of it must give back.
#[derive(Debug)]
pub(super) struct NvmeEntry {
    pub(super) slot: u32,
    pub(super) len: u32,
    pub(super) crc: u32,
    pub(super) tick: u64,
}

/// The NVMe tier's index and spill queue (one lock; no I/O is done while holding it).
#[derive(Debug, Default)]
pub(super) struct NvmeState {
    pub(super) map: HashMap<BlockKey, NvmeEntry>,
    /// Recency: tick → key, oldest first.
    pub(super) order: BTreeMap<u64, BlockKey>,
    pub(super) tick: u64,
    /// Payload bytes of the blocks in `map`.
    pub(super) bytes: u64,
    /// Slots in no entry and not being written.
    pub(super) free: Vec<u32>,
    /// Per slot, bumped whenever a write claims it: a read that started before sees the
    /// change and discards what it read (the block had left the slot).
    pub(super) gens: Vec<u64>,
    /// Spills waiting for the writer, oldest first.
    pub(super) queue: VecDeque<BlockKey>,
    /// Payloads of the spills queued or being written (bounded by the queue limit); lookups
    /// are served from them.
    pub(super) queued: HashMap<BlockKey, Arc<[u8]>>,
    /// The writer takes no new spill (tests: a stalled device).
    pub(super) paused: bool,
    /// The store is going away: the writer ends, abandoning the queue.
    pub(super) closed: bool,
}

impl NvmeState {
    /// Refreshes a written `key`'s recency; `(slot, len, crc)`, or `None` when absent.
    pub(super) fn touch(&mut self, key: &BlockKey) -> Option<(u32, u32, u32)> {
        let e = self.map.get_mut(key)?;
        self.order.remove(&e.tick);
        self.tick += 1;
        e.tick = self.tick;
        self.order.insert(self.tick, *key);
        Some((e.slot, e.len, e.crc))
    }

    /// Drops a written `key` (its slot becomes free); `false` when absent.
    pub(super) fn remove(&mut self, key: &BlockKey) -> bool {
        let Some(e) = self.map.remove(key) else { return false };
        self.order.remove(&e.tick);
        self.bytes -= u64::from(e.len);
        self.free.push(e.slot);
        true
    }

    pub(super) fn gen(&self, slot: u32) -> Option<u64> {
        self.gens.get(slot as usize).copied()
    }
}

/// The NVMe tier: a file of `slots` fixed slots of `slot_bytes`, read and written at slot
/// offsets through page-aligned bounce buffers (so `O_DIRECT` accepts every transfer).
#[derive(Debug)]
pub(super) struct NvmeTier {
    pub(super) file: File,
    pub(super) path: PathBuf,
    /// Opened with `O_DIRECT` (else buffered: the filesystem refused it).
    pub(super) direct: bool,
    pub(super) slot_bytes: usize,
    pub(super) slots: u32,
    pub(super) queue_max: usize,
    pub(super) state: Mutex<NvmeState>,
    /// Wakes the writer: a spill queued, the queue resumed, the store closing.
    pub(super) wake: Condvar,
    /// Idle read bounce buffers (each `slot_bytes`, page aligned).
    pub(super) bufs: Mutex<Vec<MmapMut>>,
}

/// What a read of the NVMe tier gave.
pub(super) enum NvmeRead {
    Hit(Arc<[u8]>),
    Miss,
}

impl NvmeTier {
    /// Opens (creating and preallocating a regular file) the tier; also returns the writer's
    /// bounce buffer. Errors name the path and the step.
    pub(super) fn open(
        cfg: &PrefixNvmeConfig,
        block_bytes: usize,
    ) -> std::io::Result<(NvmeTier, MmapMut)> {
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

    pub(super) fn state(&self) -> MutexGuard<'_, NvmeState> {
        lock(&self.state)
    }

    pub(super) fn offset(&self, slot: u32) -> u64 {
        u64::from(slot) * self.slot_bytes as u64
    }

    /// Queues `data` to be written, unless it is there already (then it counts as used now)
    /// or queued. A full queue drops it (counted).
    pub(super) fn spill(&self, key: BlockKey, data: Arc<[u8]>, c: &Counters) {
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
    pub(super) fn read(&self, key: &BlockKey, c: &Counters) -> NvmeRead {
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
    pub(super) fn read_slot(
        &self,
        slot: u32,
        len: usize,
        crc: u32,
    ) -> std::io::Result<Option<Arc<[u8]>>> {
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
    pub(super) fn remove(&self, key: &BlockKey) -> bool {
        let mut st = self.state();
        let written = st.remove(key);
        // A spill being written is finished by the writer, which then frees its slot.
        let queued = st.queued.remove(key).is_some();
        if queued {
            st.queue.retain(|k| k != key);
        }
        written || queued
    }

    pub(super) fn contains(&self, key: &BlockKey) -> bool {
        let st = self.state();
        st.map.contains_key(key) || st.queued.contains_key(key)
    }

    /// Spills queued or being written.
    pub(super) fn pending(&self) -> usize {
        self.state().queued.len()
    }

    pub(super) fn close(&self) {
        self.state().closed = true;
        self.wake.notify_all();
    }

    #[cfg(test)]
    pub(super) fn set_paused(&self, paused: bool) {
        self.state().paused = paused;
        self.wake.notify_all();
    }
}

/// Gives `file` at least `len` bytes of allocated space (`fallocate`; where the filesystem
/// cannot, a sparse `set_len` when it is shorter).
pub(super) fn preallocate(file: &File, len: u64, now: u64) -> std::io::Result<()> {
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
pub(super) fn spill_loop(tier: &NvmeTier, c: &Counters, mut buf: MmapMut) {
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
