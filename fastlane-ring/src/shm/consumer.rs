//! The consumer side of the shared-memory ring.

use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Instant;

use super::layout::{self, record_span, unpack_record_header, PAD_TYPE};
use super::{corrupt, Corruption, Role, Shared, ShmError};
use crate::sync::Ordering;
use crate::wait::{ParkFlag, Scope};
use crate::WaitStrategy;

/// The consumer side of a [`ShmRing`](super::ShmRing): reads published records in batches and
/// releases their space.
///
/// Dropping the consumer gives the role back.
#[derive(Debug)]
pub struct Consumer {
    shared: Arc<Shared>,
    /// Everything before this is released. Private and authoritative: the shared `head` is
    /// only ever written from it, never read back.
    head: u64,
    /// The producer's cursor as last loaded and validated.
    tail: u64,
    strategy: WaitStrategy,
    /// The first corruption found; returned by every later call.
    poison: Option<Corruption>,
}

impl Consumer {
    pub(super) fn attach(shared: Arc<Shared>) -> Result<Consumer, ShmError> {
        shared.check_header()?;
        let h = shared.header();
        let head = h.head.load(Ordering::Relaxed);
        // Acquire pairs with the producer's `Release` store of `tail` in `Producer::publish`.
        let tail = h.tail.load(Ordering::Acquire);
        shared.check_cursors(head, tail)?;
        Ok(Consumer { shared, head, tail, strategy: WaitStrategy::default(), poison: None })
    }

    /// Capacity of the data area in bytes.
    pub fn capacity(&self) -> usize {
        self.shared.capacity() as usize
    }

    /// How [`wait_batch`](Consumer::wait_batch) waits (default: [`WaitStrategy::default`]).
    pub fn set_wait_strategy(&mut self, strategy: WaitStrategy) {
        self.strategy = strategy;
    }

    /// The records published so far, up to `limit` of them, to iterate with
    /// [`Batch::next_record`] and then [`Batch::release`]. An empty batch if there are none.
    /// One load of the tail; no syscall, no allocation.
    ///
    /// Errors: a sticky [`ShmError::Corrupt`] if the producer's cursor or the header is
    /// impossible.
    pub fn peek_batch(&mut self, limit: usize) -> Result<Batch<'_>, ShmError> {
        self.refresh_tail()?;
        Ok(Batch { pos: self.head, end: self.tail, left: limit, consumer: self })
    }

    /// Like [`peek_batch`](Consumer::peek_batch), but waits until something is published or
    /// `deadline` passes ([`ShmError::Timeout`]), with the consumer's [`WaitStrategy`].
    pub fn wait_batch(
        &mut self,
        limit: usize,
        deadline: Option<Instant>,
    ) -> Result<Batch<'_>, ShmError> {
        self.refresh_tail()?;
        if self.tail == self.head {
            let head = self.head;
            let h = self.shared.header();
            // Any change ends the wait; `peek_batch` then validates it. Acquire pairs with the
            // producer's `Release` store of `tail` in `Producer::publish`.
            let ready = || h.tail.load(Ordering::Acquire) != head;
            let flag = ParkFlag::from_word(&h.data_waiter);
            if !flag.wait_until(Scope::Shared, self.strategy, deadline, ready) {
                return Err(ShmError::Timeout);
            }
        }
        self.peek_batch(limit)
    }

    /// Bytes published and not yet released, as of the last load of the tail.
    pub fn unreleased_len(&self) -> usize {
        (self.tail - self.head) as usize
    }

    /// Loads and validates the producer's cursor (and the header).
    fn refresh_tail(&mut self) -> Result<(), ShmError> {
        if let Some(c) = self.poison {
            return Err(c.into());
        }
        let checked = self.shared.check_header().and_then(|()| {
            // Acquire pairs with the producer's `Release` store of `tail` in
            // `Producer::publish`: the records it covers were written before it.
            let tail = self.shared.header().tail.load(Ordering::Acquire);
            if !tail.is_multiple_of(8) {
                return Err(corrupt("tail misaligned", layout::OFF_TAIL as u64, tail));
            }
            if tail < self.tail {
                return Err(corrupt("tail moved backwards", self.tail, tail));
            }
            if tail - self.head > self.shared.capacity() {
                return Err(corrupt("tail more than capacity ahead of head", self.head, tail));
            }
            Ok(tail)
        });
        match checked {
            Ok(tail) => {
                self.tail = tail;
                Ok(())
            }
            Err(c) => Err(self.set_poison(c)),
        }
    }

    fn set_poison(&mut self, c: Corruption) -> ShmError {
        self.poison = Some(c);
        c.into()
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        self.shared.unclaim(Role::Consumer);
    }
}

/// Records published when [`Consumer::peek_batch`] loaded the tail, iterated with
/// [`next_record`](Batch::next_record). Nothing is released until [`release`](Batch::release);
/// dropping the batch without it leaves the records for the next batch.
#[derive(Debug)]
pub struct Batch<'a> {
    consumer: &'a mut Consumer,
    /// Cursor of the next record header to read; everything before it was yielded.
    pos: u64,
    /// The validated tail.
    end: u64,
    /// Records the caller still wants.
    left: usize,
}

