//! `fastlane router` end to end: a real `fastlane llm serve --policy fifo` upstream (no gate
//! of its own), the router in front, curl and raw sockets as clients on loopback. Covers the
//! passthrough (same token ids as direct), 401/400/429/503, the slot held to the last token,
//! DRR ordering of dispatch, the fence and a client that goes away (both abort the upstream
//! request and free its KV blocks), the upstream being down (502), metrics and the drain;
//! and, against a raw-socket upstream that sends headers before the body, a non-streamed
//! response under a fence collected whole or refused with a 504.

mod common;

use std::io::Read;

use std::time::{Duration, Instant};

use common::http::{curl, json_body, open_stream, token_ids, Server};

const TENANTS: &str = r#"
[[tenant]]
name = "quiet"
keys = ["key-quiet"]
rpm = 6000
burst = 100
max_concurrent = 4
tier = "interactive"

[[tenant]]
name = "flood"
keys = ["key-flood"]
rpm = 6000
burst = 100
max_concurrent = 16
tier = "batch"
queue = 32

[[tenant]]
name = "tight"
keys = ["key-tight"]
rpm = 1
burst = 1
max_concurrent = 1
tier = "batch"

[[tenant]]
name = "slot"
keys = ["key-slot"]
rpm = 6000
burst = 100
max_concurrent = 1
tier = "batch"
queue = 1

[[tenant]]
name = "fenced"
keys = ["key-fenced"]
rpm = 6000
burst = 100
max_concurrent = 2
tier = "batch"
max_stream_seconds = 1

[[tenant]]
name = "brief"
keys = ["key-brief"]
rpm = 6000
burst = 100
max_concurrent = 2
tier = "batch"
max_stream_seconds = 0.1
"#;

struct Pair {
    upstream: Server,
    router: Server,
    _dir: tempfile::TempDir,
}

fn start(slots: &str) -> Pair {
    start_with(slots, &[])
}

/// As [`start`], with more router flags.
fn start_with(slots: &str, extra: &[&str]) -> Pair {
    let upstream = Server::start(&["llm", "serve", "--listen", "127.0.0.1:0", "--policy", "fifo"]);
    let mut args = vec!["--upstream-slots", slots, "--drain-seconds", "10"];
    args.extend_from_slice(extra);
    let (router, dir) = router_to(&upstream.url, &args);
    Pair { upstream, router, _dir: dir }
}

/// A router with [`TENANTS`] in front of `upstream`, with more flags; the directory that
/// holds its tenants file lives as long as it is kept.
fn router_to(upstream: &str, extra: &[&str]) -> (Server, tempfile::TempDir) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let tenants = dir.path().join("tenants.toml");
    std::fs::write(&tenants, TENANTS).unwrap();
    let mut args = vec![
        "router",
        "--upstream",
        upstream,
        "--listen",
        "127.0.0.1:0",
        "--tenants",
        tenants.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    (Server::start(&args), dir)
}

fn read_all(c: std::net::TcpStream) -> String {
    common::http::read_response(c)
}

