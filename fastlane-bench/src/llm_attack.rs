//! Hostile clients for `fastlane llm bench --url … --attack N`: while the measured load runs,
//! N connections of each kind below are kept open against the server (each one that ends is
//! replaced), and what the server answered each kind is counted.
//!
//! - `no_key_trickle`: no API key, a 1 MB body declared and trickled a byte a second (once
//!   answered, a second's pause before the next connection);
//! - `slow_headers`: a request's headers trickled a byte a second;
//! - `never_reads`: a valid key (`--attack-key`), a long streamed request, nothing read;
//! - `max_prompt`: a valid key, a prompt near the context window, four 256-byte stop
//!   strings, the whole response read;
//! - `burst_429`: a valid key of a small-bucket interactive tenant (`--attack-burst-key`), a
//!   request a second on each connection (mostly answered 429).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The kinds, in report order.
pub const KINDS: [&str; 5] =
    ["no_key_trickle", "slow_headers", "never_reads", "max_prompt", "burst_429"];

/// What to attack with.
#[derive(Debug, Clone)]
pub struct Attack {
    /// Connections of each kind kept open.
    pub per_kind: usize,
    /// A valid key (its tenant takes `never_reads` and `max_prompt`).
    pub key: String,
    /// A valid key of a tenant with a small bucket (`burst_429`).
    pub burst_key: String,
    /// The kinds that attack (a subset of [`KINDS`]).
    pub kinds: Vec<&'static str>,
}

/// `names` as kinds of [`KINDS`]; an unknown name is an error that lists the known ones.
pub fn kinds(names: &[String]) -> anyhow::Result<Vec<&'static str>> {
    names
        .iter()
        .map(|n| {
            KINDS.iter().copied().find(|k| k == n).ok_or_else(|| {
                anyhow::anyhow!("--attack-kinds: unknown kind {n:?} (known: {})", KINDS.join(","))
            })
        })
        .collect()
}

/// Per kind: connections opened, and the HTTP statuses answered (0: closed without one).
#[derive(Debug, Default, Clone, Serialize)]
pub struct KindReport {
    /// Connections opened.
    pub opened: u64,
    /// Status → count.
    pub statuses: BTreeMap<u16, u64>,
}

/// The attack's counts, per kind.
pub type Report = BTreeMap<&'static str, KindReport>;

type Shared = Arc<Mutex<Report>>;

fn count(r: &Shared, kind: &'static str, status: Option<u16>) {
    let mut r = r.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let k = r.entry(kind).or_default();
    match status {
        None => k.opened += 1,
        Some(s) => *k.statuses.entry(s).or_default() += 1,
    }
}

async fn status_of(s: &mut tokio::net::TcpStream) -> u16 {
    let mut head = [0u8; 12];
    match s.read_exact(&mut head).await {
        Ok(_) => std::str::from_utf8(&head[9..12]).ok().and_then(|v| v.parse().ok()).unwrap_or(0),
        Err(_) => 0,
    }
}

