//! `fastlane kv sim`: run a scheduler simulation scenario and report per-tenant latency.
//!
//! Prints the per-tenant table (P50/P95/P99/P99.9 TTFT, per-token P99, throughput,
//! preemptions, swap bytes), writes one `.hlog` (tags `<tenant>.ttft`, `<tenant>.token`,
//! and `window.token` for scenario d) and an SVG of the per-tenant TTFT distributions.

use std::path::PathBuf;
use std::time::{Duration, UNIX_EPOCH};

use anyhow::Context;
use clap::Args;
use fastlane_hist::{format_ns, percentile_plot_svg, HlogWriter, PlotSeries};
use fastlane_sched::sim::{
    run as run_sim, ScenarioId, SimConfig, SimReport, SwapTiming, PCIE_FACTOR_DEFAULT,
};
use fastlane_sched::{Policy, ProtectConfig, Tier};

/// Arguments of `fastlane kv sim`.
#[derive(Debug, Args)]
pub struct SimArgs {
    /// Scenario: a (flooder vs quiet), b (chat beside 32k-token batch jobs), c (20 tenants),
    /// d (one 4,000-token prompt among ten decoding users).
    #[arg(long)]
    pub scenario: String,
    /// Policy: fifo, drr (token bucket + DRR), drr+preempt.
    #[arg(long, default_value = "drr+preempt")]
    pub policy: String,
    /// Latency protection (with drr or drr+preempt): while an interactive tenant whose token
    /// bucket is at least --protect-bucket full (it sends under its rpm) has a prefill in the
    /// step, the other tenants add at most --protect-cap prefill tokens to that step (their
    /// decodes still run). Not work-conserving: the protected chunk's step stays near its solo
    /// length and the others' prefill waits. After --protect-hold-ms of holding others back,
    /// one step is planned work-conserving (starvation bound).
    #[arg(long)]
    pub protect: bool,
    /// With --protect: prefill tokens the unprotected tenants may add to a protected step.
    #[arg(long, default_value_t = 0, requires = "protect")]
    pub protect_cap: u32,
    /// With --protect: bucket fill (fraction of its capacity B, 0-1) from which an
    /// interactive tenant is protected.
    #[arg(long, default_value_t = 0.5, requires = "protect")]
    pub protect_bucket: f64,
    /// With --protect: longest hold of the others' prefill, ms, before one work-conserving step.
    #[arg(long, default_value_t = 1000.0, requires = "protect")]
    pub protect_hold_ms: f64,
    /// Simulated seconds of arrivals (default: the scenario's, 300 s; d: 3 s).
    #[arg(long)]
    pub seconds: Option<f64>,
    /// Seed of the arrival and length streams.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Prefill chunk in tokens; 0 = whole prompts in one step.
    #[arg(long, default_value_t = 512)]
    pub chunk: u32,
    /// Run only this tenant (the solo baseline), e.g. `--solo quiet`.
    #[arg(long)]
    pub solo: Option<String>,
    /// Swap cost: use this many ns per byte instead of calibrating the host tier.
    #[arg(long)]
    pub swap_ns_per_byte: Option<f64>,
    /// Scale from measured host-tier copy time to simulated PCIe time.
    #[arg(long, default_value_t = PCIE_FACTOR_DEFAULT)]
    pub pcie_factor: f64,
    /// Directory for the .hlog and .svg files.
    #[arg(long, default_value = "sim-out")]
    pub out: PathBuf,
    /// Print JSON instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// Run `fastlane kv sim`.
pub fn run(args: &SimArgs) -> anyhow::Result<()> {
    let scenario: ScenarioId = args.scenario.parse()?;
    let policy: Policy = args.policy.parse()?;
    let mut cfg = SimConfig::new(scenario, policy);
    cfg.seconds = args.seconds;
    cfg.seed = args.seed;
    cfg.chunk_tokens = (args.chunk > 0).then_some(args.chunk);
    cfg.solo = args.solo.clone();
    if args.protect {
        if !(args.protect_hold_ms > 0.0 && args.protect_hold_ms.is_finite()) {
            anyhow::bail!("--protect-hold-ms must be a positive number of milliseconds");
        }
        cfg.protect = Some(ProtectConfig {
            bucket_frac_min: args.protect_bucket,
            others_prefill_tokens_max: args.protect_cap,
            hold_ns_max: (args.protect_hold_ms * 1e6) as u64,
            ..ProtectConfig::default()
        });
    }
    cfg.swap = match args.swap_ns_per_byte {
        Some(ns_per_byte) => SwapTiming::Fixed { ns_per_byte },
        None => SwapTiming::Calibrated { pcie_factor: args.pcie_factor },
    };
    let report = run_sim(&cfg).context("simulation")?;
    let stem = file_stem(args, &report);
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let hlog = args.out.join(format!("{stem}.hlog"));
    let svg = args.out.join(format!("{stem}-ttft.svg"));
    write_hlog(&report, &hlog)?;
    let series: Vec<PlotSeries<'_>> = report
        .tenants
        .iter()
        .filter(|t| !t.stats.ttft.is_empty())
        .map(|t| PlotSeries { label: &t.name, histogram: &t.stats.ttft })
        .collect();
    let title = format!(
        "TTFT per tenant (simulation) - scenario {} {}{} chunk {}",
        report.scenario,
        report.policy,
        protect_label(&report),
        chunk_label(report.chunk_tokens)
    );
    std::fs::write(&svg, percentile_plot_svg(&title, &series))
        .with_context(|| format!("writing {}", svg.display()))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&to_json(&report))?);
    } else {
        print!("{}", table(&report));
        println!("wrote {} and {}", hlog.display(), svg.display());
    }
    Ok(())
}

