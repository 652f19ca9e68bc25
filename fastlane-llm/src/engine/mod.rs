//! The engine loop: one thread runs `Scheduler::schedule` → one batched forward pass over
//! the plan's decodes and prefill chunks → sampling → `complete_step`, on the wall clock.
//! Requests come in and tokens go out over channels; preemption goes through a real
//! [`fastlane_kvswap::SwapEngine`] on the model's KV pool ([`crate::port::EnginePort`]) or by
//! recompute, chosen with costs measured on this engine. With preemptible steps
//! ([`EngineConfig::preemptible_steps`]) a forward pass is given up between layers when an
//! interactive-tier request arrives, and the step is planned again with it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fastlane_kvswap::{
    BlockId, BlockKey, ChecksumMode, ModelDigest, PrefixStats, PrefixStore, SeqId, SwapEngine,
};
use fastlane_sched::{
    Admission, Overflow, Policy, PreemptCosts, PreemptMode, RejectReason, Request, SchedConfig,
    SchedEvent, Scheduler, SeqCounts, StepKind, StepPlan, TenantConfig, Tier,
};
use rand::{Rng, SeedableRng};

use crate::error::LlmError;
use crate::kv::KvPool;
use crate::model::{BatchItem, Forward, Model, Scratch, TOKENS_PER_BLOCK};
use crate::port::{EnginePort, PortStats};
use crate::sampling::{Sampled, Sampler, SamplingParams, TokenLogprobs};
use crate::tokenizer::TextStream;

mod boost;
mod setup;
mod step;

pub use setup::{block_digest, prefix_keys};
use setup::{
    costs_for, lookup_loop, measure_attention_context, measure_prefill_ns_per_token,
    measure_swap_ns_per_byte, prefix_store, tenant_digests,
};
use step::Loop;

/// How a preempted sequence gives up its blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreemptChoice {
    /// Swap or recompute, whichever the measured costs say is cheaper.
    Auto,
    /// Always swap (when the tiers have room).
    Swap,
    /// Always recompute.
    Recompute,
}

impl std::str::FromStr for PreemptChoice {
    type Err = LlmError;
    fn from_str(s: &str) -> Result<Self, LlmError> {
        match s {
            "auto" => Ok(PreemptChoice::Auto),
            "swap" => Ok(PreemptChoice::Swap),
            "recompute" => Ok(PreemptChoice::Recompute),
            o => Err(LlmError::BadRequest {
                reason: format!("preempt mode {o:?}: auto, swap or recompute"),
            }),
        }
    }
}

/// Engine settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Scheduling policy.
    pub policy: Policy,
    /// KV blocks in the device pool ([`TOKENS_PER_BLOCK`] tokens each).
    pub device_blocks: u32,
    /// Prefill chunk in tokens (`None`: whole prompts).
    pub chunk_tokens: Option<u32>,
    /// Token budget of a step.
    pub batch_tokens_max: u32,
    /// Sequences in a step at most.
    pub batch_seqs_max: u32,
    /// Blocks kept free when a sequence starts.
    pub watermark_blocks: u32,
    /// The swap tiers (host bytes, NVMe file, remote pool); its checksum mode guards blocks.
    pub swap: fastlane_kvswap::EngineConfig,
    /// Tenants; empty: one interactive tenant `default` with no rate limit.
    pub tenants: Vec<TenantConfig>,
    /// Swap, recompute, or measured choice.
    pub preempt: PreemptChoice,
    /// Streams longer than this are ended (the fence).
    pub stream_ns_max: Option<u64>,
    /// Test and operator hook: at each step boundary, with this probability, preempt one
    /// running sequence chosen by a generator seeded with `.1`.
    pub chaos: Option<(f64, u64)>,
    /// Prefix reuse: the content-addressed block cache (host LRU, optional cluster tier).
    pub prefix: PrefixConfig,
    /// Latency protection of under-rate interactive tenants (`fastlane_sched::ProtectConfig`;
    /// gives up work conservation while their prefill is in the step). Off by default.
    pub protect: Option<fastlane_sched::ProtectConfig>,
    /// How the interactive and batch tiers share a step (`fastlane_sched::TierSteps`): by
    /// default a step with an interactive prefill carries no batch work (on a CPU every row
    /// lengthens the step), bounded by a 500 ms starvation limit.
    pub tier_steps: fastlane_sched::TierSteps,
    /// Under `tier_steps` separate: the batch tier's work in a step that carries interactive
    /// work, in linear-token equivalents (`fastlane_sched::SchedConfig::mixed_batch_tokens`;
    /// the model's shape prices a long context's token). `None` (the default; `llm serve`
    /// sets 8): no bound but the step's token budget.
    pub mixed_batch_tokens: Option<u32>,
    /// Preemptible steps: when an interactive-tier request is submitted while a step's
    /// forward pass runs, and that step holds no interactive-tier prefill, the pass is given
    /// up between two layers or halfway through one (its work discarded) and the next step is planned with the new
    /// request in it. After a step given up, the next one runs to its end. Off by default.
    pub preemptible_steps: bool,
    /// Test hook (with `preemptible_steps`): every `.0`-th step that may be given up is given
    /// up at check `.1` of its forward pass (`2 * l`: before layer `l`; `2 * l + 1`: halfway
    /// through it; the last check when beyond), as if an interactive request had arrived then.
    pub force_step_aborts: Option<(u32, usize)>,
    /// Fault injection (tests; `llm serve --fault-engine-exit-after-steps`): the engine
    /// thread ends with an error after this many steps, as it would on a fatal fault.
    pub exit_after_steps: Option<u64>,
    /// Held while a step's forward pass carries a protected tenant's prefill (`llm serve
    /// --hold-accepts`): the listener in the same process accepts no new connection until
    /// the pass ends, so a flood of them does not share the core with that step.
    pub accept_hold: Option<&'static fastlane_daemon::http::AcceptHold>,
    /// With latency protection: the nice value of the engine thread and the compute pool's
    /// threads while a step's forward pass carries a protected tenant's prefill (`llm serve
    /// --protected-nice`; needs `CAP_SYS_NICE`, else off with a warning). `None`: never changed.
    pub protected_nice: Option<i32>,
}

