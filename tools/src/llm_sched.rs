//! `fastlane llm bench --scenario d|b`: the scheduler's claims measured on the real CPU
//! engine (not the simulator), each against its own baseline in the same run.
//!
//! - **d** (one long prompt among decoding users): ten sequences decode; a long prompt
//!   arrives. With chunked prefill the decoders' longest gap between tokens while it is
//!   prefilled is about one chunk's step; with whole-prompt prefill it is the whole prefill.
//! - **b** (chat beside batch jobs): a chat tenant (short prompts, Poisson arrivals) shares a
//!   tight KV pool with a batch tenant whose long jobs fill it. Under `fifo` chat requests
//!   wait for batch jobs; under `drr+preempt` batch sequences are preempted (swap or
//!   recompute, measured costs) so chat starts at once. Chat TTFT is compared with chat alone.
//! - **prefix** (prefix reuse): requests of a 2,048-token prefix and a 64-token suffix, one at
//!   a time on one engine; TTFT when the prefix is in the host prefix cache against TTFT when
//!   it is a new prefix (computed), and their ratio.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use fastlane_llm::{Engine, EngineConfig, GenRequest, Model, PreemptChoice, Stream, StreamEvent};
use kvswap::sched::{Overflow, Policy, TenantConfig, Tier};
use rand::{Rng, SeedableRng};
use serde::Serialize;

const WAIT: Duration = Duration::from_secs(600);

/// Token arrival times of a stream (collected on its own thread).
fn collect(s: Stream) -> std::thread::JoinHandle<Vec<Instant>> {
    std::thread::spawn(move || {
        let mut times = Vec::new();
        while let Some(ev) = s.next(WAIT) {
            match ev {
                StreamEvent::Token { .. } => times.push(Instant::now()),
                StreamEvent::Done(_) => break,
            }
        }
        times
    })
}

fn prompt(len: usize, salt: usize) -> Vec<u32> {
    (0..len).map(|i| (97 + (i * 7 + salt * 13) % 26) as u32).collect()
}

#[derive(Debug, Serialize)]
pub(crate) struct DRun {
    chunk: u32,
    /// Longest gap between two tokens of any decoder while the long prompt was prefilled, ms.
    stall_max_ms: f64,
    /// Long prompt: submission → its first token, ms.
    long_ttft_ms: f64,
    /// Median decode step gap of the decoders before the long prompt came, ms.
    gap_before_ms: f64,
}

/// Scenario d on `model`: `users` decoders, one `long`-token prompt; chunk vs whole.
pub(crate) fn scenario_d(model: &Arc<Model>, long: usize, chunk: u32) -> Result<(DRun, DRun)> {
    let run = |chunk_tokens: Option<u32>| -> Result<DRun> {
        let cfg = EngineConfig {
            device_blocks: 1024,
            chunk_tokens,
            batch_tokens_max: chunk_tokens.unwrap_or(512) + 16,
            ..EngineConfig::default()
        };
        let e = Engine::start(model.clone(), cfg)?;
        let users: Vec<_> = (0..10)
            .map(|i| e.submit(GenRequest::greedy(prompt(32, i), 400)).map(collect))
            .collect::<Result<_, _>>()?;
        // Let them all decode for a while.
        std::thread::sleep(Duration::from_millis(400));
        let t_long = Instant::now();
        let l = e.submit(GenRequest::greedy(prompt(long, 99), 1))?;
        let done = l.wait(WAIT)?;
        let t_first = t_long + Duration::from_nanos(done.ttft_ns.unwrap_or(0));
        // The decoders' streams end (aborted) when the engine shuts down.
        e.shutdown()?;
        let mut stall = 0.0f64;
        let mut before = Vec::new();
        for u in users {
            let times = u.join().map_err(|_| anyhow::anyhow!("collector panicked"))?;
            for w in times.windows(2) {
                let gap = w[1].duration_since(w[0]).as_secs_f64() * 1e3;
                if w[1] > t_long && w[0] < t_first + Duration::from_millis(1) {
                    stall = stall.max(gap);
                } else if w[1] <= t_long {
                    before.push(gap);
                }
            }
        }
        before.sort_by(f64::total_cmp);
        Ok(DRun {
            chunk: chunk_tokens.unwrap_or(0),
            stall_max_ms: stall,
            long_ttft_ms: done.ttft_ns.unwrap_or(0) as f64 / 1e6,
            gap_before_ms: before.get(before.len() / 2).copied().unwrap_or(f64::NAN),
        })
    };
    Ok((run(Some(chunk))?, run(None)?))
}

