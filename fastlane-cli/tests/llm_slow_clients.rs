//! A thousand streams whose clients read nothing, held open against `fastlane llm serve`
//! while their tokens are still being generated, must not slow the quiet tenant: its TTFT
//! with them (measured by `fastlane llm bench --url`, a real HTTP client) stays near its TTFT
//! without them, the server takes all of them in, and when the clients go away every slot
//! and KV block comes back.

mod common;

use common::http::Server;

const TENANTS: &str = r#"
[[tenant]]
name = "quiet"
keys = ["key-quiet"]
rpm = 6000
burst = 100
max_concurrent = 8
tier = "interactive"

[[tenant]]
name = "slow"
keys = ["key-slow"]
rpm = 600000
burst = 2000
max_concurrent = 2000
tier = "batch"
queue = 2000
"#;

fn bench(url: &str, extra: &[&str]) -> serde_json::Value {
    let out = common::cli::command()
        .args(["llm", "bench", "--url", url, "--solo", "--rate", "4", "--seconds", "5", "--json"])
        .args(extra)
        .output()
        .unwrap();
    assert!(out.status.success(), "bench failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn a_thousand_slow_readers_cost_the_quiet_tenant_nothing() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let tenants = dir.path().join("tenants.toml");
    std::fs::write(&tenants, TENANTS).unwrap();
    let s = Server::llm(&tenants, &["--device-blocks", "8192"]);
    let base = bench(&s.url, &[]);
    let with = bench(&s.url, &["--slow-streams", "1000", "--slow-tokens", "1024"]);
    assert_eq!(with["slow_streams_held"], 1000, "{with}");
    // Their generation was under way for the whole measured load: the engine still had
    // sequences of theirs at its end (a stream whose tokens are all generated is not busy).
    let busy = |k: &str| with[k].as_f64().unwrap_or_else(|| panic!("{k} missing: {with}"));
    assert!(busy("slow_busy_at_start") >= 256.0, "{with}");
    assert!(busy("slow_busy_at_end") >= 100.0, "still generating at the end: {with}");
    let (b, w) = (&base["tenants"][0], &with["tenants"][0]);
    assert_eq!(w["ok"], w["sent"], "every quiet request served: {with}");
    let (b99, w99) = (b["ttft_p99_ms"].as_f64().unwrap(), w["ttft_p99_ms"].as_f64().unwrap());
    eprintln!("quiet TTFT P99: {b99:.1} ms alone, {w99:.1} ms beside 1000 slow streams");
    assert!(
        w99 <= (3.0 * b99).max(b99 + 50.0),
        "slow readers slowed the quiet tenant: {b99} -> {w99}"
    );
    // The bench closed its connections: every slot and block comes back.
    s.wait_metric("fastlane_llm_streams_open{tenant=\"slow\"}", 30, "slow streams closed", |v| {
        v == 0.0
    });
    s.wait_metric("fastlane_llm_kv_blocks{state=\"used\"}", 30, "KV blocks freed", |v| v == 0.0);
    s.wait_metric("fastlane_llm_sequences{state=\"running\"}", 30, "engine idle", |v| v == 0.0);
    // The streams were taken in (admitted, generating) and ended by their clients' going.
    let n = |o: &str| {
        s.metric(&format!("fastlane_llm_requests_total{{outcome=\"{o}\",tenant=\"slow\"}}"))
    };
    assert!(n("admitted") >= 100.0, "admitted {}", n("admitted"));
    assert!(n("aborted") >= 100.0, "aborted {}", n("aborted"));
}
