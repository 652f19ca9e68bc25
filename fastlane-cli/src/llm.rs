//! `fastlane llm`: the inference engine from the command line.
//!
//! - `generate`: run prompts through the engine (continuous batching, preemption through the
//!   swap tiers), streaming tokens to stdout or printing `--json`.
//! - `make-random`: write a seeded random model as a Hugging Face directory.
//! - `bench`: decode, prefill, batching and swap overlap against floors measured in the same
//!   run (see `llm_bench.rs`).

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use fastlane_kvswap::{NvmeTierConfig, RemoteTierConfig};
use fastlane_llm::{
    Engine, EngineConfig, FinishReason, Finished, GenRequest, Model, PreemptChoice, RandomPreset,
    RandomWeights, SamplingParams, StreamEvent,
};
use fastlane_sched::Policy;

/// Arguments of `fastlane llm`.
#[derive(Debug, Args)]
pub struct LlmArgs {
    #[command(subcommand)]
    cmd: LlmCmd,
}

#[derive(Debug, Subcommand)]
enum LlmCmd {
    /// Generate text: one prompt streamed to stdout, or --prompts FILE all at once.
    Generate(Box<GenerateArgs>),
    /// Write a seeded random model as a Hugging Face directory (config.json + safetensors).
    MakeRandom(MakeRandomArgs),
    /// Measure decode, prefill, batching and swap overlap against floors of the same run.
    Bench(Box<fastlane_bench::llm_bench::BenchArgs>),
    /// Serve the engine over HTTP: the OpenAI API (/v1/completions, /v1/chat/completions,
    /// /v1/models), /health and /metrics, tenants from --tenants.
    Serve(Box<ServeArgs>),
}

/// Arguments of `fastlane llm serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    engine: EngineArgs,
    /// Tenants (TOML, `[[tenant]]` tables: name, keys, rpm, burst, max_concurrent, tier,
    /// max_stream_seconds, queue). Without it every request is served as tenant `default`
    /// and no key is needed.
    #[arg(long)]
    tenants: Option<PathBuf>,
    /// Address to listen on (port 0: any free port; the address is printed).
    #[arg(long, default_value = "127.0.0.1:8000")]
    listen: std::net::SocketAddr,
    #[command(flatten)]
    http: HttpArgs,
}

/// Listener flags shared by `llm serve` and `router`.
#[derive(Debug, Args, Clone)]
pub struct HttpArgs {
    /// After SIGTERM or SIGINT: stop accepting, let open streams finish for at most this
    /// many seconds, then exit 0.
    #[arg(long, default_value_t = 30)]
    pub drain_seconds: u64,
    /// A client must send a request's headers within this many seconds (slow-header clients
    /// are cut off).
    #[arg(long, default_value_t = 10.0)]
    pub header_timeout_seconds: f64,
    /// Open connections at most (beyond, new ones wait in the accept backlog).
    #[arg(long, default_value_t = 16_384)]
    pub max_connections: usize,
}

impl HttpArgs {
    /// The listener options.
    pub fn options(&self) -> Result<fastlane_daemon::http::HttpOptions> {
        if !(self.header_timeout_seconds.is_finite() && self.header_timeout_seconds > 0.0) {
            bail!("--header-timeout-seconds must be positive");
        }
        Ok(fastlane_daemon::http::HttpOptions {
            header_timeout: Duration::from_secs_f64(self.header_timeout_seconds),
            max_connections: self.max_connections,
            drain: Duration::from_secs(self.drain_seconds),
        })
    }

    /// Binds `addr`, prints `listening on http://ADDR` (scripts read it), serves `app` until
    /// SIGTERM/SIGINT, drains.
    pub fn run(
        &self,
        addr: std::net::SocketAddr,
        app: fastlane_llm::server::Router,
        what: &str,
    ) -> Result<()> {
        self.run_with(addr, what, move || app)
    }