/// Prefix reuse settings (see `docs/llm.md`, "Prefix reuse").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixConfig {
    /// Look up and store prompt blocks at all.
    pub enabled: bool,
    /// Bytes of KV blocks the in-process host cache holds at most.
    pub host_bytes: usize,
    /// Redis Cluster nodes (`redis://host:port` or `rediss://host:port`) of the shared
    /// tier; empty: host cache only.
    pub cluster: Vec<String>,
    /// The cluster's `AUTH` credentials and TLS CA (`fastlane_kvswap::cluster_access`).
    pub cluster_access: fastlane_kvswap::ClusterAccess,
    /// Key prefix in the cluster.
    pub cluster_namespace: String,
    /// Bound on one cluster call (lookups wait at most this long).
    pub cluster_timeout: Duration,
    /// The NVMe tier under the host cache (a file of block slots; blocks the host cache
    /// evicts are written there in the background); `None`: none.
    pub nvme: Option<fastlane_kvswap::PrefixNvmeConfig>,
    /// The namespace each tenant's blocks are keyed in, by tenant index (tenants with the
    /// same namespace share blocks, no others do); empty: each tenant's name (`default`
    /// without tenants: one namespace). Otherwise one per tenant.
    pub tenant_namespaces: Vec<String>,
}

impl Default for PrefixConfig {
    fn default() -> Self {
        PrefixConfig {
            enabled: true,
            host_bytes: 256 << 20,
            cluster: Vec::new(),
            cluster_access: fastlane_kvswap::ClusterAccess::default(),
            cluster_namespace: "fastlane-kv".into(),
            cluster_timeout: Duration::from_millis(250),
            nvme: None,
            tenant_namespaces: Vec::new(),
        }
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            policy: Policy::Fifo,
            device_blocks: 512,
            chunk_tokens: Some(256),
            batch_tokens_max: 512,
            batch_seqs_max: 256,
            watermark_blocks: 1,
            swap: fastlane_kvswap::EngineConfig {
                host_bytes: 256 << 20,
                checksum: ChecksumMode::Fast,
                ..fastlane_kvswap::EngineConfig::default()
            },
            tenants: Vec::new(),
            preempt: PreemptChoice::Auto,
            stream_ns_max: None,
            chaos: None,
            protect: None,
            tier_steps: fastlane_sched::TierSteps::SEPARATE,
            mixed_batch_tokens: None,
            prefix: PrefixConfig::default(),
            preemptible_steps: false,
            force_step_aborts: None,
            exit_after_steps: None,
            accept_hold: None,
            protected_nice: None,
        }
    }
}

/// One generation request.
#[derive(Debug, Clone)]
pub struct GenRequest {
    /// Prompt token ids (BOS included if the model wants one).
    pub prompt: Vec<u32>,
    /// Tokens to generate at most.
    pub max_tokens: u32,
    /// Greedy or sampled.
    pub sampling: SamplingParams,
    /// Stop when the text contains one of these (the stop string is not returned).
    pub stop: Vec<String>,
    /// Stop after one of these token ids (it is returned).
    pub stop_token_ids: Vec<u32>,
    /// Do not stop at the model's end-of-sequence token.
    pub ignore_eos: bool,
    /// Tenant index (into [`EngineConfig::tenants`]).
    pub tenant: usize,
    /// Fold the bits of every logits row a token was sampled from into
    /// [`Finished::logits_digest`] (tests: batch invariance down to the last bit).
    pub digest_logits: bool,
}

