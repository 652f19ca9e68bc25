//! Real-guest integration test of `fastlane serve` (vhost-user-blk) with QEMU as the frontend.
//!
//! Boots three throwaway Linux guests (`tests/vm/run-guest.sh`, QEMU TCG) against the built
//! `fastlane` binary; the guest side is `tests/vm/guest-blk.sh`. One test function, phases in
//! order:
//!
//! 1. `fastlane serve --backend file:<64 MiB file in /dev/shm> --queues 2 --hlog …`; a guest with
//!    two vCPUs and `num-queues=2` writes random data with O_DIRECT at a few offsets (each range
//!    from one CPU), reads it back after dropping caches, fsyncs the device (a flush), discards
//!    a range and reads back zeroes. The host checks the backing file holds the same bytes.
//! 2. A second guest attaches to the same, still running daemon (reconnect) and reads the
//!    ranges back.
//! 3. SIGTERM: the daemon exits 0 within a few seconds, removes its socket, and the `.hlog` it
//!    wrote reads back (with `fastlane hist` and the library) with requests on both queues.
//! 4. `fastlane serve --readonly` on the same file; a third guest sees a read-only disk, reads
//!    the data, fails to write; the file is unchanged.
//! 5. `systemd-socket-activate` starts `fastlane serve --blk-file` with the socket as fd 3
//!    (`LISTEN_FDS`) when QEMU connects; READY=1 arrives on the test's `NOTIFY_SOCKET`; a
//!    fourth guest reads the ranges back.
//!
//! QEMU missing fails the test (`.ci/install-deps.sh` installs it). Every wait is bounded, and children are killed on any
//! failure (drop guards). `FASTLANE_VM_BLK_BACKEND=qsd` runs the same guests against
//! qemu-storage-daemon instead, to tell a guest-script problem from a `serve` problem (the
//! checks specific to `fastlane serve` are then skipped).

mod common;

use std::fmt::Write as _;
use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use fastlane_guest_tests::Guest;

/// Size of the exported disk.
const DISK_BYTES: u64 = 64 << 20;
/// Bound on one guest run (boot, script, power-off); run-guest.sh kills QEMU after it.
const GUEST_TIMEOUT_S: u64 = 90;
/// Bound on the daemon creating its socket.
const SOCKET_WAIT: Duration = Duration::from_secs(20);
/// Bound on the daemon exiting after SIGTERM.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(5);
/// Guest memory; the memfd backend must have the same size.
const GUEST_MEM: &str = "512M";

/// Which vhost-user-blk backend the guests talk to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backend {
    /// `fastlane serve` (the point of the test).
    Fastlane,
    /// qemu-storage-daemon, the reference (`FASTLANE_VM_BLK_BACKEND=qsd`).
    Qsd,
}

/// A file removed on drop.
struct TempFile(PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}

/// A running backend daemon; killed on drop unless it already exited.
struct BackendProcess {
    child: Option<Child>,
    name: &'static str,
    socket: PathBuf,
    log: PathBuf,
}

