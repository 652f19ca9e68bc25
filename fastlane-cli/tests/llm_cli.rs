//! End-to-end tests of `fastlane llm`: `make-random` writes a directory that `generate`
//! loads; `generate --json` on a pool small enough to preempt gives the same token ids as
//! with an ample pool; bad models and flags are clear errors.

mod common;

use common::cli::{fastlane, ok};

fn json(args: &[&str]) -> serde_json::Value {
    serde_json::from_str(&ok(args)).expect("--json prints one JSON object")
}

fn token_ids(v: &serde_json::Value) -> Vec<Vec<u64>> {
    v["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["token_ids"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect())
        .collect()
}

#[test]
fn generate_from_a_written_directory_with_and_without_preemption() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let model = dir.path().join("tiny");
    let text = ok(&[
        "llm",
        "make-random",
        "--preset",
        "tiny",
        "--seed",
        "5",
        "--out",
        model.to_str().unwrap(),
        "--shards",
        "2",
    ]);
    assert!(text.contains("random:tiny"), "{text}");
    assert!(
        model.join("config.json").exists() && model.join("model.safetensors.index.json").exists()
    );
    let prompts = dir.path().join("prompts.txt");
    let lines: Vec<String> =
        (0..12).map(|i| format!("prompt {i}: {}", "lorem ipsum ".repeat(2 + i % 5))).collect();
    std::fs::write(&prompts, lines.join("\n")).unwrap();
    let m = model.to_str().unwrap();
    let p = prompts.to_str().unwrap();
    let ample =
        json(&["llm", "generate", "--model", m, "--prompts", p, "--max-tokens", "12", "--json"]);
    let tight = json(&[
        "llm",
        "generate",
        "--model",
        m,
        "--prompts",
        p,
        "--max-tokens",
        "40",
        "--device-blocks",
        "10",
        "--preempt",
        "swap",
        "--json",
    ]);
    let (a, t) = (token_ids(&ample), token_ids(&tight));
    assert_eq!(a.len(), 12);
    for (i, (x, y)) in a.iter().zip(&t).enumerate() {
        assert_eq!(x.len(), 12);
        assert_eq!(y.len(), 40);
        assert_eq!(x[..], y[..12], "prompt {i}: a tight pool changed the tokens");
    }
    let e = &tight["engine"];
    assert!(
        e["preempt_swap"].as_u64().unwrap() > 0,
        "10 blocks for 12 prompts of 40 tokens must preempt: {e}"
    );
    assert_eq!(e["blocks_free"], e["blocks_total"]);
    assert_eq!(tight["random_weights"], true);
    assert_eq!(tight["results"][0]["finish_reason"], "length");
}

#[test]
fn generate_streams_one_prompt_and_says_the_model_is_random() {
    let out = fastlane(&["llm", "generate", "--max-tokens", "8", "hello"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not a language model"), "{err}");
    assert!(err.contains("8 tokens"), "{err}");
}

#[test]
fn bad_models_and_flags_are_clear_errors() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let out = fastlane(&["llm", "generate", "--model", dir.path().to_str().unwrap(), "hi"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("config.json"));
    let out = fastlane(&["llm", "generate", "--model", "random:huge", "hi"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("random:tiny"));
    let out = fastlane(&["llm", "generate", "--policy", "lifo", "hi"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--policy"));
    let out =
        fastlane(&["llm", "generate", "--device-blocks", "2", "--max-tokens", "100", "hello"]);
    assert!(!out.status.success(), "a request larger than the pool is refused");
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot run"));
    let help = ok(&["llm", "generate", "--help"]);
    for flag in [
        "--prompts",
        "--max-tokens",
        "--temperature",
        "--device-blocks",
        "--policy",
        "--nvme",
        "--json",
    ] {
        assert!(help.contains(flag), "--help lacks {flag}");
    }
}

#[test]
fn attack_floor_and_probe_flags_are_clear_errors() {
    let err = |args: &[&str]| {
        let out = fastlane(args);
        assert!(!out.status.success(), "{args:?} succeeded");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let e = err(&["llm", "bench", "--attack-floor"]);
    assert!(e.contains("--attack-floor needs --attack N"), "{e}");
    let e = err(&["llm", "bench", "--attack-floor", "--attack", "1", "--probe-rate", "0"]);
    assert!(e.contains("positive --probe-rate"), "{e}");
    let e = err(&["llm", "bench", "--attack-floor", "--attack", "1", "--probe-rate", "NaN"]);
    assert!(e.contains("--probe-rate NaN"), "{e}");
    let e =
        err(&["llm", "bench", "--attack-floor", "--url", "http://127.0.0.1:1", "--attack", "1"]);
    assert!(e.contains("leave out --url"), "{e}");
    let e = err(&["llm", "bench", "--url", "http://127.0.0.1:1", "--probe-rate", "1e9"]);
    assert!(e.contains("--probe-rate 1000000000: 0 (no probe) to 10000"), "{e}");
    // The warm-up is bounded and a number (before any connection is made).
    for (bad, shown) in [("nan", "NaN"), ("4000", "4000")] {
        let e = err(&["llm", "bench", "--url", "http://127.0.0.1:1", "--warmup", bad]);
        assert!(e.contains(&format!("--warmup {shown}: 0 to 3600 seconds")), "{e}");
    }
}

#[test]
fn serve_flags_out_of_range_are_refused_before_the_model_loads() {
    // A model path that does not exist: an error about the flag, not the model, shows the flag
    // was checked first.
    let err = |flag: &[&str]| {
        let out = fastlane(&[&["llm", "serve", "--model", "/nonexistent"][..], flag].concat());
        assert!(!out.status.success(), "{flag:?} succeeded");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    for bad in ["-21", "20", "high"] {
        let e = err(&[&format!("--protected-nice={bad}")]);
        assert!(
            e.contains(&format!("--protected-nice {bad}: a nice value from -20 to 19, or off")),
            "{e}"
        );
    }
    let e = err(&["--tokenize-inline-bytes", "100000000"]);
    assert!(e.contains("--tokenize-inline-bytes 100000000: at most"), "{e}");
}

#[test]
fn engine_metrics_and_router_floor_inputs_are_clear_errors() {
    let err = |args: &[&str]| {
        let out = fastlane(args);
        assert!(!out.status.success(), "{args:?} succeeded");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let url = ["llm", "bench", "--url", "http://127.0.0.1:1", "--seconds", "1"];
    let e = err(&[&url[..], &["--engine-metrics", "ftp://x"]].concat());
    assert!(e.contains("--engine-metrics: http://HOST:PORT"), "{e}");
    // Nothing listens there: an error, not an engine that ran no steps.
    let e = err(&[&url[..], &["--engine-metrics", "http://127.0.0.1:1"]].concat());
    assert!(e.contains("no /metrics at 127.0.0.1:1"), "{e}");
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let e = err(&["llm", "bench", "--router-floor", d]);
    assert!(e.contains("loaded.from"), "{e}");
    // The files of a run whose logs hold no events (not RUST_LOG=trace --log-format json).
    for (f, text) in [
        ("loaded.from", "1.0"),
        ("loaded.to", "2.0"),
        ("up-loaded.log", "x"),
        ("router-loaded.log", ""),
    ] {
        std::fs::write(dir.path().join(f), text).unwrap();
    }
    let e = err(&["llm", "bench", "--router-floor", d]);
    assert!(e.contains("no engine `step` events"), "{e}");
}
