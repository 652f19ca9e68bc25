//! The producer side of the shared-memory ring.

use std::sync::Arc;
use std::time::Instant;

use super::layout::{self, pack_record_header, record_span, PAD_TYPE};
use super::{corrupt, Corruption, Role, Shared, ShmError};
use crate::sync::{AtomicU32, Ordering};
use crate::wait::{ParkFlag, Scope};
use crate::WaitStrategy;

/// The producer side of a [`ShmRing`](super::ShmRing): reserves space, fills it, and publishes
/// records, one at a time or in batches.
///
/// Dropping the producer gives the role back. Records staged but not published are lost.
#[derive(Debug)]
pub struct Producer {
    shared: Arc<Shared>,
    /// End of the records staged so far (published or not). Private and authoritative: the
    /// shared `tail` is only ever written from it, never read back.
    tail: u64,
    /// The value last stored into the shared `tail`.
    published: u64,
    /// The consumer's cursor as last loaded and validated.
    head: u64,
    /// The open reservation, if any.
    reservation: Option<Reservation>,
    strategy: WaitStrategy,
    /// The first corruption found; returned by every later call.
    poison: Option<Corruption>,
}

/// Space reserved for one record, not yet staged.
#[derive(Debug, Clone, Copy)]
struct Reservation {
    /// Cursor of the record header (after any padding).
    start: u64,
    /// Payload length.
    len: u32,
    /// Whether a padding record fills the data area from `Producer::tail` to its end first.
    padded: bool,
}

impl Producer {
    pub(super) fn attach(shared: Arc<Shared>) -> Result<Producer, ShmError> {
        shared.check_header()?;
        let h = shared.header();
        // Acquire pairs with the consumer's `Release` store of `head` in `Batch::release`.
        let head = h.head.load(Ordering::Acquire);
        let tail = h.tail.load(Ordering::Relaxed);
        shared.check_cursors(head, tail)?;
        Ok(Producer {
            shared,
            tail,
            published: tail,
            head,
            reservation: None,
            strategy: WaitStrategy::default(),
            poison: None,
        })
    }

    /// Capacity of the data area in bytes.
    pub fn capacity(&self) -> usize {
        self.shared.capacity() as usize
    }

    /// The longest payload a record can have: `capacity / 2 - 8` bytes. Any record up to this
    /// length fits into an empty ring wherever the cursors are.
    pub fn max_record_len(&self) -> usize {
        (self.shared.capacity() / 2) as usize - layout::RECORD_HEADER_LEN
    }

    /// How the blocking operations wait (default: [`WaitStrategy::default`]).
    pub fn set_wait_strategy(&mut self, strategy: WaitStrategy) {
        self.strategy = strategy;
    }

    /// Reserves room for a record with a `len`-byte payload and returns the payload bytes to
    /// fill. Finish the record with [`commit`](Producer::commit) or [`stage`](Producer::stage);
    /// a reservation that is neither is dropped by the next `reserve`.
    ///
    /// The slice is in the shared mapping, in space the consumer does not read until the
    /// record is published (see "Reading payloads" in the module docs for a consumer that does
    /// not play by the rules). Its initial contents are whatever was there before.
    ///
    /// Errors: [`ShmError::Full`] (retry later), [`ShmError::TooLarge`], or a sticky
    /// [`ShmError::Corrupt`]. No syscall, no allocation.
    pub fn reserve(&mut self, len: usize) -> Result<&mut [u8], ShmError> {
        self.prepare(len)?;
        Ok(self.reserved_slice())
    }

