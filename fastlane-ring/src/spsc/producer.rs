//! The writing end: [`Producer`] and the chunk of free slots it lends, [`WriteChunkUninit`].

use super::*;

/// The writing end of a ring. Move it to the producer thread; it is `Send` (for `T: Send`) but
/// not `Sync`, since every operation takes `&mut self` anyway.
///
/// ```compile_fail
/// fn is_sync<S: Sync>() {}
/// is_sync::<fastlane_ring::spsc::Producer<u64>>();
/// ```
pub struct Producer<T> {
    pub(super) header: NonNull<Header>,
    pub(super) slots: NonNull<T>,
    pub(super) mask: usize,
    /// Our own index; the shared `tail` is a published copy of it.
    pub(super) tail: usize,
    /// The consumer's `head`, as last loaded.
    pub(super) head_cache: usize,
    pub(super) strategy: WaitStrategy,
    /// Pauses before `push_blocking` looks again at a full ring (module docs, "Settling").
    pub(super) settle: u32,
    /// The most `settle` may grow to.
    pub(super) settle_limit: u32,
    /// Whether anyone can sleep on a park flag of this channel.
    pub(super) parks: bool,
    pub(super) _owns: PhantomData<T>,
}

// SAFETY:
// - The producer hands `T`s to another thread, so it needs `T: Send`, and needs nothing more:
//   everything it shares with the consumer is reached through atomics, or through slots whose
//   exclusive use is handed over by the Release/Acquire pairs on `head` and `tail`.
unsafe impl<T: Send> Send for Producer<T> {}

impl<T> Producer<T> {
    pub(super) fn header(&self) -> &Header {
        // SAFETY:
        // - The allocation lives until both sides have called `release`, and this side only
        //   does so in its `Drop`.
        unsafe { self.header.as_ref() }
    }

    /// How many items the ring holds when full (a power of two).
    pub fn capacity(&self) -> usize {
        self.mask + 1
    }

    /// The strategy the blocking variants of this channel wait with.
    pub fn strategy(&self) -> WaitStrategy {
        self.strategy
    }

    /// The most `pause`s `push_blocking` waits before its first look at a full ring when the
    /// consumer frees slots in batches (module docs, "Settling"); 0 never settles. Defaults to
    /// [`default_settle_limit`].
    pub fn set_settle_limit(&mut self, pauses: u32) {
        self.settle_limit = pauses;
        self.settle = self.settle.min(pauses);
    }

    fn free_cached(&self) -> usize {
        self.capacity() - self.tail.wrapping_sub(self.head_cache)
    }

    /// Reloads the consumer's index; returns the free slots.
    fn refresh_head(&mut self) -> usize {
        // Acquire pairs with the Release store of `head` in `Consumer::publish`: the consumer
        // finished moving out of (or dropping) every slot below that head before storing it, so
        // we may overwrite them.
        self.head_cache = self.header().cons.head.load(Ordering::Acquire);
        self.free_cached()
    }

    /// Makes every slot below `tail` readable by the consumer and wakes it if it sleeps.
    fn publish(&mut self, tail: usize) {
        self.tail = tail;
        let h = self.header();
        // Release pairs with the Acquire load of `tail` in `Consumer::refresh_tail` (and in the
        // consumer's wait condition): our slot writes happen-before its reads of those slots.
        h.prod.tail.store(tail, Ordering::Release);
        if self.parks {
            h.prod.consumer_wait.notify(Scope::Private);
        }
    }

    /// Appends `value`, or hands it back in [`PushError::Full`] when there is no room.
    /// Never waits and never allocates.
    pub fn push(&mut self, value: T) -> Result<(), PushError<T>> {
        if self.free_cached() == 0 && self.refresh_head() == 0 {
            return Err(PushError::Full(value));
        }
        let index = self.tail;
        slot_access(self.header(), index);
        // SAFETY:
        // - The slot is inside the allocation and aligned (`slot_ptr`).
        // - It is free: `index - head_cache < capacity`, and the consumer will not read it before
        //   the `tail` store in `publish` below. It holds no value (it was never written, or its
        //   value was moved out or dropped before the consumer published a head past it), so
        //   nothing is leaked by overwriting it.
        unsafe { slot_ptr(self.slots, self.mask, index).write(value) };
        self.publish(index.wrapping_add(1));
        Ok(())
    }

