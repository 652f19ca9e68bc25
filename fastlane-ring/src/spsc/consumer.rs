//! The reading end: [`Consumer`] and the chunk of items it lends, [`ReadChunk`], with its
//! iterator.

use super::*;

/// The reading end of a ring. Move it to the consumer thread; it is `Send` (for `T: Send`) but
/// not `Sync`.
///
/// ```compile_fail
/// fn is_sync<S: Sync>() {}
/// is_sync::<fastlane_ring::spsc::Consumer<u64>>();
/// ```
pub struct Consumer<T> {
    pub(super) header: NonNull<Header>,
    pub(super) slots: NonNull<T>,
    pub(super) mask: usize,
    /// Our own index; the shared `head` is a published copy of it (it may run ahead of the
    /// published copy while a [`ReadChunkIntoIter`] is alive, or after one was forgotten).
    pub(super) head: usize,
    /// The producer's `tail`, as last loaded.
    pub(super) tail_cache: usize,
    pub(super) strategy: WaitStrategy,
    /// Pauses before `pop_blocking` looks again at an empty ring (module docs, "Settling").
    pub(super) settle: u32,
    /// The most `settle` may grow to.
    pub(super) settle_limit: u32,
    pub(super) parks: bool,
    pub(super) _owns: PhantomData<T>,
}

// SAFETY:
// - The consumer receives `T`s from another thread, so it needs `T: Send`, and nothing more:
//   see `Producer`'s `Send`.
unsafe impl<T: Send> Send for Consumer<T> {}

impl<T> Consumer<T> {
    fn header(&self) -> &Header {
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

    /// The most `pause`s `pop_blocking` waits before its first look at an empty ring when the
    /// producer streams (module docs, "Settling"); 0 never settles, for a consumer that would
    /// rather poll than delay a lone item by up to that many pauses. Defaults to
    /// [`default_settle_limit`].
    pub fn set_settle_limit(&mut self, pauses: u32) {
        self.settle_limit = pauses;
        self.settle = self.settle.min(pauses);
    }

    fn avail_cached(&self) -> usize {
        self.tail_cache.wrapping_sub(self.head)
    }

    /// Reloads the producer's index; returns the items available.
    fn refresh_tail(&mut self) -> usize {
        // Acquire pairs with the Release store of `tail` in `Producer::publish`: the producer's
        // writes of every slot below that tail happen-before our reads of them.
        self.tail_cache = self.header().prod.tail.load(Ordering::Acquire);
        self.avail_cached()
    }

    /// Hands every slot below `head` back to the producer and wakes it if it sleeps.
    fn publish(&mut self, head: usize) {
        self.head = head;
        let h = self.header();
        // Release pairs with the Acquire load of `head` in `Producer::refresh_head` (and in the
        // producer's wait condition): our reads of those slots happen-before its overwrites.
        h.cons.head.store(head, Ordering::Release);
        if self.parks {
            h.cons.producer_wait.notify(Scope::Private);
        }
    }

    /// Takes the oldest item, or fails with [`PopError::Empty`]. Never waits.
    pub fn pop(&mut self) -> Result<T, PopError> {
        if self.avail_cached() == 0 {
            // Acquire pairs with the Release store of `tail` in `Producer::publish`, as in
            // `refresh_tail`. Still empty: leave the cache alone, so that a caller spinning on
            // `pop` spins on one load and a compare (no store into the handle per turn).
            let tail = self.header().prod.tail.load(Ordering::Acquire);
            if tail == self.head {
                return Err(PopError::Empty);
            }
            self.tail_cache = tail;
        }
        let index = self.head;
        slot_access(self.header(), index);
        // SAFETY:
        // - The slot is inside the allocation and aligned (`slot_ptr`).
        // - `index < tail_cache`, so the producer initialised it before the `tail` store we
        //   acquired, and will not touch it again before we publish a head past it.
        // - We move the value out and publish a head past it right below, so it is read once.
        let value = unsafe { slot_ptr(self.slots, self.mask, index).read() };
        self.publish(index.wrapping_add(1));
        Ok(value)
    }

    /// The oldest item, left in the ring.
    pub fn peek(&mut self) -> Result<&T, PopError> {
        if self.avail_cached() == 0 && self.refresh_tail() == 0 {
            return Err(PopError::Empty);
        }
        slot_access(self.header(), self.head);
        // SAFETY:
        // - The slot is in bounds, initialised and not touched by the producer, as in `pop`.
        // - The returned borrow holds `&mut self`, so nothing can take the item meanwhile.
        Ok(unsafe { &*slot_ptr(self.slots, self.mask, self.head) })
    }

    /// Like [`pop`](Self::pop), but waits with the channel's strategy while the ring is empty,
    /// until `deadline` (forever if `None`). Returns [`PopError::Empty`] if the deadline passed
    /// and [`PopError::Abandoned`] if the producer is gone and the ring is empty. Before the
    /// first look after finding the ring empty it may pause briefly, more when the producer
    /// streams (module docs, "Settling").
    #[inline(always)]
    pub fn pop_blocking(&mut self, deadline: Option<Instant>) -> Result<T, PopError> {
        if let Ok(value) = self.pop() {
            return Ok(value);
        }
        // Out of line, without `self`, as in `Producer::push_blocking`.
        let mut settle = self.settle;
        loop {
            let ready = wait_for_items(self.header(), self.head, self.strategy, settle, deadline);
            settle = 0;
            // Read the flag before the `pop` below reloads `tail`: if the producer is gone, the
            // flag's Release/Acquire makes its last `tail` visible to that reload, so "empty and
            // gone" really means nothing will ever come.
            let gone = self.is_abandoned();
            if let Ok(value) = self.pop() {
                self.settle = next_settle(self.settle, self.avail_cached() + 1, self.settle_limit);
                return Ok(value);
            }
            if gone {
                return Err(PopError::Abandoned);
            }
            if !ready {
                return Err(PopError::Empty);
            }
        }
    }

    /// Up to two slices holding the `n` oldest items, to be read (or changed) in place and then
    /// removed with [`ReadChunk::commit`], or moved out by iterating over the chunk. Fails with
    /// the number of available items if there are fewer than `n`.
    pub fn read_chunk(&mut self, n: usize) -> Result<ReadChunk<'_, T>, ChunkError> {
        let avail = if self.avail_cached() < n { self.refresh_tail() } else { self.avail_cached() };
        if avail < n {
            return Err(ChunkError::TooFewSlots(avail));
        }
        let start = self.head & self.mask;
        let first_len = n.min(self.capacity() - start);
        for i in 0..n {
            slot_access(self.header(), self.head.wrapping_add(i));
        }
        Ok(ReadChunk {
            first: slot_ptr(self.slots, self.mask, self.head),
            first_len,
            second: self.slots.as_ptr(),
            second_len: n - first_len,
            consumer: self,
        })
    }