impl GenRequest {
    /// A greedy request for `max_tokens` tokens.
    pub fn greedy(prompt: Vec<u32>, max_tokens: u32) -> GenRequest {
        GenRequest {
            prompt,
            max_tokens,
            sampling: SamplingParams::default(),
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: true,
            tenant: 0,
            digest_logits: false,
        }
    }
}

/// Why a stream ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// `max_tokens` reached.
    Length,
    /// A stop string, stop token or end-of-sequence token.
    Stop,
    /// Aborted by the caller.
    Abort,
    /// Ended by the max-stream-duration fence.
    Fenced,
    /// Refused: it can never run here (bigger than the KV pool); the text says why.
    Rejected,
    /// Refused at admission: its tenant's token bucket is empty (HTTP 429).
    RateLimited,
    /// Refused at admission: its tenant's router queue is full (HTTP 503).
    QueueFull,
    /// The engine failed or shut down.
    Error,
}

/// The end of a stream.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Finished {
    /// Why.
    pub reason: FinishReason,
    /// Every generated token id.
    pub token_ids: Vec<u32>,
    /// Their text (a stop string and what follows it removed).
    pub text: String,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Submission → first token, ns (`None` if none came).
    pub ttft_ns: Option<u64>,
    /// Times this request was preempted.
    pub preemptions: u32,
    /// FNV-1a of the logits bits (when [`GenRequest::digest_logits`]).
    pub logits_digest: Option<u64>,
}

/// What a stream receives.
#[derive(Debug, Clone)]
pub enum StreamEvent {
    /// A new token and the text it completes (may be empty mid-UTF-8).
    Token {
        /// Token id.
        id: u32,
        /// New text.
        text: String,
        /// Its log-probabilities, when the request asked for them.
        logprobs: Option<TokenLogprobs>,
    },
    /// The last event.
    Done(Finished),
}

/// A submitted request's stream.
#[derive(Debug)]
///
/// The request keeps its tenant's admission slot until the stream is dropped (after its last
/// event was read, or when the reader gives up), not just until its last token is generated:
/// a front end's stream holds the slot until the last token is written to the client.
pub struct Stream {
    /// Request id (for [`Engine::abort`]).
    pub id: u64,
    rx: flume::Receiver<StreamEvent>,
    engine: Sender<Command>,
}

impl Drop for Stream {
    fn drop(&mut self) {
        let _ = self.engine.send(Command::Release { id: self.id });
    }
}

impl Stream {
    /// The next event, waiting at most `timeout`.
    pub fn next(&self, timeout: Duration) -> Option<StreamEvent> {
        self.rx.recv_timeout(timeout).ok()
    }

    /// The next event, for async callers (`None` once the engine has dropped the stream).
    pub async fn next_async(&self) -> Option<StreamEvent> {
        self.rx.recv_async().await.ok()
    }

    /// The next event if one is there, without waiting.
    pub fn try_next(&self) -> Option<StreamEvent> {
        self.rx.try_recv().ok()
    }

    /// Waits for the end (at most `timeout`), dropping token events.
    pub fn wait(&self, timeout: Duration) -> Result<Finished, LlmError> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(StreamEvent::Done(f)) => return Ok(f),
                Ok(StreamEvent::Token { .. }) => {}
                Err(flume::RecvTimeoutError::Timeout) => {
                    return Err(LlmError::Stopped {
                        reason: format!("request {} timed out", self.id),
                    })
                }
                Err(flume::RecvTimeoutError::Disconnected) => {
                    return Err(LlmError::Stopped { reason: "engine thread exited".into() })
                }
            }
        }
    }
}

