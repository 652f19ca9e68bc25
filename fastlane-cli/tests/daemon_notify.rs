//! `sd_notify` from the daemons systemd would run with `Type=notify`: `fastlane router`,
//! `fastlane llm serve` and `fastlane kv serve` send `READY=1` to `$NOTIFY_SOCKET` once they
//! serve, and `STOPPING=1` after SIGTERM, then exit 0 (`fastlane serve` and `journal serve`
//! are checked in serve_systemd.rs and journal_service.rs; `rdma serve` needs an RDMA device).

mod common;

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::cli::command;
use common::daemon::Notify;
use common::http::KillOnDrop;

/// Runs `fastlane ARGS` with `NOTIFY_SOCKET`, waits for READY=1, sends SIGTERM, waits for
/// STOPPING=1 and a clean exit; a daemon given `--listen` must take connections once ready.
fn ready_then_stopping(args: &[&str], what: &str) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("notify");
    let notify = Notify::bind(&path);
    let mut child = KillOnDrop(
        command()
            .args(args)
            .current_dir(dir.path())
            .env("NOTIFY_SOCKET", &path)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start fastlane"),
    );
    let ready = notify.expect("READY=1", what);
    assert!(ready.contains("STATUS="), "{what}: READY=1 carries a status line: {ready:?}");
    if args.contains(&"--listen") {
        // Ready means serving: the address is printed before READY=1 and takes connections.
        let mut line = String::new();
        BufReader::new(child.0.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let addr = line.trim().strip_prefix("listening on http://").unwrap_or_else(|| {
            panic!("{what}: prints its address, got {line:?}");
        });
        std::net::TcpStream::connect(addr).expect("ready means the port takes connections");
    }
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(child.0.id() as libc::pid_t, libc::SIGTERM) }, 0);
    notify.expect("STOPPING=1", what);
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.0.try_wait().unwrap() {
            break s;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "{what}: still running 60 s after SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{what}: exit after SIGTERM: {status:?}");
}

#[test]
fn router_tells_systemd_it_is_ready_and_stopping() {
    ready_then_stopping(
        &["router", "--upstream", "http://127.0.0.1:9", "--listen", "127.0.0.1:0"],
        "router",
    );
}

#[test]
fn llm_serve_tells_systemd_it_is_ready_and_stopping() {
    ready_then_stopping(
        &["llm", "serve", "--model", "random:tiny", "--listen", "127.0.0.1:0"],
        "llm serve",
    );
}

#[test]
fn kv_serve_tells_systemd_it_is_ready_and_stopping() {
    ready_then_stopping(
        &["kv", "serve", "--device-blocks", "8", "--host-bytes", "16M", "--socket", "kv.sock"],
        "kv serve",
    );
}
