//! `fastlane kv serve|bench` end to end.

use std::io::Read;
use std::process::Stdio;
use std::time::{Duration, Instant};

use fastlane_kvswap::client::KvClient;

mod common;

use common::cli::command as fastlane;

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
    let mut c = connect_when_up(&sock);
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
    use fastlane_kvswap::client::KvClientError;
    use fastlane_kvswap::proto::ErrorCode;
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

/// A `fastlane kv serve` child on `sock` with `extra` flags (small pool, 128 KiB blocks).
fn kv_serve(sock: &std::path::Path, extra: &[&str]) -> std::process::Child {
    fastlane()
        .args(["kv", "serve", "--device-blocks", "8", "--host-bytes", "16M"])
        .args(["--tokens-per-block", "1", "--cas-bytes", "16M"])
        .args(extra)
        .arg("--socket")
        .arg(sock)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Connects once the server listens (bounded).
fn connect_when_up(sock: &std::path::Path) -> KvClient {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match KvClient::connect(sock) {
            Ok(c) => return c,
            Err(e) if Instant::now() > deadline => panic!("kv serve not up in 30 s: {e:?}"),
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

fn stop(mut child: std::process::Child) -> String {
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) }, 0);
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    assert!(status.success(), "{status:?}\n{stderr}");
    stderr
}

