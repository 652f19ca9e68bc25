//! The `fastlane-disk` binary on its own: its help says what it is and names `fastlane serve`'s
//! flags, and a backend that cannot be opened or a size that does not parse fails at start
//! with exit status 1 and an error naming the problem, before any socket is bound.

use std::process::Command;

const DISK: &str = env!("CARGO_BIN_EXE_fastlane-disk");

/// Runs `fastlane-disk args`: exit code, stdout, stderr.
fn run(args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(DISK).args(args).env_remove("LISTEN_FDS").output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_help_says_what_it_is_and_names_the_flags() {
    let (code, help, err) = run(&["--help"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(help.contains("vhost-user-blk backend"), "{help}");
    assert!(help.contains("fastlane serve"), "{help}");
    for flag in [
        "--socket-path",
        "--fd",
        "--print-capabilities",
        "--backend",
        "--blk-file",
        "--queues",
        "--read-only",
        "--direct",
        "--io",
        "--poll-us",
        "--hlog",
        "--serial",
        "--metrics",
        "--own-inflight-region",
        "--stats-interval",
        "--log-format",
    ] {
        assert!(help.contains(flag), "--help names {flag}: {help}");
    }
    assert!(help.contains("[default: mem:256M]"), "{help}");
}

#[test]
fn a_backend_that_cannot_open_fails_naming_it_and_binds_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s.sock");
    let missing = dir.path().join("no-such-disk.img");
    let (code, _, err) =
        run(&["--socket-path", sock.to_str().unwrap(), "--blk-file", missing.to_str().unwrap()]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("cannot open backend") && err.contains("no-such-disk.img"), "{err}");
    assert!(!sock.exists(), "nothing was bound for a backend that cannot open");

    let (code, _, err) = run(&["--socket-path", sock.to_str().unwrap(), "--backend", "mem:12Q"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("bad --backend"), "{err}");
    assert!(!sock.exists());
}
