//! `fastlane llm serve`, `generate` and `make-random`: each one's flags (clap `Args`, which
//! the CLI flattens into its subcommands, as `fastlane-bench`'s are) and the function that
//! runs it.
//!
//! - [`serve`]: the engine over HTTP, the OpenAI API of [`crate::server`], tenants from
//!   `--tenants`, until SIGTERM/SIGINT (then the open streams drain).
//! - [`generate`]: prompts through the engine (continuous batching, preemption through the
//!   swap tiers), streaming tokens to stdout or printing `--json`.
//! - [`make_random`]: a seeded random model written as a Hugging Face directory.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;

use crate::args::{EngineArgs, HttpArgs};
use crate::{
    Engine, FinishReason, Finished, GenRequest, RandomPreset, RandomWeights, SamplingParams,
    StreamEvent,
};

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
    /// While a step computes a protected tenant's prefill (`--protect`), accept no new
    /// connection: they wait in the kernel's backlog (at most 100 ms each) so that a flood
    /// of them does not take the core from that step. on or off.
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    hold_accepts: String,
    /// While a step computes a protected tenant's prefill (`--protect`), the engine thread and
    /// the compute pool run at this nice value (-20 to 19), then go back to their own: the
    /// quiet tenant's step then takes the core from the HTTP workers. Needs CAP_SYS_NICE (or
    /// systemd's LimitNICE=); without it the start warns and steps run at the threads' own
    /// priority. "off": never changed.
    #[arg(long, default_value = "-10", value_name = "NICE|off", allow_hyphen_values = true)]
    protected_nice: String,
    /// Request bodies of at most this many bytes are tokenized on the HTTP worker that read
    /// them (a short prompt costs less than the hand-off to the tokenizer pool and back, which
    /// waits for the core twice when it is busy); larger ones on the tokenizer pool. 0: every
    /// body on the pool. At most 65536.
    #[arg(long, default_value_t = crate::server::admit::INLINE_TOKENIZE_BYTES)]
    tokenize_inline_bytes: usize,
    /// Fault injection for tests: the engine thread ends with an error after this many
    /// steps, as on a fatal fault (the server stays up and answers 503).
    #[arg(long, hide = true)]
    fault_engine_exit_after_steps: Option<u64>,
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

/// Runs `fastlane llm serve` until SIGTERM/SIGINT, then drains.
pub fn serve(a: &ServeArgs) -> Result<()> {
    use crate::server::{AppState, EngineMetrics, Metrics, Tenants};
    let tenants = match &a.tenants {
        Some(p) => Tenants::load(p)?,
        None => Tenants::open(),
    };
    // Every flag is checked before the model loads.
    let body_limits = a.http.body_limits()?;
    let mut opts = a.http.options()?;
    if a.tokenize_inline_bytes > crate::server::admit::INLINE_TOKENIZE_BYTES_MAX {
        bail!(
            "--tokenize-inline-bytes {}: at most {}",
            a.tokenize_inline_bytes,
            crate::server::admit::INLINE_TOKENIZE_BYTES_MAX
        );
    }
    let mut cfg = a.engine.serve_config()?;
    cfg.protected_nice = match a.protected_nice.as_str() {
        "off" => None,
        n => match n.parse::<i32>() {
            Ok(v) if (-20..=19).contains(&v) => Some(v),
            _ => bail!("--protected-nice {n}: a nice value from -20 to 19, or off"),
        },
    };
    let model = a.engine.load_model()?;
    cfg.tenants = tenants.sched_configs();
    cfg.exit_after_steps = a.fault_engine_exit_after_steps;
    if a.hold_accepts == "on" && cfg.protect.is_some() {
        // One per process, shared by the engine thread and the listener.
        let hold: &'static fastlane_daemon::http::AcceptHold = Box::leak(Box::default());
        cfg.accept_hold = Some(hold);
        opts.accept_hold = Some(hold);
    }
    // Each tenant's prompt blocks in its own namespace (or its prefix group's).
    cfg.prefix.tenant_namespaces = tenants.prefix_namespaces();
    let gated = cfg.policy != fastlane_sched::Policy::Fifo;
    let engine = Arc::new(Engine::start(model.clone(), cfg)?);
    let metrics = Metrics::new().with_tenants(tenants.entries().iter().map(|e| e.name.as_str()));
    let admit = crate::server::admit::Admit::new(&tenants, gated, &metrics)
        .with_inline_bytes(a.tokenize_inline_bytes);
    let engine_metrics = EngineMetrics::new(&metrics).with_engine(engine.histograms());
    let state = Arc::new(AppState {
        engine: engine.clone(),
        tenants,
        metrics,
        engine_metrics,
        model_id: model.name().to_string(),
        body_limits,
        admit,
    });
    let what = format!("serving {} ({} tenants)", model.name(), state.tenants.entries().len());
    let app = crate::server::router(state);
    fastlane_daemon::http::run(a.listen, &what, opts, move || app)?;
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

/// Runs `fastlane llm make-random`.
pub fn make_random(a: &MakeRandomArgs) -> Result<()> {
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

/// Runs `fastlane llm generate`: one prompt streamed to stdout, or all at once.
pub fn generate(a: &GenerateArgs) -> Result<()> {
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
                ..SamplingParams::default()
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
