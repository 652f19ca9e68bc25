//! Admission before work: a request's tenant must have a token in its bucket and room among
//! its slots and queue *before* its prompt is tokenized, and tokenization of any but a short
//! body runs on blocking threads (at most [`TOKENIZER_THREADS`] at once), not on the HTTP
//! workers. A body of at most [`Admit::with_inline_bytes`] bytes (2 KiB by default) is
//! tokenized on the worker that read it: its cost is bounded by that size, and less than the
//! hand-off to a blocking thread and back, which waits for the core twice when the core is
//! busy (docs/serving.md, "Measured under attack").
//!
//! The bucket here is the tenant's rate limit on arrivals (`rpm`, `burst`), spent when a
//! request arrives; the engine's scheduler keeps its own bucket, spent at admission, which is
//! never emptier than this one (same capacity and rate, spent no earlier), so a request
//! passed here is not refused for its rate there. The open count bounds what a tenant has
//! at the front end, tokenizing, queued or streaming: `max_concurrent + queue`, the most the
//! engine would hold for it; beyond, 503 at once. With `--policy fifo` (no gate) only the
//! tokenizer bound applies.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use fastlane_openai::api::ApiError;
use fastlane_openai::{Metrics, Tenants};
use fastlane_sched::TokenBucket;
use tokio::sync::Semaphore;

/// Prompts tokenized at once, at most (each on a blocking thread).
pub const TOKENIZER_THREADS: usize = 2;

/// The largest body tokenized on the HTTP worker by default (`--tokenize-inline-bytes`).
pub const INLINE_TOKENIZE_BYTES: usize = 2048;

/// The most `--tokenize-inline-bytes` may say.
pub const INLINE_TOKENIZE_BYTES_MAX: usize = 64 << 10;

struct TenantGate {
    bucket: Mutex<TokenBucket>,
    open: Arc<AtomicUsize>,
    open_max: usize,
    rpm: f64,
}

/// The front end's admission and tokenizer pool.
pub struct Admit {
    /// Per tenant; empty: no gate (policy fifo).
    tenants: Vec<TenantGate>,
    start: Instant,
    tokenizers: Arc<Semaphore>,
    tokenized: prometheus::IntCounter,
    inline_bytes: usize,
}

impl std::fmt::Debug for Admit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admit").field("gated", &!self.tenants.is_empty()).finish()
    }
}

/// A request's place among its tenant's open requests; given back on drop.
#[derive(Debug)]
pub struct Pass(Option<Arc<AtomicUsize>>);

