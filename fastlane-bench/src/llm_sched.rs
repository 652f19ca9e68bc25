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
//! - **prefix-cluster** (the shared tier): a writer engine computes a 2,048-token prefix and
//!   stores it in a Redis Cluster; a reader engine on the same cluster, whose host cache has
//!   never seen it (as a second machine), serves the prefix + a 64-token suffix. Its TTFT
//!   against the same engine computing a prefix that is on no tier, and the rate the tier
//!   delivered the blocks at (payload bytes received / wall time of the prefix lookups).
//! - **prefix-miss** (the lookup's cost): prompts whose prefix is on no tier, on an engine
//!   with the prefix cache and the cluster on against an engine with the prefix cache off,
//!   same settings otherwise, interleaved; TTFT medians and their ratio.
//!
//! The cluster scenarios use the cluster `--kv-cluster` names, or start a private six-node one
//! on loopback (`fastlane_kvswap::testing::RedisCluster`, maxmemory raised to hold the run's blocks).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use fastlane_llm::engine::PrefixConfig;
use fastlane_llm::{Engine, EngineConfig, GenRequest, Model, PreemptChoice, Stream, StreamEvent};
use fastlane_sched::{Overflow, Policy, TenantConfig, Tier};
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
        ttft_p50_ms: crate::stats::nearest_rank(&ttft, 0.5),
        ttft_p99_ms: crate::stats::nearest_rank(&ttft, 0.99),
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

/// What one request cost on an engine with the prefix cache on (deltas around it).
#[derive(Debug, Clone, Copy, Default)]
struct ReqCost {
    ttft_ms: f64,
    prefill_tokens: u64,
    cluster_hits: u64,
    host_hits: u64,
    /// Payload bytes received from the cluster as hits.
    bytes_in: u64,
    /// Wall time of its prefix lookup (host cache, then the cluster), seconds.
    lookup_s: f64,
}

/// Runs `p` alone on `e` (one token) and waits for the counters of the step that ended it.
fn one_request(e: &Engine, p: Vec<u32>) -> Result<ReqCost> {
    let before = e.counters();
    let pbefore = e.prefix_stats().unwrap_or_default();
    let lbefore = e.histograms().prefix_lookup_seconds.get_sample_sum();
    let f = e.submit(GenRequest::greedy(p, 1))?.wait(WAIT)?;
    let t0 = Instant::now();
    let mut after = e.counters();
    while after.finished < before.finished + 1 || after.live > 0 {
        if t0.elapsed() > Duration::from_secs(10) {
            bail!("engine counters not published 10 s after the request finished");
        }
        std::thread::sleep(Duration::from_millis(1));
        after = e.counters();
    }
    let pafter = e.prefix_stats().unwrap_or_default();
    Ok(ReqCost {
        ttft_ms: f.ttft_ns.unwrap_or(0) as f64 / 1e6,
        prefill_tokens: after.prefill_tokens - before.prefill_tokens,
        cluster_hits: pafter.cluster_hits - pbefore.cluster_hits,
        host_hits: pafter.host_hits - pbefore.host_hits,
        bytes_in: pafter.bytes_in - pbefore.bytes_in,
        lookup_s: e.histograms().prefix_lookup_seconds.get_sample_sum() - lbefore,
    })
}

/// Waits for `e`'s queued cluster puts (so that they do not overlap the next measurement).
fn flush(e: &Engine, what: &str) -> Result<()> {
    if !e.flush_prefix(Duration::from_secs(120)) {
        bail!("{what}: blocks queued for the cluster not stored within 120 s");
    }
    if let Some(s) = e.prefix_stats() {
        if s.puts_dropped + s.put_errors > 0 {
            bail!(
                "{what}: {} cluster puts dropped, {} failed: {s:?}",
                s.puts_dropped,
                s.put_errors
            );
        }
    }
    Ok(())
}

/// A cluster key namespace no earlier run used (a shared cluster may hold old blocks).
fn fresh_namespace(what: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("bench-{what}-{}-{nanos}", std::process::id())
}