#[derive(Debug, Serialize)]
pub(crate) struct BRun {
    policy: String,
    chat_requests: usize,
    ttft_p50_ms: f64,
    ttft_p99_ms: f64,
    ttft_max_ms: f64,
    batch_tokens: u64,
    preempt_swap: u64,
    preempt_recompute: u64,
}

fn pct(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let i = ((v.len() as f64 * p).ceil() as usize).clamp(1, v.len()) - 1;
    v[i]
}

/// Scenario b: `secs` seconds of chat at `rate` requests/s beside `jobs` batch jobs.
pub(crate) fn scenario_b(
    model: &Arc<Model>,
    policy: Option<Policy>,
    secs: f64,
    rate: f64,
    jobs: usize,
    blocks: u32,
    seed: u64,
) -> Result<BRun> {
    let tenants = vec![
        TenantConfig {
            name: "chat".into(),
            tier: Tier::Interactive,
            bucket_capacity: 1e9,
            rpm: 1e9,
            concurrency_max: 1_000,
            weight: 1,
            overflow: Overflow::Queue { depth_max: 10_000 },
        },
        TenantConfig {
            name: "batch".into(),
            tier: Tier::Batch,
            bucket_capacity: 1e9,
            rpm: 1e9,
            concurrency_max: 1_000,
            weight: 1,
            overflow: Overflow::Queue { depth_max: 10_000 },
        },
    ];
    let cfg = EngineConfig {
        policy: policy.unwrap_or(Policy::Fifo),
        device_blocks: blocks,
        tenants,
        preempt: PreemptChoice::Auto,
        ..EngineConfig::default()
    };
    let e = Engine::start(model.clone(), cfg)?;
    let mut batch = Vec::new();
    if policy.is_some() {
        for j in 0..jobs {
            let mut r = GenRequest::greedy(prompt(512, j), 400);
            r.tenant = 1;
            batch.push(e.submit(r)?);
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let start = Instant::now();
    let mut next = 0.0f64;
    let mut chats = Vec::new();
    let mut i = 0;
    while next < secs {
        let at = start + Duration::from_secs_f64(next);
        if let Some(d) = at.checked_duration_since(Instant::now()) {
            std::thread::sleep(d);
        }
        let mut r = GenRequest::greedy(prompt(48, 1000 + i), 8);
        r.tenant = 0;
        chats.push(e.submit(r)?);
        i += 1;
        next += -(1.0 - rng.random::<f64>()).ln() / rate;
    }
    let mut ttft: Vec<f64> = Vec::new();
    for c in &chats {
        let f = c.wait(WAIT)?;
        ttft.push(f.ttft_ns.unwrap_or(u64::MAX) as f64 / 1e6);
    }
    for b in &batch {
        e.abort(b.id);
    }
    let c = e.shutdown()?;
    if c.blocks_free != c.blocks_total {
        bail!("blocks leaked: {c:?}");
    }
    ttft.sort_by(f64::total_cmp);
    Ok(BRun {
        policy: policy.map_or("solo".into(), |p| p.to_string()),
        chat_requests: ttft.len(),
        ttft_p50_ms: pct(&ttft, 0.5),
        ttft_p99_ms: pct(&ttft, 0.99),
        ttft_max_ms: ttft.last().copied().unwrap_or(f64::NAN),
        batch_tokens: c.generated_tokens.saturating_sub(8 * ttft.len() as u64),
        preempt_swap: c.preempt_swap,
        preempt_recompute: c.preempt_recompute,
    })
}

#[derive(Debug, Serialize)]
pub(crate) struct PrefixRun {
    shared_tokens: usize,
    suffix_tokens: usize,
    rounds: usize,
    /// Median TTFT of requests whose prefix nobody computed before, ms.
    cold_ttft_ms: f64,
    /// Median TTFT of requests whose prefix is in the host cache, ms.
    warm_ttft_ms: f64,
    /// warm / cold.
    ratio: f64,
    /// Prefill tokens one cold request cost (median).
    cold_prefill_tokens: u64,
    /// Prefill tokens one reused request cost (median).
    warm_prefill_tokens: u64,
    /// Prompt tokens loaded from the cache over the run.
    reused_tokens: u64,
}

/// A prompt of `len` tokens named by `salt` (distinct salts share no leading block).
fn salted(model: &Model, len: usize, salt: u64) -> Vec<u32> {
    let vocab = model.vocab() as u64;
    (0..len as u64)
        .map(|i| ((i.wrapping_add(salt << 20)).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 33) % vocab)
        .map(|t| t as u32)
        .collect()
}

/// Scenario prefix: one engine (prefix cache on); each round a cold request (a new
/// `shared`-token prefix) and a warm one (the prefix primed before the rounds), each with its
/// own `suffix`-token tail, one at a time; TTFT medians and their ratio.
pub(crate) fn scenario_prefix(
    model: &Arc<Model>,
    shared: usize,
    suffix: usize,
    rounds: usize,
) -> Result<PrefixRun> {
    let cfg = EngineConfig { device_blocks: 1024, ..EngineConfig::default() };
    let e = Engine::start(model.clone(), cfg)?;
    let with_tail = |salt: u64, tail: u64| {
        let mut p = salted(model, shared, salt);
        p.extend(salted(model, suffix, 1_000_000 + tail));
        p
    };
    let one = |p: Vec<u32>| -> Result<(f64, u64)> {
        let before = e.counters().prefill_tokens;
        let f = e.submit(GenRequest::greedy(p, 1))?.wait(WAIT)?;
        // The counters of the step that ended the stream are published right after it.
        let t0 = Instant::now();
        let mut after = e.counters();
        while after.finished == 0 || after.live > 0 {
            if t0.elapsed() > Duration::from_secs(5) {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
            after = e.counters();
        }
        Ok((f.ttft_ns.unwrap_or(0) as f64 / 1e6, after.prefill_tokens - before))
    };
    one(with_tail(0, 0))?; // primes the shared prefix (and warms up)
    let (mut cold, mut warm, mut cold_p, mut warm_p) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for r in 0..rounds as u64 {
        let (t, p) = one(with_tail(1 + r, 1 + r))?;
        cold.push(t);
        cold_p.push(p as f64);
        let (t, p) = one(with_tail(0, 1 + r))?;
        warm.push(t);
        warm_p.push(p as f64);
    }
    let c = e.shutdown()?;
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };
    let (cold_ms, warm_ms) = (median(cold), median(warm));
    Ok(PrefixRun {
        shared_tokens: shared,
        suffix_tokens: suffix,
        rounds,
        cold_ttft_ms: cold_ms,
        warm_ttft_ms: warm_ms,
        ratio: warm_ms / cold_ms,
        cold_prefill_tokens: median(cold_p) as u64,
        warm_prefill_tokens: median(warm_p) as u64,
        reused_tokens: c.prefix_reused_tokens,
    })
}

/// Runs a scenario and prints its table (or JSON).
pub(crate) fn run(
    model: &Arc<Model>,
    scenario: &str,
    seconds: f64,
    json: bool,
) -> Result<serde_json::Value> {
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim().to_string();
    match scenario {
        "d" => {
            let long = 2048.min(model.max_positions() - 8);
            eprintln!(
                "scenario d: 10 decoders + one {long}-token prompt, chunk 256 vs whole prompt"
            );
            let (c, w) = scenario_d(model, long, 256)?;
            let v = serde_json::json!({
                "scenario": "d", "model": model.name(), "long_prompt": long, "load": load,
                "chunked": c, "whole": w,
                "stall_ratio_whole_over_chunked": w.stall_max_ms / c.stall_max_ms,
                "chunked_stall_over_mean_chunk_step": c.stall_max_ms / (c.long_ttft_ms / long.div_ceil(256) as f64),
            });
            if !json {
                println!("scenario d on the CPU engine ({}), load {load}: decoders' longest stall while a {long}-token prompt is prefilled", model.name());
                println!(
                    "{:<14} {:>16} {:>18} {:>20}",
                    "prefill", "stall max (ms)", "long TTFT (ms)", "step before (ms)"
                );
                for r in [&c, &w] {
                    let name =
                        if r.chunk > 0 { format!("chunk {}", r.chunk) } else { "whole".into() };
                    println!(
                        "{:<14} {:>16.1} {:>18.1} {:>20.1}",
                        name, r.stall_max_ms, r.long_ttft_ms, r.gap_before_ms
                    );
                }
                println!(
                    "whole-prompt stall / chunked stall: {:.1}x; chunked stall / mean step of one chunk ({} chunks): {:.2}x",
                    w.stall_max_ms / c.stall_max_ms,
                    long.div_ceil(256),
                    c.stall_max_ms / (c.long_ttft_ms / long.div_ceil(256) as f64)
                );
            }
            Ok(v)
        }
        "b" => {
            let (rate, jobs, blocks) = (4.0, 6usize, 160u32);
            eprintln!("scenario b: chat at {rate}/s for {seconds}s beside {jobs} batch jobs, {blocks} KV blocks");
            let solo = scenario_b(model, None, seconds, rate, jobs, blocks, 1)?;
            let fifo = scenario_b(model, Some(Policy::Fifo), seconds, rate, jobs, blocks, 1)?;
            let pre = scenario_b(model, Some(Policy::DrrPreempt), seconds, rate, jobs, blocks, 1)?;
            let v = serde_json::json!({
                "scenario": "b", "model": model.name(), "load": load,
                "runs": [&solo, &fifo, &pre],
                "p99_fifo_over_solo": fifo.ttft_p99_ms / solo.ttft_p99_ms,
                "p99_preempt_over_solo": pre.ttft_p99_ms / solo.ttft_p99_ms,
            });
            if !json {
                println!(
                    "scenario b on the CPU engine ({}), load {load}: chat TTFT beside batch jobs",
                    model.name()
                );
                println!(
                    "{:<12} {:>6} {:>10} {:>10} {:>10} {:>12} {:>9} {:>9} {:>8}",
                    "policy",
                    "chats",
                    "P50 ms",
                    "P99 ms",
                    "max ms",
                    "batch tok",
                    "swaps",
                    "recomp",
                    "P99/solo"
                );
                for r in [&solo, &fifo, &pre] {
                    println!(
                        "{:<12} {:>6} {:>10.1} {:>10.1} {:>10.1} {:>12} {:>9} {:>9} {:>7.2}x",
                        r.policy,
                        r.chat_requests,
                        r.ttft_p50_ms,
                        r.ttft_p99_ms,
                        r.ttft_max_ms,
                        r.batch_tokens,
                        r.preempt_swap,
                        r.preempt_recompute,
                        r.ttft_p99_ms / solo.ttft_p99_ms
                    );
                }
            }
            Ok(v)
        }
        "prefix" => {
            let suffix = 64usize;
            let shared = 2048.min(model.max_positions().saturating_sub(suffix + 2));
            let rounds = 2;
            eprintln!("scenario prefix: TTFT of a {shared}-token shared prefix + {suffix}-token suffix, reused from the host cache vs a cold prefix, {rounds} rounds");
            let r = scenario_prefix(model, shared, suffix, rounds)?;
            let v = serde_json::json!({
                "scenario": "prefix", "model": model.name(), "load": load, "result": &r,
            });
            if !json {
                println!("scenario prefix on the CPU engine ({}), load {load}: TTFT with a {shared}-token prefix reused vs computed, {suffix}-token suffixes", model.name());
                println!("{:<8} {:>14} {:>16}", "prefix", "TTFT P50 (ms)", "prefill tokens");
                println!("{:<8} {:>14.1} {:>16}", "cold", r.cold_ttft_ms, r.cold_prefill_tokens);
                println!("{:<8} {:>14.1} {:>16}", "reused", r.warm_ttft_ms, r.warm_prefill_tokens);
                println!(
                    "reused / cold TTFT: {:.3}x (target <= 0.3x); {} blocks reused",
                    r.ratio,
                    r.reused_tokens / 16
                );
            }
            Ok(v)
        }
        other => bail!("--scenario {other:?}: d, b or prefix"),
    }
}
