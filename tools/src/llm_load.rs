//! `fastlane llm bench --url URL --scenario a`: an open-loop HTTP load generator against any
//! OpenAI-compatible server (ours, or another behind `--url`).
//!
//! Per tenant: Poisson arrivals at its rate, one connection per request, a streamed completion
//! (`stream: true`), SSE read as it comes. TTFT is the time from just before the connection is
//! opened to the first token event read; inter-token gaps between token events. Scenario (a),
//! scaled to this CPU engine: a `quiet` tenant at `--rate` requests/s beside a `flood` tenant at
//! 30× that rate (`--solo`: the quiet tenant alone, the baseline).

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rand::{Rng, SeedableRng};
use serde::Serialize;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

/// One tenant's load.
#[derive(Debug, Clone)]
pub(crate) struct Load {
    pub name: String,
    pub key: String,
    pub rate: f64,
}

#[derive(Debug, Default, Serialize)]
pub(crate) struct TenantResult {
    pub tenant: String,
    pub sent: u64,
    pub ok: u64,
    pub rejected_429: u64,
    pub errors: u64,
    pub tokens: u64,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    pub ttft_max_ms: f64,
    pub itl_p99_ms: f64,
    pub completed_per_s: f64,
}

struct Outcome {
    status: u16,
    ttft: Option<Duration>,
    gaps: Vec<Duration>,
    tokens: u64,
}

/// One streamed completion over a fresh connection.
async fn one(addr: &str, key: &str, prompt: &str, max_tokens: u32) -> Result<Outcome> {
    let t0 = Instant::now();
    let mut s =
        tokio::net::TcpStream::connect(addr).await.with_context(|| format!("connect {addr}"))?;
    let body = serde_json::json!({"prompt": prompt, "max_tokens": max_tokens, "stream": true,
                                  "temperature": 0, "ignore_eos": true})
    .to_string();
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await?;
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).await?;
    let status: u16 = line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).unwrap_or(0);
    let mut out = Outcome { status, ttft: None, gaps: Vec::new(), tokens: 0 };
    if status != 200 {
        return Ok(out);
    }
    let mut last: Option<Instant> = None;
    // Bounded by the response: the server ends it after [DONE] (Connection: close).
    loop {
        line.clear();
        if r.read_line(&mut line).await? == 0 {
            break;
        }
        let Some(data) = line.trim_end().strip_prefix("data: ") else { continue };
        if data == "[DONE]" {
            break;
        }
        if data.contains("\"finish_reason\":null") {
            let now = Instant::now();
            match last {
                None => out.ttft = Some(now - t0),
                Some(l) => out.gaps.push(now - l),
            }
            last = Some(now);
            out.tokens += 1;
        }
    }
    Ok(out)
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 * p).ceil() as usize).clamp(1, v.len()) - 1]
}

/// Runs the loads for `secs` seconds (then waits for the requests in flight, at most 120 s).
pub(crate) async fn run(
    addr: String,
    loads: Vec<Load>,
    secs: f64,
    max_tokens: u32,
    seed: u64,
) -> Result<Vec<TenantResult>> {
    let start = Instant::now();
    let mut handles = Vec::new();
    for (ti, l) in loads.iter().enumerate() {
        let mut rng =
            rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ ((ti as u64 + 1) * 0x9e37_79b9));
        let mut at = 0.0f64;
        let mut i = 0u64;
        // Bounded: rate × seconds arrivals.
        while at < secs {
            let (addr, key) = (addr.clone(), l.key.clone());
            let prompt = format!("{} request {i}: {}", l.name, "lorem ipsum dolor ".repeat(3));
            let when = start + Duration::from_secs_f64(at);
            handles.push((
                ti,
                tokio::spawn(async move {
                    tokio::time::sleep_until(when.into()).await;
                    one(&addr, &key, &prompt, max_tokens).await
                }),
            ));
            i += 1;
            at += -(1.0 - rng.random::<f64>()).ln() / l.rate;
        }
    }
    let mut res: Vec<TenantResult> = loads
        .iter()
        .map(|l| TenantResult { tenant: l.name.clone(), ..Default::default() })
        .collect();
    let mut ttft: Vec<Vec<f64>> = vec![Vec::new(); loads.len()];
    let mut gaps: Vec<Vec<f64>> = vec![Vec::new(); loads.len()];
    let deadline = start + Duration::from_secs_f64(secs) + Duration::from_secs(120);
    for (ti, h) in handles {
        res[ti].sent += 1;
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, h).await {
            Ok(Ok(Ok(o))) if o.status == 200 => {
                res[ti].ok += 1;
                res[ti].tokens += o.tokens;
                if let Some(t) = o.ttft {
                    ttft[ti].push(t.as_secs_f64() * 1e3);
                }
                gaps[ti].extend(o.gaps.iter().map(|g| g.as_secs_f64() * 1e3));
            }
            Ok(Ok(Ok(o))) if o.status == 429 => res[ti].rejected_429 += 1,
            _ => res[ti].errors += 1,
        }
    }
    let wall = start.elapsed().as_secs_f64();
    for (ti, r) in res.iter_mut().enumerate() {
        r.ttft_p50_ms = pct(&mut ttft[ti], 0.5);
        r.ttft_p99_ms = pct(&mut ttft[ti], 0.99);
        r.ttft_max_ms = ttft[ti].last().copied().unwrap_or(f64::NAN);
        r.itl_p99_ms = pct(&mut gaps[ti], 0.99);
        r.completed_per_s = r.ok as f64 / wall.max(secs);
    }
    if res.iter().all(|r| r.ok == 0) {
        bail!("no request succeeded against {addr}");
    }
    Ok(res)
}

/// `fastlane llm bench --url`: scenario (a) or the quiet tenant alone; prints the table.
pub(crate) fn bench(
    url: &str,
    solo: bool,
    rate: f64,
    secs: f64,
    max_tokens: u32,
    json: bool,
) -> Result<serde_json::Value> {
    let addr = url
        .trim_end_matches('/')
        .strip_prefix("http://")
        .context("--url: http://HOST:PORT")?
        .to_string();
    let mut loads = vec![Load { name: "quiet".into(), key: "key-quiet".into(), rate }];
    if !solo {
        loads.push(Load { name: "flood".into(), key: "key-flood".into(), rate: 30.0 * rate });
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    let res = rt.block_on(run(addr, loads, secs, max_tokens, 1))?;
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim().to_string();
    if !json {
        println!(
            "scenario a over HTTP ({url}), {secs} s, quiet at {rate}/s{}, load {load}",
            if solo { " alone" } else { ", flood at 30x" }
        );
        println!(
            "{:<8} {:>6} {:>6} {:>6} {:>6} {:>10} {:>10} {:>10} {:>10} {:>9}",
            "tenant",
            "sent",
            "ok",
            "429",
            "err",
            "TTFT P50",
            "TTFT P99",
            "TTFT max",
            "ITL P99",
            "done/s"
        );
        for r in &res {
            println!(
                "{:<8} {:>6} {:>6} {:>6} {:>6} {:>8.1}ms {:>8.1}ms {:>8.1}ms {:>8.1}ms {:>9.2}",
                r.tenant,
                r.sent,
                r.ok,
                r.rejected_429,
                r.errors,
                r.ttft_p50_ms,
                r.ttft_p99_ms,
                r.ttft_max_ms,
                r.itl_p99_ms,
                r.completed_per_s
            );
        }
    }
    Ok(
        serde_json::json!({"scenario": "a", "url": url, "solo": solo, "rate": rate, "seconds": secs, "load": load, "tenants": res}),
    )
}
