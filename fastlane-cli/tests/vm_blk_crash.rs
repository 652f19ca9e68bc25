//! A backend crash loses no guest request: `fastlane serve` (io_uring, O_DIRECT `file:` backend,
//! two queues, so completions come back out of order) is SIGKILLed and restarted at random
//! moments while a real QEMU guest runs Debian's fio with CRC32C verification at QD32 on both
//! queues (`tests/vm/guest-blk-fio.sh`). QEMU (`-chardev socket,reconnect=1`) reattaches to
//! each new backend and hands it the in-flight region, from which the backend resubmits what
//! was in flight.
//!
//! Passes when: fio exits 0 with no error and no verify failure, the guest finishes within its
//! bound (a request lost would hang fio), every restart was reattached, and the backends
//! together logged more than 0 resubmissions (the path was exercised, not just survived).
//!
//! `FASTLANE_VM_BLK_KILLS` sets the number of kills (default 20; 50 for the longer run by
//! hand). The seed of the kill schedule is printed and can be fixed with
//! `FASTLANE_VM_BLK_SEED`.

mod common;

use std::fs;
use std::io::BufReader;
use std::os::unix::fs::FileTypeExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fastlane_guest_tests::Guest;

/// Disk size: two fio jobs of 24 MiB each.
const DISK_BYTES: u64 = 48 << 20;
const GUEST_MEM: &str = "512M";
const KILLS_DEFAULT: u32 = 20;
/// How long a restarted backend may take to be reattached by QEMU (it retries every second).
const REATTACH_WAIT: Duration = Duration::from_secs(20);

fn have(cmd: &str, arg: &str) -> bool {
    Command::new(cmd).arg(arg).output().is_ok_and(|o| o.status.success())
}

/// SplitMix64, for the kill schedule.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn between_ms(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.next() % (hi - lo + 1))
    }
}

/// One backend process; SIGKILLed on drop.
struct Backend {
    child: Child,
    log: PathBuf,
}

impl Backend {
    fn start(socket: &Path, image: &Path, log: PathBuf) -> Backend {
        let out = fs::File::create(&log).expect("backend log");
        let err = out.try_clone().expect("dup log");
        let child = common::cli::command()
            .args(["serve", "--socket-path"])
            .arg(socket)
            .arg("--blk-file")
            .arg(image)
            .args(["--direct", "--queues", "2", "--stats-interval", "0.5"])
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .expect("start fastlane serve");
        Backend { child, log }
    }

