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

/// `bench-service --json`: every record of the case is acknowledged and timed, the two idle
/// floors and the no-journal run under the same schedule are measured, and the ratios are
/// the ones the table prints.
#[test]
fn bench_service_measures_the_floors_and_the_same_load_without_a_journal() {
    // The floors open their file with O_DIRECT: a directory on the repository's file system,
    // not a /tmp that may be tmpfs.
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let out = run_ok(
        fastlane()
            .args(["journal", "bench-service", "--dir"])
            .arg(dir.path().join("b"))
            .args(["--cases", "1000x1,2000x2", "--seconds", "0.4", "--floor-ops", "20"])
            .args(["--segment-bytes", "32M", "--json"]),
    );
    let v: serde_json::Value = serde_json::from_str(&out).expect("stdout is one JSON array");
    let cases = v.as_array().unwrap();
    assert_eq!(cases.len(), 2);
    for (c, (rate, producers)) in cases.iter().zip([(1000u64, 1u64), (2000, 2)]) {
        assert_eq!(c["rate_per_s"], rate);
        assert_eq!(c["producers"], producers);
        let records = rate * 4 / 10;
        assert_eq!(c["ack"]["count"], records, "every record acknowledged: {c}");
        assert_eq!(c["records"], records);
        // Two halves of 0.2 s at the case's rate.
        assert_eq!(c["floor_sustained"]["count"], records, "{c}");
        assert_eq!(c["floor_pwrite_fdatasync"]["count"], 20);
        assert_eq!(c["floor_dsync_direct"]["count"], 20);
        for h in ["ack", "floor_pwrite_fdatasync", "floor_dsync_direct", "floor_sustained"] {
            let p = |k: &str| c[h][k].as_u64().unwrap();
            assert!(
                p("p50_ns") > 0 && p("p50_ns") <= p("p99_ns") && p("p99_ns") <= p("max_ns"),
                "{h}"
            );
        }
        let p99 = |h: &str| c[h]["p99_ns"].as_f64().unwrap();
        let expect = p99("ack") / p99("floor_sustained");
        let r = c["ack_p99_over_sustained_p99"].as_f64().unwrap();
        assert!((r - expect).abs() < 1e-9 * expect, "ratio {r} vs {expect}");
        let expect = p99("ack") / p99("floor_pwrite_fdatasync").min(p99("floor_dsync_direct"));
        let r = c["ack_p99_over_floor_p99"].as_f64().unwrap();
        assert!((r - expect).abs() < 1e-9 * expect, "ratio {r} vs {expect}");
    }
    assert!(!dir.path().join("b/case-0").exists(), "each case's directory is removed");

    // A case that rolls: its acks split by whether the next segment's file was being
    // written (or a roll under way) when they were seen.
    let out = run_ok(
        fastlane()
            .args(["journal", "bench-service", "--dir"])
            .arg(dir.path().join("r"))
            .args(["--cases", "2000x1", "--seconds", "1.5", "--floor-ops", "4"])
            // A rate a debug build keeps up with (acks seen as they come), and a slow
            // spare (1 MiB in ~64 ms) so that acks are seen while it is written.
            .args(["--record-bytes", "1000", "--spare-rate", "16M", "--spare-adapt", "false"])
            .args(["--segment-bytes", "1M", "--retain-segments", "1", "--json"]),
    );
    let v: serde_json::Value = serde_json::from_str(&out).expect("stdout is one JSON array");
    let c = &v[0];
    let n = |h: &str| c[h]["count"].as_u64().unwrap();
    assert_eq!(n("ack"), 3_000, "{c}");
    assert_eq!(n("ack_while_spare") + n("ack_spare_ready"), n("ack"), "the split covers every ack");
    let rolls = c["rolls"].as_u64().unwrap();
    // 3,000 frames of 1,000 B payload (~3 MB) fill 1 MiB segments about three times, all
    // through the case (not only at its end: acks follow each roll).
    assert!(rolls >= 1, "rolls {rolls}: {c}");
    assert!(c["roll_us"].as_u64().unwrap() > 0, "{rolls} rolls took no time: {c}");
    assert!(n("ack_while_spare") > 0, "{rolls} rolls, each writes a spare while acks go on: {c}");
    assert!(n("ack_spare_ready") > 0, "the spare is ready at the start: {c}");
    // One segment kept: each roll lets the one before go (the last roll's removal may still
    // be under way on the spare's thread when the case stops).
    let removed = c["segments_removed"].as_u64().unwrap();
    assert!(rolls >= 2, "rolls {rolls}: {c}");
    assert!(removed + 1 >= rolls && removed <= rolls, "{rolls} rolls, {removed} removed: {c}");
}