    /// [`HttpArgs::run`] with the app built inside the runtime (it may spawn tasks).
    pub fn run_with(
        &self,
        addr: std::net::SocketAddr,
        what: &str,
        app: impl FnOnce() -> fastlane_llm::server::Router,
    ) -> Result<()> {
        use fastlane_daemon::http;
        let opts = self.options()?;
        let fds = http::raise_fd_limit();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .thread_name("fastlane-http")
            .build()?;
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding {addr}"))?;
            let local = listener.local_addr()?;
            let app = app();
            println!("listening on http://{local}");
            log::info!(
                "{what} on http://{local} (header timeout {:.1}s, {} connections at most, {fds} fds)",
                opts.header_timeout.as_secs_f64(),
                opts.max_connections
            );
            match http::serve(listener, app, opts, http::shutdown_signal()).await {
                http::Drained::Clean => log::info!("drained: every stream finished"),
                http::Drained::TimedOut => log::warn!(
                    "drain timeout ({}s): exiting with streams still open",
                    opts.drain.as_secs()
                ),
            }
            Ok::<(), anyhow::Error>(())
        })
    }
}

/// The model and engine flags shared by `generate` and `bench`.
#[derive(Debug, Args, Clone)]
pub struct EngineArgs {
    /// Model: a Hugging Face directory (config.json, *.safetensors) or random:tiny (3.4 M
    /// parameters) / random:small (125 M), seeded random weights that are not a language model.
    #[arg(long, default_value = "random:tiny")]
    pub model: String,
    /// Seed of a random: model's weights.
    #[arg(long, default_value_t = 1)]
    pub model_seed: u64,
    /// KV blocks in the device pool (16 tokens each); small values force preemption.
    #[arg(long, default_value_t = 1024)]
    pub device_blocks: u32,
    /// Scheduling policy: fifo (no gate), drr (token bucket + slots + DRR), drr+preempt
    /// (and batch sequences preempted for interactive ones). Default: fifo for generate,
    /// drr for serve.
    #[arg(long)]
    pub policy: Option<String>,
    /// How preempted sequences give up their blocks: auto (measured costs), swap, recompute.
    #[arg(long, default_value = "auto")]
    pub preempt: String,
    /// Latency protection (policies drr, drr+preempt): while an interactive tenant that sends
    /// under its rate has prefill in the step, other tenants add no prefill to that step
    /// (their decodes still run); not work-conserving, off by default (docs/scheduler.md).
    #[arg(long)]
    pub protect: bool,
    /// How the interactive and batch tiers share a step (policies drr, drr+preempt):
    /// separate (a step with an interactive prefill carries no batch-tier work, decodes
    /// included, for at most 500 ms in a row; the batch work runs in the next step) or shared
    /// (batch work fills whatever budget the interactive tier leaves, as on a GPU where rows
    /// are nearly free). On a CPU every row lengthens the step (docs/serving.md).
    #[arg(long, default_value = "separate", value_name = "separate|shared")]
    pub tier_steps: String,
    /// Prefill chunk in tokens (0: whole prompts in one step). Default 256; 64 for serve.
    #[arg(long)]
    pub chunk: Option<u32>,
    /// Token budget of one step. Default 512; 128 for serve (unless --preemptible-steps is
    /// on, a step runs to its end, so its length bounds how long a new request waits for the
    /// one in flight).
    #[arg(long)]
    pub batch_tokens: Option<u32>,
    /// Preemptible steps: on or off. On: when a request of an interactive-tier tenant
    /// arrives while a step's forward pass runs and that step holds no interactive prefill,
    /// the pass is given up between two layers (the work done on it is discarded and redone)
    /// and the next step is planned with the new request in it; the step after one given up
    /// always runs to its end. Trades batch-tier throughput for interactive TTFT; with
    /// --tier-steps separate the step that follows holds no batch row (docs/serving.md). On
    /// by default: output is the same either way.
    #[arg(long, default_value = "on")]
    pub preemptible_steps: String,
    /// Host swap tier size (bytes, K/M/G suffixes; 0: none, swap goes to --nvme/--remote).
    #[arg(long, default_value = "256M")]
    pub host_bytes: String,
    /// NVMe swap tier: a file or block device, used with O_DIRECT through io_uring.
    #[arg(long)]
    pub nvme: Option<PathBuf>,
    /// Bytes of --nvme to use.
    #[arg(long, default_value = "1G")]
    pub nvme_bytes: String,
    /// Remote swap tier: address of a `fastlane rdma serve` pool.
    #[arg(long)]
    pub remote: Option<std::net::SocketAddr>,
    /// RDMA device for --remote.
    #[arg(long, default_value = "rxe0")]
    pub rdma_device: String,
    /// Bytes to take from the remote pool.
    #[arg(long, default_value = "256M")]
    pub remote_bytes: String,
    /// Prefix reuse: prompts' full 16-token blocks are cached by content (model digest +
    /// token ids) and a new prompt's leading hits are loaded instead of prefilled: on or off.
    #[arg(long, default_value = "on")]
    pub prefix_cache: String,
    /// Bytes of KV blocks the in-process prefix cache holds (K/M/G suffixes).
    #[arg(long, default_value = "256M")]
    pub prefix_cache_bytes: String,
    /// NVMe tier of the prefix cache, under its host memory: a file (created, preallocated
    /// to --prefix-cache-nvme-bytes; O_DIRECT where the filesystem allows) or a block device.
    /// Blocks the host cache evicts are written there in the background and read back,
    /// checked by CRC32C, on a later hit. Its contents do not survive a restart.
    #[arg(long, value_name = "PATH")]
    pub prefix_cache_nvme: Option<PathBuf>,
    /// Bytes of --prefix-cache-nvme to use (K/M/G suffixes): one slot per KV block, the least
    /// recently used slot reused when full.
    #[arg(long, value_name = "SIZE", default_value = "1G", requires = "prefix_cache_nvme")]
    pub prefix_cache_nvme_bytes: String,
    /// Redis Cluster behind the prefix cache, shared by every engine that names it:
    /// redis://HOST:PORT[,HOST:PORT...] (any nodes of the cluster).
    #[arg(long)]
    pub kv_cluster: Option<String>,
}

