//! A RAM disk: the [`BlockDevice`] for tests, benchmarks and volatile exports.
//!
//! The memory is mapped once when the disk is made: anonymous and private (lazily backed, so
//! a 64 GiB disk costs nothing until written) or a file mapped shared (a file on `/dev/shm`,
//! so another process can check the same bytes). Queues complete inline: [`BlockQueue::submit`]
//! copies and stores the completion in a ring allocated by `open_queue`;
//! [`BlockQueue::complete`] drains it. No allocation, no lock and, for reads and writes, no
//! syscall per request.
//!
//! # Memory model
//!
//! Any number of queues on any number of threads copy in and out of the disk memory at the
//! same time without a lock. The disk memory is only ever touched through raw pointers
//! (`ptr::copy_nonoverlapping`, `ptr::write_bytes`, `madvise`): no `&[u8]`/`&mut [u8]` to it
//! is ever made, so there is never a reference whose aliasing guarantees another thread could
//! break. Two requests on overlapping ranges in flight at once (from two queues) race byte by
//! byte exactly as they would on a real disk: the result is some interleaving, which is the
//! guest's problem. This is the same convention vm-memory uses for guest memory that the guest
//! writes while we copy; Rust has no stable atomic `memcpy` that would make such a race
//! formally defined without giving up vectorised copies.
//!
//! # Requests
//!
//! - Byte-granular: offsets and lengths need no alignment (it is memory).
//! - Out-of-range or overflowing ranges complete with [`BlockError::OutOfRange`]; a read or
//!   write larger than `u32::MAX` bytes (the seam reports transferred bytes in a `u32`) too.
//! - Writes, discards and write-zeroes on a read-only disk complete with
//!   [`BlockError::ReadOnly`]; flush is a no-op success.
//! - Discard and write-zeroes write zeroes; on anonymous memory, whole pages inside the range
//!   are given back with `madvise(MADV_DONTNEED)` (which makes them read as zeroes) when the
//!   request allows deallocation (discard, or write-zeroes with `unmap`).

use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::{MmapOptions, MmapRaw};

use super::inline::{inline_block_queue, InlineCompletions};
use super::{BlockDevice, BlockError, BlockOp, BlockQueue, BlockRequest, DeviceInfo};

/// Most segments one request may carry (Linux's `IOV_MAX`, so the RAM disk can stand in for
/// the io_uring backend without changing what the device advertises much).
pub const RAM_MAX_SEGMENTS: u32 = 1024;

/// Deepest queue `open_queue` makes (the completion ring is allocated up front).
pub const RAM_QUEUE_DEPTH_MAX: u32 = 65_536;