/// The engine's counters.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct EngineCounters {
    /// Steps run.
    pub steps: u64,
    /// Rows computed (prefill + decode tokens).
    pub rows: u64,
    /// Prefill tokens computed (recomputation included).
    pub prefill_tokens: u64,
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Preemptions by swap.
    pub preempt_swap: u64,
    /// Preemptions by recompute.
    pub preempt_recompute: u64,
    /// Bytes swapped out / in (all tiers).
    pub swap_out_bytes: u64,
    /// See `swap_out_bytes`.
    pub swap_in_bytes: u64,
    /// Bytes swapped out per tier they landed in: host, NVMe, remote.
    pub swap_out_bytes_by_tier: [u64; 3],
    /// Bytes held in each tier now (host, NVMe, remote).
    pub tier_used_bytes: [u64; 3],
    /// Bytes spilled from host to NVMe or remote.
    pub spilled_bytes: u64,
    /// Swaps that failed (sequence recomputed).
    pub swap_failures: u64,
    /// KV blocks whose checksum did not match on the way back (sequence recomputed).
    pub checksum_mismatches: u64,
    /// Requests finished, by reason.
    pub finished: u64,
    /// Requests aborted.
    pub aborted: u64,
    /// Requests rejected at admission.
    pub rejected: u64,
    /// Time in forward passes of completed steps, ns.
    pub forward_ns: u64,
    /// Steps whose forward pass was given up for an interactive arrival (preemptible
    /// steps); not counted in `steps`, `rows`, `forward_ns` or the step histograms.
    pub steps_aborted: u64,
    /// Time spent in the forward passes of those steps (work discarded), ns.
    pub aborted_forward_ns: u64,
    /// Steps that held the listener's accepts ([`EngineConfig::accept_hold`]).
    pub accept_hold_steps: u64,
    /// Accepts that waited for such a step ([`fastlane_daemon::http::AcceptHold::waits`]).
    pub accepts_held: u64,
    /// `--tier-steps separate`: steps planned with an interactive prefill and without the
    /// batch-tier work that waited.
    pub tier_separate_steps: u64,
    /// `--tier-steps separate`: steps planned shared because batch work had waited for the
    /// hold bound.
    pub tier_released_steps: u64,
    /// `--tier-steps separate`: steps that carried interactive work and so at most
    /// `--mixed-batch-tokens` of the batch work that waited.
    pub tier_mixed_capped_steps: u64,
    /// Latency protection: steps planned with a protected tenant's prefill and the other
    /// tenants' work held back (`--protect`).
    pub protect_capped_steps: u64,
    /// Latency protection: steps planned work-conserving because the others' work had been
    /// held back for the hold bound.
    pub protect_released_steps: u64,
    /// KV blocks free in the pool now.
    pub blocks_free: u32,
    /// KV blocks in the pool.
    pub blocks_total: u32,
    /// Sequences live now.
    pub live: u64,
    /// Prefill cost per token the cost model uses now, ns.
    pub prefill_ns_per_token: f64,
    /// Swap cost per byte the cost model uses now, ns.
    pub swap_ns_per_byte: f64,
    /// Live sequences by state (router queue, waiting, running, swapping, swapped out).
    #[serde(skip)]
    pub seqs: SeqCounts,
    /// Requests waiting at the router, per tenant (index order).
    pub queued_by_tenant: Vec<usize>,
    /// Bytes of one KV block.
    pub block_bytes: u64,
    /// Prefix reuse: requests that started with cached blocks.
    pub prefix_hit_requests: u64,
    /// Prefix reuse: prompt tokens loaded from the cache instead of prefilled.
    pub prefix_reused_tokens: u64,
    /// [`EngineCounters::prefix_reused_tokens`] per tenant (index order; shorter when the
    /// last tenants reused nothing yet).
    pub prefix_reused_tokens_by_tenant: Vec<u64>,
    /// Prefix reuse: prompt blocks copied into the cache after the step that completed them.
    pub prefix_stored_blocks: u64,
    /// Prefix reuse: whether a cluster tier backs the host cache.
    pub prefix_cluster: bool,
    /// Prefix reuse: the block store's counters (`None`: prefix reuse off).
    pub prefix_cache: Option<PrefixStats>,
}

/// Histograms the engine thread observes as it goes (atomic updates, no lock); the HTTP
/// front end registers them with its Prometheus registry.
#[derive(Debug, Clone)]
pub struct EngineHistograms {
    /// Wall time of a step's forward pass, seconds.
    pub step_seconds: prometheus::Histogram,
    /// Tokens (rows) in a step's batch: decodes plus prefill chunk tokens.
    pub batch_tokens: prometheus::Histogram,
    /// Sequences in a step's batch.
    pub batch_sequences: prometheus::Histogram,
    /// Swap durations by direction (`out`, `in`), start to completion seen at a step
    /// boundary, seconds.
    pub swap_seconds: prometheus::HistogramVec,
    /// Wall time of one request's prefix lookup on the lookup thread (host cache, then the
    /// cluster tier from the first host miss on), seconds. Its sum over a run, against
    /// `PrefixStats::bytes_in`, is the rate the cluster tier delivered blocks at.
    pub prefix_lookup_seconds: prometheus::Histogram,
    /// A request's submission to its first token sent by the engine thread, by tenant
    /// (`default` without tenants), seconds: the engine's part of the TTFT (queue, steps,
    /// preemption), without the HTTP side's.
    pub first_token_seconds: prometheus::HistogramVec,
}

