//! The journal's side of the block seam: an aligned buffer it owns, and synchronous helpers
//! (submit, kick, bounded wait) over one [`BlockQueue`].

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::io;
use std::ptr::NonNull;
use std::time::{Duration, Instant};

use fastlane_block::{BlockOp, BlockQueue, BlockRequest, Completion, Segment};

use super::JournalError;

/// How long one request may take before the journal gives up on the device.
pub(crate) const IO_TIMEOUT: Duration = Duration::from_secs(30);

/// A zeroed, 4 KiB-aligned heap buffer (what `O_DIRECT` asks of memory), allocated once.
#[derive(Debug)]
pub(crate) struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is plain owned memory; `&`/`&mut` access follows Rust's rules through
// `as_slice`/`as_mut_slice`, and the block queue only sees it under `submit`'s contract.
unsafe impl Send for AlignedBuf {}

pub(crate) const BUF_ALIGN: usize = 4096;

impl AlignedBuf {
    // `from_size_align` fails only when the size rounded up to `BUF_ALIGN` (a non-zero power
    // of two) exceeds `isize::MAX`. Every caller passes a size below 2^33: a chunk constant,
    // a superblock's `max_batch_bytes` (a `u32`, bounded by the decoder) plus two write
    // alignments, or another buffer's length.
    #[allow(clippy::expect_used)]
    pub(crate) fn new(len: usize) -> AlignedBuf {
        let len = len.max(BUF_ALIGN).div_ceil(BUF_ALIGN) * BUF_ALIGN;
        let layout = Layout::from_size_align(len, BUF_ALIGN).expect("buffer layout");
        // SAFETY: `layout` has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, len }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` owns `len` initialised (zeroed at allocation) bytes for our lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as `as_slice`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// A segment naming `buf[start..start+len]`.
    fn segment(&mut self, start: usize, len: usize) -> Segment {
        assert!(start <= self.len && len <= self.len - start && len <= u32::MAX as usize);
        // SAFETY: `start <= self.len`, so the pointer stays inside (or one past) the buffer.
        let addr = unsafe { self.ptr.as_ptr().add(start) };
        Segment { addr, len: len as u32 }
    }
}

impl Drop for AlignedBuf {
    // The very layout `new` built from `self.len`, which it accepted then.
    #[allow(clippy::expect_used)]
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.len, BUF_ALIGN).expect("buffer layout");
        // SAFETY: allocated in `new` with this very layout and not freed since.
        unsafe { dealloc(self.ptr.as_ptr(), layout) }
    }
}

/// One block queue, used one request at a time (or a write and a flush in sequence).
pub(crate) struct Dev {
    pub(crate) queue: Box<dyn BlockQueue>,
    pub(crate) size_bytes: u64,
    done: [Completion; 4],
}

impl std::fmt::Debug for Dev {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dev").field("size_bytes", &self.size_bytes).finish()
    }
}

impl Dev {
    pub(crate) fn new(queue: Box<dyn BlockQueue>, size_bytes: u64) -> Dev {
        Dev { queue, size_bytes, done: [Completion::EMPTY; 4] }
    }

    /// Starts a write of `buf[start..start+len]` to `offset`; finish it with [`Dev::wait`]
    /// before touching `buf` again (the `&mut` borrow in the caller's hands is the guard:
    /// `wait` is always called before the buffer is used again, see the writer).
    pub(crate) fn start_write(
        &mut self,
        buf: &mut AlignedBuf,
        start: usize,
        len: usize,
        offset: u64,
    ) -> Result<(), JournalError> {
        self.start_write_tagged(buf, start, len, offset, 1)
    }