impl EngineArgs {
    /// The model, loaded (and a warning when it is a random one).
    pub fn load_model(&self) -> Result<Arc<Model>> {
        let t0 = Instant::now();
        let m = Model::load(&self.model, self.model_seed)
            .with_context(|| format!("loading {}", self.model))?;
        log::info!(
            "model {}: {} parameters, {} layers, {:.0} MB of f32 weights, loaded in {:.2}s, kernels {}",
            m.name(),
            m.config().parameters(),
            m.config().num_hidden_layers,
            m.weight_bytes() as f64 / 1e6,
            t0.elapsed().as_secs_f64(),
            fastlane_llm::kernels::isa()
        );
        if m.is_random() {
            eprintln!(
                "note: {} has random weights: it is not a language model, its text means nothing",
                m.name()
            );
        }
        Ok(Arc::new(m))
    }

    /// The engine configuration these flags describe.
    pub fn engine_config(&self) -> Result<EngineConfig> {
        let policy: Policy = match &self.policy {
            Some(p) => p.parse().map_err(|e| anyhow::anyhow!("--policy: {e}"))?,
            None => Policy::Fifo,
        };
        let preempt: PreemptChoice =
            self.preempt.parse().map_err(|e| anyhow::anyhow!("--preempt: {e}"))?;
        let size = |s: &str, flag: &str| {
            fastlane_util::parse_size(s).map_err(|e| anyhow::anyhow!("{flag}: {e}"))
        };
        if self.device_blocks == 0 {
            bail!("--device-blocks must be at least 1");
        }
        let mut cfg = EngineConfig {
            policy,
            preempt,
            device_blocks: self.device_blocks,
            chunk_tokens: Some(self.chunk.unwrap_or(256)).filter(|&c| c > 0),
            batch_tokens_max: self.batch_tokens.unwrap_or(512).max(1),
            protect: self.protect.then(fastlane_sched::ProtectConfig::default),
            tier_steps: self.tier_steps.parse().map_err(|e| anyhow::anyhow!("--tier-steps {e}"))?,
            ..EngineConfig::default()
        };
        cfg.swap.host_bytes = size(&self.host_bytes, "--host-bytes")?;
        cfg.swap.nvme = self
            .nvme
            .as_ref()
            .map(|p| {
                Ok::<_, anyhow::Error>(NvmeTierConfig {
                    path: p.clone(),
                    bytes: size(&self.nvme_bytes, "--nvme-bytes")?,
                    depth: 32,
                })
            })
            .transpose()?;
        cfg.swap.remote = self
            .remote
            .map(|addr| {
                Ok::<_, anyhow::Error>(RemoteTierConfig {
                    device: self.rdma_device.clone(),
                    addr,
                    bytes: size(&self.remote_bytes, "--remote-bytes")?,
                })
            })
            .transpose()?;
        cfg.preemptible_steps = match self.preemptible_steps.as_str() {
            "on" => true,
            "off" => false,
            o => bail!("--preemptible-steps {o:?}: on or off"),
        };
        cfg.prefix.enabled = match self.prefix_cache.as_str() {
            "on" => true,
            "off" => false,
            o => bail!("--prefix-cache {o:?}: on or off"),
        };
        cfg.prefix.host_bytes =
            usize::try_from(size(&self.prefix_cache_bytes, "--prefix-cache-bytes")?)
                .context("--prefix-cache-bytes: too large")?;
        if let Some(path) = &self.prefix_cache_nvme {
            if !cfg.prefix.enabled {
                bail!("--prefix-cache-nvme needs --prefix-cache on");
            }
            let bytes = size(&self.prefix_cache_nvme_bytes, "--prefix-cache-nvme-bytes")?;
            if bytes == 0 {
                bail!("--prefix-cache-nvme-bytes must be more than 0");
            }
            cfg.prefix.nvme = Some(fastlane_kvswap::PrefixNvmeConfig::new(path.clone(), bytes));
        }
        if let Some(urls) = &self.kv_cluster {
            cfg.prefix.cluster = fastlane_bench::cluster_urls::parse_cluster_urls(urls)?;
            if !cfg.prefix.enabled {
                bail!("--kv-cluster needs --prefix-cache on");
            }
        }
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::{EngineArgs, EngineConfig};

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        engine: EngineArgs,
    }