/// Reads two streamed responses to their ends in one thread, draining `first` before each
/// look at `second`, and fails if `second` has an event before `first` has its `[DONE]` (the
/// slot is held to the last token). One thread: two readers' clocks let a preempted reader
/// fail it on a loaded machine. Both texts as [`read_all`] returns them.
fn second_after_first(
    mut first: std::net::TcpStream,
    mut second: std::net::TcpStream,
) -> (String, String) {
    first.set_nonblocking(true).unwrap();
    second.set_nonblocking(true).unwrap();
    let (mut a, mut b) = (Vec::new(), Vec::new());
    let (mut a_end, mut b_end) = (false, false);
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut buf = vec![0u8; 64 << 10];
    // Whether it read anything.
    let mut drain = |c: &mut std::net::TcpStream, into: &mut Vec<u8>, end: &mut bool| {
        let before = into.len();
        // Bounded by what the socket holds.
        while !*end {
            match c.read(&mut buf) {
                Ok(0) => *end = true,
                Ok(n) => into.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("read: {e}"),
            }
        }
        into.len() > before
    };
    let mut first_done = false;
    // Bounded by the deadline.
    while !(a_end && b_end) {
        assert!(Instant::now() < deadline, "the two streams did not end within 60 s");
        if drain(&mut first, &mut a, &mut a_end) && !first_done {
            first_done = common::http::decode_response(&a).contains("data: [DONE]");
        }
        if drain(&mut second, &mut b, &mut b_end) && !first_done {
            let t = common::http::decode_response(&b);
            assert!(
                !t.contains("data: {"),
                "the second request streamed before the first ended: {t}"
            );
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    (common::http::decode_response(&a), common::http::decode_response(&b))
}

fn used_blocks_return_to_zero(s: &Server) {
    s.wait_metric("fastlane_llm_kv_blocks{state=\"used\"}", 10, "upstream KV blocks in use", |v| {
        v == 0.0
    });
}

#[test]
fn router_passes_through_and_enforces_the_tenants() {
    let p = start("64");
    let (r, u) = (&p.router, &p.upstream);
    let (st, _) = curl(&[&format!("{}/health", r.url)]);
    assert_eq!(st, 200);
    assert_eq!(
        json_body(&curl(&[&format!("{}/v1/models", r.url)]).1)["data"][0]["id"],
        "random:tiny"
    );

    // The same greedy tokens through the router as directly, streamed and not.
    let body = r#"{"prompt": "hello world", "max_tokens": 10, "temperature": 0, "return_token_ids": true}"#;
    let direct = token_ids(&u.post("/v1/completions", "any", body).1);
    assert_eq!(direct.len(), 10);
    let (st, text) = r.post("/v1/completions", "key-quiet", body);
    assert_eq!(st, 200, "{text}");
    assert_eq!(token_ids(&text), direct);
    let sbody = r#"{"prompt": "hello world", "max_tokens": 10, "temperature": 0, "return_token_ids": true, "stream": true}"#;
    let (st, text) = r.post("/v1/completions", "key-quiet", sbody);
    assert_eq!(st, 200);
    assert!(
        text.contains("text/event-stream") && text.trim_end().ends_with("data: [DONE]"),
        "{text}"
    );
    assert_eq!(token_ids(&text), direct);
    let chat = r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}"#;
    let (st, text) = r.post("/v1/chat/completions", "key-quiet", chat);
    assert_eq!((st, json_body(&text)["object"].as_str()), (200, Some("chat.completion")));

    // Errors at the router, OpenAI-shaped.
    let (st, text) = r.post("/v1/completions", "nobody", r#"{"prompt": "x"}"#);
    assert_eq!((st, json_body(&text)["error"]["code"].as_str()), (401, Some("invalid_api_key")));
    let (st, _) = r.post("/v1/completions", "key-quiet", "{not json");
    assert_eq!(st, 400);
    let (st, text) = r.post("/v1/completions", "key-quiet", r#"{"prompt": "x", "stream": "yes"}"#);
    assert_eq!(st, 400);
    assert!(json_body(&text)["error"]["message"].as_str().unwrap().contains("stream"));
    let (st, text) =
        r.post("/v1/completions", "key-quiet", r#"{"prompt": "x", "max_tokens": "ten"}"#);
    assert_eq!(st, 400, "{text}");
    assert!(json_body(&text)["error"]["message"].as_str().unwrap().contains("max_tokens"));
    let (st, _) = r.post("/v1/completions", "key-quiet", r#"["not", "an", "object"]"#);
    assert_eq!(st, 400);
    // The upstream's own 400s pass through.
    let (st, text) = r.post("/v1/completions", "key-quiet", r#"{"prompt": "x", "temprature": 1}"#);
    assert_eq!(st, 400, "{text}");
    // Bucket of one: 200 then 429 with Retry-After of one refill (60 s at 1 rpm).
    let small = r#"{"prompt": "x", "max_tokens": 2}"#;
    assert_eq!(r.post("/v1/completions", "key-tight", small).0, 200);
    let (st, text) = r.post("/v1/completions", "key-tight", small);
    assert_eq!(st, 429, "{text}");
    assert!(text.to_ascii_lowercase().contains("retry-after: 60"), "{text}");

    // One slot, queue of one: a long stream holds the slot to its last token; a second
    // request waits for it (and starts only after the first's [DONE]); a third finds the
    // queue full: 503.
    let long = open_stream(r.addr(), "key-slot", 1000);
    r.wait_metric("fastlane_llm_streams_open{tenant=\"slot\"}", 10, "long stream open", |v| {
        v == 1.0
    });
    let waiting = open_stream(r.addr(), "key-slot", 2);
    r.wait_metric("fastlane_llm_queue_depth{tenant=\"slot\"}", 10, "second request queued", |v| {
        v == 1.0
    });
    let (st, text) = r.post("/v1/completions", "key-slot", small);
    assert_eq!(st, 503, "{text}");
    assert_eq!(json_body(&text)["error"]["code"], "queue_full");
    let (long_text, waited) = second_after_first(long, waiting);
    assert!(long_text.contains("\"completion_tokens\":1000"), "{long_text}");
    assert!(waited.contains("data: [DONE]"), "{waited}");

    // The fence: a 1-second tenant's long stream ends with an error event and [DONE]; the
    // upstream request is aborted and its blocks come back.
    let aborted = u.metric("fastlane_llm_requests_total{outcome=\"aborted\",tenant=\"default\"}");
    let t0 = Instant::now();
    let text = read_all(open_stream(r.addr(), "key-fenced", 3000));
    assert!(t0.elapsed() < Duration::from_secs(20));
    assert!(
        text.contains("max_stream_seconds") && text.trim_end().ends_with("data: [DONE]"),
        "{text}"
    );
    used_blocks_return_to_zero(u);
    u.wait_metric(
        "fastlane_llm_requests_total{outcome=\"aborted\",tenant=\"default\"}",
        10,
        "the upstream aborted the fenced request",
        |v| v >= aborted + 1.0,
    );
    assert!(r.metric("fastlane_llm_requests_total{outcome=\"fenced\",tenant=\"fenced\"}") >= 1.0);
    // Not streamed: the fence gives a 504 with an OpenAI error body, not a cut 200.
    let t0 = Instant::now();
    let (st, text) = r.post(
        "/v1/completions",
        "key-brief",
        r#"{"prompt": "x", "max_tokens": 3000, "ignore_eos": true}"#,
    );
    assert_eq!(st, 504, "{}", &text[..text.len().min(300)]);
    assert_eq!(json_body(&text)["error"]["type"], "timeout_error", "{text}");
    assert!(t0.elapsed() < Duration::from_secs(20));
    used_blocks_return_to_zero(u);
    u.wait_metric(
        "fastlane_llm_requests_total{outcome=\"aborted\",tenant=\"default\"}",
        10,
        "the upstream aborted the fenced whole request",
        |v| v >= aborted + 2.0,
    );

    // A client that leaves mid-stream: the upstream request is aborted, blocks come back,
    // the router's slot is free again.
    let mut c = open_stream(r.addr(), "key-quiet", 3000);
    let mut buf = [0u8; 512];
    assert!(c.read(&mut buf).unwrap() > 0);
    drop(c);
    used_blocks_return_to_zero(u);
    u.wait_metric(
        "fastlane_llm_requests_total{outcome=\"aborted\",tenant=\"default\"}",
        10,
        "the upstream aborted the abandoned request",
        |v| v >= aborted + 3.0,
    );
    r.wait_metric("fastlane_llm_streams_open{tenant=\"quiet\"}", 10, "router slot freed", |v| {
        v == 0.0
    });

    // Metrics at the router: per-tenant TTFT measured there.
    assert!(r.metric("fastlane_llm_ttft_seconds_count{tenant=\"quiet\"}") >= 3.0);
    // The TTFT's stages are llm serve's; the router shows no empty series of them.
    let text = curl(&[&format!("{}/metrics", r.url)]).1;
    assert!(text.contains("fastlane_llm_ttft_seconds_count{tenant=\"quiet\"}"), "{text}");
    assert!(!text.contains("fastlane_llm_ttft_stage_seconds_count"), "{text}");
    assert!(
        r.metric("fastlane_llm_requests_total{outcome=\"rejected_queue_full\",tenant=\"slot\"}")
            >= 1.0
    );
}

#[test]
fn router_dispatches_by_drr_and_survives_its_upstream() {
    // One upstream slot: ten flood requests queue at the router, then one quiet request;
    // DRR (interactive first) sends the quiet one next, not after the whole flood.
    let mut p = start("1");
    let r_addr = p.router.addr().to_string();
    let first = open_stream(&r_addr, "key-flood", 2000);
    p.router.wait_metric("fastlane_llm_streams_open{tenant=\"flood\"}", 10, "flood running", |v| {
        v == 1.0
    });
    let floods: Vec<_> = (0..10).map(|_| open_stream(&r_addr, "key-flood", 100)).collect();
    p.router.wait_metric("fastlane_llm_queue_depth{tenant=\"flood\"}", 10, "flood queued", |v| {
        v == 10.0
    });
    let quiet = open_stream(&r_addr, "key-quiet", 4);
    let quiet_done = std::thread::spawn(move || (read_all(quiet), Instant::now()));
    let mut flood_ends = Vec::new();
    let mut handles = vec![std::thread::spawn(move || (read_all(first), Instant::now()))];
    handles.extend(
        floods.into_iter().map(|c| std::thread::spawn(move || (read_all(c), Instant::now()))),
    );
    for h in handles {
        let (t, at) = h.join().unwrap();
        assert!(t.contains("data: [DONE]"), "{t}");
        flood_ends.push(at);
    }
    let (qt, q_end) = quiet_done.join().unwrap();
    assert!(qt.contains("data: [DONE]"), "{qt}");
    let floods_before = flood_ends.iter().filter(|&&e| e < q_end).count();
    assert!(floods_before <= 2, "quiet finished after {floods_before} flood requests, not next");

    // The upstream goes away: 502, and the router keeps serving its own endpoints (alive,
    // not ready).
    let _ = p.upstream.child.kill();
    let _ = p.upstream.child.wait();
    let (st, text) =
        p.router.post("/v1/completions", "key-quiet", r#"{"prompt": "x", "max_tokens": 2}"#);
    assert_eq!(st, 502, "{text}");
    assert_eq!(curl(&[&format!("{}/livez", p.router.url)]).0, 200);
    assert_eq!(curl(&[&format!("{}/health", p.router.url)]).0, 503);

    // SIGTERM: exits 0.
    p.router.sigterm();
    let status = p.router.wait_exit(15);
    assert!(status.success(), "{status:?}");
}

#[test]
fn router_sends_batch_tenants_upstream_with_the_batch_key() {
    // An upstream with tenants of its own, one per tier: the router's batch tenants arrive
    // there as its batch tenant, the others as its interactive one.
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let upstream_tenants = dir.path().join("upstream.toml");
    std::fs::write(
        &upstream_tenants,
        r#"
[[tenant]]
name = "router"
keys = ["up-i"]
rpm = 60000
burst = 1000
max_concurrent = 100
tier = "interactive"

[[tenant]]
name = "router-batch"
keys = ["up-b"]
rpm = 60000
burst = 1000
max_concurrent = 100
tier = "batch"
"#,
    )
    .unwrap();
    let u = Server::start(&[
        "llm",
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--tenants",
        upstream_tenants.to_str().unwrap(),
    ]);
    let (r, _router_dir) =
        router_to(&u.url, &["--upstream-key", "up-i", "--upstream-batch-key", "up-b"]);
    let body = r#"{"prompt": "x", "max_tokens": 2}"#;
    for key in ["key-flood", "key-flood", "key-quiet"] {
        let (st, text) = r.post("/v1/completions", key, body);
        assert_eq!(st, 200, "{text}");
    }
    let finished = |t: &str| {
        u.metric(&format!("fastlane_llm_requests_total{{outcome=\"finished\",tenant=\"{t}\"}}"))
    };
    assert_eq!(finished("router-batch"), 2.0, "batch tenants under the batch key");
    assert_eq!(finished("router"), 1.0, "interactive ones under the other key");
}

#[test]
fn router_with_a_batch_prefill_limit_serves_every_tier() {
    // One batch prompt at a time awaiting its first bytes: streamed batch requests go one
    // after another's first token, a non-streamed one is not held by them, interactive ones
    // not at all; every request completes (the gate's test checks the order).
    let p = start_with("64", &["--batch-prefills", "1"]);
    let addr = p.router.addr().to_string();
    let streams: Vec<_> = (0..4).map(|_| open_stream(&addr, "key-flood", 8)).collect();
    let whole = r#"{"prompt": "x", "max_tokens": 4, "ignore_eos": true, "return_token_ids": true}"#;
    let (st, text) = p.router.post("/v1/completions", "key-flood", whole);
    assert_eq!(st, 200, "{text}");
    assert_eq!(token_ids(&text).len(), 4, "{text}");
    let (st, text) = p.router.post("/v1/completions", "key-quiet", whole);
    assert_eq!(st, 200, "{text}");
    for s in streams {
        let text = read_all(s);
        assert!(text.contains("data: [DONE]"), "{text}");
        assert!(text.matches("data: {").count() >= 8, "8 tokens streamed: {text}");
    }
    let admitted =
        p.router.metric("fastlane_llm_requests_total{outcome=\"admitted\",tenant=\"flood\"}");
    assert_eq!(admitted, 5.0);
    p.router.wait_metric("fastlane_llm_streams_open{tenant=\"flood\"}", 10, "flood streams", |v| {
        v == 0.0
    });
    used_blocks_return_to_zero(&p.upstream);
}

/// What the raw upstream of [`a_whole_response_under_a_fence_is_collected_or_refused`] saw of
/// one request.
#[derive(Debug, PartialEq)]
enum Seen {
    /// The router closed the connection while the body was unfinished.
    Closed,
    /// The body was sent to its end.
    Finished,
}

/// One request on `c`: answers 200 with its headers and the first half of a JSON body at once,
/// then the second half after `max_tokens` milliseconds unless the peer closes first.
fn half_then_rest(mut c: std::net::TcpStream) -> Seen {
    use std::io::Write;
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut req = Vec::new();
    let mut buf = [0u8; 4096];
    // Bounded by the read timeout and the request's length.
    let body = loop {
        let n = c.read(&mut buf).unwrap();
        assert!(n > 0, "request cut");
        req.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&req).into_owned();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let len: usize = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().parse().unwrap())
                })
                .unwrap_or(0);
            if body.len() >= len {
                break body.to_string();
            }
        }
    };
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let delay = Duration::from_millis(v["max_tokens"].as_u64().unwrap());
    let first = r#"{"object": "text_completion", "choices": [{"index": 0, "text": "half"#;
    write!(
        c,
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n{:x}\r\n{first}\r\n",
        first.len()
    )
    .unwrap();
    c.flush().unwrap();
    c.set_read_timeout(Some(delay)).unwrap();
    match c.read(&mut buf) {
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            let rest = r#" and rest", "finish_reason": "length"}]}"#;
            write!(c, "{:x}\r\n{rest}\r\n0\r\n\r\n", rest.len()).unwrap();
            Seen::Finished
        }
        _ => Seen::Closed,
    }
}

#[test]
fn a_whole_response_under_a_fence_is_collected_or_refused() {
    // An upstream that sends a non-streamed response's headers and part of its body before
    // the rest (ours sends them at the end): under a fence the router collects the body and
    // sends it whole, or, when the fence fires first, answers 504 instead of a cut 200 and
    // closes the upstream connection.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let upstream = format!("http://{}", listener.local_addr().unwrap());
    let (tx, seen) = std::sync::mpsc::channel();
    let server = std::thread::spawn(move || {
        for _ in 0..2 {
            let (c, _) = listener.accept().unwrap();
            tx.send(half_then_rest(c)).unwrap();
        }
    });
    let (r, _dir) = router_to(&upstream, &[]);
    // Fence 1 s, the rest after 0.3 s: the whole body, in one piece, with a 200.
    let (st, text) =
        r.post("/v1/completions", "key-fenced", r#"{"prompt": "x", "max_tokens": 300}"#);
    assert_eq!(st, 200, "{text}");
    assert_eq!(json_body(&text)["choices"][0]["text"], "half and rest", "{text}");
    assert_eq!(seen.recv_timeout(Duration::from_secs(10)).unwrap(), Seen::Finished);
    // Fence 0.1 s, the rest after 5 s: 504, and the upstream connection closed before 5 s.
    let t0 = Instant::now();
    let (st, text) =
        r.post("/v1/completions", "key-brief", r#"{"prompt": "x", "max_tokens": 5000}"#);
    assert_eq!(st, 504, "{text}");
    assert_eq!(json_body(&text)["error"]["type"], "timeout_error", "{text}");
    assert_eq!(seen.recv_timeout(Duration::from_secs(10)).unwrap(), Seen::Closed);
    assert!(t0.elapsed() < Duration::from_secs(4), "closed at the fence, not at the body's end");
    server.join().unwrap();
}

/// The JSON log lines of `path` whose `fields.event` is `event`: their fields.
fn events(path: &std::path::Path, event: &str) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(path).unwrap();
    text.lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap_or_else(|e| panic!("{e}: {l}"))
        })
        .filter(|r| r["fields"]["event"] == event)
        .map(|r| {
            assert!(r["timestamp"].as_str().is_some_and(|t| t.ends_with('Z')), "{r}");
            r["fields"].clone()
        })
        .collect()
}

