//! The io_uring backend: a regular file or a block device, one ring per queue.
//!
//! [`UringDevice::open`] opens the file once (optionally `O_DIRECT`, optionally read-only) and
//! learns its geometry: the size from the file's metadata or `BLKGETSIZE64`, the logical block
//! size from `BLKSSZGET` (block devices) or 512 (files); with `direct`, the `statx` DIO
//! alignment (4096 where the kernel does not report one).
//!
//! Each [`BlockDevice::open_queue`] makes its own io_uring with `depth` entries and a table of
//! `depth` slots allocated up front. One [`BlockRequest`] becomes one SQE whose `user_data` is
//! its slot:
//!
//! | op              | SQE                                                       |
//! |-----------------|-----------------------------------------------------------|
//! | `Read`/`Write`  | `READV`/`WRITEV`, iovecs copied into the slot's table      |
//! | `Flush`         | `FSYNC` with `IORING_FSYNC_DATASYNC` (fdatasync)           |
//! | `Discard`       | `FALLOCATE(PUNCH_HOLE \| KEEP_SIZE)`                       |
//! | `WriteZeroes`   | `FALLOCATE(ZERO_RANGE \| KEEP_SIZE)`                       |
//!
//! When `fallocate` answers `EOPNOTSUPP` (tmpfs has no `ZERO_RANGE`, some block devices no
//! punch hole), the slot falls back to writing zeroes from a pre-allocated 1 MiB zero buffer,
//! one `WRITE` after the other, and the queue stops trying that `fallocate` mode.
//!
//! Short transfers are resubmitted for the remainder (the slot's iovecs are advanced in
//! place), so a request completes with its full length or an error; a transfer that makes no
//! progress (a read at end of file, when the file shrank under us) fails with `Io(EIO)`.
//! `EINTR`/`EAGAIN` results are retried a bounded number of times.
//!
//! Costs per request: no allocation, no lock; the only syscall is `io_uring_enter` in
//! [`BlockQueue::kick`] and [`BlockQueue::wait`]. [`BlockQueue::complete`] reaps CQEs from
//! shared memory without a syscall, except that a resubmission (short transfer, zero-fill
//! fallback) is pushed to the kernel at its end.
//!
//! The [`BlockQueue::completion_fd`] is a non-blocking eventfd registered with the ring: the
//! kernel adds to its counter for each CQE. A worker that sleeps on it in `epoll` reads the
//! 8-byte counter (re-arming it) before draining with `complete`.
//!
//! Requests are checked before they reach the kernel, in this order: read-only, segment count,
//! range (overflow included: `OutOfRange`), then alignment. With `O_DIRECT`, offsets and
//! lengths (the request's and each segment's) must be multiples of the block size and segment
//! addresses of the DIO memory alignment, or the request completes with
//! [`BlockError::Misaligned`]. Discard and write-zeroes need block alignment on block devices
//! and with `O_DIRECT`. A read or write larger than `u32::MAX` bytes completes with
//! `OutOfRange` (the seam reports transferred bytes in a `u32`).

use std::fs::File;
use std::mem::ManuallyDrop;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use io_uring::{cqueue, opcode, squeue, types, IoUring};
use memmap2::{MmapOptions, MmapRaw};

use super::fileio::{advance_iovecs, open_disk, FileOpenError, RawGeometry};
use super::inline::InlineCompletions;

use super::{
    BlockDevice, BlockError, BlockOp, BlockQueue, BlockRequest, Completion, DeviceInfo, QueueFull,
};

/// Default most segments per request (`UringOptions::max_segments`).
pub const URING_MAX_SEGMENTS_DEFAULT: u32 = 256;
/// Upper bound for `max_segments`: Linux's `IOV_MAX`.
pub const URING_MAX_SEGMENTS_LIMIT: u32 = 1024;
/// Deepest queue `open_queue` makes (io_uring's own limit is 32768 SQ entries).
pub const URING_QUEUE_DEPTH_MAX: u32 = 4096;
/// Size of the zero buffer the write-zeroes fallback writes from.
const ZERO_BUF_BYTES: usize = 1 << 20;
/// Bounded retries of `EINTR`/`EAGAIN` per request.
const RETRIES_MAX: u8 = 8;
/// How long dropping a queue waits for requests still in the kernel.
const DROP_WAIT: Duration = Duration::from_secs(30);

