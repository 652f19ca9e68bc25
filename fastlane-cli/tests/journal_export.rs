//! `fastlane journal serve --export`: producer processes append, the service ships every
//! durable record to a three-node NATS JetStream cluster on loopback (Debian's nats-server);
//! the service is SIGKILLed during the export and restarted, then stopped with SIGTERM; the
//! stream holds every journal seq exactly once, in order, with the journal's bytes.

mod common;
#[path = "../../fastlane-journal-export/tests/common/mod.rs"]
mod nats;

use std::collections::BTreeMap;
use std::io::{BufRead as _, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::http::KillOnDrop;

fn serve(dir: &Path, urls: &str, log: &Path) -> KillOnDrop {
    let child = common::cli::command()
        .args(["journal", "serve", "--dir"])
        .arg(dir)
        .args(["--segment-bytes", "4M", "--status-every", "1", "--export", urls])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .expect("start fastlane journal serve");
    let t0 = Instant::now();
    while !std::fs::read_to_string(log).unwrap_or_default().contains("producers attach at") {
        assert!(t0.elapsed() < Duration::from_secs(20), "not ready: {}", read(log));
        std::thread::sleep(Duration::from_millis(10));
    }
    KillOnDrop(child)
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
}

fn producer(dir: &Path, n: u64) -> Child {
    common::cli::command()
        .args(["journal", "append", "--service"])
        .arg(dir)
        .args(["--generate", &n.to_string(), "--record-bytes", "80", "--ack-every", "500"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// Waits until the producer printed `acks` ACK lines (or exited).
fn wait_acks(p: &mut Child, acks: usize) {
    let out = p.stdout.take().unwrap();
    let mut seen = 0;
    for line in BufReader::new(out).lines().map_while(Result::ok) {
        if line.starts_with("ACK ") {
            seen += 1;
            if seen >= acks {
                return;
            }
        }
    }
}

/// The exported seq in a status line ("… exported N (lag L)").
fn exported(line: &str) -> Option<u64> {
    line.split("exported ").nth(1)?.split_whitespace().next()?.parse().ok()
}

/// The journal's records (`dump --raw`): seq → payload.
fn journal(dir: &Path) -> BTreeMap<u64, Vec<u8>> {
    let out = common::cli::command().args(["journal", "dump", "--raw"]).arg(dir).output().unwrap();
    assert!(out.status.success(), "dump: {}", String::from_utf8_lossy(&out.stderr));
    let b = out.stdout;
    let (mut at, mut recs) = (0, BTreeMap::new());
    while at < b.len() {
        let seq = u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
        let len = u32::from_le_bytes(b[at + 12..at + 16].try_into().unwrap()) as usize;
        recs.insert(seq, b[at + 16..at + 16 + len].to_vec());
        at += 16 + len;
    }
    recs
}

#[test]
fn every_durable_record_reaches_the_stream_exactly_once_across_a_sigkill() {
    let _one = nats::one_at_a_time();
    let cluster = nats::NatsCluster::start(3);
    let urls = cluster.url_list();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("j");
    let log1 = tmp.path().join("serve1.log");
    let mut svc = serve(&dir, &urls, &log1);
    let mut a = producer(&dir, 60_000);
    let b = producer(&dir, 60_000);
    wait_acks(&mut a, 6);
    // Killed while records arrive and the export runs (once it has shipped some).
    let t0 = Instant::now();
    while !read(&log1).lines().any(|l| exported(l).is_some_and(|e| e > 0)) {
        assert!(t0.elapsed() < Duration::from_secs(60), "export never started: {}", read(&log1));
        std::thread::sleep(Duration::from_millis(50));
    }
    svc.0.kill().unwrap();
    svc.0.wait().unwrap();
    let _ = a.wait();
    let mut b = b;
    let _ = b.wait();
    drop(svc);

    let log2 = tmp.path().join("serve2.log");
    let mut svc = serve(&dir, &urls, &log2);
    let mut c = producer(&dir, 3000);
    assert!(c.wait().unwrap().success(), "producer after restart: {}", read(&log2));
    // The export catches up (the status line every second says how far it is).
    let t0 = Instant::now();
    loop {
        let log = read(&log2);
        let caught_up = log.lines().rev().find(|l| l.contains("exported")).is_some_and(|l| {
            let num = |key: &str| -> Option<u64> {
                l.split(key).nth(1)?.split_whitespace().next()?.parse().ok()
            };
            num("durable seq ").is_some() && num("durable seq ") == num("exported ")
        });
        if caught_up {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "export did not catch up: {log}");
        std::thread::sleep(Duration::from_millis(200));
    }
    // SIGTERM: the service drains, the export ships what is durable, then it exits.
    let st = Command::new("kill").args(["-TERM", &svc.0.id().to_string()]).status();
    assert!(st.unwrap().success());
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = svc.0.try_wait().unwrap() {
            break s;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "no exit: {}", read(&log2));
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{}", read(&log2));
    let log = read(&log2);
    assert!(log.contains("export stopped"), "{log}");

    let v = common::cli::command().args(["journal", "verify"]).arg(&dir).output().unwrap();
    let v = String::from_utf8_lossy(&v.stdout).into_owned();
    assert!(v.contains("OK"), "verify: {v}");
    let recs = journal(&dir);
    let last = *recs.keys().last().unwrap();
    assert_eq!(recs.len() as u64, last, "the journal has a gap");
    assert!(v.contains(&format!("records {last} ")), "dump and verify disagree: {v}");
    let stored = nats::read_stream(&cluster, "FASTLANE_JOURNAL", Duration::from_secs(60));
    assert_eq!(stored.len() as u64, last, "stream holds {} of {last} records", stored.len());
    for (i, m) in stored.iter().enumerate() {
        let seq = i as u64 + 1;
        assert_eq!(m.journal_seq, seq, "stream message {i} holds journal seq {}", m.journal_seq);
        assert_eq!(m.payload, recs[&seq], "payload of seq {seq}");
    }
}
