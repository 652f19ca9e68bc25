//! FastLane's block backends behind one asynchronous seam: submit requests, drain completions.
//!
//! A [`BlockDevice`] describes one exported disk and opens [`BlockQueue`]s on it. Each queue
//! belongs to exactly one thread (a vhost-user-blk virtqueue worker, the journal writer, a
//! kvswap NVMe worker) and is never shared: no locks on the data path.
//!
//! The shape maps 1:1 onto the hardware and kernel queues underneath:
//! - io_uring: one [`BlockRequest`] is one SQE (readv/writev/fsync/fallocate), one
//!   [`Completion`] one CQE;
//! - an NVMe queue pair: one SQ entry (PRP list built from the segments), one CQ entry;
//! - RAM and the synchronous file backend ([`sync`]: `preadv`/`pwritev` for files that cannot
//!   do non-blocking buffered I/O, such as tmpfs): complete inline; `complete` returns what
//!   `submit` already finished.
//!
//! Requests name memory by raw [`Segment`]s (guest memory, DMA buffers, journal buffers), so
//! submitting is `unsafe`: the caller keeps every segment alive and does not touch a read
//! request's buffers until that request's completion has been drained.
//!
//! Backends here: [`ram::RamDisk`], [`uring::UringDevice`] (io_uring on a file or block
//! device, buffered or `O_DIRECT`) and [`sync::SyncFileDevice`] (`preadv`/`pwritev` inline).
//! Not here: the userspace NVMe driver over VFIO (`fastlane_nvme`, another [`BlockDevice`]),
//! the factory that opens a backend from a `mem:`/`file:`/`nvme:` spec (`fastlane_vhost_blk`'s
//! `spec`), and the users of the seam (the vhost-user-blk device, the journal, kvswap).

use std::time::Duration;

mod fileio;
mod inline;
pub mod ram;
pub mod sync;
pub mod uring;

pub use fileio::FileOpenError;

/// What a request asks the device to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockOp {
    /// Read `len` bytes at `offset` into the segments.
    Read,
    /// Write the segments' bytes at `offset`.
    Write,
    /// Write the segments' bytes at `offset`, durable when the request completes (forced unit
    /// access): io_uring and `pwritev2` with `RWF_DSYNC`, NVMe with the FUA bit; the RAM
    /// backend treats it as a write. A log that waits for its own writes uses it instead of
    /// a write and a flush: each write waits for its own bytes, not for a device-wide flush.
    WriteFua,
    /// Make every write completed before this flush was submitted durable on the device.
    Flush,
    /// Deallocate `len` bytes at `offset` (contents afterwards: unspecified, zeroes on the
    /// backends here).
    Discard,
    /// Make `len` bytes at `offset` read as zeroes; with `unmap` the backend may deallocate.
    WriteZeroes {
        /// The caller allows deallocation (virtio-blk `VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP`).
        unmap: bool,
    },
}

/// A piece of caller memory a request reads from or writes into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Start of the memory. Valid for `len` bytes for as long as the request is in flight.
    pub addr: *mut u8,
    /// Length in bytes.
    pub len: u32,
}

// SAFETY: a `Segment` is a plain address/length pair; who may access the memory it names is
// governed by the `unsafe` contract of `BlockQueue::submit`, not by the type.
unsafe impl Send for Segment {}

/// One request. Byte offsets and lengths: backends check them against the device size and
/// their block size, and fail the request (not the queue) when they are out of range.
#[derive(Debug, Clone, Copy)]
pub struct BlockRequest<'a> {
    /// The operation.
    pub op: BlockOp,
    /// Byte offset on the device (ignored for `Flush`).
    pub offset: u64,
    /// Byte length for `Discard` and `WriteZeroes`; for `Read`/`Write` it is the sum of the
    /// segment lengths and is not read.
    pub len: u64,
    /// Memory for `Read`/`Write`; empty for the others. The queue copies what it needs from
    /// this slice during `submit`; the slice itself need not outlive the call.
    pub segments: &'a [Segment],
    /// The caller's tag, returned in the completion.
    pub tag: u64,
}

/// A finished request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The tag the request was submitted with.
    pub tag: u64,
    /// Bytes transferred (for `Read`/`Write`), or the error.
    pub result: Result<u32, BlockError>,
}

impl Completion {
    /// An empty completion, for pre-sizing output arrays.
    pub const EMPTY: Completion = Completion { tag: 0, result: Ok(0) };
}

/// Why a request or a queue failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BlockError {
    /// The range `[offset, offset+len)` is not inside the device, or overflows.
    #[error("range out of bounds: offset {offset}, len {len}")]
    OutOfRange {
        /// Byte offset of the request.
        offset: u64,
        /// Byte length of the request.
        len: u64,
    },
    /// The offset or length is not a multiple of what the backend needs (`O_DIRECT`: the
    /// logical block size; memory alignment too).
    #[error("misaligned request: offset {offset}, len {len}, need {align}-byte alignment")]
    Misaligned {
        /// Byte offset of the request.
        offset: u64,
        /// Byte length of the request.
        len: u64,
        /// The alignment needed.
        align: u32,
    },
    /// The backend does not do this operation (or the export is read-only for writes).
    #[error("operation not supported")]
    Unsupported,
    /// The export is read-only.
    #[error("device is read-only")]
    ReadOnly,
    /// The kernel or device reported an error; the errno or status code.
    #[error("I/O error (errno {0})")]
    Io(i32),
    /// The request has more segments than the queue accepts.
    #[error("too many segments: {count}, max {max}")]
    TooManySegments {
        /// Segments in the request.
        count: usize,
        /// The queue's limit.
        max: usize,
    },
}