impl Drop for Pass {
    fn drop(&mut self) {
        if let Some(open) = self.0.take() {
            open.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Admit {
    /// The gate of `tenants` (`gated`: the engine's policy has buckets and slots); its
    /// counter `fastlane_llm_prompts_tokenized_total` is registered in `metrics`' registry.
    pub fn new(tenants: &Tenants, gated: bool, metrics: &Metrics) -> Admit {
        let tokenized = prometheus::IntCounter::new(
            "fastlane_llm_prompts_tokenized_total",
            "Prompts tokenized (requests refused before tokenization are not)",
        );
        // A constant name, registered once per registry.
        #[allow(clippy::expect_used)]
        let tokenized = tokenized.expect("a valid counter");
        if let Err(e) = metrics.registry().register(Box::new(tokenized.clone())) {
            log::warn!("fastlane_llm_prompts_tokenized_total: {e}");
        }
        let gates = if gated {
            tenants
                .entries()
                .iter()
                .map(|e| TenantGate {
                    bucket: Mutex::new(TokenBucket::new(e.burst, e.rpm / 60.0)),
                    open: Arc::new(AtomicUsize::new(0)),
                    open_max: (e.max_concurrent as usize).saturating_add(e.queue),
                    rpm: e.rpm,
                })
                .collect()
        } else {
            Vec::new()
        };
        Admit {
            tenants: gates,
            start: Instant::now(),
            tokenizers: Arc::new(Semaphore::new(TOKENIZER_THREADS)),
            tokenized,
            inline_bytes: INLINE_TOKENIZE_BYTES,
        }
    }

    /// Bodies of at most `bytes` are tokenized on the HTTP worker (0: every body goes to the
    /// tokenizer pool); at most [`INLINE_TOKENIZE_BYTES_MAX`].
    pub fn with_inline_bytes(mut self, bytes: usize) -> Admit {
        self.inline_bytes = bytes.min(INLINE_TOKENIZE_BYTES_MAX);
        self
    }

    /// Admits a request of tenant `t` (named `name`) or refuses it, counted in `metrics`: 503
    /// when the tenant has `max_concurrent + queue` requests open, 429 when its bucket is
    /// empty.
    pub fn admit(&self, t: usize, name: &str, metrics: &Metrics) -> Result<Pass, ApiError> {
        let Some(g) = self.tenants.get(t) else { return Ok(Pass(None)) };
        let was = g.open.fetch_add(1, Ordering::AcqRel);
        let pass = Pass(Some(g.open.clone()));
        if was >= g.open_max {
            metrics.requests.with_label_values(&[name, "rejected_queue_full"]).inc();
            return Err(ApiError::queue_full(name));
        }
        let now = self.start.elapsed().as_nanos() as u64;
        let mut b = g.bucket.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if !b.has_token(now) {
            metrics.requests.with_label_values(&[name, "rejected_rate"]).inc();
            return Err(ApiError::rate_limited(name, g.rpm));
        }
        b.spend();
        Ok(pass)
    }

    /// Runs `f` (the tokenization of a body of `body_bytes`): here when the body is short
    /// ([`Admit::with_inline_bytes`]), else on a blocking thread once one of the
    /// [`TOKENIZER_THREADS`] is free (waiting costs the HTTP workers nothing).
    pub async fn tokenize<R: Send + 'static>(
        &self,
        body_bytes: usize,
        f: impl FnOnce() -> R + Send + 'static,
    ) -> Result<R, ApiError> {
        self.tokenized.inc();
        if body_bytes <= self.inline_bytes {
            return Ok(f());
        }
        let busy = || ApiError::unavailable("the tokenizer pool is gone");
        let _permit = self.tokenizers.acquire().await.map_err(|_| busy())?;
        tokio::task::spawn_blocking(f).await.map_err(|_| busy())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TENANTS: &str = r#"
[[tenant]]
name = "a"
keys = ["k"]
rpm = 0.001
burst = 2
max_concurrent = 1
queue = 1
tier = "interactive"
"#;

    #[test]
    fn the_bucket_and_the_open_count_refuse_before_any_work() {
        let tenants = Tenants::parse(TENANTS).unwrap();
        let metrics = Metrics::new().with_tenants(["a"]);
        let admit = Admit::new(&tenants, true, &metrics);
        let p1 = admit.admit(0, "a", &metrics).unwrap();
        let p2 = admit.admit(0, "a", &metrics).unwrap();
        // max_concurrent + queue = 2 open: the third is 503 whatever its bucket.
        let e = admit.admit(0, "a", &metrics).unwrap_err();
        assert_eq!(e.status().as_u16(), 503);
        drop((p1, p2));
        // Room again, but the bucket (burst 2, nearly no refill) is empty: 429.
        let e = admit.admit(0, "a", &metrics).unwrap_err();
        assert_eq!(e.status().as_u16(), 429);
        let count = |o: &str| metrics.requests.with_label_values(&["a", o]).get();
        assert_eq!((count("rejected_queue_full"), count("rejected_rate")), (1, 1));
        // Refusals gave their place back: after the two drops, nothing is open.
        assert_eq!(admit.tenants[0].open.load(Ordering::Acquire), 0);
        // Ungated (policy fifo): everything passes.
        let open = Admit::new(&tenants, false, &Metrics::new());
        for _ in 0..10 {
            open.admit(0, "a", &metrics).unwrap();
        }
    }

    #[tokio::test]
    async fn a_short_body_is_tokenized_here_a_long_one_on_the_pool() {
        let tenants = Tenants::parse(TENANTS).unwrap();
        let metrics = Metrics::new().with_tenants(["a"]);
        let here = std::thread::current().id();
        let on = |admit: Admit, bytes: usize| async move {
            admit.tokenize(bytes, || std::thread::current().id()).await.unwrap()
        };
        let admit = || Admit::new(&tenants, true, &metrics);
        assert_eq!(on(admit(), INLINE_TOKENIZE_BYTES).await, here);
        assert_ne!(on(admit(), INLINE_TOKENIZE_BYTES + 1).await, here);
        // 0: every body on the pool.
        assert_ne!(on(admit().with_inline_bytes(0), 10).await, here);
    }
}
