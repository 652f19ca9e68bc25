//! Conformance with the official `openai` Python SDK: `tests/sdk/openai_conformance.py` makes
//! every call a client makes (models, completions and chat, streamed and not, usage, stop,
//! seeds, `n`, logprobs, penalties, and the 400/401/404/429 errors as the SDK's exception
//! types) against `fastlane llm serve`, then against `fastlane router` in front of it.
//!
//! The SDK is installed by this test into a virtual environment cached under
//! `CARGO_TARGET_TMPDIR` (`python3 -m venv`, then `pip install openai`: the network is needed
//! the first time). A missing `venv` module is a failure, never a skip (Debian:
//! `apt-get install python3-venv python3-pip`, as `.ci/install-deps.sh` does).

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

mod common;

use common::http::Server;

/// The interpreter CI installs (Debian 12's `python3`).
const PYTHON: &str = "/usr/bin/python3";
/// Bound on the venv's creation and the SDK's installation.
const INSTALL_WAIT_MAX: Duration = Duration::from_secs(300);
/// Bound on one run of the script (a few seconds here).
const SCRIPT_WAIT_MAX: Duration = Duration::from_secs(300);

const TENANTS: &str = r#"
[[tenant]]
name = "sdk"
keys = ["key-sdk"]
rpm = 60000
burst = 1000
max_concurrent = 8
tier = "interactive"
max_stream_seconds = 120

[[tenant]]
name = "tight"
keys = ["key-tight"]
rpm = 1
burst = 1
max_concurrent = 1
tier = "batch"
queue = 0
"#;

/// A tenant with a bucket of one request and two slots (`llm serve` only: `n` = 2 is two
/// requests there, one at the router).
const PAIR_TENANT: &str = r#"
[[tenant]]
name = "pair"
keys = ["key-pair"]
rpm = 1
burst = 1
max_concurrent = 2
tier = "batch"
"#;

/// The tenant `llm serve` knows the router by (`--upstream-key`), beside [`TENANTS`].
const UPSTREAM_TENANT: &str = r#"
[[tenant]]
name = "router"
keys = ["key-upstream"]
rpm = 60000
burst = 1000
max_concurrent = 16
tier = "interactive"
"#;

/// Runs `cmd` to its end within `max`, killed past it; its output.
fn run_bounded(cmd: &mut Command, max: Duration, what: &str) -> Output {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let (out, err) = (dir.path().join("stdout"), dir.path().join("stderr"));
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap_or_else(|e| panic!("{what}: cannot start: {e}"));
    let deadline = Instant::now() + max;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{what}: ran past {max:?} and was killed\n{}\n{}",
                std::fs::read_to_string(&out).unwrap_or_default(),
                std::fs::read_to_string(&err).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Output {
        status,
        stdout: std::fs::read(&out).unwrap_or_default(),
        stderr: std::fs::read(&err).unwrap_or_default(),
    }
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// A venv with the `openai` package: the cached one, or a new one. Panics, saying what to
/// install, when Python or its `venv` module is missing.
fn sdk_python() -> PathBuf {
    assert!(
        Path::new(PYTHON).is_file(),
        "{PYTHON} not found: the OpenAI SDK test needs python3 (Debian: apt-get install python3 \
         python3-venv python3-pip)"
    );
    let venv = Path::new(env!("CARGO_TARGET_TMPDIR")).join("openai-sdk-venv");
    let python = venv.join("bin/python");
    let has_sdk = |python: &Path| {
        python.is_file()
            && Command::new(python)
                .args(["-c", "import openai"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
    };
    if has_sdk(&python) {
        return python;
    }
    let _ = std::fs::remove_dir_all(&venv);
    let o = run_bounded(
        Command::new(PYTHON).args(["-m", "venv"]).arg(&venv),
        INSTALL_WAIT_MAX,
        "python3 -m venv",
    );
    assert!(
        o.status.success(),
        "python3 -m venv failed: the OpenAI SDK test needs the venv module and pip (Debian: \
         apt-get install python3-venv python3-pip, as .ci/install-deps.sh does)\n{}",
        text(&o)
    );
    let o = run_bounded(
        Command::new(&python).args(["-m", "pip", "install", "--quiet", "openai"]),
        INSTALL_WAIT_MAX,
        "pip install openai",
    );
    assert!(o.status.success(), "pip install openai failed (network?)\n{}", text(&o));
    assert!(has_sdk(&python), "openai installed but not importable from {}", python.display());
    python
}

/// Runs the conformance script against `url`; panics with its output when it fails.
fn conformance(python: &Path, url: &str, keys: &[&str], against: &str) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/sdk/openai_conformance.py");
    let o = run_bounded(
        Command::new(python)
            .arg(&script)
            .arg(url)
            .args(keys)
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .env("PYTHONNOUSERSITE", "1"),
        SCRIPT_WAIT_MAX,
        "openai_conformance.py",
    );
    let out = text(&o);
    println!("--- against {against} ---\n{out}");
    assert!(o.status.success(), "the OpenAI SDK against {against} failed: {}\n{out}", o.status);
    assert!(out.contains("ok: openai"), "the script ran to its end: {out}");
}

#[test]
fn the_official_openai_sdk_works_against_llm_serve_and_the_router() {
    let python = sdk_python();
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let (serve_tenants, router_tenants) =
        (dir.path().join("serve.toml"), dir.path().join("router.toml"));
    std::fs::write(&serve_tenants, format!("{TENANTS}{PAIR_TENANT}{UPSTREAM_TENANT}")).unwrap();
    std::fs::write(&router_tenants, TENANTS).unwrap();
    let s = Server::llm(&serve_tenants, &[]);
    conformance(&python, &s.url, &["key-sdk", "key-tight", "key-pair"], "llm serve");
    // The router admits by its own tenants (the 429 comes from its bucket) and forwards with
    // its own key; the 400s and 404 come from llm serve through it.
    let r = Server::start(&[
        "router",
        "--upstream",
        &s.url,
        "--upstream-key",
        "key-upstream",
        "--listen",
        "127.0.0.1:0",
        "--tenants",
        router_tenants.to_str().unwrap(),
    ]);
    conformance(&python, &r.url, &["key-sdk", "key-tight"], "router → llm serve");
}