impl EngineHistograms {
    fn new() -> EngineHistograms {
        let h = |name: &str, help: &str, buckets: Vec<f64>| {
            prometheus::Histogram::with_opts(
                prometheus::HistogramOpts::new(name, help).buckets(buckets),
            )
        };
        let secs = vec![
            0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06,
            0.075, 0.1, 0.15, 0.2, 0.25, 0.5, 1.0, 2.5,
        ];
        let sizes = vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0];
        // The names, help strings and buckets are constants prometheus accepts.
        #[allow(clippy::expect_used)]
        let first_token_seconds = prometheus::HistogramVec::new(
            prometheus::HistogramOpts::new(
                "fastlane_llm_engine_first_token_seconds",
                "A request's submission to its first token sent by the engine, by tenant",
            )
            .buckets(vec![
                0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04,
                0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0,
            ]),
            &["tenant"],
        )
        .expect("valid histogram");
        #[allow(clippy::expect_used)]
        let h = EngineHistograms {
            step_seconds: h(
                "fastlane_llm_engine_step_seconds",
                "Wall time of an engine step's forward pass",
                secs.clone(),
            )
            .expect("valid histogram"),
            batch_tokens: h(
                "fastlane_llm_engine_batch_tokens",
                "Tokens in a step's batch (decodes + prefill chunks)",
                sizes.clone(),
            )
            .expect("valid histogram"),
            batch_sequences: h(
                "fastlane_llm_engine_batch_sequences",
                "Sequences in a step's batch",
                sizes,
            )
            .expect("valid histogram"),
            swap_seconds: prometheus::HistogramVec::new(
                prometheus::HistogramOpts::new(
                    "fastlane_llm_swap_seconds",
                    "Duration of a KV swap, by direction",
                )
                .buckets(secs),
                &["direction"],
            )
            .expect("valid histogram"),
            prefix_lookup_seconds: h(
                "fastlane_llm_prefix_lookup_seconds",
                "Wall time of one request's prefix-cache lookup (host cache, then the cluster tier)",
                vec![
                    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                    0.5, 1.0,
                ],
            )
            .expect("valid histogram"),
            first_token_seconds,
        };
        // Both directions exist from the start (a dashboard query finds them before any swap).
        for dir in ["out", "in"] {
            let _ = h.swap_seconds.with_label_values(&[dir]);
        }
        h
    }
}

/// A request's prefix: the keys of its full prompt blocks and the leading blocks found.
#[derive(Default)]
struct PrefixHit {
    keys: Vec<BlockKey>,
    blocks: Vec<Arc<[u8]>>,
}

/// Steps given up in a row at most: the step after one given up runs to its end, so a
/// stream of interactive arrivals cannot keep the batch tier from progressing.
const STEP_ABORTS_IN_ROW_MAX: u32 = 1;

/// Preemptible steps: interactive-tier submissions, counted by the thread that sends them to
/// the engine thread (`Engine::submit`, or the prefix lookup thread when there is one) right
/// after the send. The engine thread counts the ones it has drained; more sent than drained
/// means an interactive request waits in the channel. (A flag raised by the sender and
/// cleared at the drain would race: raised just after the drain that took its command, it
/// would give up a step for a request already planned.)
///
/// With latency protection the submissions of tenants protected at the last step (under
/// their rate: `Scheduler::protected_tenants`) are counted apart too, so that a step
/// carrying only unprotected tenants' prefill — the same tier's flooder — is given up for
/// them. Whether a submission counted as protected travels in its command: sender and
/// drainer count the same ones even when the flag changes in between.
#[derive(Debug)]
struct Arrivals {
    /// Tenant index → whether it is in the interactive tier.
    interactive: Vec<bool>,
    /// Tenant index → whether it was protected at the last step (written by the engine
    /// thread after each plan).
    protected: Vec<AtomicBool>,
    /// Interactive-tier submissions sent to the engine thread so far.
    sent: AtomicU64,
    /// Submissions sent as protected so far.
    sent_protected: AtomicU64,
    /// `--protected-nice`: raised by the sender of a protected submission, so that the pass
    /// in flight reaches its abort check without waiting behind the HTTP workers (set by the
    /// engine thread when it starts the boost).
    boost: std::sync::OnceLock<Arc<boost::Boost>>,
}

impl Arrivals {
    fn is_interactive(&self, tenant: usize) -> bool {
        self.interactive.get(tenant).copied().unwrap_or(false)
    }

    /// Whether a submission of `tenant` sent now counts as protected.
    fn is_protected(&self, tenant: usize) -> bool {
        self.protected.get(tenant).is_some_and(|p| p.load(Ordering::Relaxed))
    }

    fn set_boost(&self, b: Arc<boost::Boost>) {
        let _ = self.boost.set(b);
    }

    /// After a Submit of `tenant`'s request went into the engine thread's channel;
    /// `protected` is what its command carries.
    fn sent(&self, tenant: usize, protected: bool) {
        // Release: pairs with the Acquire loads in the engine thread's abort check, so the
        // command sent before this is in the channel when that load sees the count.
        if protected {
            self.sent_protected.fetch_add(1, Ordering::Release);
            if let Some(b) = self.boost.get() {
                b.raise();
            }
        }
        if self.is_interactive(tenant) {
            self.sent.fetch_add(1, Ordering::Release);
        }
    }
}

// Nearly every command is a `Submit`: boxing its request would only add an allocation.
#[allow(clippy::large_enum_variant)]
enum Command {
    Submit {
        id: u64,
        req: GenRequest,
        tx: flume::Sender<StreamEvent>,
        at: Instant,
        prefix: PrefixHit,
        /// Counted as a protected tenant's arrival (`Arrivals::sent_protected`).
        protected: bool,
    },
    Abort {
        id: u64,
    },
    /// The stream was dropped: its finished request gives back its admission slot.
    Release {
        id: u64,
    },
    Shutdown,
}

