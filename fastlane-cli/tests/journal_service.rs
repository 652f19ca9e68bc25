//! `fastlane journal serve` and `fastlane journal append --service` as separate processes:
//! producers SIGKILLed while they append, the service SIGKILLed under load and restarted, every
//! acknowledged record found afterwards under its producer; readiness on `NOTIFY_SOCKET`, the
//! metrics on a real scrape, SIGTERM.

mod common;

use common::daemon::Notify;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead as _, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::http::{curl, metric_in, KillOnDrop};

/// A running `journal serve`, its log in a file; killed on drop.
struct Svc {
    child: KillOnDrop,
    log: std::path::PathBuf,
}

impl Svc {
    fn start(dir: &Path, notify: Option<&Path>, extra: &[&str]) -> Svc {
        static STARTS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = STARTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let log = dir.with_extension(format!("log{n}"));
        let mut cmd = common::cli::command();
        cmd.args(["journal", "serve", "--dir"])
            .arg(dir)
            .args(["--segment-bytes", "4M", "--status-every", "0"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        if let Some(n) = notify {
            cmd.env("NOTIFY_SOCKET", n);
        }
        let child = KillOnDrop(cmd.spawn().expect("start fastlane journal serve"));
        // Ready when it says where producers attach (a socket file left by a killed service
        // may already be there).
        let t0 = Instant::now();
        while !read(&log).contains("producers attach at") {
            assert!(t0.elapsed() < Duration::from_secs(20), "not ready: {}", read(&log));
            std::thread::sleep(Duration::from_millis(10));
        }
        Svc { child, log }
    }

    fn kill9(&mut self) {
        self.child.0.kill().unwrap();
        self.child.0.wait().unwrap();
    }
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
}

/// A producer process: `append --service DIR --generate N --ack-every K`; the seqs it was
/// told are durable, collected as it prints them.
struct Producer {
    child: Child,
    acked: Arc<Mutex<Vec<u64>>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Producer {
    fn start(dir: &Path, n: u64, ack_every: u64) -> Producer {
        let mut child = common::cli::command()
            .args(["journal", "append", "--service"])
            .arg(dir)
            .args(["--generate", &n.to_string(), "--record-bytes", "100"])
            .args(["--ack-every", &ack_every.to_string()])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let acked = Arc::new(Mutex::new(Vec::new()));
        let a = Arc::clone(&acked);
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if let Some(s) = line.strip_prefix("ACK ") {
                    a.lock().unwrap().push(s.parse().unwrap());
                }
            }
        });
        Producer { child, acked, reader: Some(reader) }
    }

    fn acks(&self) -> usize {
        self.acked.lock().unwrap().len()
    }