#[test]
fn engine_and_router_trace_events_are_json_lines_with_their_fields() {
    // What `scripts/router-floor.sh` reads: with `--log-format json` and trace on for the engine
    // and the router, one event per engine step and request taken in, one per dispatch and
    // first bytes, each with numeric fields.
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let (up_log, router_log) = (dir.path().join("up.log"), dir.path().join("router.log"));
    let tenants = dir.path().join("tenants.toml");
    std::fs::write(&tenants, TENANTS).unwrap();
    let trace = Some("info,fastlane_llm=trace,fastlane_openai=trace");
    let upstream = Server::start_logging(
        &["llm", "serve", "--log-format", "json", "--listen", "127.0.0.1:0", "--policy", "fifo"],
        trace,
        Some(&up_log),
    );
    let t = tenants.to_str().unwrap();
    let router = Server::start_logging(
        &["router", "--log-format", "json", "--upstream", &upstream.url]
            .into_iter()
            .chain(["--listen", "127.0.0.1:0", "--tenants", t])
            .collect::<Vec<_>>(),
        trace,
        Some(&router_log),
    );
    let text = read_all(open_stream(router.addr(), "key-quiet", 4));
    assert!(text.contains("data: [DONE]"), "{text}");
    drop(router);
    drop(upstream);

    let steps = events(&up_log, "step");
    assert!(!steps.is_empty(), "engine steps logged");
    for s in &steps {
        assert!(s["step_us"].is_u64() && s["prefill_items"].is_u64(), "{s}");
        assert!(s["prefill_tokens"].is_u64() && s["decodes"].is_u64(), "{s}");
        assert!(s["given_up"].is_boolean(), "{s}");
    }
    assert!(steps.iter().any(|s| s["prefill_items"].as_u64() > Some(0)), "a prefill step");
    let taken = events(&up_log, "request_taken");
    assert_eq!(taken.len(), 1, "{taken:?}");
    assert!(taken[0]["waited_us"].is_u64() && taken[0]["prompt_tokens"].as_u64() > Some(0));
    let dispatched = events(&router_log, "dispatched");
    let first = events(&router_log, "first_bytes");
    assert_eq!((dispatched.len(), first.len()), (1, 1), "{dispatched:?} {first:?}");
    assert_eq!(dispatched[0]["tenant"], "quiet");
    assert_eq!(first[0]["tenant"], "quiet");
    let (d, f) = (dispatched[0]["after_us"].as_u64(), first[0]["after_us"].as_u64());
    assert!(d.is_some() && f >= d, "first bytes after the dispatch: {d:?} {f:?}");
}