/// How to open a [`UringDevice`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UringOptions {
    /// Open with `O_DIRECT` (bypass the page cache; requests must be aligned).
    pub direct: bool,
    /// Open read-only; writes, discards and write-zeroes complete with `ReadOnly`.
    pub read_only: bool,
    /// Most segments one request may carry (1..=1024); each queue slot reserves this many
    /// iovecs (16 bytes each).
    pub max_segments: u32,
}

impl Default for UringOptions {
    fn default() -> Self {
        UringOptions { direct: false, read_only: false, max_segments: URING_MAX_SEGMENTS_DEFAULT }
    }
}

/// Why a [`UringDevice`] could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum UringError {
    /// Opening the file or device, or its geometry.
    #[error(transparent)]
    File(#[from] FileOpenError),
    /// The zero buffer could not be mapped.
    #[error("cannot allocate the zero buffer")]
    ZeroBuffer(#[source] std::io::Error),
}

/// Zeroed, page-aligned memory that only the kernel reads (the write-zeroes fallback).
#[derive(Debug)]
struct ZeroBuf {
    /// Unmapped on drop: the `ZeroBuf` lives in the device's `Shared`, which every queue holds
    /// an `Arc` of until all its requests are reaped (or leaks, see `UringQueue::drop`), so
    /// the kernel no longer reads it then.
    map: MmapRaw,
}

// SAFETY: the buffer is written once, in `ZeroBuf::new`, before it is shared; afterwards only
// the kernel reads it (as the source of WRITE SQEs). Nothing in Rust makes references to it.
unsafe impl Send for ZeroBuf {}
// SAFETY: as for `Send`: read-only after construction.
unsafe impl Sync for ZeroBuf {}

impl ZeroBuf {
    fn new(len: usize) -> std::io::Result<ZeroBuf> {
        let map = MmapRaw::from(MmapOptions::new().len(len).map_anon()?);
        // Touch every page so the buffer is backed by real zeroed pages, not the shared zero
        // page (which some kernels refuse to pin for O_DIRECT).
        // SAFETY: `map` is the mapping of `len` bytes just made, writable, referenced by nobody.
        unsafe { std::ptr::write_bytes(map.as_mut_ptr(), 0, len) };
        Ok(ZeroBuf { map })
    }
}

/// What the device and its queues share; kept alive by every queue.
#[derive(Debug)]
struct Shared {
    file: File,
    zero: ZeroBuf,
}

/// A file or block device served through io_uring. Open one queue per worker thread.
#[derive(Debug, Clone)]
pub struct UringDevice {
    shared: Arc<Shared>,
    info: DeviceInfo,
    direct: bool,
    blockdev: bool,
    mem_align: u32,
}

/// The `statx` DIO alignment `(offset, memory)`, where the kernel reports one.
fn dio_align(path: &Path) -> Option<(u32, u32)> {
    let mut cpath = Vec::with_capacity(path.as_os_str().len() + 1);
    cpath.extend_from_slice(path.as_os_str().as_bytes());
    cpath.push(0);
    let cpath = std::ffi::CStr::from_bytes_with_nul(&cpath).ok()?;
    // SAFETY: `statx` is plain old data; all-zero is a valid value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: `cpath` is NUL-terminated and lives across the call; `stx` is writable.
    let rc =
        unsafe { libc::statx(libc::AT_FDCWD, cpath.as_ptr(), 0, libc::STATX_DIOALIGN, &mut stx) };
    if rc != 0 || stx.stx_mask & libc::STATX_DIOALIGN == 0 || stx.stx_dio_offset_align == 0 {
        return None;
    }
    Some((stx.stx_dio_offset_align, stx.stx_dio_mem_align.max(1)))
}

impl UringDevice {
    /// Open `path` (a regular file or a block device).
    pub fn open(path: impl AsRef<Path>, opts: UringOptions) -> Result<UringDevice, UringError> {
        let path = path.as_ref();
        let flags = if opts.direct { libc::O_DIRECT } else { 0 };
        let (file, RawGeometry { size, logical_block: logical, blockdev }) =
            open_disk(path, opts.read_only, flags, opts.max_segments, URING_MAX_SEGMENTS_LIMIT)?;
        let (block_size, mem_align) = if opts.direct {
            match dio_align(path) {
                Some((off, mem)) => (off.max(logical), mem),
                None if blockdev => (logical, logical),
                None => (4096, 4096),
            }
        } else {
            (logical, 1)
        };
        if !block_size.is_power_of_two()
            || !(512..=65_536).contains(&block_size)
            || !mem_align.is_power_of_two()
            || size < u64::from(block_size)
        {
            return Err(FileOpenError::BadGeometry {
                path: path.to_path_buf(),
                size_bytes: size,
                block_size,
            }
            .into());
        }
        let zero = ZeroBuf::new(ZERO_BUF_BYTES).map_err(UringError::ZeroBuffer)?;
        Ok(UringDevice {
            shared: Arc::new(Shared { file, zero }),
            info: DeviceInfo {
                size_bytes: size / u64::from(block_size) * u64::from(block_size),
                block_size,
                read_only: opts.read_only,
                discard: true,
                write_zeroes: true,
                volatile_cache: true,
                max_segments: opts.max_segments,
            },
            direct: opts.direct,
            blockdev,
            mem_align,
        })
    }

    /// The memory alignment segment addresses need (1 without `O_DIRECT`).
    pub fn mem_align(&self) -> u32 {
        self.mem_align
    }
}

impl BlockDevice for UringDevice {
    fn info(&self) -> DeviceInfo {
        self.info
    }

    fn open_queue(&self, depth: u32) -> std::io::Result<Box<dyn BlockQueue>> {
        Ok(Box::new(UringQueue::new(self, depth)?))
    }
}

/// What a slot is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotOp {
    Free,
    Read,
    Write,
    Flush,
    Punch,
    ZeroRange,
    ZeroFill,
}

