//! Crash consistency with a real process kill: a child appends under load and records every
//! acknowledged durable seq in a side file; it is SIGKILLed at random points, 50 times; after
//! each kill the journal reopens, every acknowledged seq is present and intact, and recovery
//! returns only whole, consecutive records.

use std::fs::OpenOptions;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fastlane_block::uring::{UringDevice, UringOptions};
use fastlane_journal::{scan, Durability, Journal, JournalConfig, JournalError, WriterIo};

const CHILD_ENV: &str = "FASTLANE_JOURNAL_CRASH_CHILD";
const KILLS: usize = 50;
/// Journal data after which the test starts a new journal: recovery (BLAKE3 per frame, slow in
/// a debug build) must stay well inside the shortest kill delay.
const FRESH_AFTER_BYTES: u64 = 512 << 10;

fn payload_for(seq: u64) -> Vec<u8> {
    let len = 8 + (seq.wrapping_mul(13) % 120) as usize;
    (0..len).map(|i| (seq as u8).wrapping_mul(17).wrapping_add(i as u8)).collect()
}

fn config(path: &Path, io: WriterIo) -> JournalConfig {
    let dev = UringDevice::open(path, UringOptions::default()).unwrap();
    let mut c = JournalConfig::new(Arc::new(dev), Durability::Local);
    c.writer_io = io;
    c.ring_bytes = 256 << 10;
    c.max_record_bytes = 512;
    c.max_batch_bytes = 64 << 10;
    c
}

/// The child: append forever, recording each acknowledged durable seq. Does nothing unless
/// started by `acked_records_survive_sigkill`.
#[test]
fn crash_child() {
    let Ok(arg) = std::env::var(CHILD_ENV) else { return };
    let (mode, paths) = arg.split_once('|').expect("mode|journal|side");
    let (journal_path, side_path) = paths.split_once('|').expect("journal|side");
    let io = match mode {
        "flusher" => WriterIo::Flusher,
        "dsync" => WriterIo::Dsync,
        _ => WriterIo::Pipelined,
    };
    let j = Journal::open_or_create(config(Path::new(journal_path), io)).expect("open");
    let mut tx = j.producer().expect("producer");
    let mut side = OpenOptions::new().append(true).create(true).open(side_path).unwrap();
    let mut burst = 1u64;
    loop {
        let mut last = 0;
        for _ in 0..burst {
            let seq = tx.next_seq();
            last = tx.append_blocking(&payload_for(seq), Duration::from_secs(10)).expect("append");
            assert_eq!(last, seq);
        }
        match tx.wait_durable(last, Duration::from_secs(10)) {
            Ok(()) => {}
            Err(JournalError::Timeout { .. }) => continue,
            Err(e) => panic!("{e}"),
        }
        // One write(2) per acknowledgement: the kernel keeps it even when we are killed.
        side.write_all(format!("{last}\n").as_bytes()).unwrap();
        burst = burst % 64 + 1;
    }
}

fn max_acked(side: &Path) -> u64 {
    let text = std::fs::read_to_string(side).unwrap_or_default();
    text.lines().filter_map(|l| l.trim().parse::<u64>().ok()).max().unwrap_or(0)
}

#[test]
fn acked_records_survive_sigkill() {
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let journal = dir.path().join("journal");
    let side = dir.path().join("acked");
    std::fs::File::create(&journal).unwrap().set_len(32 << 20).unwrap();
    let seed = started.elapsed().as_nanos() as u64 ^ u64::from(std::process::id());
    let mut x = seed | 1;
    let mut rng = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let exe = std::env::current_exe().unwrap();
    let mut recovered_total = 0;
    let mut acked_rounds = 0;
    let mut fresh_starts = 0;
    for round in 0..KILLS {
        let mode = ["pipelined", "flusher", "dsync"][round % 3];
        let mut child = Command::new(&exe)
            .args(["crash_child", "--exact", "--nocapture", "--test-threads=1"])
            // Every writer mode in turn (each recovering what the one before left): the
            // pipelined writer, the flusher threads, the FUA writes.
            .env(CHILD_ENV, format!("{mode}|{}|{}", journal.display(), side.display()))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let before = max_acked(&side);
        // Kill at a random point: during start-up, recovery, or appends.
        std::thread::sleep(Duration::from_millis(20 + rng() % 380));
        child.kill().unwrap(); // SIGKILL
        let status = child.wait().unwrap();
        assert!(!status.success(), "round {round}: the child must have been killed, not exit");
        let acked = max_acked(&side);
        if acked > before {
            acked_rounds += 1;
        }

        // Reopen (recovery truncates a torn tail) and check every record.
        let j = Journal::open(config(&journal, WriterIo::default()))
            .unwrap_or_else(|e| panic!("round {round} (seed {seed:#x}): reopen failed: {e}"));
        let rec = j.recovery();
        assert!(
            rec.last_seq >= acked,
            "round {round} (seed {seed:#x}): acked {acked}, recovered only to {}",
            rec.last_seq
        );
        j.close().unwrap();
        let mut file = std::fs::File::open(&journal).unwrap();
        let mut expect = 1u64;
        let s = scan(&mut file, &mut |v| {
            assert_eq!(v.header.seq, expect, "round {round}: records must be consecutive");
            assert_eq!(v.payload, payload_for(v.header.seq), "round {round}: torn record");
            expect += 1;
            true
        })
        .unwrap();
        assert_eq!(s.last_seq, rec.last_seq, "round {round}: reopen changed the journal");
        recovered_total = s.last_seq;
        if s.end > FRESH_AFTER_BYTES {
            // The pipelined writer acknowledges fast enough to fill the device within a few
            // rounds, and a long journal makes the child's recovery outlast the kill delay:
            // start over with an empty file (and an empty side file).
            std::fs::remove_file(&side).unwrap();
            std::fs::remove_file(&journal).unwrap();
            std::fs::File::create(&journal).unwrap().set_len(32 << 20).unwrap();
            recovered_total = 0;
            fresh_starts += 1;
        }
    }
    assert!(
        acked_rounds >= KILLS / 5,
        "children rarely got anything acknowledged ({acked_rounds} of {KILLS} rounds, {fresh_starts} fresh journals)"
    );
    assert!(recovered_total >= max_acked(&side));
    eprintln!(
        "{KILLS} kills, {recovered_total} records, {acked_rounds} rounds with new acks, \
         {fresh_starts} fresh journals, {:?}",
        started.elapsed()
    );
}
