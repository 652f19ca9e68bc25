//! Running the `fastlane` binary of this build from a test.

#![allow(dead_code)]

use std::process::{Command, Output};

/// The path of this build's `fastlane` binary (for tools that run it: systemd's socket
/// activation, a guest's file list, the Python tests).
pub const FASTLANE: &str = env!("CARGO_BIN_EXE_fastlane");

/// `fastlane` with no arguments yet.
pub fn command() -> Command {
    Command::new(FASTLANE)
}

/// Runs `fastlane ARGS` to its end.
pub fn fastlane(args: &[&str]) -> Output {
    command().args(args).output().expect("run fastlane")
}

/// Runs `fastlane ARGS`, which must succeed; its stdout.
pub fn ok(args: &[&str]) -> String {
    let out = fastlane(args);
    assert!(
        out.status.success(),
        "fastlane {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 stdout")
}
