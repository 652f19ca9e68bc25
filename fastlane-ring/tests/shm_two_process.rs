//! The shared-memory ring between two real processes.
//!
//! The parent creates a ring, re-executes this test binary as the child (`--exact
//! shm_child_producer`, told what to do through environment variables), and the child
//! produces records of varying length (16..=256 bytes) carrying a sequence number, a pattern
//! that depends on it, and a checksum over both. The parent consumes and checks every record:
//! length, type, sequence number, checksum. Once over a file in `/dev/shm` opened by path, once
//! over a memfd whose descriptor the child inherits.
//!
//! Every wait has a deadline: if the child dies, the parent notices at the next timeout and
//! fails instead of hanging; if the parent dies, the child's blocking reserve times out.
//!
//! `FASTLANE_SHM_RECORDS` overrides the record count (default 10 million per run).

// The shared-memory ring needs mmap and futexes; loom builds leave it out.
#![cfg(not(loom))]

use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use fastlane_ring::shm::{Producer, ShmError, ShmRing};

/// Set in the child: `file:<path>` or `fd:<number>`.
const CHILD_ENV: &str = "FASTLANE_SHM_CHILD";
/// Records per run (both processes read it).
const RECORDS_ENV: &str = "FASTLANE_SHM_RECORDS";
const DEFAULT_RECORDS: u64 = 10_000_000;
const RING_BYTES: usize = 1 << 20;
const LEN_MIN: usize = 16;
const LEN_MAX: usize = 256;
/// How long either side waits for the other before concluding it is gone.
const PEER_TIMEOUT: Duration = Duration::from_secs(20);
/// The whole run.
const RUN_TIMEOUT: Duration = Duration::from_secs(180);

fn record_count() -> u64 {
    std::env::var(RECORDS_ENV).ok().and_then(|s| s.parse().ok()).unwrap_or(DEFAULT_RECORDS)
}

// A 64-bit mix (splitmix64's finaliser), to derive lengths and patterns from a seq.
use fastlane_util::mix64 as mix;

fn record_len(seq: u64) -> usize {
    LEN_MIN + (mix(seq) % (LEN_MAX - LEN_MIN + 1) as u64) as usize
}

fn record_type(seq: u64) -> u32 {
    (seq % 1000) as u32
}

/// A record under construction or being checked: 16-byte aligned, so the checksum can read
/// whole 16-byte words (debug builds are slow at byte-at-a-time loops).
#[derive(Clone)]
struct RecordBuf([u128; LEN_MAX / 16]);

impl RecordBuf {
    fn new() -> Self {
        RecordBuf([0; LEN_MAX / 16])
    }

    fn bytes(&self) -> &[u8; LEN_MAX] {
        // SAFETY:
        // - `[u128; 16]` and `[u8; 256]` have the same size; `u8` needs less alignment.
        // - Every byte of a `u128` array is initialised, and any byte value is a valid `u8`.
        // - The result borrows `self`, so it cannot outlive the array.
        unsafe { &*self.0.as_ptr().cast::<[u8; LEN_MAX]>() }
    }

    fn bytes_mut(&mut self) -> &mut [u8; LEN_MAX] {
        // SAFETY:
        // - Same size, alignment and initialisation argument as `bytes`.
        // - Any byte pattern written through the result is a valid `u128` array.
        // - The result borrows `self` exclusively.
        unsafe { &mut *self.0.as_mut_ptr().cast::<[u8; LEN_MAX]>() }
    }

    /// FNV-1a over native 8-byte words (two per step), then the tail bytes, of the first
    /// `len` bytes.
    fn checksum(&self, len: usize) -> u64 {
        const PRIME: u64 = 0x0000_0100_0000_01B3;
        let mut h = 0xCBF2_9CE4_8422_2325u64;
        for &w in &self.0[..len / 16] {
            h = (h ^ w as u64).wrapping_mul(PRIME);
            h = (h ^ (w >> 64) as u64).wrapping_mul(PRIME);
        }
        for &b in &self.bytes()[len / 16 * 16..len] {
            h = (h ^ u64::from(b)).wrapping_mul(PRIME);
        }
        h
    }