/// A segment directory of three segments (producer ids 0..4), written with the journal's
/// format helpers; returns the segments' paths.
fn segment_dir(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    use fastlane_journal::format::{encode_frame, frame_len, Superblock, FRAME_HEADER_LEN};
    use fastlane_journal::{Durability, SegmentDir, SoftPreprocess};
    use std::os::unix::fs::FileExt;
    let pre = SoftPreprocess::default();
    let mut d = SegmentDir::open(dir, true).unwrap();
    let mut sb = Superblock::new([1; 16], 1, 1, 64 << 10, 1024, Durability::Local);
    let (mut seq, mut head, mut paths) = (1u64, [0u8; 16], Vec::new());
    for i in 0..3u64 {
        if i > 0 {
            sb = sb.next_segment(i + 1, seq, head);
        }
        let path = d.install(&sb, 64 << 10).unwrap();
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        head = sb.genesis();
        let mut off = 4096;
        for _ in 0..10 {
            let p = format!("order {seq}");
            let mut buf = vec![0u8; frame_len(p.len())];
            buf[FRAME_HEADER_LEN..][..p.len()].copy_from_slice(p.as_bytes());
            let producer = (seq % 5) as u32;
            head = encode_frame(
                &mut buf,
                &sb.chain_key(),
                &head,
                seq,
                7,
                producer,
                p.len(),
                &mut |c, b| pre.crc32c_append(c, b),
            );
            f.write_all_at(&buf, off).unwrap();
            off += buf.len() as u64;
            seq += 1;
        }
        paths.push(path);
    }
    paths
}

#[test]
fn verify_and_dump_a_segment_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("journal.d");
    let segs = segment_dir(&dir);

    let v = run_ok(fastlane().args(["journal", "verify"]).arg(&dir));
    assert!(v.contains("records 30  last seq 30  head ") && v.contains("OK"), "{v}");
    assert!(v.contains("segments 3  from seq 1, segments 0..2"), "{v}");
    let head = v.split_whitespace().skip_while(|w| *w != "head").nth(1).unwrap().to_string();
    run_ok(fastlane().args(["journal", "verify", "--expect-head", &head]).arg(&dir));

    // From the middle of segment 2, with the producer id column.
    let d = run_ok(fastlane().args(["journal", "dump", "--from-seq", "15"]).arg(&dir));
    let lines: Vec<&str> = d.lines().collect();
    assert_eq!(lines.len(), 16, "{d}");
    assert!(
        lines[0].trim_start().starts_with("15 producer 0 ") && lines[0].contains("\"order 15\""),
        "{d}"
    );
    assert!(lines[1].contains(" producer 1 "), "{d}");

    // --raw: seq, producer id, length, payload, record after record.
    let out = fastlane()
        .args(["journal", "dump", "--raw", "--from-seq", "29"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(out.status.success());
    let mut want = Vec::new();
    for seq in [29u64, 30] {
        let p = format!("order {seq}");
        want.extend_from_slice(&seq.to_le_bytes());
        want.extend_from_slice(&((seq % 5) as u32).to_le_bytes());
        want.extend_from_slice(&(p.len() as u32).to_le_bytes());
        want.extend_from_slice(p.as_bytes());
    }
    assert_eq!(out.stdout, want);

    // A record of the middle segment changed: named by file and seq.
    let mut img = std::fs::read(&segs[1]).unwrap();
    let at = img.windows(8).position(|w| w == b"order 15").unwrap();
    img[at] ^= 1;
    std::fs::write(&segs[1], &img).unwrap();
    let out = fastlane().args(["journal", "verify"]).arg(&dir).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("00000000000000000001.seg") && err.contains("record after seq 14 changed"),
        "{err}"
    );
    let out = fastlane().args(["journal", "dump"]).arg(&dir).output().unwrap();
    assert!(!out.status.success(), "dump stops with the problem");
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 14);

    // A missing directory is a clear error.
    let out = fastlane().args(["journal", "verify"]).arg(tmp.path().join("nope")).output().unwrap();
    assert!(!out.status.success());
}
