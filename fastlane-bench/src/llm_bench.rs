//! `fastlane llm bench`: the engine against limits measured in the same run.
//!
//! - **decode at batch 1** against the weight-streaming floor: bytes of weights one token
//!   reads ÷ this machine's read bandwidth (a parallel sum over a buffer far larger than the
//!   last-level cache, same thread count);
//! - **prefill** tokens/s against what OpenBLAS (Debian's numpy) reaches on the same matrix
//!   shapes: the cost of batch-invariant kernels plus our kernel's quality;
//! - **batching**: decode tokens/s at batch 16 against batch 1;
//! - **swap overlap**: decode step time while kvswap swaps a 2,048-token sequence out of the
//!   same pool, against the step time without it.

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use fastlane_kvswap::{BlockId, ChecksumMode, DeviceMemory, SeqId, SwapEngine};
use fastlane_llm::kv::KvPool;
use fastlane_llm::{BatchItem, Model, Scratch, TOKENS_PER_BLOCK};
use rayon::prelude::*;
use serde::Serialize;

/// Arguments of `fastlane llm bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Model (random:small is larger than the last-level cache, as the targets assume).
    #[arg(long, default_value = "random:small")]
    model: String,
    /// Seed of a random: model.
    #[arg(long, default_value_t = 1)]
    model_seed: u64,
    /// Prompt tokens of the prefill measurement.
    #[arg(long, default_value_t = 512)]
    prefill_tokens: usize,
    /// Decode steps per measurement.
    #[arg(long, default_value_t = 16)]
    steps: usize,
    /// Rounds; each ratio is the median over rounds.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Python interpreter with numpy for the GEMM peer.
    #[arg(long, default_value = "/usr/bin/python3")]
    python: String,
    /// Print the results as JSON.
    #[arg(long)]
    json: bool,
    /// Also write the JSON results to this file.
    #[arg(long)]
    out: Option<std::path::PathBuf>,
    /// Instead of the kernel measurements, a scheduler scenario on the real engine: d (one
    /// long prompt among ten decoders: chunked vs whole prefill), b (chat beside batch
    /// jobs: solo, fifo, drr+preempt), prefix (TTFT with a 2,048-token prefix reused from
    /// the prefix cache vs computed), prefix-cluster (the prefix from the Redis Cluster tier
    /// to an engine that never saw it vs computed, and the tier's bytes/s) or prefix-miss
    /// (prefix on no tier: prefix cache + cluster on vs off; --rounds interleaved).
    #[arg(long)]
    scenario: Option<String>,
    /// Scenarios prefix-cluster and prefix-miss: the Redis Cluster,
    /// redis://HOST:PORT[,HOST:PORT...]; without it a private six-node cluster is started on
    /// loopback (redis-server on PATH).
    #[arg(long)]
    kv_cluster: Option<String>,
    /// Seconds of arrivals (scenario b, and --url).
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Load a running OpenAI-compatible server over HTTP instead (scenario a: tenants with
    /// keys `key-quiet` and `key-flood`; see docs/serving.md).
    #[arg(long)]
    url: Option<String>,
    /// With --url: the quiet tenant's arrival rate, requests/s (the flood sends 30x).
    #[arg(long, default_value_t = 1.0)]
    rate: f64,
    /// With --url: only the quiet tenant (the solo baseline).
    #[arg(long)]
    solo: bool,
    /// With --url: tokens per request (the median with --lengths lognormal).
    #[arg(long, default_value_t = 16)]
    max_tokens: u32,
    /// With --url: prompt tokens per request (median); one a byte on the random models.
    #[arg(long, default_value_t = 48)]
    prompt_tokens: u32,
    /// With --url: arrivals, poisson or bursty (AR(1) log-rate with a diurnal swing, the
    /// simulator's process).
    #[arg(long, default_value = "poisson")]
    arrivals: String,
    /// With --url: prompt and output lengths, fixed or lognormal (σ 0.5, up to 4x median).
    #[arg(long, default_value = "fixed")]
    lengths: String,
    /// With --url: first open this many streams that never read (tenant key --slow-key)
    /// and hold them for the whole run.
    #[arg(long, default_value_t = 0)]
    slow_streams: usize,
    /// With --url: the slow streams' tenant key.
    #[arg(long, default_value = "key-slow")]
    slow_key: String,
    /// With --url: tokens each slow stream asks for.
    #[arg(long, default_value_t = 256)]
    slow_tokens: u32,
    /// With --url: hold this many hostile connections of every kind during the run (no key
    /// with a trickled body, slow headers, valid key that never reads, maximal prompts and
    /// stop lists, 429'd bursts; `fastlane_bench::llm_attack`) and count the answers.
    #[arg(long, default_value_t = 0)]
    attack: usize,
    /// With --attack: the key of the tenant that never reads and sends maximal prompts.
    #[arg(long, default_value = "key-attack")]
    attack_key: String,
    /// With --attack: the key of a small-bucket tenant whose requests are mostly 429.
    #[arg(long, default_value = "key-burst")]
    attack_burst_key: String,
    /// With --attack: only these kinds (comma-separated, of no_key_trickle, slow_headers,
    /// never_reads, max_prompt, burst_429), to find which one costs the quiet tenant.
    #[arg(long, value_delimiter = ',', default_values_t = crate::llm_attack::KINDS.map(String::from))]
    attack_kinds: Vec<String>,
    /// With --url or --attack-floor: keyless requests a second on fresh connections during
    /// the run (latency to their 401: what the HTTP layer alone costs a new client); 0: none.
    #[arg(long, default_value_t = 0.0)]
    probe_rate: f64,
    /// With --url: each tenant's requests reuse its idle connections (HTTP/1.1 keep-alive,
    /// as the OpenAI SDKs do) instead of opening one per request; TTFT then starts at the
    /// request's write on a reused connection.
    #[arg(long)]
    keep_alive: bool,
    /// With --url: send the same load for this many seconds before the measured --seconds
    /// and count none of it (its requests are reported as warmup_sent). The flood tenant
    /// starts with a full rate bucket: until it has spent its burst it is under its rate
    /// and protected like the quiet one (docs/serving.md, "Fairness within a tier").
    #[arg(long, default_value_t = 0.0)]
    warmup: f64,
    /// Instead of a server at --url: the floor of the attack measurement, a bare server in
    /// this process (one thread on --floor-core that accepts, reads once, writes a fixed 401
    /// and closes: less than any server does), probed at --probe-rate for --seconds alone
    /// and then under --attack (use the kinds any server refuses at once: burst_429,
    /// no_key_trickle).
    #[arg(long)]
    attack_floor: bool,
    /// With --attack-floor: the floor server's core.
    #[arg(long, default_value_t = 0)]
    floor_core: usize,
    /// Instead of a run: split the router's quiet TTFTs of a scripts/router-floor.sh run whose
    /// files are in this directory (the JSON logs of upstream and router, the two runs'
    /// results, the loaded run's window); prints the table, --out/--json the same as JSON.
    #[arg(long, value_name = "DIR")]
    router_floor: Option<std::path::PathBuf>,
    /// With --url: an `llm serve` (http://HOST:PORT; the upstream when --url is a router)
    /// whose engine steps over the run are reported: how many, the histogram buckets of their
    /// P50 and P99, how many were given up; and per tenant the server's TTFT, its stages
    /// (admit, engine, respond) and the engine thread's part (JSON: engine.ttft_stages).
    #[arg(long)]
    engine_metrics: Option<String>,
    /// With --url: the server's pid; its RSS, threads and CPU time are reported at the start
    /// and end.
    #[arg(long)]
    server_pid: Option<u32>,
    /// With --url: write `<tenant>.hlog` (tags ttft, itl) and ttft.svg into this directory.
    #[arg(long)]
    hlog_dir: Option<std::path::PathBuf>,
    /// With --url: seed of arrivals and lengths.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// With --url: written into every prompt ahead of its number. Two runs against one
    /// server with different tags and one seed have the same arrivals and share no cached
    /// prefix (a run after another with the same prompts would find them cached).
    #[arg(long, default_value = "")]
    prompt_tag: String,
}