    /// Builds record `seq`: `[seq: u64][body: len - 16 bytes][checksum of the rest: u64]`, the
    /// body a window of `pattern` chosen by `seq`. Returns the length.
    fn fill(&mut self, seq: u64, pattern: &[u8]) -> usize {
        let len = record_len(seq);
        self.bytes_mut()[..8].copy_from_slice(&seq.to_ne_bytes());
        let off = (seq % LEN_MAX as u64) as usize;
        self.bytes_mut()[8..len - 8].copy_from_slice(&pattern[off..off + len - 16]);
        let sum = self.checksum(len - 8);
        self.bytes_mut()[len - 8..len].copy_from_slice(&sum.to_ne_bytes());
        len
    }

    /// The sequence number in the first 8 bytes.
    fn seq(&self) -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.bytes()[..8]);
        u64::from_ne_bytes(b)
    }

    /// The checksum stored in the last 8 bytes of a `len`-byte record.
    fn stored_checksum(&self, len: usize) -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.bytes()[len - 8..len]);
        u64::from_ne_bytes(b)
    }
}

/// 512 pseudo-random bytes; a record's body is a window of it chosen by its seq.
fn pattern() -> [u8; 2 * LEN_MAX] {
    let mut p = [0u8; 2 * LEN_MAX];
    for (i, chunk) in p.chunks_exact_mut(8).enumerate() {
        chunk.copy_from_slice(&mix(i as u64 + 0x5EED).to_le_bytes());
    }
    p
}

fn produce(tx: &mut Producer, count: u64) {
    let pattern = pattern();
    let run_deadline = Instant::now() + RUN_TIMEOUT;
    let mut rec = RecordBuf::new();
    for seq in 0..count {
        let len = rec.fill(seq, &pattern);
        let buf = match tx.reserve(len) {
            Ok(buf) => buf,
            Err(ShmError::Full { .. }) => {
                let deadline = Some((Instant::now() + PEER_TIMEOUT).min(run_deadline));
                tx.reserve_blocking(len, deadline)
                    .unwrap_or_else(|e| panic!("child: reserve of record {seq}: {e:?}"))
            }
            Err(e) => panic!("child: reserve of record {seq}: {e:?}"),
        };
        buf.copy_from_slice(&rec.bytes()[..len]);
        // Publish in batches of 64: one store of the tail per batch.
        if seq % 64 == 63 {
            tx.commit(record_type(seq));
        } else {
            tx.stage(record_type(seq));
        }
    }
    tx.publish();
}

/// The child's side. In a normal test run (no `FASTLANE_SHM_CHILD`) this does nothing.
#[test]
fn shm_child_producer() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let ring = if let Some(path) = spec.strip_prefix("file:") {
        ShmRing::open_file(path).expect("child: open_file")
    } else if let Some(fd) = spec.strip_prefix("fd:") {
        let fd: i32 = fd.parse().expect("child: fd number");
        // SAFETY:
        // - The parent cleared FD_CLOEXEC on this descriptor for us and names it here; it is
        //   open in this process and nothing else in the process owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        ShmRing::from_fd(fd).expect("child: from_fd")
    } else {
        panic!("child: bad {CHILD_ENV}={spec}");
    };
    let mut tx = ring.producer().expect("child: claim producer");
    produce(&mut tx, record_count());
}

fn spawn_child(spec: &str, count: u64) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "shm_child_producer", "--nocapture", "--test-threads=1", "-q"])
        .env(CHILD_ENV, spec)
        .env(RECORDS_ENV, count.to_string())
        .spawn()
        .expect("spawn child")
}