impl Batch<'_> {
    /// The next record, `Ok(None)` at the end of the batch or after `limit` records.
    ///
    /// Every record header is read once and validated: it must lie inside the published span
    /// and inside the data area, and a padding record must end exactly at the end of the data
    /// area. A violation is a sticky [`ShmError::Corrupt`]. At most two headers are read per
    /// call (a padding record, then the record at the start of the area).
    pub fn next_record(&mut self) -> Result<Option<Record<'_>>, ShmError> {
        if let Some(c) = self.consumer.poison {
            return Err(c.into());
        }
        match self.advance() {
            Ok(Some((idx, len, record_type))) => {
                let ptr = self.consumer.shared.data_ptr(idx, len);
                Ok(Some(Record { ptr, len: len as usize, record_type, _batch: PhantomData }))
            }
            Ok(None) => Ok(None),
            Err(c) => Err(self.consumer.set_poison(c)),
        }
    }

    /// Finds the next record: `(payload position, payload length, type)`.
    fn advance(&mut self) -> Result<Option<(u64, u64, u32)>, Corruption> {
        if self.left == 0 {
            return Ok(None);
        }
        let shared = &*self.consumer.shared;
        let capacity = shared.capacity();
        // Two rounds: a padding record never follows a padding record (one at position 0
        // would fill the whole area and is rejected).
        for _ in 0..2 {
            if self.pos == self.end {
                return Ok(None);
            }
            // Both cursors are multiples of 8, so at least one header's worth is published.
            let avail = self.end - self.pos;
            let idx = self.pos & shared.mask();
            let to_end = capacity - idx;
            // Relaxed: ordered after the `Acquire` load of the tail that covers it. Read once;
            // only the local copy is used from here on.
            let word = shared.record_word(idx).load(Ordering::Relaxed);
            let (len, record_type) = unpack_record_header(word);
            if record_type == PAD_TYPE {
                if idx == 0 {
                    return Err(corrupt("padding record at start of data area", self.pos, word));
                }
                if u64::from(len) != to_end - layout::RECORD_HEADER_LEN as u64 {
                    return Err(corrupt("padding record does not reach the end", self.pos, word));
                }
                if to_end > avail {
                    return Err(corrupt("padding record runs past tail", self.pos, word));
                }
                self.pos += to_end;
                continue;
            }
            let span = record_span(len.into());
            if span > to_end {
                return Err(corrupt("record runs past end of data area", self.pos, word));
            }
            if span > avail {
                return Err(corrupt("record runs past tail", self.pos, word));
            }
            self.pos += span;
            self.left -= 1;
            return Ok(Some((idx + layout::RECORD_HEADER_LEN as u64, len.into(), record_type)));
        }
        Err(corrupt("padding record after padding record", self.pos, 0))
    }

    /// Whether no published bytes are left after the records yielded so far.
    pub fn is_empty(&self) -> bool {
        self.pos == self.end
    }

    /// Releases every record yielded by [`next_record`](Batch::next_record) with one store of
    /// the head, and wakes the producer if it is parked waiting for room (one fence and one
    /// load when it is not). Does nothing after a corruption.
    pub fn release(self) {
        let consumer = self.consumer;
        if self.pos == consumer.head || consumer.poison.is_some() {
            return;
        }
        let h = consumer.shared.header();
        // Release pairs with the producer's `Acquire` load of `head` in `Producer::reserve`:
        // our reads of these records happen before it overwrites them.
        h.head.store(self.pos, Ordering::Release);
        consumer.head = self.pos;
        ParkFlag::from_word(&h.room_waiter).notify(Scope::Shared);
    }
}

/// One record of a [`Batch`]: a type and a payload in the shared mapping.
///
/// Read the payload with [`copy_to`](Record::copy_to): the producer may rewrite it at any
/// time if it does not play by the rules, so validate a private copy (see "Reading payloads"
/// in the module docs).
#[derive(Debug)]
pub struct Record<'b> {
    ptr: *const u8,
    len: usize,
    record_type: u32,
    _batch: PhantomData<&'b [u8]>,
}

impl Record<'_> {
    /// The record type the producer committed it with.
    pub fn record_type(&self) -> u32 {
        self.record_type
    }

    /// Payload length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the payload is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies the payload (at most `dst.len()` bytes of it) into `dst`; returns the number of
    /// bytes copied. One `memcpy` out of the mapping: the copy is stable even if a hostile
    /// producer scribbles on the original meanwhile (it may then be a mix of old and new bytes).
    pub fn copy_to(&self, dst: &mut [u8]) -> usize {
        let n = self.len.min(dst.len());
        // SAFETY:
        // - `self.ptr` is valid for `self.len >= n` reads inside the data area (`data_ptr`
        //   asserted it) and the mapping is kept alive by the consumer this record borrows.
        // - `dst` is valid for `n` writes. It could overlap the mapping only if the caller
        //   got it from a producer of this same ring, so use `copy` (memmove), which allows
        //   overlap.
        // - The source bytes may be written concurrently by the peer process; they are `u8`,
        //   every value is valid, and no reference to them is formed.
        unsafe { std::ptr::copy(self.ptr, dst.as_mut_ptr(), n) };
        n
    }

    /// A raw pointer to the payload in the mapping, valid for [`len`](Record::len) bytes while
    /// the record lives.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    /// The payload as a slice of the mapping, without a copy.
    ///
    /// # Safety
    ///
    /// The producer must not write these bytes while the slice lives. A producer that follows
    /// the protocol never does (it does not touch published, unreleased space); a hostile
    /// one can, and then the compiler's assumption that the slice is immutable no longer holds
    /// (two reads of one byte may differ). Use [`copy_to`](Record::copy_to) when the producer
    /// is not trusted.
    pub unsafe fn as_bytes(&self) -> &[u8] {
        // SAFETY:
        // - `self.ptr` is valid for `self.len` reads inside the mapping, which the consumer
        //   this record borrows keeps alive; the batch cannot be released while it lives.
        // - Immutability for the slice's lifetime is the caller's obligation (see above).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}
