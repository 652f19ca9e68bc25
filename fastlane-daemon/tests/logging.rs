//! The logger as a process sees it: the test binary runs itself again as a child (one global
//! logger per process) with `RUST_LOG` and a format, and reads the child's stderr.

use std::process::Command;

use fastlane_daemon::logging::{init, LogFormat};

const CHILD: &str = "FASTLANE_LOG_TEST_CHILD";

/// In the child: install the logger and write one record at each level from two targets.
fn child(format: &str) {
    let installed = init(format.parse().expect("format"));
    assert!(installed, "first init installs");
    assert!(!init(LogFormat::Text), "a second init changes nothing");
    log::info!(target: "fastlane_a", "info from a");
    log::debug!(target: "fastlane_a", "debug from a");
    log::debug!(target: "fastlane_b::inner", "debug from b");
    tracing::trace!(target: "fastlane_b::inner", step_us = 42u64, given_up = false, "a step");
}

/// Runs `test` of this binary as a child with these settings; its stderr.
fn run_child(test: &str, format: &str, rust_log: Option<&str>) -> String {
    let mut cmd = Command::new(std::env::current_exe().expect("test binary"));
    cmd.args(["--exact", test, "--nocapture", "--test-threads", "1"]).env(CHILD, format);
    match rust_log {
        Some(v) => cmd.env("RUST_LOG", v),
        None => cmd.env_remove("RUST_LOG"),
    };
    let out = cmd.output().expect("run the child");
    assert!(out.status.success(), "child failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn records(stderr: &str) -> Vec<&str> {
    stderr.lines().filter(|l| l.contains("fastlane_a") || l.contains("fastlane_b")).collect()
}

#[test]
fn text_lines_have_rfc3339_time_level_and_target_and_follow_per_module_filters() {
    if let Ok(f) = std::env::var(CHILD) {
        return child(&f);
    }
    let name = "text_lines_have_rfc3339_time_level_and_target_and_follow_per_module_filters";
    // Default: info only.
    let out = run_child(name, "text", None);
    let lines = records(&out);
    assert_eq!(lines.len(), 1, "{out}");
    let line = lines[0];
    // 2026-12-04T20:37:01.123456Z  INFO fastlane_a: info from a
    let (stamp, rest) = line.split_once(' ').expect("a timestamp first");
    assert!(stamp.len() >= 20 && stamp.ends_with('Z'), "RFC 3339 UTC: {line}");
    assert_eq!(&stamp[4..5], "-", "{line}");
    assert_eq!(&stamp[10..11], "T", "{line}");
    assert!(rest.trim_start().starts_with("INFO fastlane_a: info from a"), "{line}");

    // Per-module directives: debug for b only, trace events with their fields.
    let out = run_child(name, "text", Some("info,fastlane_b=trace"));
    let lines = records(&out);
    assert_eq!(lines.len(), 3, "{out}");
    assert!(lines[1].contains("DEBUG fastlane_b::inner: debug from b"), "{out}");
    assert!(lines[2].contains("TRACE") && lines[2].contains("step_us=42"), "{out}");

    // A filter that does not parse is said, and info is used.
    let out = run_child(name, "text", Some("fastlane_a=loud"));
    assert!(out.contains("does not parse"), "{out}");
    assert_eq!(records(&out).iter().filter(|l| l.contains("INFO")).count(), 1, "{out}");
}

#[test]
fn json_lines_are_one_object_each_with_the_fields() {
    if let Ok(f) = std::env::var(CHILD) {
        return child(&f);
    }
    let out = run_child("json_lines_are_one_object_each_with_the_fields", "json", Some("trace"));
    let lines = records(&out);
    assert_eq!(lines.len(), 4, "{out}");
    for l in &lines {
        assert!(l.starts_with('{') && l.ends_with('}'), "one object per line: {l}");
        assert!(l.contains("\"timestamp\":\"") && l.contains("\"level\":\""), "{l}");
    }
    assert!(lines[0].contains("\"message\":\"info from a\""), "{out}");
    assert!(lines[0].contains("\"target\":\"fastlane_a\""), "{out}");
    assert!(
        lines[3].contains("\"step_us\":42") && lines[3].contains("\"given_up\":false"),
        "{out}"
    );
}

#[test]
fn formats_parse_and_print_back() {
    assert_eq!("json".parse::<LogFormat>(), Ok(LogFormat::Json));
    assert_eq!("text".parse::<LogFormat>(), Ok(LogFormat::Text));
    assert!("yaml".parse::<LogFormat>().unwrap_err().contains("text or json"));
    assert_eq!(LogFormat::Json.to_string(), "json");
}