/// One request in the kernel. `user_data` of its SQE is the slot's index.
#[derive(Debug, Clone, Copy)]
struct Slot {
    op: SlotOp,
    tag: u64,
    /// Device offset of the next byte to transfer.
    offset: u64,
    /// Bytes done so far.
    done: u64,
    /// Bytes in the request.
    total: u64,
    /// The pending iovecs: `iovecs[iov_first..iov_end]` (absolute indices).
    iov_first: usize,
    iov_end: usize,
    retries: u8,
    /// `RWF_DSYNC` for [`BlockOp::WriteFua`], else 0.
    rw_flags: i32,
}

impl Slot {
    const FREE: Slot = Slot {
        op: SlotOp::Free,
        tag: 0,
        offset: 0,
        done: 0,
        total: 0,
        iov_first: 0,
        iov_end: 0,
        retries: 0,
        rw_flags: 0,
    };
}

/// A queue on a [`UringDevice`]: one io_uring, owned by one thread.
pub struct UringQueue {
    /// Declared first so it is dropped before the eventfd it signals (and leaked, not
    /// dropped, when requests are stuck in the kernel).
    ring: ManuallyDrop<IoUring>,
    /// iovecs of every slot: slot `i` owns `[i*max_segments, (i+1)*max_segments)`. The
    /// kernel reads them during `io_uring_enter`; leaked with the ring if it may still.
    iovecs: ManuallyDrop<Box<[libc::iovec]>>,
    /// The file and the zero buffer; leaked with the ring if the kernel may still use them.
    shared: ManuallyDrop<Arc<Shared>>,
    eventfd: OwnedFd,
    fd: RawFd,
    info: DeviceInfo,
    direct: bool,
    blockdev: bool,
    mem_align: u32,
    max_segments: usize,
    slots: Box<[Slot]>,
    /// Stack of free slot indices; `free[..free_len]` are free.
    free: Box<[u32]>,
    free_len: usize,
    /// Requests refused before reaching the kernel, waiting to be drained.
    inline: InlineCompletions,
    /// `fallocate` modes this file supports, as far as we know.
    punch_hole_ok: bool,
    zero_range_ok: bool,
}

