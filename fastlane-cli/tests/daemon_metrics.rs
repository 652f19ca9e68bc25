//! `--metrics` of the daemons that are not HTTP servers: `fastlane kv serve` and `fastlane
//! serve` started with `--metrics 127.0.0.1:0`, driven by real clients (the kvswap client;
//! `fastlane bench blk --verify`), scraped with curl; the counters must have moved by exactly
//! what the clients did. `fastlane rdma serve` needs an RDMA device: its families are checked
//! by the unit tests in fastlane-cli/src/rdma.rs.

mod common;

use std::io::Write;
use std::os::unix::fs::FileTypeExt as _;
use std::path::Path;
use std::time::{Duration, Instant};

use common::daemon::Daemon;
use common::http::curl;
use fastlane_kvswap::client::{KvClient, Where};

/// The daemon answers 404 elsewhere, 405 to another method, survives a request that is not
/// HTTP, and keeps serving scrapes.
fn refuses_other_requests(d: &Daemon) {
    let base = d.url.strip_suffix("/metrics").unwrap();
    assert_eq!(curl(&[&format!("{base}/")]).0, 404);
    assert_eq!(curl(&[&format!("{base}/metrics/../admin")]).0, 404);
    assert_eq!(curl(&[&format!("{base}/healthz")]).0, 404);
    assert_eq!(curl(&["-X", "POST", &d.url]).0, 405);
    let mut junk = std::net::TcpStream::connect(&d.addr).unwrap();
    junk.write_all(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03garbage\r\n\r\n").unwrap();
    let _ = junk.shutdown(std::net::Shutdown::Write);
    let mut sink = Vec::new();
    junk.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let _ = std::io::Read::read_to_end(&mut junk, &mut sink);
    // Half a request line, then the connection left open: cut off by the header timeout,
    // and meanwhile other scrapes are served.
    let mut slow = std::net::TcpStream::connect(&d.addr).unwrap();
    slow.write_all(b"GET /metr").unwrap();
    assert_eq!(curl(&[&d.url]).0, 200);
    drop(slow);
}

fn key(i: u8) -> [u8; fastlane_kvswap::proto::KEY_BYTES] {
    [i; fastlane_kvswap::proto::KEY_BYTES]
}

#[test]
fn kv_serve_counts_what_a_client_did() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("kv.sock");
    let sock_s = sock.to_str().unwrap();
    let d = Daemon::start(&[
        "kv",
        "serve",
        "--device-blocks",
        "16",
        "--host-bytes",
        "16M",
        "--tokens-per-block",
        "1",
        "--cas-bytes",
        "4M",
        "--socket",
        sock_s,
    ]);
    const BB: u64 = 128 * 1024;
    let s = d.scrape();
    assert_eq!(s.get("fastlane_kv_connections_open"), 0);
    assert_eq!(s.get("fastlane_kv_connections_total{result=\"accepted\"}"), 0);
    assert_eq!(s.get("fastlane_kv_requests_total"), 0);
    assert_eq!(s.get("fastlane_kv_device_blocks{state=\"free\"}"), 16);
    assert_eq!(s.get("fastlane_kv_device_blocks{state=\"used\"}"), 0);
    assert_eq!(s.get("fastlane_kv_tier_blocks{state=\"free\",tier=\"host\"}"), 16 << 20 >> 17);
    assert_eq!(s.get("fastlane_kv_cas_capacity_bytes"), 4 << 20);
    assert_eq!(s.get("fastlane_kv_cas_blocks"), 0);
    assert!(!s.0.contains("tier=\"nvme\""), "no NVMe tier configured:\n{}", s.0);

    let deadline = Instant::now() + Duration::from_secs(30);
    let mut c = loop {
        match KvClient::connect(&sock) {
            Ok(c) => break c,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => panic!("server did not come up: {e}"),
        }
    };
    assert_eq!(c.block_bytes() as u64, BB);
    let mut requests = 1; // HELLO
    let b = c.alloc(1, 2).unwrap();
    requests += 1;
    let s = d.scrape();
    assert_eq!(s.get("fastlane_kv_connections_open"), 1);
    assert_eq!(s.get("fastlane_kv_connections_total{result=\"accepted\"}"), 1);
    assert_eq!(s.get("fastlane_kv_device_blocks{state=\"used\"}"), 2);
    assert_eq!(s.get("fastlane_kv_device_blocks{state=\"free\"}"), 14);
    assert_eq!(s.get("fastlane_kv_requests_total"), requests);

    // Swap the two blocks out to the host tier and back in.
    c.write_block(b[0], &[7u8; 4096]);
    let t = c.prepare_store(1, &b).unwrap();
    c.complete(t, Duration::from_secs(10)).unwrap();
    requests += 2;
    let s = d.scrape();
    assert_eq!(s.get("fastlane_kv_swap_bytes_total{direction=\"out\"}"), 2 * BB);
    assert_eq!(s.get("fastlane_kv_swap_bytes_total{direction=\"in\"}"), 0);
    assert_eq!(s.get("fastlane_kv_tier_blocks{state=\"used\",tier=\"host\"}"), 2);
    assert_eq!(s.get("fastlane_kv_tickets_in_flight"), 0);
    c.free(1, &b).unwrap();
    let b2 = c.alloc(1, 2).unwrap();
    let t = c.prepare_load(1, &b2).unwrap();
    c.complete(t, Duration::from_secs(10)).unwrap();
    requests += 4;
    let mut back = [0u8; 4096];
    c.read_block(b2[0], &mut back);
    assert_eq!(back, [7u8; 4096]);
    let s = d.scrape();
    assert_eq!(s.get("fastlane_kv_swap_bytes_total{direction=\"in\"}"), 2 * BB);
    assert_eq!(s.get("fastlane_kv_swap_bytes_total{direction=\"out\"}"), 2 * BB);
    assert_eq!(s.get("fastlane_kv_checksum_failures_total"), 0);
    assert_eq!(s.get("fastlane_kv_requests_total"), requests);

    // The content-addressed store: 2 puts, a GET of 3 keys (2 hits), a pin, an EVICT.
    let b3 = c.alloc(2, 1).unwrap();
    requests += 1;
    let (k0, k1, k2) = (key(0), key(1), key(2));
    assert_eq!(c.put(&[(k0, b2[0]), (k1, b2[1])]).unwrap(), [true, true]);
    assert_eq!(c.get(&[(k0, b2[0]), (k1, b2[1]), (k2, b3[0])]).unwrap(), [true, true, false]);
    assert_eq!(c.exists(&[k0, k2]).unwrap(), [Where::Host, Where::Absent]);
    assert_eq!(c.pin(&[k0]).unwrap(), [true]);
    assert_eq!(c.evict(&[k0, k1]).unwrap(), [false, true]);
    requests += 5;
    let s = d.scrape();
    assert_eq!(s.get("fastlane_kv_cas_requests_total"), 5);
    assert_eq!(s.get("fastlane_kv_cas_inserts_total"), 2);
    assert_eq!(s.get("fastlane_kv_cas_get_keys_total"), 3);
    assert_eq!(s.get("fastlane_kv_cas_get_hits_total"), 2);
    assert_eq!(s.get("fastlane_kv_cas_evicted_by_request_total"), 1);
    assert_eq!(s.get("fastlane_kv_cas_evictions_total"), 0);
    assert_eq!(s.get("fastlane_kv_cas_blocks"), 1);
    assert_eq!(s.get("fastlane_kv_cas_bytes"), BB);
    assert_eq!(s.get("fastlane_kv_cas_pins"), 1);
    assert_eq!(s.get("fastlane_kv_cas_pinned_blocks"), 1);
    assert_eq!(s.get("fastlane_kv_cas_cluster_hits_total"), 0);
    assert_eq!(s.get("fastlane_kv_cas_integrity_misses_total"), 0);
    assert_eq!(s.get("fastlane_kv_requests_total"), requests);

    // The connection goes: its pin is released, the gauges fall, the counters stay.
    drop(c);
    let t0 = Instant::now();
    let s = loop {
        let s = d.scrape();
        if s.get("fastlane_kv_connections_open") == 0 {
            break s;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "connection still open:\n{}", s.0);
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(s.get("fastlane_kv_cas_pins"), 0);
    assert_eq!(s.get("fastlane_kv_cas_pins_released_on_close_total"), 1);
    assert_eq!(s.get("fastlane_kv_device_blocks{state=\"free\"}"), 16);
    assert_eq!(s.get("fastlane_kv_connections_total{result=\"accepted\"}"), 1);
    assert_eq!(s.get("fastlane_kv_connections_total{result=\"refused_peer\"}"), 0);
    assert_eq!(s.get("fastlane_kv_protocol_errors_total"), 0);

    refuses_other_requests(&d);
    let log = d.sigterm_and_wait();
    assert!(log.contains("stopped after 1 connections"), "{log}");
}

#[test]
fn vhost_blk_serve_counts_a_clients_io() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("blk.sock");
    let sock_s = sock.to_str().unwrap();
    let d = Daemon::start(&["serve", "--socket", sock_s, "--backend", "mem:4M", "--queues", "1"]);
    let t = Instant::now();
    while !std::fs::metadata(&sock).is_ok_and(|m| m.file_type().is_socket()) {
        assert!(t.elapsed() < Duration::from_secs(10), "serve did not create its socket");
        std::thread::sleep(Duration::from_millis(20));
    }
    let s = d.scrape();
    assert_eq!(s.get("fastlane_vhost_blk_queues"), 1);
    assert_eq!(s.get("fastlane_vhost_blk_capacity_bytes"), 4 << 20);
    assert_eq!(s.get("fastlane_vhost_blk_requests_total{queue=\"0\",result=\"ok\"}"), 0);
    assert_eq!(s.get("fastlane_vhost_blk_bytes_total{direction=\"read\",queue=\"0\"}"), 0);

    // A real frontend: 256 KiB written and read back (64 + 64 requests of 4 KiB), then
    // random reads only.
    let out = common::cli::command()
        .args(["bench", "blk", "--socket", sock_s, "--seconds", "0.1", "--qd", "1"])
        .args(["--pattern", "randread", "--verify", "0:256K", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let measured = report["cases"][0]["requests"].as_u64().unwrap();
    assert!(measured > 0, "{report}");

    let s = d.scrape();
    let q = |m: &str, labels: &str| s.get(&format!("fastlane_vhost_blk_{m}{{{labels}}}"));
    let written = q("bytes_total", "direction=\"write\",queue=\"0\"");
    let read = q("bytes_total", "direction=\"read\",queue=\"0\"");
    let ok = q("requests_total", "queue=\"0\",result=\"ok\"");
    let flushes = q("flushes_total", "queue=\"0\"");
    assert_eq!(written, 256 << 10, "only --verify writes");
    assert!(read >= (256 << 10) + measured * 4096, "read {read} B, measured {measured}");
    assert_eq!(read % 4096, 0);
    assert_eq!(ok, (read + written) / 4096 + flushes, "every request a 4 KiB read or write");
    assert_eq!(q("requests_total", "queue=\"0\",result=\"failed\""), 0);
    assert_eq!(q("requests_total", "queue=\"0\",result=\"rejected\""), 0);
    assert_eq!(q("rejected_total", "queue=\"0\",reason=\"out_of_range\""), 0);
    assert_eq!(q("discards_total", "queue=\"0\""), 0);

    refuses_other_requests(&d);
    drop(d.sigterm_and_wait());
    assert!(!Path::new(&sock).exists(), "socket left behind");
}