    /// Like [`push`](Self::push), but waits with the channel's strategy while the ring is full,
    /// until `deadline` (forever if `None`). Returns [`PushError::Full`] if the deadline passed
    /// and [`PushError::Abandoned`] if the consumer is gone and the ring is full. Before the
    /// first look after finding the ring full it may pause briefly, more when the consumer frees
    /// slots in batches (module docs, "Settling").
    #[inline(always)]
    pub fn push_blocking(
        &mut self,
        mut value: T,
        deadline: Option<Instant>,
    ) -> Result<(), PushError<T>> {
        value = match self.push(value) {
            Ok(()) => return Ok(()),
            Err(e) => e.into_inner(),
        };
        // The wait is out of line and gets the header and copies, never `self`: a call that
        // received the handle's address would make the compiler keep its fields in memory in
        // the caller's loop (see `Drop`). The fast path above stays inline.
        let mut settle = self.settle;
        loop {
            let ready = wait_for_room(
                self.header(),
                self.tail,
                self.capacity(),
                self.strategy,
                settle,
                deadline,
            );
            settle = 0;
            let gone = self.is_abandoned();
            value = match self.push(value) {
                Ok(()) => {
                    self.settle =
                        next_settle(self.settle, self.free_cached() + 1, self.settle_limit);
                    return Ok(());
                }
                Err(e) => e.into_inner(),
            };
            if gone {
                return Err(PushError::Abandoned(value));
            }
            if !ready {
                return Err(PushError::Full(value));
            }
        }
    }

    /// Up to two slices of `n` free slots, to be written in place and then published with
    /// [`WriteChunkUninit::commit`] or [`WriteChunkUninit::fill_from_iter`]. Fails with the
    /// number of free slots if there are fewer than `n`. When there is room for another `n`
    /// after these, it also asks the CPU for that next chunk's lines, for writing (a hint).
    pub fn write_chunk_uninit(&mut self, n: usize) -> Result<WriteChunkUninit<'_, T>, ChunkError> {
        let free = if self.free_cached() < n { self.refresh_head() } else { self.free_cached() };
        if free < n {
            return Err(ChunkError::TooFewSlots(free));
        }
        let start = self.tail & self.mask;
        let first_len = n.min(self.capacity() - start);
        if free >= 2 * n {
            // The next chunk's lines were last read by the consumer, a lap ago: ask for them
            // now, owned, so that their transfer overlaps this chunk's writes (BENCHMARKS.md,
            // fastlane-ring: a few per cent of chunk throughput between cores, mostly for
            // records).
            prefetch_slots_for_write(self.slots, self.mask, self.tail.wrapping_add(n), n);
        }
        for i in 0..n {
            slot_access(self.header(), self.tail.wrapping_add(i));
        }
        Ok(WriteChunkUninit {
            first: slot_ptr(self.slots, self.mask, self.tail).cast::<MaybeUninit<T>>(),
            first_len,
            second: self.slots.as_ptr().cast::<MaybeUninit<T>>(),
            second_len: n - first_len,
            producer: self,
        })
    }

    /// Free slots now (reads the consumer's index).
    pub fn slots(&self) -> usize {
        self.capacity() - self.len()
    }

    /// Items in the ring now (reads the consumer's index).
    pub fn len(&self) -> usize {
        // Acquire pairs with the Release store of `head` in `Consumer::publish`.
        self.tail.wrapping_sub(self.header().cons.head.load(Ordering::Acquire))
    }

    /// Whether the ring is empty now.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the ring is full now.
    pub fn is_full(&self) -> bool {
        self.slots() == 0
    }

    /// Whether the consumer has been dropped.
    pub fn is_abandoned(&self) -> bool {
        // Acquire pairs with the Release store in `Consumer::drop`.
        self.header().ctl.consumer_gone.load(Ordering::Acquire) != 0
    }
}

impl<T> Drop for Producer<T> {
    /// Inlined (and `release` kept out of line) so that no call ever receives the handle's
    /// address. When `drop_in_place::<Producer<Rec64>>` was an out-of-line call, the handle had
    /// escaped, and in the push loop before it the compiler kept `tail`, `head_cache` and the
    /// mask in memory: the park path's futex call might, for all it knew, read or write them.
    /// That was loads and a store per push, and 5-15 % of one-at-a-time throughput
    /// (BENCHMARKS.md, fastlane-ring). The same holds for `Consumer`.
    #[inline(always)]
    fn drop(&mut self) {
        let h = self.header();
        // Release pairs with the Acquire loads of `producer_gone` in the consumer: whoever sees
        // the flag also sees our last `tail` store.
        h.ctl.producer_gone.store(1, Ordering::Release);
        if self.parks {
            // A consumer asleep in `pop_blocking` must wake up to see that we are gone. This is
            // the same handshake as after a publish: the flag store above, then the fence in
            // `notify`, against the consumer's park-flag store, fence, and load of the flag.
            h.prod.consumer_wait.notify(Scope::Private);
        }
        // SAFETY:
        // - `header` and `slots` come from `channel_with`; this is the producer's only call, and
        //   `self` is not used afterwards.
        unsafe { release::<T>(self.header, self.slots) };
    }
}