    fn wait_acks(&self, n: usize, what: &str) {
        let t0 = Instant::now();
        while self.acks() < n {
            assert!(t0.elapsed() < Duration::from_secs(60), "{what}: {} acks of {n}", self.acks());
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Waits for the process; its last acknowledged seq (0: none) and whether it exited 0.
    fn finish(mut self) -> (u64, bool) {
        let st = self.child.wait().unwrap();
        if let Some(r) = self.reader.take() {
            r.join().unwrap();
        }
        let last = self.acked.lock().unwrap().last().copied().unwrap_or(0);
        (last, st.success())
    }
}

/// Every record of the directory, from `dump --raw`: (producer id, payload) by global seq.
fn dump_raw(dir: &Path) -> BTreeMap<u64, (u32, Vec<u8>)> {
    let out = common::cli::command().args(["journal", "dump", "--raw"]).arg(dir).output().unwrap();
    assert!(out.status.success(), "dump: {}", String::from_utf8_lossy(&out.stderr));
    let b = out.stdout;
    let mut at = 0;
    let mut recs = BTreeMap::new();
    while at < b.len() {
        let seq = u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
        let id = u32::from_le_bytes(b[at + 8..at + 12].try_into().unwrap());
        let len = u32::from_le_bytes(b[at + 12..at + 16].try_into().unwrap()) as usize;
        recs.insert(seq, (id, b[at + 16..at + 16 + len].to_vec()));
        at += 16 + len;
    }
    recs
}

/// The producer id the service gave each pid (from `producers.log`).
fn ids_by_pid(dir: &Path) -> BTreeMap<u32, BTreeSet<u32>> {
    let mut m: BTreeMap<u32, BTreeSet<u32>> = BTreeMap::new();
    for line in read(&dir.join("producers.log")).lines() {
        let id: u32 = line.split_whitespace().next().unwrap().parse().unwrap();
        let pid: u32 =
            line.split_whitespace().find_map(|w| w.strip_prefix("pid=")).unwrap().parse().unwrap();
        m.entry(pid).or_default().insert(id);
    }
    m
}

/// Checks that producer process `pid` has, under its id, records "record 1" … "record
/// last_acked" (at least), in order, each once.
fn check_acked(recs: &BTreeMap<u64, (u32, Vec<u8>)>, ids: &BTreeSet<u32>, last_acked: u64) {
    let mine: Vec<&[u8]> =
        recs.values().filter(|(id, _)| ids.contains(id)).map(|(_, p)| p.as_slice()).collect();
    assert!(
        mine.len() as u64 >= last_acked,
        "producer {ids:?}: {} records found, {last_acked} acknowledged",
        mine.len()
    );
    for (i, p) in mine.iter().enumerate() {
        let want = format!("record {}", i + 1);
        assert!(p.starts_with(want.as_bytes()), "producer {ids:?} record {i}: {:?}", &p[..20]);
    }
}

fn verify_ok(dir: &Path) -> String {
    let out = common::cli::command().args(["journal", "verify"]).arg(dir).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success() && text.contains("OK"), "verify: {text}");
    text
}

/// Three producer processes; one SIGKILLed mid-run, then the service SIGKILLed under load (the
/// other two see it go: `append` fails), restarted, and a fresh producer appends. Every seq a
/// producer printed as acknowledged is in the journal under its id, the chain verifies
/// across the segments, and the global sequence has no gap.
#[test]
fn acknowledged_records_survive_sigkill_of_producers_and_service() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("j");
    let mut svc = Svc::start(&dir, None, &[]);
    let ps: Vec<Producer> = (0..3).map(|_| Producer::start(&dir, 200_000, 500)).collect();
    ps[0].wait_acks(4, "producer 0 before its kill");
    let mut ps = ps;
    let p0 = ps.remove(0);
    let pid0 = p0.child.id();
    let mut p0 = p0;
    p0.child.kill().unwrap();
    let (last0, _) = p0.finish();
    ps[0].wait_acks(8, "producer 1 before the service's kill");
    svc.kill9();
    let mut lasts = vec![(pid0, last0)];
    for p in ps {
        let pid = p.child.id();
        let (last, ok) = p.finish();
        assert!(!ok, "a producer whose service was killed must fail, not hang or succeed");
        lasts.push((pid, last));
    }
    let log = read(&svc.log);
    drop(svc);

    // Restart: recovery, then a new producer continues the global sequence.
    let svc = Svc::start(&dir, None, &[]);
    let fresh = Producer::start(&dir, 1000, 1000);
    let fresh_pid = fresh.child.id();
    let (last_fresh, ok) = fresh.finish();
    assert!(ok && last_fresh == 1000, "producer after restart: {}", read(&svc.log));
    lasts.push((fresh_pid, last_fresh));
    drop(svc);

    let recs = dump_raw(&dir);
    let seqs: Vec<u64> = recs.keys().copied().collect();
    assert_eq!(seqs, (1..=seqs.len() as u64).collect::<Vec<_>>(), "a gap in the global seqs");
    let ids = ids_by_pid(&dir);
    for (pid, last) in &lasts {
        assert!(*last > 0, "producer {pid} never got an ack (service log: {log})");
        check_acked(&recs, &ids[pid], *last);
    }
    let v = verify_ok(&dir);
    assert!(v.contains("segments"), "{v}");
}