#[derive(Debug, Serialize)]
struct Row {
    name: &'static str,
    ours: f64,
    floor: f64,
    unit: &'static str,
    ratio: f64,
    target: &'static str,
    met: bool,
}

#[derive(Debug, Serialize)]
struct Report {
    model: String,
    parameters: u64,
    weight_bytes: u64,
    kernels: String,
    threads: usize,
    read_bandwidth_gbs: f64,
    loadavg: String,
    swap_out_2048_tokens_ms: f64,
    batch16_step_ms: f64,
    rows: Vec<Row>,
}

/// Read bandwidth: best of three parallel sums over 1 GiB (bytes/s). Integer adds, so the
/// sum vectorises and the loop is bound by memory, not by an add chain.
fn read_bandwidth() -> f64 {
    let n = (1usize << 30) / 8;
    let buf: Vec<u64> = (0..n as u64).collect();
    let mut best = 0.0f64;
    for _ in 0..3 {
        let t0 = Instant::now();
        let s: u64 = buf
            .par_chunks(1 << 15)
            .map(|c| c.iter().fold(0u64, |a, &x| a.wrapping_add(x)))
            .reduce(|| 0, u64::wrapping_add);
        let dt = t0.elapsed().as_secs_f64();
        std::hint::black_box(s);
        best = best.max((n * 8) as f64 / dt);
    }
    best
}