/// Why a RAM disk could not be made.
#[derive(Debug, thiserror::Error)]
pub enum RamError {
    /// The block size is not a power of two between 512 and 64 KiB.
    #[error("invalid block size {block_size}")]
    InvalidBlockSize {
        /// The block size asked for.
        block_size: u32,
    },
    /// The size is zero, not a multiple of the block size, or does not fit the address space.
    #[error("invalid size {size_bytes} for block size {block_size}")]
    InvalidSize {
        /// The size asked for (or the file's size).
        size_bytes: u64,
        /// The block size.
        block_size: u32,
    },
    /// Opening or inspecting the backing file failed.
    #[error("cannot open {path:?}")]
    Open {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// `mmap` failed.
    #[error("mmap of {len} bytes failed")]
    Map {
        /// Bytes asked for.
        len: usize,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// The mapping, shared by the disk handle and all its queues; unmapped when the last goes.
#[derive(Debug)]
struct RamMemory {
    /// The mapping (page-aligned); its length is the device's. Never turned into a reference.
    /// Unmapped when the last owner drops: queues hold an `Arc<RamMemory>`, so no queue (and
    /// no request, which completes inline) can still use it then.
    map: MmapRaw,
    /// Anonymous private mapping (madvise DONTNEED zeroes it); false for a shared file.
    anonymous: bool,
}

// SAFETY: `RamMemory` owns a mapping that lives until `Drop`; every access goes through raw
// pointers (see the module docs), so handing the owner to or sharing it with another thread
// creates no reference that could alias.
unsafe impl Send for RamMemory {}
// SAFETY: as for `Send`: shared access only ever makes raw-pointer copies.
unsafe impl Sync for RamMemory {}

impl RamMemory {
    /// Mapping and device length in bytes.
    fn len(&self) -> usize {
        self.map.len()
    }

    /// The address `pos` bytes into the mapping (`pos <= len`; callers check ranges first).
    /// Computing it is safe (`wrapping_add`); dereferencing it is the callers' `unsafe`.
    fn at(&self, pos: usize) -> *mut u8 {
        debug_assert!(pos <= self.len());
        self.map.as_mut_ptr().wrapping_add(pos)
    }

    /// Map `len` bytes: anonymous when `fd` is `None`, else `fd` shared from offset 0.
    fn map(len: usize, fd: Option<i32>) -> Result<RamMemory, RamError> {
        let map = match fd {
            // MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE
            None => MmapOptions::new().len(len).no_reserve_swap().map_anon().map(MmapRaw::from),
            // MAP_SHARED
            Some(fd) => MmapOptions::new().len(len).map_raw(fd),
        }
        .map_err(|source| RamError::Map { len, source })?;
        if fd.is_none() {
            // Random 4 KiB requests over a disk of hundreds of MiB miss the TLB on almost every
            // access with 4 KiB pages; transparent huge pages (where the kernel allows them:
            // `enabled` = madvise or always) cut that to one miss per 2 MiB. Advice only: a
            // kernel that says no leaves the disk as it was.
            // SAFETY:
            // - the range is exactly our own mapping, alive for this call; MADV_HUGEPAGE only
            //   changes how the kernel backs it, never its contents.
            let _ = unsafe { libc::madvise(map.as_mut_ptr().cast(), len, libc::MADV_HUGEPAGE) };
        }
        Ok(RamMemory { map, anonymous: fd.is_none() })
    }
}

/// Copy `len` bytes from `src` into the disk at `dst`. Whole 64-byte lines at a 16-byte aligned
/// destination go with non-temporal stores: a random block of a large disk is not in the cache,
/// and a plain store would first read each line it overwrites (the read-for-ownership that
/// makes a 4 KiB write to cold memory slower than a read of it). Anything else is a plain copy.
///
/// # Safety
///
/// `src..src+len` is readable, `dst..dst+len` writable, and they do not overlap.
unsafe fn copy_into_disk(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        if len >= 512 && len.is_multiple_of(64) && (dst as usize).is_multiple_of(16) {
            let mut i = 0;
            while i < len {
                for k in (0..64).step_by(16) {
                    // `i + k + 16 <= len`: inside both ranges (the caller's promise).
                    let from = src.wrapping_add(i + k).cast::<__m128i>();
                    let to = dst.wrapping_add(i + k).cast::<__m128i>();
                    // SAFETY: `from` is 16 readable bytes (unaligned loads are allowed).
                    let v = unsafe { _mm_loadu_si128(from) };
                    // SAFETY: `to` is 16 writable bytes, 16-byte aligned (`dst` is, checked,
                    // and `i + k` is a multiple of 16).
                    unsafe { _mm_stream_si128(to, v) };
                }
                i += 64;
            }
            // Non-temporal stores are weakly ordered: make them visible before the completion
            // that follows (and whatever the reader of it does) is.
            // SAFETY: a fence has no memory-safety preconditions (SSE2, baseline on x86_64).
            unsafe { _mm_sfence() };
            return;
        }
    }
    // SAFETY: the caller's promise.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
}

/// A disk in memory. Cheap to clone (the clones share the memory); open one queue per thread.
#[derive(Debug, Clone)]
pub struct RamDisk {
    mem: Arc<RamMemory>,
    block_size: u32,
    read_only: bool,
}

fn check_geometry(size_bytes: u64, block_size: u32) -> Result<usize, RamError> {
    if !block_size.is_power_of_two() || !(512..=65_536).contains(&block_size) {
        return Err(RamError::InvalidBlockSize { block_size });
    }
    let invalid = RamError::InvalidSize { size_bytes, block_size };
    if size_bytes == 0 || !size_bytes.is_multiple_of(u64::from(block_size)) {
        return Err(invalid);
    }
    // Leave room so `base + len` can never overflow a pointer on 64-bit targets.
    match usize::try_from(size_bytes) {
        Ok(len) if len <= isize::MAX as usize / 2 => Ok(len),
        _ => Err(invalid),
    }
}

impl RamDisk {
    /// A zero-filled disk of `size_bytes` (a non-zero multiple of `block_size`), in anonymous
    /// memory that is only backed as it is written.
    pub fn new(size_bytes: u64, block_size: u32) -> Result<RamDisk, RamError> {
        let len = check_geometry(size_bytes, block_size)?;
        Ok(RamDisk { mem: Arc::new(RamMemory::map(len, None)?), block_size, read_only: false })
    }

    /// A disk over an existing file (a file on `/dev/shm`, a memfd under `/proc/self/fd`),
    /// mapped shared: writes land in the file and the file's bytes are the disk's. The size is
    /// the file's (a non-zero multiple of 512); the block size 512.
    ///
    /// Whoever else writes the file while queues run races with them as described in the
    /// module docs; truncating it under the disk makes accesses fault (SIGBUS) — don't.
    pub fn from_shm_file(path: impl AsRef<Path>) -> Result<RamDisk, RamError> {
        let path = path.as_ref();
        let open_err = |source| RamError::Open { path: path.to_path_buf(), source };
        let file = OpenOptions::new().read(true).write(true).open(path).map_err(open_err)?;
        let size_bytes = file.metadata().map_err(open_err)?.len();
        let block_size = 512;
        let len = check_geometry(size_bytes, block_size)?;
        // The mapping keeps its own reference to the file; `file` may close after `mmap`.
        let mem = RamMemory::map(len, Some(file.as_raw_fd()))?;
        Ok(RamDisk { mem: Arc::new(mem), block_size, read_only: false })
    }

    /// The same memory, exported read-only (or writable again) by queues opened from now on.
    pub fn with_read_only(mut self, read_only: bool) -> RamDisk {
        self.read_only = read_only;
        self
    }

    /// Size in bytes.
    pub fn size_bytes(&self) -> u64 {
        self.mem.len() as u64
    }

    /// Copy `buf.len()` bytes at `offset` out of the disk (for tests and tools). Races with
    /// queues writing the same range as the module docs describe.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), BlockError> {
        let start = range(&self.mem, offset, buf.len() as u64)?;
        // SAFETY:
        // - `range` checked `start + buf.len() <= mem.len`, so the source lies in the mapping,
        //   which `self.mem` keeps alive;
        // - `buf` is our own exclusive borrow and cannot overlap the mapping (nobody holds a
        //   reference into the mapping);
        // - the disk side is only read through a raw pointer (module docs).
        unsafe {
            std::ptr::copy_nonoverlapping(self.mem.at(start), buf.as_mut_ptr(), buf.len());
        }
        Ok(())
    }

    /// Copy `buf` into the disk at `offset` (for tests and tools; ignores read-only).
    pub fn write_at(&self, offset: u64, buf: &[u8]) -> Result<(), BlockError> {
        let start = range(&self.mem, offset, buf.len() as u64)?;
        // SAFETY: as in `read_at`, with the direction reversed; the disk side is written
        // through a raw pointer only.
        unsafe {
            std::ptr::copy_nonoverlapping(buf.as_ptr(), self.mem.at(start), buf.len());
        }
        Ok(())
    }
}

/// Check `[offset, offset+len)` against the mapping; returns `offset` as a `usize`.
fn range(mem: &RamMemory, offset: u64, len: u64) -> Result<usize, BlockError> {
    match offset.checked_add(len) {
        Some(end) if end <= mem.len() as u64 => Ok(offset as usize),
        _ => Err(BlockError::OutOfRange { offset, len }),
    }
}

impl BlockDevice for RamDisk {
    fn info(&self) -> DeviceInfo {
        DeviceInfo {
            size_bytes: self.mem.len() as u64,
            block_size: self.block_size,
            read_only: self.read_only,
            discard: true,
            write_zeroes: true,
            volatile_cache: false,
            max_segments: RAM_MAX_SEGMENTS,
        }
    }

