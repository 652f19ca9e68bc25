//! `fastlane llm bench --url URL`: an open-loop HTTP load generator against any
//! OpenAI-compatible server (ours, our router, or another behind `--url`).
//!
//! Per tenant: arrivals at its rate, Poisson or AR(1)-bursty (the simulator's processes,
//! `fastlane_sched::sim::ArrivalProcess`), prompt and output lengths fixed or log-normal, one
//! connection per request (`--keep-alive`: idle connections reused, as the OpenAI SDKs do), a
//! streamed completion (`stream: true`) whose SSE events are read
//! as they come. TTFT is the time from just before the connection is opened (or the request
//! written on a reused one) to the first token event read; inter-token gaps are between token events. Scenario (a), scaled to this
//! CPU engine: a `quiet` tenant at `--rate` requests/s beside a `flood` tenant at 30× that
//! rate (`--solo`: the quiet tenant alone, the baseline).
//!
//! `--slow-streams N` first opens N streams of a third tenant whose client reads nothing (a
//! 4 KiB receive buffer), waits until the server has generated their tokens, and holds them
//! open for the whole run: slow readers must cost the other tenants nothing.
//!
//! Output: the table (or `--json`), and with `--hlog-dir` one `.hlog` per tenant (tags
//! `ttft`, `itl`) and `ttft.svg` with every tenant's TTFT distribution.

use std::path::PathBuf;
use std::time::{Duration, Instant, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use fastlane_hist::{percentile_plot_svg, Histogram, HlogWriter, PlotSeries};
use fastlane_sched::sim::{ArrivalProcess, LenDist, SimRng};
use fastlane_sched::{new_histogram, record};
use serde::Serialize;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

/// What to run.
#[derive(Debug, Clone)]
pub(crate) struct LoadOpts {
    /// `http://HOST:PORT`.
    pub url: String,
    /// Only the quiet tenant.
    pub solo: bool,
    /// The quiet tenant's mean rate, requests/s.
    pub rate: f64,
    /// Seconds of arrivals.
    pub secs: f64,
    /// Seconds of the same load sent before `secs` start and not counted (`--warmup`).
    pub warmup: f64,
    /// Tokens per request (the median with log-normal lengths).
    pub max_tokens: u32,
    /// Prompt tokens per request (median), for the byte-level random models one a byte.
    pub prompt_tokens: u32,
    /// `poisson` or `bursty`.
    pub arrivals: String,
    /// `fixed` or `lognormal`.
    pub lengths: String,
    /// Slow streams held open during the run.
    pub slow_streams: usize,
    /// Their tenant's key.
    pub slow_key: String,
    /// Tokens each slow stream asks for.
    pub slow_tokens: u32,
    /// Hostile connections of every kind held during the run (`crate::llm_attack`).
    pub attack: Option<crate::llm_attack::Attack>,
    /// The server's pid: its memory and threads are reported at the start and end of the run.
    pub server_pid: Option<u32>,
    /// Where the .hlog files and the SVG go.
    pub hlog_dir: Option<PathBuf>,
    /// Seed of arrivals and lengths.
    pub seed: u64,
    /// Written into every prompt ahead of its number (see `llm bench --prompt-tag`).
    pub prompt_tag: String,
    /// Keyless requests a second ([`crate::llm_attack::probe`]) during the measured load; 0: none.
    pub probe_rate: f64,
    /// `http://HOST:PORT` of an `llm serve` whose engine step histogram and given-up steps
    /// over the measured load are reported ([`engine_steps`]); it may differ from `url` (the
    /// upstream behind a router).
    pub engine_metrics: Option<String>,
    /// JSON instead of the table.
    pub json: bool,
    /// Each tenant's requests reuse its idle connections (HTTP/1.1 keep-alive, as the
    /// OpenAI SDKs do) instead of a fresh connection each.
    pub keep_alive: bool,
}

/// One tenant's load.
#[derive(Debug, Clone)]
struct Load {
    name: String,
    key: String,
    arrivals: ArrivalProcess,
    prompt: LenDist,
    output: LenDist,
}

#[derive(Debug, Default, Serialize)]
pub(crate) struct TenantResult {
    pub tenant: String,
    pub sent: u64,
    pub ok: u64,
    pub rejected_429: u64,
    pub rejected_503: u64,
    pub errors: u64,
    /// Connections opened (one a request, fewer with `--keep-alive`).
    pub connections: u64,
    pub tokens: u64,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    pub ttft_max_ms: f64,
    pub itl_p99_ms: f64,
    pub completed_per_s: f64,
    /// Requests sent in the warm-up (`--warmup`), in none of the counts above.
    pub warmup_sent: u64,
    #[serde(skip)]
    ttft: Option<Histogram<u64>>,
    #[serde(skip)]
    itl: Option<Histogram<u64>>,
}

struct Outcome {
    status: u16,
    /// Connections this request opened (0: it reused one, `--keep-alive`).
    connects: u64,
    ttft: Option<Duration>,
    gaps: Vec<Duration>,
    tokens: u64,
}

fn request_bytes(addr: &str, key: &str, prompt: &str, max_tokens: u32) -> String {
    request_with(addr, key, prompt, max_tokens, "close")
}

fn request_with(addr: &str, key: &str, prompt: &str, max_tokens: u32, connection: &str) -> String {
    let body = serde_json::json!({"prompt": prompt, "max_tokens": max_tokens, "stream": true,
                                  "temperature": 0, "ignore_eos": true})
    .to_string();
    format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: {connection}\r\n\r\n{body}",
        body.len()
    )
}