/// `READY=1` on `NOTIFY_SOCKET` once producers can attach; the metrics a real scrape reads
/// (each required, none read as 0 when absent); SIGTERM drains, says `STOPPING=1`, exits 0.
#[test]
fn notify_metrics_and_sigterm() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("j");
    let notify_path = tmp.path().join("notify");
    let notify = Notify::bind(&notify_path);
    let mut svc = Svc::start(&dir, Some(&notify_path), &["--metrics", "127.0.0.1:0"]);
    let ready = notify.next();
    assert!(ready.contains("READY=1"), "{ready}");

    let (last, ok) = Producer::start(&dir, 3000, 1000).finish();
    assert!(ok && last == 3000);
    let t0 = Instant::now();
    let url = loop {
        let log = read(&svc.log);
        if let Some(at) = log.find("metrics on http://") {
            let rest = &log[at + "metrics on ".len()..];
            break rest.split_whitespace().next().unwrap().to_string();
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "no metrics address: {log}");
        std::thread::sleep(Duration::from_millis(20));
    };
    let (status, text) = curl(&[&url]);
    assert_eq!(status, 200);
    let m = |name: &str| {
        metric_in(&text, name).unwrap_or_else(|| panic!("no {name} in the scrape:\n{text}"))
    };
    assert_eq!(m("fastlane_journal_records_total"), 3000.0);
    assert_eq!(m("fastlane_journal_durable_seq"), 3000.0);
    assert_eq!(m("fastlane_journal_attaches_total"), 1.0);
    assert_eq!(m("fastlane_journal_producer_faults_total"), 0.0);
    assert!(m("fastlane_journal_flushes_total") >= 1.0);
    assert!(m("fastlane_journal_producer_records_total{") == 3000.0);
    assert!(m("fastlane_journal_commit_latency_seconds_count") >= 1.0);
    // No roll here, so none waited; the spare's pace is shown (0 once it is written).
    assert_eq!(m("fastlane_journal_spare_waits_total"), 0.0);
    assert_eq!(m("fastlane_journal_spare_wait_milliseconds_total"), 0.0);
    assert_eq!(m("fastlane_journal_roll_microseconds_total"), 0.0);
    assert_eq!(m("fastlane_journal_segments_removed_total"), 0.0);
    assert_eq!(m("fastlane_journal_retention_failures_total"), 0.0);
    assert!(m("fastlane_journal_spare_pace_bytes_per_second") >= 0.0);

    let st = Command::new("kill").args(["-TERM", &svc.child.0.id().to_string()]).status();
    assert!(st.unwrap().success());
    notify.expect("STOPPING=1", "journal serve after SIGTERM");
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = svc.child.0.try_wait().unwrap() {
            break s;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "no exit after SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{}", read(&svc.log));
    assert!(read(&svc.log).contains("journal service stopped: durable seq 3000"));
    verify_ok(&dir);
}

/// Without a service, `append --service` fails at once and says why.
#[test]
fn append_without_a_service_says_so() {
    let tmp = tempfile::tempdir().unwrap();
    let out = common::cli::command()
        .args(["journal", "append", "--service"])
        .arg(tmp.path())
        .arg("x")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("attach to the journal service"), "{err}");
}

/// A roll that finds the next segment's file not ready says so in the log, with what to
/// change: 4 MiB segments filled at full speed while the spare is held to 1 MiB/s
/// (`--spare-adapt false`); every record is still acknowledged and the directory verifies.
#[test]
fn a_roll_that_waits_for_the_spare_is_logged() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("j");
    let svc = Svc::start(&dir, None, &["--spare-rate", "1M", "--spare-adapt", "false"]);
    let (last, ok) = Producer::start(&dir, 40_000, 10_000).finish();
    assert!(ok && last == 40_000, "producer: ok {ok}, last ack {last}");
    let t0 = Instant::now();
    while !read(&svc.log).contains("waited") {
        assert!(t0.elapsed() < Duration::from_secs(20), "no spare wait logged: {}", read(&svc.log));
        std::thread::sleep(Duration::from_millis(50));
    }
    let log = read(&svc.log);
    assert!(log.contains("for the next segment's file (1 such rolls since start)"), "{log}");
    assert!(log.contains("--spare-adapt true"), "the advice names the flag: {log}");
    drop(svc);
    assert!(verify_ok(&dir).contains("records 40000"));
}
