//! A second process appends through the shared ring while the first reads the durable seq;
//! a third continues the numbering after it.

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fastlane_block::uring::{UringDevice, UringOptions};
use fastlane_journal::{scan, Durability, Journal, JournalConfig, JournalProducer};

const CHILD_ENV: &str = "FASTLANE_JOURNAL_PRODUCER_CHILD";
const PER_CHILD: u64 = 20_000;

fn payload_for(seq: u64) -> Vec<u8> {
    let len = (seq % 100) as usize;
    (0..len).map(|i| (seq as u8) ^ (i as u8)).collect()
}

/// The producer process: attach by path, append, wait for the last seq, print the range.
#[test]
fn producer_child() {
    let Ok(shm) = std::env::var(CHILD_ENV) else { return };
    let mut tx = JournalProducer::attach(&shm).expect("attach");
    let first = tx.next_seq();
    let mut last = 0;
    for _ in 0..PER_CHILD {
        let seq = tx.next_seq();
        last = tx.append_blocking(&payload_for(seq), Duration::from_secs(10)).expect("append");
    }
    tx.wait_durable(last, Duration::from_secs(30)).expect("durable");
    println!("RANGE {first} {last}");
}

fn run_child(exe: &Path, shm: &Path) -> std::process::Child {
    Command::new(exe)
        .args(["producer_child", "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, shm)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

fn range(out: &[u8]) -> (u64, u64) {
    let text = String::from_utf8_lossy(out);
    // libtest may print "test producer_child ... " on the same line first.
    let at = text.find("RANGE ").expect("child printed its range");
    let line = text[at..].lines().next().unwrap();
    let mut it = line.split_whitespace().skip(1).map(|x| x.parse::<u64>().unwrap());
    (it.next().unwrap(), it.next().unwrap())
}

#[test]
fn second_process_appends_while_first_reads_durable_seq() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("journal");
    std::fs::File::create(&path).unwrap().set_len(16 << 20).unwrap();
    let dev = UringDevice::open(&path, UringOptions::default()).unwrap();
    let mut c = JournalConfig::new(Arc::new(dev), Durability::Local);
    c.shm_path = Some(dir.path().join("ring"));
    c.ring_bytes = 256 << 10;
    let j = Journal::create(c).unwrap();
    let shm = j.shm_path().unwrap().to_path_buf();
    let exe = std::env::current_exe().unwrap();

    let mut expect_first = 1;
    for _ in 0..2 {
        let child = run_child(&exe, &shm);
        // Watch the durable seq advance while the other process appends.
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut seen = Vec::new();
        let target = expect_first + PER_CHILD - 1;
        let mut last_seen = j.durable_seq();
        while last_seen < target {
            assert!(Instant::now() < deadline, "durable seq stuck at {last_seen}");
            let d = j.durable_seq();
            assert!(d >= last_seen, "durable seq went backwards");
            if d != last_seen {
                seen.push(d);
            }
            last_seen = d;
            std::thread::sleep(Duration::from_micros(200));
        }
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success());
        let (first, last) = range(&out.stdout);
        assert_eq!((first, last), (expect_first, target));
        assert!(seen.len() > 1, "the durable seq should advance in steps, saw {seen:?}");
        j.wait_durable(last, Duration::from_secs(1)).unwrap();
        expect_first = last + 1;
    }
    j.close().unwrap();
    let mut file = std::fs::File::open(&path).unwrap();
    let mut n = 0u64;
    scan(&mut file, &mut |v| {
        n += 1;
        assert_eq!(v.header.seq, n);
        assert_eq!(v.payload, payload_for(n));
        true
    })
    .unwrap();
    assert_eq!(n, 2 * PER_CHILD);
}
