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
pub mod layout;
mod producer;

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

/// A mapped shared-memory ring, not yet attached as either side.
///
/// Attach with [`producer`](ShmRing::producer) or [`consumer`](ShmRing::consumer); the handles
/// keep the mapping alive, so the `ShmRing` may be dropped after attaching.
#[derive(Debug)]
pub struct ShmRing {
    shared: Arc<Shared>,
}

impl ShmRing {
    /// Creates a ring of `capacity` data bytes in a new memfd named `name` (the name is only
    /// for `/proc/<pid>/fd`). The memfd is sealed against shrinking and growing, is
    /// close-on-exec, and is passed to the peer with [`as_fd`](AsFd::as_fd) (clear `FD_CLOEXEC`
    /// on a duplicate, or send it over a Unix socket) and opened there with
    /// [`from_fd`](ShmRing::from_fd).
    pub fn create_memfd(name: &str, capacity: usize) -> Result<ShmRing, ShmError> {
        let capacity = check_capacity(capacity as u64)?;
        let cname = CString::new(name).map_err(|_| ShmError::Io {
            op: "memfd_create",
            source: io::Error::from(io::ErrorKind::InvalidInput),
        })?;
        // SAFETY: `cname` is a valid NUL-terminated string for the duration of the call.
        let fd = unsafe {
            libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if fd < 0 {
            return Err(io_err("memfd_create")(io::Error::last_os_error()));
        }
        // SAFETY: `fd` was just returned by `memfd_create`, is open and owned by nobody else.
        let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        file.set_len(layout::DATA_OFFSET as u64 + capacity).map_err(io_err("ftruncate"))?;
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: F_ADD_SEALS on an fd we own; no memory is passed.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
            return Err(io_err("F_ADD_SEALS")(io::Error::last_os_error()));
        }
        Self::init(file, capacity)
    }

