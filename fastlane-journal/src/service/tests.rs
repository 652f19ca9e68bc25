//! The journal service with producers in threads of this process (the attach protocol, the
//! rings and the writer are the same as for other processes; `fastlane-cli/tests/
//! journal_service.rs` runs real producer processes and kills them).

use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use fastlane_block::BlockDevice;

use super::wire::{self, Hello, Reply, Status, REPLY_LEN};
use super::{Service, ServiceConfig, SOCKET_NAME};
use crate::{read_from, verify_dir, Anchor, JournalError, JournalProducer};

const T: Duration = Duration::from_secs(20);

fn config(dir: &Path) -> ServiceConfig {
    let mut c = ServiceConfig::new(dir);
    c.segment_bytes = 8 << 20;
    c.max_batch_bytes = 256 << 10;
    c.ring_bytes = 1 << 20;
    c
}

/// Every record of the directory: global seq → (producer id, payload).
fn records(dir: &Path) -> BTreeMap<u64, (u32, Vec<u8>)> {
    let mut out = BTreeMap::new();
    read_from(dir, 1, &mut |h, p| {
        out.insert(h.seq, (h.flags, p.to_vec()));
        true
    })
    .unwrap();
    out
}

/// Each producer's payloads in global order.
fn by_producer(recs: &BTreeMap<u64, (u32, Vec<u8>)>) -> BTreeMap<u32, Vec<Vec<u8>>> {
    let mut out: BTreeMap<u32, Vec<Vec<u8>>> = BTreeMap::new();
    for (id, p) in recs.values() {
        out.entry(*id).or_default().push(p.clone());
    }
    out
}

/// Three producers append concurrently: one global sequence without gaps, each producer's
/// records in its own order under its own id, each acknowledged by its own seqs.
#[test]
fn producers_merge_into_one_sequence() {
    let d = tempfile::tempdir().unwrap();
    let svc = Service::start(config(d.path())).unwrap();
    let n = 3000u64;
    let handles: Vec<_> = (0..3)
        .map(|k| {
            let dir = d.path().to_path_buf();
            std::thread::spawn(move || {
                let mut tx = JournalProducer::connect(&dir, &format!("p{k}")).unwrap();
                let mut last = 0;
                for i in 1..=n {
                    last = tx.append_blocking(format!("p{k} {i}").as_bytes(), T).unwrap();
                    assert_eq!(last, i, "a producer's own seqs count 1, 2, 3");
                }
                tx.wait_durable(last, T).unwrap();
                tx.producer_id().unwrap()
            })
        })
        .collect();
    let ids: Vec<u32> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let stats = svc.stop().unwrap();
    assert_eq!(stats.records, 3 * n);
    assert_eq!(stats.attaches, 3);
    let recs = records(d.path());
    assert_eq!(recs.len() as u64, 3 * n);
    assert_eq!(recs.keys().copied().collect::<Vec<_>>(), (1..=3 * n).collect::<Vec<_>>());
    let per = by_producer(&recs);
    for (k, id) in ids.iter().enumerate() {
        let want: Vec<Vec<u8>> = (1..=n).map(|i| format!("p{k} {i}").into_bytes()).collect();
        assert_eq!(per[id], want, "producer {k} (id {id}) records out of order or missing");
    }
    let v = verify_dir(d.path(), Anchor::default()).unwrap();
    assert!(v.problem.is_none(), "{:?}", v.problem);
    assert_eq!(v.last_seq, 3 * n);
}

/// Small segments: the service rolls many times under load, the chain continues across them,
/// and a restart resumes the global sequence where it ended.
#[test]
fn rolls_segments_and_resumes_after_restart() {
    let d = tempfile::tempdir().unwrap();
    let mut c = config(d.path());
    c.segment_bytes = 1 << 20;
    c.max_batch_bytes = 64 << 10;
    let svc = Service::start(c).unwrap();
    let mut tx = JournalProducer::connect(d.path(), "roller").unwrap();
    let payload = [7u8; 1000];
    let n = 5000u64;
    for _ in 0..n {
        tx.append_blocking(&payload, T).unwrap();
    }
    tx.wait_durable(n, T).unwrap();
    drop(tx);
    let stats = svc.stop().unwrap();
    assert!(stats.rolls >= 4, "5 MB of records in 1 MiB segments rolled only {}", stats.rolls);
    let v = verify_dir(d.path(), Anchor::default()).unwrap();
    assert!(v.problem.is_none(), "{:?}", v.problem);
    assert_eq!((v.records, v.last_seq), (n, n));
    assert!(v.segments >= 5);

    let mut c = config(d.path());
    c.segment_bytes = 1 << 20;
    let svc = Service::start(c).unwrap();
    assert_eq!(svc.recovered().last_seq, n);
    let mut tx = JournalProducer::connect(d.path(), "after").unwrap();
    let s = tx.append(b"after restart").unwrap();
    tx.wait_durable(s, T).unwrap();
    drop(tx);
    svc.stop().unwrap();
    let recs = records(d.path());
    assert_eq!(recs[&(n + 1)].1, b"after restart");
}

