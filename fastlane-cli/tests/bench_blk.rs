//! End-to-end tests of `fastlane bench blk`: the built binary against `fastlane serve` (a small
//! RAM disk on a temporary socket), the JSON it prints, the ratio table of `--compare`, and the
//! errors a user sees when there is no backend.

use std::os::unix::fs::FileTypeExt as _;
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

mod common;

use common::cli::fastlane;

/// `fastlane serve` on `socket`; SIGTERM (then SIGKILL) when dropped.
struct Serve(Child);

impl Serve {
    fn start(socket: &Path, backend: &str, extra: &[&str]) -> Serve {
        let child = common::cli::command()
            .args(["serve", "--socket", socket.to_str().unwrap(), "--backend", backend])
            .args(["--queues", "1"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn fastlane serve");
        let serve = Serve(child);
        let t = Instant::now();
        while !std::fs::metadata(socket).is_ok_and(|m| m.file_type().is_socket()) {
            assert!(t.elapsed() < Duration::from_secs(10), "serve did not create its socket");
            std::thread::sleep(Duration::from_millis(20));
        }
        serve
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        // SAFETY:
        // - kill(2) on our own child's pid; it has not been reaped yet (we wait below), so the
        //   pid cannot have been reused.
        unsafe { libc::kill(self.0.id() as libc::pid_t, libc::SIGTERM) };
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(5) {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn u(v: &Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("{key} missing or not an integer in {v}"))
}

#[test]
fn measures_fastlane_serve_and_reports_sane_json() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("blk.sock");
    let hlog = dir.path().join("blk.hlog");
    let serve = Serve::start(&socket, "mem:16M", &[]);
    let out = fastlane(&[
        "bench",
        "blk",
        "--socket",
        socket.to_str().unwrap(),
        "--seconds",
        "0.2",
        "--json",
        "--hlog",
        hlog.to_str().unwrap(),
    ]);
    drop(serve);
    assert!(out.status.success(), "bench blk failed: {}", String::from_utf8_lossy(&out.stderr));
    let report: Value = serde_json::from_slice(&out.stdout).expect("stdout is JSON");
    assert_eq!(u(&report, "capacity_bytes"), 16 << 20);
    assert_eq!(u(&report, "size_bytes"), 4096);
    let cases = report["cases"].as_array().expect("cases");
    let names: Vec<&str> = cases.iter().map(|c| c["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["qd1_randread", "qd1_randwrite", "qd32_randread", "qd32_randwrite"]);
    for c in cases {
        let name = c["name"].as_str().unwrap();
        let lat = &c["latency"];
        let requests = u(c, "requests");
        assert!(requests > 0, "{name}: no requests");
        assert_eq!(u(lat, "count"), requests, "{name}: one latency per request");
        assert!(c["iops"].as_f64().unwrap() > 0.0, "{name}: IOPS");
        let (p50, p99, max) = (u(lat, "p50_ns"), u(lat, "p99_ns"), u(lat, "max_ns"));
        assert!(0 < p50 && p50 <= p99 && p99 <= max, "{name}: P50 {p50} P99 {p99} max {max}");
        assert!(max < 5_000_000_000, "{name}: max {max} ns");
        let client = u(c, "client_ns_per_request_p50");
        assert!(0 < client && client <= p50, "{name}: client {client} ns of P50 {p50} ns");
        let kicks = c["kicks_per_request"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&kicks), "{name}: {kicks} kicks per request");
    }
    // The per-case histograms are in the log, one tag per case.
    let file = fastlane_hist::read_hlog(&hlog).unwrap();
    for name in names {
        let h = file.merged_for_tag(Some(name)).unwrap_or_else(|| panic!("no {name} in hlog"));
        assert!(!h.is_empty());
    }

    // --compare of a report with itself: every ratio is 1.00.
    let json = dir.path().join("a.json");
    std::fs::write(&json, &out.stdout).unwrap();
    let cmp = fastlane(&[
        "bench",
        "blk",
        "--compare",
        json.to_str().unwrap(),
        json.to_str().unwrap(),
        "--labels",
        "base,new",
    ]);
    assert!(cmp.status.success(), "{}", String::from_utf8_lossy(&cmp.stderr));
    let table = String::from_utf8(cmp.stdout).unwrap();
    let rows: Vec<&str> = table.lines().filter(|l| l.starts_with("qd")).collect();
    assert_eq!(rows.len(), 2 + 2 + 3 + 3, "{table}");
    assert!(rows.iter().all(|r| r.contains(" 1.00 ")), "{table}");
}

#[test]
fn missing_socket_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nobody.sock");
    let out = fastlane(&["bench", "blk", "--socket", socket.to_str().unwrap(), "--seconds", "0.2"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no vhost-user socket at") && err.contains("nobody.sock"),
        "stderr: {err}"
    );

    // A regular file where the socket should be.
    let file = dir.path().join("plain");
    std::fs::write(&file, b"x").unwrap();
    let out = fastlane(&["bench", "blk", "--socket", file.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("is not a Unix socket"));

    // A socket file nobody listens on (a backend that died).
    let stale = dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    let out = fastlane(&["bench", "blk", "--socket", stale.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot connect to the vhost-user-blk backend"), "stderr: {err}");
}

#[test]
fn read_only_export_is_refused_before_writing() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("ro.sock");
    let serve = Serve::start(&socket, "mem:4M", &["--readonly"]);
    let sock = socket.to_str().unwrap();
    let out = fastlane(&["bench", "blk", "--socket", sock, "--seconds", "0.1"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("read-only"), "stderr: {err}");
    // Reads alone run.
    let args = ["bench", "blk", "--socket", sock, "--seconds", "0.1", "--pattern", "randread"];
    let out = fastlane(&[&args[..], &["--qd", "1", "--json"]].concat());
    drop(serve);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["cases"].as_array().unwrap().len(), 1);
}