/// Live requests with no turn of the engine loop for this long make the engine
/// [`EngineHealth::Stalled`].
pub const STALL_AFTER: Duration = Duration::from_secs(30);

/// What [`Engine::health`] finds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineHealth {
    /// The engine thread runs: idle, or its loop turned within [`STALL_AFTER`].
    Ok,
    /// The engine thread (or its prefix lookup thread) has ended: no request can be served.
    Dead,
    /// Requests are live but the loop has not turned for this long (a step that does not
    /// end).
    Stalled(Duration),
}

/// The engine loop's heartbeat: when its last turn began and how many requests were live.
#[derive(Debug, Default)]
pub(crate) struct Beat {
    at_ns: AtomicU64,
    live: AtomicU64,
    /// Set when the loop has ended, before its streams get their last events.
    ended: std::sync::atomic::AtomicBool,
}

/// A running engine.
#[derive(Debug)]
pub struct Engine {
    start: Instant,
    beat: Arc<Beat>,
    tx: Sender<Command>,
    thread: Option<JoinHandle<Result<(), LlmError>>>,
    next_id: AtomicU64,
    counters: Arc<Mutex<EngineCounters>>,
    histograms: EngineHistograms,
    model: Arc<Model>,
    prefix: Option<Arc<PrefixStore>>,
    lookup: Option<JoinHandle<()>>,
    /// Preemptible steps without a lookup thread: `submit` counts interactive arrivals.
    arrivals: Option<Arc<Arrivals>>,
}

struct Live {
    req: GenRequest,
    generated: Vec<u32>,
    sampler: Sampler,
    tx: flume::Sender<StreamEvent>,
    text: String,
    stream: TextStream,
    arrived: Instant,
    ttft_ns: Option<u64>,
    preemptions: u32,
    digest: u64,
    /// Keys of the full prompt blocks (empty: prefix reuse off).
    keys: Vec<BlockKey>,
    /// Cached blocks to load into the first blocks before the first prefill.
    load: Vec<Arc<[u8]>>,
    /// Prompt tokens covered by `load` (where the first prefill starts).
    cached_tokens: u32,
    /// Leading prompt blocks known to be in the cache (loaded from it or stored).
    stored_blocks: usize,
}

impl Engine {
    /// Starts the engine thread on `model` (measures the preemption costs first).
    pub fn start(model: Arc<Model>, cfg: EngineConfig) -> Result<Engine, LlmError> {
        Engine::start_inner(model, cfg, None)
    }

    /// [`Engine::start`] with caller-built NVMe/remote tiers (tests inject faulty ones).
    pub fn start_with_tiers(
        model: Arc<Model>,
        cfg: EngineConfig,
        tiers: fastlane_kvswap::CustomTiers,
    ) -> Result<Engine, LlmError> {
        Engine::start_inner(model, cfg, Some(tiers))
    }