/// Lookup bound of the cluster scenarios: a slow tier shows as a slow TTFT, not as misses.
const BENCH_CLUSTER_TIMEOUT: Duration = Duration::from_secs(10);

fn cluster_engine_config(urls: &[String], namespace: &str) -> EngineConfig {
    EngineConfig {
        device_blocks: 1024,
        prefix: PrefixConfig {
            cluster: urls.to_vec(),
            cluster_namespace: namespace.to_string(),
            cluster_timeout: BENCH_CLUSTER_TIMEOUT,
            ..PrefixConfig::default()
        },
        ..EngineConfig::default()
    }
}

/// Starts an engine that must have reached the cluster.
fn start_on_cluster(model: &Arc<Model>, cfg: EngineConfig, what: &str) -> Result<Engine> {
    let e = Engine::start(model.clone(), cfg)?;
    if !e.counters().prefix_cluster {
        bail!("{what}: the engine could not reach the cluster (see the warning above)");
    }
    Ok(e)
}

/// Bytes of one engine KV block of `model`.
fn model_block_bytes(model: &Model) -> u64 {
    fastlane_llm::kv::block_bytes(&model.kv_geometry()) as u64
}

#[derive(Debug, Serialize)]
pub(crate) struct PrefixClusterRun {
    shared_tokens: usize,
    suffix_tokens: usize,
    rounds: usize,
    block_bytes: u64,
    /// Blocks of the shared prefix the reader can load (all but a block holding the last
    /// prompt token).
    prefix_blocks: u64,
    /// Bound on one cluster call in this run, ms.
    cluster_timeout_ms: u64,
    /// Median TTFT on the reader when the prefix comes from the cluster tier, ms.
    cluster_ttft_ms: f64,
    /// Median TTFT on the reader of a prefix on no tier (computed), ms.
    computed_ttft_ms: f64,
    /// cluster / computed (medians).
    ratio: f64,
    /// Median prefill tokens of a cluster-served request.
    cluster_prefill_tokens: u64,
    /// Median prefill tokens of a computed request.
    computed_prefill_tokens: u64,
    /// Fewest blocks one cluster-served request got from the cluster (`prefix_blocks` when
    /// every lookup found the whole prefix).
    cluster_blocks_min: u64,
    /// Median wall time of a cluster-served request's prefix lookup, ms.
    lookup_ms: f64,
    /// Payload bytes the reader received from the cluster over the cluster-served requests.
    tier_bytes_in: u64,
    /// Their prefix lookups' wall time, seconds.
    tier_lookup_seconds: f64,
    /// `tier_bytes_in / tier_lookup_seconds`.
    tier_bytes_per_s: f64,
    /// Median TTFT of the writer computing each prefix (no tier had it), ms.
    writer_ttft_ms: f64,
}

