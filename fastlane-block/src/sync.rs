//! The synchronous file backend: a regular file or block device served with
//! `preadv`/`pwritev` inside [`BlockQueue::submit`].
//!
//! For files that cannot do non-blocking buffered I/O — tmpfs and ramfs answer a
//! `preadv2(…, RWF_NOWAIT)` with `EOPNOTSUPP` — io_uring cannot complete a read or write
//! inline and hands every one to an `iou-wrk` kernel thread, which then competes with the
//! polling worker for its CPU (two context switches per request; see BENCHMARKS.md,
//! "vhost-user-blk"). On such a file the copy itself is a memcpy from the page cache that never
//! waits for a device, so doing it on the worker's own thread is both the shortest path and
//! the one that cannot stall: this backend does exactly that. [`probe_nowait`] tells the two
//! kinds of file apart; `file:` specs pick this backend by default when it says
//! [`NowaitProbe::Unsupported`] (see `fastlane_vhost_blk::spec`).
//!
//! It is not for files on a real device: a page-cache miss blocks the queue's thread for the
//! whole device read, and nothing else on that queue moves meanwhile.
//!
//! # Requests
//!
//! Each request is one syscall (plus one per short transfer, which `preadv`/`pwritev` only
//! make at end of file or on a signal), executed in `submit`; its completion goes into a ring
//! allocated by `open_queue`, and [`BlockQueue::complete`] drains it. No allocation and no
//! lock per request: the iovec array (`max_segments` entries) is allocated with the queue.
//!
//! | op                         | syscall, in order of preference                                   |
//! |----------------------------|-------------------------------------------------------------------|
//! | `Read`/`Write`             | `preadv`/`pwritev`; short transfers continue from where they stopped |
//! | `Flush`                    | `fdatasync`                                                       |
//! | `Discard`                  | `fallocate(PUNCH_HOLE)`, `fallocate(ZERO_RANGE)`, write zeroes     |
//! | `WriteZeroes { unmap }`    | `fallocate(PUNCH_HOLE)`, `fallocate(ZERO_RANGE)`, write zeroes     |
//! | `WriteZeroes { !unmap }`   | `fallocate(ZERO_RANGE)`, write zeroes                             |
//!
//! Every `fallocate` keeps the file size (`KEEP_SIZE`). A hole reads as zeroes, so punching one
//! is a valid write-zeroes when the guest allows deallocation; without `unmap` the blocks stay
//! allocated: tmpfs, which has no `ZERO_RANGE`, gets zeroes written from a 1 MiB zero buffer
//! allocated with the device (one `pwrite` per MiB, all inside `submit`). A mode that answers
//! `EOPNOTSUPP` is not tried again on that queue.
//!
//! Requests are checked before any syscall, in this order: read-only, segment count, range
//! (overflow included: [`BlockError::OutOfRange`]; also a read or write larger than `u32::MAX`
//! bytes, since the seam reports transferred bytes in a `u32`), then, on block devices, block
//! alignment of discard and write-zeroes (`Misaligned`). Reads and writes need no alignment
//! (no `O_DIRECT`: the page cache takes any offset). `EINTR` is retried (bounded); a transfer
//! that makes no progress (a read at end of file, when the file shrank under us) fails with
//! `Io(EIO)`; other errors complete the request with `Io(errno)`.

use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::path::Path;
use std::sync::Arc;

use super::fileio::{advance_iovecs, open_disk, FileOpenError, RawGeometry};
use super::inline::{inline_block_queue, InlineCompletions};
use super::{BlockDevice, BlockError, BlockOp, BlockQueue, BlockRequest, DeviceInfo};

/// Default most segments per request (`SyncFileOptions::max_segments`).
pub const SYNC_MAX_SEGMENTS_DEFAULT: u32 = 1024;
/// Upper bound for `max_segments`: Linux's `IOV_MAX`, the most one `preadv` takes.
pub const SYNC_MAX_SEGMENTS_LIMIT: u32 = 1024;
/// Deepest queue `open_queue` makes (the completion ring is allocated up front).
pub const SYNC_QUEUE_DEPTH_MAX: u32 = 65_536;
/// Size of the zero buffer write-zeroes falls back to writing from.
const ZERO_BUF_BYTES: usize = 1 << 20;
/// Bounded retries of `EINTR` per request.
const EINTR_RETRIES_MAX: u32 = 64;

