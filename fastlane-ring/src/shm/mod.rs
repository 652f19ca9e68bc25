//! A byte ring of variable-length records in a shared mapping, between two processes that do
//! not trust each other.
//!
//! One producer process appends records; one consumer process reads them in batches. The ring
//! lives in one `MAP_SHARED` mapping of a memfd ([`ShmRing::create_memfd`], handed to the peer
//! as a file descriptor and opened there with [`ShmRing::from_fd`]) or of a file, normally under
//! `/dev/shm` ([`ShmRing::create_file`], [`ShmRing::open_file`]).
//!
//! ```no_run
//! # fn main() -> Result<(), fastlane_ring::shm::ShmError> {
//! use fastlane_ring::shm::ShmRing;
//! let ring = ShmRing::create_file("/dev/shm/example-ring", 1 << 20)?;
//! let mut tx = ring.producer()?; // normally in one process ...
//! let mut rx = ring.consumer()?; // ... and this in another (`ShmRing::open_file`)
//! tx.reserve(5)?.copy_from_slice(b"hello");
//! tx.commit(7);
//! let mut batch = rx.peek_batch(64)?;
//! let mut buf = [0u8; 256];
//! while let Some(record) = batch.next_record()? {
//!     let n = record.copy_to(&mut buf);
//!     assert_eq!((record.record_type(), &buf[..n]), (7, &b"hello"[..]));
//! }
//! batch.release();
//! # Ok(()) }
//! ```
//!
//! # Shared layout (ABI version 1)
//!
//! All integers are in the host's native byte order. Offsets are from the start of the mapping;
//! the constants live in [`layout`].
//!
//! | offset | size | field | written by |
//! |-------:|-----:|-------|------------|
//! | 0   | 8 | magic `b"FLSHMRNG"` ([`layout::MAGIC`]) | creator, last, with `Release` |
//! | 8   | 4 | ABI version ([`layout::ABI_VERSION`] = 1) | creator |
//! | 12  | 4 | flags (0) | creator |
//! | 16  | 8 | capacity of the data area in bytes (power of two, 64 B ..= 2 GiB) | creator |
//! | 24  | 8 | data offset (384) | creator |
//! | 32  | 4 | creator pid (informational) | creator |
//! | 36  | 4 | producer claim: pid, 0 if free | attach/detach |
//! | 40  | 4 | consumer claim: pid, 0 if free | attach/detach |
//! | 44  | 84 | reserved (0) | |
//! | 128 | 8 | **tail**: bytes ever published (producer cursor) | producer |
//! | 136 | 4 | data waiter: consumer's park word | consumer (parking), producer (waking) |
//! | 140 | 116 | reserved (0) | |
//! | 256 | 8 | **head**: bytes ever released (consumer cursor) | consumer |
//! | 264 | 4 | room waiter: producer's park word | producer (parking), consumer (waking) |
//! | 268 | 116 | reserved (0) | |
//! | 384 | capacity | data area | |
//!
//! The cursors are monotonic `u64` byte counts that never wrap (2^64 bytes is 58 years at
//! 10 GB/s; a producer refuses to go past it); the position in the data area is
//! `cursor & (capacity - 1)`. `tail - head` is the number of bytes published and not yet
//! released, never more than the capacity. Each cursor
//! has its own 128-byte line, together with the park word that its *writer* checks right after
//! writing it, so the fast path touches only lines a side already owns; the waiting side writes
//! the other side's line only when it is about to sleep.
//!
//! # Records
//!
//! Every record starts 8-byte aligned in the data area with an 8-byte header, a native `u64`
//! whose low 32 bits are the payload length in bytes and whose high 32 bits are the record
//! type. The payload follows and is padded to the next multiple of 8, so a record occupies
//! `8 + round_up(len, 8)` bytes. Record types are the caller's, except [`layout::PAD_TYPE`]
//! (`u32::MAX`): a *padding record*, written when a record would not fit before the end of the
//! data area. A padding record fills the data area exactly to its end (its length field is
//! `capacity - position - 8`) and the next record starts at position 0, so every payload is
//! contiguous in memory. Because a wrapping reservation may cost the rest of the area in
//! padding, a payload is at most `capacity / 2 - 8` bytes ([`Producer::max_record_len`]); any
//! such record fits into an empty ring.
//!
//! # Protocol and memory ordering
//!
//! The producer writes payloads and record headers, then stores `tail` with `Release`; the
//! consumer loads `tail` with `Acquire`, so it sees the records it covers. The consumer reads
//! (copies) the records, then stores `head` with `Release`; the producer loads `head` with
//! `Acquire` before reusing the space, so the consumer's reads happen before the overwrite.
//! Each side keeps its own cursor privately and only *publishes* it: it never reads its own
//! cursor back from the mapping, so a peer that scribbles on it confuses only itself.
//!
//! Batching: [`Producer::stage`] finishes records without publishing them and
//! [`Producer::publish`] stores `tail` once for all of them ([`Producer::commit`] is both).
//! [`Consumer::peek_batch`] loads `tail` once and [`Batch::release`] stores `head` once.
//!
//! # One producer, one consumer
//!
//! The ring assumes exactly one producer and one consumer (threads or processes). Attaching
//! ([`ShmRing::producer`], [`ShmRing::consumer`]) claims the role with a compare-and-swap of
//! the caller's pid into the header, releases it on drop, and takes over a claim whose process
//! no longer exists. That catches honest mistakes; it is not enforcement: a peer can write the
//! claim words like anything else.
//!
//! # A hostile peer
//!
//! The other process may write anything into the mapping at any time. The rules:
//!
//! - Capacity, data offset, version and magic are validated when the ring is opened, and the
//!   validated capacity is kept in private memory; the mapping is exactly `384 + capacity`
//!   bytes long. Changes to the header afterwards are detected by [`Consumer::peek_batch`] and
//!   on the producer's slow path and reported as [`ShmError::Corrupt`], but never used.
//! - Every value read from the mapping is read once, into a local, and validated before use:
//!   the peer's cursor must be 8-byte aligned, monotonic, and within `capacity` of ours; a
//!   record header must describe a record that lies inside the published span and inside the
//!   data area without wrapping; a padding record must end exactly at the end of the data area.
//!   Every pointer into the data area is computed by one function that asserts its bounds, so a
//!   validation bug would be a panic, never an out-of-bounds access.
//! - A violation is [`ShmError::Corrupt`] with a short description and the position and value
//!   involved. It is sticky: the handle returns the same error from then on.
//! - The worst a peer can do through the park words is cause spurious wake-ups or a sleep that
//!   ends at the caller's deadline.
//! - A peer that truncates a *file* backing the ring makes the next access to the lost pages
//!   raise `SIGBUS`; no check can prevent that for files. Memfd rings are sealed against
//!   shrinking ([`ShmRing::create_memfd`] seals them, [`ShmRing::from_fd`] adds the seal if it is
//!   missing and refuses the fd if it cannot), so use a memfd when the peer is not trusted.
//!
//! ## Reading payloads: copies, not references
//!
//! The consumer's view of a payload is [`Record`], and the safe way to read it is
//! [`Record::copy_to`], which copies the bytes into the caller's memory with one `memcpy` from
//! the mapping. A `&[u8]` into the mapping would promise the compiler that the bytes do not
//! change while it lives, and a hostile producer can break that promise at will: the compiler
//! may then load a byte twice and see two values where the source read it once (a check on the
//! first load, a use of the second). A private copy is stable; validate the copy, then use it.
//! For a trusted producer, [`Record::as_bytes`] is an `unsafe fn` whose contract is exactly
//! that promise.
//!
//! The producer side hands out `&mut [u8]` from [`Producer::reserve`] for zero-copy writes. A
//! well-behaved consumer never touches unpublished space. A hostile one can write behind that
//! `&mut`, which Rust's memory model has no words for (the writer is outside the program); it
//! is harmless here only because the bytes are `u8` (no invalid values), the ring never reads
//! them back or derives a length or an index from them, and the worst outcome is that the
//! producer's own code reads back something other than what it wrote. Producers that want no
//! reference into the mapping at all use [`Producer::try_push`], which copies.
//!
//! # Cost
//!
//! The non-blocking operations ([`Producer::reserve`], [`Producer::commit`],
//! [`Producer::try_push`], [`Consumer::peek_batch`], [`Batch::release`]) allocate nothing and
//! make no syscall, except the futex wake that tells a parked peer there is work: after
//! publishing, a side checks the peer's park word with one fence and one load, and calls
//! `FUTEX_WAKE` only when the peer announced it sleeps. The blocking variants
//! ([`Producer::reserve_blocking`], [`Consumer::wait_batch`]) wait with the handle's
//! [`WaitStrategy`] and end at a deadline with [`ShmError::Timeout`].