/// Scenario prefix-cluster (see the module doc) on `urls`.
pub(crate) fn scenario_prefix_cluster(
    model: &Arc<Model>,
    urls: &[String],
    shared: usize,
    suffix: usize,
    rounds: usize,
) -> Result<PrefixClusterRun> {
    let ns = fresh_namespace("prefix-cluster");
    let writer = start_on_cluster(model, cluster_engine_config(urls, &ns), "writer")?;
    let reader = start_on_cluster(model, cluster_engine_config(urls, &ns), "reader")?;
    let with_tail = |salt: u64, tail: u64| {
        let mut p = salted(model, shared, salt);
        p.extend(salted(model, suffix, 1_000_000 + tail));
        p
    };
    // Warm-up of both engines on prefixes of their own (every later prefix is new to both).
    one_request(&writer, with_tail(50_000, 0))?;
    one_request(&reader, with_tail(50_001, 0))?;
    flush(&writer, "writer")?;
    flush(&reader, "reader")?;
    let prefix_blocks = (shared + suffix - 1).min(shared) as u64 / 16;
    let (mut from_cluster, mut computed, mut wrote) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..rounds as u64 {
        // The writer computes prefix P_r; its blocks reach the cluster before the reader asks.
        let w = one_request(&writer, with_tail(60_000 + r, 1))?;
        flush(&writer, "writer")?;
        wrote.push(w.ttft_ms);
        let cluster_req = |tail| one_request(&reader, with_tail(60_000 + r, tail));
        let computed_req = || one_request(&reader, with_tail(70_000 + r, 3));
        // Alternate which goes first; the reader's own puts are flushed in between.
        let (c, n) = if r % 2 == 0 {
            let c = cluster_req(2)?;
            flush(&reader, "reader")?;
            let n = computed_req()?;
            (c, n)
        } else {
            let n = computed_req()?;
            flush(&reader, "reader")?;
            let c = cluster_req(2)?;
            (c, n)
        };
        flush(&reader, "reader")?;
        eprintln!(
            "round {}/{rounds}: from the cluster {:.1} ms ({} blocks, lookup {:.1} ms), computed {:.1} ms",
            r + 1,
            c.ttft_ms,
            c.cluster_hits,
            c.lookup_s * 1e3,
            n.ttft_ms
        );
        if c.host_hits > 0 {
            bail!("the reader found {} blocks of a new prefix in its host cache", c.host_hits);
        }
        if n.host_hits + n.cluster_hits > 0 {
            bail!("a prefix meant to be on no tier was found ({n:?})");
        }
        from_cluster.push(c);
        computed.push(n);
    }
    writer.shutdown()?;
    reader.shutdown()?;
    let bytes_in: u64 = from_cluster.iter().map(|c| c.bytes_in).sum();
    let lookup_s: f64 = from_cluster.iter().map(|c| c.lookup_s).sum();
    let c_ms = crate::stats::median(from_cluster.iter().map(|c| c.ttft_ms).collect());
    let n_ms = crate::stats::median(computed.iter().map(|c| c.ttft_ms).collect());
    Ok(PrefixClusterRun {
        shared_tokens: shared,
        suffix_tokens: suffix,
        rounds,
        block_bytes: model_block_bytes(model),
        prefix_blocks,
        cluster_timeout_ms: BENCH_CLUSTER_TIMEOUT.as_millis() as u64,
        cluster_ttft_ms: c_ms,
        computed_ttft_ms: n_ms,
        ratio: c_ms / n_ms,
        cluster_prefill_tokens: crate::stats::median(
            from_cluster.iter().map(|c| c.prefill_tokens as f64).collect(),
        ) as u64,
        computed_prefill_tokens: crate::stats::median(
            computed.iter().map(|c| c.prefill_tokens as f64).collect(),
        ) as u64,
        cluster_blocks_min: from_cluster.iter().map(|c| c.cluster_hits).min().unwrap_or(0),
        lookup_ms: crate::stats::median(from_cluster.iter().map(|c| c.lookup_s * 1e3).collect()),
        tier_bytes_in: bytes_in,
        tier_lookup_seconds: lookup_s,
        tier_bytes_per_s: bytes_in as f64 / lookup_s,
        writer_ttft_ms: crate::stats::median(wrote),
    })
}

#[derive(Debug, Serialize)]
pub(crate) struct PrefixMissRun {
    shared_tokens: usize,
    suffix_tokens: usize,
    rounds: usize,
    /// Median TTFT with the prefix cache and the cluster on (every lookup misses), ms.
    on_ttft_ms: f64,
    /// Median TTFT with the prefix cache off, ms.
    off_ttft_ms: f64,
    /// on / off (medians).
    ratio: f64,
    /// Median over rounds of each round's on / off.
    ratio_median_of_rounds: f64,
    /// Median wall time of one lookup that missed everywhere, ms.
    lookup_ms: f64,
    /// Blocks the "on" engine found on any tier over the run (0: every lookup missed).
    hits: u64,
    /// Blocks the "on" engine stored in the cluster over the run.
    cluster_puts: u64,
}