    fn open_queue(&self, depth: u32) -> std::io::Result<Box<dyn BlockQueue>> {
        Ok(Box::new(RamQueue::new(self, depth)?))
    }
}

/// A queue on a [`RamDisk`]: completes every request inside `submit`.
#[derive(Debug)]
pub struct RamQueue {
    mem: Arc<RamMemory>,
    read_only: bool,
    /// Finished requests not yet drained (== in flight), `depth` entries, allocated once.
    done: InlineCompletions,
}

impl RamQueue {
    /// A queue with room for `depth` (1..=[`RAM_QUEUE_DEPTH_MAX`]) undrained completions.
    pub fn new(disk: &RamDisk, depth: u32) -> std::io::Result<RamQueue> {
        if depth == 0 || depth > RAM_QUEUE_DEPTH_MAX {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("queue depth {depth} not in 1..={RAM_QUEUE_DEPTH_MAX}"),
            ));
        }
        Ok(RamQueue {
            mem: Arc::clone(&disk.mem),
            read_only: disk.read_only,
            done: InlineCompletions::new(depth as usize),
        })
    }

    /// Do the request; its outcome.
    ///
    /// # Safety
    ///
    /// The segments obey the contract of [`BlockQueue::submit`] for the duration of the call.
    unsafe fn execute(&self, req: &BlockRequest<'_>) -> Result<u32, BlockError> {
        match req.op {
            BlockOp::Flush => Ok(0),
            BlockOp::Read | BlockOp::Write | BlockOp::WriteFua => {
                let write = req.op != BlockOp::Read;
                if write && self.read_only {
                    return Err(BlockError::ReadOnly);
                }
                if req.segments.len() > RAM_MAX_SEGMENTS as usize {
                    return Err(BlockError::TooManySegments {
                        count: req.segments.len(),
                        max: RAM_MAX_SEGMENTS as usize,
                    });
                }
                // At most 1024 segments of u32::MAX bytes: the u64 sum cannot overflow.
                let total: u64 = req.segments.iter().map(|s| u64::from(s.len)).sum();
                let total_u32 = u32::try_from(total)
                    .map_err(|_| BlockError::OutOfRange { offset: req.offset, len: total })?;
                let mut pos = range(&self.mem, req.offset, total)?;
                for seg in req.segments {
                    if seg.len == 0 {
                        continue;
                    }
                    if seg.addr.is_null() {
                        return Err(BlockError::Io(libc::EFAULT));
                    }
                    let len = seg.len as usize;
                    let disk = self.mem.at(pos);
                    // SAFETY (both arms):
                    // - disk side: `range` checked `offset + total <= mem.len` and `pos + len`
                    //   stays within that sum, so `disk..disk+len` lies in the mapping that
                    //   `self.mem` keeps alive; it is only touched through raw pointers, so
                    //   racing requests on other queues give torn bytes, never an aliased
                    //   reference (module docs);
                    // - caller side: the `submit` contract keeps `seg.addr..+len` mapped and,
                    //   for a read, not accessed by anyone else; for a write, not written;
                    // - no overlap: the mapping's addresses are never handed out, so a caller
                    //   cannot point a segment into it (a second mapping of a shared file has
                    //   other virtual addresses).
                    if write {
                        // SAFETY: see above; caller memory → disk.
                        unsafe { copy_into_disk(seg.addr.cast_const(), disk, len) };
                    } else {
                        // SAFETY: see above; disk → caller memory.
                        unsafe { std::ptr::copy_nonoverlapping(disk.cast_const(), seg.addr, len) };
                    }
                    pos += len;
                }
                Ok(total_u32)
            }
            BlockOp::Discard | BlockOp::WriteZeroes { .. } => {
                if self.read_only {
                    return Err(BlockError::ReadOnly);
                }
                let start = range(&self.mem, req.offset, req.len)?;
                let may_unmap =
                    matches!(req.op, BlockOp::Discard | BlockOp::WriteZeroes { unmap: true });
                self.zero(start, req.len as usize, may_unmap && self.mem.anonymous);
                Ok(0)
            }
        }
    }

    /// Make `[start, start+len)` (inside the mapping) read as zeroes.
    fn zero(&self, start: usize, len: usize, dontneed: bool) {
        let page = page_size();
        let mut head_end = start + len;
        let mut tail_start = start + len;
        if dontneed {
            let first = start.next_multiple_of(page);
            let last = (start + len) / page * page;
            if last > first {
                // SAFETY:
                // - `first..last` is page-aligned and inside our anonymous private mapping
                //   (`base` is page-aligned), which `self.mem` keeps alive;
                // - DONTNEED on private anonymous memory makes the pages read as zeroes; no
                //   reference into the mapping exists that could observe the change as UB.
                let rc = unsafe {
                    libc::madvise(self.mem.at(first).cast(), last - first, libc::MADV_DONTNEED)
                };
                if rc == 0 {
                    head_end = first;
                    tail_start = last;
                }
            }
        }
        for (from, to) in [(start, head_end), (tail_start, start + len)] {
            if to > from {
                // SAFETY: `from..to` lies inside `start..start+len`, which `range` checked to be
                // inside the mapping `self.mem` keeps alive; written through a raw pointer only.
                unsafe { std::ptr::write_bytes(self.mem.at(from), 0, to - from) };
            }
        }
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size).unwrap_or(4096).max(1)
}

