//! The prefix cache keeps tenants apart: `fastlane llm serve` with a tenants file keys each
//! tenant's prompt blocks in its own namespace, so a tenant whose prompt another tenant sent
//! before finds nothing (no faster first token to learn from), while tenants that name the
//! same `prefix_group` share blocks. Read from the server's own counters
//! (`fastlane_llm_prefix_blocks_total`, `fastlane_llm_prefix_reused_tokens_total`,
//! `fastlane_llm_prefix_cache_blocks`); greedy decoding, every wait bounded.

mod common;

use common::http::{json_body, Server};

/// `alpha` and `gamma` share the group `shared`; `beta` keeps its own namespace.
const TENANTS: &str = r#"
[[tenant]]
name = "alpha"
keys = ["key-alpha"]
rpm = 6000
burst = 100
max_concurrent = 4
tier = "interactive"
prefix_group = "shared"

[[tenant]]
name = "beta"
keys = ["key-beta"]
rpm = 6000
burst = 100
max_concurrent = 4
tier = "interactive"

[[tenant]]
name = "gamma"
keys = ["key-gamma"]
rpm = 6000
burst = 100
max_concurrent = 4
tier = "interactive"
prefix_group = "shared"
"#;

const HOST_HIT: &str = "fastlane_llm_prefix_blocks_total{result=\"host_hit\"}";
const MISS: &str = "fastlane_llm_prefix_blocks_total{result=\"miss\"}";
const REUSED: &str = "fastlane_llm_prefix_reused_tokens_total";
const CACHED: &str = "fastlane_llm_prefix_cache_blocks";

/// The prompt tokens `tenant` loaded from the cache (a missing series panics).
fn reused_by(s: &Server, tenant: &str) -> f64 {
    s.metric(&format!("fastlane_llm_tenant_prefix_reused_tokens_total{{tenant=\"{tenant}\"}}"))
}

/// 200 characters (one token each on random:tiny's byte tokenizer): 12 full blocks after BOS.
fn prompt() -> String {
    (0..200u32).map(|i| (b'a' + ((i * 7 + i / 13) % 26) as u8) as char).collect()
}

/// The counters the test reads, as of now (a missing one panics).
#[derive(Debug, Clone, Copy)]
struct Prefix {
    host_hits: f64,
    misses: f64,
    reused_tokens: f64,
    cached_blocks: f64,
}

fn prefix(s: &Server) -> Prefix {
    Prefix {
        host_hits: s.metric(HOST_HIT),
        misses: s.metric(MISS),
        reused_tokens: s.metric(REUSED),
        cached_blocks: s.metric(CACHED),
    }
}

/// Sends the prompt as tenant `key` and waits (bounded) until the host cache holds
/// `cached_at_least` blocks (`what` says whose): the prefix counters after it, and the blocks a
/// lookup could use.
fn send(s: &Server, key: &str, cached_at_least: f64, what: &str) -> (Prefix, f64) {
    let body = format!(r#"{{"prompt": "{}", "max_tokens": 4, "temperature": 0}}"#, prompt());
    let (st, text) = s.post("/v1/completions", key, &body);
    assert_eq!(st, 200, "{key}: {text}");
    let prompt_tokens = json_body(&text)["usage"]["prompt_tokens"].as_f64().expect("usage");
    // A lookup never loads the block of the last prompt token.
    let usable = ((prompt_tokens - 1.0) / 16.0).floor();
    assert!(usable >= 10.0, "the prompt spans blocks: {prompt_tokens} tokens");
    s.wait_metric(CACHED, 10, what, |v| v >= cached_at_least);
    (prefix(s), usable)
}

#[test]
fn a_tenant_finds_only_its_own_groups_cached_blocks() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let tenants = dir.path().join("tenants.toml");
    std::fs::write(&tenants, TENANTS).unwrap();
    let s = Server::llm(&tenants, &["--drain-seconds", "1"]);
    // (The engine publishes its counters from its first step on: none to read before.)

    // alpha computes the prompt: every usable block a miss, its full blocks stored.
    let (p1, usable) = send(&s, "key-alpha", 1.0, "alpha's blocks are stored");
    assert_eq!((p1.host_hits, p1.reused_tokens), (0.0, 0.0), "{p1:?}");
    assert_eq!(p1.misses, usable, "{p1:?}");
    let stored = p1.cached_blocks;
    assert!(stored >= usable, "{p1:?}");

    // alpha again: every usable block is a hit.
    let (p2, _) = send(&s, "key-alpha", stored, "alpha's blocks stay");
    assert_eq!(p2.host_hits - p1.host_hits, usable, "alpha reuses its prompt: {p2:?}");
    assert_eq!(p2.reused_tokens - p1.reused_tokens, usable * 16.0, "{p2:?}");
    assert_eq!(p2.cached_blocks, stored, "nothing new to store: {p2:?}");
    assert_eq!(reused_by(&s, "alpha"), usable * 16.0, "the tenant's own series counts it");

    // beta, the same prompt: nothing found, and its blocks are stored beside alpha's.
    let (p3, _) = send(&s, "key-beta", 2.0 * stored, "beta's blocks are stored beside alpha's");
    assert_eq!(p3.host_hits, p2.host_hits, "beta finds none of alpha's blocks: {p3:?}");
    assert_eq!(p3.reused_tokens, p2.reused_tokens, "{p3:?}");
    assert_eq!(p3.misses - p2.misses, usable, "{p3:?}");
    assert_eq!(p3.cached_blocks, 2.0 * stored, "beta's blocks are its own: {p3:?}");
    assert_eq!(reused_by(&s, "beta"), 0.0, "beta reused nothing yet");

    // beta again: its own blocks are found.
    let (p4, _) = send(&s, "key-beta", 2.0 * stored, "both tenants' blocks stay");
    assert_eq!(p4.host_hits - p3.host_hits, usable, "beta reuses its own prompt: {p4:?}");

    // gamma, in alpha's group: a hit on the first request, nothing new stored.
    let (p5, _) = send(&s, "key-gamma", 2.0 * stored, "both tenants' blocks stay");
    assert_eq!(p5.host_hits - p4.host_hits, usable, "gamma shares alpha's group: {p5:?}");
    assert_eq!(p5.reused_tokens - p4.reused_tokens, usable * 16.0, "{p5:?}");
    assert_eq!(p5.misses, p4.misses, "{p5:?}");
    assert_eq!(p5.cached_blocks, 2.0 * stored, "{p5:?}");
    let by_tenant = ["alpha", "beta", "gamma"].map(|t| reused_by(&s, t));
    assert_eq!(by_tenant, [usable * 16.0; 3], "each tenant's own reuse, once");
    assert_eq!(by_tenant.iter().sum::<f64>(), p5.reused_tokens, "the series add up");
}