/// Seconds OpenBLAS (numpy, float32) takes for `m`-row GEMMs of each (n, k), summed,
/// median of 5 after a warm-up.
fn numpy_gemm_seconds(python: &str, m: usize, shapes: &[(usize, usize, usize)]) -> Result<f64> {
    let script = r#"
import json, sys, time
import numpy as np
m = int(sys.argv[1]); shapes = json.loads(sys.argv[2])
rng = np.random.default_rng(0)
mats = [(rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32), c) for n, k, c in shapes]
def once():
    t = time.perf_counter()
    for x, w, c in mats:
        for _ in range(c):
            x @ w
    return time.perf_counter() - t
once()
print(sorted(once() for _ in range(5))[2])
"#;
    let shapes_json = serde_json::to_string(shapes)?;
    let out = Command::new(python)
        .arg("-c")
        .arg(script)
        .arg(m.to_string())
        .arg(shapes_json)
        .output()
        .with_context(|| {
            format!("running {python} (install python3-numpy and libopenblas0-pthread)")
        })?;
    if !out.status.success() {
        bail!("numpy GEMM peer failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().parse()?)
}

struct Fixture {
    model: Arc<Model>,
    pool: KvPool,
    s: Scratch,
}

impl Fixture {
    /// Blocks of sequence `i` of `len` positions (sequences laid out one after another).
    fn blocks(&self, i: usize, per_seq: usize) -> Vec<BlockId> {
        (i * per_seq..(i + 1) * per_seq).map(|b| BlockId(b as u32)).collect()
    }

    /// Seconds per decode step of `batch` sequences at context `ctx`, over `steps` steps.
    fn decode_step_s(
        &mut self,
        batch: usize,
        ctx: usize,
        steps: usize,
        per_seq: usize,
    ) -> Result<f64> {
        let tables: Vec<Vec<BlockId>> = (0..batch).map(|i| self.blocks(i, per_seq)).collect();
        let toks: Vec<[u32; 1]> = (0..batch).map(|i| [(65 + i % 26) as u32]).collect();
        let t0 = Instant::now();
        for step in 0..steps {
            let items: Vec<BatchItem<'_>> = (0..batch)
                .map(|i| BatchItem {
                    tokens: &toks[i],
                    start_pos: ctx + step,
                    blocks: &tables[i],
                    want_logits: true,
                })
                .collect();
            self.model.forward(&items, &self.pool, &mut self.s)?;
        }
        Ok(t0.elapsed().as_secs_f64() / steps as f64)
    }
}

/// Writes `--out` and prints `--json` of a finished run.
fn emit(a: &BenchArgs, v: &serde_json::Value) -> Result<()> {
    if let Some(p) = &a.out {
        if let Some(dir) = p.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(p, serde_json::to_string_pretty(v)?)?;
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(v)?);
    }
    Ok(())
}

