//! `fastlane llm serve` end to end with a real HTTP client (curl) on loopback: the OpenAI
//! endpoints streamed and not, tenants (401, 429 with Retry-After), 400s that name the field,
//! the max-stream fence and a client that goes away both free the KV blocks, metrics, and
//! SIGTERM's drain; and `llm bench --keep-alive` reusing its connections. The server picks a free port (`--listen 127.0.0.1:0`) and is stopped by
//! the test; every wait is bounded.

use std::io::{Read, Write};
use std::process::Command;
use std::time::{Duration, Instant};

const TENANTS: &str = r#"
[[tenant]]
name = "quiet"
keys = ["key-quiet"]
rpm = 6000
burst = 100
max_concurrent = 8
tier = "interactive"
max_stream_seconds = 60

[[tenant]]
name = "tight"
keys = ["key-tight"]
rpm = 1
burst = 1
max_concurrent = 1
tier = "batch"
queue = 0

[[tenant]]
name = "slot"
keys = ["key-slot"]
rpm = 6000
burst = 100
max_concurrent = 1
tier = "batch"
queue = 0

[[tenant]]
name = "fenced"
keys = ["key-fenced"]
rpm = 6000
burst = 100
max_concurrent = 2
tier = "batch"
max_stream_seconds = 1
"#;

mod common;

use common::http::{curl, json_body, open_stream, Server};

fn start() -> (Server, tempfile::TempDir) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let tenants = dir.path().join("tenants.toml");
    std::fs::write(&tenants, TENANTS).unwrap();
    (Server::llm(&tenants, &["--drain-seconds", "5", "--header-timeout-seconds", "1"]), dir)
}

/// Waits (at most 10 s) until no KV block is in use.
fn blocks_come_back(s: &Server) {
    s.wait_metric("fastlane_llm_kv_blocks{state=\"used\"}", 10, "KV blocks still in use", |v| {
        v == 0.0
    });
}