/// `statfs.f_type` of tmpfs.
const TMPFS_MAGIC: i64 = 0x0102_1994;
/// `statfs.f_type` of ramfs.
const RAMFS_MAGIC: i64 = 0x8584_58f6;
/// `statfs.f_type` of ext2/3/4.
const EXT4_SUPER_MAGIC: i64 = 0xef53;
/// `statfs.f_type` of XFS.
const XFS_SUPER_MAGIC: i64 = 0x5846_5342;
/// `statfs.f_type` of btrfs.
const BTRFS_SUPER_MAGIC: i64 = 0x9123_683e;

/// How to open a [`SyncFileDevice`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyncFileOptions {
    /// Open read-only; writes, discards and write-zeroes complete with `ReadOnly`.
    pub read_only: bool,
    /// Most segments one request may carry (1..=1024); each queue reserves this many iovecs
    /// (16 bytes each).
    pub max_segments: u32,
}

impl Default for SyncFileOptions {
    fn default() -> Self {
        SyncFileOptions { read_only: false, max_segments: SYNC_MAX_SEGMENTS_DEFAULT }
    }
}

/// Why a [`SyncFileDevice`] could not be opened.
pub type SyncFileError = FileOpenError;

/// What the device and its queues share.
#[derive(Debug)]
struct Shared {
    file: File,
    /// Zeroes, only ever read (the source of the write-zeroes fallback's `pwrite`s).
    zero: Box<[u8]>,
}

/// A file or block device served with synchronous syscalls. Open one queue per worker thread.
#[derive(Debug, Clone)]
pub struct SyncFileDevice {
    shared: Arc<Shared>,
    info: DeviceInfo,
    blockdev: bool,
}

impl SyncFileDevice {
    /// Open `path` (a regular file or a block device), buffered (no `O_DIRECT`).
    pub fn open(
        path: impl AsRef<Path>,
        opts: SyncFileOptions,
    ) -> Result<SyncFileDevice, SyncFileError> {
        let path = path.as_ref();
        let (file, RawGeometry { size, logical_block: block_size, blockdev }) =
            open_disk(path, opts.read_only, 0, opts.max_segments, SYNC_MAX_SEGMENTS_LIMIT)?;
        // `preadv` takes an `off_t`: the whole device must be addressable with one.
        if !block_size.is_power_of_two()
            || !(512..=65_536).contains(&block_size)
            || size < u64::from(block_size)
            || size > i64::MAX as u64
        {
            return Err(FileOpenError::BadGeometry {
                path: path.to_path_buf(),
                size_bytes: size,
                block_size,
            });
        }
        Ok(SyncFileDevice {
            shared: Arc::new(Shared { file, zero: vec![0u8; ZERO_BUF_BYTES].into_boxed_slice() }),
            info: DeviceInfo {
                size_bytes: size / u64::from(block_size) * u64::from(block_size),
                block_size,
                read_only: opts.read_only,
                discard: true,
                write_zeroes: true,
                volatile_cache: true,
                max_segments: opts.max_segments,
            },
            blockdev,
        })
    }
}

impl BlockDevice for SyncFileDevice {
    fn info(&self) -> DeviceInfo {
        self.info
    }

    fn open_queue(&self, depth: u32) -> std::io::Result<Box<dyn BlockQueue>> {
        Ok(Box::new(SyncFileQueue::new(self, depth)?))
    }
}

/// A queue on a [`SyncFileDevice`]: does every request inside `submit`.
pub struct SyncFileQueue {
    /// Keeps the file (and so `fd`) and the zero buffer alive.
    shared: Arc<Shared>,
    fd: RawFd,
    info: DeviceInfo,
    blockdev: bool,
    /// Scratch iovecs for one request (`max_segments` entries), filled and consumed within a
    /// single `submit`; between calls they hold stale addresses nobody reads.
    iovecs: Box<[libc::iovec]>,
    /// Finished requests not yet drained.
    done: InlineCompletions,
    /// `fallocate` modes this file supports, as far as we know.
    punch_hole_ok: bool,
    zero_range_ok: bool,
}

