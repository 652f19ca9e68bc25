//! The shared layout of a [`ShmRing`](super::ShmRing) mapping: an ABI between processes.
//!
//! Everything here is fixed by [`ABI_VERSION`]; changing an offset, a size or the meaning of a
//! field means bumping it. All integers are in the host's native byte order (both sides run on
//! one host). The table is in the [module docs](super).

use crate::sync::{AtomicU32, AtomicU64};

/// `b"FLSHMRNG"` read as a little-endian `u64`; the first 8 bytes of every ring.
pub const MAGIC: u64 = u64::from_le_bytes(*b"FLSHMRNG");
/// The layout version this code reads and writes.
pub const ABI_VERSION: u32 = 1;

/// Bytes of header before the data area; also the offset of the data area.
pub const HEADER_LEN: usize = 384;
/// Offset of the data area from the start of the mapping (same as [`HEADER_LEN`] in v1).
pub const DATA_OFFSET: usize = HEADER_LEN;

// Byte offsets of the header fields; the private `Header` struct asserts each one at compile
// time.

/// `u64` magic, [`MAGIC`].
pub const OFF_MAGIC: usize = 0;
/// `u32` ABI version.
pub const OFF_VERSION: usize = 8;
/// `u32` flags, 0 in v1.
pub const OFF_FLAGS: usize = 12;
/// `u64` capacity of the data area in bytes.
pub const OFF_CAPACITY: usize = 16;
/// `u64` offset of the data area.
pub const OFF_DATA_OFFSET: usize = 24;
/// `u32` pid of the creating process (informational).
pub const OFF_CREATOR_PID: usize = 32;
/// `u32` pid holding the producer role, 0 if none (best-effort claim).
pub const OFF_PRODUCER_PID: usize = 36;
/// `u32` pid holding the consumer role, 0 if none (best-effort claim).
pub const OFF_CONSUMER_PID: usize = 40;
/// `u64` producer cursor: bytes ever published. Written only by the producer.
pub const OFF_TAIL: usize = 128;
/// `u32` park word of a consumer waiting for data; the producer checks it after publishing.
pub const OFF_DATA_WAITER: usize = 136;
/// `u64` consumer cursor: bytes ever released. Written only by the consumer.
pub const OFF_HEAD: usize = 256;
/// `u32` park word of a producer waiting for room; the consumer checks it after releasing.
pub const OFF_ROOM_WAITER: usize = 264;

/// Smallest capacity accepted (a power of two).
pub const MIN_CAPACITY: usize = 64;
/// Largest capacity accepted (2 GiB), so that every record and padding length fits the
/// header's `u32` length field.
pub const MAX_CAPACITY: usize = 1 << 31;

/// Size of the record header that precedes every payload in the data area.
pub const RECORD_HEADER_LEN: usize = 8;
/// Alignment of every record (header and payload start) in the data area.
pub const RECORD_ALIGN: usize = 8;
/// Record type reserved for the padding record written before a wrap-around.
pub const PAD_TYPE: u32 = u32::MAX;

/// The header at the start of the mapping.
///
/// Every field, padding included, is an atomic, so a `&Header` into the shared mapping never
/// asserts that bytes the peer may write are immutable. No field is trusted: values read from
/// it are validated before use (see the module docs of [`shm`](super)).
#[repr(C)]
#[derive(Debug)]
pub(crate) struct Header {
    // Line 0 (0..128): written by the creator before publication, then read-only except the
    // claim words (written at attach and detach only).
    pub(crate) magic: AtomicU64,
    pub(crate) version: AtomicU32,
    pub(crate) flags: AtomicU32,
    pub(crate) capacity: AtomicU64,
    pub(crate) data_offset: AtomicU64,
    pub(crate) creator_pid: AtomicU32,
    pub(crate) producer_pid: AtomicU32,
    pub(crate) consumer_pid: AtomicU32,
    _reserved0: AtomicU32,
    _pad0: [AtomicU64; 10],
    // Line 1 (128..256): the producer's line. The producer writes `tail` on every publish and
    // reads `data_waiter` right after (its notify); the consumer writes `data_waiter` only when
    // it is about to sleep.
    pub(crate) tail: AtomicU64,
    pub(crate) data_waiter: AtomicU32,
    _reserved1: AtomicU32,
    _pad1: [AtomicU64; 14],
    // Line 2 (256..384): the consumer's line, the mirror image.
    pub(crate) head: AtomicU64,
    pub(crate) room_waiter: AtomicU32,
    _reserved2: AtomicU32,
    _pad2: [AtomicU64; 14],
}

const _: () = {
    use std::mem::{align_of, offset_of, size_of};
    assert!(size_of::<Header>() == HEADER_LEN);
    assert!(align_of::<Header>() <= 8);
    assert!(offset_of!(Header, magic) == OFF_MAGIC);
    assert!(offset_of!(Header, version) == OFF_VERSION);
    assert!(offset_of!(Header, flags) == OFF_FLAGS);
    assert!(offset_of!(Header, capacity) == OFF_CAPACITY);
    assert!(offset_of!(Header, data_offset) == OFF_DATA_OFFSET);
    assert!(offset_of!(Header, creator_pid) == OFF_CREATOR_PID);
    assert!(offset_of!(Header, producer_pid) == OFF_PRODUCER_PID);
    assert!(offset_of!(Header, consumer_pid) == OFF_CONSUMER_PID);
    assert!(offset_of!(Header, tail) == OFF_TAIL);
    assert!(offset_of!(Header, data_waiter) == OFF_DATA_WAITER);
    assert!(offset_of!(Header, head) == OFF_HEAD);
    assert!(offset_of!(Header, room_waiter) == OFF_ROOM_WAITER);
    // The cursors sit on their own 128-byte lines (two 64-byte lines: adjacent-line prefetch).
    assert!(
        OFF_TAIL.is_multiple_of(128) && OFF_HEAD.is_multiple_of(128) && OFF_HEAD - OFF_TAIL == 128
    );
    assert!(DATA_OFFSET.is_multiple_of(128));
    assert!(RECORD_HEADER_LEN == RECORD_ALIGN);
    assert!(MIN_CAPACITY.is_power_of_two() && MAX_CAPACITY.is_power_of_two());
    assert!(MAX_CAPACITY as u64 - 8 <= u32::MAX as u64);
};

/// Bytes a record with a `len`-byte payload occupies in the data area (header + padding to 8).
#[inline]
pub(crate) const fn record_span(len: u64) -> u64 {
    // `len` is at most `u32::MAX` where this is called, so this cannot overflow.
    (RECORD_HEADER_LEN as u64 + len + (RECORD_ALIGN as u64 - 1)) & !(RECORD_ALIGN as u64 - 1)
}

/// The record header word as stored: payload length in the low 32 bits, type in the high 32.
#[inline]
pub(crate) const fn pack_record_header(len: u32, record_type: u32) -> u64 {
    (len as u64) | ((record_type as u64) << 32)
}

/// The inverse of [`pack_record_header`]: `(len, record_type)`.
#[inline]
pub(crate) const fn unpack_record_header(word: u64) -> (u32, u32) {
    (word as u32, (word >> 32) as u32)
}
