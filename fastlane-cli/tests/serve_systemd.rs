//! `fastlane serve` run the way QEMU's vhost-user "backend program conventions", libvirt and
//! systemd run a backend, driven by a real vhost-user frontend (`fastlane bench blk`, on the
//! virtio-driver crate):
//!
//! - `--print-capabilities` prints the JSON of QEMU's `vhost-user.json` schema and exits 0, under
//!   both names (`fastlane serve` and a `fastlane-vhost-user-blk` link);
//! - `--fd N`: a listening socket created by the test and inherited; the data written through
//!   it is in the file (`--blk-file`), and the socket file, not the daemon's, is left in place;
//! - Debian's `systemd-socket-activate` passes the socket as fd 3 with `LISTEN_FDS`, and the
//!   test reads READY/STATUS/STOPPING from a `NOTIFY_SOCKET` it bound; meanwhile the latency
//!   histogram, in-flight gauge and connection counter on `--metrics`, a `--stats-interval`
//!   line and the SIGUSR1 totals agree with what the client did.
//!
//! The QEMU guest attached to a socket-activated backend is a phase of `vm_blk.rs`.

mod common;

use common::daemon::Notify;

use std::io::{BufRead as _, BufReader};
use std::os::fd::AsRawFd as _;
use std::os::unix::net::UnixListener;
use std::os::unix::process::CommandExt as _;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use common::http::curl;

use common::cli::FASTLANE;

/// A child whose stderr is collected line by line; SIGKILLed on drop if still running.
struct Logged {
    child: Child,
    log: Arc<Mutex<String>>,
    lines: mpsc::Receiver<String>,
}

