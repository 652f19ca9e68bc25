//! The content-addressed ops (`PUT` … `EVICT`) of one connection on the server's shared
//! [`PrefixStore`], and the pins it holds.

use super::*;

impl Conn {
    /// Serves a content-addressed op (`None`: `req` is not one). The reply body is one `u8`
    /// per key, in request order.
    pub(super) fn content_addressed(
        &mut self,
        slab: Slab,
        req: &Request,
    ) -> Option<Result<Vec<u8>, Refusal>> {
        let r = match req {
            Request::Put { items } => self.put(slab, items),
            Request::Get { items } => self.get(slab, items),
            Request::Exists { keys } => self.with_store(keys, |_, store, keys| {
                let code = |l: Option<Located>| match l {
                    None => located::ABSENT,
                    Some(Located::Host) => located::HOST,
                    Some(Located::Nvme) => located::NVME,
                    Some(Located::Cluster) => located::CLUSTER,
                };
                store.exists(keys).into_iter().map(code).collect()
            }),
            Request::Pin { keys } => self.with_store(keys, Conn::pin),
            Request::Unpin { keys } => self.with_store(keys, Conn::unpin),
            Request::Evict { keys } => self.with_store(keys, |_, store, keys| {
                store.evict(keys).into_iter().map(u8::from).collect()
            }),
            _ => return None,
        };
        Some(r)
    }

    /// The store, or the refusal of a server without one.
    fn store(&self) -> Result<Arc<PrefixStore>, Refusal> {
        self.store.clone().ok_or_else(|| {
            (
                ErrorCode::StoreDisabled,
                "this kv server has no content-addressed store (started with --cas-bytes 0)".into(),
            )
        })
    }