fn chunk_label(chunk: Option<u32>) -> String {
    chunk.map_or_else(|| "whole".to_string(), |c| c.to_string())
}

/// " +protect(cap C)" when latency protection is on, "" otherwise.
fn protect_label(r: &SimReport) -> String {
    r.protect
        .map_or_else(String::new, |p| format!(" +protect(cap {})", p.others_prefill_tokens_max))
}

fn file_stem(args: &SimArgs, r: &SimReport) -> String {
    let mut policy = r.policy.to_string().replace('+', "-");
    if let Some(p) = r.protect {
        policy.push_str(&format!("-protect{}", p.others_prefill_tokens_max));
    }
    let mut stem =
        format!("sim-{}-{policy}-chunk{}-seed{}", r.scenario, chunk_label(r.chunk_tokens), r.seed);
    if let Some(solo) = &args.solo {
        stem.push_str("-solo-");
        stem.push_str(solo);
    }
    stem
}

fn write_hlog(r: &SimReport, path: &std::path::Path) -> anyhow::Result<()> {
    let mut w = HlogWriter::with_base_time(
        std::io::BufWriter::new(
            std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?,
        ),
        UNIX_EPOCH,
    )?;
    w.write_comment(&format!(
        "fastlane kv sim: SIMULATION of Llama-3.1-8B on one A100-40GB, scenario {} policy {}{} chunk {} seed {} seconds {}",
        r.scenario,
        r.policy,
        protect_label(r),
        chunk_label(r.chunk_tokens),
        r.seed,
        r.seconds
    ))?;
    let length = Duration::from_nanos(r.end_ns.max(1));
    for t in &r.tenants {
        w.write_histogram(
            Some(&format!("{}.ttft", t.name)),
            Duration::ZERO,
            length,
            &t.stats.ttft,
        )?;
        w.write_histogram(
            Some(&format!("{}.token", t.name)),
            Duration::ZERO,
            length,
            &t.stats.token_gap,
        )?;
    }
    if let Some(h) = &r.window_token_gap {
        w.write_histogram(Some("window.token"), Duration::ZERO, length, h)?;
    }
    w.flush()?;
    Ok(())
}

fn q(h: &fastlane_hist::Histogram<u64>, quantile: f64) -> u64 {
    if h.is_empty() {
        0
    } else {
        h.value_at_quantile(quantile)
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.0}", bytes as f64 / (1u64 << 20) as f64)
}