// SAFETY: the only non-`Send` fields are the raw pointers inside `iovecs`; they are written and
// handed to the kernel within one `submit` call on the thread that holds `&mut self`, and never
// dereferenced afterwards, so moving the queue to another thread moves no live borrow.
unsafe impl Send for SyncFileQueue {}

impl std::fmt::Debug for SyncFileQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SyncFileQueue")
            .field("fd", &self.fd)
            .field("in_flight", &self.done.len())
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

const IOVEC_EMPTY: libc::iovec = libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 };

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)
}

impl SyncFileQueue {
    /// A queue with room for `depth` (1..=[`SYNC_QUEUE_DEPTH_MAX`]) undrained completions.
    pub fn new(dev: &SyncFileDevice, depth: u32) -> std::io::Result<SyncFileQueue> {
        if depth == 0 || depth > SYNC_QUEUE_DEPTH_MAX {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("queue depth {depth} not in 1..={SYNC_QUEUE_DEPTH_MAX}"),
            ));
        }
        Ok(SyncFileQueue {
            shared: Arc::clone(&dev.shared),
            fd: dev.shared.file.as_raw_fd(),
            info: dev.info,
            blockdev: dev.blockdev,
            iovecs: vec![IOVEC_EMPTY; dev.info.max_segments as usize].into_boxed_slice(),
            done: InlineCompletions::new(depth as usize),
            punch_hole_ok: true,
            zero_range_ok: true,
        })
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.info.size_bytes => Ok(()),
            _ => Err(BlockError::OutOfRange { offset, len }),
        }
    }

    /// Do the request; its outcome.
    ///
    /// # Safety
    ///
    /// The segments obey the contract of [`BlockQueue::submit`] for the duration of the call.
    unsafe fn execute(&mut self, req: &BlockRequest<'_>) -> Result<u32, BlockError> {
        match req.op {
            BlockOp::Flush => self.fdatasync().map(|()| 0),
            BlockOp::Read | BlockOp::Write | BlockOp::WriteFua => {
                let write = req.op != BlockOp::Read;
                let flags = if req.op == BlockOp::WriteFua { libc::RWF_DSYNC } else { 0 };
                if write && self.info.read_only {
                    return Err(BlockError::ReadOnly);
                }
                if req.segments.len() > self.iovecs.len() {
                    return Err(BlockError::TooManySegments {
                        count: req.segments.len(),
                        max: self.iovecs.len(),
                    });
                }
                // At most 1024 segments of u32::MAX bytes: the u64 sum cannot overflow.
                let total: u64 = req.segments.iter().map(|s| u64::from(s.len)).sum();
                self.check_range(req.offset, total)?;
                if total > u64::from(u32::MAX) {
                    return Err(BlockError::OutOfRange { offset: req.offset, len: total });
                }
                if total == 0 {
                    return Ok(0);
                }
                for (iov, s) in self.iovecs.iter_mut().zip(req.segments) {
                    *iov = libc::iovec { iov_base: s.addr.cast(), iov_len: s.len as usize };
                }
                // SAFETY: forwarded from our caller: the segments the iovecs name stay valid
                // (and, for a read, untouched by anyone else) for this call.
                unsafe { self.transfer(write, flags, req.offset, req.segments.len(), total) }?;
                Ok(total as u32)
            }
            BlockOp::Discard | BlockOp::WriteZeroes { .. } => {
                if self.info.read_only {
                    return Err(BlockError::ReadOnly);
                }
                self.check_range(req.offset, req.len)?;
                if self.blockdev {
                    let bs = u64::from(self.info.block_size);
                    if !req.offset.is_multiple_of(bs) || !req.len.is_multiple_of(bs) {
                        return Err(BlockError::Misaligned {
                            offset: req.offset,
                            len: req.len,
                            align: self.info.block_size,
                        });
                    }
                }
                if req.len == 0 {
                    return Ok(0);
                }
                let may_punch =
                    matches!(req.op, BlockOp::Discard | BlockOp::WriteZeroes { unmap: true });
                self.zero(req.offset, req.len, may_punch).map(|()| 0)
            }
        }
    }

    /// Move `total` bytes between `offset` and the caller memory named by `iovecs[..count]`.
    ///
    /// # Safety
    ///
    /// `iovecs[..count]` name memory that obeys the [`BlockQueue::submit`] contract for the
    /// duration of the call, `total` is their summed length, and `offset + total` lies inside
    /// the device (checked by the caller).
    unsafe fn transfer(
        &mut self,
        write: bool,
        flags: libc::c_int,
        offset: u64,
        count: usize,
        total: u64,
    ) -> Result<(), BlockError> {
        let mut first = 0;
        let mut done = 0u64;
        let mut eintr = 0u32;
        // Bounded: every pass moves at least one byte, or is one of EINTR_RETRIES_MAX retries,
        // or returns.
        while done < total {
            // `offset + total <= size_bytes <= i64::MAX` (checked at open and by the caller).
            let pos = (offset + done) as libc::off_t;
            let iov = self.iovecs[first..count].as_ptr();
            let iovcnt = (count - first) as libc::c_int;
            // SAFETY:
            // - `iov..iov+iovcnt` lies in `self.iovecs`, which we own and do not touch during
            //   the call; `count <= iovecs.len() <= IOV_MAX`;
            // - every iovec names caller memory that the `submit` contract (forwarded by our
            //   caller) keeps mapped for this call: for a read, memory nobody else accesses,
            //   which the kernel writes; for a write, memory nobody else writes, which the
            //   kernel reads;
            // - `self.fd` is open: `self.shared` owns the file.
            let rc = if write {
                // SAFETY: see above (the kernel reads the caller's memory).
                unsafe { libc::pwritev2(self.fd, iov, iovcnt, pos, flags) }
            } else {
                // SAFETY: see above (the kernel writes the caller's memory).
                unsafe { libc::preadv(self.fd, iov, iovcnt, pos) }
            };
            if rc < 0 {
                let e = errno();
                if e == libc::EINTR && eintr < EINTR_RETRIES_MAX {
                    eintr += 1;
                    continue;
                }
                return Err(BlockError::Io(e));
            }
            let n = rc as u64;
            if n == 0 || n > total - done {
                // 0: end of file (the file shrank under us) or no progress; more than asked:
                // the kernel broke its promise. Either way the request cannot finish.
                if n > total - done {
                    log::error!("sync file: {n} bytes done of {} asked", total - done);
                }
                return Err(BlockError::Io(libc::EIO));
            }
            done += n;
            if done < total {
                first = advance_iovecs(&mut self.iovecs[..count], first, n);
            }
        }
        Ok(())
    }

    fn fdatasync(&self) -> Result<(), BlockError> {
        for _ in 0..=EINTR_RETRIES_MAX {
            // SAFETY: fdatasync has no memory-safety preconditions; `self.fd` is open
            // (`self.shared` owns the file).
            if unsafe { libc::fdatasync(self.fd) } == 0 {
                return Ok(());
            }
            let e = errno();
            if e != libc::EINTR {
                return Err(BlockError::Io(e));
            }
        }
        Err(BlockError::Io(libc::EINTR))
    }

    /// `fallocate(mode | KEEP_SIZE)` over the range; `Err(errno)`.
    fn fallocate(&self, mode: libc::c_int, offset: u64, len: u64) -> Result<(), i32> {
        // Range-checked by the caller against a size that fits an `off_t`.
        let (off, len) = (offset as libc::off_t, len as libc::off_t);
        for _ in 0..=EINTR_RETRIES_MAX {
            // SAFETY: fallocate names no memory; `self.fd` is open (`self.shared`).
            let rc =
                unsafe { libc::fallocate(self.fd, mode | libc::FALLOC_FL_KEEP_SIZE, off, len) };
            if rc == 0 {
                return Ok(());
            }
            let e = errno();
            if e != libc::EINTR {
                return Err(e);
            }
        }
        Err(libc::EINTR)
    }

    /// Make `[offset, offset+len)` (checked, non-empty) read as zeroes; `may_punch`: the caller
    /// allows deallocation.
    fn zero(&mut self, offset: u64, len: u64, may_punch: bool) -> Result<(), BlockError> {
        if may_punch && self.punch_hole_ok {
            match self.fallocate(libc::FALLOC_FL_PUNCH_HOLE, offset, len) {
                Ok(()) => return Ok(()),
                Err(libc::EOPNOTSUPP) => self.punch_hole_ok = false,
                Err(e) => return Err(BlockError::Io(e)),
            }
        }
        if self.zero_range_ok {
            match self.fallocate(libc::FALLOC_FL_ZERO_RANGE, offset, len) {
                Ok(()) => return Ok(()),
                Err(libc::EOPNOTSUPP) => self.zero_range_ok = false,
                Err(e) => return Err(BlockError::Io(e)),
            }
        }
        self.write_zeroes(offset, len)
    }

    /// Write zeroes over `[offset, offset+len)` from the shared zero buffer.
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        let zero = &self.shared.zero;
        let mut done = 0u64;
        let mut eintr = 0u32;
        // Bounded: every pass writes at least one byte, retries EINTR at most
        // EINTR_RETRIES_MAX times, or returns.
        while done < len {
            let n = (len - done).min(zero.len() as u64) as usize;
            let pos = (offset + done) as libc::off_t;
            // SAFETY: `zero[..n]` is initialised memory we hold a shared borrow of for the call;
            // the kernel only reads it. `self.fd` is open (`self.shared`).
            let rc = unsafe { libc::pwrite(self.fd, zero.as_ptr().cast(), n, pos) };
            if rc < 0 {
                let e = errno();
                if e == libc::EINTR && eintr < EINTR_RETRIES_MAX {
                    eintr += 1;
                    continue;
                }
                return Err(BlockError::Io(e));
            }
            if rc == 0 || rc as usize > n {
                return Err(BlockError::Io(libc::EIO));
            }
            done += rc as u64;
        }
        Ok(())
    }
}