mod consumer;
pub mod doorbell;
pub mod layout;
mod producer;
mod ring;
#[cfg(test)]
mod tests;

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::{MmapOptions, MmapRaw};

use crate::sync::{AtomicU32, AtomicU64, Ordering};
pub use consumer::{Batch, Consumer, Record};
use layout::Header;
pub use producer::Producer;
pub use ring::{sealed_memfd, ShmRing};

#[cfg(doc)]
use crate::WaitStrategy;

/// Errors of the shared-memory ring.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShmError {
    /// Not enough free space for the record now; not fatal, retry after the consumer releases.
    #[error("ring full")]
    Full {
        /// Bytes the reservation needs (record and any padding before it).
        needed: u64,
        /// Bytes free.
        free: u64,
    },
    /// The record can never fit: longer than [`Producer::max_record_len`].
    #[error("record too large")]
    TooLarge {
        /// Requested payload length.
        len: usize,
        /// Largest payload this ring takes.
        max: usize,
    },
    /// A blocking operation reached its deadline.
    #[error("timed out")]
    Timeout,
    /// The mapping does not start with [`layout::MAGIC`] (not a ring, or not initialised yet).
    #[error("bad magic")]
    BadMagic {
        /// The first 8 bytes found.
        found: u64,
    },
    /// The ring was written by a different ABI version.
    #[error("unsupported ABI version")]
    BadVersion {
        /// Version in the header.
        found: u32,
        /// Version this code speaks.
        supported: u32,
    },
    /// Capacity not a power of two in `MIN_CAPACITY..=MAX_CAPACITY` (at create or open).
    #[error("bad capacity")]
    BadCapacity {
        /// The capacity asked for or found.
        capacity: u64,
    },
    /// The header's data offset is not the one of this ABI version.
    #[error("bad data offset")]
    BadLayout {
        /// Offset found.
        data_offset: u64,
    },
    /// The file or memfd is shorter than its header says.
    #[error("ring file truncated")]
    Truncated {
        /// Length of the file.
        len: u64,
        /// Length the header requires.
        needed: u64,
    },
    /// A memfd without `F_SEAL_SHRINK` that could not be sealed: the peer could shrink it.
    #[error("memfd not sealed against shrinking")]
    Unsealed,
    /// The role is claimed by a live process (possibly this one).
    #[error("{role:?} role already claimed")]
    RoleTaken {
        /// The role asked for.
        role: Role,
        /// Pid in the claim word.
        pid: u32,
    },
    /// The peer wrote something impossible into the shared mapping. Sticky for the handle.
    #[error("corrupt shared ring: {what}")]
    Corrupt {
        /// What was wrong.
        what: &'static str,
        /// The cursor position (or header offset) where it was found.
        at: u64,
        /// The offending value.
        value: u64,
    },
    /// A system call failed while creating or opening the ring.
    #[error("{op} failed")]
    Io {
        /// The operation.
        op: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

/// One side of the ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The side that appends records.
    Producer,
    /// The side that reads and releases them.
    Consumer,
}