/// A tenant's idle kept-alive connections (`--keep-alive`).
type Idle = std::sync::Arc<std::sync::Mutex<Vec<BufReader<tokio::net::TcpStream>>>>;

/// One streamed completion over a fresh connection, or with `idle` over one of its
/// connections (a new one when none is idle), given back after a whole 200 response.
async fn one(
    addr: &str,
    key: &str,
    prompt: &str,
    max_tokens: u32,
    idle: Option<&Idle>,
) -> Result<Outcome> {
    let t0 = Instant::now();
    let reused = idle.and_then(|p| p.lock().ok()?.pop());
    let was_reused = reused.is_some();
    let mut connects = u64::from(!was_reused);
    let mut r = match reused {
        Some(r) => r,
        None => {
            let s = tokio::net::TcpStream::connect(addr)
                .await
                .with_context(|| format!("connect {addr}"))?;
            let _ = s.set_nodelay(true);
            BufReader::new(s)
        }
    };
    let connection = if idle.is_some() { "keep-alive" } else { "close" };
    let req = request_with(addr, key, prompt, max_tokens, connection);
    let mut line = String::new();
    let sent = r.get_mut().write_all(req.as_bytes()).await;
    let got = match sent {
        Ok(()) => r.read_line(&mut line).await.unwrap_or(0),
        Err(_) => 0,
    };
    if got == 0 && was_reused {
        // The server closed the idle connection (its keep-alive timeout): a fresh one.
        let s = tokio::net::TcpStream::connect(addr)
            .await
            .with_context(|| format!("connect {addr}"))?;
        let _ = s.set_nodelay(true);
        connects += 1;
        r = BufReader::new(s);
        r.get_mut().write_all(req.as_bytes()).await?;
        r.read_line(&mut line).await?;
    }
    let status: u16 = line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).unwrap_or(0);
    let mut out = Outcome { status, connects, ttft: None, gaps: Vec::new(), tokens: 0 };
    if status != 200 {
        return Ok(out);
    }
    let mut last: Option<Instant> = None;
    // Bounded by the response: the server ends it after [DONE] (and closes the connection
    // unless it is kept alive).
    loop {
        line.clear();
        if r.read_line(&mut line).await? == 0 {
            break;
        }
        let Some(data) = line.trim_end().strip_prefix("data: ") else { continue };
        if data == "[DONE]" {
            if let Some(p) = idle {
                // The body is chunked: its last chunk (`0`) and the blank line end it.
                loop {
                    line.clear();
                    if r.read_line(&mut line).await? == 0 {
                        return Ok(out);
                    }
                    if line.trim_end() == "0" {
                        line.clear();
                        r.read_line(&mut line).await?;
                        break;
                    }
                }
                if let Ok(mut v) = p.lock() {
                    v.push(r);
                }
            }
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

/// A stream whose client sends its request and reads nothing: the connection (`None`: the
/// connection or the send failed).
async fn slow(addr: String, key: String, max_tokens: u32) -> Option<tokio::net::TcpStream> {
    let sock = tokio::net::TcpSocket::new_v4().ok()?;
    let _ = sock.set_recv_buffer_size(4096);
    let sa: std::net::SocketAddr = tokio::net::lookup_host(&addr).await.ok()?.next()?;
    let mut s = sock.connect(sa).await.ok()?;
    s.write_all(request_bytes(&addr, &key, "slow reader", max_tokens).as_bytes()).await.ok()?;
    // Nothing is read, not even the response's head: the stream's tokens pile up in the
    // server while it generates them.
    Some(s)
}

/// `GET /metrics` of the server at `addr` (HOST:PORT): the whole response, or `None` when it
/// does not answer within 5 s.
async fn scrape(addr: &str) -> Option<String> {
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    let req = format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.ok()?;
    let mut text = String::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut text)).await.ok()?.ok()?;
    Some(text)
}

/// The value of the sample named exactly `name_and_labels` in a Prometheus text scrape.
fn sample(text: &str, name_and_labels: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name_and_labels)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

/// The engine's steps between two scrapes of `llm serve`: how many ran to their end, the
/// upper bounds (ms) of the buckets of `fastlane_llm_engine_step_seconds` that hold their
/// median and 99th percentile, and how many were given up
/// (`fastlane_llm_engine_steps_aborted_total`; a step given up is not in the histogram).
/// An error names what the scrapes lack: a missing family is not read as zero.
pub(crate) fn engine_steps(before: &str, after: &str) -> Result<serde_json::Value> {
    let delta = histogram_delta(before, after, "fastlane_llm_engine_step_seconds", "");
    if delta.is_empty() {
        bail!("no fastlane_llm_engine_step_seconds buckets in the scrape (not an llm serve?)");
    }
    let (n, p50, p99) = bucket_quantiles(&delta);
    let aborted = |text: &str| sample(text, "fastlane_llm_engine_steps_aborted_total");
    let aborted = match (aborted(before), aborted(after)) {
        (Some(x), Some(y)) => y - x,
        _ => bail!("no fastlane_llm_engine_steps_aborted_total in the scrapes"),
    };
    // Latency protection: the steps that held the others back for a protected prefill and
    // those planned work-conserving after the hold bound (0 and 0 when it is off).
    let mut protect = serde_json::Map::new();
    for kind in ["capped", "released"] {
        let name = format!("fastlane_llm_engine_protect_steps_total{{kind=\"{kind}\"}}");
        match (sample(before, &name), sample(after, &name)) {
            (Some(x), Some(y)) => protect.insert(kind.into(), (y - x).into()),
            _ => bail!("no {name} in the scrapes"),
        };
    }
    Ok(serde_json::json!({"steps": n, "p50_le_ms": p50, "p99_le_ms": p99,
        "aborted": aborted, "protect_steps": protect, "ttft_stages": ttft_stages(before, after)}))
}