inline_block_queue!(RamQueue);

#[cfg(test)]
mod tests {

    #[test]
    fn copy_into_disk_copies_every_length_and_alignment() {
        let src: Vec<u8> = (0..8192u32).map(|i| (i * 31 + 7) as u8).collect();
        // 64-byte aligned destination buffer with room for offsets.
        let mut dst = vec![0u128; 8192 / 16 + 8];
        let base = dst.as_mut_ptr().cast::<u8>();
        let cases = [(0, 4096), (16, 4096), (8, 4096), (0, 512), (0, 100), (16, 8128), (3, 640)];
        for (off, len) in cases {
            // SAFETY: the whole of `dst` (8192 + 128 bytes) is ours.
            unsafe { std::ptr::write_bytes(base, 0, 8192 + 128) };
            // SAFETY: `base + off .. + len` is inside `dst`, `src` holds `len` bytes, and the
            // two are separate allocations.
            unsafe { copy_into_disk(src.as_ptr(), base.wrapping_add(off), len) };
            // SAFETY: as above; read back through the same raw pointer.
            let got = unsafe { std::slice::from_raw_parts(base.wrapping_add(off), len) };
            assert_eq!(got, &src[..len], "offset {off}, length {len}");
            // SAFETY: the byte after the copy is inside `dst`.
            assert_eq!(unsafe { *base.wrapping_add(off + len) }, 0, "nothing past the end");
        }
    }

