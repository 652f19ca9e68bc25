//! `fastlane router`: the multi-tenant front end (tenants, token bucket, slots, DRR, fence,
//! per-tenant TTFT in Prometheus) as a proxy before an OpenAI-compatible server.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use fastlane_openai::router::{self as proxy, ProxyConfig, ProxyState};
use fastlane_openai::{Metrics, Tenants};

/// Arguments of `fastlane router`.
#[derive(Debug, Args)]
pub struct RouterArgs {
    /// The OpenAI-compatible server to protect, `http://HOST:PORT` (ours started with
    /// `llm serve --policy fifo`, vLLM, SGLang, llama.cpp's server).
    #[arg(long)]
    upstream: String,
    /// Tenants (TOML, as for `llm serve`): keys, rpm, burst, weight, max_concurrent, tier,
    /// max_stream_seconds, queue. Without it every request is tenant `default`.
    #[arg(long)]
    tenants: Option<PathBuf>,
    /// Address to listen on (port 0: any free port; the address is printed).
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: std::net::SocketAddr,
    /// Requests in flight at the upstream at most; when one ends, DRR picks the next.
    #[arg(long, default_value_t = 64)]
    upstream_slots: usize,
    /// Upstream slots kept for interactive-tier tenants: the batch tier holds the others at
    /// most, so batch streams that never end cannot take every slot. Default: a quarter of
    /// --upstream-slots (16 of 64).
    #[arg(long)]
    interactive_slots: Option<usize>,
    /// Streamed batch-tier requests dispatched upstream whose first bytes have not come back
    /// (whose prompts the upstream is still computing), at most; 0: no limit. On a CPU
    /// upstream without tiers (`llm serve --policy fifo`, llama.cpp's server), 1 keeps batch
    /// prompts from sharing one long step that an interactive request must wait for. It caps
    /// how fast batch requests start (one per time to first byte).
    #[arg(long, default_value_t = 0)]
    batch_prefills: usize,
    /// Key sent upstream as `Authorization: Bearer KEY` (clients' keys are not forwarded).
    #[arg(long)]
    upstream_key: Option<String>,
    /// Key sent upstream instead of --upstream-key with batch-tier tenants' requests. With an
    /// upstream `llm serve --tenants` that has an interactive tenant for --upstream-key and a
    /// batch one for this key, the upstream sees the router's tiers (its tier steps and
    /// preemptible steps then apply; docs/serving.md).
    #[arg(long)]
    upstream_batch_key: Option<String>,
    /// Seconds to connect and get the upstream's response headers (then 502/504).
    #[arg(long, default_value_t = 30.0)]
    upstream_timeout_seconds: f64,
    /// DRR quantum in estimated tokens (prompt bytes / 4 + max_tokens).
    #[arg(long, default_value_t = 256)]
    quantum_tokens: u64,
    #[command(flatten)]
    http: fastlane_openai::HttpArgs,
}

/// Runs the router until SIGTERM/SIGINT.
pub fn run(a: &RouterArgs) -> Result<()> {
    crate::logging::init();
    let upstream: fastlane_openai::Uri =
        a.upstream.parse().with_context(|| format!("--upstream {:?}", a.upstream))?;
    if upstream.scheme_str() != Some("http") || upstream.host().is_none() {
        bail!("--upstream: http://HOST:PORT (no TLS)");
    }
    let upstream_timeout =
        fastlane_openai::listen::seconds("--upstream-timeout-seconds", a.upstream_timeout_seconds)?;
    if a.upstream_slots == 0 {
        bail!("--upstream-slots must be at least 1");
    }
    let interactive_slots = a.interactive_slots.unwrap_or(a.upstream_slots / 4);
    if interactive_slots >= a.upstream_slots {
        bail!(
            "--interactive-slots {interactive_slots} must be below --upstream-slots {} (the batch tier keeps one at least)",
            a.upstream_slots
        );
    }
    let tenants = match &a.tenants {
        Some(p) => Tenants::load(p)?,
        None => Tenants::open(),
    };
    let cfg = ProxyConfig {
        upstream,
        upstream_slots: a.upstream_slots,
        interactive_slots,
        batch_prefills: a.batch_prefills,
        upstream_key: a.upstream_key.clone(),
        upstream_batch_key: a.upstream_batch_key.clone(),
        upstream_timeout,
        quantum_tokens: a.quantum_tokens.max(1),
        body_limits: a.http.body_limits()?,
    };
    let what = format!(
        "routing to {} ({} tenants, {} upstream slots, {} kept for the interactive tier)",
        a.upstream,
        tenants.entries().len(),
        a.upstream_slots,
        interactive_slots
    );
    a.http.run_with(a.listen, &what, move || {
        let metrics =
            Metrics::new().with_tenants(tenants.entries().iter().map(|e| e.name.as_str()));
        proxy::router(ProxyState::new(cfg, tenants, metrics))
    })
}