/// The buckets `(le, count)` of histogram `family` whose labels start with `labels` (e.g.
/// `tenant="quiet",`; empty: the family has no labels but `le`), counted between the scrapes
/// `before` and `after`, ordered by `le`. Empty when `after` has none.
fn histogram_delta(before: &str, after: &str, family: &str, labels: &str) -> Vec<(f64, f64)> {
    let head = format!("{family}_bucket{{{labels}");
    let buckets = |text: &str| -> Vec<(f64, f64)> {
        let mut v: Vec<(f64, f64)> = text
            .lines()
            .filter_map(|l| {
                let rest = l.strip_prefix(head.as_str())?;
                let le = rest.strip_prefix("le=\"")?.split('"').next()?;
                let le = if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? };
                Some((le, l.rsplit(' ').next()?.trim().parse().ok()?))
            })
            .collect();
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
        v
    };
    let (a, z) = (buckets(before), buckets(after));
    z.iter().map(|&(le, c)| (le, c - a.iter().find(|x| x.0 == le).map_or(0.0, |x| x.1))).collect()
}

/// Count, and the upper bounds (ms) of the buckets holding the median and the 99th
/// percentile, of cumulative buckets.
fn bucket_quantiles(delta: &[(f64, f64)]) -> (f64, Option<f64>, Option<f64>) {
    let n = delta.last().map_or(0.0, |d| d.1);
    let q = |p: f64| delta.iter().find(|d| n > 0.0 && d.1 >= p * n).map(|d| d.0 * 1e3);
    (n, q(0.5), q(0.99))
}

/// Per tenant, the server's TTFT, its stages (`fastlane_llm_ttft_stage_seconds`) and the
/// engine thread's part (`engine_thread`: `fastlane_llm_engine_first_token_seconds`) between
/// the scrapes: count and the P50/P99 bucket bounds (ms) of each, for the tenants with
/// requests in between.
fn ttft_stages(before: &str, after: &str) -> serde_json::Value {
    let tenants: Vec<String> = after
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("fastlane_llm_ttft_seconds_count{tenant=\"")?;
            Some(rest.split('"').next()?.to_string())
        })
        .collect();
    let mut out = serde_json::Map::new();
    for t in tenants {
        let mut stages = serde_json::Map::new();
        let tenant = format!("tenant=\"{t}\",");
        let mut parts = vec![("total", "fastlane_llm_ttft_seconds", tenant.clone())];
        for s in fastlane_openai::metrics::TTFT_STAGES {
            let labels = format!("stage=\"{s}\",{tenant}");
            parts.push((s, "fastlane_llm_ttft_stage_seconds", labels));
        }
        // The engine thread's part of the `engine` stage.
        parts.push(("engine_thread", "fastlane_llm_engine_first_token_seconds", tenant));
        for (name, family, labels) in parts {
            let (n, p50, p99) = bucket_quantiles(&histogram_delta(before, after, family, &labels));
            if n > 0.0 {
                stages.insert(
                    name.to_string(),
                    serde_json::json!({"n": n, "p50_le_ms": p50, "p99_le_ms": p99}),
                );
            }
        }
        if !stages.is_empty() {
            out.insert(t, serde_json::Value::Object(stages));
        }
    }
    serde_json::Value::Object(out)
}

/// The sum of our server's `fastlane_llm_sequences` gauges for waiting and running
/// sequences (`None`: not our server, or no answer).
async fn busy_sequences(addr: &str) -> Option<f64> {
    let text = scrape(addr).await?;
    let found: Vec<f64> = ["waiting", "running", "queued"]
        .iter()
        .filter_map(|state| sample(&text, &format!("fastlane_llm_sequences{{state=\"{state}\"}}")))
        .collect();
    (!found.is_empty()).then(|| found.iter().sum())
}

fn ms(h: &Histogram<u64>, q: f64) -> f64 {
    if h.is_empty() {
        f64::NAN
    } else {
        h.value_at_quantile(q) as f64 / 1e6
    }
}

/// A probe's latencies ([`crate::llm_attack::probe`]) as JSON: answered and failed, P50, P99
/// and the largest in ms, from the same histogram as the TTFTs.
pub(crate) fn probe_summary(lat: &[Duration], failed: u64) -> serde_json::Value {
    let mut h = new_histogram();
    for d in lat {
        record(&mut h, d.as_nanos() as u64);
    }
    serde_json::json!({"n": lat.len(), "failed": failed, "p50_ms": ms(&h, 0.5),
        "p99_ms": ms(&h, 0.99), "max_ms": ms(&h, 1.0)})
}

