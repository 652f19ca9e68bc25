//! `fastlane journal append|verify|dump|bench` end to end.

use std::process::Command;

mod common;

use common::cli::command as fastlane;

fn run_ok(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{cmd:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn append_verify_dump_and_a_flipped_byte() {
    let dir = tempfile::tempdir().unwrap();
    let j = dir.path().join("j");
    let seqs = run_ok(fastlane().args(["journal", "append", "--size", "1M"]).arg(&j).args([
        "buy 100 ACME",
        "sell 50 ACME",
        "cancel 7",
    ]));
    assert_eq!(seqs.lines().collect::<Vec<_>>(), ["1", "2", "3"]);
    let more = run_ok(fastlane().args(["journal", "append"]).arg(&j).arg("fill 9"));
    assert_eq!(more.trim(), "4", "numbering resumes after reopen");

    let v = run_ok(fastlane().args(["journal", "verify"]).arg(&j));
    assert!(v.contains("records 4") && v.contains("OK"), "{v}");
    let head = v.split_whitespace().skip_while(|w| *w != "head").nth(1).unwrap().to_string();
    run_ok(
        fastlane()
            .args(["journal", "verify", "--expect-last-seq", "4", "--expect-head", &head])
            .arg(&j),
    );
    let bad =
        fastlane().args(["journal", "verify", "--expect-last-seq", "5"]).arg(&j).output().unwrap();
    assert!(!bad.status.success());

    let d = run_ok(fastlane().args(["journal", "dump"]).arg(&j));
    assert!(d.contains("\"sell 50 ACME\"") && d.contains("\"fill 9\""), "{d}");

    // Flip one byte inside record 3's payload.
    let mut img = std::fs::read(&j).unwrap();
    let at = img.windows(8).position(|w| w == b"cancel 7").unwrap();
    img[at] ^= 0x01;
    std::fs::write(&j, &img).unwrap();
    let out = fastlane().args(["journal", "verify"]).arg(&j).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("record after seq 2 changed") && err.contains("seq 3"), "{err}");
}

#[test]
fn bench_writes_three_histograms() {
    let dir = tempfile::tempdir().unwrap();
    let hlog = dir.path().join("j.hlog");
    let out = run_ok(
        fastlane()
            .args(["journal", "bench", "--size", "16M", "--records", "20000", "--rate", "2000"])
            .args(["--seconds", "0.3", "--baseline-ops", "20", "--hlog"])
            .arg(&hlog)
            .arg(dir.path().join("bench.journal")),
    );
    assert!(out.contains("throughput:") && out.contains("ack/baseline"), "{out}");
    let text = std::fs::read_to_string(&hlog).unwrap();
    for tag in ["Tag=append,", "Tag=ack,", "Tag=pwrite_fdatasync,"] {
        assert!(text.contains(tag), "{tag} missing from {text}");
    }
}

/// `--json` gives the table's numbers to scripts; `--ack-wait poll` runs the ack run with a
/// writer and a waiter that never sleep in the kernel.
#[test]
fn bench_json_with_polling_waits() {
    let dir = tempfile::tempdir().unwrap();
    let out = run_ok(
        fastlane()
            .args(["journal", "bench", "--size", "16M", "--records", "20000", "--rate", "2000"])
            .args(["--seconds", "0.3", "--baseline-ops", "20", "--ack-wait", "poll", "--json"])
            .arg("--hlog")
            .arg(dir.path().join("j.hlog"))
            .arg(dir.path().join("bench.journal")),
    );
    let v: serde_json::Value = serde_json::from_str(&out).expect("stdout is one JSON object");
    assert_eq!(v["ack_wait"], "poll");
    assert_eq!(v["rate_per_s"], 2000);
    assert_eq!(v["append"]["count"], 20000, "every append of the throughput run is timed");
    assert_eq!(v["ack"]["count"], 600, "every record of the 0.3 s ack run is acknowledged");
    assert_eq!(v["same_load_no_journal"]["count"], 600);
    assert_eq!(v["pwrite_fdatasync"]["count"], 20);
    for h in ["append", "ack", "pwrite_fdatasync", "same_load_no_journal"] {
        let (p50, p99, max) = (&v[h]["p50_ns"], &v[h]["p99_ns"], &v[h]["max_ns"]);
        let (p50, p99, max) = (p50.as_u64().unwrap(), p99.as_u64().unwrap(), max.as_u64().unwrap());
        assert!(p50 > 0 && p50 <= p99 && p99 <= max, "{h}: {p50} {p99} {max}");
    }
    let r = v["ack_over_floor_p99"].as_f64().unwrap();
    let expect =
        v["ack"]["p99_ns"].as_f64().unwrap() / v["pwrite_fdatasync"]["p99_ns"].as_f64().unwrap();
    assert!((r - expect).abs() < 1e-9 * expect.max(1.0), "ratio {r} vs {expect}");
    assert!(v["throughput_records_per_s"].as_f64().unwrap() > 0.0);
}

/// A wait mode the bench does not know is refused before anything runs, naming the choices.
#[test]
fn bench_refuses_an_unknown_ack_wait() {
    let dir = tempfile::tempdir().unwrap();
    let out = fastlane()
        .args(["journal", "bench", "--ack-wait", "sleepy"])
        .arg(dir.path().join("bench.journal"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("sleepy: want park or poll"), "{err}");
    assert!(!dir.path().join("bench.journal").exists(), "nothing created");
}
