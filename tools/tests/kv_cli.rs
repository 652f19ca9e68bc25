//! `fastlane kv serve|bench` end to end.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvswap::client::KvClient;

fn fastlane() -> Command {
    Command::new(env!("CARGO_BIN_EXE_fastlane"))
}

/// `fastlane kv bench` on 8 MiB, one round, two swap-in samples, its file and `swapin.hlog`
/// in `dir`.
fn small_bench(dir: &std::path::Path, extra: &[&str]) -> std::process::Output {
    fastlane()
        .args(["kv", "bench", "--bytes", "8M", "--rounds", "1", "--samples", "2"])
        .args(extra)
        .arg("--file")
        .arg(dir.join("bench.dat"))
        .arg("--hlog")
        .arg(dir.join("swapin.hlog"))
        .output()
        .unwrap()
}

#[test]
fn bench_prints_ratios_and_writes_histograms() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let hlog = dir.path().join("swapin.hlog");
    let out = small_bench(dir.path(), &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}\n{}", stdout, String::from_utf8_lossy(&out.stderr));
    for case in [
        "host swap-out vs memcpy",
        "host swap-in vs memcpy",
        "nvme swap-out vs O_DIRECT pwrite",
        "nvme swap-in vs O_DIRECT pread",
    ] {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(case))
            .unwrap_or_else(|| panic!("no {case} row:\n{stdout}"));
        let ratio: f64 = line.split_whitespace().last().unwrap().parse().unwrap();
        assert!(ratio > 0.0, "{line}");
    }
    let h = fastlane_hist::read_hlog(&hlog).unwrap();
    let tags = h.tags();
    assert!(tags.contains(&Some("swapin-host")) && tags.contains(&Some("swapin-nvme")), "{tags:?}");
    assert!(!dir.path().join("bench.dat").exists(), "bench file left behind");
}

#[test]
fn bench_json_has_every_number_of_the_table() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let hlog = dir.path().join("swapin.hlog");
    let out = small_bench(dir.path(), &["--json"]);
    let (stdout, stderr) =
        (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap_or_else(|e| {
        panic!("stdout is not one JSON object ({e}):\n{stdout}");
    });
    let u = |v: &serde_json::Value, k: &str| {
        v[k].as_u64().unwrap_or_else(|| panic!("{k} missing or not an integer in {v}"))
    };
    let f = |v: &serde_json::Value, k: &str| {
        v[k].as_f64().unwrap_or_else(|| panic!("{k} missing or not a number in {v}"))
    };
    let bytes = u(&v, "bytes");
    assert_eq!(bytes, 8 << 20);
    assert_eq!(u(&v, "blocks") * u(&v, "block_bytes"), bytes);
    assert_eq!(v["checksum"], "fast");
    assert_eq!(v["hlog"].as_str(), hlog.to_str());
    let rows = v["bandwidth"].as_array().expect("bandwidth rows");
    let cases: Vec<&str> = rows.iter().map(|r| r["case"].as_str().unwrap()).collect();
    assert_eq!(
        cases,
        [
            "host swap-out vs memcpy",
            "host swap-in vs memcpy",
            "nvme swap-out vs O_DIRECT pwrite",
            "nvme swap-in vs O_DIRECT pread",
        ]
    );
    for (r, (tier, dir)) in rows.iter().zip([
        ("host", "swap-out"),
        ("host", "swap-in"),
        ("nvme", "swap-out"),
        ("nvme", "swap-in"),
    ]) {
        assert_eq!((r["tier"].as_str(), r["direction"].as_str()), (Some(tier), Some(dir)), "{r}");
        assert_eq!(u(r, "bytes"), bytes);
        let (peer_ns, ours_ns) = (u(r, "peer_ns"), u(r, "ours_ns"));
        assert!(peer_ns > 0 && ours_ns > 0, "{r}");
        let ours_bps = f(r, "ours_bytes_per_s");
        assert!((ours_bps / (bytes as f64 * 1e9 / ours_ns as f64) - 1.0).abs() < 1e-6, "{r}");
        assert!(f(r, "peer_bytes_per_s") > 0.0, "{r}");
        let ratio = f(r, "ours_vs_peer");
        assert!((ratio / (peer_ns as f64 / ours_ns as f64) - 1.0).abs() < 1e-6, "{r}");
    }
    let swap_in = v["swap_in"].as_array().expect("swap_in");
    let tiers: Vec<&str> = swap_in.iter().map(|s| s["tier"].as_str().unwrap()).collect();
    assert_eq!(tiers, ["host", "nvme"]);
    for s in swap_in {
        assert_eq!(u(s, "bytes"), bytes);
        let l = &s["latency"];
        assert_eq!(u(l, "count"), 2, "{s}");
        let (p50, p99, max) = (u(l, "p50_ns"), u(l, "p99_ns"), u(l, "max_ns"));
        assert!(0 < p50 && p50 <= p99 && p99 <= max, "{s}");
        assert!(f(s, "bytes_per_s_at_p50") > 0.0, "{s}");
    }
    // The per-tier latency lines, printed on stdout without --json, are on stderr.
    assert!(stderr.contains("host swap-in of 8388608 bytes: p50"), "{stderr}");
    let h = fastlane_hist::read_hlog(&hlog).unwrap();
    assert!(h.tags().contains(&Some("swapin-nvme")), "{:?}", h.tags());
    assert!(!dir.path().join("bench.dat").exists(), "bench file left behind");
}