impl<T> fmt::Debug for Producer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Producer")
            .field("capacity", &self.capacity())
            .field("tail", &self.tail)
            .field("head_cache", &self.head_cache)
            .field("strategy", &self.strategy)
            .field("settle", &self.settle)
            .field("settle_limit", &self.settle_limit)
            .finish_non_exhaustive()
    }
}

/// Free slots of a ring, borrowed from its [`Producer`], in up to two slices (the second starts
/// at slot 0 when the chunk wraps). Nothing is published until a `commit`; dropping the chunk
/// publishes nothing (and leaks whatever was written into it).
pub struct WriteChunkUninit<'a, T> {
    first: *mut MaybeUninit<T>,
    first_len: usize,
    second: *mut MaybeUninit<T>,
    second_len: usize,
    producer: &'a mut Producer<T>,
}

impl<T> WriteChunkUninit<'_, T> {
    /// Number of slots in the chunk.
    pub fn len(&self) -> usize {
        self.first_len + self.second_len
    }

    /// Whether the chunk has no slots.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The slots, in ring order: write the first `k` of them and then `commit(k)`.
    pub fn as_mut_slices(&mut self) -> (&mut [MaybeUninit<T>], &mut [MaybeUninit<T>]) {
        // SAFETY:
        // - `first .. first + first_len` is a run of slots inside the allocation (it ends at or
        //   before the last slot), free, and the consumer will not look at them before a commit.
        // - The chunk holds `&mut Producer`, and the slices borrow `&mut self`: no other
        //   reference to these slots exists while they live.
        let first = unsafe { std::slice::from_raw_parts_mut(self.first, self.first_len) };
        // SAFETY:
        // - Same as above for slots `0 .. second_len`; `second_len > 0` only when the chunk
        //   wraps, and then the two runs do not overlap (`first_len + second_len <= capacity`).
        let second = unsafe { std::slice::from_raw_parts_mut(self.second, self.second_len) };
        (first, second)
    }

    /// Publishes the first `n` slots of the chunk (in ring order) to the consumer.
    ///
    /// # Safety
    ///
    /// - The first `n` slots (across both slices) have been initialised.
    ///
    /// # Panics
    ///
    /// If `n > self.len()`.
    pub unsafe fn commit(self, n: usize) {
        assert!(n <= self.len(), "spsc: commit({n}) of a {}-slot chunk", self.len());
        if n > 0 {
            let tail = self.producer.tail.wrapping_add(n);
            self.producer.publish(tail);
        }
    }

    /// Publishes the whole chunk.
    ///
    /// # Safety
    ///
    /// - Every slot of the chunk has been initialised.
    pub unsafe fn commit_all(self) {
        let n = self.len();
        // SAFETY:
        // - The caller promises all `n` slots are initialised.
        unsafe { self.commit(n) };
    }

    /// Moves items from `iter` into the chunk until either runs out, publishes them, and returns
    /// how many there were. If `iter` panics, the items written so far are leaked, not published.
    pub fn fill_from_iter<I: IntoIterator<Item = T>>(mut self, iter: I) -> usize {
        let (first, second) = self.as_mut_slices();
        let mut iter = iter.into_iter();
        let mut written = 0;
        // Two plain loops rather than `first.chain(second).zip(iter)`: a chained iterator
        // checks which half it is in on every item, which costs 3x on 8-byte items.
        for slot in first.iter_mut() {
            let Some(value) = iter.next() else { break };
            slot.write(value);
            written += 1;
        }
        if written == first.len() {
            for slot in second.iter_mut() {
                let Some(value) = iter.next() else { break };
                slot.write(value);
                written += 1;
            }
        }
        // SAFETY:
        // - The loop above initialised exactly the first `written` slots, in ring order.
        unsafe { self.commit(written) };
        written
    }
}

impl<T> fmt::Debug for WriteChunkUninit<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WriteChunkUninit")
            .field("first_len", &self.first_len)
            .field("second_len", &self.second_len)
            .finish_non_exhaustive()
    }
}