    /// [`Dev::start_write`] with the caller's tag; the caller reaps the completion itself
    /// ([`Dev::reap`]) and keeps `buf` unwritten and alive until it has (the writer keeps
    /// the buffer in its in-flight slot, and drops the queue before its buffers).
    pub(crate) fn start_write_tagged(
        &mut self,
        buf: &mut AlignedBuf,
        start: usize,
        len: usize,
        offset: u64,
        tag: u64,
    ) -> Result<(), JournalError> {
        let seg = [buf.segment(start, len)];
        let req = BlockRequest { op: BlockOp::Write, offset, len: len as u64, segments: &seg, tag };
        // SAFETY:
        // - The segment lies inside `buf`, which the journal keeps alive and does not write
        //   until `wait` has returned this request's completion (every caller pairs
        //   `start_write` with `wait` before touching the buffer again, and `Dev` has at most
        //   one request in flight).
        // - If the queue is dropped with the request in flight, the queue's drop waits for it.
        unsafe { self.queue.submit(req) }.map_err(|_| JournalError::QueueFull)?;
        self.queue.kick().map_err(|source| JournalError::Io { op: "kick", source })
    }

    /// [`Dev::start_write_tagged`] as a write that is durable when it completes
    /// ([`BlockOp::WriteFua`]), under the same contract for `buf`.
    pub(crate) fn start_write_fua_tagged(
        &mut self,
        buf: &mut AlignedBuf,
        len: usize,
        offset: u64,
        tag: u64,
    ) -> Result<(), JournalError> {
        let seg = [buf.segment(0, len)];
        let req =
            BlockRequest { op: BlockOp::WriteFua, offset, len: len as u64, segments: &seg, tag };
        // SAFETY: as `start_write_tagged`: the segment lies inside `buf`, which the writer
        // keeps alive and does not touch until this request's completion is reaped (the
        // buffer sits in the writer's in-flight list until then), and the queue's drop waits
        // for requests still in flight.
        unsafe { self.queue.submit(req) }.map_err(|_| JournalError::QueueFull)?;
        self.queue.kick().map_err(|source| JournalError::Io { op: "kick", source })
    }

    pub(crate) fn start_flush(&mut self) -> Result<(), JournalError> {
        self.start_flush_tagged(2)
    }

    /// A flush with the caller's tag (reaped with [`Dev::reap`]).
    pub(crate) fn start_flush_tagged(&mut self, tag: u64) -> Result<(), JournalError> {
        let req = BlockRequest { op: BlockOp::Flush, offset: 0, len: 0, segments: &[], tag };
        // SAFETY: a flush names no memory.
        unsafe { self.queue.submit(req) }.map_err(|_| JournalError::QueueFull)?;
        self.queue.kick().map_err(|source| JournalError::Io { op: "kick", source })
    }

    /// Drains finished requests into `out` without blocking (the pipelined writer's reap).
    pub(crate) fn reap(&mut self, out: &mut [Completion]) -> usize {
        self.queue.complete(out)
    }

    /// Blocks until a request finishes or `timeout` passes.
    pub(crate) fn block_wait(&mut self, timeout: Duration) -> Result<(), JournalError> {
        self.queue
            .wait(Some(timeout))
            .map_err(|source| JournalError::Io { op: "block wait", source })
    }

    /// Waits (bounded) for the one request in flight and returns its result.
    pub(crate) fn wait(&mut self, op: &'static str, offset: u64) -> Result<(), JournalError> {
        let deadline = Instant::now() + IO_TIMEOUT;
        loop {
            let n = self.queue.complete(&mut self.done);
            if n > 0 {
                for c in &self.done[..n] {
                    if let Err(e) = c.result {
                        return Err(JournalError::Block { op, offset, source: e });
                    }
                }
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(JournalError::Io {
                    op,
                    source: io::Error::new(io::ErrorKind::TimedOut, "block request timed out"),
                });
            }
            self.queue
                .wait(Some(deadline - now))
                .map_err(|source| JournalError::Io { op: "block wait", source })?;
        }
    }

    pub(crate) fn write(
        &mut self,
        buf: &mut AlignedBuf,
        start: usize,
        len: usize,
        offset: u64,
    ) -> Result<(), JournalError> {
        self.start_write(buf, start, len, offset)?;
        self.wait("write", offset)
    }

    pub(crate) fn flush(&mut self) -> Result<(), JournalError> {
        self.start_flush()?;
        self.wait("flush", 0)
    }