#[test]
fn serve_round_trip_then_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("kv.sock");
    let mut child = fastlane()
        .args([
            "kv",
            "serve",
            "--device-blocks",
            "8",
            "--host-bytes",
            "16M",
            "--tokens-per-block",
            "1",
        ])
        .arg("--socket")
        .arg(&sock)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut c = loop {
        match KvClient::connect(&sock) {
            Ok(c) => break c,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => panic!("server did not come up: {e}"),
        }
    };
    assert_eq!(c.block_bytes(), 128 * 1024, "1 token of Llama-3.1-8B");
    let b = c.alloc(1, 2).unwrap();
    c.write_block(b[0], &[7u8; 4096]);
    let t = c.prepare_store(1, &b).unwrap();
    c.complete(t, Duration::from_secs(10)).unwrap();
    c.free(1, &b).unwrap();
    let b2 = c.alloc(1, 2).unwrap();
    let t = c.prepare_load(1, &b2).unwrap();
    c.complete(t, Duration::from_secs(10)).unwrap();
    let mut back = [0u8; 4096];
    c.read_block(b2[0], &mut back);
    assert_eq!(back, [7u8; 4096]);
    drop(c);
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) }, 0);
    let status = child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    assert!(!sock.exists(), "socket left behind");
}

/// `fastlane kv serve --allow-uid` without this process's uid: the client gets the refusal
/// message, the server logs it and keeps running until SIGTERM.
#[test]
fn serve_refuses_a_uid_off_the_allow_list() {
    use kvswap::client::KvClientError;
    use kvswap::proto::ErrorCode;
    use std::io::Read;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    let other = me.wrapping_add(4242);
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("kv.sock");
    let mut child = fastlane()
        .args(["kv", "serve", "--device-blocks", "8", "--host-bytes", "16M"])
        .args(["--tokens-per-block", "1", "--allow-uid", &format!("{other},{}", other + 1)])
        .arg("--socket")
        .arg(&sock)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let detail = loop {
        match KvClient::connect(&sock) {
            Err(KvClientError::Server { code: ErrorCode::PeerRefused, detail }) => break detail,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            other => panic!("expected a refusal, got {other:?}"),
        }
    };
    assert!(detail.contains(&format!("uid {me} ")) && detail.contains("not allowed"), "{detail}");
    // Still up: a second peer is refused the same way.
    assert!(matches!(
        KvClient::connect(&sock),
        Err(KvClientError::Server { code: ErrorCode::PeerRefused, .. })
    ));
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) }, 0);
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    assert!(status.success(), "{status:?}\n{stderr}");
    assert!(
        stderr.contains("refused a connection") && stderr.contains(&format!("uid {me} ")),
        "{stderr}"
    );
    assert!(stderr.contains("(2 refused)"), "{stderr}");
}