    fn start_inner(
        model: Arc<Model>,
        cfg: EngineConfig,
        tiers: Option<fastlane_kvswap::CustomTiers>,
    ) -> Result<Engine, LlmError> {
        let geom = model.kv_geometry();
        let pool = KvPool::new(&geom, cfg.device_blocks)?;
        let device: Arc<dyn fastlane_kvswap::DeviceMemory> = pool.memory().clone();
        let swap = match tiers {
            Some(t) => SwapEngine::with_tiers(cfg.swap.clone(), device, t)?,
            None => SwapEngine::new(cfg.swap.clone(), device)?,
        };
        let tenants = if cfg.tenants.is_empty() {
            vec![TenantConfig {
                name: "default".into(),
                tier: Tier::Interactive,
                bucket_capacity: 1e12,
                rpm: 1e12,
                concurrency_max: u32::MAX,
                weight: 1,
                overflow: Overflow::Queue { depth_max: 1 << 20 },
            }]
        } else {
            cfg.tenants.clone()
        };
        let mut scratch = Scratch::default();
        let prefill_ns = measure_prefill_ns_per_token(&model, &pool, &mut scratch)?;
        let swap_ns = measure_swap_ns_per_byte(crate::kv::block_bytes(&geom));
        let costs = costs_for(cfg.preempt, prefill_ns, swap_ns, crate::kv::block_bytes(&geom));
        let flop_attention = model.config().attention_context();
        let measured_attention = measure_attention_context(&model, &pool, &mut scratch)?;
        let attention_context = measured_attention.unwrap_or(flop_attention);
        log::info!(
            "engine: attention context {attention_context} tokens ({}; the FLOP estimate is {flop_attention})",
            if measured_attention.is_some() { "measured" } else { "not measurable on this pool" }
        );
        log::info!(
            "engine: model {} ({} parameters), {} KV blocks of {} bytes, policy {}, prefill {:.0} ns/token, swap {:.3} ns/byte (measured)",
            model.name(),
            model.config().parameters(),
            cfg.device_blocks,
            crate::kv::block_bytes(&geom),
            cfg.policy,
            prefill_ns,
            swap_ns
        );
        let sched_cfg = SchedConfig {
            policy: cfg.policy,
            kv_blocks: cfg.device_blocks,
            watermark_blocks: cfg.watermark_blocks,
            chunk_tokens: cfg.chunk_tokens,
            batch_tokens_max: cfg.batch_tokens_max,
            batch_seqs_max: cfg.batch_seqs_max,
            drr_quantum_tokens: u64::from(cfg.chunk_tokens.unwrap_or(256)),
            stream_ns_max: cfg.stream_ns_max,
            preempt: costs,
            protect: cfg.protect,
            tier_steps: cfg.tier_steps,
            mixed_batch_tokens: cfg.mixed_batch_tokens,
            attention_context,
        };
        let prefix =
            if cfg.prefix.enabled { Some(Arc::new(prefix_store(&cfg, &geom)?)) } else { None };
        // Each tenant's digest, computed once: the lookup thread picks one by index.
        let digests = tenant_digests(&model, &tenants, &cfg.prefix.tenant_namespaces)?;
        let arrivals = cfg.preemptible_steps.then(|| {
            Arc::new(Arrivals {
                interactive: tenants.iter().map(|t| t.tier == Tier::Interactive).collect(),
                protected: tenants.iter().map(|_| AtomicBool::new(false)).collect(),
                sent: AtomicU64::new(0),
                sent_protected: AtomicU64::new(0),
                boost: std::sync::OnceLock::new(),
            })
        });
        let histograms = EngineHistograms::new();
        // Each tenant's first-token series, looked up once.
        let first_token: Vec<prometheus::Histogram> = tenants
            .iter()
            .map(|t| histograms.first_token_seconds.with_label_values(&[&t.name]))
            .collect();
        let port = EnginePort::new(swap).with_histogram(histograms.swap_seconds.clone());
        let mut sched = Scheduler::new(sched_cfg, tenants, port)?;
        sched.hold_slots_until_released();
        let (tx, rx) = mpsc::channel();
        let counters = Arc::new(Mutex::new(EngineCounters {
            blocks_total: cfg.device_blocks,
            blocks_free: cfg.device_blocks,
            prefill_ns_per_token: prefill_ns,
            swap_ns_per_byte: swap_ns,
            block_bytes: crate::kv::block_bytes(&geom) as u64,
            prefix_cluster: prefix.as_ref().is_some_and(|p| p.has_cluster()),
            ..EngineCounters::default()
        }));
        let start = Instant::now();
        let beat = Arc::new(Beat::default());
        let mut lp = Loop {
            model: model.clone(),
            pool,
            sched,
            scratch,
            rx,
            live: HashMap::new(),
            counters: counters.clone(),
            histograms: histograms.clone(),
            local: EngineCounters {
                block_bytes: crate::kv::block_bytes(&geom) as u64,
                prefix_cluster: prefix.as_ref().is_some_and(|p| p.has_cluster()),
                ..EngineCounters::default()
            },
            prefix: prefix.clone(),
            start,
            beat: beat.clone(),
            cfg,
            prefill_ns,
            swap_ns,
            eos: model.config().eos_ids(),
            chaos: None,
            arrivals: arrivals.clone(),
            interactive_seen: 0,
            first_token,
            protected_seen: 0,
            aborts_in_row: 0,
            abortable_steps: 0,
            boost: None,
        };
        lp.local.prefill_ns_per_token = prefill_ns;
        lp.local.swap_ns_per_byte = swap_ns;
        lp.chaos = lp.cfg.chaos.map(|(_, seed)| rand_chacha::ChaCha8Rng::seed_from_u64(seed));
        let thread = std::thread::Builder::new()
            .name("fastlane-llm-engine".into())
            .spawn(move || lp.run())
            .map_err(|e| LlmError::Stopped { reason: format!("spawn: {e}") })?;
        // With prefix reuse, commands pass through a lookup thread that finds each new
        // request's cached blocks (host cache, then the cluster: network I/O the engine
        // thread must not wait on) and forwards every command in order.
        let (tx, lookup) = match &prefix {
            Some(store) => {
                let (ltx, lrx) = mpsc::channel::<Command>();
                let store = store.clone();
                let seconds = histograms.prefix_lookup_seconds.clone();
                let arrivals = arrivals.clone();
                let t = std::thread::Builder::new()
                    .name("fastlane-llm-prefix".into())
                    .spawn(move || {
                        lookup_loop(&lrx, &tx, &store, &digests, &seconds, arrivals.as_deref())
                    })
                    .map_err(|e| LlmError::Stopped { reason: format!("spawn: {e}") })?;
                (ltx, Some(t))
            }
            None => (tx, None),
        };
        let arrivals = if lookup.is_some() { None } else { arrivals };
        Ok(Engine {
            start,
            beat,
            tx,
            thread: Some(thread),
            next_id: AtomicU64::new(1),
            counters,
            histograms,
            model,
            prefix,
            lookup,
            arrivals,
        })
    }