#[test]
fn openai_endpoints_tenants_fence_disconnect_and_drain() {
    let (s, _dir) = start();
    let (st, text) = curl(&[&format!("{}/health", s.url)]);
    assert_eq!(st, 200, "{text}");
    let models = json_body(&curl(&[&format!("{}/v1/models", s.url)]).1);
    assert_eq!(models["data"][0]["id"], "random:tiny");

    // Non-streaming: the same token ids as the CLI's greedy generation.
    let body = r#"{"prompt": "hello world", "max_tokens": 12, "temperature": 0, "return_token_ids": true}"#;
    let (st, text) = s.post("/v1/completions", "key-quiet", body);
    assert_eq!(st, 200, "{text}");
    let v = json_body(&text);
    let ids: Vec<u64> = v["choices"][0]["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    assert_eq!(ids.len(), 12);
    assert_eq!(v["usage"]["completion_tokens"], 12);
    let cli = common::cli::command()
        .args(["llm", "generate", "--max-tokens", "12", "--json", "hello world"])
        .output()
        .unwrap();
    let cli: serde_json::Value = serde_json::from_slice(&cli.stdout).unwrap();
    let cli_ids: Vec<u64> = cli["results"][0]["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    assert_eq!(ids, cli_ids, "HTTP and CLI generate the same greedy tokens");

    // Streaming: the chunks carry the same tokens, then usage, then [DONE].
    let body = r#"{"prompt": "hello world", "max_tokens": 12, "temperature": 0, "stream": true, "return_token_ids": true}"#;
    let (st, text) = s.post("/v1/completions", "key-quiet", body);
    assert_eq!(st, 200);
    assert!(text.contains("text/event-stream"), "{text}");
    let events: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(events.last(), Some(&"[DONE]"));
    let mut streamed = Vec::new();
    for e in &events[..events.len() - 1] {
        let v: serde_json::Value = serde_json::from_str(e).unwrap();
        if let Some(t) = v["choices"][0]["token_ids"].as_array() {
            streamed.extend(t.iter().map(|x| x.as_u64().unwrap()));
        }
    }
    assert_eq!(streamed, ids);
    let last: serde_json::Value = serde_json::from_str(events[events.len() - 2]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert_eq!(last["usage"]["completion_tokens"], 12);

    // Sampling without a seed: identical requests get independent completions; with one,
    // the same tokens again.
    let sampled = |seed: &str| {
        let body = format!(
            r#"{{"prompt": "hello world", "max_tokens": 16, "temperature": 1.0, "return_token_ids": true{seed}}}"#
        );
        let (st, text) = s.post("/v1/completions", "key-quiet", &body);
        assert_eq!(st, 200, "{text}");
        json_body(&text)["choices"][0]["token_ids"].clone()
    };
    let (a, b) = (sampled(""), sampled(""));
    assert_ne!(a, b, "two unseeded requests sampled the same 16 tokens");
    assert_eq!(sampled(r#", "seed": 7"#), sampled(r#", "seed": 7"#));

    // What the OpenAI SDKs and LangChain send by default is accepted when it asks for nothing
    // we do not do; anything else is a 400 naming the field.
    let body = r#"{"prompt": "hello world", "max_tokens": 5, "temperature": 0, "stream": true,
        "stream_options": {"include_usage": true}, "frequency_penalty": 0, "presence_penalty": 0.0,
        "logprobs": null, "logit_bias": {}, "echo": false, "best_of": 1, "user": "u1"}"#;
    let (st, text) = s.post("/v1/completions", "key-quiet", body);
    assert_eq!(st, 200, "{text}");
    let events: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(events.last(), Some(&"[DONE]"));
    let last: serde_json::Value = serde_json::from_str(events[events.len() - 2]).unwrap();
    assert_eq!(last["usage"]["completion_tokens"], 5, "include_usage: the last chunk has usage");
    let body = r#"{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3,
        "temperature": 0, "logprobs": false, "top_logprobs": 0, "response_format": {"type": "text"}}"#;
    let (st, text) = s.post("/v1/chat/completions", "key-quiet", body);
    assert_eq!(st, 200, "{text}");
    assert_eq!(json_body(&text)["usage"]["completion_tokens"], 3, "max_completion_tokens");
    for (field, body) in [
        ("frequency_penalty", r#"{"prompt": "hi", "frequency_penalty": 2.5}"#),
        ("presence_penalty", r#"{"prompt": "hi", "presence_penalty": -3}"#),
        ("logprobs", r#"{"prompt": "hi", "logprobs": 6}"#),
        ("top_logprobs", r#"{"prompt": "hi", "top_logprobs": 2}"#),
        ("n", r#"{"prompt": "hi", "n": 9}"#),
        ("logit_bias", r#"{"prompt": "hi", "logit_bias": {"5": 10}}"#),
        ("echo", r#"{"prompt": "hi", "echo": true}"#),
        ("best_of", r#"{"prompt": "hi", "best_of": 3}"#),
        ("bogus", r#"{"prompt": "hi", "stream_options": {"include_usage": true, "bogus": 1}}"#),
        (
            "max_completion_tokens",
            r#"{"prompt": "hi", "max_tokens": 4, "max_completion_tokens": 5}"#,
        ),
    ] {
        let (st, text) = s.post("/v1/completions", "key-quiet", body);
        assert_eq!(st, 400, "{field}: {text}");
        assert!(json_body(&text)["error"]["message"].as_str().unwrap().contains(field), "{text}");
    }
    let body = r#"{"messages": [{"role": "user", "content": "hi"}], "logprobs": true,
        "top_logprobs": 21}"#;
    let (st, text) = s.post("/v1/chat/completions", "key-quiet", body);
    assert_eq!(st, 400, "{text}");
    assert!(text.contains("top_logprobs"), "{text}");

    // Chat.
    let body =
        r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}"#;
    let (st, text) = s.post("/v1/chat/completions", "key-quiet", body);
    assert_eq!(st, 200, "{text}");
    assert_eq!(json_body(&text)["object"], "chat.completion");

    // Errors: OpenAI-shaped, with the right status.
    let (st, text) = s.post("/v1/completions", "nobody", r#"{"prompt": "x"}"#);
    assert_eq!(st, 401, "{text}");
    assert_eq!(json_body(&text)["error"]["code"], "invalid_api_key");
    let (st, text) = s.post("/v1/completions", "key-quiet", "{not json");
    assert_eq!(st, 400, "{text}");
    let (st, text) = s.post("/v1/completions", "key-quiet", r#"{"prompt": "x", "temprature": 0}"#);
    assert_eq!(st, 400);
    assert!(json_body(&text)["error"]["message"].as_str().unwrap().contains("temprature"));
    let (st, _) =
        s.post("/v1/completions", "key-quiet", r#"{"prompt": "x", "max_tokens": 100000}"#);
    assert_eq!(st, 400);
    // The tight tenant: one request, then 429 with Retry-After.
    let (st, _) = s.post("/v1/completions", "key-tight", r#"{"prompt": "x", "max_tokens": 2}"#);
    assert_eq!(st, 200);
    let (st, text) = s.post("/v1/completions", "key-tight", r#"{"prompt": "x", "max_tokens": 2}"#);
    assert_eq!(st, 429, "{text}");
    assert!(text.to_ascii_lowercase().contains("retry-after: 60"), "{text}");
    assert_eq!(json_body(&text)["error"]["code"], "rate_limit_exceeded");
    assert!(
        s.metric("fastlane_llm_requests_total{outcome=\"rejected_rate\",tenant=\"tight\"}") >= 1.0
    );

    // The one-slot tenant: while its stream runs, a second request finds the slot busy and
    // its queue (0) full: 503, not 429 (its bucket has tokens).
    let mut long = open_stream(s.addr(), "key-slot", 2000);
    let mut first = [0u8; 64];
    let n = long.read(&mut first).unwrap();
    assert!(
        String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"),
        "the long stream started"
    );
    let (st, text) = s.post("/v1/completions", "key-slot", r#"{"prompt": "x", "max_tokens": 2}"#);
    assert_eq!(st, 503, "{text}");
    assert_eq!(json_body(&text)["error"]["code"], "queue_full");
    assert!(text.to_ascii_lowercase().contains("retry-after: 1"), "{text}");
    drop(long);
    blocks_come_back(&s);

    // The fence: a 1-second tenant's long stream ends with an error event, and its blocks
    // come back.
    let t0 = Instant::now();
    let (st, text) = s.post(
        "/v1/completions",
        "key-fenced",
        r#"{"prompt": "x", "max_tokens": 3000, "stream": true, "ignore_eos": true}"#,
    );
    assert_eq!(st, 200);
    assert!(t0.elapsed() < Duration::from_secs(20), "the fence ended the stream");
    assert!(
        text.contains("max_stream_seconds") && text.trim_end().ends_with("data: [DONE]"),
        "{text}"
    );
    blocks_come_back(&s);
    assert!(s.metric("fastlane_llm_requests_total{outcome=\"fenced\",tenant=\"fenced\"}") >= 1.0);

    // A client that goes away mid-stream: the request is aborted and its blocks come back.
    let aborted = s.metric("fastlane_llm_requests_total{outcome=\"aborted\",tenant=\"quiet\"}");
    let out = Command::new("curl")
        .args(["-s", "-N", "--max-time", "1", "-H", "Authorization: Bearer key-quiet", "-d"])
        .arg(r#"{"prompt": "x", "max_tokens": 3000, "stream": true, "ignore_eos": true}"#)
        .arg(format!("{}/v1/completions", s.url))
        .output()
        .unwrap();
    assert!(!out.stdout.is_empty(), "tokens arrived before the client left");
    blocks_come_back(&s);
    assert!(
        s.metric("fastlane_llm_requests_total{outcome=\"aborted\",tenant=\"quiet\"}") > aborted
    );

    // Metrics: per-tenant TTFT histograms and the engine's gauges.
    let ttft_n = s.metric("fastlane_llm_ttft_seconds_count{tenant=\"quiet\"}");
    assert!(ttft_n >= 3.0);
    assert!(s.metric("fastlane_llm_engine_steps_total") > 0.0);
    // The quiet tenant is under its rate (protected): its prefill steps held the listener's
    // accepts (--hold-accepts on, the default).
    assert!(s.metric("fastlane_llm_engine_accept_holds_total{what=\"step\"}") >= 1.0);
    // The TTFT's stages: one sample each per first token, and together the TTFT (they are
    // consecutive spans of one clock; 1 ms of slack a request for the float sums).
    let mut parts = 0.0;
    for stage in ["admit", "engine", "respond"] {
        let series =
            format!("fastlane_llm_ttft_stage_seconds_count{{stage=\"{stage}\",tenant=\"quiet\"}}");
        assert_eq!(s.metric(&series), ttft_n, "{stage}");
        parts += s.metric(&series.replace("_count{", "_sum{"));
    }
    let total = s.metric("fastlane_llm_ttft_seconds_sum{tenant=\"quiet\"}");
    assert!((parts - total).abs() < 1e-3 * ttft_n, "stages {parts} s, TTFT {total} s");
    // The engine thread's part: every first token it sent (also of requests whose client had
    // gone by then).
    let engine_n = s.metric("fastlane_llm_engine_first_token_seconds_count{tenant=\"quiet\"}");
    assert!(engine_n >= ttft_n, "engine first tokens {engine_n}, HTTP {ttft_n}");

    // SIGTERM with a stream in flight: new connections are refused, the stream runs to its
    // [DONE], and the server exits 0.
    let mut s = s;
    let mut running = open_stream(s.addr(), "key-quiet", 300);
    let mut got = vec![0u8; 256];
    let n = running.read(&mut got).unwrap();
    got.truncate(n);
    s.sigterm();
    let t0 = Instant::now();
    while std::net::TcpStream::connect(s.addr()).is_ok() {
        assert!(t0.elapsed() < Duration::from_secs(5), "still accepting 5 s after SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    }
    running.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    running.read_to_end(&mut got).unwrap();
    let got = String::from_utf8_lossy(&got);
    assert!(got.contains("data: [DONE]"), "the stream in flight finished: {got}");
    assert!(got.contains("\"completion_tokens\":300"), "all 300 tokens: {got}");
    let status = s.wait_exit(15);
    assert!(status.success(), "exit status {status:?}");
}

#[test]
fn a_client_that_trickles_its_headers_is_cut_off() {
    let (s, _dir) = start();
    let mut c = std::net::TcpStream::connect(s.addr()).unwrap();
    c.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    let t0 = Instant::now();
    // One byte every 200 ms: the 1-second header timeout ends the connection long before
    // the headers could end.
    let mut closed = false;
    for b in
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key-quiet\r\n".iter()
    {
        if c.write_all(&[*b]).is_err() {
            closed = true;
            break;
        }
        let mut buf = [0u8; 256];
        match c.read(&mut buf) {
            Ok(0) => {
                closed = true;
                break;
            }
            Ok(_) => {
                closed = true; // hyper answers 408 and closes
                break;
            }
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => {
                closed = true;
                break;
            }
        }
    }
    let took = t0.elapsed();
    assert!(closed, "the server kept a trickling client for {took:?}");
    assert!(took < Duration::from_secs(4), "cut off after {took:?} (timeout 1 s)");
    // The server still serves.
    let (st, _) = curl(&[&format!("{}/health", s.url)]);
    assert_eq!(st, 200);
}

/// `llm bench --url URL --solo --rate 4 --json --max-tokens 8` with `flags` (which include
/// `--seconds`): its JSON.
fn bench_solo(url: &str, flags: &[&str]) -> serde_json::Value {
    let out = common::cli::command()
        .args(["llm", "bench", "--url", url, "--solo", "--rate", "4"])
        .args(["--json", "--max-tokens", "8"])
        .args(flags)
        .output()
        .unwrap();
    assert!(out.status.success(), "bench: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn the_bench_client_keeps_its_connections_when_asked() {
    // `llm bench --keep-alive` reuses a tenant's idle connections, as the OpenAI SDKs do: every
    // request answered, fewer connections than requests; without it, one each.
    let (s, _dir) = start();
    for (flags, kept) in [(&["--keep-alive"][..], true), (&[][..], false)] {
        let out = bench_solo(&s.url, &[&["--seconds", "5"][..], flags].concat());
        let q = &out["tenants"][0];
        let n = |k: &str| q[k].as_u64().unwrap_or_else(|| panic!("{k} missing: {out}"));
        assert!(n("sent") >= 10, "{out}");
        assert_eq!(n("ok"), n("sent"), "every request answered: {out}");
        if kept {
            assert!(n("connections") < n("sent") / 2, "connections reused: {out}");
        } else {
            assert_eq!(n("connections"), n("sent"), "one connection a request: {out}");
        }
    }
    // --warmup: the first seconds' requests are sent and not counted; the engine's counters
    // are read when the measured load starts.
    let out = bench_solo(&s.url, &["--seconds", "3", "--warmup", "3", "--engine-metrics", &s.url]);
    let q = &out["tenants"][0];
    let n = |k: &str| q[k].as_u64().unwrap_or_else(|| panic!("{k} missing: {out}"));
    // 12 expected in each part (Poisson at 4/s for 3 s).
    assert!(n("warmup_sent") >= 3 && n("sent") >= 3, "{out}");
    assert_eq!(n("ok"), n("sent"), "{out}");
    assert_eq!(out["warmup_s"], 3.0, "{out}");
    // The engine's counters were read around the measured part (each request takes a step
    // a token at least, shared or not).
    assert!(out["engine"]["steps"].as_f64().unwrap() >= n("sent") as f64, "{out}");
}