    /// Items available now (reads the producer's index).
    pub fn slots(&self) -> usize {
        self.len()
    }

    /// Items in the ring now (reads the producer's index).
    pub fn len(&self) -> usize {
        // Acquire pairs with the Release store of `tail` in `Producer::publish`.
        self.header().prod.tail.load(Ordering::Acquire).wrapping_sub(self.head)
    }

    /// Whether the ring is empty now.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the producer has been dropped. Items it pushed before may still be in the ring.
    pub fn is_abandoned(&self) -> bool {
        // Acquire pairs with the Release store in `Producer::drop`.
        self.header().ctl.producer_gone.load(Ordering::Acquire) != 0
    }
}

impl<T> Drop for Consumer<T> {
    /// Inlined for the same reason as `Producer`'s.
    #[inline(always)]
    fn drop(&mut self) {
        let head = self.head;
        let h = self.header();
        // Publish our own index: after a forgotten `ReadChunkIntoIter` it may be ahead of the
        // shared one, and the slots in between no longer hold values. Release, as in
        // `publish`: a producer that is still alive may reuse those slots once it loads this.
        h.cons.head.store(head, Ordering::Release);
        // Release pairs with the Acquire loads of `consumer_gone` in the producer.
        h.ctl.consumer_gone.store(1, Ordering::Release);
        if self.parks {
            // Wake a producer asleep in `push_blocking`; same handshake as in `Producer::drop`.
            h.cons.producer_wait.notify(Scope::Private);
        }
        // SAFETY:
        // - `header` and `slots` come from `channel_with`; this is the consumer's only call, and
        //   `self` is not used afterwards.
        unsafe { release::<T>(self.header, self.slots) };
    }
}

impl<T> fmt::Debug for Consumer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("capacity", &self.capacity())
            .field("head", &self.head)
            .field("tail_cache", &self.tail_cache)
            .field("strategy", &self.strategy)
            .field("settle", &self.settle)
            .field("settle_limit", &self.settle_limit)
            .finish_non_exhaustive()
    }
}

/// The oldest items of a ring, borrowed from its [`Consumer`], in up to two slices. Dropping the
/// chunk leaves them in the ring; [`commit`](Self::commit) removes (drops) them; iterating over
/// the chunk moves them out.
pub struct ReadChunk<'a, T> {
    first: *mut T,
    first_len: usize,
    second: *mut T,
    second_len: usize,
    consumer: &'a mut Consumer<T>,
}

impl<'a, T> ReadChunk<'a, T> {
    /// Number of items in the chunk.
    pub fn len(&self) -> usize {
        self.first_len + self.second_len
    }

    /// Whether the chunk has no items.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The items, oldest first.
    pub fn as_slices(&self) -> (&[T], &[T]) {
        // SAFETY:
        // - `first .. first + first_len` are slots inside the allocation that hold values the
        //   producer published (we acquired its `tail` past them) and will not touch before we
        //   publish a head past them, which needs the `&mut Consumer` this chunk holds.
        let first = unsafe { std::slice::from_raw_parts(self.first, self.first_len) };
        // SAFETY:
        // - Same as above for slots `0 .. second_len`, disjoint from the first run.
        let second = unsafe { std::slice::from_raw_parts(self.second, self.second_len) };
        (first, second)
    }