/// Runs the loads (then waits for the requests in flight, at most 120 s).
/// What the slow readers were: streams sent and held, and the server's busy sequences (our
/// server only) when the measured load began and when it ended.
struct Held {
    streams: usize,
    busy_at_start: Option<f64>,
    busy_at_end: Option<f64>,
    attack: Option<crate::llm_attack::Report>,
    server: [Option<serde_json::Value>; 2],
    probe: Option<serde_json::Value>,
    /// [`engine_steps`] over the measured load (`--engine-metrics`).
    engine: Option<serde_json::Value>,
}

async fn run(o: &LoadOpts, addr: String, loads: Vec<Load>) -> Result<(Vec<TenantResult>, Held)> {
    // Slow readers first, held until the end; they read nothing while the server is still
    // generating their tokens (our server's busy sequences say so, at the start and at the
    // end of the measured load).
    let mut held = Vec::new();
    let mut busy = (None, None);
    if o.slow_streams > 0 {
        let t0 = Instant::now();
        let tasks: Vec<_> = (0..o.slow_streams)
            .map(|_| tokio::spawn(slow(addr.clone(), o.slow_key.clone(), o.slow_tokens)))
            .collect();
        for t in tasks {
            if let Ok(Some(s)) = t.await {
                held.push(s);
            }
        }
        // Until our server has taken them in (at most 30 s; another server: 1 s).
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match busy_sequences(&addr).await {
                Some(n) if n >= held.len().min(256) as f64 => break,
                None => {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    break;
                }
                Some(_) if Instant::now() >= deadline => break,
                Some(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
        busy.0 = busy_sequences(&addr).await;
        if !o.json {
            eprintln!(
                "{} of {} slow streams sent, {} sequences busy ({:.1}s)",
                held.len(),
                o.slow_streams,
                busy.0.map_or("?".to_string(), |b| b.to_string()),
                t0.elapsed().as_secs_f64()
            );
        }
    }
    // The attack runs for the whole measured load.
    let attack_stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let attack = match o.attack.clone() {
        Some(a) => Some(crate::llm_attack::spawn(addr.clone(), a, attack_stop.clone())?),
        None => None,
    };
    if attack.is_some() {
        // Let every attacking connection open before the measurement starts.
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    let server_start = o.server_pid.and_then(crate::llm_attack::process_usage);
    let engine_addr = match &o.engine_metrics {
        Some(u) => Some(
            u.trim_end_matches('/')
                .strip_prefix("http://")
                .context("--engine-metrics: http://HOST:PORT")?
                .to_string(),
        ),
        None => None,
    };
    if let Some(a) = &engine_addr {
        // Before any load: a wrong address is an error now, not after the run.
        scrape(a).await.with_context(|| format!("no /metrics at {a}"))?;
    }
    // The measured load starts after the warm-up: the engine's counters are read then, and
    // the probe runs from then on.
    let start = Instant::now();
    let warmup = Duration::from_secs_f64(o.warmup);
    let measured = start + warmup;
    let engine_start = engine_addr.clone().map(|a| {
        tokio::spawn(async move {
            tokio::time::sleep_until(measured.into()).await;
            scrape(&a).await.with_context(|| format!("no /metrics at {a}"))
        })
    });
    let probe = (o.probe_rate > 0.0).then(|| {
        let (addr, rate, secs) = (addr.clone(), o.probe_rate, o.secs);
        tokio::spawn(async move {
            tokio::time::sleep_until(measured.into()).await;
            crate::llm_attack::probe(addr, rate, secs).await
        })
    });
    let answered = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut handles = Vec::new();
    let idles: Vec<Option<Idle>> = loads.iter().map(|_| o.keep_alive.then(Idle::default)).collect();
    for (ti, l) in loads.iter().enumerate() {
        let mut rng = SimRng::stream(o.seed, ti as u64 + 1);
        let times = l.arrivals.times_ns(&mut rng, 0.0, o.warmup + o.secs, 1_000_000);
        for (i, at) in times.into_iter().enumerate() {
            let (addr, key) = (addr.clone(), l.key.clone());
            let n = l.prompt.sample(&mut rng) as usize;
            // The tag is in the text: two runs against one server (solo, then under load)
            // with different tags share no cached prefix, and with one seed the same arrivals.
            let head = format!("{} request {}{i}: ", l.name, o.prompt_tag);
            let mut prompt: String = head.chars().take(n).collect();
            let filler = "lorem ipsum dolor sit amet ";
            while prompt.len() < n {
                prompt.push_str(&filler[..filler.len().min(n - prompt.len())]);
            }
            let max_tokens = l.output.sample(&mut rng);
            let when = start + Duration::from_nanos(at);
            let answered = answered.clone();
            let idle = idles[ti].clone();
            handles.push((
                ti,
                Duration::from_nanos(at) < warmup,
                tokio::spawn(async move {
                    tokio::time::sleep_until(when.into()).await;
                    let r = one(&addr, &key, &prompt, max_tokens, idle.as_ref()).await;
                    answered.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    r
                }),
            ));
        }
    }
    let mut res: Vec<TenantResult> = loads
        .iter()
        .map(|l| TenantResult {
            tenant: l.name.clone(),
            ttft: Some(new_histogram()),
            itl: Some(new_histogram()),
            ..Default::default()
        })
        .collect();
    let deadline = measured + Duration::from_secs_f64(o.secs) + Duration::from_secs(120);
    let total = handles.len();
    // Progress on stderr every 5 s (not with --json).
    let progress = (!o.json).then(|| {
        let answered = answered.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(5)).await;
                eprintln!(
                    "  {:.0}s: {}/{total} requests answered",
                    start.elapsed().as_secs_f64(),
                    answered.load(std::sync::atomic::Ordering::Relaxed)
                );
            }
        })
    });
    for (ti, warming, h) in handles {
        let r = &mut res[ti];
        let left = deadline.saturating_duration_since(Instant::now());
        let done = tokio::time::timeout(left, h).await;
        if warming {
            r.warmup_sent += 1;
            continue;
        }
        r.sent += 1;
        if let Ok(Ok(Ok(out))) = &done {
            r.connections += out.connects;
        }
        match done {
            Ok(Ok(Ok(out))) if out.status == 200 => {
                r.ok += 1;
                r.tokens += out.tokens;
                if let (Some(t), Some(h)) = (out.ttft, r.ttft.as_mut()) {
                    record(h, t.as_nanos() as u64);
                }
                if let Some(h) = r.itl.as_mut() {
                    for g in &out.gaps {
                        record(h, g.as_nanos() as u64);
                    }
                }
            }
            Ok(Ok(Ok(out))) if out.status == 429 => r.rejected_429 += 1,
            Ok(Ok(Ok(out))) if out.status == 503 => r.rejected_503 += 1,
            _ => r.errors += 1,
        }
    }
    if let Some(p) = progress {
        p.abort();
    }
    if o.slow_streams > 0 {
        busy.1 = busy_sequences(&addr).await;
    }
    let server_end = o.server_pid.and_then(crate::llm_attack::process_usage);
    let engine = match (&engine_addr, engine_start) {
        (Some(a), Some(before)) => {
            let before = before.await.context("the engine scrape at the start")??;
            let after = scrape(a).await.with_context(|| format!("no /metrics at {a}"))?;
            Some(engine_steps(&before, &after)?)
        }
        _ => None,
    };
    let probe = match probe {
        Some(p) => p.await.ok().map(|(lat, failed)| probe_summary(&lat, failed)),
        None => None,
    };
    attack_stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let attack = match attack {
        // The attack thread takes 5 s to count after `stop`; the join waits off the runtime.
        Some(t) => tokio::time::timeout(
            Duration::from_secs(90),
            tokio::task::spawn_blocking(move || t.join().ok()),
        )
        .await
        .ok()
        .and_then(Result::ok)
        .flatten(),
        None => None,
    };
    let wall = measured.elapsed().as_secs_f64();
    for r in res.iter_mut() {
        if let (Some(t), Some(i)) = (&r.ttft, &r.itl) {
            r.ttft_p50_ms = ms(t, 0.5);
            r.ttft_p99_ms = ms(t, 0.99);
            r.ttft_max_ms = if t.is_empty() { f64::NAN } else { t.max() as f64 / 1e6 };
            r.itl_p99_ms = ms(i, 0.99);
        }
        r.completed_per_s = r.ok as f64 / wall.max(o.secs);
    }
    if res.iter().all(|r| r.ok == 0) {
        bail!("no request succeeded against {addr}");
    }
    let held_n = Held {
        streams: held.len(),
        busy_at_start: busy.0,
        busy_at_end: busy.1,
        attack,
        server: [server_start, server_end],
        probe,
        engine,
    };
    drop(held);
    Ok((res, held_n))
}