    /// Creates a ring of `capacity` data bytes in a new file at `path` (normally under
    /// `/dev/shm`). Fails if `path` exists. The file appears at `path` only once its header is
    /// complete (it is written under a temporary name and linked into place). The caller owns
    /// the path: the ring does not remove it.
    ///
    /// A peer that can write the file can also truncate it, which makes the next access
    /// `SIGBUS`; use [`create_memfd`](ShmRing::create_memfd) for peers that are not trusted.
    pub fn create_file(path: impl AsRef<Path>, capacity: usize) -> Result<ShmRing, ShmError> {
        let path = path.as_ref();
        let capacity = check_capacity(capacity as u64)?;
        static CREATED: AtomicU32 = AtomicU32::new(0);
        let mut tmp_name = path.as_os_str().to_owned();
        let n = CREATED.fetch_add(1, Ordering::Relaxed);
        tmp_name.push(format!(".tmp-{}-{n}", std::process::id()));
        let tmp = PathBuf::from(tmp_name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(io_err("create"))?;
        let result = file
            .set_len(layout::DATA_OFFSET as u64 + capacity)
            .map_err(io_err("ftruncate"))
            .and_then(|()| Self::init(file, capacity))
            .and_then(|ring| std::fs::hard_link(&tmp, path).map(|()| ring).map_err(io_err("link")));
        let _ = std::fs::remove_file(&tmp);
        result
    }

    /// Opens the ring in the file at `path`, validating its header.
    pub fn open_file(path: impl AsRef<Path>) -> Result<ShmRing, ShmError> {
        let file = OpenOptions::new().read(true).write(true).open(path).map_err(io_err("open"))?;
        Self::open(file, false)
    }

    /// Opens the ring in `fd`, normally a memfd from [`create_memfd`](ShmRing::create_memfd)
    /// in another process. A memfd that is not sealed against shrinking gets the seal now; an
    /// fd that lacks it and cannot take it (a memfd created without `MFD_ALLOW_SEALING`, or a
    /// file rather than a memfd) is refused with [`ShmError::Unsealed`]: open files by path
    /// with [`open_file`](ShmRing::open_file).
    pub fn from_fd(fd: OwnedFd) -> Result<ShmRing, ShmError> {
        Self::open(File::from(fd), true)
    }

    /// Capacity of the data area in bytes.
    pub fn capacity(&self) -> usize {
        self.shared.capacity as usize
    }

    /// Attaches as the producer, claiming the role (see the module docs).
    pub fn producer(&self) -> Result<Producer, ShmError> {
        self.shared.claim(Role::Producer)?;
        Producer::attach(Arc::clone(&self.shared)).inspect_err(|_| {
            self.shared.unclaim(Role::Producer);
        })
    }

    /// Attaches as the consumer, claiming the role (see the module docs).
    pub fn consumer(&self) -> Result<Consumer, ShmError> {
        self.shared.claim(Role::Consumer)?;
        Consumer::attach(Arc::clone(&self.shared)).inspect_err(|_| {
            self.shared.unclaim(Role::Consumer);
        })
    }

    /// Writes a fresh header into a zero-filled file of the right length and maps it.
    fn init(file: File, capacity: u64) -> Result<ShmRing, ShmError> {
        let shared = map(file, capacity)?;
        let h = shared.header();
        h.version.store(layout::ABI_VERSION, Ordering::Relaxed);
        h.flags.store(0, Ordering::Relaxed);
        h.capacity.store(capacity, Ordering::Relaxed);
        h.data_offset.store(layout::DATA_OFFSET as u64, Ordering::Relaxed);
        h.creator_pid.store(std::process::id(), Ordering::Relaxed);
        // Pairs with the opener's read of the magic: a ring with the magic is initialised.
        // (Openers read the header with `pread`, after the file became visible to them through
        // a syscall; the store is `Release` for openers of an already-mapped memfd.)
        h.magic.store(layout::MAGIC, Ordering::Release);
        Ok(ShmRing { shared: Arc::new(shared) })
    }

    /// Validates the header of an existing ring file and maps it.
    fn open(file: File, seal: bool) -> Result<ShmRing, ShmError> {
        if seal {
            ensure_shrink_seal(&file)?;
        }
        let len = file.metadata().map_err(io_err("fstat"))?.len();
        if len < layout::HEADER_LEN as u64 {
            return Err(ShmError::Truncated { len, needed: layout::HEADER_LEN as u64 });
        }
        let mut raw = [0u8; layout::HEADER_LEN];
        file.read_exact_at(&mut raw, 0).map_err(io_err("read header"))?;
        let u64_at = |off: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&raw[off..off + 8]);
            u64::from_ne_bytes(b)
        };
        let u32_at = |off: usize| {
            let mut b = [0u8; 4];
            b.copy_from_slice(&raw[off..off + 4]);
            u32::from_ne_bytes(b)
        };
        let magic = u64_at(layout::OFF_MAGIC);
        if magic != layout::MAGIC {
            return Err(ShmError::BadMagic { found: magic });
        }
        let version = u32_at(layout::OFF_VERSION);
        if version != layout::ABI_VERSION {
            return Err(ShmError::BadVersion { found: version, supported: layout::ABI_VERSION });
        }
        let capacity = check_capacity(u64_at(layout::OFF_CAPACITY))?;
        let data_offset = u64_at(layout::OFF_DATA_OFFSET);
        if data_offset != layout::DATA_OFFSET as u64 {
            return Err(ShmError::BadLayout { data_offset });
        }
        let needed = layout::DATA_OFFSET as u64 + capacity;
        if len < needed {
            return Err(ShmError::Truncated { len, needed });
        }
        let shared = map(file, capacity)?;
        // The header may have changed between the read and the mapping; what counts from now
        // on is the private `capacity`, and `check_header` reports any difference.
        shared.check_header()?;
        Ok(ShmRing { shared: Arc::new(shared) })
    }
}

impl AsFd for ShmRing {
    /// The file or memfd behind the ring, to pass to the peer.
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.shared.file.as_fd()
    }
}

fn check_capacity(capacity: u64) -> Result<u64, ShmError> {
    let ok = capacity.is_power_of_two()
        && capacity >= layout::MIN_CAPACITY as u64
        && capacity <= layout::MAX_CAPACITY as u64
        && usize::try_from(capacity).is_ok();
    if ok {
        Ok(capacity)
    } else {
        Err(ShmError::BadCapacity { capacity })
    }
}

/// Maps exactly `DATA_OFFSET + capacity` bytes of `file`.
fn map(file: File, capacity: u64) -> Result<Shared, ShmError> {
    let len = layout::DATA_OFFSET as u64 + capacity;
    let len = usize::try_from(len).map_err(|_| ShmError::BadCapacity { capacity })?;
    let map = MmapOptions::new().len(len).map_raw(&file).map_err(io_err("mmap"))?;
    Ok(Shared { map, file, capacity })
}