    /// The items, oldest first, to change in place.
    pub fn as_mut_slices(&mut self) -> (&mut [T], &mut [T]) {
        // SAFETY:
        // - As in `as_slices`; and the slices borrow `&mut self`, so they are the only
        //   references to these slots while they live.
        let first = unsafe { std::slice::from_raw_parts_mut(self.first, self.first_len) };
        // SAFETY:
        // - Same as above for slots `0 .. second_len`, disjoint from the first run.
        let second = unsafe { std::slice::from_raw_parts_mut(self.second, self.second_len) };
        (first, second)
    }

    /// Drops the `n` oldest items of the chunk and hands their slots back to the producer.
    ///
    /// # Panics
    ///
    /// If `n > self.len()`. (If dropping an item panics, the remaining items of that slice are
    /// still dropped, those of the other slice leak, and all `n` slots are handed back.)
    pub fn commit(self, n: usize) {
        assert!(n <= self.len(), "spsc: commit({n}) of a {}-item chunk", self.len());
        let (first, second) = (self.first, self.second);
        let in_first = n.min(self.first_len);
        let in_second = n - in_first;
        let guard =
            PublishOnDrop { new_head: self.consumer.head.wrapping_add(n), consumer: self.consumer };
        // SAFETY:
        // - The first `in_first` items of the first run are initialised and ours (see
        //   `as_slices`); `guard` publishes a head past them even if a drop panics, so none is
        //   dropped twice.
        unsafe { ptr::drop_in_place(ptr::slice_from_raw_parts_mut(first, in_first)) };
        // SAFETY:
        // - Same for the first `in_second` items of the second run, which is only non-empty when
        //   the first run was taken whole.
        unsafe { ptr::drop_in_place(ptr::slice_from_raw_parts_mut(second, in_second)) };
        drop(guard);
    }

    /// Drops every item of the chunk and hands the slots back to the producer.
    pub fn commit_all(self) {
        let n = self.len();
        self.commit(n);
    }
}

/// Publishes the consumer's new head when dropped, including on unwind.
struct PublishOnDrop<'a, T> {
    consumer: &'a mut Consumer<T>,
    new_head: usize,
}

impl<T> Drop for PublishOnDrop<'_, T> {
    fn drop(&mut self) {
        if self.new_head != self.consumer.head {
            self.consumer.publish(self.new_head);
        }
    }
}

impl<T> fmt::Debug for ReadChunk<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReadChunk")
            .field("first_len", &self.first_len)
            .field("second_len", &self.second_len)
            .finish_non_exhaustive()
    }
}

impl<'a, T> IntoIterator for ReadChunk<'a, T> {
    type Item = T;
    type IntoIter = ReadChunkIntoIter<'a, T>;

    /// Moves the items out, oldest first. The slots of the items taken are handed back to the
    /// producer when the iterator is dropped; items not taken stay in the ring.
    fn into_iter(self) -> Self::IntoIter {
        ReadChunkIntoIter { len: self.len(), left: self.len(), consumer: self.consumer }
    }
}

/// Moves the items of a [`ReadChunk`] out of the ring; see [`ReadChunk::into_iter`].
pub struct ReadChunkIntoIter<'a, T> {
    consumer: &'a mut Consumer<T>,
    /// Items in the chunk.
    len: usize,
    /// Items of the chunk not taken yet; they start at `consumer.head`.
    left: usize,
}

impl<T> Iterator for ReadChunkIntoIter<'_, T> {
    type Item = T;

    fn next(&mut self) -> Option<T> {
        if self.left == 0 {
            return None;
        }
        let c = &mut *self.consumer;
        let index = c.head;
        // SAFETY:
        // - `index` is inside the chunk, so its slot holds a value the producer published and
        //   will not touch before we publish a head past it (see `ReadChunk::as_slices`).
        // - We advance our own head right below, before anything else can read the slot: even
        //   if this iterator is forgotten, `Consumer::drop` publishes that head, so the moved-out
        //   value is never read or dropped again.
        let value = unsafe { slot_ptr(c.slots, c.mask, index).read() };
        c.head = index.wrapping_add(1);
        self.left -= 1;
        Some(value)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

impl<T> ExactSizeIterator for ReadChunkIntoIter<'_, T> {}

impl<T> Drop for ReadChunkIntoIter<'_, T> {
    fn drop(&mut self) {
        // Hand back the slots of the items taken: `next` already moved our own head past them.
        if self.left != self.len {
            let head = self.consumer.head;
            self.consumer.publish(head);
        }
    }
}

impl<T> fmt::Debug for ReadChunkIntoIter<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReadChunkIntoIter").field("left", &self.left).finish_non_exhaustive()
    }
}