fn write_files(dir: &std::path::Path, res: &[TenantResult], secs: f64, title: &str) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut series = Vec::new();
    for r in res {
        let (Some(ttft), Some(itl)) = (&r.ttft, &r.itl) else { continue };
        let path = dir.join(format!("{}.hlog", r.tenant));
        let f =
            std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        let mut w = HlogWriter::with_base_time(std::io::BufWriter::new(f), UNIX_EPOCH)?;
        let len = Duration::from_secs_f64(secs);
        w.write_histogram(Some("ttft"), Duration::ZERO, len, ttft)?;
        w.write_histogram(Some("itl"), Duration::ZERO, len, itl)?;
        w.flush()?;
        series.push(PlotSeries { label: &r.tenant, histogram: ttft });
    }
    std::fs::write(dir.join("ttft.svg"), percentile_plot_svg(title, &series))?;
    Ok(())
}

fn dist(kind: &str, median: u32, what: &str) -> Result<LenDist> {
    Ok(match kind {
        "fixed" => LenDist::Fixed(median.max(1)),
        "lognormal" => LenDist::LogNormal {
            median: f64::from(median.max(1)),
            sigma: 0.5,
            min: 1,
            max: median.max(1).saturating_mul(4),
        },
        other => bail!("--lengths {other:?}: fixed or lognormal ({what})"),
    })
}