/// Makes sure a memfd carries `F_SEAL_SHRINK`, adding it if needed.
fn ensure_shrink_seal(file: &File) -> Result<(), ShmError> {
    // SAFETY: F_GET_SEALS on an fd we own; no memory is passed.
    let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 {
        // EINVAL: a file on a filesystem without seals. It could be shrunk under us.
        let err = io::Error::last_os_error();
        return if err.raw_os_error() == Some(libc::EINVAL) {
            Err(ShmError::Unsealed)
        } else {
            Err(io_err("F_GET_SEALS")(err))
        };
    }
    if seals & libc::F_SEAL_SHRINK != 0 {
        return Ok(());
    }
    // SAFETY: F_ADD_SEALS on an fd we own; no memory is passed.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) } < 0 {
        return Err(ShmError::Unsealed);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::time::{Duration, Instant};

    use super::layout::*;
    use super::*;
    use crate::WaitStrategy;

    fn memfd_ring(capacity: usize) -> (ShmRing, Producer, Consumer) {
        let ring = ShmRing::create_memfd("shm-unit", capacity).unwrap();
        let tx = ring.producer().unwrap();
        let rx = ring.consumer().unwrap();
        (ring, tx, rx)
    }

    /// Drains up to `limit` records into owned copies and releases them.
    fn drain(rx: &mut Consumer, limit: usize) -> Vec<(u32, Vec<u8>)> {
        let mut out = Vec::new();
        let mut batch = rx.peek_batch(limit).unwrap();
        while let Some(r) = batch.next_record().unwrap() {
            let mut buf = vec![0u8; r.len()];
            assert_eq!(r.copy_to(&mut buf), r.len());
            out.push((r.record_type(), buf));
        }
        batch.release();
        out
    }

    fn word_at(ring: &ShmRing, idx: u64) -> (u32, u32) {
        unpack_record_header(ring.shared.record_word(idx).load(Ordering::Relaxed))
    }

    #[test]
    fn framing_header_and_alignment() {
        let (ring, mut tx, mut rx) = memfd_ring(1024);
        let lens = [0usize, 1, 7, 8, 9, 16, 31];
        for (i, &len) in lens.iter().enumerate() {
            let buf = tx.reserve(len).unwrap();
            buf.fill(i as u8 + 1);
            tx.commit(100 + i as u32);
        }
        // Walk the data area by hand: header (len, type), payload rounded up to 8.
        let mut idx = 0u64;
        for (i, &len) in lens.iter().enumerate() {
            assert_eq!(word_at(&ring, idx), (len as u32, 100 + i as u32));
            assert_eq!(idx % 8, 0);
            idx += record_span(len as u64);
        }
        assert_eq!(ring.shared.header().tail.load(Ordering::Relaxed), idx);
        assert_eq!(record_span(0), 8);
        assert_eq!(record_span(1), 16);
        assert_eq!(record_span(8), 16);
        assert_eq!(record_span(9), 24);
        let got = drain(&mut rx, usize::MAX);
        assert_eq!(got.len(), lens.len());
        for (i, (t, payload)) in got.iter().enumerate() {
            assert_eq!(*t, 100 + i as u32);
            assert_eq!(payload, &vec![i as u8 + 1; lens[i]]);
        }
        assert_eq!(ring.shared.header().head.load(Ordering::Relaxed), idx);
    }

    #[test]
    fn wrap_around_writes_a_padding_record_and_keeps_payloads_contiguous() {
        let (ring, mut tx, mut rx) = memfd_ring(256);
        // 3 records of 64 bytes (span 72) leave 40 bytes at the end.
        for i in 0..3u8 {
            tx.try_push(1, &[i; 64]).unwrap();
        }
        assert_eq!(drain(&mut rx, usize::MAX).len(), 3);
        // 48 bytes (span 56) do not fit in 40: padding at 216, the record at 0.
        tx.try_push(2, &[9; 48]).unwrap();
        assert_eq!(word_at(&ring, 216), (40 - 8, PAD_TYPE));
        assert_eq!(word_at(&ring, 0), (48, 2));
        assert_eq!(ring.shared.header().tail.load(Ordering::Relaxed), 256 + 56);
        let mut batch = rx.peek_batch(10).unwrap();
        let r = batch.next_record().unwrap().unwrap();
        assert_eq!(r.as_ptr(), ring.shared.data_ptr(8, 48).cast_const());
        let mut buf = [0u8; 48];
        r.copy_to(&mut buf);
        assert_eq!(buf, [9; 48]);
        // SAFETY: the producer is in this test and writes nothing while the slice lives.
        assert_eq!(unsafe { r.as_bytes() }, &[9; 48]);
        assert!(batch.next_record().unwrap().is_none());
        batch.release();
        assert_eq!(ring.shared.header().head.load(Ordering::Relaxed), 256 + 56);
    }

    #[test]
    fn full_is_not_fatal() {
        let (_ring, mut tx, mut rx) = memfd_ring(256);
        assert_eq!(tx.max_record_len(), 120);
        let mut n = 0;
        let err = loop {
            match tx.try_push(n, &[n as u8; 24]) {
                Ok(()) => n += 1,
                Err(e) => break e,
            }
        };
        assert_eq!(n, 8); // 8 records of span 32 fill 256 bytes
        assert!(matches!(err, ShmError::Full { needed: 32, free: 0 }), "{err:?}");
        assert!(matches!(tx.reserve(0), Err(ShmError::Full { .. })));
        // Release two records: room again.
        let mut batch = rx.peek_batch(2).unwrap();
        while batch.next_record().unwrap().is_some() {}
        batch.release();
        tx.try_push(99, &[1; 24]).unwrap();
        tx.try_push(99, &[1; 24]).unwrap();
        assert!(matches!(tx.try_push(99, &[1; 24]), Err(ShmError::Full { .. })));
        let got = drain(&mut rx, usize::MAX);
        let types: Vec<u32> = got.iter().map(|(t, _)| *t).collect();
        assert_eq!(types, [2, 3, 4, 5, 6, 7, 99, 99]);
    }

    #[test]
    fn too_large_is_refused_up_front() {
        let (_ring, mut tx, _rx) = memfd_ring(256);
        assert!(matches!(tx.reserve(121), Err(ShmError::TooLarge { len: 121, max: 120 })));
        assert!(tx.reserve(120).is_ok());
    }

    #[test]
    fn batch_commit_publishes_once() {
        let (ring, mut tx, mut rx) = memfd_ring(1024);
        for i in 0..5u32 {
            tx.reserve(4).unwrap().copy_from_slice(&i.to_le_bytes());
            tx.stage(i);
        }
        assert_eq!(tx.unpublished_len(), 5 * 16);
        assert_eq!(ring.shared.header().tail.load(Ordering::Relaxed), 0);
        assert!(rx.peek_batch(10).unwrap().is_empty());
        tx.publish();
        assert_eq!(ring.shared.header().tail.load(Ordering::Relaxed), 80);
        // Limit: two records, release them, the rest stays.
        let got = drain(&mut rx, 2);
        assert_eq!(got, vec![(0, 0u32.to_le_bytes().to_vec()), (1, 1u32.to_le_bytes().to_vec())]);
        assert_eq!(ring.shared.header().head.load(Ordering::Relaxed), 32);
        // A batch dropped without release leaves its records.
        {
            let mut batch = rx.peek_batch(10).unwrap();
            assert!(batch.next_record().unwrap().is_some());
        }
        assert_eq!(drain(&mut rx, 10).len(), 3);
    }

    #[test]
    fn abandoned_reservation_is_dropped() {
        let (_ring, mut tx, mut rx) = memfd_ring(256);
        tx.reserve(50).unwrap().fill(1);
        tx.reserve(3).unwrap().copy_from_slice(b"abc");
        tx.commit(5);
        assert_eq!(drain(&mut rx, 10), vec![(5, b"abc".to_vec())]);
    }

    #[test]
    #[should_panic(expected = "without a reservation")]
    fn commit_without_reserve_panics() {
        let (_ring, mut tx, _rx) = memfd_ring(256);
        tx.commit(1);
    }

    /// Random operations on both sides against a `VecDeque` model, with a small ring so that
    /// wrap-around, padding and full happen constantly.
    #[test]
    fn random_operations_match_a_model() {
        let (_ring, mut tx, mut rx) = memfd_ring(512);
        let mut model: VecDeque<(u32, Vec<u8>)> = VecDeque::new();
        let mut staged: Vec<(u32, Vec<u8>)> = Vec::new();
        let mut rng = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut seq = 0u32;
        let mut full = 0;
        for _ in 0..50_000 {
            match next() % 4 {
                0 | 1 => {
                    let len = (next() % 100) as usize;
                    match tx.reserve(len) {
                        Ok(buf) => {
                            for (i, b) in buf.iter_mut().enumerate() {
                                *b = seq.wrapping_add(i as u32) as u8;
                            }
                            let payload = buf.to_vec();
                            if next() % 3 == 0 {
                                tx.stage(seq);
                                staged.push((seq, payload));
                            } else {
                                tx.commit(seq);
                                model.extend(staged.drain(..));
                                model.push_back((seq, payload));
                            }
                            seq += 1;
                        }
                        Err(ShmError::Full { .. }) => {
                            full += 1;
                            tx.publish();
                            model.extend(staged.drain(..));
                        }
                        Err(e) => panic!("{e:?}"),
                    }
                }
                2 => {
                    tx.publish();
                    model.extend(staged.drain(..));
                }
                _ => {
                    let limit = (next() % 6) as usize;
                    for got in drain(&mut rx, limit) {
                        assert_eq!(Some(got), model.pop_front());
                    }
                }
            }
        }
        tx.publish();
        model.extend(staged.drain(..));
        for got in drain(&mut rx, usize::MAX) {
            assert_eq!(Some(got), model.pop_front());
        }
        assert!(model.is_empty());
        assert!(full > 100, "the ring should have been full often ({full})");
    }

    #[test]
    fn open_file_validates_the_header() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ring");
        let ring = ShmRing::create_file(&path, 4096).unwrap();
        assert_eq!(ShmRing::open_file(&path).unwrap().capacity(), 4096);
        assert!(matches!(ShmRing::create_file(&path, 4096), Err(ShmError::Io { op: "link", .. })));
        drop(ring);

        let patch = |off: usize, bytes: &[u8]| {
            let p = dir.path().join(format!("patched-{off}"));
            let mut raw = std::fs::read(&path).unwrap();
            raw[off..off + bytes.len()].copy_from_slice(bytes);
            std::fs::write(&p, raw).unwrap();
            ShmRing::open_file(&p)
        };
        assert!(matches!(patch(OFF_MAGIC, b"NOTARING"), Err(ShmError::BadMagic { .. })));
        assert!(matches!(
            patch(OFF_VERSION, &2u32.to_ne_bytes()),
            Err(ShmError::BadVersion { found: 2, supported: 1 })
        ));
        for bad in [0u64, 100, 32, 1 << 32, u64::MAX] {
            assert!(matches!(
                patch(OFF_CAPACITY, &bad.to_ne_bytes()),
                Err(ShmError::BadCapacity { capacity }) if capacity == bad
            ));
        }
        // A larger capacity than the file holds.
        assert!(matches!(
            patch(OFF_CAPACITY, &8192u64.to_ne_bytes()),
            Err(ShmError::Truncated { len, needed }) if len == 384 + 4096 && needed == 384 + 8192
        ));
        assert!(matches!(
            patch(OFF_DATA_OFFSET, &4096u64.to_ne_bytes()),
            Err(ShmError::BadLayout { data_offset: 4096 })
        ));
        // Impossible cursors are refused at attach.
        let r = patch(OFF_TAIL, &4104u64.to_ne_bytes()).unwrap();
        assert!(matches!(r.consumer(), Err(ShmError::Corrupt { .. })));
        assert!(matches!(r.producer(), Err(ShmError::Corrupt { .. })));
    }

    #[test]
    fn truncated_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ring");
        drop(ShmRing::create_file(&path, 4096).unwrap());
        let f = OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(1000).unwrap();
        assert!(matches!(
            ShmRing::open_file(&path),
            Err(ShmError::Truncated { len: 1000, needed: 4480 })
        ));
        f.set_len(100).unwrap();
        assert!(matches!(ShmRing::open_file(&path), Err(ShmError::Truncated { len: 100, .. })));
        f.set_len(0).unwrap();
        assert!(matches!(ShmRing::open_file(&path), Err(ShmError::Truncated { len: 0, .. })));
    }

    #[test]
    fn create_rejects_bad_capacity() {
        for cap in [0, 8, 63, 100, 4097, (MAX_CAPACITY * 2)] {
            assert!(matches!(ShmRing::create_memfd("x", cap), Err(ShmError::BadCapacity { .. })));
        }
    }

    #[test]
    fn roles_are_claimed_once() {
        let ring = ShmRing::create_memfd("roles", 256).unwrap();
        let tx = ring.producer().unwrap();
        assert!(matches!(ring.producer(), Err(ShmError::RoleTaken { role: Role::Producer, .. })));
        let rx = ring.consumer().unwrap();
        assert!(matches!(ring.consumer(), Err(ShmError::RoleTaken { role: Role::Consumer, .. })));
        drop(tx);
        drop(rx);
        let _tx = ring.producer().unwrap();
        let _rx = ring.consumer().unwrap();
    }

    #[test]
    fn memfd_is_sealed_and_reopens_by_fd() {
        let (ring, mut tx, _rx) = memfd_ring(4096);
        tx.try_push(3, b"over the fd").unwrap();
        let fd = ring.as_fd().try_clone_to_owned().unwrap();
        let file = File::from(fd.try_clone().unwrap());
        assert!(file.set_len(10).is_err(), "shrinking a sealed memfd must fail");
        let other = ShmRing::from_fd(fd).unwrap();
        drop(ring);
        drop(_rx);
        let mut rx = other.consumer().unwrap();
        assert_eq!(drain(&mut rx, 10), vec![(3, b"over the fd".to_vec())]);
    }

    #[test]
    fn from_fd_refuses_an_unsealable_fd() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ring");
        drop(ShmRing::create_file(&path, 4096).unwrap());
        let fd = OwnedFd::from(File::options().read(true).write(true).open(&path).unwrap());
        assert!(matches!(ShmRing::from_fd(fd), Err(ShmError::Unsealed)));
    }

    #[test]
    fn changed_header_is_a_sticky_corruption() {
        let (ring, mut tx, mut rx) = memfd_ring(256);
        tx.try_push(1, b"x").unwrap();
        ring.shared.header().capacity.store(512, Ordering::Relaxed);
        let err = rx.peek_batch(10).unwrap_err();
        assert!(matches!(err, ShmError::Corrupt { what: "header capacity changed", .. }), "{err}");
        ring.shared.header().capacity.store(256, Ordering::Relaxed);
        assert!(matches!(rx.peek_batch(10), Err(ShmError::Corrupt { .. })), "sticky");
        ring.shared.header().magic.store(0, Ordering::Relaxed);
        // The producer only looks at the header on its slow path (when it needs room).
        while tx.try_push(1, b"x").is_ok() {}
        assert!(matches!(
            tx.try_push(1, b"x"),
            Err(ShmError::Corrupt { what: "header magic changed", .. })
        ));
    }

    #[test]
    fn blocking_calls_time_out() {
        let (_ring, mut tx, mut rx) = memfd_ring(256);
        let start = Instant::now();
        let deadline = Some(start + Duration::from_millis(30));
        assert!(matches!(rx.wait_batch(10, deadline), Err(ShmError::Timeout)));
        while tx.try_push(0, &[0; 24]).is_ok() {}
        assert!(matches!(tx.reserve_blocking(24, deadline), Err(ShmError::Timeout)));
        assert!(start.elapsed() >= Duration::from_millis(30));
    }

    #[test]
    fn parked_sides_wake_each_other() {
        let (_ring, mut tx, mut rx) = memfd_ring(256);
        let park = WaitStrategy::SpinYieldPark { spins: 0, yields: 0 };
        tx.set_wait_strategy(park);
        rx.set_wait_strategy(park);
        const N: u32 = 20_000;
        let deadline = Some(Instant::now() + Duration::from_secs(30));
        let producer = std::thread::spawn(move || {
            for i in 0..N {
                let len = (i % 100) as usize;
                tx.push_blocking(i, &vec![i as u8; len], deadline).unwrap();
            }
        });
        let mut expect = 0u32;
        let mut buf = [0u8; 128];
        while expect < N {
            let mut batch = rx.wait_batch(7, deadline).unwrap();
            while let Some(r) = batch.next_record().unwrap() {
                assert_eq!(r.record_type(), expect);
                let n = r.copy_to(&mut buf);
                assert_eq!(n, (expect % 100) as usize);
                assert!(buf[..n].iter().all(|&b| b == expect as u8));
                expect += 1;
            }
            batch.release();
        }
        producer.join().unwrap();
    }
}