    fn engine(args: &[&str]) -> Result<EngineConfig, String> {
        let cli = Cli::try_parse_from(std::iter::once("t").chain(args.iter().copied()))
            .map_err(|e| e.to_string())?;
        cli.engine.engine_config().map_err(|e| e.to_string())
    }

    #[test]
    fn preemptible_steps_flag() {
        let cfg = |args: &[&str]| {
            let cli = Cli::try_parse_from(std::iter::once("fastlane").chain(args.iter().copied()));
            cli.unwrap().engine.engine_config()
        };
        assert!(cfg(&[]).unwrap().preemptible_steps, "on by default");
        assert!(cfg(&["--preemptible-steps", "on"]).unwrap().preemptible_steps);
        assert!(!cfg(&["--preemptible-steps", "off"]).unwrap().preemptible_steps);
        let err = cfg(&["--preemptible-steps", "yes"]).unwrap_err().to_string();
        assert!(err.contains("on or off"), "{err}");
    }

    #[test]
    fn tier_steps_flag() {
        use fastlane_sched::TierSteps;
        let cfg = |args: &[&str]| {
            let cli = Cli::try_parse_from(std::iter::once("fastlane").chain(args.iter().copied()));
            cli.unwrap().engine.engine_config()
        };
        assert_eq!(cfg(&[]).unwrap().tier_steps, TierSteps::SEPARATE, "separate by default");
        assert_eq!(cfg(&["--tier-steps", "shared"]).unwrap().tier_steps, TierSteps::Shared);
        let err = cfg(&["--tier-steps", "mixed"]).unwrap_err().to_string();
        assert!(err.contains("--tier-steps") && err.contains("shared or separate"), "{err}");
    }

    #[test]
    fn prefix_cache_nvme_flags() {
        assert_eq!(engine(&[]).unwrap().prefix.nvme, None);
        let c = engine(&["--prefix-cache-nvme", "/x/kv.cache"]).unwrap();
        let n = c.prefix.nvme.expect("an NVMe tier");
        assert_eq!((n.path.as_path(), n.bytes), (std::path::Path::new("/x/kv.cache"), 1 << 30));
        let c = engine(&["--prefix-cache-nvme", "/x", "--prefix-cache-nvme-bytes", "64M"]).unwrap();
        assert_eq!(c.prefix.nvme.expect("an NVMe tier").bytes, 64 << 20);
        let e = engine(&["--prefix-cache-nvme-bytes", "64M"]).unwrap_err();
        assert!(e.contains("--prefix-cache-nvme <PATH>"), "{e}");
        let e = engine(&["--prefix-cache-nvme", "/x", "--prefix-cache-nvme-bytes", "lots"]);
        assert!(e.unwrap_err().starts_with("--prefix-cache-nvme-bytes: "));
        let e = engine(&["--prefix-cache-nvme", "/x", "--prefix-cache-nvme-bytes", "0"]);
        assert!(e.unwrap_err().contains("more than 0"));
        let e = engine(&["--prefix-cache", "off", "--prefix-cache-nvme", "/x"]).unwrap_err();
        assert_eq!(e, "--prefix-cache-nvme needs --prefix-cache on");
    }
}

