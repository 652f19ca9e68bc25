//! The engine's Prometheus families (`GET /metrics` of `llm serve`), registered beside the front
//! end's ([`fastlane_openai::metrics::Metrics`]) in its registry.

use fastlane_openai::metrics::Metrics;
use prometheus::{IntCounterVec, IntGaugeVec, Opts};

use crate::engine::{EngineCounters, EngineHistograms};

/// The engine's families.
#[derive(Debug, Clone)]
pub struct EngineMetrics {
    front: Metrics,
    engine: IntGaugeVec,
    blocks: IntGaugeVec,
    preemptions: IntCounterVec,
    swap_bytes: IntCounterVec,
    steps: IntCounterVec,
    steps_aborted: IntCounterVec,
    accept_holds: IntCounterVec,
    tier_steps: IntCounterVec,
    protect_steps: IntCounterVec,
    prefix_blocks: IntCounterVec,
    prefix_reused_tokens: IntCounterVec,
    tenant_prefix_reused_tokens: IntCounterVec,
    prefix_cache_blocks: IntGaugeVec,
    prefix_cluster_puts: IntCounterVec,
    prefix_cluster_bytes: IntCounterVec,
    prefix_cluster_errors: IntCounterVec,
}

fn must<T>(r: prometheus::Result<T>) -> T {
    // The names and labels below are constants that prometheus accepts.
    #[allow(clippy::expect_used)]
    r.expect("valid metric definition")
}

