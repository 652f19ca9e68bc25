//! Prometheus metrics of the front end and the engine (`GET /metrics`).

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder,
};

use crate::engine::EngineCounters;

/// Latency buckets, seconds: 1 ms … 120 s.
const BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

/// The metric families.
#[derive(Debug, Clone)]
pub struct Metrics {
    registry: Registry,
    /// Request arrival at the server → first token's bytes handed to the connection.
    pub ttft: HistogramVec,
    /// Between consecutive tokens of a stream.
    pub inter_token: HistogramVec,
    /// Request arrival → last byte.
    pub e2e: HistogramVec,
    /// Requests by outcome: admitted, rejected_rate, rejected_invalid, unauthorized, aborted,
    /// fenced, finished.
    pub requests: IntCounterVec,
    /// Streams open now.
    pub streams_open: IntGaugeVec,
    engine: IntGaugeVec,
    blocks: IntGaugeVec,
    preemptions: IntCounterVec,
    swap_bytes: IntCounterVec,
    steps: IntCounterVec,
}

fn must<T>(r: prometheus::Result<T>) -> T {
    // The names and labels below are constants that prometheus accepts.
    #[allow(clippy::expect_used)]
    r.expect("valid metric definition")
}

impl Metrics {
    /// All families, registered.
    pub fn new() -> Metrics {
        let registry = Registry::new();
        let hist = |name: &str, help: &str| {
            let h = must(HistogramVec::new(
                HistogramOpts::new(name, help).buckets(BUCKETS.to_vec()),
                &["tenant"],
            ));
            must(registry.register(Box::new(h.clone())));
            h
        };
        let ttft = hist(
            "fastlane_llm_ttft_seconds",
            "Request arrival to the first token written, per tenant",
        );
        let inter_token =
            hist("fastlane_llm_inter_token_seconds", "Gap between tokens of a stream, per tenant");
        let e2e = hist("fastlane_llm_e2e_seconds", "Request arrival to its last byte, per tenant");
        let requests = must(IntCounterVec::new(
            Opts::new("fastlane_llm_requests_total", "Requests by tenant and outcome"),
            &["tenant", "outcome"],
        ));
        must(registry.register(Box::new(requests.clone())));
        let gauge = |name: &str, help: &str, labels: &[&str]| {
            let g = must(IntGaugeVec::new(Opts::new(name, help), labels));
            must(registry.register(Box::new(g.clone())));
            g
        };
        let streams_open =
            gauge("fastlane_llm_streams_open", "Streams open now, per tenant", &["tenant"]);
        let engine = gauge("fastlane_llm_sequences", "Sequences in the engine now", &["state"]);
        let blocks = gauge("fastlane_llm_kv_blocks", "KV blocks of the device pool", &["state"]);
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
        Metrics {
            registry,
            ttft,
            inter_token,
            e2e,
            requests,
            streams_open,
            engine,
            blocks,
            preemptions,
            swap_bytes,
            steps,
        }
    }

    /// The text exposition, with the engine's counters as of now.
    pub fn render(&self, c: &EngineCounters) -> String {
        self.engine.with_label_values(&["live"]).set(c.live as i64);
        self.blocks.with_label_values(&["free"]).set(i64::from(c.blocks_free));
        self.blocks.with_label_values(&["used"]).set(i64::from(c.blocks_total - c.blocks_free));
        // The engine's counters only grow: bring each Prometheus counter up to them.
        let up = |v: &IntCounterVec, labels: &[&str], to: u64| {
            let c = v.with_label_values(labels);
            c.inc_by(to.saturating_sub(c.get()));
        };
        up(&self.preemptions, &["swap"], c.preempt_swap);
        up(&self.preemptions, &["recompute"], c.preempt_recompute);
        for (i, tier) in ["host", "nvme", "remote"].iter().enumerate() {
            up(&self.swap_bytes, &["out", tier], c.swap_out_bytes_by_tier[i]);
        }
        up(&self.swap_bytes, &["in", "all"], c.swap_in_bytes);
        up(&self.steps, &[], c.steps);
        let mut buf = Vec::new();
        // Writing text into a Vec cannot fail.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8_lossy(&buf).into_owned()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}