/// Arguments of `fastlane llm generate`.
#[derive(Debug, Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    engine: EngineArgs,
    /// The prompt (text, byte-tokenized; BOS first).
    prompt: Option<String>,
    /// A file of prompts, one a line, all submitted at once.
    #[arg(long, conflicts_with = "prompt")]
    prompts: Option<PathBuf>,
    /// Prompt as token ids, comma separated (for a checkpoint whose tokenizer is not read).
    #[arg(long, conflicts_with_all = ["prompt", "prompts"])]
    prompt_ids: Option<String>,
    /// Tokens to generate at most per prompt.
    #[arg(long, default_value_t = 64)]
    max_tokens: u32,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling: keep the most likely tokens up to this probability.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Keep only the k most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Seed of the sampler (prompt i uses seed + i).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop when the text contains this string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Stop after this token id (repeatable).
    #[arg(long)]
    stop_token_id: Vec<u32>,
    /// Stop at the model's end-of-sequence token (off by default: random models emit it by
    /// chance).
    #[arg(long)]
    eos: bool,
    /// Print per prompt the token ids and text, and the engine's counters, as JSON.
    #[arg(long)]
    json: bool,
}

/// Arguments of `fastlane llm make-random`.
#[derive(Debug, Args)]
pub struct MakeRandomArgs {
    /// tiny or small.
    #[arg(long, default_value = "tiny")]
    preset: String,
    /// Seed of the weights (the same seed gives the same files).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    /// Write bf16 weights instead of f32.
    #[arg(long)]
    bf16: bool,
    /// Spread the tensors over this many files with a model.safetensors.index.json.
    #[arg(long, default_value_t = 1)]
    shards: usize,
}

/// Runs `fastlane llm`.
pub fn run(args: &LlmArgs) -> Result<()> {
    crate::logging::init();
    match &args.cmd {
        LlmCmd::Generate(a) => generate(a),
        LlmCmd::MakeRandom(a) => make_random(a),
        LlmCmd::Bench(a) => fastlane_bench::llm_bench::run(a),
        LlmCmd::Serve(a) => serve(a),
    }
}

fn serve(a: &ServeArgs) -> Result<()> {
    use fastlane_llm::server::{AppState, EngineMetrics, Metrics, Tenants};
    let tenants = match &a.tenants {
        Some(p) => Tenants::load(p)?,
        None => Tenants::open(),
    };
    let model = a.engine.load_model()?;
    let mut cfg = a.engine.engine_config()?;
    if a.engine.policy.is_none() {
        cfg.policy = Policy::Drr;
    }
    // Serving defaults: short steps (BENCHMARKS.md, serving: the quiet tenant's P99 TTFT is
    // its solo TTFT plus the step in flight).
    if a.engine.chunk.is_none() {
        cfg.chunk_tokens = Some(64);
    }
    if a.engine.batch_tokens.is_none() {
        cfg.batch_tokens_max = 128;
    }
    cfg.tenants = tenants.sched_configs();
    let engine = Arc::new(Engine::start(model.clone(), cfg)?);
    let metrics = Metrics::new().with_tenants(tenants.entries().iter().map(|e| e.name.as_str()));
    let engine_metrics = EngineMetrics::new(&metrics).with_engine(engine.histograms());
    let state = Arc::new(AppState {
        engine: engine.clone(),
        tenants,
        metrics,
        engine_metrics,
        model_id: model.name().to_string(),
    });
    let what = format!("serving {} ({} tenants)", model.name(), state.tenants.entries().len());
    a.http.run(a.listen, fastlane_llm::server::router(state), &what)?;
    match Arc::try_unwrap(engine) {
        Ok(e) => {
            let c = e.shutdown()?;
            log::info!(
                "stopped: {} requests finished, {} aborted, {} steps ({} given up)",
                c.finished,
                c.aborted,
                c.steps,
                c.steps_aborted
            );
        }
        Err(_) => log::info!("stopped"),
    }
    Ok(())
}

fn make_random(a: &MakeRandomArgs) -> Result<()> {
    let preset = RandomPreset::parse(&format!("random:{}", a.preset))
        .with_context(|| format!("--preset {:?}: tiny or small", a.preset))?;
    let w = RandomWeights::new(preset.config(), a.seed);
    w.write_dir(&a.out, a.bf16, a.shards)?;
    println!(
        "wrote {} ({} parameters, seed {}, {}) to {}",
        preset.name(),
        preset.config().parameters(),
        a.seed,
        if a.bf16 { "bf16" } else { "f32" },
        a.out.display()
    );
    Ok(())
}