/// Waits for the child to exit, killing it after `timeout`.
fn reap(child: &mut Child, timeout: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            return child.wait().unwrap();
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Consumes and verifies `count` records from `ring`, produced by `child`.
fn consume_and_verify(ring: &ShmRing, child: &mut Child, count: u64) {
    let start = Instant::now();
    let run_deadline = start + RUN_TIMEOUT;
    let mut rx = ring.consumer().expect("claim consumer");
    let pattern = pattern();
    let mut expect = 0u64;
    let mut got = RecordBuf::new();
    let mut want = RecordBuf::new();
    while expect < count {
        let deadline = (Instant::now() + PEER_TIMEOUT).min(run_deadline);
        let mut batch = match rx.wait_batch(256, Some(deadline)) {
            Ok(batch) => batch,
            Err(ShmError::Timeout) => {
                let status = child.try_wait().unwrap();
                let _ = child.kill();
                panic!("no record {expect} of {count} after {PEER_TIMEOUT:?}; child: {status:?}");
            }
            Err(e) => panic!("parent: wait_batch at record {expect}: {e:?}"),
        };
        while let Some(record) = batch.next_record().expect("parent: next_record") {
            let len = record.copy_to(got.bytes_mut());
            assert_eq!(record.len(), record_len(expect), "length of record {expect}");
            assert_eq!(record.record_type(), record_type(expect), "type of record {expect}");
            assert_eq!(got.seq(), expect, "sequence number");
            assert_eq!(got.stored_checksum(len), got.checksum(len - 8), "checksum of {expect}");
            // Spot-check the whole content against a fresh build every 4096 records.
            if expect.is_multiple_of(4096) {
                want.fill(expect, &pattern);
                assert_eq!(got.bytes()[..len], want.bytes()[..len], "content of record {expect}");
            }
            expect += 1;
        }
        batch.release();
    }
    // Nothing after the last record.
    let status = reap(child, PEER_TIMEOUT);
    assert!(status.success(), "child failed: {status:?}");
    assert!(rx.peek_batch(1).unwrap().is_empty(), "records after the last one");
    let secs = start.elapsed().as_secs_f64();
    eprintln!("{count} records in {secs:.2} s ({:.2} M records/s)", count as f64 / secs / 1e6);
}

/// One run at a time: the machine running the tests may have few cores, and two spinning pairs
/// would mostly measure the scheduler.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn ten_million_records_over_a_dev_shm_file() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let count = record_count();
    let path = format!("/dev/shm/fastlane-ring-test-{}", std::process::id());
    let _ = std::fs::remove_file(&path);
    let ring = ShmRing::create_file(&path, RING_BYTES).expect("create_file");
    let mut child = spawn_child(&format!("file:{path}"), count);
    // The child has opened the file once it claims the role; removing the path early is
    // fine then, but simplest is to remove it at the end, even on failure.
    struct Unlink(String);
    impl Drop for Unlink {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    let _unlink = Unlink(path);
    consume_and_verify(&ring, &mut child, count);
}

/// A ring in a memfd, and a producer child that inherits it.
fn memfd_ring_and_child(count: u64) -> (ShmRing, Child) {
    let ring = ShmRing::create_memfd("fastlane-ring-test", RING_BYTES).expect("create_memfd");
    // A duplicate without FD_CLOEXEC for the child to inherit; closed here once it is spawned.
    let fd = ring.as_fd().try_clone_to_owned().expect("dup");
    // SAFETY: F_SETFD on a descriptor we own; no memory is passed.
    let rc = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, 0) };
    assert_eq!(rc, 0, "clear FD_CLOEXEC");
    let child = spawn_child(&format!("fd:{}", fd.as_raw_fd()), count);
    drop(fd);
    (ring, child)
}

#[test]
fn ten_million_records_over_an_inherited_memfd() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let count = record_count();
    let (ring, mut child) = memfd_ring_and_child(count);
    consume_and_verify(&ring, &mut child, count);
}

/// The producer process goes away (here: it stops after 1000 records and exits); the consumer
/// gets `Timeout` from its deadline, not a hang.
#[test]
fn a_gone_producer_is_a_timeout_not_a_hang() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (ring, mut child) = memfd_ring_and_child(1000);
    let mut rx = ring.consumer().expect("claim consumer");
    let start = Instant::now();
    let mut seen = 0;
    loop {
        assert!(start.elapsed() < RUN_TIMEOUT, "consumer hung");
        match rx.wait_batch(256, Some(Instant::now() + Duration::from_millis(200))) {
            Ok(mut batch) => {
                while batch.next_record().expect("next_record").is_some() {
                    seen += 1;
                }
                batch.release();
            }
            Err(ShmError::Timeout) if child.try_wait().unwrap().is_some() => break,
            Err(ShmError::Timeout) => {}
            Err(e) => panic!("wait_batch: {e:?}"),
        }
    }
    assert_eq!(seen, 1000);
    assert!(reap(&mut child, PEER_TIMEOUT).success());
    let waited = Instant::now();
    let deadline = Some(waited + Duration::from_millis(50));
    assert!(matches!(rx.wait_batch(1, deadline), Err(ShmError::Timeout)));
    assert!(waited.elapsed() < Duration::from_secs(5));
}