    use super::*;
    use crate::Completion;
    use crate::Segment;

    fn seg(buf: &mut [u8]) -> Segment {
        Segment { addr: buf.as_mut_ptr(), len: buf.len() as u32 }
    }

    fn run(q: &mut dyn BlockQueue, req: BlockRequest<'_>) -> Result<u32, BlockError> {
        // SAFETY: every caller passes segments over buffers it owns and does not touch until
        // this function returns, after the completion has been drained.
        unsafe { q.submit(req) }.expect("queue has room");
        let mut out = [Completion::EMPTY; 1];
        assert_eq!(q.complete(&mut out), 1);
        assert_eq!(out[0].tag, req.tag);
        out[0].result
    }

    #[test]
    fn geometry_is_checked() {
        assert!(matches!(RamDisk::new(0, 512), Err(RamError::InvalidSize { .. })));
        assert!(matches!(RamDisk::new(1000, 512), Err(RamError::InvalidSize { .. })));
        assert!(matches!(RamDisk::new(4096, 100), Err(RamError::InvalidBlockSize { .. })));
        assert!(RamDisk::new(u64::MAX / 512 * 512, 512).is_err());
    }

    #[test]
    fn huge_disk_is_lazy_and_discard_zeroes_pages() {
        let disk = RamDisk::new(64 << 30, 4096).unwrap();
        let mut q = disk.open_queue(4).unwrap();
        let off = (64u64 << 30) - 3 * 4096 - 100;
        let mut data = vec![0xabu8; 3 * 4096 + 100];
        let segs = [seg(&mut data)];
        let write =
            BlockRequest { op: BlockOp::Write, offset: off, len: 0, segments: &segs, tag: 7 };
        assert_eq!(run(&mut *q, write), Ok(12388));
        let discard = BlockRequest { op: BlockOp::Discard, len: 12388, segments: &[], ..write };
        assert_eq!(run(&mut *q, discard), Ok(0));
        let mut back = vec![1u8; data.len()];
        disk.read_at(off, &mut back).unwrap();
        assert!(back.iter().all(|&b| b == 0));
    }

    #[test]
    fn full_queue_hands_back_and_drains_in_order() {
        let disk = RamDisk::new(1 << 20, 512).unwrap();
        let mut q = disk.open_queue(3).unwrap();
        for tag in 0..3 {
            let req = BlockRequest { op: BlockOp::Flush, offset: 0, len: 0, segments: &[], tag };
            // SAFETY: no segments.
            unsafe { q.submit(req) }.unwrap();
        }
        let req = BlockRequest { op: BlockOp::Flush, offset: 0, len: 0, segments: &[], tag: 99 };
        // SAFETY: no segments.
        let back = unsafe { q.submit(req) }.unwrap_err();
        assert_eq!(back.0.tag, 99);
        assert_eq!(q.in_flight(), 3);
        let mut out = [Completion::EMPTY; 2];
        assert_eq!(q.complete(&mut out), 2);
        assert_eq!((out[0].tag, out[1].tag), (0, 1));
        assert_eq!(q.complete(&mut out), 1);
        assert_eq!(out[0].tag, 2);
        assert_eq!(q.in_flight(), 0);
    }

    #[test]
    fn oversized_transfer_is_out_of_range() {
        let disk = RamDisk::new(1 << 20, 512).unwrap();
        let mut q = disk.open_queue(1).unwrap();
        // Two segments summing past u32::MAX: refused before any byte is touched, so the
        // (dangling but non-null) address is never used.
        let big = Segment { addr: std::ptr::NonNull::<u8>::dangling().as_ptr(), len: u32::MAX };
        let r = run(
            &mut *q,
            BlockRequest { op: BlockOp::Read, offset: 0, len: 0, segments: &[big, big], tag: 1 },
        );
        assert!(matches!(r, Err(BlockError::OutOfRange { .. })));
    }
}