    /// The store keys of a client's keys: each qualified by this connection's namespace.
    fn store_keys<'a>(&self, keys: impl IntoIterator<Item = &'a Key>) -> Vec<BlockKey> {
        // HELLO sets the slab and the namespace together; ops reach here only after it.
        let ns = self.namespace.as_deref().unwrap_or_default();
        keys.into_iter().map(|k| BlockKey::in_namespace(ns, k)).collect()
    }

    /// A key-only op: the store keys, then `f` with them.
    fn with_store(
        &mut self,
        keys: &[Key],
        f: impl FnOnce(&mut Conn, &PrefixStore, &[BlockKey]) -> Vec<u8>,
    ) -> Result<Vec<u8>, Refusal> {
        let store = self.store()?;
        let keys = self.store_keys(keys);
        Ok(f(self, &store, &keys))
    }

    /// Checks that every block is this connection's to copy to or from: in its slab, held by
    /// one of its sequences (`ALLOC`), not read or written by a transfer in flight, and (with
    /// `distinct`) named once.
    ///
    /// What this checks stays true until this connection's next request: only this
    /// connection's own requests, served one at a time on this thread, allocate, free, pin
    /// or drop blocks of its slab (other connections allocate in their own slabs only).
    fn check_blocks(&self, slab: Slab, blocks: &[u32], distinct: bool) -> Result<(), Refusal> {
        let range = slab.range();
        let mut e = self.engine();
        for (i, &b) in blocks.iter().enumerate() {
            let ours = range.contains(&b)
                && e.block_owner(BlockId(b)).is_some_and(|s| s.0 >> 32 == self.id);
            if !ours {
                return Err((
                    ErrorCode::BlockNotOwned,
                    format!(
                        "block {b} (key {i}) is not held by a sequence of this connection                          (its slab is {range:?}; ALLOC blocks before PUT or GET)"
                    ),
                ));
            }
        }
        let ids: Vec<BlockId> = blocks.iter().map(|b| BlockId(*b)).collect();
        if let Some(b) = e.first_pinned(&ids) {
            return Err((
                ErrorCode::BlockPinned,
                format!("block {b} is being swapped; COMPLETE its transfer first"),
            ));
        }
        drop(e);
        if distinct {
            let mut seen = HashSet::with_capacity(blocks.len());
            if let Some(b) = blocks.iter().find(|b| !seen.insert(**b)) {
                return Err((
                    ErrorCode::DuplicateBlock,
                    format!("block {b} is named twice: a GET writes each block once"),
                ));
            }
        }
        Ok(())
    }

    /// `PUT`: copies each block into the store under its key; per key 1 stored, 0 refused.
    fn put(&mut self, slab: Slab, items: &[(Key, u32)]) -> Result<Vec<u8>, Refusal> {
        let store = self.store()?;
        let blocks: Vec<u32> = items.iter().map(|i| i.1).collect();
        self.check_blocks(slab, &blocks, false)?;
        let keys = self.store_keys(items.iter().map(|i| &i.0));
        let bb = self.device.block_bytes();
        let mut out = Vec::with_capacity(items.len());
        for (key, &b) in keys.into_iter().zip(&blocks) {
            let mut data = Arc::<[u8]>::new_uninit_slice(bb);
            let Some(dst) = Arc::get_mut(&mut data) else {
                return Err((ErrorCode::Other, "fresh block buffer is shared".into()));
            };
            // SAFETY:
            // - `dst` is a fresh buffer of `bb` = block_bytes bytes, writable and ours alone.
            // - `b` is a block of this connection's slab, held by one of its sequences and
            //   pinned by no transfer (`check_blocks`), and nothing but this thread's requests
            //   can start one on it before this copy ends: no worker writes it meanwhile.
            //   (The client may write its own mapping meanwhile; it then stores torn bytes of
            //   its own, as with a swap-out.)
            if let Err(e) = unsafe { self.device.read_block(BlockId(b), dst.as_mut_ptr().cast()) } {
                return Err((ErrorCode::of(&e), e.to_string()));
            }
            // SAFETY: `read_block` wrote all `bb` bytes (it returned Ok).
            let data = unsafe { data.assume_init() };
            out.push(u8::from(store.insert(key, data)));
        }
        Ok(out)
    }

    /// `GET`: copies each hit into its block; per key 1 hit (the block now holds it), 0 miss
    /// (the block is untouched).
    fn get(&mut self, slab: Slab, items: &[(Key, u32)]) -> Result<Vec<u8>, Refusal> {
        let store = self.store()?;
        let blocks: Vec<u32> = items.iter().map(|i| i.1).collect();
        self.check_blocks(slab, &blocks, true)?;
        let keys = self.store_keys(items.iter().map(|i| &i.0));
        let bb = self.device.block_bytes();
        let mut out = Vec::with_capacity(items.len());
        for (hit, &b) in store.get(&keys).into_iter().zip(&blocks) {
            let Some(data) = hit.filter(|d| d.len() == bb) else {
                out.push(0);
                continue;
            };
            // SAFETY:
            // - `data` holds `bb` = block_bytes readable bytes (checked above), kept alive by
            //   its `Arc` for the call.
            // - `b` is a block of this connection's slab held by one of its sequences, pinned by
            //   no transfer and named once in this request (`check_blocks`); only this thread's
            //   requests could start a transfer on it, so no worker reads or writes it
            //   meanwhile.
            if let Err(e) = unsafe { self.device.write_block(BlockId(b), data.as_ptr()) } {
                return Err((ErrorCode::of(&e), e.to_string()));
            }
            out.push(1);
        }
        Ok(out)
    }

    /// `PIN`: per key 1 when pinned for this connection, 0 when the block is on no tier,
    /// cannot be held in host memory, or this connection holds [`PINS_PER_KEY_MAX`] pins of it.
    fn pin(&mut self, store: &PrefixStore, keys: &[BlockKey]) -> Vec<u8> {
        let mut out = vec![0u8; keys.len()];
        let (asked, at) = self
            .pin_requests(keys, |held, pending| held.saturating_add(pending) < PINS_PER_KEY_MAX);
        for ((k, i), ok) in asked.iter().zip(at).zip(store.pin(&asked)) {
            if ok {
                *self.pins.entry(*k).or_insert(0) += 1;
                out[i] = 1;
            }
        }
        out
    }

    /// `UNPIN`: per key 1 when one of this connection's pins of it was released, 0 when this
    /// connection holds none (another connection's pins are not its to release).
    fn unpin(&mut self, store: &PrefixStore, keys: &[BlockKey]) -> Vec<u8> {
        let mut out = vec![0u8; keys.len()];
        let (asked, at) = self.pin_requests(keys, |held, pending| pending < held);
        for ((k, i), ok) in asked.iter().zip(at).zip(store.unpin(&asked)) {
            if ok {
                out[i] = 1;
            }
            // Our count goes down either way: a pin the store no longer has is not ours.
            if let Some(n) = self.pins.get_mut(k) {
                *n -= 1;
                if *n == 0 {
                    self.pins.remove(k);
                }
            }
        }
        out
    }

    /// The keys of a PIN or UNPIN to pass to the store, and their positions in `keys`: a key
    /// goes on while `ok(pins this connection holds, times it is already in this request)`.
    fn pin_requests(
        &self,
        keys: &[BlockKey],
        ok: impl Fn(u32, u32) -> bool,
    ) -> (Vec<BlockKey>, Vec<usize>) {
        let mut asked = Vec::with_capacity(keys.len());
        let mut at = Vec::with_capacity(keys.len());
        let mut pending: HashMap<BlockKey, u32> = HashMap::new();
        for (i, k) in keys.iter().enumerate() {
            let held = self.pins.get(k).copied().unwrap_or(0);
            let p = pending.entry(*k).or_insert(0);
            if ok(held, *p) {
                *p += 1;
                asked.push(*k);
                at.push(i);
            }
        }
        (asked, at)
    }

    /// Releases every pin this connection still holds (it is closing).
    pub(super) fn release_pins(&mut self) {
        let Some(store) = self.store.clone() else { return };
        let mut released = 0u64;
        for (k, n) in self.pins.drain() {
            // In slices, so that a key pinned many times does not need one long vector.
            let mut left = n as usize;
            while left > 0 {
                let now = left.min(1024);
                released += store.unpin(&vec![k; now]).iter().filter(|u| **u).count() as u64;
                left -= now;
            }
        }
        if released > 0 {
            self.counters.pins_released_on_close.fetch_add(released, Ordering::Relaxed);
            log::debug!("kv serve: connection {} closed holding {released} pins", self.id);
        }
    }
}