impl EngineMetrics {
    /// The engine's families, registered in `front`'s registry; [`EngineMetrics::render`]
    /// renders both.
    pub fn new(front: &Metrics) -> EngineMetrics {
        let registry = front.registry();
        let gauge = |name: &str, help: &str, labels: &[&str]| {
            let g = must(IntGaugeVec::new(Opts::new(name, help), labels));
            must(registry.register(Box::new(g.clone())));
            g
        };
        let engine = gauge(
            "fastlane_llm_sequences",
            "Sequences in the engine now, by state (queued, waiting, running, swapping, swapped_out)",
            &["state"],
        );
        let blocks = gauge(
            "fastlane_llm_kv_blocks",
            "KV blocks: free and used in the device pool, swapped out per tier",
            &["state"],
        );
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let c = must(IntCounterVec::new(Opts::new(name, help), labels));
            must(registry.register(Box::new(c.clone())));
            c
        };
        let preemptions =
            counter("fastlane_llm_preemptions_total", "Preemptions, by mode", &["mode"]);
        let swap_bytes = counter(
            "fastlane_llm_swap_bytes_total",
            "Bytes swapped, by direction and tier",
            &["direction", "tier"],
        );
        let steps = counter(
            "fastlane_llm_engine_steps_total",
            "Engine steps (batched forward passes)",
            &[],
        );
        let steps_aborted = counter(
            "fastlane_llm_engine_steps_aborted_total",
            "Engine steps whose forward pass was given up for an interactive arrival (--preemptible-steps)",
            &[],
        );
        let accept_holds = counter(
            "fastlane_llm_engine_accept_holds_total",
            "The listener's accepts held for a protected tenant's prefill (--hold-accepts): steps that held them (step), new connections that waited (accept)",
            &["what"],
        );
        let tier_steps = counter(
            "fastlane_llm_engine_tier_steps_total",
            "Steps with an interactive prefill that kept the batch tier's waiting work out (separate), or shared after the hold bound (released); --tier-steps",
            &["kind"],
        );
        let protect_steps = counter(
            "fastlane_llm_engine_protect_steps_total",
            "Steps with an under-rate tenant's prefill that held the other tenants' work back (capped), or planned work-conserving after the hold bound (released); --protect",
            &["kind"],
        );
        let prefix_blocks = counter(
            "fastlane_llm_prefix_blocks_total",
            "Prompt blocks looked up in the prefix cache, by result (host_hit, nvme_hit, cluster_hit, miss, integrity_miss)",
            &["result"],
        );
        let prefix_reused_tokens = counter(
            "fastlane_llm_prefix_reused_tokens_total",
            "Prompt tokens loaded from the prefix cache instead of prefilled",
            &[],
        );
        let tenant_prefix_reused_tokens = counter(
            "fastlane_llm_tenant_prefix_reused_tokens_total",
            "Prompt tokens loaded from the prefix cache instead of prefilled, by tenant",
            &["tenant"],
        );
        let prefix_cache_blocks = gauge(
            "fastlane_llm_prefix_cache_blocks",
            "KV blocks held in the host prefix cache",
            &[],
        );
        let prefix_cluster_puts = counter(
            "fastlane_llm_prefix_cluster_puts_total",
            "Prompt blocks sent to the cluster tier, by result (stored, dropped: the queue to it was full, error)",
            &["result"],
        );
        let prefix_cluster_bytes = counter(
            "fastlane_llm_prefix_cluster_bytes_total",
            "Block payload bytes through the cluster tier, by direction (out: stored, in: hits)",
            &["direction"],
        );
        let prefix_cluster_errors = counter(
            "fastlane_llm_prefix_cluster_errors_total",
            "Cluster-tier lookups that failed (timeout, connection, cluster down); their blocks were misses",
            &[],
        );
        EngineMetrics {
            front: front.clone(),
            engine,
            blocks,
            preemptions,
            swap_bytes,
            steps,
            steps_aborted,
            accept_holds,
            tier_steps,
            protect_steps,
            prefix_blocks,
            prefix_reused_tokens,
            tenant_prefix_reused_tokens,
            prefix_cache_blocks,
            prefix_cluster_puts,
            prefix_cluster_bytes,
            prefix_cluster_errors,
        }
    }

    /// Registers the engine's histograms (step time, batch size, swap durations) too.
    pub fn with_engine(self, h: &EngineHistograms) -> EngineMetrics {
        let reg = |c: Box<dyn prometheus::core::Collector>| must(self.front.registry().register(c));
        reg(Box::new(h.step_seconds.clone()));
        reg(Box::new(h.batch_tokens.clone()));
        reg(Box::new(h.batch_sequences.clone()));
        reg(Box::new(h.swap_seconds.clone()));
        reg(Box::new(h.prefix_lookup_seconds.clone()));
        reg(Box::new(h.first_token_seconds.clone()));
        self
    }

    /// The text exposition, with the engine's counters as of now; `tenants` names the
    /// scheduler's tenants in index order.
    pub fn render(&self, c: &EngineCounters, tenants: &[&str]) -> String {
        let states = [
            ("queued", c.seqs.queued),
            ("waiting", c.seqs.waiting),
            ("running", c.seqs.running),
            ("swapping", c.seqs.swapping),
            ("swapped_out", c.seqs.swapped_out),
        ];
        for (state, n) in states {
            self.engine.with_label_values(&[state]).set(n as i64);
        }
        for (t, name) in tenants.iter().enumerate() {
            let q = c.queued_by_tenant.get(t).copied().unwrap_or(0);
            self.front.queue_depth.with_label_values(&[name]).set(q as i64);
            let reused = c.prefix_reused_tokens_by_tenant.get(t).copied().unwrap_or(0);
            fastlane_daemon::metrics::set_total(&self.tenant_prefix_reused_tokens, &[name], reused);
        }
        self.blocks.with_label_values(&["free"]).set(i64::from(c.blocks_free));
        self.blocks.with_label_values(&["used"]).set(i64::from(c.blocks_total - c.blocks_free));
        for (i, tier) in ["swapped_host", "swapped_nvme", "swapped_remote"].iter().enumerate() {
            let n = c.tier_used_bytes[i] / c.block_bytes.max(1);
            self.blocks.with_label_values(&[tier]).set(n as i64);
        }
        // The engine's counters only grow: bring each Prometheus counter up to them.
        let up = fastlane_daemon::metrics::set_total;
        up(&self.preemptions, &["swap"], c.preempt_swap);
        up(&self.preemptions, &["recompute"], c.preempt_recompute);
        for (i, tier) in ["host", "nvme", "remote"].iter().enumerate() {
            up(&self.swap_bytes, &["out", tier], c.swap_out_bytes_by_tier[i]);
        }
        up(&self.swap_bytes, &["in", "all"], c.swap_in_bytes);
        up(&self.steps, &[], c.steps);
        up(&self.steps_aborted, &[], c.steps_aborted);
        up(&self.accept_holds, &["step"], c.accept_hold_steps);
        up(&self.accept_holds, &["accept"], c.accepts_held);
        up(&self.tier_steps, &["separate"], c.tier_separate_steps);
        up(&self.tier_steps, &["released"], c.tier_released_steps);
        up(&self.tier_steps, &["mixed_capped"], c.tier_mixed_capped_steps);
        up(&self.protect_steps, &["capped"], c.protect_capped_steps);
        up(&self.protect_steps, &["released"], c.protect_released_steps);
        up(&self.prefix_reused_tokens, &[], c.prefix_reused_tokens);
        if let Some(p) = &c.prefix_cache {
            up(&self.prefix_blocks, &["host_hit"], p.host_hits);
            up(&self.prefix_blocks, &["nvme_hit"], p.nvme_hits);
            up(&self.prefix_blocks, &["cluster_hit"], p.cluster_hits);
            up(&self.prefix_blocks, &["miss"], p.misses);
            up(&self.prefix_blocks, &["integrity_miss"], p.integrity_misses);
            self.prefix_cache_blocks.with_label_values::<&str>(&[]).set(p.host_blocks as i64);
            if c.prefix_cluster {
                up(&self.prefix_cluster_puts, &["stored"], p.cluster_puts);
                up(&self.prefix_cluster_puts, &["dropped"], p.puts_dropped);
                up(&self.prefix_cluster_puts, &["error"], p.put_errors);
                up(&self.prefix_cluster_bytes, &["out"], p.bytes_out);
                up(&self.prefix_cluster_bytes, &["in"], p.bytes_in);
                up(&self.prefix_cluster_errors, &[], p.cluster_errors);
            }
        }
        self.front.render()
    }
}