/// A corruption found in the mapping: what, where, which value. Copy, so handles can keep it
/// as their sticky error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Corruption {
    pub(crate) what: &'static str,
    pub(crate) at: u64,
    pub(crate) value: u64,
}

impl From<Corruption> for ShmError {
    fn from(c: Corruption) -> Self {
        ShmError::Corrupt { what: c.what, at: c.at, value: c.value }
    }
}

pub(crate) fn corrupt(what: &'static str, at: u64, value: u64) -> Corruption {
    Corruption { what, at, value }
}

fn io_err(op: &'static str) -> impl FnOnce(io::Error) -> ShmError {
    move |source| ShmError::Io { op, source }
}

/// A mapping of a ring and what was validated about it, shared by the handles of one process.
#[derive(Debug)]
pub(crate) struct Shared {
    map: MmapRaw,
    file: File,
    /// The validated capacity (power of two), private: never re-read from the mapping.
    capacity: u64,
}

impl Shared {
    /// The header at the start of the mapping.
    #[inline]
    pub(crate) fn header(&self) -> &Header {
        // SAFETY:
        // - The mapping is at least `HEADER_LEN` bytes (checked before mapping) and starts on a
        //   page boundary, so it holds a `Header` at proper alignment.
        // - Every byte of `Header` is inside an atomic, so the peer's concurrent writes do not
        //   contradict the shared reference, and every bit pattern is a valid value.
        // - `self.map` keeps the mapping alive for the lifetime of the returned reference.
        unsafe { &*self.map.as_ptr().cast::<Header>() }
    }

    #[inline]
    pub(crate) fn capacity(&self) -> u64 {
        self.capacity
    }

    #[inline]
    pub(crate) fn mask(&self) -> u64 {
        self.capacity - 1
    }

