//! Prometheus metrics of the front end (`GET /metrics` of the router and of `llm serve`, where
//! the engine adds its own families to the same registry).

use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry,
};

/// Latency buckets, seconds: 1 ms … 120 s.
const BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

/// Buckets of the TTFT stages, seconds: 0.5 ms … 120 s, finer than [`BUCKETS`] where a
/// stage's time usually is.
const STAGE_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

/// The stages of [`Metrics::ttft_stages`], in the order a request passes them.
pub const TTFT_STAGES: [&str; 3] = ["admit", "engine", "respond"];

/// The metric families.
#[derive(Debug, Clone)]
pub struct Metrics {
    registry: Registry,
    /// Request arrival at the server → first token's bytes handed to the connection.
    pub ttft: HistogramVec,
    /// The parts of the TTFT, per tenant and stage (`llm serve` only): `admit` (arrival to
    /// the prompt tokenized: body read, bucket and slots, the tokenizer pool), `engine`
    /// (tokenized to the first token received by the request's task: the engine's queue and
    /// steps and the task's wake-up), `respond` (that to the first token handed to the
    /// connection: the response head and the body's first poll).
    pub ttft_stages: HistogramVec,
    /// Between consecutive tokens of a stream.
    pub inter_token: HistogramVec,
    /// Request arrival → last byte.
    pub e2e: HistogramVec,
    /// Requests by outcome: admitted, rejected_rate, rejected_queue_full, rejected_invalid,
    /// rejected_body (413/408), unauthorized, aborted, fenced, finished, unavailable (engine
    /// down), upstream_error (router).
    pub requests: IntCounterVec,
    /// Streams open now.
    pub streams_open: IntGaugeVec,
    /// Requests waiting at the router queue, per tenant.
    pub queue_depth: IntGaugeVec,
}

fn must<T>(r: prometheus::Result<T>) -> T {
    // The names and labels below are constants that prometheus accepts.
    #[allow(clippy::expect_used)]
    r.expect("valid metric definition")
}

/// One tenant's latency histograms, looked up once per request rather than per token.
#[derive(Debug, Clone)]
pub struct TenantLatency {
    /// See [`Metrics::ttft`].
    pub ttft: Histogram,
    /// See [`Metrics::inter_token`].
    pub inter_token: Histogram,
    /// See [`Metrics::e2e`].
    pub e2e: Histogram,
    /// See [`Metrics::ttft_stages`], in the order of [`TTFT_STAGES`] (`None` for the
    /// router, which has no such stages: its families stay without series).
    pub stages: Option<[Histogram; 3]>,
}

impl Metrics {
    /// `tenant`'s latency histograms, without the TTFT's stages (the router's).
    pub fn tenant_latency(&self, tenant: &str) -> TenantLatency {
        TenantLatency {
            ttft: self.ttft.with_label_values(&[tenant]),
            inter_token: self.inter_token.with_label_values(&[tenant]),
            e2e: self.e2e.with_label_values(&[tenant]),
            stages: None,
        }
    }

    /// `tenant`'s latency histograms with the TTFT's stages (`llm serve`'s).
    pub fn tenant_latency_with_stages(&self, tenant: &str) -> TenantLatency {
        TenantLatency {
            stages: Some(TTFT_STAGES.map(|s| self.ttft_stages.with_label_values(&[tenant, s]))),
            ..self.tenant_latency(tenant)
        }
    }

    /// Every outcome of [`Metrics::requests`].
    pub const OUTCOMES: [&'static str; 11] = [
        "admitted",
        "rejected_rate",
        "rejected_queue_full",
        "rejected_invalid",
        "rejected_body",
        "unavailable",
        "unauthorized",
        "aborted",
        "fenced",
        "finished",
        "upstream_error",
    ];

    /// The per-tenant series of these tenants exist from the start at 0 (requests by every
    /// outcome, streams open, queue depth): a dashboard or a test reads 0, not "no data",
    /// before the first request.
    pub fn with_tenants<'a>(self, tenants: impl IntoIterator<Item = &'a str>) -> Metrics {
        for t in tenants {
            for o in Self::OUTCOMES {
                let _ = self.requests.with_label_values(&[t, o]);
            }
            let _ = self.streams_open.with_label_values(&[t]);
            let _ = self.queue_depth.with_label_values(&[t]);
        }
        self
    }

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
        let ttft_stages = must(HistogramVec::new(
            HistogramOpts::new(
                "fastlane_llm_ttft_stage_seconds",
                "The TTFT's parts: admit (body, bucket, tokenizer), engine (to the first token \
                 received), respond (to its bytes handed to the connection), per tenant",
            )
            .buckets(STAGE_BUCKETS.to_vec()),
            &["tenant", "stage"],
        ));
        must(registry.register(Box::new(ttft_stages.clone())));
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
        let queue_depth = gauge(
            "fastlane_llm_queue_depth",
            "Requests waiting at the router for a slot, per tenant",
            &["tenant"],
        );
        Metrics {
            registry,
            ttft,
            ttft_stages,
            inter_token,
            e2e,
            requests,
            streams_open,
            queue_depth,
        }
    }

    /// The text exposition of every family in the registry.
    pub fn render(&self) -> String {
        fastlane_daemon::metrics::render(&self.registry)
    }

    /// The registry, for families others add (the engine's in `llm serve`).
    pub fn registry(&self) -> &Registry {
        &self.registry
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}