    fn text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Wait until the log has `what`; Err with the log if the process exits or time runs out.
    fn wait_log(&mut self, what: &str, limit: Duration) -> Result<(), String> {
        let t0 = Instant::now();
        loop {
            if self.text().contains(what) {
                return Ok(());
            }
            if let Ok(Some(st)) = self.child.try_wait() {
                return Err(format!("backend exited ({st}) before {what:?}:\n{}", self.text()));
            }
            if t0.elapsed() > limit {
                return Err(format!("no {what:?} within {limit:?}:\n{}", self.text()));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether a `--stats-interval` line shows the guest writing.
    fn writing(&self) -> bool {
        self.text().lines().filter(|l| l.contains("stats: ")).any(|l| {
            l.split(" MB/s written")
                .next()
                .and_then(|head| head.rsplit(' ').next())
                .and_then(|v| v.parse::<f64>().ok())
                .is_some_and(|mb| mb > 0.0)
        })
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn terminate(&mut self) -> Option<std::process::ExitStatus> {
        let st = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status();
        assert!(st.is_ok_and(|s| s.success()));
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Sum of `resubmitted N request(s)` over a backend log.
fn resubmitted(log: &str) -> u64 {
    log.lines()
        .filter_map(|l| {
            l.split("resubmitted ").nth(1)?.split_whitespace().next()?.parse::<u64>().ok()
        })
        .sum()
}

#[test]
fn backend_sigkilled_under_fio_verify_loses_no_request() {
    assert!(
        have("qemu-system-x86_64", "--version") && have("fio", "--version"),
        "qemu-system-x86_64 and fio are needed (.ci/install-deps.sh installs them)"
    );
    let kills: u32 = std::env::var("FASTLANE_VM_BLK_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(KILLS_DEFAULT);
    let seed: u64 = std::env::var("FASTLANE_VM_BLK_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    eprintln!("vm_blk_crash: {kills} kills, seed {seed} (FASTLANE_VM_BLK_SEED={seed} repeats it)");
    let mut rng = Rng(seed);

    // O_DIRECT needs a real file system: the target dir, not /dev/shm (tmpfs).
    let tmp = tempfile::Builder::new()
        .prefix("vm-blk-crash")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .expect("tempdir");
    let image = tmp.path().join("disk.img");
    fs::File::create(&image).and_then(|f| f.set_len(DISK_BYTES)).expect("disk image");
    let socket = tmp.path().join("blk.sock");

    let mut logs: Vec<PathBuf> = Vec::new();
    let next_log = |logs: &mut Vec<PathBuf>| {
        let p = tmp.path().join(format!("backend-{}.log", logs.len()));
        logs.push(p.clone());
        p
    };
    let mut backend = Backend::start(&socket, &image, next_log(&mut logs));
    backend.wait_log("listening on", Duration::from_secs(20)).unwrap_or_else(|e| panic!("{e}"));
    assert!(fs::metadata(&socket).is_ok_and(|m| m.file_type().is_socket()));

    // Time for the kills (each: up to 1.5 s of I/O, the reattach, about a second) and 10 s
    // after the last one.
    let fio_seconds = u64::from(kills) * 5 / 2 + 10;
    let mut guest = Guest::new(env!("CARGO_MANIFEST_DIR"), "tests/vm/guest-blk-fio.sh")
        .bin("/usr/bin/fio")
        .smp(2)
        .mem(GUEST_MEM)
        .timeout_s(fio_seconds + 150)
        .append(&format!("fl_fio_seconds={fio_seconds}"))
        .vhost_user_blk(&socket, 2, true)
        .command()
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run tests/vm/run-guest.sh");
    // The guest's console reaches us when it exits; the backend's stats lines say when fio
    // is writing.
    let out = guest.stdout.take().expect("guest stdout");
    let reader = std::thread::spawn(move || {
        let mut all = String::new();
        let _ = std::io::Read::read_to_string(&mut BufReader::new(out), &mut all);
        all
    });
    let t0 = Instant::now();
    while !backend.writing() {
        if t0.elapsed() > Duration::from_secs(180) || matches!(guest.try_wait(), Ok(Some(_))) {
            let _ = guest.kill();
            let _ = guest.wait();
            panic!(
                "the guest did not start writing within 180 s:\n{}\n--- backend ---\n{}",
                reader.join().unwrap_or_default(),
                backend.text()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }

    let mut failures = Vec::new();
    let t_kills = Instant::now();
    let mut done = 0;
    for k in 0..kills {
        // Let the new backend carry I/O for a while, then kill it mid-flight.
        std::thread::sleep(rng.between_ms(300, 1500));
        backend.kill();
        std::thread::sleep(rng.between_ms(0, 300));
        backend = Backend::start(&socket, &image, next_log(&mut logs));
        if let Err(e) = backend.wait_log("frontend connected", REATTACH_WAIT) {
            failures.push(format!("kill {k}: QEMU did not reattach: {e}"));
            break;
        }
        done += 1;
    }
    eprintln!("vm_blk_crash: {done} kills and restarts in {:.1}s", t_kills.elapsed().as_secs_f64());

    let status = guest.wait().expect("guest exit");
    let mut err = String::new();
    if let Some(mut e) = guest.stderr.take() {
        let _ = std::io::Read::read_to_string(&mut e, &mut err);
    }
    let stdout = reader.join().unwrap_or_default();
    let term = backend.terminate();
    let backend_logs: Vec<String> =
        logs.iter().map(|p| fs::read_to_string(p).unwrap_or_default()).collect();
    let resubmissions: u64 = backend_logs.iter().map(|l| resubmitted(l)).sum();
    let scalar = |key: &str| {
        stdout
            .lines()
            .rev()
            .find_map(|l| l.strip_prefix(&format!("RESULT {key}=")))
            .and_then(|v| v.trim().parse::<i64>().ok())
    };
    eprintln!(
        "vm_blk_crash: fio exit {:?}, errors {:?}, {:?} KiB moved; {resubmissions} request(s) resubmitted over {} backends",
        scalar("fio_exit"),
        scalar("fio_errors"),
        scalar("fio_kib"),
        logs.len()
    );
    if done != kills {
        failures.push(format!("{done} of {kills} kills were reattached"));
    }
    if !status.success() {
        failures.push(format!("guest exit status {status} (fio failed or the run hung)"));
    }
    if scalar("fio_exit") != Some(0) {
        failures.push(format!("fio exit {:?} (verify failure or I/O error)", scalar("fio_exit")));
    }
    if scalar("fio_errors") != Some(0) {
        failures.push(format!("fio errors {:?}", scalar("fio_errors")));
    }
    if scalar("fio_kib").is_none_or(|k| k <= 0) {
        failures.push(format!("fio moved no data: {:?}", scalar("fio_kib")));
    }
    if resubmissions == 0 {
        failures
            .push("no backend resubmitted anything: the in-flight path was not exercised".into());
    }
    if !term.is_some_and(|s| s.success()) {
        failures.push(format!("the last backend did not exit 0 on SIGTERM: {term:?}"));
    }
    if !failures.is_empty() {
        let last_logs: Vec<&String> = backend_logs.iter().rev().take(3).collect();
        panic!(
            "{} failure(s):\n  {}\n--- guest stdout ---\n{stdout}\n--- guest stderr ---\n{err}\n--- last backend logs ---\n{last_logs:?}",
            failures.len(),
            failures.join("\n  ")
        );
    }
}