/// Scenario prefix-miss (see the module doc) on `urls`.
pub(crate) fn scenario_prefix_miss(
    model: &Arc<Model>,
    urls: &[String],
    shared: usize,
    suffix: usize,
    rounds: usize,
) -> Result<PrefixMissRun> {
    let ns = fresh_namespace("prefix-miss");
    let on = start_on_cluster(model, cluster_engine_config(urls, &ns), "prefix cache on")?;
    let off_cfg = EngineConfig {
        prefix: PrefixConfig { enabled: false, ..PrefixConfig::default() },
        ..cluster_engine_config(&[], &ns)
    };
    let off = Engine::start(model.clone(), off_cfg)?;
    let prompt_of = |salt: u64| {
        let mut p = salted(model, shared, salt);
        p.extend(salted(model, suffix, 1_000_000 + salt));
        p
    };
    one_request(&on, prompt_of(80_000))?;
    one_request(&off, prompt_of(80_001))?;
    flush(&on, "prefix cache on")?;
    let warm = on.prefix_stats().unwrap_or_default();
    let (mut on_ms, mut off_ms, mut ratios, mut lookups) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for r in 0..rounds as u64 {
        // Every prompt is new: its prefix is on no tier.
        let run_on = || -> Result<ReqCost> {
            let c = one_request(&on, prompt_of(90_000 + 2 * r))?;
            flush(&on, "prefix cache on")?;
            Ok(c)
        };
        let run_off = || one_request(&off, prompt_of(90_001 + 2 * r));
        let (a, b) = if r % 2 == 0 {
            let a = run_on()?;
            (a, run_off()?)
        } else {
            let b = run_off()?;
            (run_on()?, b)
        };
        eprintln!(
            "round {}/{rounds}: prefix cache + cluster on {:.1} ms (lookup {:.2} ms), off {:.1} ms ({:.3}x)",
            r + 1,
            a.ttft_ms,
            a.lookup_s * 1e3,
            b.ttft_ms,
            a.ttft_ms / b.ttft_ms
        );
        if a.host_hits + a.cluster_hits > 0 {
            bail!("a prompt meant to be on no tier hit ({a:?})");
        }
        on_ms.push(a.ttft_ms);
        off_ms.push(b.ttft_ms);
        ratios.push(a.ttft_ms / b.ttft_ms);
        lookups.push(a.lookup_s * 1e3);
    }
    let s = on.prefix_stats().unwrap_or_default();
    on.shutdown()?;
    off.shutdown()?;
    let (a, b) = (crate::stats::median(on_ms), crate::stats::median(off_ms));
    Ok(PrefixMissRun {
        shared_tokens: shared,
        suffix_tokens: suffix,
        rounds,
        on_ttft_ms: a,
        off_ttft_ms: b,
        ratio: a / b,
        ratio_median_of_rounds: crate::stats::median(ratios),
        lookup_ms: crate::stats::median(lookups),
        hits: (s.host_hits + s.cluster_hits) - (warm.host_hits + warm.cluster_hits),
        cluster_puts: s.cluster_puts - warm.cluster_puts,
    })
}

/// Options of the scenarios beyond the model.
#[derive(Debug, Clone)]
pub(crate) struct ScenarioOpts {
    /// Seconds of arrivals (scenario b).
    pub seconds: f64,
    /// Rounds (prefix-cluster, prefix-miss).
    pub rounds: usize,
    /// The cluster of prefix-cluster and prefix-miss (`redis://…`); `None`: a private one.
    pub kv_cluster: Option<String>,
    /// Print JSON instead of tables.
    pub json: bool,
}