/// A producer that scribbles over its ring's header is shut off alone: its control block says
/// so, the service counts the fault, and another producer goes on.
#[test]
fn a_hostile_producer_is_shut_off_alone() {
    let d = tempfile::tempdir().unwrap();
    let svc = Service::start(config(d.path())).unwrap();
    let mut good = JournalProducer::connect(d.path(), "good").unwrap();
    good.append(b"before").unwrap();

    // The hostile one attaches by hand and keeps the raw ring mapping.
    let s = UnixStream::connect(d.path().join(SOCKET_NAME)).unwrap();
    let mut s2 = &s;
    use std::io::Write as _;
    s2.write_all(&Hello { ring_bytes: 4096, name: "evil".into() }.encode()).unwrap();
    let mut buf = [0u8; REPLY_LEN];
    let fds = wire::recv_with_fds(&s, &mut buf, 3).unwrap();
    assert_eq!(Reply::decode(&buf).unwrap().status, Status::Ok);
    let map = |fd: &std::os::fd::OwnedFd| {
        // SAFETY: maps one page of a memfd just received (each is at least a page long).
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        p.cast::<u8>()
    };
    let ring = map(&fds[0]);
    // SAFETY: garbage over the ring's header page: the attack under test, on a mapping this
    // test made (and never unmaps: the process ends with the test binary).
    unsafe { std::ptr::write_bytes(ring, 0xA5, 4096) };
    let bell = map(&fds[2]).cast::<std::sync::atomic::AtomicU32>();
    // SAFETY: the doorbell page is mapped above, page-aligned, and lives on; wake the writer.
    fastlane_ring::shm::doorbell::ring(unsafe { &*bell });
    let deadline = std::time::Instant::now() + T;
    while svc.stats().faults == 0 {
        assert!(std::time::Instant::now() < deadline, "the scribbled ring was never faulted");
        std::thread::sleep(Duration::from_millis(5));
    }
    let seq = good.append(b"after").unwrap();
    good.wait_durable(seq, T).unwrap();
    drop(good);
    let stats = svc.stop().unwrap();
    assert_eq!(stats.faults, 1);
    let recs = records(d.path());
    let payloads: Vec<&[u8]> = recs.values().map(|(_, p)| p.as_slice()).collect();
    assert_eq!(payloads, [b"before".as_slice(), b"after".as_slice()]);
    drop(s);
}

