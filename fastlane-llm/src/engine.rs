//! The engine loop: one thread runs `Scheduler::schedule` → one batched forward pass over
//! the plan's decodes and prefill chunks → sampling → `complete_step`, on the wall clock.
//! Requests come in and tokens go out over channels; preemption goes through a real
//! [`fastlane_kvswap::SwapEngine`] on the model's KV pool ([`crate::port::EnginePort`]) or by
//! recompute, chosen with costs measured on this engine. With preemptible steps
//! ([`EngineConfig::preemptible_steps`]) a forward pass is given up between layers when an
//! interactive-tier request arrives, and the step is planned again with it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fastlane_kvswap::{
    BlockKey, ChecksumMode, ModelDigest, PrefixStats, PrefixStore, SeqId, SwapEngine,
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
use crate::sampling::{Sampler, SamplingParams};
use crate::tokenizer::TextStream;

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
    /// Preemptible steps: when an interactive-tier request is submitted while a step's
    /// forward pass runs, and that step holds no interactive-tier prefill, the pass is given
    /// up between two layers (its work discarded) and the next step is planned with the new
    /// request in it. After a step given up, the next one runs to its end. Off by default.
    pub preemptible_steps: bool,
    /// Test hook (with `preemptible_steps`): every `.0`-th step that may be given up is given
    /// up before layer `.1` (the last layer when beyond), as if an interactive request had
    /// arrived then.
    pub force_step_aborts: Option<(u32, usize)>,
}

/// Prefix reuse settings (see `docs/llm.md`, "Prefix reuse").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixConfig {
    /// Look up and store prompt blocks at all.
    pub enabled: bool,
    /// Bytes of KV blocks the in-process host cache holds at most.
    pub host_bytes: usize,
    /// Redis Cluster nodes (`redis://host:port`) of the shared tier; empty: host cache only.
    pub cluster: Vec<String>,
    /// Key prefix in the cluster.
    pub cluster_namespace: String,
    /// Bound on one cluster call (lookups wait at most this long).
    pub cluster_timeout: Duration,
    /// The NVMe tier under the host cache (a file of block slots; blocks the host cache
    /// evicts are written there in the background); `None`: none.
    pub nvme: Option<fastlane_kvswap::PrefixNvmeConfig>,
}