/// `fastlane llm bench --url`: scenario (a) or the quiet tenant alone; prints the table.
pub(crate) fn bench(o: &LoadOpts) -> Result<serde_json::Value> {
    let addr = o
        .url
        .trim_end_matches('/')
        .strip_prefix("http://")
        .context("--url: http://HOST:PORT")?
        .to_string();
    if !(o.rate.is_finite() && o.rate > 0.0 && o.secs.is_finite() && o.secs > 0.0) {
        bail!("--rate and --seconds must be positive");
    }
    if !(0.0..=3600.0).contains(&o.warmup) {
        bail!("--warmup {}: 0 to 3600 seconds", o.warmup);
    }
    check_probe_rate(o.probe_rate)?;
    let arrivals = |rate: f64| -> Result<ArrivalProcess> {
        Ok(match o.arrivals.as_str() {
            "poisson" => ArrivalProcess::Poisson { rate_per_s: rate },
            "bursty" => ArrivalProcess::bursty(rate, o.secs),
            other => bail!("--arrivals {other:?}: poisson or bursty"),
        })
    };
    let prompt = dist(&o.lengths, o.prompt_tokens, "prompt")?;
    let output = dist(&o.lengths, o.max_tokens, "output")?;
    let mut loads = vec![Load {
        name: "quiet".into(),
        key: "key-quiet".into(),
        arrivals: arrivals(o.rate)?,
        prompt,
        output,
    }];
    if !o.solo {
        loads.push(Load {
            name: "flood".into(),
            key: "key-flood".into(),
            arrivals: arrivals(30.0 * o.rate)?,
            prompt,
            output,
        });
    }
    let conns = o.slow_streams + o.attack.as_ref().map_or(0, |a| a.per_kind * a.kinds.len());
    if conns > 0 {
        let fds = fastlane_daemon::http::raise_fd_limit();
        if fds < conns as u64 + 256 {
            bail!("--slow-streams and --attack need {conns} open files; the limit here is {fds}");
        }
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    let (res, slow) = rt.block_on(run(o, addr, loads))?;
    let held = slow.streams;
    let load = crate::load::loadavg();
    let what = format!(
        "scenario a over HTTP ({}), {} s, {} arrivals, quiet at {}/s{}{}{}",
        o.url,
        o.secs,
        o.arrivals,
        o.rate,
        if o.solo { " alone" } else { ", flood at 30x" },
        if o.warmup > 0.0 { format!(" after {} s of warm-up", o.warmup) } else { String::new() },
        if held > 0 { format!(", {held} slow streams held open") } else { String::new() }
    );
    if let Some(dir) = &o.hlog_dir {
        write_files(dir, &res, o.secs, &format!("TTFT per tenant - {what}"))?;
    }
    if !o.json {
        println!("{what}, load {load}");
        println!(
            "{:<8} {:>6} {:>6} {:>6} {:>6} {:>6} {:>6} {:>10} {:>10} {:>10} {:>10} {:>9}",
            "tenant",
            "sent",
            "ok",
            "429",
            "503",
            "err",
            "conns",
            "TTFT P50",
            "TTFT P99",
            "TTFT max",
            "ITL P99",
            "done/s"
        );
        for r in &res {
            println!(
                "{:<8} {:>6} {:>6} {:>6} {:>6} {:>6} {:>6} {:>8.1}ms {:>8.1}ms {:>8.1}ms {:>8.1}ms {:>9.2}",
                r.tenant,
                r.sent,
                r.ok,
                r.rejected_429,
                r.rejected_503,
                r.errors,
                r.connections,
                r.ttft_p50_ms,
                r.ttft_p99_ms,
                r.ttft_max_ms,
                r.itl_p99_ms,
                r.completed_per_s
            );
        }
        if let Some(a) = &slow.attack {
            println!("{:<16} {:>8}  statuses answered", "attack", "opened");
            for (kind, k) in a {
                let st: Vec<String> = k.statuses.iter().map(|(s, n)| format!("{s}: {n}")).collect();
                println!("{kind:<16} {:>8}  {}", k.opened, st.join(", "));
            }
        }
        for (when, u) in [("start", &slow.server[0]), ("end", &slow.server[1])] {
            if let Some(u) = u {
                println!(
                    "server at the {when}: RSS {} kB (peak {} kB), {} threads",
                    u["rss_kb"], u["hwm_kb"], u["threads"]
                );
            }
        }
        if let Some(p) = &slow.probe {
            print_probe("keyless probe", p);
        }
        if let Some(e) = &slow.engine {
            let ms = |k: &str| e[k].as_f64().map_or("?".to_string(), |v| format!("{v}"));
            println!(
                "engine: {} steps ran to their end (P50 <= {} ms, P99 <= {} ms by bucket), {} given up",
                e["steps"], ms("p50_le_ms"), ms("p99_le_ms"), e["aborted"]
            );
            if let Some(p) = e["protect_steps"].as_object() {
                let n = |k: &str| p.get(k).map_or("?".to_string(), |v| v.to_string());
                println!(
                    "protection: {} steps held the others back, {} released after the hold bound",
                    n("capped"),
                    n("released")
                );
            }
        }
        if held > 0 {
            let b = |v: Option<f64>| v.map_or("?".to_string(), |v| v.to_string());
            println!(
                "slow streams: {held} held, sequences busy {} at the start and {} at the end",
                b(slow.busy_at_start),
                b(slow.busy_at_end)
            );
        }
        if let Some(dir) = &o.hlog_dir {
            println!("wrote {}/{{quiet,flood}}.hlog and ttft.svg", dir.display());
        }
    }
    Ok(serde_json::json!({"scenario": "a", "url": o.url, "solo": o.solo, "rate": o.rate,
        "seconds": o.secs, "warmup_s": o.warmup, "arrivals": o.arrivals, "lengths": o.lengths,
        "slow_streams_held": held, "slow_busy_at_start": slow.busy_at_start,
        "slow_busy_at_end": slow.busy_at_end, "attack": slow.attack,
        "server_at_start": slow.server[0], "server_at_end": slow.server[1],
        "probe": slow.probe, "engine": slow.engine, "load": load, "tenants": res}))
}

/// `--probe-rate`: 0 (none) up to 10,000 a second (each probe is a task and a connection).
fn check_probe_rate(rate: f64) -> Result<()> {
    if !(0.0..=10_000.0).contains(&rate) {
        bail!("--probe-rate {rate}: 0 (no probe) to 10000 requests a second");
    }
    Ok(())
}

/// One line of a probe's latencies.
fn print_probe(what: &str, p: &serde_json::Value) {
    println!(
        "{what:<22} {:>5} answered {:>3} failed  P50 {:>7.2}ms  P99 {:>7.2}ms  max {:>7.2}ms",
        p["n"],
        p["failed"],
        p["p50_ms"].as_f64().unwrap_or(f64::NAN),
        p["p99_ms"].as_f64().unwrap_or(f64::NAN),
        p["max_ms"].as_f64().unwrap_or(f64::NAN)
    );
}

/// `fastlane llm bench --attack-floor`: [`crate::llm_attack::FloorServer`] on `core`, probed
/// alone and then under `o.attack` at `o.probe_rate` for `o.secs` each; prints the table.
pub(crate) fn floor(o: &LoadOpts, core: usize) -> Result<serde_json::Value> {
    use std::sync::atomic::{AtomicBool, Ordering};
    let Some(attack) = o.attack.clone() else {
        bail!("--attack-floor needs --attack N (connections of each kind)");
    };
    check_probe_rate(o.probe_rate)?;
    if !(o.probe_rate > 0.0 && o.secs.is_finite() && o.secs > 0.0) {
        bail!("--attack-floor needs a positive --probe-rate and --seconds");
    }
    let conns = attack.per_kind * attack.kinds.len();
    let fds = fastlane_daemon::http::raise_fd_limit();
    if fds < 2 * conns as u64 + 256 {
        bail!(
            "--attack-floor with {conns} connections needs {} open files; the limit here is {fds}",
            2 * conns + 256
        );
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    let (solo, under, report, served, cpu) = rt.block_on(async {
        let server = crate::llm_attack::FloorServer::start(core)?;
        let addr = server.addr.to_string();
        let solo = crate::llm_attack::probe(addr.clone(), o.probe_rate, o.secs).await;
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let t = crate::llm_attack::spawn(addr.clone(), attack, stop.clone())?;
        // As with a server at --url: every attacking connection open before the measurement.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let under = crate::llm_attack::probe(addr, o.probe_rate, o.secs).await;
        stop.store(true, Ordering::Relaxed);
        let (report, (served, cpu)) = tokio::task::spawn_blocking(move || {
            let report = t.join().unwrap_or_default();
            (report, server.stop())
        })
        .await?;
        Ok::<_, anyhow::Error>((solo, under, report, served, cpu))
    })?;
    let solo = probe_summary(&solo.0, solo.1);
    let under = probe_summary(&under.0, under.1);
    let added =
        under["p99_ms"].as_f64().unwrap_or(f64::NAN) - solo["p99_ms"].as_f64().unwrap_or(f64::NAN);
    let per_conn_us = cpu.as_secs_f64() * 1e6 / served.max(1) as f64;
    let load = crate::load::loadavg();
    if !o.json {
        println!(
            "floor server (accept, one read, a fixed 401, close; one thread on core {core}), keyless probe at {}/s for {} s, load {load}",
            o.probe_rate, o.secs
        );
        print_probe("alone", &solo);
        print_probe("under attack", &under);
        println!("P99 added by the attack: {added:.2} ms; the floor's CPU: {per_conn_us:.1} us a connection ({served} connections)");
        println!("{:<16} {:>8}  statuses answered", "attack", "opened");
        for (kind, k) in &report {
            let st: Vec<String> = k.statuses.iter().map(|(s, n)| format!("{s}: {n}")).collect();
            println!("{kind:<16} {:>8}  {}", k.opened, st.join(", "));
        }
    }
    Ok(serde_json::json!({"floor": {"core": core, "probe_solo": solo, "probe_attack": under,
        "p99_added_ms": added, "connections": served, "cpu_us_per_connection": per_conn_us},
        "probe_rate": o.probe_rate, "seconds": o.secs, "attack": report, "load": load}))
}

#[cfg(test)]
mod tests {
    #[test]
    fn probe_rates_past_the_bound_or_not_numbers_are_refused() {
        for ok in [0.0, 20.0, 10_000.0] {
            assert!(super::check_probe_rate(ok).is_ok(), "{ok}");
        }
        for bad in [-1.0, 10_001.0, f64::INFINITY, f64::NAN] {
            let e = super::check_probe_rate(bad).unwrap_err().to_string();
            assert!(e.starts_with("--probe-rate"), "{e}");
        }
    }

    /// A scrape of `llm serve` with `n` steps in each of the buckets 0.005, 0.01, 0.05 s and
    /// `aborted` steps given up.
    fn scrape(n: [u64; 3], aborted: u64) -> String {
        let (a, b, c) = (n[0], n[0] + n[1], n[0] + n[1] + n[2]);
        format!(
            "# TYPE fastlane_llm_engine_step_seconds histogram\n\
             fastlane_llm_engine_step_seconds_bucket{{le=\"0.005\"}} {a}\n\
             fastlane_llm_engine_step_seconds_bucket{{le=\"0.01\"}} {b}\n\
             fastlane_llm_engine_step_seconds_bucket{{le=\"0.05\"}} {c}\n\
             fastlane_llm_engine_step_seconds_bucket{{le=\"+Inf\"}} {c}\n\
             fastlane_llm_engine_steps_aborted_total {aborted}\n\
             fastlane_llm_engine_protect_steps_total{{kind=\"capped\"}} {}\n\
             fastlane_llm_engine_protect_steps_total{{kind=\"released\"}} {}\n",
            2 * aborted,
            aborted / 2
        )
    }

    #[test]
    fn engine_steps_are_the_bucket_deltas_between_two_scrapes() {
        // Before: 100 fast steps. During the run: 50 fast, 48 middling, 2 slow, 3 given up.
        let e = super::engine_steps(&scrape([100, 0, 0], 1), &scrape([150, 48, 2], 4)).unwrap();
        assert_eq!(e["steps"], 100.0);
        assert_eq!(e["p50_le_ms"], 5.0);
        assert_eq!(e["p99_le_ms"], 50.0);
        assert_eq!(e["aborted"], 3.0);
        assert_eq!(e["protect_steps"]["capped"], 6.0);
        assert_eq!(e["protect_steps"]["released"], 2.0);
        // A scrape without the families is an error, not zero steps.
        let err = super::engine_steps("", "up 1\n").unwrap_err().to_string();
        assert!(err.contains("fastlane_llm_engine_step_seconds"), "{err}");
        let no_aborted =
            scrape([1, 0, 0], 0).replace("fastlane_llm_engine_steps_aborted_total 0\n", "");
        let err = super::engine_steps(&no_aborted, &no_aborted).unwrap_err().to_string();
        assert!(err.contains("aborted"), "{err}");
        let no_released = scrape([1, 0, 0], 0).replace("kind=\"released\"", "kind=\"other\"");
        let err = super::engine_steps(&no_released, &no_released).unwrap_err().to_string();
        assert!(err.contains("released"), "{err}");
    }

    /// `tenant`'s TTFT and stage samples: (le, cumulative count) per family part.
    fn ttft_scrape(tenant: &str, total: &[(f64, u64)], engine: &[(f64, u64)]) -> String {
        let mut s = String::new();
        let le = |x: f64| if x.is_infinite() { "+Inf".to_string() } else { x.to_string() };
        for (x, n) in total {
            s += &format!(
                "fastlane_llm_ttft_seconds_bucket{{tenant=\"{tenant}\",le=\"{}\"}} {n}\n",
                le(*x)
            );
        }
        s += &format!(
            "fastlane_llm_ttft_seconds_count{{tenant=\"{tenant}\"}} {}\n",
            total.last().unwrap().1
        );
        for (x, n) in engine {
            s += &format!(
                "fastlane_llm_ttft_stage_seconds_bucket{{stage=\"engine\",tenant=\"{tenant}\",le=\"{}\"}} {n}\n",
                le(*x)
            );
        }
        s
    }

    #[test]
    fn ttft_stages_are_per_tenant_bucket_deltas() {
        let inf = f64::INFINITY;
        let before =
            ttft_scrape("quiet", &[(0.01, 10), (0.025, 10), (inf, 10)], &[(0.005, 10), (inf, 10)]);
        // During the run: 100 more, 98 within 10 ms, 2 within 25 ms; the engine stage of all
        // within 5 ms but 2.
        let after = ttft_scrape(
            "quiet",
            &[(0.01, 108), (0.025, 110), (inf, 110)],
            &[(0.005, 108), (inf, 110)],
        ) + &ttft_scrape("idle", &[(0.01, 3), (inf, 3)], &[]);
        let s = super::ttft_stages(&before, &after);
        assert_eq!(s["quiet"]["total"]["n"], 100.0);
        assert_eq!(s["quiet"]["total"]["p50_le_ms"], 10.0);
        assert_eq!(s["quiet"]["total"]["p99_le_ms"], 25.0);
        assert_eq!(s["quiet"]["engine"]["n"], 100.0);
        // Beyond the largest finite bucket: JSON has no infinity, so null.
        assert!(s["quiet"]["engine"]["p99_le_ms"].is_null(), "{s}");
        assert!(s["quiet"].get("admit").is_none(), "no admit samples: not reported as 0");
        // A tenant that first appears after `before` counts from zero.
        assert_eq!(s["idle"]["total"]["n"], 3.0);
        assert!(super::ttft_stages(&after, &after).as_object().unwrap().is_empty());
    }
}
