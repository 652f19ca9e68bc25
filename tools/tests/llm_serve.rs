//! `fastlane llm serve` end to end with a real HTTP client (curl) on loopback: the OpenAI
//! endpoints streamed and not, tenants (401, 429 with Retry-After), 400s that name the field,
//! the max-stream fence and a client that goes away both free the KV blocks, metrics, and
//! SIGTERM's drain. The server picks a free port (`--listen 127.0.0.1:0`) and is stopped by
//! the test; every wait is bounded.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
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
name = "fenced"
keys = ["key-fenced"]
rpm = 6000
burst = 100
max_concurrent = 2
tier = "batch"
max_stream_seconds = 1
"#;

struct Server {
    child: Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start() -> Server {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let tenants = dir.path().join("tenants.toml");
    std::fs::write(&tenants, TENANTS).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_fastlane"))
        .args(["llm", "serve", "--listen", "127.0.0.1:0", "--drain-seconds", "5", "--tenants"])
        .arg(&tenants)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start fastlane llm serve");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let url = line
        .trim()
        .strip_prefix("listening on ")
        .expect("the server prints its address")
        .to_string();
    Server { child, url, _dir: dir }
}

/// curl: returns (status, headers + body).
fn curl(args: &[&str]) -> (u16, String) {
    let out = Command::new("curl")
        .args(["-s", "-i", "--max-time", "60"])
        .args(args)
        .output()
        .expect("curl runs (CI installs it)");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let status = text.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    (status, text)
}

fn post(s: &Server, path: &str, key: &str, body: &str) -> (u16, String) {
    let auth = format!("Authorization: Bearer {key}");
    curl(&[
        "-H",
        &auth,
        "-H",
        "Content-Type: application/json",
        "-d",
        body,
        &format!("{}{path}", s.url),
    ])
}

fn json_body(text: &str) -> serde_json::Value {
    let body = text.split("\r\n\r\n").nth(1).unwrap_or("");
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

fn metric(s: &Server, name_and_labels: &str) -> f64 {
    let (_, text) = curl(&[&format!("{}/metrics", s.url)]);
    text.lines()
        .find(|l| l.starts_with(name_and_labels))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// Waits (at most 10 s) until no KV block is in use.
fn blocks_come_back(s: &Server) {
    let t0 = Instant::now();
    while metric(s, "fastlane_llm_kv_blocks{state=\"used\"}") > 0.0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "KV blocks still in use after 10 s");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn openai_endpoints_tenants_fence_disconnect_and_drain() {
    let s = start();
    let (st, text) = curl(&[&format!("{}/health", s.url)]);
    assert_eq!(st, 200, "{text}");
    let models = json_body(&curl(&[&format!("{}/v1/models", s.url)]).1);
    assert_eq!(models["data"][0]["id"], "random:tiny");

    // Non-streaming: the same token ids as the CLI's greedy generation.
    let body = r#"{"prompt": "hello world", "max_tokens": 12, "temperature": 0, "return_token_ids": true}"#;
    let (st, text) = post(&s, "/v1/completions", "key-quiet", body);
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
    let cli = Command::new(env!("CARGO_BIN_EXE_fastlane"))
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
    let (st, text) = post(&s, "/v1/completions", "key-quiet", body);
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

    // Chat.
    let body =
        r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}"#;
    let (st, text) = post(&s, "/v1/chat/completions", "key-quiet", body);
    assert_eq!(st, 200, "{text}");
    assert_eq!(json_body(&text)["object"], "chat.completion");

    // Errors: OpenAI-shaped, with the right status.
    let (st, text) = post(&s, "/v1/completions", "nobody", r#"{"prompt": "x"}"#);
    assert_eq!(st, 401, "{text}");
    assert_eq!(json_body(&text)["error"]["code"], "invalid_api_key");
    let (st, text) = post(&s, "/v1/completions", "key-quiet", "{not json");
    assert_eq!(st, 400, "{text}");
    let (st, text) =
        post(&s, "/v1/completions", "key-quiet", r#"{"prompt": "x", "temprature": 0}"#);
    assert_eq!(st, 400);
    assert!(json_body(&text)["error"]["message"].as_str().unwrap().contains("temprature"));
    let (st, _) =
        post(&s, "/v1/completions", "key-quiet", r#"{"prompt": "x", "max_tokens": 100000}"#);
    assert_eq!(st, 400);
    // The tight tenant: one request, then 429 with Retry-After.
    let (st, _) = post(&s, "/v1/completions", "key-tight", r#"{"prompt": "x", "max_tokens": 2}"#);
    assert_eq!(st, 200);
    let (st, text) =
        post(&s, "/v1/completions", "key-tight", r#"{"prompt": "x", "max_tokens": 2}"#);
    assert_eq!(st, 429, "{text}");
    assert!(text.to_ascii_lowercase().contains("retry-after: 60"), "{text}");

    // The fence: a 1-second tenant's long stream ends with an error event, and its blocks
    // come back.
    let t0 = Instant::now();
    let (st, text) = post(
        &s,
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
    assert!(metric(&s, "fastlane_llm_requests_total{outcome=\"fenced\",tenant=\"fenced\"}") >= 1.0);

    // A client that goes away mid-stream: the request is aborted and its blocks come back.
    let aborted = metric(&s, "fastlane_llm_requests_total{outcome=\"aborted\",tenant=\"quiet\"}");
    let out = Command::new("curl")
        .args(["-s", "-N", "--max-time", "1", "-H", "Authorization: Bearer key-quiet", "-d"])
        .arg(r#"{"prompt": "x", "max_tokens": 3000, "stream": true, "ignore_eos": true}"#)
        .arg(format!("{}/v1/completions", s.url))
        .output()
        .unwrap();
    assert!(!out.stdout.is_empty(), "tokens arrived before the client left");
    blocks_come_back(&s);
    assert!(
        metric(&s, "fastlane_llm_requests_total{outcome=\"aborted\",tenant=\"quiet\"}") > aborted
    );

    // Metrics: per-tenant TTFT histograms and the engine's gauges.
    assert!(metric(&s, "fastlane_llm_ttft_seconds_count{tenant=\"quiet\"}") >= 3.0);
    assert!(metric(&s, "fastlane_llm_engine_steps_total") > 0.0);

    // SIGTERM: the server drains and exits 0.
    let mut s = s;
    unsafe_free_sigterm(s.child.id());
    let t0 = Instant::now();
    loop {
        if let Some(status) = s.child.try_wait().unwrap() {
            assert!(status.success(), "exit status {status:?}");
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(15), "no exit 15 s after SIGTERM");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `kill -TERM PID` (the kill(1) command: no unsafe code in the test).
fn unsafe_free_sigterm(pid: u32) {
    let st = Command::new("kill").args(["-TERM", &pid.to_string()]).status().unwrap();
    assert!(st.success());
}