/// The per-tenant table.
pub fn table(r: &SimReport) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "SIMULATION: Llama-3.1-8B bf16 on one A100-40GB (cost model), {} KV blocks; scenario {} policy {}{} chunk {} seed {} seconds {}",
        r.kv_blocks,
        r.scenario,
        r.policy,
        protect_label(r),
        chunk_label(r.chunk_tokens),
        r.seed,
        r.seconds
    );
    let sw = &r.swap;
    let _ = writeln!(
        s,
        "swap cost: {:.4} ns/B ({:.1} GB/s){}; {} real engine transfers, {} MiB real, {} MiB simulated, {} mismatches",
        sw.ns_per_byte,
        1.0 / sw.ns_per_byte.max(1e-12),
        match (sw.host_ns_per_byte, sw.pcie_factor) {
            (Some(h), Some(f)) => format!(" = host tier measured {h:.4} ns/B ({:.1} GB/s) x PCIe factor {f}", 1.0 / h.max(1e-12)),
            _ => " (fixed)".to_string(),
        },
        sw.port.transfers,
        mib(sw.port.real_bytes),
        mib(sw.port.sim_bytes),
        sw.port.mismatches
    );
    if let Some(p) = &r.protect {
        let _ = writeln!(
            s,
            "protect: interactive tenants with bucket >= {} of B protected; others' prefill <= {} tokens in a protected step; hold <= {}; {} capped steps, {} released (work-conserving) steps of {}",
            p.bucket_frac_min,
            p.others_prefill_tokens_max,
            format_ns(p.hold_ns_max as f64),
            r.protect_stats.capped_steps,
            r.protect_stats.released_steps,
            r.steps
        );
    }
    let _ = writeln!(
        s,
        "{:<10} {:<5} {:>6} {:>6} {:>6} {:>5} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>10}",
        "tenant",
        "tier",
        "req",
        "admit",
        "429",
        "unsrv",
        "TTFT P50",
        "P95",
        "P99",
        "P99.9",
        "tok P99",
        "tok/s",
        "preempt",
        "swap MiB"
    );
    for t in &r.tenants {
        let st = &t.stats;
        let _ = writeln!(
            s,
            "{:<10} {:<5} {:>6} {:>6} {:>6} {:>5} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8.1} {:>8} {:>10}",
            t.name,
            match t.tier {
                Tier::Interactive => "inter",
                Tier::Batch => "batch",
            },
            st.submitted,
            st.admitted,
            st.rejected,
            t.unserved,
            format_ns(q(&st.ttft, 0.5) as f64),
            format_ns(q(&st.ttft, 0.95) as f64),
            format_ns(q(&st.ttft, 0.99) as f64),
            format_ns(q(&st.ttft, 0.999) as f64),
            format_ns(q(&st.token_gap, 0.99) as f64),
            t.tokens_per_s,
            st.preemptions(),
            mib(st.swap_out_bytes + st.swap_in_bytes)
        );
    }
    if let Some(h) = &r.window_token_gap {
        let _ = writeln!(
            s,
            "others' token gap while the long prompt waited for its first token: P50 {} P99 {} max {} ({} tokens)",
            format_ns(q(h, 0.5) as f64),
            format_ns(q(h, 0.99) as f64),
            format_ns(h.max() as f64),
            h.len()
        );
    }
    s
}

fn to_json(r: &SimReport) -> serde_json::Value {
    let tenants: Vec<_> = r
        .tenants
        .iter()
        .map(|t| {
            let st = &t.stats;
            serde_json::json!({
                "name": t.name,
                "tier": match t.tier { Tier::Interactive => "interactive", Tier::Batch => "batch" },
                "submitted": st.submitted,
                "admitted": st.admitted,
                "rejected": st.rejected,
                "queued": st.queued,
                "completed": st.completed,
                "fenced": st.fenced,
                "unserved": t.unserved,
                "ttft_ns": {
                    "p50": q(&st.ttft, 0.5), "p95": q(&st.ttft, 0.95),
                    "p99": q(&st.ttft, 0.99), "p99_9": q(&st.ttft, 0.999), "count": st.ttft.len(),
                },
                "token_gap_ns": { "p50": q(&st.token_gap, 0.5), "p99": q(&st.token_gap, 0.99) },
                "tokens_per_s": t.tokens_per_s,
                "preempted_swap": st.preempted_swap,
                "preempted_recompute": st.preempted_recompute,
                "swap_out_bytes": st.swap_out_bytes,
                "swap_in_bytes": st.swap_in_bytes,
            })
        })
        .collect();
    serde_json::json!({
        "simulation": true,
        "scenario": r.scenario.to_string(),
        "policy": r.policy.to_string(),
        "chunk_tokens": r.chunk_tokens,
        "seed": r.seed,
        "seconds": r.seconds,
        "kv_blocks": r.kv_blocks,
        "steps": r.steps,
        "swap_ns_per_byte": r.swap.ns_per_byte,
        "host_tier_ns_per_byte": r.swap.host_ns_per_byte,
        "pcie_factor": r.swap.pcie_factor,
        "engine_transfers": r.swap.port.transfers,
        "protect": r.protect.map(|p| serde_json::json!({
            "bucket_frac_min": p.bucket_frac_min,
            "others_prefill_tokens_max": p.others_prefill_tokens_max,
            "hold_ns_max": p.hold_ns_max,
            "capped_steps": r.protect_stats.capped_steps,
            "released_steps": r.protect_stats.released_steps,
        })),
        "window_token_gap_ns": r.window_token_gap.as_ref().map(|h| serde_json::json!({
            "p50": q(h, 0.5), "p99": q(h, 0.99), "max": h.max(), "count": h.len(),
        })),
        "tenants": tenants,
    })
}