/// Runs a scenario and prints its table (or JSON).
pub(crate) fn run(
    model: &Arc<Model>,
    scenario: &str,
    opts: &ScenarioOpts,
) -> Result<serde_json::Value> {
    let (seconds, json) = (opts.seconds, opts.json);
    let load = crate::load::loadavg();
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
        "prefix-cluster" | "prefix-miss" => {
            let suffix = 64usize;
            let shared = 2048.min(model.max_positions().saturating_sub(suffix + 2));
            let rounds = opts.rounds.max(1);
            let bb = model_block_bytes(model);
            // Blocks the run stores: two prompts per round and the warm-ups, each at most
            // (shared + suffix) / 16 blocks; an upper bound for each node of a private cluster.
            let blocks = (2 * rounds as u64 + 4) * (shared + suffix).div_ceil(16) as u64;
            let cluster = crate::kv_cluster::BenchCluster::open(
                opts.kv_cluster.as_deref(),
                blocks * (bb + 128) + (64 << 20),
            )?;
            let where_ = if cluster.is_private() {
                "a private 6-node loopback cluster".to_string()
            } else {
                cluster.flag()
            };
            if scenario == "prefix-cluster" {
                eprintln!("scenario prefix-cluster: TTFT of a {shared}-token prefix + {suffix}-token suffix served from the cluster tier ({where_}) to an engine that never saw it, vs computed, {rounds} rounds");
                let r = scenario_prefix_cluster(model, &cluster.urls, shared, suffix, rounds)?;
                let v = serde_json::json!({
                    "scenario": "prefix-cluster", "model": model.name(), "load": load,
                    "load_after": crate::load::loadavg(), "cluster": where_, "result": &r,
                });
                if !json {
                    println!("scenario prefix-cluster on the CPU engine ({}), load {load}: TTFT with a {shared}-token prefix from the cluster tier ({where_}) vs computed, {suffix}-token suffixes, {rounds} rounds", model.name());
                    println!(
                        "{:<10} {:>14} {:>16} {:>14} {:>16}",
                        "prefix",
                        "TTFT P50 (ms)",
                        "prefill tokens",
                        "lookup (ms)",
                        "cluster blocks"
                    );
                    println!(
                        "{:<10} {:>14.1} {:>16} {:>14} {:>16}",
                        "computed", r.computed_ttft_ms, r.computed_prefill_tokens, "-", 0
                    );
                    println!(
                        "{:<10} {:>14.1} {:>16} {:>14.1} {:>16}",
                        "cluster",
                        r.cluster_ttft_ms,
                        r.cluster_prefill_tokens,
                        r.lookup_ms,
                        r.cluster_blocks_min
                    );
                    println!(
                        "cluster / computed TTFT: {:.3}x; the tier delivered {:.1} MB in {:.3} s of lookups: {:.3} GB/s ({} blocks of {} bytes per prefix)",
                        r.ratio,
                        r.tier_bytes_in as f64 / 1e6,
                        r.tier_lookup_seconds,
                        r.tier_bytes_per_s / 1e9,
                        r.prefix_blocks,
                        r.block_bytes
                    );
                    if r.cluster_blocks_min < r.prefix_blocks {
                        println!("warning: a lookup got {} of {} blocks from the cluster (evicted, or timed out after {} ms): those TTFTs include recomputation", r.cluster_blocks_min, r.prefix_blocks, r.cluster_timeout_ms);
                    }
                }
                Ok(v)
            } else {
                eprintln!("scenario prefix-miss: TTFT of {shared}+{suffix}-token prompts on no tier, prefix cache + cluster ({where_}) on vs prefix cache off, interleaved, {rounds} rounds");
                let r = scenario_prefix_miss(model, &cluster.urls, shared, suffix, rounds)?;
                let v = serde_json::json!({
                    "scenario": "prefix-miss", "model": model.name(), "load": load,
                    "load_after": crate::load::loadavg(), "cluster": where_, "result": &r,
                });
                if !json {
                    println!("scenario prefix-miss on the CPU engine ({}), load {load}: TTFT of {shared}+{suffix}-token prompts whose prefix is on no tier, {rounds} rounds interleaved", model.name());
                    println!("{:<26} {:>14} {:>12}", "engine", "TTFT P50 (ms)", "lookup (ms)");
                    println!("{:<26} {:>14.1} {:>12}", "prefix cache off", r.off_ttft_ms, "-");
                    println!(
                        "{:<26} {:>14.1} {:>12.2}",
                        "prefix cache + cluster on", r.on_ttft_ms, r.lookup_ms
                    );
                    println!(
                        "on / off TTFT: {:.4}x (median of rounds {:.4}x; target <= 1.01x); {} blocks hit (0: every lookup missed), {} stored in the cluster",
                        r.ratio, r.ratio_median_of_rounds, r.hits, r.cluster_puts
                    );
                }
                Ok(v)
            }
        }
        other => bail!("--scenario {other:?}: d, b, prefix, prefix-cluster or prefix-miss"),
    }
}
