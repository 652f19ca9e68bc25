//! The Python client (`python/fastlane_kv`) against a real `fastlane kv serve`: runs its
//! unittest suite (`python/tests`) with this build's binary, so `cargo test --workspace`
//! runs the Python tests too. Each Python test starts and stops its own server.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The interpreter CI installs (Debian 12's `python3`, 3.11; the client needs 3.9+).
const PYTHON: &str = "/usr/bin/python3";
/// Bound on the whole suite (about 1 s here); the child is killed past it.
const SUITE_WAIT_MAX: Duration = Duration::from_secs(300);

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("fastlane-cli/ has a parent")
        .to_path_buf()
}

#[test]
fn python_client_unittests_pass_against_kv_serve() {
    assert!(
        Path::new(PYTHON).is_file(),
        "{PYTHON} not found: the Python client tests (python/tests) need python3 3.9 or later \
         (Debian/Ubuntu: apt-get install python3)"
    );
    let root = repo_root();
    let out_dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let (out_path, err_path) = (out_dir.path().join("stdout"), out_dir.path().join("stderr"));
    let mut child = Command::new(PYTHON)
        .args(["-m", "unittest", "discover", "-s", "python/tests", "-v"])
        .current_dir(&root)
        .env("FASTLANE_BIN", common::cli::FASTLANE)
        // No __pycache__ in the source tree; no user site-packages shadowing the package.
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("PYTHONNOUSERSITE", "1")
        .env("PYTHONPATH", root.join("python"))
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {PYTHON}: {e}"));
    let deadline = Instant::now() + SUITE_WAIT_MAX;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let stdout = std::fs::read_to_string(&out_path).unwrap_or_default();
    let stderr = std::fs::read_to_string(&err_path).unwrap_or_default();
    let Some(status) = status else {
        panic!("python tests ran past {SUITE_WAIT_MAX:?} and were killed\n{stdout}\n{stderr}");
    };
    // unittest reports on stderr: one line per test, then "OK" or "FAILED (...)".
    assert!(status.success(), "python tests failed ({status}):\n{stdout}\n{stderr}");
    assert!(stderr.contains("\nOK"), "no OK from unittest:\n{stderr}");
    assert!(!stderr.contains("skipped"), "python tests skipped:\n{stderr}");
    let ran = stderr
        .lines()
        .find_map(|l| l.strip_prefix("Ran ")?.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(0);
    assert!(ran >= 10, "only {ran} python tests ran:\n{stderr}");
}