inline_block_queue!(SyncFileQueue);

/// What a `preadv2(…, RWF_NOWAIT)` of one block said about a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NowaitProbe {
    /// The read completed, or would have blocked (`EAGAIN`): the file does non-blocking
    /// buffered reads, so io_uring completes cached reads inline.
    Supported,
    /// `EOPNOTSUPP`: no non-blocking buffered I/O (tmpfs, ramfs); io_uring hands every request
    /// to a worker thread.
    Unsupported,
    /// Some other error (the errno); nothing learnt.
    Failed(i32),
}

/// Probe whether `file` does non-blocking buffered reads: one `preadv2(…, RWF_NOWAIT)` of 512
/// bytes at offset 0 into a stack buffer. Never blocks (that is what `RWF_NOWAIT` means) and
/// changes nothing. Meaningful for files opened without `O_DIRECT`.
pub fn probe_nowait(file: &File) -> NowaitProbe {
    let mut buf = [0u8; 512];
    let iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: one iovec naming `buf`, a local array we own exclusively for the call; the
    // kernel writes at most 512 bytes into it. The descriptor is open (`file` is borrowed).
    let rc = unsafe { libc::preadv2(file.as_raw_fd(), &iov, 1, 0, libc::RWF_NOWAIT) };
    if rc >= 0 {
        return NowaitProbe::Supported;
    }
    match errno() {
        libc::EAGAIN => NowaitProbe::Supported,
        libc::EOPNOTSUPP => NowaitProbe::Unsupported,
        e => NowaitProbe::Failed(e),
    }
}

