//! One suite, every block backend: the checks take a `&dyn BlockDevice` and run against the
//! RAM disk (anonymous and shared-file), io_uring (buffered file, O_DIRECT file, tmpfs) and the
//! synchronous file backend (a file in the temp directory, a tmpfs file).
//!
//! What is checked is what a user of a disk cares about: bytes read back equal bytes written
//! (against a `Vec<u8>` model of the whole device), zeroes after discard and write-zeroes, the
//! backing file holds the same bytes, bad requests complete with an error instead of panicking.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::path::Path;
use std::time::{Duration, Instant};

use fastlane_block::ram::RamDisk;
use fastlane_block::sync::{SyncFileDevice, SyncFileOptions};
use fastlane_block::uring::{UringDevice, UringError, UringOptions};
use fastlane_block::FileOpenError;
use fastlane_block::{
    BlockDevice, BlockError, BlockOp, BlockQueue, BlockRequest, Completion, Segment,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const MIB: u64 = 1 << 20;

/// A zeroed heap buffer aligned for O_DIRECT.
struct AlignedBuf {
    ptr: *mut u8,
    layout: Layout,
}

impl AlignedBuf {
    fn new(len: usize) -> AlignedBuf {
        let layout = Layout::from_size_align(len.max(1), 4096).unwrap();
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        assert!(!ptr.is_null());
        AlignedBuf { ptr, layout }
    }

    fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `layout.size()` initialised bytes for our lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr, self.layout.size()) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` makes the borrow exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.layout.size()) }
    }

    /// A segment over `[at, at+len)`.
    fn seg(&mut self, at: usize, len: usize) -> Segment {
        assert!(at + len <= self.layout.size());
        Segment {
            // SAFETY: in bounds, checked above.
            addr: unsafe { self.ptr.add(at) },
            len: len as u32,
        }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr, self.layout) }
    }
}

/// Wait (bounded) until the completion for `tag` arrives; other completions are returned in
/// `others`.
fn drain_until(q: &mut dyn BlockQueue, tag: u64) -> Result<u32, BlockError> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut out = [Completion::EMPTY; 16];
    loop {
        let n = q.complete(&mut out);
        if let Some(c) = out[..n].iter().find(|c| c.tag == tag) {
            assert_eq!(n, 1, "only one request was in flight");
            return c.result;
        }
        assert_eq!(n, 0, "unexpected completion");
        assert!(Instant::now() < deadline, "request {tag} never completed");
        q.wait(Some(Duration::from_millis(100))).unwrap();
    }
}

/// Submit one request, wait for it, return its result.
///
/// # Safety
///
/// The segments name memory the caller owns and leaves alone until this returns.
unsafe fn io(
    q: &mut dyn BlockQueue,
    op: BlockOp,
    offset: u64,
    len: u64,
    segments: &[Segment],
) -> Result<u32, BlockError> {
    assert_eq!(q.in_flight(), 0);
    let req = BlockRequest { op, offset, len, segments, tag: 0x5eed };
    // SAFETY: forwarded to our caller.
    unsafe { q.submit(req) }.expect("empty queue has room");
    q.kick().unwrap();
    let r = drain_until(q, 0x5eed);
    assert_eq!(q.in_flight(), 0);
    r
}

/// Read `len` bytes at `offset` into a fresh buffer (one segment).
fn read(q: &mut dyn BlockQueue, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = AlignedBuf::new(len);
    let seg = buf.seg(0, len);
    // SAFETY: `buf` lives until after the request has completed.
    let r = unsafe { io(q, BlockOp::Read, offset, 0, &[seg]) };
    assert_eq!(r, Ok(len as u32));
    buf.as_slice()[..len].to_vec()
}

/// Write `data` at `offset` (one segment).
fn write(q: &mut dyn BlockQueue, offset: u64, data: &[u8]) {
    let mut buf = AlignedBuf::new(data.len());
    buf.as_mut_slice()[..data.len()].copy_from_slice(data);
    let seg = buf.seg(0, data.len());
    // SAFETY: `buf` lives until after the request has completed.
    let r = unsafe { io(q, BlockOp::Write, offset, 0, &[seg]) };
    assert_eq!(r, Ok(data.len() as u32));
}

/// Random reads and writes of 1..=8 segments at block-aligned offsets, checked against a model.
/// Returns the model (the device's full contents) for callers that check the backing file.
fn random_io(dev: &dyn BlockDevice, seed: u64, rounds: usize) -> Vec<u8> {
    let info = dev.info();
    let bs = info.block_size as usize;
    let size = info.size_bytes as usize;
    let mut q = dev.open_queue(8).unwrap();
    let mut model = read(&mut *q, 0, size);
    let mut rng = StdRng::seed_from_u64(seed);
    for _ in 0..rounds {
        let nseg = rng.random_range(1..=8usize);
        let lens: Vec<usize> = (0..nseg).map(|_| bs * rng.random_range(1..=8)).collect();
        let total: usize = lens.iter().sum();
        let offset = bs * rng.random_range(0..=(size - total) / bs);
        // Segments at aligned but scattered places in one buffer.
        let mut buf = AlignedBuf::new(total + nseg * bs);
        let mut segs = Vec::new();
        let mut at = 0;
        for &len in &lens {
            segs.push(buf.seg(at, len));
            at += len + bs;
        }
        if rng.random_bool(0.5) {
            rng.fill(buf.as_mut_slice());
            // SAFETY: `buf` outlives the request.
            let r = unsafe { io(&mut *q, BlockOp::Write, offset as u64, 0, &segs) };
            assert_eq!(r, Ok(total as u32));
            let mut pos = offset;
            for (s, &len) in segs.iter().zip(&lens) {
                let from = s.addr as usize - buf.ptr as usize;
                model[pos..pos + len].copy_from_slice(&buf.as_slice()[from..from + len]);
                pos += len;
            }
        } else {
            // SAFETY: `buf` outlives the request.
            let r = unsafe { io(&mut *q, BlockOp::Read, offset as u64, 0, &segs) };
            assert_eq!(r, Ok(total as u32));
            let mut pos = offset;
            for (s, &len) in segs.iter().zip(&lens) {
                let from = s.addr as usize - buf.ptr as usize;
                assert!(
                    buf.as_slice()[from..from + len] == model[pos..pos + len],
                    "read at {pos} differs from what was written"
                );
                pos += len;
            }
        }
    }
    assert!(read(&mut *q, 0, size) == model, "final contents differ");
    model
}

/// Fill the queue until it hands a request back, then drain; every write must land.
fn fill_queue(dev: &dyn BlockDevice) {
    let bs = dev.info().block_size as usize;
    let depth = 16u32;
    let mut q = dev.open_queue(depth).unwrap();
    let count = depth as usize + 4;
    let mut buf = AlignedBuf::new(count * bs);
    for (i, b) in buf.as_mut_slice().iter_mut().enumerate() {
        *b = (i / bs) as u8 ^ 0x5a;
    }
    let segs: Vec<Segment> = (0..count).map(|i| buf.seg(i * bs, bs)).collect();
    let mut submitted = 0;
    let mut done = vec![false; count];
    let mut out = [Completion::EMPTY; 4];
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut saw_full = false;
    while done.iter().any(|d| !d) {
        while submitted < count {
            let req = BlockRequest {
                op: BlockOp::Write,
                offset: (submitted * bs) as u64,
                len: 0,
                segments: &segs[submitted..=submitted],
                tag: submitted as u64,
            };
            // SAFETY: `buf` outlives every request: the loop drains them all before it ends.
            match unsafe { q.submit(req) } {
                Ok(()) => submitted += 1,
                Err(full) => {
                    assert_eq!(full.0.tag, submitted as u64, "handed back untouched");
                    assert_eq!(q.in_flight(), depth);
                    saw_full = true;
                    break;
                }
            }
        }
        q.kick().unwrap();
        q.wait(Some(Duration::from_millis(100))).unwrap();
        let n = q.complete(&mut out);
        for c in &out[..n] {
            assert_eq!(c.result, Ok(bs as u32));
            assert!(!done[c.tag as usize], "tag {} completed twice", c.tag);
            done[c.tag as usize] = true;
        }
        assert!(Instant::now() < deadline, "writes never completed");
    }
    assert!(saw_full, "queue never reported full");
    assert_eq!(q.in_flight(), 0);
    let back = read(&mut *q, 0, count * bs);
    assert!(back == buf.as_slice()[..count * bs], "queued writes differ");
}

/// Flush, discard, write-zeroes.
fn flush_discard_zeroes(dev: &dyn BlockDevice) {
    let bs = dev.info().block_size as usize;
    let mut q = dev.open_queue(4).unwrap();
    let len = 64 * bs;
    let ones = vec![0xffu8; len];
    // SAFETY: no segments.
    assert_eq!(unsafe { io(&mut *q, BlockOp::Flush, 0, 0, &[]) }, Ok(0));
    for op in [
        BlockOp::Discard,
        BlockOp::WriteZeroes { unmap: false },
        BlockOp::WriteZeroes { unmap: true },
    ] {
        write(&mut *q, 0, &ones);
        // Zero the middle, leaving one block of ones on each side.
        // SAFETY: no segments.
        let r = unsafe { io(&mut *q, op, bs as u64, (len - 2 * bs) as u64, &[]) };
        assert_eq!(r, Ok(0), "{op:?}");
        let back = read(&mut *q, 0, len);
        assert!(back[..bs].iter().all(|&b| b == 0xff), "{op:?} hit the head");
        assert!(back[len - bs..].iter().all(|&b| b == 0xff), "{op:?} hit the tail");
        assert!(back[bs..len - bs].iter().all(|&b| b == 0), "{op:?} left data behind");
    }
    // SAFETY: no segments.
    assert_eq!(unsafe { io(&mut *q, BlockOp::Flush, 0, 0, &[]) }, Ok(0));
}

/// Ranges past the end, overflowing ranges, too many segments: errors, never panics.
fn bad_ranges(dev: &dyn BlockDevice) {
    let info = dev.info();
    let bs = u64::from(info.block_size);
    let size = info.size_bytes;
    let mut q = dev.open_queue(4).unwrap();
    let mut buf = AlignedBuf::new(8192);
    let seg = buf.seg(0, bs as usize);
    let near_max = u64::MAX / bs * bs;
    for (op, offset, len) in [
        (BlockOp::Read, size, 0),
        (BlockOp::Write, size, 0),
        (BlockOp::Read, size - bs / 2, 0),
        (BlockOp::Read, near_max, 0),
        (BlockOp::Write, near_max, 0),
        (BlockOp::Discard, size, bs),
        (BlockOp::Discard, near_max, bs),
        (BlockOp::Discard, bs, u64::MAX - bs + 1),
        (BlockOp::WriteZeroes { unmap: false }, near_max, 2 * bs),
        (BlockOp::WriteZeroes { unmap: true }, 0, size + bs),
    ] {
        let segs = if matches!(op, BlockOp::Read | BlockOp::Write) {
            std::slice::from_ref(&seg)
        } else {
            &[]
        };
        // SAFETY: `buf` outlives the request.
        let r = unsafe { io(&mut *q, op, offset, len, segs) };
        assert!(
            matches!(r, Err(BlockError::OutOfRange { .. })),
            "{op:?} at {offset} len {len}: {r:?}"
        );
    }
    let many = vec![seg; info.max_segments as usize + 1];
    // SAFETY: `buf` outlives the request; it is refused before any byte moves anyway.
    let r = unsafe { io(&mut *q, BlockOp::Read, 0, 0, &many) };
    assert!(matches!(r, Err(BlockError::TooManySegments { .. })), "{r:?}");
    // The queue still works.
    write(&mut *q, 0, &vec![3u8; bs as usize]);
    assert_eq!(read(&mut *q, 0, bs as usize), vec![3u8; bs as usize]);
}

/// A read-only export refuses writes, discards and write-zeroes, and still reads and flushes.
fn read_only_refuses(dev: &dyn BlockDevice) {
    assert!(dev.info().read_only);
    let bs = dev.info().block_size as usize;
    let mut q = dev.open_queue(2).unwrap();
    let mut buf = AlignedBuf::new(bs);
    let seg = buf.seg(0, bs);
    for (op, len) in [
        (BlockOp::Write, 0),
        (BlockOp::Discard, bs as u64),
        (BlockOp::WriteZeroes { unmap: false }, bs as u64),
    ] {
        let segs = if op == BlockOp::Write { std::slice::from_ref(&seg) } else { &[] };
        // SAFETY: `buf` outlives the request.
        let r = unsafe { io(&mut *q, op, 0, len, segs) };
        assert_eq!(r, Err(BlockError::ReadOnly), "{op:?}");
    }
    read(&mut *q, 0, bs);
    // SAFETY: no segments.
    assert_eq!(unsafe { io(&mut *q, BlockOp::Flush, 0, 0, &[]) }, Ok(0));
}

/// Two threads, one queue each, writing and reading back disjoint halves at once.
fn two_threads(dev: &dyn BlockDevice) {
    let info = dev.info();
    let bs = info.block_size as usize;
    let half = (info.size_bytes / 2) as usize / bs * bs;
    std::thread::scope(|s| {
        for t in 0..2u8 {
            s.spawn(move || {
                let mut q = dev.open_queue(4).unwrap();
                let mut rng = StdRng::seed_from_u64(u64::from(t));
                let base = usize::from(t) * half;
                for _ in 0..100 {
                    let len = bs * rng.random_range(1..=4);
                    let off = base + bs * rng.random_range(0..=(half - len) / bs);
                    let data: Vec<u8> = (0..len).map(|_| rng.random()).collect();
                    write(&mut *q, off as u64, &data);
                    assert!(read(&mut *q, off as u64, len) == data, "thread {t}");
                }
            });
        }
    });
}

/// Everything that holds for every writable backend.
fn suite(dev: &dyn BlockDevice) -> Vec<u8> {
    fill_queue(dev);
    flush_discard_zeroes(dev);
    bad_ranges(dev);
    two_threads(dev);
    random_io(dev, 42, 200)
}

fn shm_dir() -> &'static Path {
    Path::new("/dev/shm")
}

#[test]
fn ram_anonymous() {
    let disk = RamDisk::new(4 * MIB, 512).unwrap();
    suite(&disk);
    let model = random_io(&disk, 7, 50);
    let mut back = vec![0u8; model.len()];
    disk.read_at(0, &mut back).unwrap();
    assert!(back == model);
    read_only_refuses(&disk.with_read_only(true));
}

#[test]
fn ram_4k_blocks() {
    suite(&RamDisk::new(4 * MIB, 4096).unwrap());
}

#[test]
fn ram_shared_file_holds_the_bytes() {
    let dir = if shm_dir().is_dir() { shm_dir().to_path_buf() } else { std::env::temp_dir() };
    let file = tempfile::NamedTempFile::new_in(dir).unwrap();
    file.as_file().set_len(2 * MIB).unwrap();
    let disk = RamDisk::from_shm_file(file.path()).unwrap();
    let model = suite(&disk);
    assert!(std::fs::read(file.path()).unwrap() == model);
    read_only_refuses(&disk.with_read_only(true));
}

/// A `len`-byte file in `dir`, filled with a pattern so zeroes have to be written to appear.
fn backing_file(dir: &Path, len: u64) -> tempfile::NamedTempFile {
    let file = tempfile::NamedTempFile::new_in(dir).unwrap();
    let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    std::fs::write(file.path(), data).unwrap();
    file
}

#[test]
fn uring_buffered_file() {
    let file = backing_file(&std::env::temp_dir(), 4 * MIB);
    let dev = UringDevice::open(file.path(), UringOptions::default()).unwrap();
    let info = dev.info();
    assert_eq!((info.size_bytes, info.block_size), (4 * MIB, 512));
    let model = suite(&dev);
    drop(dev);
    assert!(std::fs::read(file.path()).unwrap() == model, "file bytes differ");
    let ro = UringOptions { read_only: true, ..UringOptions::default() };
    read_only_refuses(&UringDevice::open(file.path(), ro).unwrap());
    assert!(std::fs::read(file.path()).unwrap() == model, "read-only device wrote");
}

#[test]
fn uring_tmpfs_falls_back_to_writing_zeroes() {
    // tmpfs has no FALLOC_FL_ZERO_RANGE: write-zeroes goes through the zero buffer.
    if !shm_dir().is_dir() {
        eprintln!("skipped: no /dev/shm");
        return;
    }
    let file = backing_file(shm_dir(), 2 * MIB);
    let dev = UringDevice::open(file.path(), UringOptions::default()).unwrap();
    let mut q = dev.open_queue(2).unwrap();
    // More than the 1 MiB zero buffer: several chained writes.
    let len = 1536 * 1024;
    // SAFETY: no segments.
    let r = unsafe { io(&mut *q, BlockOp::WriteZeroes { unmap: false }, 4096, len, &[]) };
    assert_eq!(r, Ok(0));
    let bytes = std::fs::read(file.path()).unwrap();
    assert!(bytes[4096..4096 + len as usize].iter().all(|&b| b == 0));
    assert_eq!(bytes[4095], (4095 % 251) as u8);
    let end = 4096 + len as usize;
    assert_eq!(bytes[end], (end % 251) as u8);
    drop(q);
    let model = suite(&dev);
    assert!(std::fs::read(file.path()).unwrap() == model, "file bytes differ");
}

/// An O_DIRECT device on a file in a directory that supports it, or `None` (skip).
fn direct_device(file: &tempfile::NamedTempFile) -> Option<UringDevice> {
    let opts = UringOptions { direct: true, ..UringOptions::default() };
    match UringDevice::open(file.path(), opts) {
        Ok(dev) => Some(dev),
        Err(UringError::File(FileOpenError::Open { source, .. }))
            if source.raw_os_error() == Some(libc::EINVAL) =>
        {
            eprintln!(
                "skipped: {} does not support O_DIRECT",
                file.path().parent().unwrap().display()
            );
            None
        }
        Err(e) => panic!("open O_DIRECT: {e:?}"),
    }
}

#[test]
fn uring_direct_file() {
    let file = backing_file(&std::env::temp_dir(), 4 * MIB);
    let Some(dev) = direct_device(&file) else {
        return;
    };
    let info = dev.info();
    assert!(info.block_size >= 512 && info.block_size.is_power_of_two());
    let model = suite(&dev);
    assert!(std::fs::read(file.path()).unwrap() == model, "file bytes differ");

    let bs = info.block_size as usize;
    let align = dev.mem_align() as usize;
    let mut q = dev.open_queue(2).unwrap();
    let mut buf = AlignedBuf::new(4 * bs);
    let good = buf.seg(0, bs);
    let short = buf.seg(0, bs / 2);
    let mut cases = vec![
        (BlockOp::Read, 1u64, 0u64, vec![good]),
        (BlockOp::Write, bs as u64 + 512 / 2, 0, vec![good]),
        (BlockOp::Read, 0, 0, vec![short]),
        (BlockOp::Write, 0, 0, vec![short, short]),
        (BlockOp::Discard, 1, bs as u64, vec![]),
        (BlockOp::WriteZeroes { unmap: false }, 0, 100, vec![]),
    ];
    if align > 1 {
        cases.push((BlockOp::Read, 0, 0, vec![buf.seg(align / 2, bs)]));
    }
    for (op, offset, len, segs) in cases {
        // SAFETY: `buf` outlives the request; it is refused before the kernel sees it.
        let r = unsafe { io(&mut *q, op, offset, len, &segs) };
        assert!(matches!(r, Err(BlockError::Misaligned { .. })), "{op:?} at {offset}: {r:?}");
    }
    assert!(std::fs::read(file.path()).unwrap() == model, "refused requests wrote");
}

#[test]
fn uring_read_past_a_shrunken_file_fails_with_eio() {
    let file = backing_file(&std::env::temp_dir(), MIB);
    let dev = UringDevice::open(file.path(), UringOptions::default()).unwrap();
    file.as_file().set_len(MIB / 2).unwrap();
    let mut q = dev.open_queue(2).unwrap();
    let mut buf = AlignedBuf::new(8192);
    // Straddles the new end: a short read, a resubmit that reads 0 bytes, then EIO.
    for offset in [MIB / 2 - 4096, MIB / 2 + 4096] {
        let seg = buf.seg(0, 8192);
        // SAFETY: `buf` outlives the request.
        let r = unsafe { io(&mut *q, BlockOp::Read, offset, 0, &[seg]) };
        assert_eq!(r, Err(BlockError::Io(libc::EIO)), "read at {offset}");
    }
}

#[test]
fn uring_completion_fd_and_drop_with_requests_in_flight() {
    let file = backing_file(&std::env::temp_dir(), MIB);
    let dev = UringDevice::open(file.path(), UringOptions::default()).unwrap();
    let mut buf = AlignedBuf::new(64 * 4096);
    buf.as_mut_slice().fill(0xee);
    {
        let mut q = dev.open_queue(64).unwrap();
        let fd = q.completion_fd().expect("io_uring has an eventfd");
        for i in 0..64 {
            let seg = buf.seg(i * 4096, 4096);
            let req = BlockRequest {
                op: BlockOp::Write,
                offset: (i * 4096) as u64,
                len: 0,
                segments: &[seg],
                tag: i as u64,
            };
            // SAFETY: `buf` outlives the queue, whose drop waits for every request.
            unsafe { q.submit(req) }.unwrap();
        }
        q.kick().unwrap();
        let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut pfd, 1, 10_000) };
        assert_eq!(n, 1, "eventfd never became readable");
        // Dropped with (probably) some of the 64 writes still in the kernel.
    }
    let bytes = std::fs::read(file.path()).unwrap();
    assert!(bytes[..64 * 4096].iter().all(|&b| b == 0xee));
}

#[test]
fn uring_refuses_bad_options() {
    let file = backing_file(&std::env::temp_dir(), 4096);
    for max_segments in [0, 1025] {
        let opts = UringOptions { max_segments, ..UringOptions::default() };
        assert!(matches!(
            UringDevice::open(file.path(), opts),
            Err(UringError::File(FileOpenError::MaxSegments { .. }))
        ));
    }
    let dev = UringDevice::open(file.path(), UringOptions::default()).unwrap();
    assert!(dev.open_queue(0).is_err());
    assert!(dev.open_queue(1 << 20).is_err());
    let empty = tempfile::NamedTempFile::new().unwrap();
    assert!(matches!(
        UringDevice::open(empty.path(), UringOptions::default()),
        Err(UringError::File(FileOpenError::BadGeometry { .. }))
    ));
    let ro = UringOptions { read_only: true, ..UringOptions::default() };
    assert!(matches!(
        UringDevice::open(std::env::temp_dir(), ro),
        Err(UringError::File(FileOpenError::NotADisk { .. }))
    ));
}

/// The synchronous backend over `file`: the shared suite, the file holds the model's bytes, a
/// read-only open refuses changes and leaves them alone.
fn sync_file_suite(file: &tempfile::NamedTempFile, size: u64) {
    let dev = SyncFileDevice::open(file.path(), SyncFileOptions::default()).unwrap();
    let info = dev.info();
    assert_eq!((info.size_bytes, info.block_size, info.max_segments), (size, 512, 1024));
    let model = suite(&dev);
    assert!(std::fs::read(file.path()).unwrap() == model, "file bytes differ");
    // Unaligned, byte-granular I/O goes through the page cache as is.
    let mut q = dev.open_queue(2).unwrap();
    write(&mut *q, 4097, b"unaligned");
    let mut want = model[4095..4095 + 13].to_vec();
    want[2..11].copy_from_slice(b"unaligned");
    assert_eq!(read(&mut *q, 4095, 13), want);
    drop(q);
    let model = std::fs::read(file.path()).unwrap();
    let ro = SyncFileOptions { read_only: true, ..SyncFileOptions::default() };
    read_only_refuses(&SyncFileDevice::open(file.path(), ro).unwrap());
    assert!(std::fs::read(file.path()).unwrap() == model, "read-only device wrote");
}

#[test]
fn sync_file_in_temp_dir() {
    let file = backing_file(&std::env::temp_dir(), 4 * MIB);
    sync_file_suite(&file, 4 * MIB);
}

#[test]
fn sync_file_on_tmpfs() {
    if !shm_dir().is_dir() {
        eprintln!("skipped: no /dev/shm");
        return;
    }
    let file = backing_file(shm_dir(), 2 * MIB);
    sync_file_suite(&file, 2 * MIB);
}
