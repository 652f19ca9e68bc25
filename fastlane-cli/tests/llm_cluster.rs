//! Two `fastlane llm serve` processes sharing a real Redis Cluster (six `redis-server`s on
//! free loopback ports, `fastlane_kvswap::testing::RedisCluster`) through `--kv-cluster`, as two
//! machines would: the first computes a long prompt and its blocks reach the cluster (its
//! `fastlane_llm_prefix_cluster_puts_total`); the second, whose host cache never saw the
//! prompt, loads them from the cluster (`fastlane_llm_prefix_blocks_total{result="cluster_hit"}`,
//! reused tokens) and generates exactly the token ids and text of the first, and of `fastlane
//! llm generate --prefix-cache off`. Then the whole cluster is killed: a new prompt to the
//! second server still gets the right answer within a bounded time, every lookup a miss
//! counted as a cluster error. Greedy decoding throughout; every wait is bounded.

use std::time::{Duration, Instant};

use fastlane_kvswap::testing::RedisCluster;

mod common;

use common::http::{curl, json_body, Server};

const MAX_TOKENS: u32 = 16;
/// Prompt characters: one token each on random:tiny's byte tokenizer, after BOS.
const PROMPT_CHARS: usize = 640;
/// Full blocks of the prompt (BOS + 640 tokens) a lookup may load: all but the block of the
/// last prompt token, (641 - 1) / 16.
const USABLE_BLOCKS: f64 = 40.0;

/// `PROMPT_CHARS` lower-case letters and spaces from `seed` (nothing JSON must escape).
fn prompt(seed: u64) -> String {
    let mut x =
        seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
    (0..PROMPT_CHARS)
        .map(|_| {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            let c = (x >> 33) % 27;
            if c == 26 {
                ' '
            } else {
                (b'a' + c as u8) as char
            }
        })
        .collect()
}

fn serve(cluster: &RedisCluster) -> Server {
    let nodes: Vec<String> = (0..6).map(|i| format!("127.0.0.1:{}", cluster.port(i))).collect();
    let flag = format!("redis://{}", nodes.join(","));
    Server::start(&[
        "llm",
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--model",
        "random:tiny",
        "--kv-cluster",
        &flag,
        "--drain-seconds",
        "1",
    ])
}

/// A greedy completion: (token ids, text).
fn complete(s: &Server, prompt: &str) -> (Vec<u64>, String) {
    let body = serde_json::json!({
        "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": true,
        // As `generate` does by default: a random model emits EOS by chance.
        "ignore_eos": true,
    })
    .to_string();
    let url = format!("{}/v1/completions", s.url);
    let (st, text) = curl(&["-H", "Content-Type: application/json", "-d", &body, &url]);
    assert_eq!(st, 200, "{text}");
    let v = json_body(&text);
    let ids: Vec<u64> = v["choices"][0]["token_ids"]
        .as_array()
        .unwrap_or_else(|| panic!("token_ids in {v}"))
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    assert_eq!(ids.len(), MAX_TOKENS as usize, "{v}");
    (ids, v["choices"][0]["text"].as_str().unwrap().to_string())
}

/// The same prompt through `fastlane llm generate --prefix-cache off` (the reference).
fn reference(prompt: &str) -> (Vec<u64>, String) {
    let out = common::cli::command()
        .args(["llm", "generate", "--model", "random:tiny", "--prefix-cache", "off", "--json"])
        .args(["--max-tokens", &MAX_TOKENS.to_string(), prompt])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let r = &v["results"][0];
    let ids = r["token_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
    (ids, r["text"].as_str().unwrap().to_string())
}

#[test]
fn two_servers_share_prefix_blocks_through_the_cluster_and_survive_its_loss() {
    let (p1, p2) = (prompt(1), prompt(2));
    let (want1, want2) = (reference(&p1), reference(&p2));
    let mut cluster = RedisCluster::start().unwrap_or_else(|e| panic!("{e}"));
    let a = serve(&cluster);
    let b = serve(&cluster);

    // A computes the prompt; its 40 full blocks (640 tokens after BOS: 641 / 16) reach the
    // cluster through the background writer.
    let got_a = complete(&a, &p1);
    assert_eq!(got_a, want1, "server A matches generate --prefix-cache off");
    a.wait_metric(
        "fastlane_llm_prefix_cluster_puts_total{result=\"stored\"}",
        20,
        "A's blocks stored in the cluster",
        |v| v >= USABLE_BLOCKS,
    );
    assert_eq!(a.metric("fastlane_llm_prefix_cluster_puts_total{result=\"error\"}"), 0.0);
    assert_eq!(a.metric("fastlane_llm_prefix_blocks_total{result=\"cluster_hit\"}"), 0.0);

    // B has never seen it: every usable block comes from the cluster, none is prefilled.
    let got_b = complete(&b, &p1);
    assert_eq!(got_b.0, got_a.0, "B's token ids equal A's");
    assert_eq!(got_b.1, got_a.1, "B's text equals A's");
    b.wait_metric(
        "fastlane_llm_prefix_blocks_total{result=\"cluster_hit\"}",
        10,
        "B's lookup served from the cluster",
        |v| v == USABLE_BLOCKS,
    );
    b.wait_metric("fastlane_llm_prefix_reused_tokens_total", 10, "B reused the prefix", |v| {
        v == USABLE_BLOCKS * 16.0
    });
    assert_eq!(b.metric("fastlane_llm_prefix_blocks_total{result=\"host_hit\"}"), 0.0);
    assert!(b.metric("fastlane_llm_prefix_cluster_bytes_total{direction=\"in\"}") > 0.0);
    assert_eq!(b.metric("fastlane_llm_prefix_cluster_errors_total"), 0.0);
    let lookups = b.metric("fastlane_llm_prefix_lookup_seconds_count");
    assert_eq!(lookups, 1.0, "one lookup observed");

    // The whole cluster goes away. B's next (new) prompt misses everywhere and is computed,
    // with the right tokens, in bounded time (each cluster call is bounded by 250 ms).
    let misses_before = b.metric("fastlane_llm_prefix_blocks_total{result=\"miss\"}");
    cluster.stop_all();
    let t0 = Instant::now();
    let got = complete(&b, &p2);
    let took = t0.elapsed();
    assert_eq!(got, want2, "B answers correctly with the cluster down");
    assert!(took < Duration::from_secs(20), "answer took {took:?} with the cluster down");
    b.wait_metric(
        "fastlane_llm_prefix_blocks_total{result=\"miss\"}",
        10,
        "the new prompt's lookup missed",
        |v| v == misses_before + USABLE_BLOCKS,
    );
    assert_eq!(
        b.metric("fastlane_llm_prefix_blocks_total{result=\"cluster_hit\"}"),
        USABLE_BLOCKS,
        "no cluster hit while the cluster is down"
    );
    b.wait_metric(
        "fastlane_llm_prefix_cluster_errors_total",
        10,
        "the failed cluster lookup counted",
        |v| v >= 1.0,
    );
    // Its blocks' puts fail in the background (counted), and the server keeps serving.
    b.wait_metric(
        "fastlane_llm_prefix_cluster_puts_total{result=\"error\"}",
        20,
        "B's puts to the dead cluster counted as errors",
        |v| v >= 1.0,
    );
    assert_eq!(complete(&b, &p2), want2, "B's host cache serves the prompt again");
    assert_eq!(complete(&a, &p2), want2, "A computes it too");
}