// SAFETY: the raw pointers inside (`iovecs` entries, the zero buffer) point at memory whose
// lifetime the `submit` contract and `Shared` govern, not the thread that holds the queue;
// the queue is used through `&mut self` by one thread at a time, and `IoUring` is `Send`.
unsafe impl Send for UringQueue {}

impl std::fmt::Debug for UringQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringQueue")
            .field("fd", &self.fd)
            .field("depth", &self.slots.len())
            .field("in_kernel", &self.in_kernel())
            .field("inline", &self.inline.len())
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

const IOVEC_EMPTY: libc::iovec = libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 };

impl UringQueue {
    /// A queue with room for `depth` (1..=[`URING_QUEUE_DEPTH_MAX`]) requests in flight.
    pub fn new(dev: &UringDevice, depth: u32) -> std::io::Result<UringQueue> {
        if depth == 0 || depth > URING_QUEUE_DEPTH_MAX {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("queue depth {depth} not in 1..={URING_QUEUE_DEPTH_MAX}"),
            ));
        }
        let ring: IoUring = IoUring::builder().build(depth)?;
        if !ring.params().is_feature_ext_arg() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::Unsupported,
                "io_uring without IORING_FEAT_EXT_ARG (kernel older than 5.11)",
            ));
        }
        assert!(ring.params().sq_entries() >= depth);
        // SAFETY: eventfd has no memory-safety preconditions.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if efd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `efd` is a fresh descriptor that nothing else owns.
        let eventfd = unsafe { OwnedFd::from_raw_fd(efd) };
        ring.submitter().register_eventfd(eventfd.as_raw_fd())?;
        let max_segments = dev.info.max_segments as usize;
        let depth = depth as usize;
        Ok(UringQueue {
            ring: ManuallyDrop::new(ring),
            iovecs: ManuallyDrop::new(vec![IOVEC_EMPTY; depth * max_segments].into_boxed_slice()),
            shared: ManuallyDrop::new(Arc::clone(&dev.shared)),
            eventfd,
            fd: dev.shared.file.as_raw_fd(),
            info: dev.info,
            direct: dev.direct,
            blockdev: dev.blockdev,
            mem_align: dev.mem_align,
            max_segments,
            slots: vec![Slot::FREE; depth].into_boxed_slice(),
            free: (0..depth as u32).rev().collect(),
            free_len: depth,
            inline: InlineCompletions::new(depth),
            punch_hole_ok: true,
            zero_range_ok: true,
        })
    }

    fn in_kernel(&self) -> usize {
        self.slots.len() - self.free_len
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.info.size_bytes => Ok(()),
            _ => Err(BlockError::OutOfRange { offset, len }),
        }
    }

    fn check_block_aligned(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        let bs = u64::from(self.info.block_size);
        if !offset.is_multiple_of(bs) || !len.is_multiple_of(bs) {
            return Err(BlockError::Misaligned { offset, len, align: self.info.block_size });
        }
        Ok(())
    }

    /// Check `req`; the slot it needs (without iovecs), or the error to complete it with.
    /// `Ok(None)`: nothing to do, complete with `Ok(0)`.
    fn plan(&self, req: &BlockRequest<'_>) -> Result<Option<Slot>, BlockError> {
        let mut slot = Slot { tag: req.tag, offset: req.offset, ..Slot::FREE };
        match req.op {
            BlockOp::Flush => slot.op = SlotOp::Flush,
            BlockOp::Read | BlockOp::Write | BlockOp::WriteFua => {
                let write = req.op != BlockOp::Read;
                if write && self.info.read_only {
                    return Err(BlockError::ReadOnly);
                }
                if req.op == BlockOp::WriteFua {
                    slot.rw_flags = libc::RWF_DSYNC;
                }
                if req.segments.len() > self.max_segments {
                    return Err(BlockError::TooManySegments {
                        count: req.segments.len(),
                        max: self.max_segments,
                    });
                }
                // At most 1024 segments of u32::MAX bytes: the u64 sum cannot overflow.
                let total: u64 = req.segments.iter().map(|s| u64::from(s.len)).sum();
                self.check_range(req.offset, total)?;
                if total > u64::from(u32::MAX) {
                    return Err(BlockError::OutOfRange { offset: req.offset, len: total });
                }
                if self.direct {
                    self.check_block_aligned(req.offset, total)?;
                    let bs = u64::from(self.info.block_size);
                    let mem = self.mem_align as usize;
                    for s in req.segments {
                        if u64::from(s.len) % bs != 0 {
                            return Err(BlockError::Misaligned {
                                offset: req.offset,
                                len: total,
                                align: self.info.block_size,
                            });
                        }
                        if !(s.addr as usize).is_multiple_of(mem) {
                            return Err(BlockError::Misaligned {
                                offset: req.offset,
                                len: total,
                                align: self.mem_align,
                            });
                        }
                    }
                }
                if total == 0 {
                    return Ok(None);
                }
                slot.op = if write { SlotOp::Write } else { SlotOp::Read };
                slot.total = total;
            }
            BlockOp::Discard | BlockOp::WriteZeroes { .. } => {
                if self.info.read_only {
                    return Err(BlockError::ReadOnly);
                }
                self.check_range(req.offset, req.len)?;
                if self.direct || self.blockdev {
                    self.check_block_aligned(req.offset, req.len)?;
                }
                if req.len == 0 {
                    return Ok(None);
                }
                slot.total = req.len;
                slot.op = match req.op {
                    BlockOp::Discard if self.punch_hole_ok => SlotOp::Punch,
                    BlockOp::WriteZeroes { .. } if self.zero_range_ok => SlotOp::ZeroRange,
                    _ => SlotOp::ZeroFill,
                };
            }
        }
        Ok(Some(slot))
    }

    /// The SQE for slot `idx`'s next step.
    fn sqe(&self, idx: usize) -> squeue::Entry {
        let s = &self.slots[idx];
        let fd = types::Fd(self.fd);
        let remaining = s.total - s.done;
        let entry = match s.op {
            SlotOp::Read | SlotOp::Write => {
                // `wrapping_add` only computes the address; it is in bounds (iov_first <
                // iovecs.len()) and the kernel is the one that reads through it.
                let iov = self.iovecs.as_ptr().wrapping_add(s.iov_first);
                let n = (s.iov_end - s.iov_first) as u32;
                if s.op == SlotOp::Read {
                    opcode::Readv::new(fd, iov, n).offset(s.offset).build()
                } else {
                    opcode::Writev::new(fd, iov, n).offset(s.offset).rw_flags(s.rw_flags).build()
                }
            }
            SlotOp::Flush => opcode::Fsync::new(fd).flags(types::FsyncFlags::DATASYNC).build(),
            SlotOp::Punch => opcode::Fallocate::new(fd, remaining)
                .offset(s.offset)
                .mode(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE)
                .build(),
            SlotOp::ZeroRange => opcode::Fallocate::new(fd, remaining)
                .offset(s.offset)
                .mode(libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE)
                .build(),
            SlotOp::ZeroFill => {
                let n = remaining.min(self.shared.zero.map.len() as u64) as u32;
                opcode::Write::new(fd, self.shared.zero.map.as_mut_ptr(), n)
                    .offset(s.offset)
                    .build()
            }
            SlotOp::Free => unreachable!("SQE for a free slot"),
        };
        entry.user_data(idx as u64)
    }

    /// Queue slot `idx`'s next step on the SQ (not yet submitted).
    fn push(&mut self, idx: usize) {
        let entry = self.sqe(idx);
        // SAFETY: the memory this SQE names stays valid until its CQE is reaped:
        // - the iovec array: `self.iovecs`, entries `iov_first..iov_end` of this slot, which
        //   nobody changes while the slot is in the kernel and which `Drop` leaks if the
        //   kernel may still read it;
        // - the buffers the iovecs point at: the caller of `submit` keeps them alive and
        //   untouched until `complete` returns this request's completion (or the queue's
        //   drop has seen its CQE) — the `submit` contract;
        // - the zero buffer and the file: `self.shared`, which outlives the ring (dropped
        //   after it, or leaked with it).
        let pushed = unsafe { self.ring.submission().push(&entry) };
        // Each busy slot has at most one SQE not yet consumed by the kernel, and the SQ has
        // at least `depth` entries: a full SQ is our bug.
        assert!(pushed.is_ok(), "io_uring SQ full with a free slot");
    }

    /// Finish slot `idx` with `result`.
    fn finish(&mut self, idx: usize, result: Result<u32, BlockError>) -> Completion {
        let tag = self.slots[idx].tag;
        self.slots[idx] = Slot::FREE;
        self.free[self.free_len] = idx as u32;
        self.free_len += 1;
        Completion { tag, result }
    }

    /// Handle one CQE: `Some(completion)` if its request is done, `None` if it was
    /// resubmitted (pushed on the SQ).
    fn on_cqe(&mut self, cqe: &cqueue::Entry) -> Option<Completion> {
        let idx = cqe.user_data() as usize;
        let res = cqe.result();
        if idx >= self.slots.len() || self.slots[idx].op == SlotOp::Free {
            // Validate what the kernel hands back; a stray CQE is a bug somewhere, not a
            // reason to touch a slot that is not ours.
            log::error!("io_uring CQE for unknown slot {idx} (result {res}); ignored");
            return None;
        }
        let slot = self.slots[idx];
        if res == -libc::EINTR || res == -libc::EAGAIN {
            if slot.retries < RETRIES_MAX {
                self.slots[idx].retries += 1;
                self.push(idx);
                return None;
            }
            return Some(self.finish(idx, Err(BlockError::Io(-res))));
        }
        match slot.op {
            SlotOp::Free => unreachable!("checked above"),
            SlotOp::Flush => Some(self.finish(idx, io_result(res).map(|_| 0))),
            SlotOp::Punch | SlotOp::ZeroRange if res == -libc::EOPNOTSUPP => {
                if slot.op == SlotOp::Punch {
                    self.punch_hole_ok = false;
                } else {
                    self.zero_range_ok = false;
                }
                self.slots[idx].op = SlotOp::ZeroFill;
                self.push(idx);
                None
            }
            SlotOp::Punch | SlotOp::ZeroRange => Some(self.finish(idx, io_result(res).map(|_| 0))),
            SlotOp::Read | SlotOp::Write | SlotOp::ZeroFill => {
                let n = match io_result(res) {
                    Err(e) => return Some(self.finish(idx, Err(e))),
                    Ok(n) => u64::from(n),
                };
                let remaining = slot.total - slot.done;
                if n == 0 || n > remaining {
                    if n > remaining {
                        log::error!("io_uring: {n} bytes done of {remaining} asked (slot {idx})");
                    }
                    return Some(self.finish(idx, Err(BlockError::Io(libc::EIO))));
                }
                if n == remaining {
                    let bytes = if slot.op == SlotOp::ZeroFill { 0 } else { slot.total as u32 };
                    return Some(self.finish(idx, Ok(bytes)));
                }
                // Short transfer: move on by `n` bytes and go again.
                let s = &mut self.slots[idx];
                s.done += n;
                s.offset += n;
                if s.op != SlotOp::ZeroFill {
                    s.iov_first = advance_iovecs(&mut self.iovecs[..s.iov_end], s.iov_first, n);
                }
                self.push(idx);
                None
            }
        }
    }

    /// Pop one CQE, if any (no syscall).
    fn next_cqe(&mut self) -> Option<cqueue::Entry> {
        self.ring.completion().next()
    }

    /// Submit what is on the SQ; transient errors leave it there for the next call.
    fn submit_pending(&mut self) -> std::io::Result<()> {
        if self.ring.submission().is_empty() {
            return Ok(());
        }
        match self.ring.submit() {
            Ok(_) => Ok(()),
            Err(e)
                if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) =>
            {
                Ok(())
            }
            Err(e) => Err(e),
        }
    }
}