#[test]
fn two_kv_servers_share_blocks_through_a_redis_cluster() {
    use fastlane_kvswap::client::Where;
    let cluster = fastlane_kvswap::testing::RedisCluster::start().unwrap_or_else(|e| panic!("{e}"));
    let url = format!("redis://127.0.0.1:{},127.0.0.1:{}", cluster.port(0), cluster.port(1));
    let dir = tempfile::tempdir().unwrap();
    let (sa, sb) = (dir.path().join("a.sock"), dir.path().join("b.sock"));
    let a = kv_serve(&sa, &["--kv-cluster", &url]);
    let b = kv_serve(&sb, &["--kv-cluster", &url]);
    let (mut ca, mut cb) = (connect_when_up(&sa), connect_when_up(&sb));
    let bb = 128 << 10;
    let data: Vec<u8> = (0..bb).map(|i| (i * 7 + i / 4096) as u8).collect();
    let key = [0x42u8; 32];
    let blocks_a = ca.alloc(1, 1).unwrap();
    ca.write_block(blocks_a[0], &data);
    assert_eq!(ca.put(&[(key, blocks_a[0])]).unwrap(), [true]);
    // B has never seen the block: it finds it in the cluster once A's put has landed there.
    let deadline = Instant::now() + Duration::from_secs(20);
    while cb.exists(&[key]).unwrap() != [Where::Cluster] {
        assert!(Instant::now() < deadline, "A's block did not reach the cluster in 20 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    let blocks_b = cb.alloc(1, 1).unwrap();
    cb.write_block(blocks_b[0], &vec![0u8; bb]);
    assert_eq!(cb.get(&[(key, blocks_b[0])]).unwrap(), [true]);
    let mut got = vec![0u8; bb];
    cb.read_block(blocks_b[0], &mut got);
    assert!(got == data, "B read other bytes than A stored");
    // Now in B's host memory too.
    assert_eq!(cb.exists(&[key]).unwrap(), [Where::Host]);
    drop((ca, cb));
    // Their shutdown summaries: A put one block to the cluster, B got one hit from it.
    let (ea, eb) = (stop(a), stop(b));
    assert!(ea.contains("cluster: 1 puts, 0 dropped, 0 put errors"), "{ea}");
    assert!(eb.contains("1 keys got (1 hits: 1 cluster)"), "{eb}");
}

#[test]
fn kv_serve_refuses_to_start_without_its_cluster() {
    // A port nobody listens on: the server says so and exits non-zero, promptly.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let dir = tempfile::tempdir().unwrap();
    let t0 = Instant::now();
    let out = fastlane()
        .args(["kv", "serve", "--device-blocks", "8", "--tokens-per-block", "1"])
        .args(["--kv-cluster", &format!("redis://127.0.0.1:{port}")])
        .arg("--socket")
        .arg(dir.path().join("kv.sock"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("--kv-cluster"), "{stderr}");
    assert!(t0.elapsed() < Duration::from_secs(20), "took {:?}", t0.elapsed());
    for (flags, want) in [
        (
            &["--cas-bytes", "0", "--kv-cluster", "redis://127.0.0.1:1"][..],
            "needs --cas-bytes above 0",
        ),
        (&["--kv-cluster", "127.0.0.1:1"][..], "redis://HOST:PORT"),
    ] {
        let out = fastlane()
            .args(["kv", "serve", "--device-blocks", "8", "--tokens-per-block", "1"])
            .args(flags)
            .arg("--socket")
            .arg(dir.path().join("kv2.sock"))
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(want), "{flags:?}: {stderr}");
    }
}

/// `fastlane kv serve` with `extra` flags and `env` set (the Redis credential variables
/// cleared first), its exit status and stderr once it ends; bounded by the server's own
/// connect timeouts (it ends by itself when its cluster refuses it).
fn kv_serve_refused(dir: &std::path::Path, extra: &[&str], env: &[(&str, &str)]) -> String {
    let t0 = Instant::now();
    let mut cmd = fastlane();
    cmd.args(["kv", "serve", "--device-blocks", "8", "--tokens-per-block", "1"])
        .args(["--cas-bytes", "16M"])
        .args(extra)
        .arg("--socket")
        .arg(dir.join("refused.sock"))
        .env_remove("FASTLANE_REDIS_PASSWORD")
        .env_remove("FASTLANE_REDIS_USERNAME");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{extra:?} started: {stderr}");
    assert!(t0.elapsed() < Duration::from_secs(20), "{extra:?} took {:?}", t0.elapsed());
    stderr
}

#[test]
fn kv_servers_share_blocks_through_a_tls_cluster_with_a_password() {
    use fastlane_kvswap::client::Where;
    use fastlane_kvswap::testing::{RedisCluster, RedisClusterOptions};
    use std::os::unix::fs::PermissionsExt;
    const PASSWORD: &str = "cli-test-pass-91c2";
    let cluster = RedisCluster::start_with(RedisClusterOptions {
        password: Some(PASSWORD.into()),
        tls: true,
    })
    .unwrap_or_else(|e| panic!("{e}"));
    let url = format!("rediss://127.0.0.1:{},127.0.0.1:{}", cluster.port(0), cluster.port(1));
    let ca = cluster.ca_file().unwrap();
    let ca = ca.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let pw = dir.path().join("redis.pw");
    std::fs::write(&pw, format!("{PASSWORD}\n")).unwrap();
    std::fs::set_permissions(&pw, std::fs::Permissions::from_mode(0o644)).unwrap();
    let pw = pw.to_str().unwrap();

    // What is refused, and says why: no password, a world-readable password file, no CA,
    // a password in the URL.
    let tls = ["--kv-cluster", &url, "--kv-cluster-ca", ca];
    let e = kv_serve_refused(dir.path(), &tls, &[]);
    let node0 = format!("rediss://127.0.0.1:{}", cluster.port(0));
    assert!(e.contains("authentication failed") && e.contains(&node0), "{e}");
    let e = kv_serve_refused(
        dir.path(),
        &[&tls[..], &["--kv-cluster-password-file", pw]].concat(),
        &[],
    );
    assert!(e.contains("readable by its group or others"), "{e}");
    let e = kv_serve_refused(
        dir.path(),
        &["--kv-cluster", &url],
        &[("FASTLANE_REDIS_PASSWORD", PASSWORD)],
    );
    assert!(e.contains("TLS failed") && e.contains("UnknownIssuer"), "{e}");
    let in_url = format!("rediss://default:{PASSWORD}@127.0.0.1:{}", cluster.port(0));
    let e = kv_serve_refused(dir.path(), &["--kv-cluster", &in_url, "--kv-cluster-ca", ca], &[]);
    assert!(e.contains("never the command line") && !e.contains(PASSWORD), "{e}");

    // A takes the password from its file, B from the environment; both trust the test CA.
    std::fs::set_permissions(pw, std::fs::Permissions::from_mode(0o600)).unwrap();
    let (sa, sb) = (dir.path().join("a.sock"), dir.path().join("b.sock"));
    let a = kv_serve(&sa, &[&tls[..], &["--kv-cluster-password-file", pw]].concat());
    let b = {
        let mut b = fastlane();
        b.args(["kv", "serve", "--device-blocks", "8", "--host-bytes", "16M"])
            .args(["--tokens-per-block", "1", "--cas-bytes", "16M"])
            .args(tls)
            .arg("--socket")
            .arg(&sb)
            .env("FASTLANE_REDIS_PASSWORD", PASSWORD)
            .stderr(Stdio::piped());
        b.spawn().unwrap()
    };
    let (mut ca_client, mut cb) = (connect_when_up(&sa), connect_when_up(&sb));
    let bb = 128 << 10;
    let data: Vec<u8> = (0..bb).map(|i| (i * 13 + i / 512) as u8).collect();
    let key = [0x5au8; 32];
    let blocks_a = ca_client.alloc(1, 1).unwrap();
    ca_client.write_block(blocks_a[0], &data);
    assert_eq!(ca_client.put(&[(key, blocks_a[0])]).unwrap(), [true]);
    let deadline = Instant::now() + Duration::from_secs(20);
    while cb.exists(&[key]).unwrap() != [Where::Cluster] {
        assert!(Instant::now() < deadline, "A's block did not reach the cluster in 20 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    let blocks_b = cb.alloc(1, 1).unwrap();
    cb.write_block(blocks_b[0], &vec![0u8; bb]);
    assert_eq!(cb.get(&[(key, blocks_b[0])]).unwrap(), [true]);
    let mut got = vec![0u8; bb];
    cb.read_block(blocks_b[0], &mut got);
    assert!(got == data, "B read other bytes than A stored");
    drop((ca_client, cb));
    let (ea, eb) = (stop(a), stop(b));
    assert!(ea.contains("cluster: 1 puts, 0 dropped, 0 put errors"), "{ea}");
    assert!(eb.contains("1 keys got (1 hits: 1 cluster)"), "{eb}");
    assert!(!ea.contains(PASSWORD) && !eb.contains(PASSWORD), "a log shows the password");
}