    /// Reads `buf[..len]` from `offset` (both aligned by the caller).
    pub(crate) fn read(
        &mut self,
        buf: &mut AlignedBuf,
        len: usize,
        offset: u64,
    ) -> Result<(), JournalError> {
        let seg = [buf.segment(0, len)];
        let req =
            BlockRequest { op: BlockOp::Read, offset, len: len as u64, segments: &seg, tag: 3 };
        // SAFETY:
        // - The segment lies inside `buf`, borrowed mutably for this whole call, so nothing
        //   else reads or writes it; `wait` below returns only after the completion.
        // - On a timeout error the queue still owns the request; `buf` then lives in the
        //   caller, which drops the queue (waiting for in-flight requests) before the buffer
        //   (field order in `BlockReader`, and the journal gives up on the device).
        unsafe { self.queue.submit(req) }.map_err(|_| JournalError::QueueFull)?;
        self.queue.kick().map_err(|source| JournalError::Io { op: "kick", source })?;
        self.wait("read", offset)
    }
}

/// Random-access reads at any offset and length, for the scanner.
pub trait ReadAt {
    /// Fills `buf` from byte `offset`. Reading past the end is an error.
    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> io::Result<()>;
    /// Length in bytes.
    fn len_bytes(&self) -> u64;
}

impl ReadAt for std::fs::File {
    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        std::os::unix::fs::FileExt::read_exact_at(self, buf, offset)
    }
    fn len_bytes(&self) -> u64 {
        self.metadata().map(|m| m.len()).unwrap_or(0)
    }
}

impl ReadAt for &[u8] {
    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let start = usize::try_from(offset).map_err(|_| io::ErrorKind::UnexpectedEof)?;
        let end = start.checked_add(buf.len()).ok_or(io::ErrorKind::UnexpectedEof)?;
        let src = self.get(start..end).ok_or(io::ErrorKind::UnexpectedEof)?;
        buf.copy_from_slice(src);
        Ok(())
    }
    fn len_bytes(&self) -> u64 {
        self.len() as u64
    }
}

/// [`ReadAt`] over a block queue, caching one aligned chunk.
pub(crate) struct BlockReader<'d> {
    pub(crate) dev: &'d mut Dev,
    chunk: AlignedBuf,
    /// Device offset of `chunk[0]`, or `u64::MAX` when empty.
    chunk_off: u64,
    chunk_len: usize,
}

const CHUNK: usize = 1 << 20;

impl<'d> BlockReader<'d> {
    pub(crate) fn new(dev: &'d mut Dev) -> BlockReader<'d> {
        BlockReader { dev, chunk: AlignedBuf::new(CHUNK), chunk_off: u64::MAX, chunk_len: 0 }
    }
}

impl ReadAt for BlockReader<'_> {
    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let size = self.dev.size_bytes;
        let mut off = offset;
        let mut out = 0usize;
        let end = offset.checked_add(buf.len() as u64).ok_or(io::ErrorKind::UnexpectedEof)?;
        if end > size {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        while out < buf.len() {
            let inside = self.chunk_off != u64::MAX
                && off >= self.chunk_off
                && off < self.chunk_off + self.chunk_len as u64;
            if !inside {
                let base = off / BUF_ALIGN as u64 * BUF_ALIGN as u64;
                let len = (size - base).min(CHUNK as u64) as usize;
                self.chunk_off = u64::MAX;
                self.dev
                    .read(&mut self.chunk, len, base)
                    .map_err(|e| io::Error::other(e.to_string()))?;
                self.chunk_off = base;
                self.chunk_len = len;
            }
            let at = (off - self.chunk_off) as usize;
            let n = (self.chunk_len - at).min(buf.len() - out);
            buf[out..out + n].copy_from_slice(&self.chunk.as_slice()[at..at + n]);
            out += n;
            off += n as u64;
        }
        Ok(())
    }

    fn len_bytes(&self) -> u64 {
        self.dev.size_bytes
    }
}