impl BackendProcess {
    fn start(
        backend: Backend,
        socket: &Path,
        image: &Path,
        queues: u32,
        readonly: bool,
        hlog: Option<&Path>,
        log: PathBuf,
    ) -> BackendProcess {
        let mut cmd;
        let name;
        match backend {
            Backend::Fastlane => {
                name = "fastlane serve";
                cmd = common::cli::command();
                cmd.arg("serve")
                    .arg("--socket")
                    .arg(socket)
                    .arg("--backend")
                    .arg(format!("file:{}", image.display()))
                    .arg("--queues")
                    .arg(queues.to_string())
                    .arg("--serial")
                    .arg("fl-vm-test");
                if readonly {
                    cmd.arg("--readonly");
                }
                if let Some(h) = hlog {
                    cmd.arg("--hlog").arg(h);
                }
                cmd.env("RUST_LOG", std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()));
            }
            Backend::Qsd => {
                name = "qemu-storage-daemon";
                cmd = Command::new("qemu-storage-daemon");
                cmd.arg("--blockdev")
                    .arg(format!(
                        "driver=file,node-name=disk0,filename={},discard=unmap{}",
                        image.display(),
                        if readonly { ",read-only=on" } else { "" }
                    ))
                    .arg("--export")
                    .arg(format!(
                        "type=vhost-user-blk,id=exp0,node-name=disk0,addr.type=unix,\
                         addr.path={},writable={},num-queues={queues}",
                        socket.display(),
                        if readonly { "off" } else { "on" }
                    ));
            }
        }
        BackendProcess::spawn(cmd, name, socket, log)
    }

    /// Start `cmd` with its output in `log`.
    fn spawn(mut cmd: Command, name: &'static str, socket: &Path, log: PathBuf) -> BackendProcess {
        let out = fs::File::create(&log).expect("create daemon log");
        let err = out.try_clone().expect("dup daemon log");
        cmd.stdin(Stdio::null()).stdout(out).stderr(err);
        let child = cmd.spawn().unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        eprintln!("vm_blk: started {name} (pid {}): {cmd:?}", child.id());
        BackendProcess { child: Some(child), name, socket: socket.to_path_buf(), log }
    }

    fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Wait until the socket exists; Err if the daemon exits or time runs out.
    fn wait_for_socket(&mut self) -> Result<Duration, String> {
        let t0 = Instant::now();
        loop {
            if fs::metadata(&self.socket).is_ok_and(|m| m.file_type().is_socket()) {
                return Ok(t0.elapsed());
            }
            if let Some(st) = self.try_wait() {
                return Err(format!("{} exited ({st}) before creating its socket", self.name));
            }
            if t0.elapsed() > SOCKET_WAIT {
                return Err(format!(
                    "{} did not create {} within {SOCKET_WAIT:?}",
                    self.name,
                    self.socket.display()
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn try_wait(&mut self) -> Option<ExitStatus> {
        self.child.as_mut().and_then(|c| c.try_wait().ok().flatten())
    }

    /// SIGTERM, then wait up to `SHUTDOWN_WAIT`: the exit status and how long it took, or None
    /// (the daemon is then killed).
    fn terminate(&mut self) -> Option<(ExitStatus, Duration)> {
        let child = self.child.as_mut()?;
        let t0 = Instant::now();
        if let Ok(pid) = libc::pid_t::try_from(child.id()) {
            // SAFETY:
            // - `pid` is our own child, not yet reaped (`try_wait` has not returned it), so the
            //   id cannot have been reused; kill only sends a signal.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
        loop {
            if let Ok(Some(st)) = child.try_wait() {
                self.child = None;
                return Some((st, t0.elapsed()));
            }
            if t0.elapsed() > SHUTDOWN_WAIT {
                let _ = child.kill();
                let _ = child.wait();
                self.child = None;
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for BackendProcess {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// What one guest run printed.
struct GuestRun {
    label: String,
    status: Option<i32>,
    stdout: String,
    stderr: String,
    elapsed: Duration,
}

/// One `RESULT wrote|read NAME OFFSET LEN SHA` line.
#[derive(Debug, Clone)]
struct Range {
    name: String,
    offset: u64,
    len: u64,
    sha: String,
}

impl GuestRun {
    fn results(&self) -> impl Iterator<Item = &str> {
        self.stdout.lines().filter_map(|l| l.strip_prefix("RESULT "))
    }

    /// `RESULT key=value`: the value (the rest of the line), last occurrence.
    fn scalar(&self, key: &str) -> Option<String> {
        let prefix = format!("{key}=");
        self.results().filter_map(|r| r.strip_prefix(&prefix)).last().map(str::to_string)
    }

    fn number(&self, key: &str) -> Option<i64> {
        self.scalar(key).and_then(|v| v.trim().parse().ok())
    }

    /// `RESULT <kind> NAME OFFSET LEN SHA` lines (kind: wrote or read).
    fn ranges(&self, kind: &str) -> Vec<Range> {
        self.results()
            .filter_map(|r| {
                let mut it = r.split_whitespace();
                if it.next()? != kind {
                    return None;
                }
                Some(Range {
                    name: it.next()?.to_string(),
                    offset: it.next()?.parse().ok()?,
                    len: it.next()?.parse().ok()?,
                    sha: it.next()?.to_string(),
                })
            })
            .collect()
    }

    fn range(&self, kind: &str, name: &str) -> Option<Range> {
        self.ranges(kind).into_iter().find(|r| r.name == name)
    }

    /// `RESULT check NAME FAIL …` lines.
    fn failed_checks(&self) -> Vec<String> {
        self.results()
            .filter(|r| r.starts_with("check ") && r.split_whitespace().nth(2) == Some("FAIL"))
            .map(str::to_string)
            .collect()
    }

    fn dump(&self) -> String {
        format!(
            "--- guest {} (status {:?}, {:.1}s) stdout ---\n{}\n--- stderr ---\n{}",
            self.label,
            self.status,
            self.elapsed.as_secs_f64(),
            self.stdout,
            self.stderr
        )
    }
}

/// Boot a guest running `tests/vm/guest-blk.sh` in `phase` against the socket.
fn run_guest(phase: &str, smp: u32, num_queues: u32, socket: &Path) -> GuestRun {
    let t0 = Instant::now();
    let out = Guest::new(env!("CARGO_MANIFEST_DIR"), "tests/vm/guest-blk.sh")
        .smp(smp)
        .mem(GUEST_MEM)
        .timeout_s(GUEST_TIMEOUT_S)
        .append(&format!("fl_blk_phase={phase}"))
        .vhost_user_blk(socket, num_queues, false)
        .output();
    let run = GuestRun {
        label: phase.to_string(),
        status: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        elapsed: t0.elapsed(),
    };
    eprintln!(
        "vm_blk: guest {phase}: status {:?} in {:.1}s",
        run.status,
        run.elapsed.as_secs_f64()
    );
    run
}

/// sha256 (hex) of `len` bytes of `path` at `offset`, by the host's `sha256sum`.
fn host_sha256(path: &Path, offset: u64, len: u64) -> String {
    let mut f = fs::File::open(path).expect("open backing file");
    f.seek(SeekFrom::Start(offset)).expect("seek backing file");
    let mut buf = vec![0u8; len as usize];
    f.read_exact(&mut buf).expect("read backing file");
    sha256_hex(&buf)
}

fn sha256_hex(data: &[u8]) -> String {
    let mut child = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("run sha256sum");
    child.stdin.take().expect("stdin").write_all(data).expect("feed sha256sum");
    let out = child.wait_with_output().expect("sha256sum output");
    assert!(out.status.success(), "sha256sum failed");
    String::from_utf8_lossy(&out.stdout).split_whitespace().next().unwrap_or("").to_string()
}

/// Collected assertions: every check is printed; the test fails at the end with all failures
/// and the logs that explain them.
#[derive(Default)]
struct Checks {
    failures: Vec<String>,
    passes: usize,
}

impl Checks {
    fn check(&mut self, ok: bool, what: impl AsRef<str>) -> bool {
        if ok {
            eprintln!("vm_blk: ok   {}", what.as_ref());
            self.passes += 1;
        } else {
            eprintln!("vm_blk: FAIL {}", what.as_ref());
            self.failures.push(what.as_ref().to_string());
        }
        ok
    }
}

/// Per-queue request counts from the daemon's `.hlog` (tags `queue<N>`).
fn hlog_queue_counts(path: &Path, queues: u32) -> Result<Vec<u64>, String> {
    let log =
        fastlane_hist::read_hlog(path).map_err(|e| format!("read {}: {e}", path.display()))?;
    Ok((0..queues)
        .map(|q| log.merged_for_tag(Some(&format!("queue{q}"))).map_or(0, |h| h.len()))
        .collect())
}

/// The guest-side checks common to every phase; returns the guest's ranges read back.
fn check_guest_basics(c: &mut Checks, g: &GuestRun, cpus: u32, queues: u32) {
    c.check(
        g.scalar("phase").as_deref() == Some(g.label.as_str()),
        format!("[{}] guest ran its script (phase line present)", g.label),
    );
    let sectors = g.number("sectors");
    c.check(
        sectors == Some((DISK_BYTES / 512) as i64),
        format!("[{}] guest sees a {DISK_BYTES}-byte disk: sectors = {sectors:?}", g.label),
    );
    let cpus_seen = g.number("cpus");
    c.check(cpus_seen == Some(i64::from(cpus)), format!("[{}] cpus = {cpus_seen:?}", g.label));
    let mq = g.number("mq_queues");
    c.check(
        mq == Some(i64::from(queues)),
        format!("[{}] /sys/block/vda/mq has {queues} entries: {mq:?}", g.label),
    );
    let failed = g.failed_checks();
    c.check(failed.is_empty(), format!("[{}] guest-side checks: failed {failed:?}", g.label));
}

/// Every range `wrote` lists was read back by `g` with the same checksum.
fn check_readback(c: &mut Checks, wrote: &[Range], g: &GuestRun) {
    for w in wrote {
        let r = g.range("read", &w.name);
        c.check(
            r.as_ref().is_some_and(|r| r.sha == w.sha && r.offset == w.offset && r.len == w.len),
            format!(
                "[{}] range {} (byte {}, {} B) reads back what was written: wrote {}, read {:?}",
                g.label,
                w.name,
                w.offset,
                w.len,
                w.sha,
                r.map(|r| r.sha)
            ),
        );
    }
}

/// The daemon's last per-queue totals (`queue N: … ok, …, F flushes, D discards` lines after
/// the last `totals` log line): (flushes, discards) summed over queues, None if absent.
fn daemon_totals(log: &str) -> Option<(u64, u64)> {
    let lines: Vec<&str> = log.lines().collect();
    let last = lines.iter().rposition(|l| l.contains("totals"))?;
    let mut found = None;
    for line in lines[last + 1..].iter().take_while(|l| l.starts_with("queue ")) {
        let count = |what: &str| {
            line.split(", ").find_map(|f| f.strip_suffix(what)?.trim().parse::<u64>().ok())
        };
        let (f, d) = (count(" flushes")?, count(" discards")?);
        let t = found.get_or_insert((0, 0));
        t.0 += f;
        t.1 += d;
    }
    found
}

#[test]
fn vhost_user_blk_serve_with_a_real_guest() {
    fastlane_guest_tests::guest::require_qemu();
    let backend = match std::env::var("FASTLANE_VM_BLK_BACKEND").as_deref() {
        Ok("qsd") => Backend::Qsd,
        _ => Backend::Fastlane,
    };
    let fastlane = backend == Backend::Fastlane;
    let t_all = Instant::now();
    let tmp = tempfile::Builder::new().prefix("fl-vmblk").tempdir().expect("tempdir");
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let image = TempFile(PathBuf::from(format!(
        "/dev/shm/fastlane-vmblk-{}-{nanos}.img",
        std::process::id()
    )));
    fs::File::create(&image.0).and_then(|f| f.set_len(DISK_BYTES)).expect("create backing file");
    let socket = tmp.path().join("blk.sock");
    let hlog = tmp.path().join("serve.hlog");
    let mut c = Checks::default();
    let mut logs = String::new();

    // --- 1. read-write daemon, two queues; first guest writes ---------------------------------
    let mut daemon = BackendProcess::start(
        backend,
        &socket,
        &image.0,
        2,
        false,
        Some(&hlog),
        tmp.path().join("daemon-rw.log"),
    );
    if let Err(e) = daemon.wait_for_socket() {
        panic!("{e}\n--- daemon log ---\n{}", daemon.log_text());
    }
    let g1 = run_guest("write", 2, 2, &socket);
    logs.push_str(&g1.dump());
    c.check(
        g1.status == Some(0),
        format!("[write] guest exit status {:?} (0 expected)", g1.status),
    );
    check_guest_basics(&mut c, &g1, 2, 2);
    c.check(g1.number("ro") == Some(0), format!("[write] ro = {:?}", g1.scalar("ro")));

    let wrote = g1.ranges("wrote");
    c.check(wrote.len() >= 4, format!("[write] guest wrote {} ranges (4 expected)", wrote.len()));
    check_readback(&mut c, &wrote, &g1);

    // 2 queues, 2 vCPUs: each CPU's I/O went to its own hardware queue (guest view).
    for q in 0..2 {
        let d = g1.number(&format!("hctx{q}_runs_delta"));
        c.check(
            d.is_some_and(|d| d > 0),
            format!("[write] guest hardware queue {q} was run during the pinned writes: {d:?}"),
        );
    }

    // Flush: the device offers a write cache, and fsync made the guest send a flush that
    // completed (dd conv=fsync succeeded: a guest-side check).
    let wc = g1.scalar("write_cache");
    let flushes = g1.number("flushes_delta");
    if fastlane {
        c.check(
            wc.as_deref() == Some("write back"),
            format!(
                "[write] device advertises a volatile write cache (FLUSH): write_cache = {wc:?}"
            ),
        );
        c.check(
            flushes.is_some_and(|n| n > 0),
            format!("[write] guest completed flush requests after fsync: {flushes:?}"),
        );
    } else {
        eprintln!("vm_blk: note write_cache = {wc:?}, flushes_delta = {flushes:?} (reference)");
    }

    // Discard: the range read back as zeroes in the guest.
    let discard_max = g1.number("discard_max_bytes");
    c.check(
        discard_max.is_some_and(|n| n > 0),
        format!("[write] device offers discard: discard_max_bytes = {discard_max:?}"),
    );
    let discards = g1.number("discards_delta");
    c.check(
        discards.is_some_and(|n| n > 0),
        format!("[write] guest completed discard requests: {discards:?}"),
    );
    let zero = g1.scalar("zero_sha256").unwrap_or_default();
    let before = g1.range("read", "discard_before");
    let after = g1.range("read", "discard");
    c.check(
        before.as_ref().is_some_and(|b| b.sha != zero),
        format!("[write] discard range held data before the discard: {before:?}"),
    );
    c.check(
        after.as_ref().is_some_and(|a| !zero.is_empty() && a.sha == zero),
        format!("[write] discard range reads back as zeroes in the guest: {after:?}, zero {zero}"),
    );

    // Host: the backing file holds what the guest wrote, and zeroes where it discarded.
    for w in &wrote {
        let h = host_sha256(&image.0, w.offset, w.len);
        c.check(
            h == w.sha,
            format!(
                "[host] backing file at byte {} ({} B, range {}) = guest data: {h} vs {}",
                w.offset, w.len, w.name, w.sha
            ),
        );
    }
    if let Some(a) = &after {
        let h = host_sha256(&image.0, a.offset, a.len);
        c.check(h == zero, format!("[host] discarded range is zeroes in the backing file: {h}"));
    }

    // --- 2. reconnect: a second guest on the same daemon ---------------------------------------
    let alive = daemon.try_wait();
    c.check(alive.is_none(), format!("daemon survived the first guest's disconnect: {alive:?}"));
    if alive.is_none() {
        let g2 = run_guest("verify", 2, 2, &socket);
        logs.push_str(&g2.dump());
        c.check(
            g2.status == Some(0),
            format!("[verify] guest exit status {:?} (0 expected)", g2.status),
        );
        check_guest_basics(&mut c, &g2, 2, 2);
        check_readback(&mut c, &wrote, &g2);
        let d = g2.range("read", "discard");
        c.check(
            d.as_ref().is_some_and(|d| d.sha == zero),
            format!("[verify] discarded range still reads as zeroes: {d:?}"),
        );
    }

    // --- 3. clean shutdown ----------------------------------------------------------------------
    let term = daemon.terminate();
    let rw_log = daemon.log_text();
    let _ = writeln!(logs, "--- {} (read-write) log ---\n{rw_log}", daemon.name);
    c.check(
        term.is_some_and(|(st, _)| st.success()),
        format!("daemon exits 0 within {SHUTDOWN_WAIT:?} of SIGTERM: {term:?}"),
    );
    if fastlane {
        c.check(!socket.exists(), "daemon removed its socket on shutdown");
        // The daemon's own view: it counted the flush and the discard.
        let totals = daemon_totals(&rw_log);
        c.check(
            totals.is_some_and(|(f, _)| f > 0),
            format!("daemon's final totals count flush requests: (flushes, discards) = {totals:?}"),
        );
        c.check(
            totals.is_some_and(|(_, d)| d > 0),
            format!(
                "daemon's final totals count discard requests: (flushes, discards) = {totals:?}"
            ),
        );
        c.check(hlog.exists(), format!("--hlog file {} exists", hlog.display()));
        let hist = common::cli::command().arg("hist").arg(&hlog).output();
        let hist_ok = hist.as_ref().is_ok_and(|o| o.status.success());
        c.check(
            hist_ok,
            format!(
                "fastlane hist reads the --hlog: {}",
                hist.as_ref()
                    .map(|o| format!(
                        "{}{}",
                        String::from_utf8_lossy(&o.stdout),
                        String::from_utf8_lossy(&o.stderr)
                    ))
                    .unwrap_or_else(|e| e.to_string())
            ),
        );
        match hlog_queue_counts(&hlog, 2) {
            Ok(counts) => {
                c.check(
                    counts.iter().all(|&n| n > 0),
                    format!(
                        "daemon saw requests on both queues (hlog counts per queue): {counts:?}"
                    ),
                );
            }
            Err(e) => {
                c.check(false, format!("hlog per-queue counts: {e}"));
            }
        }
    } else {
        let _ = fs::remove_file(&socket);
    }
    drop(daemon);

    // --- 4. read-only export ------------------------------------------------------------------
    let sha_before = host_sha256(&image.0, 0, DISK_BYTES);
    let socket_ro = tmp.path().join("blk-ro.sock");
    let mut ro = BackendProcess::start(
        backend,
        &socket_ro,
        &image.0,
        1,
        true,
        None,
        tmp.path().join("daemon-ro.log"),
    );
    match ro.wait_for_socket() {
        Err(e) => {
            c.check(false, format!("[readonly] {e}"));
        }
        Ok(_) => {
            let g3 = run_guest("readonly", 1, 1, &socket_ro);
            logs.push_str(&g3.dump());
            c.check(
                g3.status == Some(0),
                format!("[readonly] guest exit status {:?} (0 expected)", g3.status),
            );
            check_guest_basics(&mut c, &g3, 1, 1);
            c.check(
                g3.number("ro") == Some(1),
                format!("[readonly] /sys/block/vda/ro = {:?}", g3.scalar("ro")),
            );
            check_readback(&mut c, &wrote, &g3);
            let wexit = g3.number("ro_write_exit");
            c.check(
                wexit.is_some_and(|n| n != 0),
                format!(
                    "[readonly] an O_DIRECT write fails: dd exit {wexit:?}, {:?}",
                    g3.scalar("ro_write_error")
                ),
            );
            let sha_after = host_sha256(&image.0, 0, DISK_BYTES);
            c.check(sha_after == sha_before, "[readonly] backing file unchanged");
        }
    }
    let term = ro.terminate();
    let _ = writeln!(logs, "--- {} (read-only) log ---\n{}", ro.name, ro.log_text());
    c.check(
        term.is_some_and(|(st, _)| st.success()),
        format!("[readonly] daemon exits 0 after SIGTERM: {term:?}"),
    );
    if fastlane {
        c.check(!socket_ro.exists(), "[readonly] daemon removed its socket on shutdown");
    }
    drop(ro);

    // --- 5. started the way systemd starts it -------------------------------------------------
    // `systemd-socket-activate` creates the socket, waits for QEMU to connect and execs the
    // daemon with the socket as fd 3 (LISTEN_FDS); READY=1 arrives on the test's
    // NOTIFY_SOCKET; the guest reads back what the first guest wrote.
    if fastlane {
        let socket_sa = tmp.path().join("blk-activated.sock");
        let notify_path = tmp.path().join("notify");
        let notify = common::daemon::Notify::bind(&notify_path);
        let mut cmd = Command::new("systemd-socket-activate");
        cmd.env("NOTIFY_SOCKET", &notify_path)
            .args(["-E", "NOTIFY_SOCKET", "-E", "RUST_LOG", "-l"])
            .arg(&socket_sa)
            .arg(common::cli::FASTLANE)
            .args(["serve", "--queues", "2", "--blk-file"])
            .arg(&image.0)
            .env("RUST_LOG", "info");
        let mut sa = BackendProcess::spawn(
            cmd,
            "socket-activated fastlane serve",
            &socket_sa,
            tmp.path().join("daemon-sa.log"),
        );
        match sa.wait_for_socket() {
            Err(e) => {
                c.check(false, format!("[activated] {e}"));
            }
            Ok(_) => {
                let ready = std::thread::spawn(move || notify.recv());
                let g4 = run_guest("verify", 2, 2, &socket_sa);
                logs.push_str(&g4.dump());
                c.check(
                    g4.status == Some(0),
                    format!("[activated] guest exit status {:?} (0 expected)", g4.status),
                );
                check_guest_basics(&mut c, &g4, 2, 2);
                check_readback(&mut c, &wrote, &g4);
                let ready = ready.join().expect("notify reader");
                c.check(
                    ready.as_ref().is_ok_and(|r| r.contains("READY=1") && r.contains("LISTEN_FDS")),
                    format!("[activated] READY=1 on NOTIFY_SOCKET, serving fd 3: {ready:?}"),
                );
            }
        }
        let term = sa.terminate();
        let sa_log = sa.log_text();
        let _ = writeln!(logs, "--- {} log ---\n{sa_log}", sa.name);
        c.check(
            term.is_some_and(|(st, _)| st.success()),
            format!("[activated] daemon exits 0 after SIGTERM: {term:?}"),
        );
        c.check(
            sa_log.contains("listening on fd 3 (LISTEN_FDS"),
            "[activated] the daemon served the socket systemd passed (fd 3)",
        );
    }

    eprintln!(
        "vm_blk: {} checks passed, {} failed, {:.1}s in all ({backend:?})",
        c.passes,
        c.failures.len(),
        t_all.elapsed().as_secs_f64()
    );
    if !c.failures.is_empty() {
        panic!(
            "{} vhost-user-blk guest check(s) failed:\n  {}\n{logs}",
            c.failures.len(),
            c.failures.join("\n  ")
        );
    }
}