impl Default for PrefixConfig {
    fn default() -> Self {
        PrefixConfig {
            enabled: true,
            host_bytes: 256 << 20,
            cluster: Vec::new(),
            cluster_namespace: "fastlane-kv".into(),
            cluster_timeout: Duration::from_millis(250),
            nvme: None,
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
            prefix: PrefixConfig::default(),
            preemptible_steps: false,
            force_step_aborts: None,
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
    /// `--tier-steps separate`: steps planned with an interactive prefill and without the
    /// batch-tier work that waited.
    pub tier_separate_steps: u64,
    /// `--tier-steps separate`: steps planned shared because batch work had waited for the
    /// hold bound.
    pub tier_released_steps: u64,
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
#[derive(Debug)]
struct Arrivals {
    /// Tenant index → whether it is in the interactive tier.
    interactive: Vec<bool>,
    /// Interactive-tier submissions sent to the engine thread so far.
    sent: AtomicU64,
}

impl Arrivals {
    fn is_interactive(&self, tenant: usize) -> bool {
        self.interactive.get(tenant).copied().unwrap_or(false)
    }

    /// After a Submit of `tenant`'s request went into the engine thread's channel.
    fn sent(&self, tenant: usize) {
        if self.is_interactive(tenant) {
            // Release: pairs with the Acquire load in the engine thread's abort check, so
            // the command sent before this is in the channel when that load sees the count.
            self.sent.fetch_add(1, Ordering::Release);
        }
    }
}

enum Command {
    Submit {
        id: u64,
        req: GenRequest,
        tx: flume::Sender<StreamEvent>,
        at: Instant,
        prefix: PrefixHit,
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

/// A running engine.
#[derive(Debug)]
pub struct Engine {
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
        };
        let prefix =
            if cfg.prefix.enabled { Some(Arc::new(prefix_store(&cfg, &geom)?)) } else { None };
        let arrivals = cfg.preemptible_steps.then(|| {
            Arc::new(Arrivals {
                interactive: tenants.iter().map(|t| t.tier == Tier::Interactive).collect(),
                sent: AtomicU64::new(0),
            })
        });
        let histograms = EngineHistograms::new();
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
            start: Instant::now(),
            cfg,
            prefill_ns,
            swap_ns,
            eos: model.config().eos_ids(),
            chaos: None,
            arrivals: arrivals.clone(),
            interactive_seen: 0,
            aborts_in_row: 0,
            abortable_steps: 0,
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
                let digest = ModelDigest::new(&model.model_id(), &geom);
                let store = store.clone();
                let seconds = histograms.prefix_lookup_seconds.clone();
                let arrivals = arrivals.clone();
                let t = std::thread::Builder::new()
                    .name("fastlane-llm-prefix".into())
                    .spawn(move || {
                        lookup_loop(&lrx, &tx, &store, &digest, &seconds, arrivals.as_deref())
                    })
                    .map_err(|e| LlmError::Stopped { reason: format!("spawn: {e}") })?;
                (ltx, Some(t))
            }
            None => (tx, None),
        };
        let arrivals = if lookup.is_some() { None } else { arrivals };
        Ok(Engine {
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
        self.tx
            .send(Command::Submit { id, req, tx, at: Instant::now(), prefix: PrefixHit::default() })
            .map_err(|_| LlmError::Stopped { reason: "engine thread exited".into() })?;
        if let Some(a) = &self.arrivals {
            a.sent(tenant);
        }
        Ok(Stream { id, rx, engine: self.tx.clone() })
    }

    /// Aborts a request (its stream ends with [`FinishReason::Abort`]); within one step.
    pub fn abort(&self, id: u64) {
        let _ = self.tx.send(Command::Abort { id });
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

fn costs_for(
    choice: PreemptChoice,
    prefill_ns: f64,
    swap_ns: f64,
    block_bytes: usize,
) -> PreemptCosts {
    let kv_bytes_per_token = (block_bytes / TOKENS_PER_BLOCK) as u64;
    let (prefill, swap) = match choice {
        PreemptChoice::Auto => (prefill_ns, swap_ns),
        // A recompute that costs "forever" / a swap that does.
        PreemptChoice::Swap => (1e15, swap_ns),
        PreemptChoice::Recompute => (0.0, 1e15),
    };
    PreemptCosts {
        prefill_ns_per_token: prefill,
        swap_ns_per_byte: swap,
        swap_fixed_ns: 20_000,
        kv_bytes_per_token,
    }
}

/// The keys of the full blocks of `prompt` for `model`, as the prefix cache names them.
pub fn prefix_keys(model: &Model, prompt: &[u32]) -> Vec<BlockKey> {
    let geom = model.kv_geometry();
    let digest = ModelDigest::new(&model.model_id(), &geom);
    fastlane_kvswap::prefix_keys(&digest, prompt, geom.tokens_per_block)
}

/// The engine's block store: a host cache, the NVMe tier when one is configured (an error
/// opening it fails the engine's start), and the cluster tier when one is configured and
/// reachable (when it is not, a warning, and the local tiers alone).
fn prefix_store(
    cfg: &EngineConfig,
    geom: &fastlane_kvswap::KvGeometry,
) -> Result<PrefixStore, LlmError> {
    let pc = &cfg.prefix;
    let scfg = fastlane_kvswap::PrefixStoreConfig {
        host_bytes: pc.host_bytes,
        block_bytes: crate::kv::block_bytes(geom),
        put_queue_max: fastlane_kvswap::prefix::PUT_QUEUE_MAX,
        nvme: pc.nvme.clone(),
    };
    let local = |scfg: fastlane_kvswap::PrefixStoreConfig| {
        PrefixStore::open(scfg).map_err(|e| LlmError::PrefixCache { reason: e.to_string() })
    };
    if pc.cluster.is_empty() {
        return local(scfg);
    }
    let t = pc.cluster_timeout.max(Duration::from_millis(4));
    let ccfg = fastlane_kvswap::cluster::ClusterTierConfig {
        namespace: pc.cluster_namespace.clone(),
        timeout: t,
        connect_timeout: t / 4,
        response_timeout: t / 2,
        ..fastlane_kvswap::cluster::ClusterTierConfig::default()
    };
    let tier = match fastlane_kvswap::cluster::ClusterTier::connect(&pc.cluster, ccfg) {
        Ok(t) => t,
        Err(e) => {
            log::warn!(
                "prefix cache: cluster {:?} unreachable ({e}); local tiers only",
                pc.cluster
            );
            return local(scfg);
        }
    };
    match PrefixStore::with_cluster(scfg.clone(), tier) {
        Ok(s) => Ok(s),
        Err(e) => {
            // The NVMe tier failing again is the engine's error; else the cluster's writer
            // thread was the trouble.
            let s = local(scfg)?;
            log::warn!("prefix cache: cluster not used ({e}); local tiers only");
            Ok(s)
        }
    }
}

/// The lookup thread: a new request's full prompt blocks are keyed and the longest run of
/// leading cached blocks found (never the block of the last prompt token: it is always
/// computed, so its logits exist); every command goes on to the engine in order. With
/// preemptible steps it counts the interactive submissions it forwards (`arrivals`).
fn lookup_loop(
    rx: &Receiver<Command>,
    tx: &Sender<Command>,
    store: &PrefixStore,
    digest: &ModelDigest,
    seconds: &prometheus::Histogram,
    arrivals: Option<&Arrivals>,
) {
    // Ends when the engine handle is gone or after forwarding a shutdown.
    while let Ok(mut c) = rx.recv() {
        let shutdown = matches!(c, Command::Shutdown);
        let submitted = if let Command::Submit { req, .. } = &c { Some(req.tenant) } else { None };
        if let Command::Submit { req, prefix, .. } = &mut c {
            prefix.keys =
                fastlane_kvswap::prefix_keys(digest, &req.prompt, TOKENS_PER_BLOCK as u32);
            let usable =
                (req.prompt.len().saturating_sub(1) / TOKENS_PER_BLOCK).min(prefix.keys.len());
            if usable > 0 {
                let t0 = Instant::now();
                prefix.blocks = store.lookup(&prefix.keys[..usable]);
                seconds.observe(t0.elapsed().as_secs_f64());
            }
        }
        if tx.send(c).is_err() || shutdown {
            return;
        }
        if let (Some(a), Some(tenant)) = (arrivals, submitted) {
            a.sent(tenant);
        }
    }
}

/// One 64-token prefill (after a warm-up) into scratch blocks of the pool, timed.
fn measure_prefill_ns_per_token(
    model: &Model,
    pool: &KvPool,
    s: &mut Scratch,
) -> Result<f64, LlmError> {
    let n = 64usize.min(model.max_positions());
    let blocks: Vec<fastlane_kvswap::BlockId> =
        (0..n.div_ceil(TOKENS_PER_BLOCK).min(pool.blocks() as usize) as u32)
            .map(fastlane_kvswap::BlockId)
            .collect();
    let n = n.min(blocks.len() * TOKENS_PER_BLOCK);
    let tokens: Vec<u32> = (0..n as u32).map(|i| i % model.vocab() as u32).collect();
    let item = [BatchItem { tokens: &tokens, start_pos: 0, blocks: &blocks, want_logits: true }];
    model.forward(&item, pool, s)?;
    let t0 = Instant::now();
    model.forward(&item, pool, s)?;
    Ok(t0.elapsed().as_nanos() as f64 / n as f64)
}

/// The host tier's copy cost on this machine (kvswap's calibration, 8 blocks, 3 rounds).
fn measure_swap_ns_per_byte(block_bytes: usize) -> f64 {
    match fastlane_sched::sim::calibrate_host_tier(block_bytes, 8, 3) {
        Ok(c) => c.ns_per_byte(),
        Err(e) => {
            log::warn!("engine: host tier calibration failed ({e}); assuming 0.1 ns/byte");
            0.1
        }
    }
}

struct Loop {
    model: Arc<Model>,
    pool: KvPool,
    sched: Scheduler<EnginePort>,
    scratch: Scratch,
    rx: Receiver<Command>,
    live: HashMap<u64, Live>,
    counters: Arc<Mutex<EngineCounters>>,
    histograms: EngineHistograms,
    local: EngineCounters,
    start: Instant,
    cfg: EngineConfig,
    prefill_ns: f64,
    swap_ns: f64,
    eos: Vec<u32>,
    chaos: Option<rand_chacha::ChaCha8Rng>,
    prefix: Option<Arc<PrefixStore>>,
    /// Preemptible steps: the submit path's count of interactive arrivals (`None`: off).
    arrivals: Option<Arc<Arrivals>>,
    /// Interactive-tier submissions drained from the channel so far.
    interactive_seen: u64,
    /// Steps given up since the last one that ran to its end.
    aborts_in_row: u32,
    /// Steps that could have been given up (the `force_step_aborts` hook counts them).
    abortable_steps: u64,
}

impl Loop {
    fn now(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }

    fn run(mut self) -> Result<(), LlmError> {
        let result = self.serve();
        // Whatever ended the loop, every open stream gets its end.
        let reason = if result.is_ok() { FinishReason::Abort } else { FinishReason::Error };
        let ids: Vec<u64> = self.live.keys().copied().collect();
        for id in ids {
            let _ = self.sched.abort(SeqId(id));
            self.end(id, reason);
        }
        self.publish();
        if let Err(e) = &result {
            log::error!("engine stopped: {e}");
        }
        result
    }

    fn serve(&mut self) -> Result<(), LlmError> {
        // Bounded: each turn either runs a step or waits on the channel with a timeout.
        loop {
            let idle = self.live.is_empty();
            let first = if idle {
                match self.rx.recv() {
                    Ok(c) => Some(c),
                    Err(_) => return Ok(()),
                }
            } else {
                None
            };
            if let Some(c) = first {
                if !self.command(c)? {
                    return Ok(());
                }
            }
            loop {
                match self.rx.try_recv() {
                    Ok(c) => {
                        if !self.command(c)? {
                            return Ok(());
                        }
                    }
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => return Ok(()),
                }
            }
            self.maybe_chaos()?;
            let now = self.now();
            let ran = self.step(now)?;
            if !ran && !self.live.is_empty() {
                // Waiting for a swap, the bucket, or nothing to do: sleep until the next
                // event the scheduler knows of, a command, or 200 µs.
                let wake = self
                    .sched
                    .next_wakeup_ns(now)
                    .map(|t| t.saturating_sub(now))
                    .unwrap_or(200_000);
                let wait = Duration::from_nanos(wake.clamp(20_000, 200_000));
                match self.rx.recv_timeout(wait) {
                    Ok(c) => {
                        if !self.command(c)? {
                            return Ok(());
                        }
                    }
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => return Ok(()),
                }
            }
        }
    }

    /// Ends a live request as aborted (nothing when it already ended).
    fn abort_live(&mut self, id: u64) -> Result<(), LlmError> {
        if self.live.contains_key(&id) {
            self.sched.abort(SeqId(id))?;
            self.end(id, FinishReason::Abort);
        }
        Ok(())
    }

    /// Handles one command; `false` on shutdown.
    fn command(&mut self, c: Command) -> Result<bool, LlmError> {
        match c {
            Command::Shutdown => return Ok(false),
            Command::Abort { id } => self.abort_live(id)?,
            Command::Release { id } => {
                // A stream dropped before its end is aborted first (a no-op when it ended).
                self.abort_live(id)?;
                self.sched.release_slot(SeqId(id));
            }
            Command::Submit { id, req, tx, at, prefix } => {
                let tenant = req.tenant;
                // `scripts/router-floor.sh` reads these events (`--log-format json`).
                tracing::trace!(
                    event = "request_taken",
                    id,
                    waited_us = at.elapsed().as_micros() as u64,
                    prompt_tokens = req.prompt.len(),
                    "engine: request taken in"
                );
                if self.arrivals.as_ref().is_some_and(|a| a.is_interactive(tenant)) {
                    self.interactive_seen += 1;
                }
                let arrival_ns = at.saturating_duration_since(self.start).as_nanos() as u64;
                let cached_tokens = (prefix.blocks.len() * TOKENS_PER_BLOCK) as u32;
                let r = Request {
                    seq: SeqId(id),
                    tenant,
                    prompt_tokens: req.prompt.len() as u32,
                    output_tokens: req.max_tokens,
                    arrival_ns,
                    cached_tokens,
                };
                let live = Live {
                    sampler: Sampler::new(req.sampling),
                    req,
                    generated: Vec::new(),
                    tx,
                    text: String::new(),
                    stream: TextStream::default(),
                    arrived: at,
                    ttft_ns: None,
                    preemptions: 0,
                    digest: 0xcbf2_9ce4_8422_2325,
                    stored_blocks: prefix.blocks.len(),
                    keys: prefix.keys,
                    load: prefix.blocks,
                    cached_tokens,
                };
                match self.sched.submit(self.now().max(arrival_ns), r) {
                    Ok(Admission::Admitted | Admission::Queued) => {
                        self.live.insert(id, live);
                    }
                    Ok(Admission::Rejected(why)) => {
                        self.local.rejected += 1;
                        self.live.insert(id, live);
                        self.end(
                            id,
                            match why {
                                RejectReason::RateLimited => FinishReason::RateLimited,
                                RejectReason::QueueFull => FinishReason::QueueFull,
                            },
                        );
                    }
                    Err(e) => {
                        // A request the scheduler can never run (bigger than the pool, unknown
                        // tenant): the stream ends with the reason as its text.
                        log::warn!("request {id} refused: {e}");
                        let _ = live.tx.send(StreamEvent::Done(Finished {
                            reason: FinishReason::Rejected,
                            token_ids: Vec::new(),
                            text: e.to_string(),
                            prompt_tokens: live.req.prompt.len() as u32,
                            ttft_ns: None,
                            preemptions: 0,
                            logits_digest: None,
                        }));
                        self.local.rejected += 1;
                    }
                }
            }
        }
        Ok(true)
    }

    fn maybe_chaos(&mut self) -> Result<(), LlmError> {
        let Some((p, _)) = self.cfg.chaos else { return Ok(()) };
        let Some(rng) = self.chaos.as_mut() else { return Ok(()) };
        if rng.random::<f64>() >= p || self.live.is_empty() {
            return Ok(());
        }
        let mut ids: Vec<u64> = self.live.keys().copied().collect();
        ids.sort_unstable();
        let pick = ids[rng.random_range(0..ids.len())];
        let mode = match self.cfg.preempt {
            PreemptChoice::Swap => Some(PreemptMode::Swap),
            PreemptChoice::Recompute => Some(PreemptMode::Recompute),
            PreemptChoice::Auto => None,
        };
        let now = self.now();
        self.sched.preempt_now(now, SeqId(pick), mode)?;
        Ok(())
    }

    /// Plans and runs one step; `false` when there was nothing to run.
    fn step(&mut self, now: u64) -> Result<bool, LlmError> {
        let plan = self.sched.schedule(now)?.clone();
        self.absorb_events();
        if plan.is_empty() {
            self.publish();
            return Ok(false);
        }
        // Inputs: all tokens of a sequence are prompt ++ generated; a step item covers
        // positions context..context+n of them.
        let mut inputs: Vec<(u64, Vec<u32>, usize, bool)> = Vec::with_capacity(plan.items.len());
        for it in &plan.items {
            let id = it.seq.0;
            let live = self.live.get(&id).ok_or_else(|| LlmError::Stopped {
                reason: format!("scheduler planned unknown sequence {id}"),
            })?;
            let ctx = it.context_tokens as usize;
            let n = match it.kind {
                StepKind::Decode => 1,
                StepKind::Prefill { tokens } => tokens as usize,
            };
            let plen = live.req.prompt.len();
            let all =
                |i: usize| if i < plen { live.req.prompt[i] } else { live.generated[i - plen] };
            if ctx + n > plen + live.generated.len() {
                return Err(LlmError::Stopped {
                    reason: format!("step for sequence {id} runs past its tokens ({ctx}+{n})"),
                });
            }
            let toks: Vec<u32> = (ctx..ctx + n).map(all).collect();
            let want = match it.kind {
                StepKind::Decode => true,
                StepKind::Prefill { .. } => live.generated.is_empty() && ctx + n >= plen,
            };
            inputs.push((id, toks, ctx, want));
        }
        let mut tables: Vec<Vec<fastlane_kvswap::BlockId>> = inputs
            .iter()
            .map(|(id, ..)| {
                self.sched.blocks().table(SeqId(*id)).map(<[_]>::to_vec).unwrap_or_default()
            })
            .collect();
        // An item whose block table does not cover its positions is a scheduler bug: that
        // request fails (after the step, with an error), the others go on.
        let mut broken: Vec<u64> = Vec::new();
        let mut i = 0;
        while i < inputs.len() {
            let (id, toks, ctx, _) = &inputs[i];
            if tables[i].len() * TOKENS_PER_BLOCK < ctx + toks.len() {
                log::error!(
                    "engine: sequence {id} planned at positions {ctx}..{} with {} blocks; failing it",
                    ctx + toks.len(),
                    tables[i].len()
                );
                broken.push(*id);
                inputs.remove(i);
                tables.remove(i);
            } else {
                i += 1;
            }
        }
        self.load_prefixes(&inputs, &tables);
        let items: Vec<BatchItem<'_>> = inputs
            .iter()
            .zip(&tables)
            .map(|((_, toks, ctx, want), blocks)| BatchItem {
                tokens: toks,
                start_pos: *ctx,
                blocks,
                want_logits: *want,
            })
            .collect();
        let rows: u64 = inputs.iter().map(|i| i.1.len() as u64).sum();
        let t0 = Instant::now();
        let mut forced = None;
        let outcome = if self.step_abortable(&plan) {
            self.abortable_steps += 1;
            let last = self.model.config().num_hidden_layers.saturating_sub(1);
            forced = self.cfg.force_step_aborts.and_then(|(every, layer)| {
                (every > 0 && self.abortable_steps.is_multiple_of(u64::from(every)))
                    .then_some(layer.min(last))
            });
            let seen = self.interactive_seen;
            let sent = self.arrivals.as_deref().map(|a| &a.sent);
            // One atomic load per layer. Acquire pairs with the Release increment in
            // `Arrivals::sent`: an arrival counted here is in the channel at the next drain.
            let stop = |layer: usize| {
                forced == Some(layer) || sent.is_some_and(|n| n.load(Ordering::Acquire) > seen)
            };
            self.model.forward_abortable(&items, &self.pool, &mut self.scratch, &stop)?
        } else {
            Forward::Done(self.model.forward(&items, &self.pool, &mut self.scratch)?)
        };
        let fwd_ns = t0.elapsed().as_nanos() as u64;
        // One event per step at trace level (the record's timestamp is the step's end):
        // `scripts/router-floor.sh` reads what the engine was doing when a request arrived
        // (`--log-format json`). The fields are only evaluated when trace is on.
        tracing::trace!(
            event = "step",
            step_us = fwd_ns / 1_000,
            prefill_items = plan.items.iter().filter(|it| it.kind != StepKind::Decode).count(),
            prefill_tokens = plan
                .items
                .iter()
                .map(|it| match it.kind {
                    StepKind::Prefill { tokens } => tokens,
                    StepKind::Decode => 0,
                })
                .sum::<u32>(),
            decodes = plan.items.iter().filter(|it| it.kind == StepKind::Decode).count(),
            given_up = matches!(outcome, Forward::Aborted { .. }),
            "engine: step"
        );
        if let Forward::Aborted { layer } = outcome {
            // The step did not happen: nothing was sampled or stored, no cost measured; the
            // K/V written for its positions is rewritten when they are computed again.
            self.aborts_in_row += 1;
            self.local.steps_aborted += 1;
            self.local.aborted_forward_ns += fwd_ns;
            log::debug!(
                "engine: step given up before layer {layer} of {} after {:.2} ms ({} sequences, {rows} rows) {}",
                self.model.config().num_hidden_layers,
                fwd_ns as f64 * 1e-6,
                inputs.len(),
                if forced == Some(layer) { "by the test hook" } else { "for an interactive arrival" }
            );
            self.sched.abandon_step()?;
            self.fail_broken(broken)?;
            self.publish();
            return Ok(true);
        }
        self.aborts_in_row = 0;
        let vocab = self.model.vocab();
        let mut sampled: HashMap<u64, u32> = HashMap::new();
        let mut row = 0;
        for (id, _, _, want) in &inputs {
            if *want {
                let logits = &self.scratch.logits[row * vocab..(row + 1) * vocab];
                let live = self.live.get_mut(id).expect("checked above");
                if live.req.digest_logits {
                    for v in logits {
                        live.digest =
                            (live.digest ^ u64::from(v.to_bits())).wrapping_mul(0x100_0000_01b3);
                    }
                }
                sampled.insert(*id, live.sampler.sample(logits));
                row += 1;
            }
        }
        self.store_prefixes(&inputs, &tables);
        // Measured costs: prefill ns/token from this step when it was mostly prefill.
        if plan.prefill_tokens >= 16 && plan.prefill_tokens as u64 * 2 >= rows {
            let per = fwd_ns as f64 / rows as f64;
            self.prefill_ns = 0.9 * self.prefill_ns + 0.1 * per;
        }
        // The swap cost stays the start-up calibration: the port sees a transfer end only at
        // the next step boundary, so its wall times include the step and would overstate it.
        let bb = crate::kv::block_bytes(&self.model.kv_geometry());
        self.sched.set_preempt_costs(costs_for(
            self.cfg.preempt,
            self.prefill_ns,
            self.swap_ns,
            bb,
        ));
        self.local.steps += 1;
        self.local.rows += rows;
        self.local.prefill_tokens += u64::from(plan.prefill_tokens);
        self.local.forward_ns += fwd_ns;
        self.histograms.step_seconds.observe(fwd_ns as f64 * 1e-9);
        self.histograms.batch_tokens.observe(rows as f64);
        self.histograms.batch_sequences.observe(inputs.len() as f64);
        let done_ns = self.now();
        let events: Vec<SchedEvent> = self.sched.complete_step(done_ns)?.to_vec();
        self.sched.clear_events();
        let mut to_stop = Vec::new();
        for ev in events {
            match ev {
                SchedEvent::Token { seq, .. } | SchedEvent::Finished { seq, .. }
                    if broken.contains(&seq.0) => {}
                SchedEvent::Token { seq, .. } => {
                    let Some(tok) = sampled.remove(&seq.0) else {
                        return Err(LlmError::Stopped {
                            reason: format!(
                                "scheduler emitted a token for {} that was not sampled",
                                seq.0
                            ),
                        });
                    };
                    if self.token(seq.0, tok) {
                        to_stop.push(seq.0);
                    }
                }
                SchedEvent::Finished { seq, fenced: false, .. } if to_stop.contains(&seq.0) => {
                    self.end(seq.0, FinishReason::Stop);
                }
                other => self.event(other),
            }
        }
        if let Some((id, _)) = sampled.into_iter().next() {
            return Err(LlmError::Stopped {
                reason: format!("sampled a token for {id} the scheduler did not emit"),
            });
        }
        self.fail_broken(broken)?;
        for id in to_stop {
            if self.live.contains_key(&id) {
                self.sched.abort(SeqId(id))?;
                self.sched.clear_events();
                self.end(id, FinishReason::Stop);
            }
        }
        self.publish();
        Ok(true)
    }

    /// Whether this step's forward pass may be given up for an interactive arrival:
    /// preemptible steps on, no interactive-tier prefill in the step (an interactive request
    /// is never given up for another), and fewer than [`STEP_ABORTS_IN_ROW_MAX`] steps given
    /// up in a row (no livelock: then the step runs to its end).
    fn step_abortable(&self, plan: &StepPlan) -> bool {
        let Some(a) = &self.arrivals else { return false };
        self.aborts_in_row < STEP_ABORTS_IN_ROW_MAX
            && !plan.items.iter().any(|it| {
                matches!(it.kind, StepKind::Prefill { .. }) && a.is_interactive(it.tenant)
            })
    }

    /// Fails the requests whose planned item had no blocks for its positions (a scheduler
    /// bug), after the step: the others go on.
    fn fail_broken(&mut self, broken: Vec<u64>) -> Result<(), LlmError> {
        for id in broken {
            if self.live.contains_key(&id) {
                self.sched.abort(SeqId(id))?;
                self.sched.clear_events();
                self.end(id, FinishReason::Error);
            }
        }
        Ok(())
    }

    /// Copies each starting sequence's cached prefix blocks into its first blocks: the
    /// first prefill item of a sequence with a hit starts at `cached_tokens`, so those
    /// positions must hold their K/V before the forward pass reads them.
    fn load_prefixes(
        &mut self,
        inputs: &[(u64, Vec<u32>, usize, bool)],
        tables: &[Vec<fastlane_kvswap::BlockId>],
    ) {
        for ((id, _, ctx, _), table) in inputs.iter().zip(tables) {
            let Some(live) = self.live.get_mut(id) else { continue };
            if live.load.is_empty() {
                continue;
            }
            // A first prefill after a hit starts exactly there (the scheduler's
            // `cached_tokens`); anything else (a restart from 0) recomputes and drops them.
            if *ctx == live.cached_tokens as usize && table.len() >= live.load.len() {
                for (b, data) in table.iter().zip(&live.load) {
                    self.pool.write_block(*b, data);
                }
                self.local.prefix_hit_requests += 1;
                self.local.prefix_reused_tokens += u64::from(live.cached_tokens);
            }
            live.load = Vec::new();
        }
    }

    /// After the forward pass: the full prompt blocks this step completed, not yet in the
    /// cache, are copied into it (host memory now; the cluster put is queued).
    fn store_prefixes(
        &mut self,
        inputs: &[(u64, Vec<u32>, usize, bool)],
        tables: &[Vec<fastlane_kvswap::BlockId>],
    ) {
        let Some(store) = &self.prefix else { return };
        for ((id, toks, ctx, _), table) in inputs.iter().zip(tables) {
            let Some(live) = self.live.get_mut(id) else { continue };
            let done =
                ((ctx + toks.len()) / TOKENS_PER_BLOCK).min(live.keys.len()).min(table.len());
            let from = live.stored_blocks.min(done);
            for (key, b) in live.keys[from..done].iter().zip(&table[from..done]) {
                if !store.contains(key) {
                    let data: Arc<[u8]> = self.pool.block_bytes_of(*b).into();
                    if store.insert(*key, data) {
                        self.local.prefix_stored_blocks += 1;
                    }
                }
            }
            live.stored_blocks = live.stored_blocks.max(done);
        }
    }

    /// Events outside a step's tokens (preemptions at schedule time, fences, aborts that
    /// completed with a swap).
    fn absorb_events(&mut self) {
        let events: Vec<SchedEvent> = self.sched.events().to_vec();
        self.sched.clear_events();
        for ev in events {
            self.event(ev);
        }
    }

    fn event(&mut self, ev: SchedEvent) {
        match ev {
            SchedEvent::Preempted { seq, mode, .. } => {
                match mode {
                    PreemptMode::Swap => self.local.preempt_swap += 1,
                    PreemptMode::Recompute => self.local.preempt_recompute += 1,
                }
                if let Some(l) = self.live.get_mut(&seq.0) {
                    l.preemptions += 1;
                }
            }
            SchedEvent::Finished { seq, fenced, .. } => {
                if self.live.contains_key(&seq.0) {
                    self.end(
                        seq.0,
                        if fenced { FinishReason::Fenced } else { FinishReason::Length },
                    );
                }
            }
            SchedEvent::Token { .. } => {}
        }
    }

    /// Delivers a token; `true` when the request must stop here.
    fn token(&mut self, id: u64, tok: u32) -> bool {
        let now = Instant::now();
        let Some(l) = self.live.get_mut(&id) else { return false };
        l.generated.push(tok);
        self.local.generated_tokens += 1;
        if l.ttft_ns.is_none() {
            l.ttft_ns = Some(now.saturating_duration_since(l.arrived).as_nanos() as u64);
        }
        let piece = self.model.tokenizer().piece(&l.generated, &mut l.stream);
        let before = l.text.len();
        l.text.push_str(&piece);
        // A stop string may straddle tokens: search the new text with enough of the old.
        let longest = l.req.stop.iter().map(String::len).max().unwrap_or(0);
        let mut from = before.saturating_sub(longest);
        while !l.text.is_char_boundary(from) {
            from -= 1;
        }
        if let Some(cut) = l
            .req
            .stop
            .iter()
            .filter_map(|s| l.text[from..].find(s.as_str()).map(|i| from + i))
            .min()
        {
            l.text.truncate(cut);
            let visible = if cut > before { l.text[before..].to_string() } else { String::new() };
            let _ = l.tx.send(StreamEvent::Token { id: tok, text: visible });
            return true;
        }
        let _ = l.tx.send(StreamEvent::Token { id: tok, text: piece });
        l.req.stop_token_ids.contains(&tok) || (!l.req.ignore_eos && self.eos.contains(&tok))
    }

    fn end(&mut self, id: u64, reason: FinishReason) {
        let Some(mut l) = self.live.remove(&id) else { return };
        let tail = l.stream.finish();
        if reason != FinishReason::Stop {
            l.text.push_str(&tail);
        }
        match reason {
            FinishReason::Abort => self.local.aborted += 1,
            FinishReason::Rejected | FinishReason::RateLimited | FinishReason::QueueFull => {}
            _ => self.local.finished += 1,
        }
        let _ = l.tx.send(StreamEvent::Done(Finished {
            reason,
            token_ids: l.generated,
            text: l.text,
            prompt_tokens: l.req.prompt.len() as u32,
            ttft_ns: l.ttft_ns,
            preemptions: l.preemptions,
            logits_digest: l.req.digest_logits.then_some(l.digest),
        }));
    }

    fn publish(&mut self) {
        let port: PortStats = self.sched.port().stats();
        let es = self.sched.port().engine().stats();
        self.local.swap_out_bytes = port.out_bytes;
        self.local.swap_in_bytes = port.in_bytes;
        self.local.swap_out_bytes_by_tier = port.out_bytes_by_tier;
        self.local.swap_failures = port.failures;
        self.local.checksum_mismatches = port.checksum_mismatches;
        self.local.spilled_bytes = es.bytes_spilled;
        for (i, t) in es.tiers.iter().enumerate() {
            self.local.tier_used_bytes[i] = t.used_bytes;
        }
        self.local.blocks_free = self.sched.blocks().free();
        self.local.blocks_total = self.sched.blocks().total();
        self.local.live = self.live.len() as u64;
        self.local.seqs = self.sched.seq_counts();
        let tiers = self.sched.tier_stats();
        self.local.tier_separate_steps = tiers.separate_steps;
        self.local.tier_released_steps = tiers.released_steps;
        let n = self.sched.tenant_count();
        self.local.queued_by_tenant.resize(n, 0);
        for t in 0..n {
            self.local.queued_by_tenant[t] = self.sched.router_queued_of(t);
        }
        self.local.prefill_ns_per_token = self.prefill_ns;
        self.local.swap_ns_per_byte = self.swap_ns;
        self.local.prefix_cache = self.prefix.as_ref().map(|p| p.stats());
        if let Ok(mut c) = self.counters.lock() {
            *c = self.local.clone();
        }
    }
}