/// The name of the filesystem `file` is on (from `fstatfs`), for logs: `tmpfs`, `ramfs`,
/// `ext4`, `xfs`, `btrfs`, or the magic number in hex.
pub fn filesystem_name(file: &File) -> String {
    // SAFETY: `statfs` is plain old data; all-zero is a valid value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a writable statfs on our stack; the descriptor is open.
    if unsafe { libc::fstatfs(file.as_raw_fd(), &mut st) } != 0 {
        return "an unknown filesystem".to_string();
    }
    // `f_type`'s integer type differs between targets; the magics are all below 2^32.
    #[allow(clippy::unnecessary_cast)]
    let magic = st.f_type as i64 & 0xffff_ffff;
    match magic {
        TMPFS_MAGIC => "tmpfs".to_string(),
        RAMFS_MAGIC => "ramfs".to_string(),
        EXT4_SUPER_MAGIC => "ext4".to_string(),
        XFS_SUPER_MAGIC => "xfs".to_string(),
        BTRFS_SUPER_MAGIC => "btrfs".to_string(),
        m => format!("filesystem {m:#x}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Completion;
    use crate::Segment;

    #[test]
    fn short_transfer_advances_iovecs() {
        let mut mem = [0u8; 64];
        let base = mem.as_mut_ptr();
        let iov = |at: usize, len: usize| libc::iovec {
            iov_base: base.wrapping_add(at).cast(),
            iov_len: len,
        };
        let mut v = [iov(0, 8), iov(16, 0), iov(16, 8), iov(32, 16)];
        // The first iovec and the empty one after it.
        assert_eq!(advance_iovecs(&mut v, 0, 8), 1);
        assert_eq!(advance_iovecs(&mut v, 1, 3), 2);
        assert_eq!((v[2].iov_base, v[2].iov_len), (base.wrapping_add(19).cast(), 5));
        assert_eq!(advance_iovecs(&mut v, 2, 15), 3);
        assert_eq!((v[3].iov_base, v[3].iov_len), (base.wrapping_add(42).cast(), 6));
        assert_eq!(advance_iovecs(&mut v, 3, 6), 4);
        assert_eq!(advance_iovecs(&mut v, 4, 0), 4);
    }

    fn file_in(dir: &Path, len: u64) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new_in(dir).unwrap();
        let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8 | 1).collect();
        std::fs::write(f.path(), data).unwrap();
        f
    }

    fn run(q: &mut dyn BlockQueue, req: BlockRequest<'_>) -> Result<u32, BlockError> {
        // SAFETY: every caller passes segments over buffers it owns and does not touch until
        // this returns; the request has completed by then (inline).
        unsafe { q.submit(req) }.expect("queue has room");
        let mut out = [Completion::EMPTY; 1];
        assert_eq!(q.complete(&mut out), 1);
        assert_eq!(out[0].tag, req.tag);
        out[0].result
    }

    #[test]
    fn geometry_and_options() {
        let f = file_in(&std::env::temp_dir(), 1000);
        let dev = SyncFileDevice::open(f.path(), SyncFileOptions::default()).unwrap();
        let info = dev.info();
        assert_eq!((info.size_bytes, info.block_size), (512, 512));
        assert!(info.volatile_cache && info.discard && info.write_zeroes && !info.read_only);
        assert_eq!(info.max_segments, SYNC_MAX_SEGMENTS_DEFAULT);
        assert!(dev.open_queue(0).is_err());
        assert!(dev.open_queue(SYNC_QUEUE_DEPTH_MAX + 1).is_err());
        for max_segments in [0, 1025] {
            let opts = SyncFileOptions { max_segments, ..SyncFileOptions::default() };
            assert!(matches!(
                SyncFileDevice::open(f.path(), opts),
                Err(SyncFileError::MaxSegments { .. })
            ));
        }
        let empty = tempfile::NamedTempFile::new().unwrap();
        assert!(matches!(
            SyncFileDevice::open(empty.path(), SyncFileOptions::default()),
            Err(SyncFileError::BadGeometry { .. })
        ));
        let ro = SyncFileOptions { read_only: true, ..SyncFileOptions::default() };
        assert!(matches!(
            SyncFileDevice::open(std::env::temp_dir(), ro),
            Err(SyncFileError::NotADisk { .. })
        ));
    }

    #[test]
    fn read_past_a_shrunken_file_fails_with_eio() {
        let f = file_in(&std::env::temp_dir(), 1 << 20);
        let dev = SyncFileDevice::open(f.path(), SyncFileOptions::default()).unwrap();
        f.as_file().set_len(1 << 19).unwrap();
        let mut q = dev.open_queue(2).unwrap();
        let mut buf = vec![0u8; 8192];
        // Straddles the new end (a short read, then 0 bytes), or lies past it (0 bytes).
        for offset in [(1 << 19) - 4096, (1 << 19) + 4096] {
            let seg = Segment { addr: buf.as_mut_ptr(), len: 8192 };
            let req =
                BlockRequest { op: BlockOp::Read, offset, len: 0, segments: &[seg], tag: offset };
            assert_eq!(run(&mut *q, req), Err(BlockError::Io(libc::EIO)), "read at {offset}");
        }
        // The part before the end was read before the short read stopped.
        assert!(buf[..4096]
            .iter()
            .enumerate()
            .all(|(i, &b)| b == (((1 << 19) - 4096 + i) % 251) as u8 | 1));
    }

    #[test]
    fn zero_length_and_flush_complete_without_data() {
        let f = file_in(&std::env::temp_dir(), 4096);
        let dev = SyncFileDevice::open(f.path(), SyncFileOptions::default()).unwrap();
        let mut q = dev.open_queue(1).unwrap();
        for op in [BlockOp::Read, BlockOp::Write, BlockOp::Flush, BlockOp::Discard] {
            let req = BlockRequest { op, offset: 4096, len: 0, segments: &[], tag: 1 };
            assert_eq!(run(&mut *q, req), Ok(0), "{op:?}");
        }
        assert!(std::fs::read(f.path()).unwrap().iter().all(|&b| b != 0));
    }

    #[test]
    fn tmpfs_write_zeroes_keeps_or_frees_blocks_as_asked() {
        let shm = Path::new("/dev/shm");
        if !shm.is_dir() {
            eprintln!("skipped: no /dev/shm");
            return;
        }
        let len = 3u64 << 20;
        let f = file_in(shm, len);
        let blocks = |f: &tempfile::NamedTempFile| {
            use std::os::unix::fs::MetadataExt;
            f.as_file().metadata().unwrap().blocks()
        };
        let full = blocks(&f);
        let dev = SyncFileDevice::open(f.path(), SyncFileOptions::default()).unwrap();
        let mut q = dev.open_queue(1).unwrap();
        // Without unmap: tmpfs has no ZERO_RANGE, so zeroes are written (more than the 1 MiB
        // zero buffer, unaligned ends) and the blocks stay allocated.
        let (off, n) = (1000u64, (3 << 19) + 123);
        let wz = BlockRequest {
            op: BlockOp::WriteZeroes { unmap: false },
            offset: off,
            len: n,
            segments: &[],
            tag: 1,
        };
        assert_eq!(run(&mut *q, wz), Ok(0));
        let bytes = std::fs::read(f.path()).unwrap();
        assert!(bytes[off as usize..(off + n) as usize].iter().all(|&b| b == 0));
        assert_ne!(bytes[off as usize - 1], 0);
        assert_ne!(bytes[(off + n) as usize], 0);
        assert_eq!(blocks(&f), full, "write-zeroes without unmap freed blocks");
        // With unmap: a punched hole (reads as zeroes, frees the pages).
        let wz = BlockRequest {
            op: BlockOp::WriteZeroes { unmap: true },
            offset: 0,
            len: 2 << 20,
            ..wz
        };
        assert_eq!(run(&mut *q, wz), Ok(0));
        assert!(blocks(&f) < full, "write-zeroes with unmap kept every block");
        let bytes = std::fs::read(f.path()).unwrap();
        assert!(bytes[..2 << 20].iter().all(|&b| b == 0));
        assert_eq!(bytes.len() as u64, len, "size kept");
    }

    #[test]
    fn probe_tells_tmpfs_apart() {
        let shm = Path::new("/dev/shm");
        if shm.is_dir() {
            let f = file_in(shm, 4096);
            assert_eq!(filesystem_name(f.as_file()), "tmpfs");
            assert_eq!(probe_nowait(f.as_file()), NowaitProbe::Unsupported);
        }
        let f = file_in(&std::env::temp_dir(), 4096);
        let name = filesystem_name(f.as_file());
        if matches!(name.as_str(), "ext4" | "xfs" | "btrfs") {
            assert_eq!(probe_nowait(f.as_file()), NowaitProbe::Supported, "{name}");
        }
    }
}