    /// A pointer to `len` bytes at position `idx` of the data area. Every access to the data
    /// area goes through here; the bounds are asserted, so a validation bug panics instead of
    /// reading or writing outside the area.
    #[inline]
    pub(crate) fn data_ptr(&self, idx: u64, len: u64) -> *mut u8 {
        assert!(
            idx <= self.capacity && len <= self.capacity - idx,
            "shm ring: access outside the data area (bug in validation)"
        );
        // SAFETY:
        // - The mapping is `DATA_OFFSET + capacity` bytes, and `idx <= capacity`, so the result
        //   is inside it or one past its end (only when `len` is 0).
        // - `idx` fits in `usize`: capacity was checked against `MAX_CAPACITY` and the mapping
        //   of that size succeeded.
        unsafe { self.map.as_mut_ptr().add(layout::DATA_OFFSET + idx as usize) }
    }

    /// The 8-byte record header word at position `idx` of the data area.
    #[inline]
    pub(crate) fn record_word(&self, idx: u64) -> &AtomicU64 {
        assert!(idx.is_multiple_of(8), "shm ring: misaligned record header (bug in validation)");
        let ptr = self.data_ptr(idx, layout::RECORD_HEADER_LEN as u64);
        // SAFETY:
        // - `data_ptr` checked the 8 bytes lie in the data area; the area starts 128-aligned
        //   and `idx` is a multiple of 8, so the pointer is aligned for `AtomicU64`.
        // - The peer may write these bytes concurrently; it is another process, and all our
        //   own accesses to record headers are atomic.
        // - `self.map` keeps the memory alive as long as the returned reference.
        unsafe { AtomicU64::from_ptr(ptr.cast::<u64>()) }
    }

    /// Checks that the immutable part of the header still says what it said at open.
    pub(crate) fn check_header(&self) -> Result<(), Corruption> {
        let h = self.header();
        let magic = h.magic.load(Ordering::Relaxed);
        if magic != layout::MAGIC {
            return Err(corrupt("header magic changed", layout::OFF_MAGIC as u64, magic));
        }
        let version = h.version.load(Ordering::Relaxed);
        if version != layout::ABI_VERSION {
            return Err(corrupt(
                "header version changed",
                layout::OFF_VERSION as u64,
                version.into(),
            ));
        }
        let capacity = h.capacity.load(Ordering::Relaxed);
        if capacity != self.capacity {
            return Err(corrupt("header capacity changed", layout::OFF_CAPACITY as u64, capacity));
        }
        let offset = h.data_offset.load(Ordering::Relaxed);
        if offset != layout::DATA_OFFSET as u64 {
            return Err(corrupt(
                "header data offset changed",
                layout::OFF_DATA_OFFSET as u64,
                offset,
            ));
        }
        Ok(())
    }

    /// Checks a `(head, tail)` pair read at attach time.
    pub(crate) fn check_cursors(&self, head: u64, tail: u64) -> Result<(), Corruption> {
        if !head.is_multiple_of(8) {
            return Err(corrupt("head misaligned", layout::OFF_HEAD as u64, head));
        }
        if !tail.is_multiple_of(8) {
            return Err(corrupt("tail misaligned", layout::OFF_TAIL as u64, tail));
        }
        if head > tail {
            return Err(corrupt("head ahead of tail", head, tail));
        }
        if tail - head > self.capacity {
            return Err(corrupt("tail more than capacity ahead of head", head, tail));
        }
        Ok(())
    }

    fn claim_word(&self, role: Role) -> &AtomicU32 {
        match role {
            Role::Producer => &self.header().producer_pid,
            Role::Consumer => &self.header().consumer_pid,
        }
    }

    /// Claims `role` for this process (best effort, see the module docs).
    fn claim(&self, role: Role) -> Result<(), ShmError> {
        let me = std::process::id();
        let word = self.claim_word(role);
        let mut seen = 0;
        // Two tries: the free case, then taking over from a dead process. Bounded; a peer
        // that keeps rewriting the word just gets `RoleTaken`.
        for _ in 0..2 {
            match word.compare_exchange(seen, me, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return Ok(()),
                Err(pid) if pid != me && pid != 0 && !process_alive(pid) => seen = pid,
                Err(pid) => return Err(ShmError::RoleTaken { role, pid }),
            }
        }
        Err(ShmError::RoleTaken { role, pid: word.load(Ordering::Relaxed) })
    }

    /// Gives the claim back if it is still ours.
    pub(crate) fn unclaim(&self, role: Role) {
        let me = std::process::id();
        let _ = self.claim_word(role).compare_exchange(me, 0, Ordering::AcqRel, Ordering::Relaxed);
    }
}

/// Whether a process with this pid exists (`kill(pid, 0)`; a pid we may not signal exists).
fn process_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: `kill` with signal 0 sends nothing; it only checks existence and permission.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}