impl Logged {
    fn spawn(mut cmd: Command) -> Logged {
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
        let (tx, lines) = mpsc::channel();
        let log = Arc::new(Mutex::new(String::new()));
        let (pipe, sink) = (child.stderr.take().unwrap(), log.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines() {
                let Ok(line) = line else { break };
                sink.lock().unwrap().push_str(&format!("{line}\n"));
                let _ = tx.send(line);
            }
        });
        Logged { child, log, lines }
    }

    /// The first log line containing `what`, within `secs`.
    fn wait_line(&self, what: &str, secs: u64) -> String {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.contains(what) => return l,
                Ok(_) => {}
                Err(_) => panic!("no log line with {what:?} within {secs} s:\n{}", self.text()),
            }
        }
    }

    fn text(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    fn signal(&self, sig: &str) {
        let st = Command::new("kill").args([sig, &self.child.id().to_string()]).status();
        assert!(st.unwrap().success());
    }

    /// SIGTERM and the exit status within 10 s.
    fn terminate(&mut self) -> std::process::ExitStatus {
        self.signal("-TERM");
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                // The reader has the rest once the pipe closes.
                std::thread::sleep(Duration::from_millis(100));
                return st;
            }
            assert!(t0.elapsed() < Duration::from_secs(10), "no exit 10 s after SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Logged {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `fastlane bench blk` against `socket`: 256 KiB written and verified at `region`, then
/// `seconds` of QD1 random reads; the number of measured requests.
fn client_io(socket: &Path, region: &str, seconds: &str) -> u64 {
    let out = common::cli::command()
        .args(["bench", "blk", "--socket", socket.to_str().unwrap()])
        .args(["--seconds", seconds, "--qd", "1", "--pattern", "randread"])
        .args(["--verify", region, "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "bench blk: {}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    report["cases"][0]["requests"].as_u64().unwrap()
}

fn disk_file(dir: &Path, bytes: u64) -> std::path::PathBuf {
    let path = dir.join("disk.img");
    std::fs::File::create(&path).and_then(|f| f.set_len(bytes)).unwrap();
    path
}

#[test]
fn print_capabilities_under_both_names() {
    let dir = tempfile::tempdir().unwrap();
    let link = dir.path().join("fastlane-vhost-user-blk");
    std::os::unix::fs::symlink(FASTLANE, &link).unwrap();
    for cmd in [
        common::cli::command().args(["serve", "--print-capabilities"]).output(),
        Command::new(&link).arg("--print-capabilities").output(),
    ] {
        let out = cmd.unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let caps: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(caps["type"], "block");
        let features: Vec<&str> =
            caps["features"].as_array().unwrap().iter().map(|f| f.as_str().unwrap()).collect();
        assert_eq!(features, ["read-only", "blk-file"]);
    }
    // Under the link name the options are the backend's own, at the top level.
    let help = Command::new(&link).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("--socket-path") && help.contains("--blk-file"), "{help}");
}

#[test]
fn a_wrong_invocation_fails_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| {
        let out = common::cli::command().arg("serve").args(args).env_remove("LISTEN_FDS").output();
        let out = out.unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (code, err) = run(&[]);
    assert_eq!(code, Some(1));
    assert!(err.contains("--socket-path PATH or --fd FD"), "{err}");
    let (code, err) = run(&["--fd", "0"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("--fd: fd 0 is not an open socket"), "{err}");
    let sock = dir.path().join("s.sock");
    let (code, err) = run(&["--socket-path", sock.to_str().unwrap(), "--fd", "3"]);
    assert_eq!(code, Some(2), "clap refuses both: {err}");
    let (code, err) = run(&["--socket-path", sock.to_str().unwrap(), "--blk-file", "/nonexistent"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("/nonexistent"), "{err}");
    assert!(!sock.exists(), "nothing was bound for a backend that cannot open");
}

#[test]
fn an_inherited_fd_is_served_and_left_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let image = disk_file(dir.path(), 4 << 20);
    let sock = dir.path().join("libvirt.sock");
    let listener = UnixListener::bind(&sock).unwrap();
    let fd = listener.as_raw_fd();
    let mut cmd = common::cli::command();
    cmd.args(["serve", "--fd", &fd.to_string(), "--blk-file", image.to_str().unwrap()]);
    let let_through = move || {
        // The standard library opens sockets close-on-exec: let this one through.
        // SAFETY:
        // - fcntl only changes the descriptor flags of `fd`, which the parent keeps open
        //   until the child has exec'd.
        if unsafe { libc::fcntl(fd, libc::F_SETFD, 0) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    };
    // SAFETY:
    // - the hook runs in the child between fork and exec and only calls fcntl, which is
    //   async-signal-safe; it allocates nothing and takes no lock.
    unsafe { cmd.pre_exec(let_through) };
    let mut d = Logged::spawn(cmd);
    let line = d.wait_line("listening on", 20);
    assert!(line.contains(&format!("fd {fd} (--fd, {})", sock.display())), "{line}");
    drop(listener);

    let measured = client_io(&sock, "1M:256K", "0.1");
    assert!(measured > 0);
    let st = d.terminate();
    assert!(st.success(), "{st:?}\n{}", d.text());
    assert!(sock.exists(), "a socket handed over is the manager's, not removed");
    assert!(d.text().contains("stopped; fd"), "{}", d.text());
    // The verify pattern landed in the file: 256 KiB at 1 MiB, not all zeroes.
    let data = std::fs::read(&image).unwrap();
    assert!(data[(1 << 20)..(1 << 20) + (256 << 10)].iter().any(|&b| b != 0));
    assert!(data[..1 << 20].iter().all(|&b| b == 0), "nothing written outside the range");
}

fn have_socket_activate() -> bool {
    Command::new("systemd-socket-activate")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

#[test]
fn socket_activated_with_notify_metrics_stats_and_sigusr1() {
    assert!(
        have_socket_activate(),
        "systemd-socket-activate is missing: .ci/install-deps.sh installs the systemd package"
    );
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("blk.sock");
    let notify = Notify::bind(&dir.path().join("notify"));
    let mut cmd = Command::new("systemd-socket-activate");
    // The socket is made and passed as fd 3 (LISTEN_FDS=1, LISTEN_PID); only the variables
    // named with -E reach the daemon, as under systemd.
    cmd.env("NOTIFY_SOCKET", dir.path().join("notify"))
        .args(["-E", "NOTIFY_SOCKET", "-l", sock.to_str().unwrap(), FASTLANE])
        .args(["serve", "--backend", "mem:4M", "--metrics", "127.0.0.1:0"])
        .args(["--stats-interval", "0.5"]);
    let mut d = Logged::spawn(cmd);
    let t0 = Instant::now();
    while !sock.exists() {
        assert!(t0.elapsed() < Duration::from_secs(10), "no socket:\n{}", d.text());
        std::thread::sleep(Duration::from_millis(20));
    }
    // systemd-socket-activate starts the daemon on the first connection.
    let client = std::thread::spawn({
        let sock = sock.clone();
        move || client_io(&sock, "0:256K", "0.3")
    });
    let ready = notify.next();
    assert!(ready.contains("READY=1"), "{ready}");
    assert!(ready.contains("STATUS=listening on fd 3 (LISTEN_FDS"), "{ready}");
    assert_eq!(notify.next(), "STATUS=frontend connected (connection 1)\n");
    let metrics = d.wait_line("metrics on http://", 10);
    let url = metrics.split("metrics on ").nth(1).unwrap().trim().to_string();
    let measured = client.join().unwrap();
    assert_eq!(notify.next(), "STATUS=waiting for a frontend (1 connection(s) served)\n");

    let (status, text) = curl(&[&url]);
    assert_eq!(status, 200, "{text}");
    let sample = |name: &str| -> u64 {
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("no {name} in the scrape:\n{text}"))
            .parse()
            .unwrap()
    };
    let ok = sample("fastlane_vhost_blk_requests_total{queue=\"0\",result=\"ok\"}");
    assert!(ok >= 128 + measured, "ok {ok}, measured {measured}");
    // Every request is in the histogram the moment it is scraped (the scrape wakes the
    // queue to merge), and the buckets are cumulative up to the count.
    let count = sample("fastlane_vhost_blk_request_duration_seconds_count{queue=\"0\"}");
    assert_eq!(count, ok, "histogram count = requests completed");
    let inf = sample("fastlane_vhost_blk_request_duration_seconds_bucket{queue=\"0\",le=\"+Inf\"}");
    let le_10s =
        sample("fastlane_vhost_blk_request_duration_seconds_bucket{queue=\"0\",le=\"10\"}");
    let le_1us =
        sample("fastlane_vhost_blk_request_duration_seconds_bucket{queue=\"0\",le=\"0.000001\"}");
    assert_eq!(inf, count);
    assert_eq!(le_10s, count, "no request took 10 s");
    assert!(le_1us < count, "not every request under 1 µs: {le_1us}");
    assert_eq!(sample("fastlane_vhost_blk_in_flight{queue=\"0\"}"), 0);
    assert_eq!(sample("fastlane_vhost_blk_connections_total"), 1);
    assert_eq!(sample("fastlane_vhost_blk_connection_errors_total"), 0);
    // bench blk's frontend (virtio-driver) does not negotiate in-flight tracking: nothing to
    // resubmit, and the families are there at 0.
    assert_eq!(sample("fastlane_vhost_blk_resubmitted_total{queue=\"0\"}"), 0);
    assert_eq!(sample("fastlane_vhost_blk_torn_completions_total{queue=\"0\"}"), 0);
    assert_eq!(sample("fastlane_vhost_blk_broken_avail_total{queue=\"0\"}"), 0);

    let stats = d.wait_line("stats: ", 10);
    assert!(stats.contains("requests (") && stats.contains("in flight"), "{stats}");
    d.signal("-USR1");
    d.wait_line("totals (SIGUSR1): 1 connection(s)", 10);
    let latency = d.wait_line("queue 0: latency p50", 10);
    assert!(latency.contains(&format!("({ok} requests)")), "{latency}");

    let st = d.terminate();
    assert!(st.success(), "{st:?}\n{}", d.text());
    assert_eq!(notify.next(), "STOPPING=1\nSTATUS=stopping\n");
}

fn repo_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("fastlane-cli/ has a parent")
}

/// The shipped units pass `systemd-analyze verify` (as an instance, with the built binary in
/// ExecStart), and the service runs `fastlane serve` the way the socket-activation test does.
#[test]
fn shipped_systemd_units_verify() {
    let deploy = repo_root().join("deploy/systemd");
    let dir = tempfile::tempdir().unwrap();
    let service = std::fs::read_to_string(deploy.join("fastlane-vhost-blk@.service")).unwrap();
    let socket = std::fs::read_to_string(deploy.join("fastlane-vhost-blk@.socket")).unwrap();
    assert!(service.contains("\nType=notify\n"), "READY=1 is what systemd waits for");
    assert!(service.contains("ExecStart=/usr/local/bin/fastlane serve --blk-file "));
    assert!(socket.contains("\nSocketMode=0660\n") && socket.contains("\nSocketGroup=kvm\n"));
    assert!(socket.contains("\nAccept=no\n"), "one backend for the socket, not one per connection");
    std::fs::write(
        dir.path().join("fastlane-vhost-blk@.service"),
        service.replace("/usr/local/bin/fastlane", FASTLANE),
    )
    .unwrap();
    std::fs::write(dir.path().join("fastlane-vhost-blk@.socket"), socket).unwrap();
    for kind in ["service", "socket"] {
        std::os::unix::fs::symlink(
            format!("fastlane-vhost-blk@.{kind}"),
            dir.path().join(format!("fastlane-vhost-blk@disk0.{kind}")),
        )
        .unwrap();
    }
    let out = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(dir.path().join("fastlane-vhost-blk@disk0.service"))
        .arg(dir.path().join("fastlane-vhost-blk@disk0.socket"))
        .output()
        .expect("systemd-analyze (the systemd package; .ci/install-deps.sh installs it)");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.trim().is_empty(), "{:?}: {err}", out.status);
}

/// QEMU's and libvirt's vhost-user JSON descriptor names a binary that, under that name,
/// prints capabilities of the descriptor's type.
#[test]
fn shipped_vhost_user_descriptor_matches_the_program() {
    let path = repo_root().join("deploy/vhost-user/50-fastlane-vhost-blk.json");
    let desc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap())
        .expect("the descriptor is JSON");
    assert_eq!(desc["type"], "block");
    assert!(desc["description"].as_str().is_some_and(|d| !d.is_empty()));
    let binary = Path::new(desc["binary"].as_str().expect("binary"));
    assert!(binary.is_absolute());
    let dir = tempfile::tempdir().unwrap();
    let link = dir.path().join(binary.file_name().unwrap());
    std::os::unix::fs::symlink(FASTLANE, &link).unwrap();
    let out = Command::new(&link).arg("--print-capabilities").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let caps: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(caps["type"], desc["type"]);
}
