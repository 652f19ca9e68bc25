//! `fastlane kv serve|bench` end to end.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvswap::client::KvClient;

fn fastlane() -> Command {
    Command::new(env!("CARGO_BIN_EXE_fastlane"))
}

#[test]
fn bench_prints_ratios_and_writes_histograms() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let hlog = dir.path().join("swapin.hlog");
    let out = fastlane()
        .args(["kv", "bench", "--bytes", "8M", "--rounds", "1", "--samples", "2"])
        .arg("--file")
        .arg(dir.path().join("bench.dat"))
        .arg("--hlog")
        .arg(&hlog)
        .output()
        .unwrap();
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