fn generate(a: &GenerateArgs) -> Result<()> {
    let model = a.engine.load_model()?;
    let prompts: Vec<Vec<u32>> = if let Some(ids) = &a.prompt_ids {
        vec![ids
            .split(',')
            .map(|s| {
                s.trim()
                    .parse::<u32>()
                    .with_context(|| format!("--prompt-ids: {s:?} is not a token id"))
            })
            .collect::<Result<_>>()?]
    } else if let Some(path) = &a.prompts {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        text.lines()
            .filter(|l| !l.is_empty())
            .map(|l| model.tokenizer().encode(l))
            .collect::<Result<_, _>>()?
    } else if let Some(p) = &a.prompt {
        vec![model.tokenizer().encode(p)?]
    } else {
        bail!("give a prompt, --prompts FILE or --prompt-ids");
    };
    if prompts.is_empty() {
        bail!("no prompts");
    }
    let engine = Engine::start(model.clone(), a.engine.engine_config()?)?;
    let t0 = Instant::now();
    let mut streams = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let req = GenRequest {
            prompt: p.clone(),
            max_tokens: a.max_tokens,
            sampling: SamplingParams {
                temperature: a.temperature,
                top_p: a.top_p,
                top_k: a.top_k,
                seed: a.seed + i as u64,
            },
            stop: a.stop.clone(),
            stop_token_ids: a.stop_token_id.clone(),
            ignore_eos: !a.eos,
            tenant: 0,
            digest_logits: false,
        };
        streams.push(engine.submit(req)?);
    }
    let wait = Duration::from_secs(3600);
    let mut results: Vec<Finished> = Vec::new();
    if streams.len() == 1 && !a.json {
        // Stream the one prompt's tokens as they come.
        let mut out = std::io::stdout().lock();
        loop {
            match streams[0].next(wait) {
                Some(StreamEvent::Token { text, .. }) => {
                    out.write_all(text.as_bytes())?;
                    out.flush()?;
                }
                Some(StreamEvent::Done(f)) => {
                    writeln!(out)?;
                    results.push(f);
                    break;
                }
                None => bail!("no token for an hour"),
            }
        }
    } else {
        for (i, s) in streams.iter().enumerate() {
            let f = s.wait(wait)?;
            if !a.json {
                println!("--- prompt {i} ({:?}, {} tokens)", f.reason, f.token_ids.len());
                println!("{}", f.text);
            }
            results.push(f);
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let c = engine.shutdown()?;
    let generated: usize = results.iter().map(|f| f.token_ids.len()).sum();
    if a.json {
        let per: Vec<serde_json::Value> = results
            .iter()
            .map(|f| {
                serde_json::json!({
                    "token_ids": f.token_ids,
                    "text": f.text,
                    "finish_reason": f.reason,
                    "prompt_tokens": f.prompt_tokens,
                    "ttft_ms": f.ttft_ns.map(|n| n as f64 / 1e6),
                    "preemptions": f.preemptions,
                })
            })
            .collect();
        let v = serde_json::json!({
            "model": model.name(),
            "random_weights": model.is_random(),
            "results": per,
            "seconds": secs,
            "tokens_per_second": generated as f64 / secs,
            "engine": c,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        eprintln!(
            "{} prompts, {generated} tokens in {secs:.2}s ({:.1} tokens/s); {} steps, preempted {} by swap / {} by recompute, swapped {} B out / {} B in, {} checksum mismatches",
            results.len(),
            generated as f64 / secs,
            c.steps,
            c.preempt_swap,
            c.preempt_recompute,
            c.swap_out_bytes,
            c.swap_in_bytes,
            c.checksum_mismatches
        );
    }
    let refused = |f: &&Finished| {
        matches!(
            f.reason,
            FinishReason::Rejected | FinishReason::RateLimited | FinishReason::QueueFull
        )
    };
    if results.iter().any(|f| refused(&f)) {
        let why: Vec<&str> = results.iter().filter(refused).map(|f| f.text.as_str()).collect();
        bail!("{} prompt(s) refused: {}", why.len(), why.join("; "));
    }
    Ok(())
}