/// The queue has no free slot; the request is handed back untouched.
#[derive(Debug, Clone, Copy)]
pub struct QueueFull<'a>(pub BlockRequest<'a>);

/// What a device offers; the vhost-user-blk config space is built from this.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Size in bytes (a multiple of `block_size`).
    pub size_bytes: u64,
    /// Logical block size in bytes (512 or 4096).
    pub block_size: u32,
    /// Writes, discards and write-zeroes are refused.
    pub read_only: bool,
    /// `Discard` is implemented.
    pub discard: bool,
    /// `WriteZeroes` is implemented.
    pub write_zeroes: bool,
    /// `Flush` does something (false for a RAM disk, where every write is as durable as it
    /// gets; flushes still complete successfully).
    pub volatile_cache: bool,
    /// Most segments one request may carry.
    pub max_segments: u32,
}

/// One exported disk. Shared between the threads that open queues on it.
pub trait BlockDevice: Send + Sync {
    /// What the device offers.
    fn info(&self) -> DeviceInfo;

    /// Open a queue with room for `depth` requests in flight, for the calling thread's use.
    fn open_queue(&self, depth: u32) -> std::io::Result<Box<dyn BlockQueue>>;

    /// Memory the device can be told about ahead of time, so that requests into it go without
    /// a copy (the VFIO NVMe driver maps it in the IOMMU). `None` (the default): the backend
    /// reaches any memory as it is (io_uring, RAM, synchronous file).
    fn external_memory(&self) -> Option<&dyn ExternalMemory> {
        None
    }
}

/// A device's registry of caller memory that it reaches directly (zero copy): for the
/// vhost-user-blk device, the guest memory regions of the current memory table.
pub trait ExternalMemory: Send + Sync {
    /// Make the registered memory exactly `regions` (host address, length, key). A region
    /// already registered with the same address, length and key stays registered, and
    /// requests in flight into it are undisturbed; every other registered region is dropped
    /// (requests still in flight into it may fail). `key` names what backs the range (for
    /// example the file and offset it is mapped from), so that an address reused for other
    /// memory is registered anew. `&[]` drops everything.
    ///
    /// On error the registrations are partly updated: memory outside them still works, only
    /// slower (copied); a later call with the full list, or `&[]`, sets them right.
    ///
    /// # Safety
    ///
    /// For every region passed, until a later call that no longer lists it has returned
    /// `Ok` (a failed call may have left it registered), or the device is dropped:
    /// - `ptr..ptr+len` stays mapped in this process and is not replaced (no `munmap`, no
    ///   `mmap(MAP_FIXED)` over it): the device reaches the pages that are there now;
    /// - no Rust reference (`&`/`&mut`) to that memory is made or live: the device reads and
    ///   writes it by DMA at any time (raw pointers and volatile access only);
    /// - `ptr` and `len` are page-aligned (backends check, and fail the region otherwise).
    unsafe fn sync_regions(&self, regions: &[(*mut u8, usize, u64)]) -> std::io::Result<()>;
}

/// A submission/completion queue on a [`BlockDevice`], owned by one thread.
pub trait BlockQueue: Send {
    /// Queue a request.
    ///
    /// Returns `Err(QueueFull(req))` when `depth` requests are in flight; nothing was queued.
    /// A request the backend rejects (out of range, read-only, …) is accepted here and
    /// completes with the error.
    ///
    /// Requests may be batched: the backend may hold them until [`BlockQueue::kick`] or until
    /// its queue fills.
    ///
    /// # Safety
    ///
    /// For every segment of `req`, until the completion carrying `req.tag` has been returned by
    /// [`BlockQueue::complete`] (or the queue has been dropped, which waits for in-flight
    /// requests):
    /// - `addr..addr+len` stays mapped and valid;
    /// - for `Read`, nobody else reads or writes that memory (the backend, a kernel or a device
    ///   writes into it at any time until then);
    /// - for `Write`, nobody else writes that memory.
    unsafe fn submit<'a>(&mut self, req: BlockRequest<'a>) -> Result<(), QueueFull<'a>>;

    /// Push queued requests to the kernel or device (one `io_uring_enter`, one doorbell).
    fn kick(&mut self) -> std::io::Result<()>;

    /// Drain finished requests into `out`, without blocking. Returns how many were written.
    fn complete(&mut self, out: &mut [Completion]) -> usize;

    /// Block until at least one request has finished or `timeout` passes (kicks first).
    /// Returns immediately when nothing is in flight.
    fn wait(&mut self, timeout: Option<Duration>) -> std::io::Result<()>;

    /// Requests submitted and not yet returned by `complete`.
    fn in_flight(&self) -> u32;

    /// A file descriptor that becomes readable (an eventfd) when completions arrive, so a
    /// worker can sleep in one `epoll_wait` on its virtqueue kick and its backend. `None` for
    /// backends that complete inline during `submit` (RAM, synchronous file).
    fn completion_fd(&self) -> Option<std::os::fd::RawFd> {
        None
    }
}