fn io_result(res: i32) -> Result<u32, BlockError> {
    if res < 0 {
        Err(BlockError::Io(-res))
    } else {
        Ok(res as u32)
    }
}

impl BlockQueue for UringQueue {
    unsafe fn submit<'a>(&mut self, req: BlockRequest<'a>) -> Result<(), QueueFull<'a>> {
        if self.in_kernel() + self.inline.len() >= self.slots.len() {
            return Err(QueueFull(req));
        }
        let mut slot = match self.plan(&req) {
            Ok(Some(slot)) => slot,
            Ok(None) => {
                self.inline.push(Completion { tag: req.tag, result: Ok(0) });
                return Ok(());
            }
            Err(e) => {
                self.inline.push(Completion { tag: req.tag, result: Err(e) });
                return Ok(());
            }
        };
        // A free slot exists: in_kernel + inline < depth == slots.
        self.free_len -= 1;
        let idx = self.free[self.free_len] as usize;
        debug_assert_eq!(self.slots[idx].op, SlotOp::Free);
        if matches!(slot.op, SlotOp::Read | SlotOp::Write) {
            slot.iov_first = idx * self.max_segments;
            slot.iov_end = slot.iov_first + req.segments.len();
            for (iov, s) in self.iovecs[slot.iov_first..slot.iov_end].iter_mut().zip(req.segments) {
                *iov = libc::iovec { iov_base: s.addr.cast(), iov_len: s.len as usize };
            }
        }
        self.slots[idx] = slot;
        self.push(idx);
        Ok(())
    }

    fn kick(&mut self) -> std::io::Result<()> {
        self.submit_pending()
    }

    fn complete(&mut self, out: &mut [Completion]) -> usize {
        let mut n = self.inline.drain(out);
        let mut resubmitted = false;
        // Bounded: every CQE frees a slot or resubmits one, and the CQ holds at most
        // 2 × depth entries; stop as soon as `out` is full.
        while n < out.len() {
            let Some(cqe) = self.next_cqe() else { break };
            match self.on_cqe(&cqe) {
                Some(c) => {
                    out[n] = c;
                    n += 1;
                }
                None => resubmitted = true,
            }
        }
        if resubmitted {
            if let Err(e) = self.submit_pending() {
                log::error!("io_uring resubmit failed: {e}; retried on the next kick");
            }
        }
        n
    }

    fn wait(&mut self, timeout: Option<Duration>) -> std::io::Result<()> {
        if !self.inline.is_empty() || self.in_kernel() == 0 || !self.ring.completion().is_empty() {
            return Ok(());
        }
        let r = match timeout {
            None => self.ring.submit_and_wait(1),
            Some(d) => {
                let ts = types::Timespec::from(d);
                let args = types::SubmitArgs::new().timespec(&ts);
                self.ring.submitter().submit_with_args(1, &args)
            }
        };
        match r {
            Ok(_) => Ok(()),
            Err(e) if matches!(e.raw_os_error(), Some(libc::ETIME | libc::EINTR)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    fn in_flight(&self) -> u32 {
        (self.in_kernel() + self.inline.len()) as u32
    }

    fn completion_fd(&self) -> Option<RawFd> {
        Some(self.eventfd.as_raw_fd())
    }
}

impl Drop for UringQueue {
    fn drop(&mut self) {
        // Requests still in the kernel name caller memory, our iovecs and the zero buffer:
        // wait for their CQEs (without resubmitting anything) before freeing any of it.
        let deadline = Instant::now() + DROP_WAIT;
        let _ = self.submit_pending();
        while self.in_kernel() > 0 {
            while let Some(cqe) = self.next_cqe() {
                let idx = cqe.user_data() as usize;
                if idx < self.slots.len() && self.slots[idx].op != SlotOp::Free {
                    let _ = self.finish(idx, Ok(0));
                }
            }
            let now = Instant::now();
            if self.in_kernel() == 0 || now >= deadline {
                break;
            }
            let ts = types::Timespec::from((deadline - now).min(Duration::from_millis(100)));
            let args = types::SubmitArgs::new().timespec(&ts);
            let _ = self.ring.submitter().submit_with_args(1, &args);
        }
        if self.in_kernel() > 0 {
            log::error!(
                "io_uring queue dropped with {} requests still in the kernel after {:?}; \
                 leaking the ring and its buffers",
                self.in_kernel(),
                DROP_WAIT
            );
            return;
        }
        // SAFETY: no request is in the kernel any more, so nothing reads these; each is
        // dropped exactly once, here, and never used afterwards. The ring goes first.
        unsafe { ManuallyDrop::drop(&mut self.ring) };
        // SAFETY: as above.
        unsafe { ManuallyDrop::drop(&mut self.iovecs) };
        // SAFETY: as above.
        unsafe { ManuallyDrop::drop(&mut self.shared) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_transfer_advances_iovecs() {
        let mut mem = [0u8; 64];
        let base = mem.as_mut_ptr();
        let iov = |at: usize, len: usize| libc::iovec {
            iov_base: base.wrapping_add(at).cast(),
            iov_len: len,
        };
        let mut v = [iov(0, 8), iov(16, 8), iov(32, 16)];
        // Exactly the first iovec.
        assert_eq!(advance_iovecs(&mut v, 0, 8), 1);
        // Into the middle of the second.
        assert_eq!(advance_iovecs(&mut v, 1, 3), 1);
        assert_eq!((v[1].iov_base, v[1].iov_len), (base.wrapping_add(19).cast(), 5));
        // The rest of the second and 10 of the third.
        assert_eq!(advance_iovecs(&mut v, 1, 15), 2);
        assert_eq!((v[2].iov_base, v[2].iov_len), (base.wrapping_add(42).cast(), 6));
        // Everything: past the end.
        assert_eq!(advance_iovecs(&mut v, 2, 6), 3);
        // Zero bytes: nothing moves.
        assert_eq!(advance_iovecs(&mut v, 3, 0), 3);
    }

    fn file_of(len: u64) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        f.as_file().set_len(len).unwrap();
        f
    }

    #[test]
    fn geometry_of_a_file() {
        let f = file_of(1000);
        let dev = UringDevice::open(f.path(), UringOptions::default()).unwrap();
        let info = dev.info();
        // Rounded down to whole blocks; the tail is not exported.
        assert_eq!((info.size_bytes, info.block_size), (512, 512));
        assert!(info.volatile_cache && info.discard && info.write_zeroes && !info.read_only);
        assert_eq!(info.max_segments, URING_MAX_SEGMENTS_DEFAULT);
        assert_eq!(dev.mem_align(), 1);
    }

    #[test]
    fn refused_requests_complete_inline_in_order() {
        let f = file_of(1 << 20);
        let dev = UringDevice::open(f.path(), UringOptions::default()).unwrap();
        let mut q = UringQueue::new(&dev, 2).unwrap();
        for tag in 0..2 {
            let req =
                BlockRequest { op: BlockOp::Discard, offset: u64::MAX, len: 1, segments: &[], tag };
            // SAFETY: no segments.
            unsafe { q.submit(req) }.unwrap();
        }
        let req = BlockRequest { op: BlockOp::Flush, offset: 0, len: 0, segments: &[], tag: 9 };
        // SAFETY: no segments.
        assert!(unsafe { q.submit(req) }.is_err(), "inline completions count");
        assert_eq!(q.in_flight(), 2);
        let mut out = [Completion::EMPTY; 4];
        assert_eq!(q.complete(&mut out), 2);
        assert_eq!((out[0].tag, out[1].tag), (0, 1));
        assert!(matches!(out[0].result, Err(BlockError::OutOfRange { .. })));
        assert_eq!(q.in_flight(), 0);
        // Nothing in flight: wait returns at once.
        q.wait(None).unwrap();
    }
}