/// A producer that appends and goes away without waiting: everything it published is
/// written; the service lists it as gone.
#[test]
fn a_detached_producer_is_drained() {
    let d = tempfile::tempdir().unwrap();
    let svc = Service::start(config(d.path())).unwrap();
    {
        let mut tx = JournalProducer::connect(d.path(), "brief").unwrap();
        for i in 0..500 {
            tx.append_blocking(format!("r{i}").as_bytes(), T).unwrap();
        }
    }
    let deadline = std::time::Instant::now() + T;
    loop {
        let s = svc.stats();
        if s.producers.len() == 1 && s.producers[0].gone {
            assert_eq!(s.producers[0].records, 500);
            assert_eq!(s.producers[0].durable_local, 500);
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the detached producer was never dropped");
        std::thread::sleep(Duration::from_millis(5));
    }
    svc.stop().unwrap();
    assert_eq!(records(d.path()).len(), 500);
}

/// Limits and garbage at the socket: a second producer over the limit is refused with the
/// reason; a connection that sends garbage is refused; one that sends nothing is dropped
/// after the hello timeout; none of them stops the service.
#[test]
fn refusals_name_the_reason() {
    let d = tempfile::tempdir().unwrap();
    let mut c = config(d.path());
    c.max_producers = 1;
    let svc = Service::start(c).unwrap();
    let _silent = UnixStream::connect(d.path().join(SOCKET_NAME)).unwrap();
    let mut first = JournalProducer::connect(d.path(), "first").unwrap();
    match JournalProducer::connect(d.path(), "second") {
        Err(JournalError::Refused { status: Status::TooMany, .. }) => {}
        other => panic!("want TooMany, got {other:?}"),
    }
    let s = UnixStream::connect(d.path().join(SOCKET_NAME)).unwrap();
    use std::io::Write as _;
    (&s).write_all(&[0x55; super::wire::HELLO_LEN]).unwrap();
    let mut buf = [0u8; REPLY_LEN];
    wire::recv_with_fds(&s, &mut buf, 3).unwrap();
    assert_eq!(Reply::decode(&buf).unwrap().status, Status::BadHello);
    let seq = first.append(b"still fine").unwrap();
    first.wait_durable(seq, T).unwrap();
    drop(first);
    let stats = svc.stop().unwrap();
    assert!(stats.refused >= 2, "refused {}", stats.refused);
}

/// A second service on the same directory is refused (the directory's lock).
#[test]
fn one_service_per_directory() {
    let d = tempfile::tempdir().unwrap();
    let svc = Service::start(config(d.path())).unwrap();
    let err = Service::start(config(d.path())).unwrap_err();
    let locked = crate::SegmentError::of(&err);
    assert!(
        matches!(locked, Some(crate::SegmentError::Locked { pid: Some(p), .. }) if *p == std::process::id()),
        "{err:?}"
    );
    svc.stop().unwrap();
}

/// A tmpfs of `mib` MiB mounted for the test (the service's directory on a file system that
/// fills up); unmounted on drop. Needs root, as the test suite runs in CI: fails loudly
/// otherwise, never skips.
struct SmallFs {
    path: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl SmallFs {
    fn mount(mib: u64) -> SmallFs {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fs");
        std::fs::create_dir(&path).unwrap();
        let st = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mib}M"), "tmpfs"])
            .arg(&path)
            .status()
            .expect("mount(8)");
        assert!(st.success(), "mounting a tmpfs needs root (the suite runs as root in CI)");
        SmallFs { path, _dir: dir }
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg("-l").arg(&self.path).status();
    }
}

/// The file system fills up: the roll to the next segment fails and is retried, appends push
/// back (`append_blocking` times out: the ring is full) while everything acknowledged stays
/// durable and the directory verifies (no half-made segment); when space returns, the service
/// rolls and the producer goes on.
#[test]
fn a_full_file_system_pushes_back_and_the_service_resumes() {
    let fs = SmallFs::mount(14);
    let dir = fs.path.join("j");
    let mut c = config(&dir);
    c.segment_bytes = 4 << 20;
    c.max_batch_bytes = 64 << 10;
    c.ring_bytes = 64 << 10;
    let svc = Service::start(c).unwrap();
    // Segment 0 and its spare take 8 MiB; the ballast takes most of the rest.
    let ballast = fs.path.join("ballast");
    std::fs::write(&ballast, vec![1u8; 5 << 20]).unwrap();
    let mut tx = JournalProducer::connect(&dir, "filler").unwrap();
    let rec = [0x42u8; 1000];
    let mut acked = 0;
    let mut stalled = false;
    // Bounded: at most 20,000 records (20 MB, more than the file system holds).
    for _ in 0..20_000 {
        match tx.append_blocking(&rec, Duration::from_millis(500)) {
            Ok(s) => acked = s,
            Err(JournalError::DeviceFull) => {
                stalled = true;
                break;
            }
            Err(e) => panic!("append: {e}"),
        }
    }
    assert!(stalled, "the file system never filled up");
    // A plain append says so at once, too, and waiting for an unacknowledged seq fails.
    assert!(matches!(tx.append(&rec), Err(JournalError::DeviceFull)));
    let durable = tx.durable_seq();
    assert!(matches!(tx.wait_durable(acked.max(durable + 1), T), Err(JournalError::DeviceFull)));
    assert!(durable > 4000, "only {durable} records durable before the disk filled");
    let s = svc.stats();
    assert!(s.roll_failures > 0, "no failed roll counted: {s:?}");
    let v = verify_dir(&dir, Anchor::default()).unwrap();
    assert!(v.problem.is_none(), "{:?}", v.problem);
    assert!(v.last_seq >= durable);
    // Space returns: the service rolls and the producer goes on.
    std::fs::remove_file(&ballast).unwrap();
    let mut more = 0;
    for _ in 0..200 {
        acked = tx.append_blocking(&rec, T).unwrap();
        more += 1;
    }
    tx.wait_durable(acked, T).unwrap();
    drop(tx);
    let stats = svc.stop().unwrap();
    assert!(stats.rolls >= 2, "{stats:?}");
    let v = verify_dir(&dir, Anchor::default()).unwrap();
    assert!(v.problem.is_none(), "{:?}", v.problem);
    assert_eq!(v.last_seq, acked);
    assert!(more == 200);
}

/// A tailer follows a live service across segment rolls (both writer modes): it returns every
/// durable record once, in order, under its producer, and a second tailer opened in the
/// middle starts exactly there.
#[test]
fn a_tailer_follows_the_service_across_rolls() {
    for io in [crate::WriterIo::Pipelined, crate::WriterIo::Dsync] {
        let d = tempfile::tempdir().unwrap();
        let mut c = config(d.path());
        c.segment_bytes = 1 << 20;
        c.max_batch_bytes = 64 << 10;
        c.writer_io = io;
        let svc = Service::start(c).unwrap();
        let mut tx = JournalProducer::connect(d.path(), "tailed").unwrap();
        let mut tail = crate::Tailer::open(d.path(), 1).unwrap();
        let mut got = Vec::new();
        let n = 4000u64;
        for i in 1..=n {
            tx.append_blocking(format!("rec {i:>600}").as_bytes(), T).unwrap();
            if i % 500 == 0 {
                tail.read(svc.durable_seq(), usize::MAX, &mut got).unwrap();
            }
        }
        tx.wait_durable(n, T).unwrap();
        tail.read(svc.durable_seq(), usize::MAX, &mut got).unwrap();
        let stats = svc.stop().unwrap();
        assert!(stats.rolls >= 2, "{io:?}: {stats:?}");
        assert_eq!(got.len() as u64, n, "{io:?}");
        for (i, r) in got.iter().enumerate() {
            assert_eq!(r.header.seq, i as u64 + 1);
            assert_eq!(r.payload, format!("rec {:>600}", i + 1).into_bytes());
            assert_eq!(r.header.flags, tx.producer_id().unwrap());
        }
        let mut mid = crate::Tailer::open(d.path(), 2500).unwrap();
        let mut rest = Vec::new();
        mid.read(n, usize::MAX, &mut rest).unwrap();
        assert_eq!(rest.first().map(|r| r.header.seq), Some(2500));
        assert_eq!(rest.len(), 1501);
    }
}

/// Segments that fill faster than the configured spare pace: the pace is raised with the
/// fill, so no roll waits for its spare. (At the fixed 512 KiB/s configured here each 4 MiB
/// spare takes 8 s and every roll would wait seconds; the test fails that way with
/// `spare_adaptive = false`.)
#[test]
fn the_spare_keeps_up_with_a_segment_that_fills_fast() {
    let d = tempfile::tempdir().unwrap();
    let mut c = config(d.path());
    c.segment_bytes = 4 << 20;
    c.spare_bytes_per_s = 512 << 10;
    let svc = Service::start(c).unwrap();
    let mut tx = JournalProducer::connect(d.path(), "fast").unwrap();
    // 4 KB records at 1,000 a second: a segment every second or so, for 3.5 s.
    let payload = vec![0x42u8; 4000];
    let start = std::time::Instant::now();
    let n = 3500u32;
    let mut last = 0;
    for i in 0..n {
        let due = start + Duration::from_millis(u64::from(i));
        if let Some(w) = due.checked_duration_since(std::time::Instant::now()) {
            std::thread::sleep(w);
        }
        last = tx.append_blocking(&payload, T).unwrap();
    }
    tx.wait_durable(last, T).unwrap();
    let during = svc.stats();
    drop(tx);
    let stats = svc.stop().unwrap();
    assert_eq!(stats.records, u64::from(n));
    assert!(stats.rolls >= 2, "segments filled: {} rolls", stats.rolls);
    assert_eq!(
        stats.spare_waits, 0,
        "{} of {} rolls waited {:?} for the spare (pace {} B/s)",
        stats.spare_waits, stats.rolls, stats.spare_wait, during.spare_pace
    );
    let v = verify_dir(d.path(), Anchor::default()).unwrap();
    assert!(v.problem.is_none(), "{:?}", v.problem);
}

/// The next segment's device is opened by the spare's thread, ahead of the roll: no segment
/// is opened on the writer's thread (every ack waits while it rolls), the roll uses the
/// device opened on the file it installed (the records verify), and the writer's time in
/// rolls is counted.
#[test]
fn the_next_segment_is_opened_before_the_roll() {
    use std::sync::{Arc, Mutex};
    let d = tempfile::tempdir().unwrap();
    let mut c = config(d.path());
    c.segment_bytes = 1 << 20;
    c.max_batch_bytes = 64 << 10;
    let threads: Arc<Mutex<Vec<String>>> = Arc::default();
    let (queues, closes): (Names, Names) = Default::default();
    let (seen, inner) = (Arc::clone(&threads), Arc::clone(&c.open));
    let (q, cl) = (Arc::clone(&queues), Arc::clone(&closes));
    c.open = Arc::new(move |p: &Path| {
        seen.lock().unwrap().push(thread_name());
        let (queues, closes) = (Arc::clone(&q), Arc::clone(&cl));
        Ok(Arc::new(QueueWatch { inner: inner(p)?, queues, closes }) as Arc<dyn BlockDevice>)
    });
    let svc = Service::start(c).unwrap();
    let mut tx = JournalProducer::connect(d.path(), "roller").unwrap();
    let payload = [3u8; 1000];
    let n = 4000u64;
    for _ in 0..n {
        tx.append_blocking(&payload, T).unwrap();
    }
    tx.wait_durable(n, T).unwrap();
    drop(tx);
    let stats = svc.stop().unwrap();
    assert!(stats.rolls >= 3, "4 MB of records in 1 MiB segments rolled only {}", stats.rolls);
    assert!(stats.roll_time > Duration::ZERO, "{} rolls took no time", stats.rolls);
    let opened = threads.lock().unwrap().clone();
    assert!(
        opened.iter().all(|t| t != "journal-writer"),
        "a segment was opened on the writer's thread: {opened:?}"
    );
    let queued = queues.lock().unwrap().clone();
    assert!(
        queued.iter().all(|t| t != "journal-writer"),
        "a segment's queue was opened on the writer's thread: {queued:?}"
    );
    // Each segment rolled from is closed by the next roll's spare thread (the last one, and
    // the one in use, by the writer as it stops).
    let closed = closes.lock().unwrap().clone();
    let off = closed.iter().filter(|t| *t == "journal-spare").count() as u64;
    assert!(off + 1 >= stats.rolls, "{} rolls, closed: {closed:?}", stats.rolls);
    let ahead = opened.iter().filter(|t| *t == "journal-spare").count() as u64;
    assert!(
        ahead >= stats.rolls,
        "{} rolls, {ahead} segments opened ahead: {opened:?}",
        stats.rolls
    );
    let v = verify_dir(d.path(), Anchor::default()).unwrap();
    assert!(v.problem.is_none(), "{:?}", v.problem);
    assert_eq!((v.records, v.last_seq), (n, n));
}

/// Thread names, shared.
type Names = std::sync::Arc<std::sync::Mutex<Vec<String>>>;

/// A device that records the thread each queue is opened on, and the one it is closed on.
struct QueueWatch {
    inner: std::sync::Arc<dyn BlockDevice>,
    queues: Names,
    closes: Names,
}

fn thread_name() -> String {
    std::thread::current().name().unwrap_or("?").to_string()
}

impl BlockDevice for QueueWatch {
    fn info(&self) -> fastlane_block::DeviceInfo {
        self.inner.info()
    }

    fn open_queue(&self, depth: u32) -> std::io::Result<Box<dyn fastlane_block::BlockQueue>> {
        self.queues.lock().unwrap().push(thread_name());
        self.inner.open_queue(depth)
    }
}

impl Drop for QueueWatch {
    fn drop(&mut self) {
        if let Ok(mut c) = self.closes.lock() {
            c.push(thread_name());
        }
    }
}

/// A device opened ahead on a spare that was since replaced (another inode at the path) is
/// not used: the roll opens the file it installed.
#[test]
fn a_device_opened_on_another_file_is_not_used() {
    use std::os::unix::fs::MetadataExt as _;
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("seg");
    std::fs::write(&path, [0u8; 4096]).unwrap();
    let open = config(d.path()).open;
    let ino = std::fs::metadata(&path).unwrap().ino();
    let same = super::roll::Spare { device: Some((open(&path).unwrap(), ino, None)) };
    assert!(same.device_for(&path).is_some(), "the same file: its device is used");
    let old = super::roll::Spare { device: Some((open(&path).unwrap(), ino, None)) };
    // The old device's descriptor keeps the old inode alive: the new file gets another number.
    std::fs::remove_file(&path).unwrap();
    std::fs::write(&path, [0u8; 4096]).unwrap();
    assert_ne!(std::fs::metadata(&path).unwrap().ino(), ino);
    assert!(old.device_for(&path).is_none(), "another file at the path: not used");
    assert!(super::roll::Spare { device: None }.device_for(&path).is_none());
}

/// Retention's removals run on the spare's thread, never the writer's (unlinking a 256 MiB
/// segment took 54 ms on this project's VM: every ack would wait for it), oldest first; a
/// removal that fails is counted and named, and the journal goes on.
#[test]
fn retention_removes_segments_off_the_writer() {
    use std::sync::{Arc, Mutex};
    let d = tempfile::tempdir().unwrap();
    let mut c = config(d.path());
    c.segment_bytes = 1 << 20;
    c.max_batch_bytes = 64 << 10;
    c.retention = crate::Retention { max_segments: Some(2), ..Default::default() };
    let seen: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let (log, fail) = (Arc::clone(&seen), Arc::new(std::sync::atomic::AtomicBool::new(false)));
    let failing = Arc::clone(&fail);
    c.remove = Arc::new(move |p: &Path| {
        let name = std::thread::current().name().unwrap_or("?").to_string();
        let file = p.file_name().unwrap().to_string_lossy().into_owned();
        log.lock().unwrap().push((name, file));
        if failing.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(std::io::Error::from(std::io::ErrorKind::PermissionDenied));
        }
        std::fs::remove_file(p)
    });
    let svc = Service::start(c).unwrap();
    let mut tx = JournalProducer::connect(d.path(), "retained").unwrap();
    let payload = [5u8; 1000];
    let n = 5000u64;
    for _ in 0..n {
        tx.append_blocking(&payload, T).unwrap();
    }
    tx.wait_durable(n, T).unwrap();
    let rolls = svc.stats().rolls;
    assert!(rolls >= 3, "5 MB of records in 1 MiB segments rolled only {rolls} times");
    // The last roll's removal runs beside the writer: wait for it (bounded).
    let t0 = std::time::Instant::now();
    while svc.stats().segments_removed + 2 < rolls + 1 && t0.elapsed() < T {
        std::thread::sleep(Duration::from_millis(10));
    }
    let removed = seen.lock().unwrap().clone();
    assert_eq!(svc.stats().segments_removed, removed.len() as u64, "{removed:?}");
    assert_eq!(removed.len() as u64, rolls - 1, "{rolls} rolls, 2 kept: {removed:?}");
    assert!(
        removed.iter().all(|(t, _)| t == "journal-spare"),
        "a segment was removed on another thread than the spare's: {removed:?}"
    );
    let files: Vec<&str> = removed.iter().map(|(_, f)| f.as_str()).collect();
    let mut sorted = files.clone();
    sorted.sort();
    assert_eq!(files, sorted, "not removed oldest first");
    // A failing removal: counted, named, and the records still go in.
    fail.store(true, std::sync::atomic::Ordering::Relaxed);
    for _ in 0..n {
        tx.append_blocking(&payload, T).unwrap();
    }
    tx.wait_durable(2 * n, T).unwrap();
    let t0 = std::time::Instant::now();
    while svc.retention_failures().0 == 0 && t0.elapsed() < T {
        std::thread::sleep(Duration::from_millis(10));
    }
    let (failures, why) = svc.retention_failures();
    assert!(failures >= 1, "no failed removal counted");
    assert!(why.contains("remove") && why.contains(".seg"), "{why}");
    drop(tx);
    svc.stop().unwrap();
    let v = verify_dir(d.path(), Anchor::default()).unwrap_or_else(|e| panic!("{e:?}"));
    assert!(v.problem.is_none(), "{:?}", v.problem);
    assert_eq!(v.last_seq, 2 * n);
    assert!(v.first_seq > 1, "nothing was removed: first seq {}", v.first_seq);
}