/// Runs `fastlane llm bench`.
pub fn run(a: &BenchArgs) -> Result<()> {
    if let Some(dir) = &a.router_floor {
        let v = crate::router_floor::report(dir, a.json)?;
        return emit(a, &v);
    }
    if a.url.is_some() || a.attack_floor {
        let attack_kinds = crate::llm_attack::kinds(&a.attack_kinds)?;
        let o = crate::llm_load::LoadOpts {
            url: a.url.clone().unwrap_or_default(),
            solo: a.solo,
            rate: a.rate,
            secs: a.seconds,
            warmup: a.warmup,
            max_tokens: a.max_tokens,
            prompt_tokens: a.prompt_tokens,
            arrivals: a.arrivals.clone(),
            lengths: a.lengths.clone(),
            slow_streams: a.slow_streams,
            slow_key: a.slow_key.clone(),
            slow_tokens: a.slow_tokens,
            attack: (a.attack > 0).then(|| crate::llm_attack::Attack {
                per_kind: a.attack,
                key: a.attack_key.clone(),
                burst_key: a.attack_burst_key.clone(),
                kinds: attack_kinds,
            }),
            server_pid: a.server_pid,
            hlog_dir: a.hlog_dir.clone(),
            seed: a.seed,
            prompt_tag: a.prompt_tag.clone(),
            probe_rate: a.probe_rate,
            engine_metrics: a.engine_metrics.clone(),
            json: a.json,
            keep_alive: a.keep_alive,
        };
        let v = if a.attack_floor {
            if a.url.is_some() {
                bail!("--attack-floor starts its own server: leave out --url");
            }
            crate::llm_load::floor(&o, a.floor_core)?
        } else {
            crate::llm_load::bench(&o)?
        };
        return emit(a, &v);
    }
    let model = Arc::new(
        Model::load(&a.model, a.model_seed).with_context(|| format!("loading {}", a.model))?,
    );
    if let Some(sc) = &a.scenario {
        let opts = crate::llm_sched::ScenarioOpts {
            seconds: a.seconds,
            rounds: a.rounds,
            kv_cluster: a.kv_cluster.clone(),
            json: a.json,
        };
        let v = crate::llm_sched::run(&model, sc, &opts)?;
        return emit(a, &v);
    }
    let threads = rayon::current_num_threads();
    eprintln!(
        "bench: {} ({} parameters, {:.0} MB of weights), kernels {}, {threads} threads",
        model.name(),
        model.config().parameters(),
        model.weight_bytes() as f64 / 1e6,
        fastlane_llm::kernels::isa()
    );
    let ctx = 64usize;
    let batch = 16usize;
    let per_seq = (ctx + a.steps + 1)
        .div_ceil(TOKENS_PER_BLOCK)
        .max(a.prefill_tokens.div_ceil(TOKENS_PER_BLOCK));
    let swap_blocks = 2048 / TOKENS_PER_BLOCK;
    let geom = model.kv_geometry();
    let pool_blocks = (batch * per_seq + swap_blocks) as u32;
    let pool = KvPool::new(&geom, pool_blocks)?;
    let mut f = Fixture { model: model.clone(), pool, s: Scratch::default() };
    // Fill every sequence's context with a prefill (also the warm-up).
    let prompt: Vec<u32> = (0..ctx as u32).map(|i| 65 + i % 26).collect();
    for i in 0..batch {
        let blocks = f.blocks(i, per_seq);
        let item =
            [BatchItem { tokens: &prompt, start_pos: 0, blocks: &blocks, want_logits: true }];
        f.model.forward(&item, &f.pool, &mut f.s)?;
    }
    eprintln!("bench: measuring read bandwidth (1 GiB)…");
    let bw = read_bandwidth();
    let floor_s = model.weight_bytes() as f64 / bw;

    let (mut dec1, mut dec16, mut pre, mut peer, mut over) =
        (vec![], vec![], vec![], vec![], vec![]);
    let mut swap_s = Vec::new();
    let long: Vec<u32> = (0..a.prefill_tokens as u32).map(|i| 65 + i % 26).collect();
    // GEMM peer: the same shapes, every layer, m = prefill tokens.
    let layers = model.config().num_hidden_layers;
    let shapes: Vec<(usize, usize, usize)> = model
        .matrix_shapes()
        .into_iter()
        .filter(|s| s.0 != "lm_head")
        .map(|(_, n, k)| (n, k, layers))
        .collect();
    // The swap engine over the same pool, for the overlap measurement.
    let dev: Arc<dyn DeviceMemory> = f.pool.memory().clone();
    let mut swap = SwapEngine::new(
        fastlane_kvswap::EngineConfig {
            host_bytes: (swap_blocks * f.pool.memory().block_bytes()) as u64,
            checksum: ChecksumMode::Fast,
            ..fastlane_kvswap::EngineConfig::default()
        },
        dev,
    )?;
    let victim = SeqId(1 << 40);
    let vblocks: Vec<BlockId> =
        (batch * per_seq..batch * per_seq + swap_blocks).map(|b| BlockId(b as u32)).collect();
    for r in 0..a.rounds.max(1) {
        eprintln!("bench: round {}/{}", r + 1, a.rounds);
        dec1.push(f.decode_step_s(1, ctx, a.steps, per_seq)?);
        dec16.push(f.decode_step_s(batch, ctx, a.steps, per_seq)?);
        let blocks = f.blocks(0, per_seq);
        let item = [BatchItem { tokens: &long, start_pos: 0, blocks: &blocks, want_logits: true }];
        let t0 = Instant::now();
        f.model.forward(&item, &f.pool, &mut f.s)?;
        pre.push(t0.elapsed().as_secs_f64());
        peer.push(numpy_gemm_seconds(&a.python, a.prefill_tokens, &shapes)?);
        // Overlap: one step alone, then one step started together with a 2,048-token
        // swap-out (which ends inside it), alternating.
        for _ in 0..8 {
            let base = f.decode_step_s(batch, ctx, 1, per_seq)?;
            swap.adopt_blocks(victim, &vblocks)?;
            let t0 = Instant::now();
            let t = swap.swap_out(victim, &vblocks)?;
            let during = f.decode_step_s(batch, ctx, 1, per_seq)?;
            swap.wait(t, Duration::from_secs(60))?;
            swap_s.push(t0.elapsed().as_secs_f64());
            swap.free_blocks(victim, &vblocks)?;
            swap.drop_seq(victim)?;
            over.push(during / base);
        }
    }
    let d1 = crate::stats::median(dec1);
    let d16 = crate::stats::median(dec16);
    let pre_tps = a.prefill_tokens as f64 / crate::stats::median(pre);
    let peer_tps = a.prefill_tokens as f64 / crate::stats::median(peer);
    let ov = crate::stats::median(over);
    let rows = vec![
        Row {
            name: "decode batch 1: ms/token vs weight-streaming floor",
            ours: d1 * 1e3,
            floor: floor_s * 1e3,
            unit: "ms",
            ratio: d1 / floor_s,
            target: "<= 1.5x",
            met: d1 / floor_s <= 1.5,
        },
        Row {
            name: "prefill: tokens/s vs OpenBLAS on the same shapes",
            ours: pre_tps,
            floor: peer_tps,
            unit: "tok/s",
            ratio: pre_tps / peer_tps,
            target: ">= 0.7x",
            met: pre_tps / peer_tps >= 0.7,
        },
        Row {
            name: "decode throughput batch 16 vs batch 1",
            ours: batch as f64 / d16,
            floor: 1.0 / d1,
            unit: "tok/s",
            ratio: (batch as f64 / d16) / (1.0 / d1),
            target: ">= 6x",
            met: (batch as f64 / d16) * d1 >= 6.0,
        },
        Row {
            name: "batch-16 step with a 2,048-token swap-out vs without",
            ours: ov,
            floor: 1.0,
            unit: "x",
            ratio: ov,
            target: "<= 1.1x",
            met: ov <= 1.1,
        },
    ];
    let report = Report {
        model: model.name().to_string(),
        parameters: model.config().parameters(),
        weight_bytes: model.weight_bytes(),
        kernels: fastlane_llm::kernels::isa().to_string(),
        threads,
        read_bandwidth_gbs: bw / 1e9,
        swap_out_2048_tokens_ms: crate::stats::median(swap_s) * 1e3,
        batch16_step_ms: d16 * 1e3,
        loadavg: crate::load::loadavg(),
        rows,
    };
    emit(a, &serde_json::to_value(&report)?)?;
    if a.json {
        return Ok(());
    }
    println!(
        "model {} ({} parameters, {:.0} MB), kernels {}, {} threads, read bandwidth {:.1} GB/s, load {}",
        report.model,
        report.parameters,
        report.weight_bytes as f64 / 1e6,
        report.kernels,
        report.threads,
        report.read_bandwidth_gbs,
        report.loadavg
    );
    println!(
        "a 2,048-token swap-out ({:.0} MB) takes {:.1} ms; a batch-16 decode step {:.1} ms",
        (2048 * f.pool.memory().block_bytes() / TOKENS_PER_BLOCK) as f64 / 1e6,
        report.swap_out_2048_tokens_ms,
        report.batch16_step_ms
    );
    println!(
        "{:<56} {:>12} {:>12} {:>8} {:>9} {:>4}",
        "measurement", "ours", "floor/peer", "ratio", "target", "met"
    );
    for r in &report.rows {
        println!(
            "{:<56} {:>12.3} {:>12.3} {:>7.2}x {:>9} {:>4}",
            r.name,
            r.ours,
            r.floor,
            r.ratio,
            r.target,
            if r.met { "yes" } else { "no" }
        );
    }
    Ok(())
}