    /// Like [`reserve`](Producer::reserve), but waits for room until `deadline`
    /// ([`ShmError::Timeout`]) with the producer's [`WaitStrategy`]. Records staged so far are
    /// published before waiting, since the consumer cannot free room it cannot see.
    pub fn reserve_blocking(
        &mut self,
        len: usize,
        deadline: Option<Instant>,
    ) -> Result<&mut [u8], ShmError> {
        loop {
            let needed = match self.prepare(len) {
                Ok(()) => return Ok(self.reserved_slice()),
                Err(ShmError::Full { needed, .. }) => needed,
                Err(e) => return Err(e),
            };
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(ShmError::Timeout);
            }
            self.publish();
            let (tail, published, head_seen) = (self.tail, self.published, self.head);
            let capacity = self.shared.capacity();
            let h = self.shared.header();
            let ready = || {
                // Acquire pairs with the consumer's `Release` store of `head` in
                // `Batch::release`. A value `prepare` would reject also ends the wait, so
                // that the caller gets the `Corrupt` error rather than a timeout.
                let head = h.head.load(Ordering::Acquire);
                let invalid = !head.is_multiple_of(8) || head < head_seen || head > published;
                invalid || capacity - (tail - head) >= needed
            };
            let flag = ParkFlag::from_word(&h.room_waiter);
            if !flag.wait_until(Scope::Shared, self.strategy, deadline, ready) {
                return Err(ShmError::Timeout);
            }
        }
    }

    /// Finishes the reserved record with type `record_type` and publishes it, together with
    /// every record staged before it: one store of the tail, then a wake-up of the consumer if
    /// it is parked (one fence and one load when it is not).
    ///
    /// # Panics
    ///
    /// If no reservation is open, or `record_type` is [`layout::PAD_TYPE`].
    pub fn commit(&mut self, record_type: u32) {
        self.stage(record_type);
        self.publish();
    }

    /// Finishes the reserved record with type `record_type` without publishing it: the
    /// consumer sees it at the next [`publish`](Producer::publish) or
    /// [`commit`](Producer::commit). Use it to publish a batch with one store of the tail.
    ///
    /// # Panics
    ///
    /// If no reservation is open, or `record_type` is [`layout::PAD_TYPE`].
    // The documented panic of a caller's misuse in this process (stage without reserve),
    // not something the peer's memory can cause.
    #[allow(clippy::expect_used)]
    pub fn stage(&mut self, record_type: u32) {
        assert!(record_type != PAD_TYPE, "record type u32::MAX is reserved for padding");
        let res = self.reservation.take().expect("stage or commit without a reservation");
        let mask = self.shared.mask();
        if res.padded {
            let idx = self.tail & mask;
            let pad_len = self.shared.capacity() - idx - layout::RECORD_HEADER_LEN as u64;
            // Ordered before the consumer's reads by the `Release` store of the tail in
            // `publish`; `pad_len < MAX_CAPACITY <= u32::MAX`.
            self.shared
                .record_word(idx)
                .store(pack_record_header(pad_len as u32, PAD_TYPE), Ordering::Relaxed);
        }
        self.shared
            .record_word(res.start & mask)
            .store(pack_record_header(res.len, record_type), Ordering::Relaxed);
        self.tail = res.start + record_span(res.len.into());
    }

    /// Publishes every staged record with one store of the tail and wakes the consumer if it
    /// is parked. Does nothing if nothing is staged.
    pub fn publish(&mut self) {
        if self.store_tail() {
            let h = self.shared.header();
            ParkFlag::from_word(&h.data_waiter).notify(Scope::Shared);
        }
    }

    /// [`commit`](Producer::commit), but the wake-up goes to a [doorbell](super::doorbell)
    /// word shared by several rings instead of this ring's own: for a consumer that sleeps on
    /// the doorbell, never on this ring. Same cost as `commit`.
    ///
    /// # Panics
    ///
    /// As [`commit`](Producer::commit).
    pub fn commit_ringing(&mut self, record_type: u32, doorbell: &AtomicU32) {
        self.stage(record_type);
        if self.store_tail() {
            super::doorbell::ring(doorbell);
        }
    }

    /// Stores the shared tail if anything is staged; returns whether it did.
    #[inline]
    fn store_tail(&mut self) -> bool {
        if self.tail == self.published || self.poison.is_some() {
            return false;
        }
        let h = self.shared.header();
        // Release pairs with the consumer's `Acquire` load of `tail` in `Consumer::peek_batch`:
        // the payloads and record headers written before it are visible to the consumer.
        h.tail.store(self.tail, Ordering::Release);
        self.published = self.tail;
        true
    }

    /// Copies `payload` into a new record of type `record_type` and publishes it (with any
    /// staged records). Never forms a reference into the mapping. Errors as
    /// [`reserve`](Producer::reserve).
    pub fn try_push(&mut self, record_type: u32, payload: &[u8]) -> Result<(), ShmError> {
        self.prepare(payload.len())?;
        self.copy_into_reservation(payload);
        self.commit(record_type);
        Ok(())
    }

    /// Like [`try_push`](Producer::try_push), waiting for room as
    /// [`reserve_blocking`](Producer::reserve_blocking) does.
    pub fn push_blocking(
        &mut self,
        record_type: u32,
        payload: &[u8],
        deadline: Option<Instant>,
    ) -> Result<(), ShmError> {
        self.reserve_blocking(payload.len(), deadline)?;
        self.copy_into_reservation(payload);
        self.commit(record_type);
        Ok(())
    }

    /// Bytes staged and not yet published.
    pub fn unpublished_len(&self) -> usize {
        (self.tail - self.published) as usize
    }

    /// Opens a reservation for a `len`-byte payload at the current tail, or says why not.
    fn prepare(&mut self, len: usize) -> Result<(), ShmError> {
        if let Some(c) = self.poison {
            return Err(c.into());
        }
        self.reservation = None;
        let max = self.max_record_len();
        if len > max {
            return Err(ShmError::TooLarge { len, max });
        }
        let capacity = self.shared.capacity();
        let span = record_span(len as u64);
        let to_end = capacity - (self.tail & self.shared.mask());
        let (pad, needed) = if span <= to_end { (0, span) } else { (to_end, to_end + span) };
        if self.tail.checked_add(needed).is_none() {
            // Only a cursor planted by the peer before we attached gets here (2^64 bytes is
            // decades of traffic).
            let c = corrupt("tail would overflow", self.tail, needed);
            self.poison = Some(c);
            return Err(c.into());
        }
        if needed > capacity - (self.tail - self.head) {
            self.refresh_head()?;
            let free = capacity - (self.tail - self.head);
            if needed > free {
                return Err(ShmError::Full { needed, free });
            }
        }
        // `len <= max_record_len < u32::MAX`.
        self.reservation =
            Some(Reservation { start: self.tail + pad, len: len as u32, padded: pad != 0 });
        Ok(())
    }

    /// Loads and validates the consumer's cursor (and the header, on this slow path).
    fn refresh_head(&mut self) -> Result<(), ShmError> {
        let checked = self.shared.check_header().and_then(|()| {
            // Acquire pairs with the consumer's `Release` store of `head` in `Batch::release`:
            // its reads of the released records happen before we overwrite them.
            let head = self.shared.header().head.load(Ordering::Acquire);
            if !head.is_multiple_of(8) {
                return Err(corrupt("head misaligned", layout::OFF_HEAD as u64, head));
            }
            if head < self.head {
                return Err(corrupt("head moved backwards", self.head, head));
            }
            if head > self.published {
                return Err(corrupt("head ahead of published tail", self.published, head));
            }
            Ok(head)
        });
        match checked {
            Ok(head) => {
                self.head = head;
                Ok(())
            }
            Err(c) => {
                self.poison = Some(c);
                self.reservation = None;
                Err(c.into())
            }
        }
    }

    /// The payload bytes of the open reservation.
    fn reserved_slice(&mut self) -> &mut [u8] {
        let (ptr, len) = self.reservation_ptr();
        // SAFETY:
        // - `ptr` points at `len` bytes inside the data area (`data_ptr` asserts it), kept
        //   mapped by `self.shared` for as long as the returned borrow of `self` lives.
        // - The bytes are free space: the consumer has released them (validated `head`) and
        //   does not read them until we publish, which needs `&mut self`, so no other
        //   reference into them exists in this process.
        // - A consumer that breaks the protocol may still write them: they are `u8`, so any
        //   value is valid, and the ring never reads them back (see the module docs).
        unsafe { std::slice::from_raw_parts_mut(ptr, len) }
    }

    fn copy_into_reservation(&mut self, payload: &[u8]) {
        let (ptr, len) = self.reservation_ptr();
        assert_eq!(len, payload.len());
        // SAFETY:
        // - `ptr` is valid for `len` writes inside the data area (`data_ptr` asserts it).
        // - `payload` is valid for `len` reads. The regions may only overlap if the caller's
        //   slice points into this very mapping, so use `copy` (memmove), which allows it.
        unsafe { std::ptr::copy(payload.as_ptr(), ptr, len) }
    }

    // Called only right after a successful `prepare`, which opened the reservation (our own
    // state; the peer's memory plays no part in whether it is set).
    #[allow(clippy::expect_used)]
    fn reservation_ptr(&self) -> (*mut u8, usize) {
        let res = self.reservation.expect("reservation prepared");
        let idx = (res.start & self.shared.mask()) + layout::RECORD_HEADER_LEN as u64;
        (self.shared.data_ptr(idx, res.len.into()), res.len as usize)
    }
}

impl Drop for Producer {
    fn drop(&mut self) {
        self.shared.unclaim(Role::Producer);
    }
}