    /// Whether the engine can serve: its threads alive and, with requests live, its loop
    /// turning (`/health`, `/livez` and `/readyz` of `llm serve` answer from this).
    pub fn health(&self) -> EngineHealth {
        let ended = |t: &Option<JoinHandle<_>>| t.as_ref().is_some_and(JoinHandle::is_finished);
        if self.beat.ended.load(Ordering::Acquire)
            || self.thread.as_ref().is_none_or(JoinHandle::is_finished)
            || ended(&self.lookup)
        {
            return EngineHealth::Dead;
        }
        if self.beat.live.load(Ordering::Relaxed) == 0 {
            return EngineHealth::Ok;
        }
        let now = self.start.elapsed().as_nanos() as u64;
        let since =
            Duration::from_nanos(now.saturating_sub(self.beat.at_ns.load(Ordering::Relaxed)));
        if since > STALL_AFTER {
            EngineHealth::Stalled(since)
        } else {
            EngineHealth::Ok
        }
    }

    /// The prefix cache's counters (`None`: prefix reuse off).
    pub fn prefix_stats(&self) -> Option<PrefixStats> {
        self.prefix.as_ref().map(|p| p.stats())
    }

    /// Waits (at most `timeout`) until the blocks queued for the cluster tier are stored;
    /// `true` if so (and without a cluster).
    pub fn flush_prefix(&self, timeout: Duration) -> bool {
        self.prefix.as_ref().is_none_or(|p| p.flush(timeout))
    }

    /// The model.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// The histograms the engine thread observes (step time, batch size, swap durations).
    pub fn histograms(&self) -> &EngineHistograms {
        &self.histograms
    }

    /// Submits a request; its tokens arrive on the returned stream.
    pub fn submit(&self, req: GenRequest) -> Result<Stream, LlmError> {
        req.sampling.validate()?;
        let max_pos = self.model.max_positions();
        if req.prompt.is_empty() {
            return Err(LlmError::BadRequest { reason: "empty prompt".into() });
        }
        if req.max_tokens == 0 {
            return Err(LlmError::BadRequest { reason: "max_tokens must be at least 1".into() });
        }
        let total = req.prompt.len() + req.max_tokens as usize;
        if total > max_pos {
            return Err(LlmError::BadRequest {
                reason: format!(
                    "prompt of {} tokens + max_tokens {} exceeds the context window of {max_pos}",
                    req.prompt.len(),
                    req.max_tokens
                ),
            });
        }
        if let Some(t) = req.prompt.iter().find(|&&t| t as usize >= self.model.vocab()) {
            return Err(LlmError::BadRequest {
                reason: format!("token id {t} ≥ vocab {}", self.model.vocab()),
            });
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = flume::unbounded();
        let tenant = req.tenant;
        // With a lookup thread, `arrivals` is that thread's: it decides `protected`.
        let protected = self.arrivals.as_ref().is_some_and(|a| a.is_protected(tenant));
        let at = Instant::now();
        self.tx
            .send(Command::Submit { id, req, tx, at, prefix: PrefixHit::default(), protected })
            .map_err(|_| LlmError::Stopped { reason: "engine thread exited".into() })?;
        if let Some(a) = &self.arrivals {
            a.sent(tenant, protected);
        }
        Ok(Stream { id, rx, engine: self.tx.clone() })
    }

    /// Aborts a request (its stream ends with [`FinishReason::Abort`]); within one step.
    pub fn abort(&self, id: u64) {
        let _ = self.tx.send(Command::Abort { id });
    }

    /// Aborts a request and gives its tenant's slot back now, though its [`Stream`] is still
    /// held (the fence of a stream nobody reads); within one step. Dropping the stream later
    /// does nothing more.
    pub fn abort_and_release(&self, id: u64) {
        let _ = self.tx.send(Command::Release { id });
    }

    /// A snapshot of the counters (updated after every step).
    pub fn counters(&self) -> EngineCounters {
        self.counters.lock().map(|c| c.clone()).unwrap_or_default()
    }

    /// Stops the engine (live requests end with [`FinishReason::Abort`]) and returns the
    /// final counters.
    pub fn shutdown(mut self) -> Result<EngineCounters, LlmError> {
        self.stop()?;
        Ok(self.counters())
    }

    fn stop(&mut self) -> Result<(), LlmError> {
        let _ = self.tx.send(Command::Shutdown);
        if let Some(t) = self.lookup.take() {
            let _ = t.join();
        }
        match self.thread.take() {
            Some(t) => t
                .join()
                .map_err(|_| LlmError::Stopped { reason: "engine thread panicked".into() })?,
            None => Ok(()),
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}