fn post(addr: &str, key: Option<&str>, body: &str) -> String {
    let auth = key.map(|k| format!("Authorization: Bearer {k}\r\n")).unwrap_or_default();
    format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// One connection of `kind`, to its end (bounded by the server's limits, or `stop`).
async fn one(addr: &str, kind: &'static str, a: &Attack, stop: &AtomicBool, r: &Shared) {
    let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else {
        tokio::time::sleep(Duration::from_millis(100)).await;
        return;
    };
    count(r, kind, None);
    let tick = Duration::from_secs(1);
    let status = match kind {
        "no_key_trickle" => {
            let head =
                "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n";
            let _ = s.write_all(head.as_bytes()).await;
            // One byte a second until the server answers (it should at once).
            let mut status = 0;
            while !stop.load(Ordering::Relaxed) {
                tokio::select! {
                    st = status_of(&mut s) => { status = st; break; }
                    _ = tokio::time::sleep(tick) => {
                        if s.write_all(b"x").await.is_err() { break; }
                    }
                }
            }
            // Then a second before the next: N connections, N keyless requests a second. An
            // attacker reconnecting as fast as the CPU allows is a connection flood, which
            // the threat model leaves to the network in front (docs/serving.md).
            tokio::time::sleep(tick).await;
            status
        }
        "slow_headers" => {
            let head = format!("GET /v1/models HTTP/1.1\r\nHost: {addr}\r\nX-Slow: ");
            let mut status = 0;
            for b in head.bytes().chain(std::iter::repeat(b'a')) {
                if stop.load(Ordering::Relaxed) || s.write_all(&[b]).await.is_err() {
                    break;
                }
                tokio::select! {
                    st = status_of(&mut s) => { status = st; break; }
                    _ = tokio::time::sleep(tick) => {}
                }
            }
            status
        }
        "never_reads" => {
            let body = r#"{"prompt": "never read", "max_tokens": 2048, "stream": true, "ignore_eos": true}"#;
            let _ = s.write_all(post(addr, Some(&a.key), body).as_bytes()).await;
            // Held, unread, until the server closes it or the run ends.
            let mut probe = [0u8; 1];
            while !stop.load(Ordering::Relaxed) {
                match tokio::time::timeout(tick, s.peek(&mut probe)).await {
                    Ok(Ok(0)) | Ok(Err(_)) => break,
                    // Data waits unread: look again in a second.
                    Ok(Ok(_)) => tokio::time::sleep(tick).await,
                    Err(_) => {}
                }
            }
            0
        }
        "max_prompt" => {
            let stop_strings: Vec<String> = (0..4).map(|i| format!("{i}").repeat(256)).collect();
            let body = serde_json::json!({"prompt": "p".repeat(3000), "max_tokens": 64,
                "stop": stop_strings, "ignore_eos": true})
            .to_string();
            let _ = s.write_all(post(addr, Some(&a.key), &body).as_bytes()).await;
            let st = status_of(&mut s).await;
            let mut sink = Vec::new();
            let _ = tokio::time::timeout(Duration::from_secs(60), s.read_to_end(&mut sink)).await;
            st
        }
        _ => {
            let body = r#"{"prompt": "burst", "max_tokens": 1}"#;
            let _ = s.write_all(post(addr, Some(&a.burst_key), body).as_bytes()).await;
            let st = status_of(&mut s).await;
            // One request a second per connection: N connections, N requests a second.
            tokio::time::sleep(tick).await;
            st
        }
    };
    count(r, kind, Some(status));
}

/// Runs the attack until `stop` is set; the counts.
pub async fn run(addr: String, a: Attack, stop: Arc<AtomicBool>) -> Report {
    let report: Shared = Arc::new(Mutex::new(Report::new()));
    let mut tasks = Vec::new();
    for kind in a.kinds.clone() {
        for _ in 0..a.per_kind {
            let (addr, a, stop, r) = (addr.clone(), a.clone(), stop.clone(), report.clone());
            tasks.push(tokio::spawn(async move {
                // Bounded by `stop`: each turn is one connection.
                while !stop.load(Ordering::Relaxed) {
                    one(&addr, kind, &a, &stop, &r).await;
                }
            }));
        }
    }
    while !stop.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A connection that holds on (a trickled body, a stream nobody reads) can outlast the
    // measurement by minutes: after 5 s the counts are taken and the rest are cut.
    tokio::time::sleep(Duration::from_secs(5)).await;
    for t in &tasks {
        t.abort();
    }
    let r = report.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
    r
}

/// `VmRSS`, `VmHWM` (kB) and `Threads` of process `pid`, from `/proc`.
pub fn process_usage(pid: u32) -> Option<serde_json::Value> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| -> Option<u64> {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
    };
    Some(serde_json::json!({"rss_kb": field("VmRSS:")?, "hwm_kb": field("VmHWM:")?,
        "threads": field("Threads:")?}))
}
