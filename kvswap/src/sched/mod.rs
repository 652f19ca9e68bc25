//! The iteration-level, preemptive, multi-tenant scheduler.
//!
//! # What it does
//!
//! - Keeps the KV cache in fixed blocks of [`BLOCK_TOKENS`] tokens ([`BlockManager`]): one
//!   block table per sequence and a free pool. A sequence gets blocks for its whole prompt
//!   when it starts (plus a free-pool watermark, as vLLM does), and one more block every
//!   16 generated tokens.
//! - Runs one step at a time ([`Scheduler::schedule`] → the caller runs the batch →
//!   [`Scheduler::complete_step`]). A step holds one decode token per running sequence and
//!   prefill chunks of at most `chunk_tokens` each (Sarathi-Serve's chunked prefill), within
//!   a token budget; decodes go first, then prefill chunks.
//! - Admits requests at the router (policies `drr` and `drr+preempt`): a per-tenant token
//!   bucket (capacity B, refill rpm/60 per second) and a per-tenant concurrency limit. A
//!   request needs both; one that has a bucket token but no free slot does **not** spend the
//!   token. Refused requests wait in a bounded per-tenant router queue or get a 429. The slot
//!   is held until the stream's last token, or until the max-stream-duration fence ends it.
//! - Shares each step's prefill token budget across tenants by deficit round robin on chunk
//!   tokens, interactive tier before batch tier: a tenant's prefill work is its running
//!   prefills and then its admitted requests, so a request that waits gets its tenant's share
//!   of the very next step however many prefills another tenant has under way, and which
//!   tenant's request starts next is DRR's choice too. Policy `fifo` is the baseline: one
//!   global arrival-order queue, running prefills oldest first, no bucket, no tiers.
//! - Optionally ([`SchedConfig::protect`], `--protect`), gives up work conservation for
//!   latency: while an interactive tenant that sends under its rate (bucket at least half
//!   full) has a prefill in the step, the other tenants add at most a configured number of
//!   prefill tokens to that step (default 0; their decodes still run), so the protected
//!   chunk's step lasts about what it lasts solo. A hold bound plans one work-conserving
//!   step after the others' prefill has waited that long ([`ProtectConfig`]).
//! - Under `drr+preempt`, when an interactive request is waiting and the free pool cannot
//!   take it, preempts batch sequences at the step boundary, cheapest first, by swap (through
//!   a [`SwapPort`]) or by recompute, whichever the [`PreemptCosts`] model says costs less;
//!   preempted sequences resume later from the front of their tenant's queue. Running out of
//!   blocks for a decode preempts the newest lowest-tier sequence under every policy (vLLM's
//!   rule), the same way.
//! - Records per-tenant TTFT (arrival at the router → first token) and per-token latency
//!   histograms ([`TenantStats`]).
//!
//! # What it does not do
//!
//! It does not run a model: the caller executes [`StepPlan`]s (the simulator prices them with
//! a cost model). Time is passed in as nanoseconds on the caller's clock, so the same code
//! runs on a wall clock or a discrete-event one. No prefix caching, no speculative decoding,
//! no pipeline parallelism.

mod blocks;
mod fair;
mod port;
mod stats;

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::str::FromStr;

use thiserror::Error;

pub use blocks::{blocks_for_tokens, BlockError, BlockManager, PinnedBlocks, BLOCK_TOKENS};
pub use fair::{Drr, TokenBucket};
pub use port::{InstantPort, SwapDir, SwapDone, SwapPort, SwapPortError};
pub use stats::{new_histogram, record, TenantStats, LATENCY_NS_MAX};

pub use crate::{BlockId, SeqId};

/// Index of a tenant in the scheduler's tenant list.
pub type TenantIndex = usize;

/// Priority tier of a tenant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    /// Latency-sensitive: served first, may preempt batch work.
    Interactive,
    /// Throughput work: may be preempted.
    Batch,
}

/// Scheduling policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// One global arrival-order queue; no admission control, no tiers (the baseline).
    Fifo,
    /// Token bucket + concurrency admission, DRR across tenants, interactive tier first.
    Drr,
    /// [`Policy::Drr`] plus preemption of batch sequences for waiting interactive ones.
    DrrPreempt,
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Policy::Fifo => "fifo",
            Policy::Drr => "drr",
            Policy::DrrPreempt => "drr+preempt",
        })
    }
}

impl FromStr for Policy {
    type Err = SchedError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "fifo" => Ok(Policy::Fifo),
            "drr" => Ok(Policy::Drr),
            "drr+preempt" => Ok(Policy::DrrPreempt),
            other => Err(SchedError::Config { reason: format!("unknown policy {other:?}") }),
        }
    }
}

/// What the router does with a request it cannot admit now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overflow {
    /// Hold it in the tenant's router queue (at most `depth_max`), retried every step.
    Queue {
        /// Queue bound; beyond it requests are rejected.
        depth_max: usize,
    },
    /// Refuse it (HTTP 429).
    Reject,
}

/// One tenant's admission settings.
#[derive(Debug, Clone)]
pub struct TenantConfig {
    /// Name (for reports; no spaces or commas: it becomes an .hlog tag).
    pub name: String,
    /// Priority tier.
    pub tier: Tier,
    /// Token bucket capacity B (burst).
    pub bucket_capacity: f64,
    /// Requests per minute refilled into the bucket (rate rpm/60 per second).
    pub rpm: f64,
    /// Streams in flight at most (admission slots).
    pub concurrency_max: u32,
    /// What to do with a request that cannot be admitted now.
    pub overflow: Overflow,
}

/// The numbers the swap-or-recompute decision uses.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PreemptCosts {
    /// GPU time to recompute one token of KV (prefill), ns.
    pub prefill_ns_per_token: f64,
    /// Transfer time per byte, one way, ns.
    pub swap_ns_per_byte: f64,
    /// Fixed cost per swap, one way, ns.
    pub swap_fixed_ns: u64,
    /// KV bytes per token.
    pub kv_bytes_per_token: u64,
}

impl PreemptCosts {
    /// Bytes of `blocks` KV blocks.
    pub fn block_bytes(&self) -> u64 {
        self.kv_bytes_per_token * u64::from(BLOCK_TOKENS)
    }

    /// Round-trip swap time of `tokens` tokens of KV (out and back in).
    pub fn swap_round_trip_ns(&self, tokens: u32) -> f64 {
        let bytes = u64::from(blocks_for_tokens(tokens)) * self.block_bytes();
        2.0 * (self.swap_fixed_ns as f64 + bytes as f64 * self.swap_ns_per_byte)
    }

    /// Time to recompute `tokens` tokens of KV.
    pub fn recompute_ns(&self, tokens: u32) -> f64 {
        f64::from(tokens) * self.prefill_ns_per_token
    }
}

/// Scheduler settings.
#[derive(Debug, Clone)]
pub struct SchedConfig {
    /// Policy.
    pub policy: Policy,
    /// KV blocks on the device.
    pub kv_blocks: u32,
    /// Blocks kept free when starting a sequence (room for running ones to grow).
    pub watermark_blocks: u32,
    /// Prefill chunk size in tokens; `None`: whole prompts in one step.
    pub chunk_tokens: Option<u32>,
    /// Token budget of one step (decode tokens + prefill chunk tokens). A whole-prompt
    /// prefill may exceed it when it is the step's only prefill.
    pub batch_tokens_max: u32,
    /// Sequences in one step at most.
    pub batch_seqs_max: u32,
    /// DRR quantum, in tokens.
    pub drr_quantum_tokens: u64,
    /// Streams longer than this (from admission) are ended; `None`: no fence.
    pub stream_ns_max: Option<u64>,
    /// The swap-or-recompute cost model.
    pub preempt: PreemptCosts,
    /// Latency protection of under-rate interactive tenants (`None`: off, every step's
    /// prefill budget is shared work-conserving). Policies `drr` and `drr+preempt` only.
    pub protect: Option<ProtectConfig>,
}

/// Latency protection (`--protect`): an operator's choice to give up work conservation
/// while the prefill of a tenant that stays under its rate is in the step.
///
/// A tenant is *protected* while it is in the interactive tier and its token bucket holds at
/// least `bucket_frac_min` of its capacity B, i.e. it has been sending below its rpm (a
/// flooder's bucket is empty). Which tenant that is follows from the buckets, not from names.
/// While a protected tenant has prefill work for the step, the other tenants (both tiers)
/// may add at most `others_prefill_tokens_max` prefill tokens to it; their decodes still run.
/// So the protected chunk's step lasts about what it lasts solo, and the unprotected
/// tenants pay: their prefill waits (the GPU stays busy, the step is just shorter).
///
/// Starvation bound: when the cap has held unprotected prefill work back for `hold_ns_max`
/// without a break, the next step is planned work-conserving (plain DRR), and the clock
/// starts again. Protected tenants cannot hold the cap for long on their own either: a
/// tenant that keeps the GPU busy spends its bucket below the threshold and loses the
/// protection.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProtectConfig {
    /// Bucket fill (fraction of B, 0–1) at or above which an interactive tenant is protected.
    pub bucket_frac_min: f64,
    /// Prefill tokens the unprotected tenants may add to a step with a protected prefill.
    pub others_prefill_tokens_max: u32,
    /// Longest the cap holds unprotected prefill work back before one work-conserving step.
    pub hold_ns_max: u64,
}

impl Default for ProtectConfig {
    /// Half the bucket, cap 0 (the protected chunk has the step's prefill to itself), 1 s.
    fn default() -> Self {
        Self { bucket_frac_min: 0.5, others_prefill_tokens_max: 0, hold_ns_max: 1_000_000_000 }
    }
}

/// A request as it reaches the router.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Its sequence id (unique).
    pub seq: SeqId,
    /// Tenant.
    pub tenant: TenantIndex,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Tokens to generate (the stream ends after the last one).
    pub output_tokens: u32,
    /// Arrival at the router, ns.
    pub arrival_ns: u64,
}

/// The router's answer to a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// It holds a slot and waits for the scheduler.
    Admitted,
    /// It waits at the router for a bucket token or a slot.
    Queued,
    /// Refused (429).
    Rejected,
}

/// Errors of the scheduler.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum SchedError {
    /// Invalid configuration.
    #[error("scheduler config: {reason}")]
    Config {
        /// What is wrong.
        reason: String,
    },
    /// A request names a tenant that does not exist.
    #[error("unknown tenant {tenant}")]
    UnknownTenant {
        /// The index given.
        tenant: TenantIndex,
    },
    /// A request reuses a live sequence id.
    #[error("sequence {seq:?} already exists")]
    DuplicateSeq {
        /// The id.
        seq: SeqId,
    },
    /// A request that can never run (empty, or larger than the whole KV cache).
    #[error("request {seq:?} cannot run: {reason}")]
    BadRequest {
        /// The id.
        seq: SeqId,
        /// Why.
        reason: &'static str,
    },
    /// The previous plan was not completed before scheduling again, or vice versa.
    #[error("step protocol: {reason}")]
    Protocol {
        /// What was out of order.
        reason: &'static str,
    },
}

/// What a sequence does in a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepKind {
    /// Prefill `tokens` more prompt (or recompute) tokens.
    Prefill {
        /// Chunk size.
        tokens: u32,
    },
    /// Generate one token.
    Decode,
}

/// One sequence's share of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepItem {
    /// The sequence.
    pub seq: SeqId,
    /// Its tenant.
    pub tenant: TenantIndex,
    /// Prefill chunk or decode.
    pub kind: StepKind,
    /// Tokens already in its KV cache before this step (attention reads them).
    pub context_tokens: u32,
}

/// The batch of one step.
#[derive(Debug, Clone, Default)]
pub struct StepPlan {
    /// Items, decodes first.
    pub items: Vec<StepItem>,
    /// Sum of prefill chunk tokens.
    pub prefill_tokens: u32,
    /// Decode tokens (one per decoding sequence).
    pub decode_tokens: u32,
}

impl StepPlan {
    /// Whether the step has nothing to run.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

/// How a sequence was preempted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreemptMode {
    /// Its KV went to the host tier.
    Swap,
    /// Its KV was dropped, to be recomputed.
    Recompute,
}

/// Something that happened, for callers that want more than the histograms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SchedEvent {
    /// A stream produced a token at `at_ns`; `gap_ns` is arrival→token for the first one.
    Token {
        /// The sequence.
        seq: SeqId,
        /// Its tenant.
        tenant: TenantIndex,
        /// Whether it is the first token.
        first: bool,
        /// Time since the previous token (since arrival for the first).
        gap_ns: u64,
        /// When.
        at_ns: u64,
    },
    /// A stream ended (last token, or the fence when `fenced`).
    Finished {
        /// The sequence.
        seq: SeqId,
        /// Its tenant.
        tenant: TenantIndex,
        /// Ended by the max-stream-duration fence.
        fenced: bool,
    },
    /// A sequence was preempted.
    Preempted {
        /// The sequence.
        seq: SeqId,
        /// Its tenant.
        tenant: TenantIndex,
        /// How.
        mode: PreemptMode,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    Done,
    Fenced,
    Aborted,
}

#[derive(Debug)]
enum State {
    /// Admitted, waiting to start (or to restart after a recompute preemption).
    Waiting,
    Running,
    SwappingOut(PinnedBlocks),
    SwappedOut,
    SwappingIn,
}

#[derive(Debug)]
struct Seq {
    req: Request,
    tier: Tier,
    admitted_ns: u64,
    /// Tokens whose KV exists (on the device, or on the host while swapped).
    computed: u32,
    /// Tokens to prefill before decoding (prompt, or everything computed before a
    /// recompute preemption).
    target: u32,
    generated: u32,
    state: State,
    last_token_ns: Option<u64>,
    /// Order of (re)starting; larger = newer (victims are chosen newest first).
    start_order: u64,
    /// Aborted while a swap was in flight: finished when the swap completes.
    abort_pending: bool,
}

impl Seq {
    fn decode_ready(&self) -> bool {
        matches!(self.state, State::Running)
            && self.computed >= self.target
            && self.generated >= 1
            && self.generated < self.req.output_tokens
    }
}

struct TenantState {
    cfg: TenantConfig,
    bucket: TokenBucket,
    inflight: u32,
    router: VecDeque<Request>,
    ready: VecDeque<SeqId>,
    stats: TenantStats,
}

/// The scheduler. See the [module docs](self).
pub struct Scheduler<P: SwapPort> {
    cfg: SchedConfig,
    tenants: Vec<TenantState>,
    blocks: BlockManager,
    port: P,
    seqs: HashMap<SeqId, Seq>,
    /// Policy `fifo`: the one queue.
    fifo: VecDeque<SeqId>,
    running: Vec<SeqId>,
    drr: [Drr; 2],
    plan: StepPlan,
    planned: bool,
    events: Vec<SchedEvent>,
    done: Vec<SwapDone>,
    order: u64,
    steps: u64,
    /// Latency protection, this step: which tenants are protected (empty: none).
    protected: Vec<bool>,
    /// Latency protection, this step: prefill tokens the unprotected tenants may still add
    /// (`None`: no cap this step).
    others_left: Option<u32>,
    /// Since when the cap has held unprotected prefill work back without a break.
    held_since_ns: Option<u64>,
    protect_stats: ProtectStats,
}

/// What latency protection did over a run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProtectStats {
    /// Steps planned with the cap while unprotected tenants had prefill work.
    pub capped_steps: u64,
    /// Steps planned work-conserving because the cap had held others back for `hold_ns_max`.
    pub released_steps: u64,
}

impl<P: SwapPort> fmt::Debug for Scheduler<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Scheduler")
            .field("policy", &self.cfg.policy)
            .field("seqs", &self.seqs.len())
            .field("running", &self.running.len())
            .field("free_blocks", &self.blocks.free())
            .field("steps", &self.steps)
            .finish()
    }
}

fn tier_index(t: Tier) -> usize {
    match t {
        Tier::Interactive => 0,
        Tier::Batch => 1,
    }
}

impl<P: SwapPort> Scheduler<P> {
    /// A scheduler over `tenants`, swapping through `port`.
    pub fn new(cfg: SchedConfig, tenants: Vec<TenantConfig>, port: P) -> Result<Self, SchedError> {
        let bad = |reason: String| Err(SchedError::Config { reason });
        if tenants.is_empty() {
            return bad("no tenants".into());
        }
        if cfg.kv_blocks == 0 || cfg.watermark_blocks >= cfg.kv_blocks {
            return bad(format!("kv_blocks {} watermark {}", cfg.kv_blocks, cfg.watermark_blocks));
        }
        if cfg.batch_tokens_max == 0 || cfg.batch_seqs_max == 0 || cfg.chunk_tokens == Some(0) {
            return bad("zero step budget or chunk".into());
        }
        if let Some(p) = &cfg.protect {
            if cfg.policy == Policy::Fifo {
                return bad("protection needs a drr policy (fifo has no buckets)".into());
            }
            if !(0.0..=1.0).contains(&p.bucket_frac_min) || p.hold_ns_max == 0 {
                return bad(format!(
                    "protect: bucket fraction {} (0-1), hold {} ns (> 0)",
                    p.bucket_frac_min, p.hold_ns_max
                ));
            }
        }
        for t in &tenants {
            if t.concurrency_max == 0
                || t.rpm.is_nan()
                || t.rpm < 0.0
                || t.bucket_capacity.is_nan()
                || t.bucket_capacity < 1.0
            {
                return bad(format!("tenant {}: bad admission settings", t.name));
            }
        }
        let n = tenants.len();
        let tenants = tenants
            .into_iter()
            .map(|cfg| TenantState {
                bucket: TokenBucket::new(cfg.bucket_capacity, cfg.rpm / 60.0),
                cfg,
                inflight: 0,
                router: VecDeque::new(),
                ready: VecDeque::new(),
                stats: TenantStats::default(),
            })
            .collect();
        let quantum = cfg.drr_quantum_tokens;
        Ok(Self {
            blocks: BlockManager::new(cfg.kv_blocks),
            cfg,
            tenants,
            port,
            seqs: HashMap::new(),
            fifo: VecDeque::new(),
            running: Vec::new(),
            drr: [Drr::new(n, quantum), Drr::new(n, quantum)],
            plan: StepPlan::default(),
            planned: false,
            events: Vec::new(),
            done: Vec::new(),
            order: 0,
            steps: 0,
            protected: Vec::with_capacity(n),
            others_left: None,
            held_since_ns: None,
            protect_stats: ProtectStats::default(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SchedConfig {
        &self.cfg
    }

    /// The block manager (read-only).
    pub fn blocks(&self) -> &BlockManager {
        &self.blocks
    }

    /// The swap port.
    pub fn port(&self) -> &P {
        &self.port
    }

    /// Tenant names, in index order.
    pub fn tenant_names(&self) -> Vec<&str> {
        self.tenants.iter().map(|t| t.cfg.name.as_str()).collect()
    }

    /// One tenant's statistics.
    pub fn stats(&self, tenant: TenantIndex) -> Option<&TenantStats> {
        self.tenants.get(tenant).map(|t| &t.stats)
    }

    /// Live sequences (admitted, not finished).
    pub fn live(&self) -> usize {
        self.seqs.len()
    }

    /// Requests waiting at the router.
    pub fn router_queued(&self) -> usize {
        self.tenants.iter().map(|t| t.router.len()).sum()
    }

    /// Whether a stream has not produced its first token yet: admitted and waiting, or held
    /// at the router.
    pub fn waiting_first_token(&self) -> usize {
        self.router_queued() + self.seqs.values().filter(|s| s.generated == 0).count()
    }

    /// Steps scheduled so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// What latency protection did so far (zeros when it is off).
    pub fn protect_stats(&self) -> ProtectStats {
        self.protect_stats
    }

    /// Events of the last [`complete_step`](Self::complete_step) and of preemptions since.
    pub fn events(&self) -> &[SchedEvent] {
        &self.events
    }

    /// Forget the recorded events.
    pub fn clear_events(&mut self) {
        self.events.clear();
    }

    /// A request reaches the router at `now_ns` (its `arrival_ns`).
    pub fn submit(&mut self, now_ns: u64, req: Request) -> Result<Admission, SchedError> {
        let t = req.tenant;
        if t >= self.tenants.len() {
            return Err(SchedError::UnknownTenant { tenant: t });
        }
        if req.prompt_tokens == 0 || req.output_tokens == 0 {
            return Err(SchedError::BadRequest { seq: req.seq, reason: "empty prompt or output" });
        }
        let total = req.prompt_tokens.saturating_add(req.output_tokens);
        if blocks_for_tokens(total) + self.cfg.watermark_blocks > self.cfg.kv_blocks {
            return Err(SchedError::BadRequest {
                seq: req.seq,
                reason: "larger than the KV cache",
            });
        }
        if self.seqs.contains_key(&req.seq) {
            return Err(SchedError::DuplicateSeq { seq: req.seq });
        }
        self.tenants[t].stats.submitted += 1;
        if self.cfg.policy == Policy::Fifo {
            self.admit(now_ns, req);
            return Ok(Admission::Admitted);
        }
        // Keep per-tenant arrival order: nothing overtakes a request held at the router.
        if self.tenants[t].router.is_empty() && self.try_admit(now_ns, req) {
            return Ok(Admission::Admitted);
        }
        let ts = &mut self.tenants[t];
        match ts.cfg.overflow {
            Overflow::Queue { depth_max } if ts.router.len() < depth_max => {
                ts.router.push_back(req);
                ts.stats.queued += 1;
                Ok(Admission::Queued)
            }
            _ => {
                ts.stats.rejected += 1;
                Ok(Admission::Rejected)
            }
        }
    }

    /// Bucket and concurrency check; spends the bucket token only if both pass.
    fn try_admit(&mut self, now_ns: u64, req: Request) -> bool {
        let ts = &mut self.tenants[req.tenant];
        if ts.inflight >= ts.cfg.concurrency_max || !ts.bucket.has_token(now_ns) {
            return false;
        }
        ts.bucket.spend();
        self.admit(now_ns, req);
        true
    }

    fn admit(&mut self, now_ns: u64, req: Request) {
        let ts = &mut self.tenants[req.tenant];
        ts.inflight += 1;
        ts.stats.admitted += 1;
        let tier = if self.cfg.policy == Policy::Fifo { Tier::Batch } else { ts.cfg.tier };
        self.seqs.insert(
            req.seq,
            Seq {
                req,
                tier,
                admitted_ns: now_ns,
                computed: 0,
                target: req.prompt_tokens,
                generated: 0,
                state: State::Waiting,
                last_token_ns: None,
                start_order: 0,
                abort_pending: false,
            },
        );
        if self.cfg.policy == Policy::Fifo {
            self.fifo.push_back(req.seq);
        } else {
            ts.ready.push_back(req.seq);
        }
    }

    /// The earliest time something can change without a step: a swap completes, or a
    /// router-held request gets a bucket token. `None`: nothing pending.
    pub fn next_wakeup_ns(&mut self, now_ns: u64) -> Option<u64> {
        let mut next = self.port.next_completion_ns();
        for ts in &mut self.tenants {
            if !ts.router.is_empty() && ts.inflight < ts.cfg.concurrency_max {
                if let Some(t) = ts.bucket.next_token_ns(now_ns) {
                    next = Some(next.map_or(t, |n: u64| n.min(t)));
                }
            }
        }
        next
    }

    /// Form the batch for a step starting at `now_ns`. Starts swaps and preemptions as
    /// needed. An empty plan means there is nothing to run now (see
    /// [`next_wakeup_ns`](Self::next_wakeup_ns)).
    pub fn schedule(&mut self, now_ns: u64) -> Result<&StepPlan, SchedError> {
        if self.planned {
            return Err(SchedError::Protocol {
                reason: "schedule() twice without complete_step()",
            });
        }
        self.plan = StepPlan::default();
        self.poll_swaps(now_ns);
        self.fence(now_ns);
        self.retry_router(now_ns);
        if self.cfg.policy == Policy::DrrPreempt {
            self.preempt_for_interactive(now_ns);
        }
        let mut budget = self.cfg.batch_tokens_max;
        let mut seqs_left = self.cfg.batch_seqs_max;
        // Decodes first (a stall hurts them most), then the interactive tier's prefills —
        // running ones, then new ones — and only then the batch tier's, so batch prefill
        // chunks never take the token budget an interactive request is waiting for.
        self.plan_decodes(now_ns, &mut budget, &mut seqs_left);
        self.plan_protection(now_ns, budget);
        if self.cfg.policy == Policy::Fifo {
            self.plan_prefills(Tier::Batch, &mut budget, &mut seqs_left);
            self.plan_new(now_ns, &mut budget, &mut seqs_left);
            return self.finish_plan();
        }
        // Each tier's prefill work — chunks of running prefills and new starts alike — gets
        // the step's remaining budget shared across its tenants by deficit round robin.
        let blocked = self.plan_tier(now_ns, Tier::Interactive, false, &mut budget, &mut seqs_left);
        // `drr+preempt` also preempts batch work in compute: while an interactive request
        // waits for or is in its prefill, batch prefill chunks sit the step out (their
        // decodes keep running), so the step it lands in is short.
        let hold_batch = self.cfg.policy == Policy::DrrPreempt
            && self.seqs.values().any(|s| {
                s.tier == Tier::Interactive
                    && s.generated == 0
                    && matches!(s.state, State::Waiting | State::Running)
            });
        if !hold_batch {
            // An interactive start waiting for blocks keeps batch starts out (it keeps what
            // preemption freed); running batch prefills still get their chunks.
            self.plan_tier(now_ns, Tier::Batch, blocked, &mut budget, &mut seqs_left);
        }
        self.finish_plan()
    }

    fn finish_plan(&mut self) -> Result<&StepPlan, SchedError> {
        debug_assert_eq!(self.blocks.accounted(), self.blocks.total());
        if !self.plan.is_empty() {
            self.planned = true;
            self.steps += 1;
        }
        Ok(&self.plan)
    }

    fn poll_swaps(&mut self, now_ns: u64) {
        let mut done = std::mem::take(&mut self.done);
        done.clear();
        self.port.poll(now_ns, &mut done);
        for d in &done {
            let Some(seq) = self.seqs.get_mut(&d.seq) else { continue };
            match (d.dir, std::mem::replace(&mut seq.state, State::Waiting)) {
                (SwapDir::Out, State::SwappingOut(pinned)) => {
                    self.blocks.unpin(pinned);
                    if d.ok {
                        seq.state = State::SwappedOut;
                    } else {
                        // The host copy failed: the KV is gone from the device's point of
                        // view once unpinned, so recompute it.
                        seq.target = seq.computed.max(seq.target);
                        seq.computed = 0;
                        self.port.drop_seq(d.seq);
                    }
                    let t = seq.req.tenant;
                    self.requeue_front(t, d.seq);
                }
                (SwapDir::In, State::SwappingIn) => {
                    if d.ok {
                        seq.state = State::Running;
                        self.running.push(d.seq);
                    } else {
                        self.blocks.release(d.seq);
                        seq.target = seq.computed.max(seq.target);
                        seq.computed = 0;
                        self.port.drop_seq(d.seq);
                        let t = seq.req.tenant;
                        self.requeue_front(t, d.seq);
                    }
                }
                (_, other) => seq.state = other,
            }
            if self.seqs.get(&d.seq).is_some_and(|s| {
                s.abort_pending && !matches!(s.state, State::SwappingOut(_) | State::SwappingIn)
            }) {
                self.finish_as(d.seq, Ending::Aborted);
            }
        }
        self.done = done;
    }

    fn requeue_front(&mut self, tenant: TenantIndex, seq: SeqId) {
        if self.cfg.policy == Policy::Fifo {
            self.fifo.push_front(seq);
        } else {
            self.tenants[tenant].ready.push_front(seq);
        }
    }

    fn fence(&mut self, now_ns: u64) {
        let Some(limit) = self.cfg.stream_ns_max else { return };
        let expired: Vec<SeqId> = self
            .seqs
            .values()
            .filter(|s| now_ns.saturating_sub(s.admitted_ns) > limit)
            .filter(|s| matches!(s.state, State::Running | State::Waiting | State::SwappedOut))
            .map(|s| s.req.seq)
            .collect();
        for seq in expired {
            self.finish(seq, true);
        }
    }

    fn retry_router(&mut self, now_ns: u64) {
        for t in 0..self.tenants.len() {
            // Bounded by the queue length.
            while let Some(&req) = self.tenants[t].router.front() {
                if !self.try_admit(now_ns, req) {
                    break;
                }
                self.tenants[t].router.pop_front();
            }
        }
    }

    /// The interactive request that would start next (the first interactive tenant, from
    /// the DRR cursor, with a request ready to start), without taking it.
    fn peek_interactive(&self) -> Option<SeqId> {
        let tenants = &self.tenants;
        let t = self.drr[tier_index(Tier::Interactive)].peek(|t| {
            let ts = &tenants[t];
            (ts.cfg.tier == Tier::Interactive && !ts.ready.is_empty()).then_some(0)
        })?;
        self.tenants[t].ready.front().copied()
    }

    /// Blocks a waiting sequence needs to start (or resume).
    fn start_need(&self, seq: SeqId) -> u32 {
        // A swapped-out sequence comes back into blocks for what it computed and needs the
        // rest of its prefill (if it was preempted mid-prefill) or its next token too.
        match self.seqs.get(&seq) {
            Some(s) => blocks_for_tokens(s.target.max(s.computed + 1)),
            None => 0,
        }
    }

    /// `drr+preempt`: if the next interactive request cannot get blocks, free them by
    /// preempting batch sequences, cheapest first.
    fn preempt_for_interactive(&mut self, now_ns: u64) {
        let Some(cand) = self.peek_interactive() else { return };
        let need = self.start_need(cand) + self.cfg.watermark_blocks;
        // Blocks pinned by swap-outs come back on their own; count them as on the way.
        let have = self.blocks.free() + self.blocks.pinned();
        if have >= need {
            return;
        }
        let mut short = need - have;
        let mut victims: Vec<(f64, u64, SeqId, u32)> = self
            .running
            .iter()
            .filter_map(|id| self.seqs.get(id))
            .filter(|s| s.tier == Tier::Batch && matches!(s.state, State::Running))
            .map(|s| {
                let c = &self.cfg.preempt;
                let cost = c.recompute_ns(s.computed).min(c.swap_round_trip_ns(s.computed));
                let held = self.blocks.table(s.req.seq).map_or(0, |t| t.len() as u32);
                (cost, u64::MAX - s.start_order, s.req.seq, held)
            })
            .collect();
        // Cheapest first; newest first among equals.
        victims.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        for (_, _, seq, held) in victims {
            if short == 0 {
                break;
            }
            self.preempt(now_ns, seq);
            short = short.saturating_sub(held);
        }
    }

    /// Preempt a running sequence: swap or recompute by the cost model.
    fn preempt(&mut self, now_ns: u64, id: SeqId) {
        self.running.retain(|&r| r != id);
        let Some(seq) = self.seqs.get_mut(&id) else { return };
        let c = self.cfg.preempt;
        let tokens = seq.computed;
        let bytes = u64::from(blocks_for_tokens(tokens)) * c.block_bytes();
        let t = seq.req.tenant;
        let swap = tokens > 0
            && c.swap_round_trip_ns(tokens) < c.recompute_ns(tokens)
            && self.port.can_hold(bytes);
        let mut mode = PreemptMode::Recompute;
        if swap {
            // Only the blocks that hold KV travel; prompt blocks not yet filled are freed.
            let _ = self.blocks.truncate(id, tokens);
            if let Ok(pinned) = self.blocks.pin(id) {
                match self.port.swap_out(now_ns, id, pinned.blocks()) {
                    Ok(()) => {
                        seq.state = State::SwappingOut(pinned);
                        mode = PreemptMode::Swap;
                        self.tenants[t].stats.swap_out_bytes += bytes;
                    }
                    Err(_) => self.blocks.unpin(pinned),
                }
            }
        }
        let stats = &mut self.tenants[t].stats;
        match mode {
            PreemptMode::Swap => stats.preempted_swap += 1,
            PreemptMode::Recompute => {
                stats.preempted_recompute += 1;
                self.blocks.release(id);
                seq.target = seq.target.max(seq.computed);
                seq.computed = 0;
                seq.state = State::Waiting;
                self.requeue_front(t, id);
            }
        }
        self.events.push(SchedEvent::Preempted { seq: id, tenant: t, mode });
    }

    /// Running sequences in service order: interactive first, then oldest start first.
    fn running_in_order(&self) -> Vec<SeqId> {
        let mut order: Vec<(usize, u64, SeqId)> = self
            .running
            .iter()
            .filter_map(|id| self.seqs.get(id))
            .map(|s| (tier_index(s.tier), s.start_order, s.req.seq))
            .collect();
        order.sort_unstable();
        order.into_iter().map(|(_, _, id)| id).collect()
    }

    fn push_item(&mut self, seq: SeqId, kind: StepKind) {
        let Some(s) = self.seqs.get(&seq) else { return };
        self.plan.items.push(StepItem {
            seq,
            tenant: s.req.tenant,
            kind,
            context_tokens: s.computed,
        });
        match kind {
            StepKind::Decode => self.plan.decode_tokens += 1,
            StepKind::Prefill { tokens } => self.plan.prefill_tokens += tokens,
        }
    }

    fn chunk_for(&self, remaining: u32, budget: u32) -> u32 {
        match self.cfg.chunk_tokens {
            Some(chunk) => remaining.min(chunk).min(budget),
            // Whole prefill: one prompt per step may exceed the budget.
            None if self.plan.prefill_tokens == 0 => remaining,
            None => {
                if remaining <= budget {
                    remaining
                } else {
                    0
                }
            }
        }
    }

    /// [`chunk_for`](Self::chunk_for), except that a `capped` tenant's chunk never exceeds
    /// `budget` (a whole prompt does not get the "first prefill may exceed" exception).
    fn chunk_capped(&self, remaining: u32, budget: u32, capped: bool) -> u32 {
        if !capped {
            return self.chunk_for(remaining, budget);
        }
        match self.cfg.chunk_tokens {
            Some(chunk) => remaining.min(chunk).min(budget),
            None if remaining <= budget => remaining,
            None => 0,
        }
    }

    /// Latency protection: decide which tenants are protected this step and whether the
    /// cap on the others' prefill tokens applies (see [`ProtectConfig`]). `budget` is what
    /// the decodes left.
    fn plan_protection(&mut self, now_ns: u64, budget: u32) {
        self.protected.clear();
        self.others_left = None;
        let Some(p) = self.cfg.protect else { return };
        if self.cfg.policy == Policy::Fifo {
            return;
        }
        for ts in &mut self.tenants {
            let fill = ts.bucket.tokens(now_ns) / ts.bucket.capacity();
            self.protected.push(ts.cfg.tier == Tier::Interactive && fill >= p.bucket_frac_min);
        }
        // Prefill work for this step: a running prefill, or a request at the head of a
        // ready queue. A protected tenant's request counts only if it can start now (blocks
        // free, not a swap-in): the cap must not hold the others back for nothing.
        let mut protected_work = false;
        let mut others_work = false;
        for s in self.seqs.values() {
            let t = s.req.tenant;
            if matches!(s.state, State::Running) && s.computed < s.target {
                if self.protected[t] {
                    protected_work = true;
                } else {
                    others_work = true;
                }
            }
        }
        for (t, ts) in self.tenants.iter().enumerate() {
            let Some(&id) = ts.ready.front() else { continue };
            if !self.protected[t] {
                others_work = true;
            } else if !protected_work {
                let swap_in =
                    self.seqs.get(&id).is_some_and(|s| matches!(s.state, State::SwappedOut));
                protected_work = !swap_in && self.start_chunk(id, budget, false).is_some();
            }
        }
        if !protected_work || !others_work {
            self.held_since_ns = None;
            return;
        }
        let since = *self.held_since_ns.get_or_insert(now_ns);
        if now_ns.saturating_sub(since) >= p.hold_ns_max {
            // Starvation bound: this step is work-conserving, then the cap starts again.
            self.held_since_ns = None;
            self.protect_stats.released_steps += 1;
            return;
        }
        self.protect_stats.capped_steps += 1;
        self.others_left = Some(p.others_prefill_tokens_max);
    }

    /// Whether tenant `t`'s prefill is under the protection cap this step.
    fn capped(&self, t: TenantIndex) -> bool {
        self.others_left.is_some() && !self.protected.get(t).copied().unwrap_or(false)
    }

    /// Count `tokens` of tenant `t`'s prefill against the protection cap, if it is capped.
    fn charge_cap(&mut self, t: TenantIndex, tokens: u32) {
        if self.capped(t) {
            if let Some(left) = &mut self.others_left {
                *left = left.saturating_sub(tokens);
            }
        }
    }

    fn plan_decodes(&mut self, now_ns: u64, budget: &mut u32, seqs_left: &mut u32) {
        let order = self.running_in_order();
        let mut i = 0;
        while i < order.len() {
            let id = order[i];
            i += 1;
            if *seqs_left == 0 || *budget == 0 {
                break;
            }
            let Some(s) = self.seqs.get(&id) else { continue };
            if !s.decode_ready() || !self.running.contains(&id) {
                continue;
            }
            let need_tokens = s.computed + 1;
            let my_tier = s.tier;
            // Bounded: each pass preempts one sequence.
            let mut granted = false;
            for _ in 0..=order.len() {
                if self.blocks.grow(id, need_tokens).is_ok() {
                    granted = true;
                    break;
                }
                // Out of blocks: preempt the newest lowest-tier sequence not yet planned.
                let victim = order[i..]
                    .iter()
                    .rev()
                    .copied()
                    .find(|v| self.running.contains(v))
                    .filter(|v| tier_index(self.seqs[v].tier) >= tier_index(my_tier))
                    .unwrap_or(id);
                self.preempt(now_ns, victim);
                if victim == id || self.blocks.free() == 0 {
                    break;
                }
            }
            if granted && self.running.contains(&id) {
                self.push_item(id, StepKind::Decode);
                *budget -= 1;
                *seqs_left -= 1;
            }
        }
    }

    /// Prefills already under way, of one tier.
    fn plan_prefills(&mut self, tier: Tier, budget: &mut u32, seqs_left: &mut u32) {
        for id in self.running_in_order() {
            if *seqs_left == 0 || *budget == 0 {
                break;
            }
            let Some(s) = self.seqs.get(&id) else { continue };
            if s.tier != tier || !matches!(s.state, State::Running) || s.computed >= s.target {
                continue;
            }
            if !self.running.contains(&id) {
                continue;
            }
            let chunk = self.chunk_for(s.target - s.computed, *budget);
            let end = s.computed + chunk;
            // The chunk's positions must have blocks (a no-op when they do already).
            if chunk == 0 || self.blocks.grow(id, end).is_err() {
                continue;
            }
            self.push_item(id, StepKind::Prefill { tokens: chunk });
            *budget = budget.saturating_sub(chunk);
            *seqs_left -= 1;
        }
    }

    /// Policy `fifo`: start new sequences in arrival order while blocks and budget last.
    fn plan_new(&mut self, now_ns: u64, budget: &mut u32, seqs_left: &mut u32) {
        // Bounded by the number of live sequences: each pass starts one or stops.
        for _ in 0..=self.seqs.len() {
            if *seqs_left == 0 || *budget == 0 {
                return;
            }
            let Some(id) = self.fifo.front().copied() else { return };
            let Some(chunk) = self.start_chunk(id, *budget, false) else { return };
            self.fifo.pop_front();
            self.start(now_ns, id, chunk, budget, seqs_left);
        }
    }

    /// The chunk `id` would start with (0: a swap-in), or `None` if it cannot start now
    /// (no blocks, or a whole prompt that does not fit the budget left).
    fn start_chunk(&self, id: SeqId, budget: u32, capped: bool) -> Option<u32> {
        let s = self.seqs.get(&id)?;
        if self.blocks.free() < self.start_need(id) + self.cfg.watermark_blocks {
            return None;
        }
        if matches!(s.state, State::SwappedOut) {
            return Some(0);
        }
        let chunk = self.chunk_capped(s.target.saturating_sub(s.computed), budget, capped);
        (chunk > 0).then_some(chunk)
    }

    /// Start (or resume) `id`, already taken off its queue; `chunk` from
    /// [`start_chunk`](Self::start_chunk).
    fn start(&mut self, now_ns: u64, id: SeqId, chunk: u32, budget: &mut u32, seqs_left: &mut u32) {
        self.order += 1;
        let order = self.order;
        let Some(s) = self.seqs.get_mut(&id) else { return };
        s.start_order = order;
        if matches!(s.state, State::SwappedOut) {
            let tokens = s.computed;
            let t = s.req.tenant;
            // Cannot fail: free >= need checked by start_chunk.
            let _ = self.blocks.grow(id, tokens);
            let table = self.blocks.table(id).unwrap_or(&[]).to_vec();
            // Reserve the rest: the prefill left when it was preempted mid-prefill, or the
            // next token's block (appended after the table the copy lands in).
            let _ = self.blocks.grow(id, s.target.max(tokens + 1));
            match self.port.swap_in(now_ns, id, &table) {
                Ok(()) => {
                    s.state = State::SwappingIn;
                    let bytes = table.len() as u64 * self.cfg.preempt.block_bytes();
                    self.tenants[t].stats.swap_in_bytes += bytes;
                }
                Err(_) => {
                    // The host copy is unusable: recompute instead.
                    self.blocks.release(id);
                    self.port.drop_seq(id);
                    s.target = s.target.max(s.computed);
                    s.computed = 0;
                    s.state = State::Waiting;
                    self.requeue_front(t, id);
                }
            }
            return;
        }
        let target = s.target;
        // Cannot fail: free >= need checked by start_chunk.
        let _ = self.blocks.grow(id, target);
        s.state = State::Running;
        self.running.push(id);
        self.push_item(id, StepKind::Prefill { tokens: chunk });
        *budget = budget.saturating_sub(chunk);
        *seqs_left -= 1;
    }

    /// Policies `drr` and `drr+preempt`: the prefill work of one tier. Each tenant's work is
    /// its running prefills (oldest first), then the requests of its ready queue; deficit
    /// round robin across tenants, on chunk tokens, decides whose next chunk goes into the
    /// step until the budget or the sequence limit runs out. So a tenant with a request
    /// waiting gets its share of this very step, however many prefills another tenant has
    /// under way. A start that cannot get blocks stops all starts of the tier for this step
    /// (nothing smaller behind it takes the blocks it waits for); `starts_blocked` passes
    /// that in from the interactive tier, and the return value passes it on.
    fn plan_tier(
        &mut self,
        now_ns: u64,
        tier: Tier,
        mut starts_blocked: bool,
        budget: &mut u32,
        seqs_left: &mut u32,
    ) -> bool {
        let n = self.tenants.len();
        let mut running: Vec<VecDeque<SeqId>> = vec![VecDeque::new(); n];
        for id in self.running_in_order() {
            let Some(s) = self.seqs.get(&id) else { continue };
            if s.tier == tier && matches!(s.state, State::Running) && s.computed < s.target {
                running[s.req.tenant].push_back(id);
            }
        }
        // Each pass plans one item, drops one running prefill that cannot go this step, or
        // blocks the starts; so the bound is never reached before the work runs out.
        let mut heads: Vec<Option<(SeqId, u32, bool)>> = vec![None; n];
        for _ in 0..(2 * self.seqs.len() + n + 2) {
            if *seqs_left == 0 || *budget == 0 {
                break;
            }
            for (t, head) in heads.iter_mut().enumerate() {
                *head = None;
                if self.tenants[t].cfg.tier != tier {
                    continue;
                }
                // Under the protection cap a tenant's chunks fit what the cap leaves.
                let capped = self.capped(t);
                let budget = match self.others_left {
                    Some(left) if capped => left.min(*budget),
                    _ => *budget,
                };
                // Running prefills whose chunk does not fit (whole-prompt mode, or the
                // protection cap) sit out.
                while let Some(&id) = running[t].front() {
                    let left = self.seqs.get(&id).map_or(0, |s| s.target - s.computed);
                    let chunk = self.chunk_capped(left, budget, capped);
                    if chunk > 0 {
                        *head = Some((id, chunk, false));
                        break;
                    }
                    running[t].pop_front();
                }
                if head.is_none() && !starts_blocked {
                    if let Some(&id) = self.tenants[t].ready.front() {
                        let s = &self.seqs[&id];
                        let chunk = if matches!(s.state, State::SwappedOut) {
                            0
                        } else {
                            self.chunk_capped(s.target.saturating_sub(s.computed), budget, capped)
                        };
                        let swapped = matches!(s.state, State::SwappedOut);
                        if swapped || chunk > 0 {
                            *head = Some((id, chunk, true));
                        }
                    }
                }
            }
            let drr = &mut self.drr[tier_index(tier)];
            let Some(t) = drr.pick(|t| heads[t].map(|(_, chunk, _)| u64::from(chunk))) else {
                break;
            };
            let Some((id, chunk, is_start)) = heads[t] else { break };
            if !is_start {
                running[t].pop_front();
                let end = self.seqs.get(&id).map_or(0, |s| s.computed + chunk);
                // The chunk's positions must have blocks (a no-op when they do already).
                if self.blocks.grow(id, end).is_err() {
                    continue;
                }
                let drr = &mut self.drr[tier_index(tier)];
                drr.charge(t, u64::from(chunk));
                self.charge_cap(t, chunk);
                self.push_item(id, StepKind::Prefill { tokens: chunk });
                *budget = budget.saturating_sub(chunk);
                *seqs_left -= 1;
                continue;
            }
            // The head's chunk already fits what the protection cap leaves.
            let capped = self.capped(t);
            let start_budget = if capped { (*budget).min(chunk) } else { *budget };
            match self.start_chunk(id, start_budget, capped) {
                Some(chunk) => {
                    self.drr[tier_index(tier)].charge(t, u64::from(chunk));
                    self.charge_cap(t, chunk);
                    self.tenants[t].ready.pop_front();
                    self.start(now_ns, id, chunk, budget, seqs_left);
                }
                // Wait for blocks; nothing behind it may take them (no starvation by
                // smaller requests, and the interactive tier keeps what preemption freed).
                None => starts_blocked = true,
            }
        }
        starts_blocked
    }

    /// Ends a request before its last token (client gone, stop string, end-of-sequence
    /// token), at a step boundary: frees its slot and blocks and drops its swapped-out copy.
    /// A request still at the router leaves the queue. One whose swap is in flight ends when
    /// the swap completes (its blocks are pinned until then). Returns whether the request was
    /// known. Counted in [`TenantStats::aborted`]; emits `Finished { fenced: false }`.
    pub fn abort(&mut self, seq: SeqId) -> Result<bool, SchedError> {
        if self.planned {
            return Err(SchedError::Protocol {
                reason: "abort() between schedule() and complete_step()",
            });
        }
        for ts in &mut self.tenants {
            if let Some(i) = ts.router.iter().position(|r| r.seq == seq) {
                ts.router.remove(i);
                ts.stats.aborted += 1;
                return Ok(true);
            }
        }
        let Some(s) = self.seqs.get_mut(&seq) else { return Ok(false) };
        if matches!(s.state, State::SwappingOut(_) | State::SwappingIn) {
            s.abort_pending = true;
        } else {
            self.finish_as(seq, Ending::Aborted);
        }
        Ok(true)
    }

    /// Preempts a running sequence now, at a step boundary, by `mode` (`None`: the cost
    /// model decides, as for any preemption). For operators and tests that force preemption
    /// at chosen boundaries. Returns whether the sequence was running.
    pub fn preempt_now(
        &mut self,
        now_ns: u64,
        seq: SeqId,
        mode: Option<PreemptMode>,
    ) -> Result<bool, SchedError> {
        if self.planned {
            return Err(SchedError::Protocol { reason: "preempt_now() inside a step" });
        }
        if !self.running.contains(&seq)
            || !self.seqs.get(&seq).is_some_and(|s| matches!(s.state, State::Running))
        {
            return Ok(false);
        }
        let saved = self.cfg.preempt;
        match mode {
            Some(PreemptMode::Swap) => {
                self.cfg.preempt.prefill_ns_per_token = f64::MAX / 1e6;
            }
            Some(PreemptMode::Recompute) => self.cfg.preempt.prefill_ns_per_token = 0.0,
            None => {}
        }
        self.preempt(now_ns, seq);
        self.cfg.preempt = saved;
        Ok(true)
    }

    /// Replaces the swap-or-recompute cost model (an engine that measures its own costs
    /// while it runs).
    pub fn set_preempt_costs(&mut self, costs: PreemptCosts) {
        self.cfg.preempt = costs;
    }

    /// Whether `seq` is live (admitted and not finished).
    pub fn is_live(&self, seq: SeqId) -> bool {
        self.seqs.contains_key(&seq)
    }

    /// The step planned by [`schedule`](Self::schedule) finished at `now_ns`: emit tokens,
    /// finish streams, record latencies. Returns the events.
    pub fn complete_step(&mut self, now_ns: u64) -> Result<&[SchedEvent], SchedError> {
        if !self.planned {
            return Err(SchedError::Protocol { reason: "complete_step() without a planned step" });
        }
        self.planned = false;
        let items = std::mem::take(&mut self.plan.items);
        for item in &items {
            let Some(s) = self.seqs.get_mut(&item.seq) else { continue };
            if !matches!(s.state, State::Running) {
                continue;
            }
            let emit = match item.kind {
                StepKind::Prefill { tokens } => {
                    s.computed += tokens;
                    self.tenants[item.tenant].stats.prefill_tokens += u64::from(tokens);
                    s.computed >= s.target && s.generated == 0
                }
                StepKind::Decode => {
                    s.computed += 1;
                    true
                }
            };
            if !emit {
                continue;
            }
            s.generated += 1;
            let first = s.last_token_ns.is_none();
            let since = s.last_token_ns.unwrap_or(s.req.arrival_ns);
            let gap_ns = now_ns.saturating_sub(since);
            s.last_token_ns = Some(now_ns);
            let done = s.generated >= s.req.output_tokens;
            let stats = &mut self.tenants[item.tenant].stats;
            stats.output_tokens += 1;
            if first {
                record(&mut stats.ttft, gap_ns);
            } else {
                record(&mut stats.token_gap, gap_ns);
            }
            self.events.push(SchedEvent::Token {
                seq: item.seq,
                tenant: item.tenant,
                first,
                gap_ns,
                at_ns: now_ns,
            });
            if done {
                self.finish(item.seq, false);
            }
        }
        self.plan.items = items;
        self.plan.items.clear();
        Ok(&self.events)
    }

    fn finish(&mut self, id: SeqId, fenced: bool) {
        self.finish_as(id, if fenced { Ending::Fenced } else { Ending::Done });
    }

    fn finish_as(&mut self, id: SeqId, how: Ending) {
        let fenced = how == Ending::Fenced;
        let Some(s) = self.seqs.remove(&id) else { return };
        self.blocks.release(id);
        self.running.retain(|&r| r != id);
        if matches!(s.state, State::SwappedOut) {
            self.port.drop_seq(id);
        }
        if self.cfg.policy == Policy::Fifo {
            self.fifo.retain(|&q| q != id);
        } else {
            self.tenants[s.req.tenant].ready.retain(|&q| q != id);
        }
        let ts = &mut self.tenants[s.req.tenant];
        ts.inflight -= 1;
        match how {
            Ending::Fenced => ts.stats.fenced += 1,
            Ending::Done => ts.stats.completed += 1,
            Ending::Aborted => ts.stats.aborted += 1,
        }
        self.events.push(SchedEvent::Finished { seq: id, tenant: s.req.tenant, fenced });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn costs() -> PreemptCosts {
        PreemptCosts {
            prefill_ns_per_token: 100_000.0,
            swap_ns_per_byte: 0.04,
            swap_fixed_ns: 100_000,
            kv_bytes_per_token: 131_072,
        }
    }

    fn cfg(policy: Policy, kv_blocks: u32) -> SchedConfig {
        SchedConfig {
            policy,
            kv_blocks,
            watermark_blocks: 1,
            chunk_tokens: Some(512),
            batch_tokens_max: 2048,
            batch_seqs_max: 256,
            drr_quantum_tokens: 512,
            stream_ns_max: None,
            preempt: costs(),
            protect: None,
        }
    }

    fn tenant(
        name: &str,
        tier: Tier,
        cap: f64,
        rpm: f64,
        conc: u32,
        overflow: Overflow,
    ) -> TenantConfig {
        TenantConfig {
            name: name.into(),
            tier,
            bucket_capacity: cap,
            rpm,
            concurrency_max: conc,
            overflow,
        }
    }

    fn port() -> InstantPort {
        InstantPort::new(131_072 * 16, 0.04, 100_000, 1 << 40)
    }

    fn req(seq: u64, tenant: TenantIndex, prompt: u32, out: u32, at: u64) -> Request {
        Request {
            seq: SeqId(seq),
            tenant,
            prompt_tokens: prompt,
            output_tokens: out,
            arrival_ns: at,
        }
    }

    /// Run steps of 10 ms until idle or `steps_max`.
    fn drain<P: SwapPort>(s: &mut Scheduler<P>, mut now: u64, steps_max: u32) -> u64 {
        for _ in 0..steps_max {
            let empty = s.schedule(now).unwrap().is_empty();
            if empty {
                match s.next_wakeup_ns(now) {
                    Some(t) => {
                        now = t.max(now + 1);
                        continue;
                    }
                    None => return now,
                }
            }
            now += 10_000_000;
            s.complete_step(now).unwrap();
        }
        now
    }

    #[test]
    fn bucket_pass_but_concurrency_fail_keeps_the_token() {
        let t = tenant("a", Tier::Interactive, 2.0, 0.0, 1, Overflow::Reject);
        let mut s = Scheduler::new(cfg(Policy::Drr, 1000), vec![t], port()).unwrap();
        assert_eq!(s.submit(0, req(1, 0, 16, 4, 0)).unwrap(), Admission::Admitted);
        // Slot taken: rejected, and the bucket still has its second token.
        assert_eq!(s.submit(0, req(2, 0, 16, 4, 0)).unwrap(), Admission::Rejected);
        drain(&mut s, 0, 100);
        assert_eq!(s.stats(0).unwrap().completed, 1);
        assert_eq!(s.submit(1, req(3, 0, 16, 4, 1)).unwrap(), Admission::Admitted);
        drain(&mut s, 1, 100);
        // Now both tokens are spent (rpm 0: no refill).
        assert_eq!(s.submit(2, req(4, 0, 16, 4, 2)).unwrap(), Admission::Rejected);
        let st = s.stats(0).unwrap();
        assert_eq!((st.admitted, st.rejected, st.completed), (2, 2, 2));
    }

    #[test]
    fn router_queue_admits_when_the_bucket_refills() {
        let t = tenant("a", Tier::Interactive, 1.0, 60.0, 8, Overflow::Queue { depth_max: 4 });
        let mut s = Scheduler::new(cfg(Policy::Drr, 1000), vec![t], port()).unwrap();
        assert_eq!(s.submit(0, req(1, 0, 16, 2, 0)).unwrap(), Admission::Admitted);
        assert_eq!(s.submit(0, req(2, 0, 16, 2, 0)).unwrap(), Admission::Queued);
        let end = drain(&mut s, 0, 1000);
        assert!(end >= 1_000_000_000, "second request waited for the refill: {end}");
        let st = s.stats(0).unwrap();
        assert_eq!(st.completed, 2);
        // Its TTFT counts the router wait (≈ 1 s).
        assert!(st.ttft.max() >= 1_000_000_000);
    }

    #[test]
    fn chunked_prefill_splits_a_long_prompt_and_decodes_keep_running() {
        let t = tenant("a", Tier::Interactive, 100.0, 6000.0, 100, Overflow::Reject);
        let mut s = Scheduler::new(cfg(Policy::Drr, 10_000), vec![t], port()).unwrap();
        s.submit(0, req(1, 0, 16, 100, 0)).unwrap();
        let _ = s.schedule(0).unwrap();
        s.complete_step(1).unwrap();
        s.submit(1, req(2, 0, 2000, 1, 1)).unwrap();
        let mut prefill_chunks = Vec::new();
        for k in 0..5u64 {
            let plan = s.schedule(2 + k).unwrap();
            assert!(plan.items.iter().any(|i| i.kind == StepKind::Decode), "decode every step");
            prefill_chunks.extend(plan.items.iter().filter_map(|i| match i.kind {
                StepKind::Prefill { tokens } => Some(tokens),
                StepKind::Decode => None,
            }));
            s.complete_step(3 + k).unwrap();
        }
        assert_eq!(&prefill_chunks[..4], &[512, 512, 512, 464]);
    }

    #[test]
    fn interactive_preempts_batch_by_swap_and_batch_resumes() {
        let tenants = vec![
            tenant("chat", Tier::Interactive, 10.0, 600.0, 10, Overflow::Reject),
            tenant("batch", Tier::Batch, 10.0, 600.0, 10, Overflow::Reject),
        ];
        // 100 blocks: the batch job (1200 + 64 tokens = 79 blocks) leaves too few for chat.
        let mut s = Scheduler::new(cfg(Policy::DrrPreempt, 100), tenants, port()).unwrap();
        s.submit(0, req(1, 1, 1200, 64, 0)).unwrap();
        let mut now = 0;
        for _ in 0..5 {
            let _ = s.schedule(now).unwrap();
            now += 10_000_000;
            s.complete_step(now).unwrap();
        }
        s.submit(now, req(2, 0, 400, 4, now)).unwrap();
        let end = drain(&mut s, now, 10_000);
        let chat = s.stats(0).unwrap();
        let batch = s.stats(1).unwrap();
        assert_eq!(chat.completed, 1);
        assert_eq!(batch.completed, 1, "batch job resumed and finished");
        assert_eq!(batch.preempted_swap, 1);
        assert!(batch.swap_out_bytes > 0 && batch.swap_in_bytes == batch.swap_out_bytes);
        assert!(chat.ttft.max() < 100_000_000, "chat waited {} ns", chat.ttft.max());
        assert!(end > now);
        assert_eq!(s.blocks().free(), 100);
    }

    #[test]
    fn without_preemption_interactive_waits_for_the_batch_job() {
        let tenants = vec![
            tenant("chat", Tier::Interactive, 10.0, 600.0, 10, Overflow::Reject),
            tenant("batch", Tier::Batch, 10.0, 600.0, 10, Overflow::Reject),
        ];
        let mut s = Scheduler::new(cfg(Policy::Drr, 100), tenants, port()).unwrap();
        s.submit(0, req(1, 1, 1200, 64, 0)).unwrap();
        let mut now = 0;
        for _ in 0..5 {
            let _ = s.schedule(now).unwrap();
            now += 10_000_000;
            s.complete_step(now).unwrap();
        }
        s.submit(now, req(2, 0, 400, 4, now)).unwrap();
        drain(&mut s, now, 10_000);
        let chat = s.stats(0).unwrap();
        assert_eq!(s.stats(1).unwrap().preemptions(), 0);
        assert!(chat.ttft.max() > 500_000_000, "chat waited only {} ns", chat.ttft.max());
    }

    #[test]
    fn fence_ends_runaway_streams_and_frees_the_slot() {
        let t = tenant("a", Tier::Interactive, 10.0, 600.0, 1, Overflow::Queue { depth_max: 4 });
        let mut c = cfg(Policy::Drr, 10_000);
        c.stream_ns_max = Some(200_000_000);
        let mut s = Scheduler::new(c, vec![t], port()).unwrap();
        s.submit(0, req(1, 0, 16, 1_000_000, 0)).unwrap_err();
        s.submit(0, req(1, 0, 16, 10_000, 0)).unwrap();
        s.submit(0, req(2, 0, 16, 4, 0)).unwrap();
        drain(&mut s, 0, 10_000);
        let st = s.stats(0).unwrap();
        assert_eq!((st.fenced, st.completed), (1, 1));
        assert_eq!(s.live(), 0);
    }

    #[test]
    fn a_waiting_quiet_prefill_gets_its_share_of_the_next_step() {
        // The flooder has eight long prefills under way: its chunks alone would fill every
        // step's 2,048-token budget for many steps. The quiet tenant's request must get a
        // chunk in the very next step (DRR over the step's prefill budget), not wait behind
        // the flooder's admitted chunks.
        let tenants = vec![
            tenant("flood", Tier::Interactive, 1e9, 1e9, 1000, Overflow::Reject),
            tenant("quiet", Tier::Interactive, 1e9, 1e9, 1000, Overflow::Reject),
        ];
        let mut s = Scheduler::new(cfg(Policy::Drr, 10_000), tenants, port()).unwrap();
        for i in 0..8 {
            s.submit(0, req(i, 0, 8000, 4, 0)).unwrap();
        }
        let mut now = 0;
        for _ in 0..2 {
            let _ = s.schedule(now).unwrap();
            now += 10_000_000;
            s.complete_step(now).unwrap();
        }
        s.submit(now, req(100, 1, 2000, 4, now)).unwrap();
        let plan = s.schedule(now).unwrap();
        let quiet = tenant_tokens(plan, 1).0;
        assert_eq!(quiet, 512, "quiet chunk in the next step: {plan:?}");
        assert_eq!(plan.prefill_tokens, 2048, "the flooder gets the rest (work conserving)");
    }

    #[test]
    fn drr_shares_the_engine_between_a_flooder_and_a_quiet_tenant() {
        let tenants = vec![
            tenant("flood", Tier::Interactive, 1e9, 1e9, 1000, Overflow::Reject),
            tenant("quiet", Tier::Interactive, 1e9, 1e9, 1000, Overflow::Reject),
        ];
        let mut c = cfg(Policy::Drr, 400);
        c.batch_seqs_max = 4;
        let mut s = Scheduler::new(c, tenants, port()).unwrap();
        for i in 0..200 {
            s.submit(0, req(i, 0, 256, 8, 0)).unwrap();
        }
        s.submit(0, req(1000, 1, 256, 8, 0)).unwrap();
        let mut now = 0;
        let mut quiet_first = None;
        for step in 0..400 {
            let _ = s.schedule(now).unwrap();
            now += 10_000_000;
            s.complete_step(now).unwrap();
            if s.stats(1).unwrap().ttft.len() == 1 {
                quiet_first = Some(step);
                break;
            }
        }
        assert!(quiet_first.unwrap() < 10, "quiet tenant served at step {quiet_first:?}");
    }
    /// Prefill tokens of `tenant` in `plan`, and its decodes.
    fn tenant_tokens(plan: &StepPlan, tenant: TenantIndex) -> (u32, u32) {
        plan.items.iter().filter(|i| i.tenant == tenant).fold((0, 0), |(p, d), i| match i.kind {
            StepKind::Prefill { tokens } => (p + tokens, d),
            StepKind::Decode => (p, d + 1),
        })
    }

    /// A flooder that spent its whole bucket (8 admissions, no refill: unprotected) with two
    /// streams decoding and six long prefills under way, and a quiet tenant with a full
    /// bucket. Returns the scheduler and the time after the flooder's first steps.
    fn flooder_and_quiet(protect: Option<ProtectConfig>) -> (Scheduler<InstantPort>, u64) {
        let tenants = vec![
            tenant("flood", Tier::Interactive, 8.0, 0.0, 1000, Overflow::Reject),
            tenant("quiet", Tier::Interactive, 10.0, 60.0, 1000, Overflow::Reject),
        ];
        let mut c = cfg(Policy::Drr, 10_000);
        c.protect = protect;
        let mut s = Scheduler::new(c, tenants, port()).unwrap();
        for i in 0..2 {
            s.submit(0, req(i, 0, 16, 1000, 0)).unwrap();
        }
        for i in 2..8 {
            s.submit(0, req(i, 0, 8000, 4, 0)).unwrap();
        }
        let mut now = 0;
        for _ in 0..2 {
            let _ = s.schedule(now).unwrap();
            now += 10_000_000;
            s.complete_step(now).unwrap();
        }
        (s, now)
    }

    #[test]
    fn protection_gives_an_under_rate_tenants_chunk_the_step_and_decodes_keep_running() {
        let (mut s, mut now) = flooder_and_quiet(Some(ProtectConfig::default()));
        // Nothing protected to prefill yet: the flooder gets the whole budget.
        let plan = s.schedule(now).unwrap();
        assert_eq!(tenant_tokens(plan, 0), (2046, 2), "work conserving before: {plan:?}");
        now += 10_000_000;
        s.complete_step(now).unwrap();
        s.submit(now, req(100, 1, 2000, 4, now)).unwrap();
        // The quiet request's four chunks (512, 512, 512, 464) each have the step's prefill
        // to themselves; the flooder's decodes still run in every one of them.
        let mut quiet_chunks = Vec::new();
        for _ in 0..4 {
            let plan = s.schedule(now).unwrap();
            let (quiet, _) = tenant_tokens(plan, 1);
            assert_eq!(tenant_tokens(plan, 0), (0, 2), "flooder capped to 0: {plan:?}");
            quiet_chunks.push(quiet);
            now += 10_000_000;
            s.complete_step(now).unwrap();
        }
        assert_eq!(quiet_chunks, [512, 512, 512, 464]);
        assert_eq!(s.stats(1).unwrap().ttft.len(), 1, "first token after the last chunk");
        // The quiet prefill is done: the flooder has the budget again.
        let plan = s.schedule(now).unwrap();
        assert_eq!(tenant_tokens(plan, 0).0, 2048 - plan.decode_tokens);
        assert_eq!(s.protect_stats(), ProtectStats { capped_steps: 4, released_steps: 0 });
    }

    #[test]
    fn protection_cap_lets_the_others_add_that_many_prefill_tokens() {
        let p = ProtectConfig { others_prefill_tokens_max: 300, ..ProtectConfig::default() };
        let (mut s, now) = flooder_and_quiet(Some(p));
        s.submit(now, req(100, 1, 2000, 4, now)).unwrap();
        let plan = s.schedule(now).unwrap();
        assert_eq!(tenant_tokens(plan, 1).0, 512);
        assert_eq!(tenant_tokens(plan, 0), (300, 2), "{plan:?}");
    }

    #[test]
    fn without_protection_the_flooder_fills_the_quiet_step() {
        let (mut s, now) = flooder_and_quiet(None);
        s.submit(now, req(100, 1, 2000, 4, now)).unwrap();
        let plan = s.schedule(now).unwrap();
        assert_eq!(tenant_tokens(plan, 1).0, 512);
        assert_eq!(tenant_tokens(plan, 0), (2048 - 512 - 2, 2));
        assert_eq!(s.protect_stats(), ProtectStats::default());
    }

    #[test]
    fn a_tenant_over_its_rate_is_not_protected() {
        // Both tenants spent their buckets: nobody is protected, the step stays work
        // conserving.
        let tenants = vec![
            tenant("flood", Tier::Interactive, 8.0, 0.0, 1000, Overflow::Reject),
            tenant("busy", Tier::Interactive, 2.0, 0.0, 1000, Overflow::Reject),
        ];
        let mut c = cfg(Policy::Drr, 10_000);
        c.protect = Some(ProtectConfig::default());
        let mut s = Scheduler::new(c, tenants, port()).unwrap();
        for i in 0..8 {
            s.submit(0, req(i, 0, 8000, 4, 0)).unwrap();
        }
        s.submit(0, req(100, 1, 2000, 4, 0)).unwrap();
        s.submit(0, req(101, 1, 2000, 4, 0)).unwrap();
        let plan = s.schedule(0).unwrap();
        assert_eq!(plan.prefill_tokens, 2048);
        assert!(tenant_tokens(plan, 0).0 >= 1024, "{plan:?}");
        assert_eq!(s.protect_stats().capped_steps, 0);
    }

    #[test]
    fn protection_releases_one_work_conserving_step_after_the_hold_bound() {
        // The quiet tenant's 40,000-token prompt keeps a protected prefill in every step for
        // 79 steps; with a 100 ms hold bound (10 ms steps) the flooder still gets a full
        // step's prefill share at least every 11 steps.
        let p = ProtectConfig { hold_ns_max: 100_000_000, ..ProtectConfig::default() };
        let (mut s, mut now) = flooder_and_quiet(Some(p));
        s.submit(now, req(100, 1, 40_000, 4, now)).unwrap();
        let mut since_flood = 0;
        let mut released = 0;
        for _ in 0..60 {
            let plan = s.schedule(now).unwrap();
            assert!(tenant_tokens(plan, 1).0 > 0, "quiet prefill in every step");
            let flood = tenant_tokens(plan, 0).0;
            if flood > 0 {
                assert_eq!(flood + 512 + plan.decode_tokens, 2048, "work conserving: {plan:?}");
                released += 1;
                since_flood = 0;
            } else {
                since_flood += 1;
                assert!(since_flood <= 10, "flooder held more than the bound");
            }
            now += 10_000_000;
            s.complete_step(now).unwrap();
        }
        assert!(released >= 5, "{released}");
        assert_eq!(s.protect_stats().released_steps, released);
    }

    #[test]
    fn protection_needs_a_drr_policy_and_sane_settings() {
        let t = || vec![tenant("a", Tier::Interactive, 1.0, 60.0, 1, Overflow::Reject)];
        let mut c = cfg(Policy::Fifo, 100);
        c.protect = Some(ProtectConfig::default());
        assert!(matches!(Scheduler::new(c, t(), port()), Err(SchedError::Config { .. })));
        let mut c = cfg(Policy::Drr, 100);
        c.protect = Some(ProtectConfig { bucket_frac_min: 1.5, ..ProtectConfig::default() });
        assert!(matches!(Scheduler::new(c, t(), port()), Err(SchedError::Config { .. })));
        let mut c = cfg(Policy::Drr, 100);
        c.protect = Some(ProtectConfig { hold_ns_max: 0, ..ProtectConfig::default() });
        assert!(matches!(Scheduler::new(c, t(), port()), Err(SchedError::Config { .. })));
    }

    /// Every planned item's positions have blocks, through swaps and recomputes forced in
    /// the middle of prefills, under each policy (found by the real engine: a sequence
    /// swapped out mid-prefill came back with blocks for what it had computed only).
    #[test]
    fn every_planned_item_has_blocks_for_its_positions() {
        for policy in [Policy::Fifo, Policy::Drr, Policy::DrrPreempt] {
            let tenants = vec![
                tenant(
                    "chat",
                    Tier::Interactive,
                    1e9,
                    1e9,
                    100,
                    Overflow::Queue { depth_max: 100 },
                ),
                tenant("batch", Tier::Batch, 1e9, 1e9, 100, Overflow::Queue { depth_max: 100 }),
            ];
            let mut c = cfg(policy, 40);
            c.chunk_tokens = Some(16);
            c.batch_tokens_max = 64;
            let mut s = Scheduler::new(c, tenants, port()).unwrap();
            for i in 0..12u64 {
                s.submit(0, req(i + 1, (i % 2) as usize, 20 + 13 * (i as u32 % 5), 30, 0)).unwrap();
            }
            let mut now = 0;
            let mut forced = 0;
            for step in 0..5_000u64 {
                now += 1_000_000;
                // Force a preemption every few steps, alternating swap and recompute, for a
                // while (forcing it forever would keep the same sequence from finishing).
                if step % 3 == 0 && step < 300 {
                    if let Some(&id) = s.running.first() {
                        let mode =
                            if step % 2 == 0 { PreemptMode::Swap } else { PreemptMode::Recompute };
                        if s.preempt_now(now, id, Some(mode)).unwrap() {
                            forced += 1;
                        }
                    }
                }
                let plan = s.schedule(now).unwrap().clone();
                for it in &plan.items {
                    let n = match it.kind {
                        StepKind::Decode => 1,
                        StepKind::Prefill { tokens } => tokens,
                    };
                    let held = s.blocks().table(it.seq).map_or(0, |t| t.len() as u32);
                    assert!(
                        held * BLOCK_TOKENS >= it.context_tokens + n,
                        "{policy}: step {step}: {:?} needs {} positions, holds {held} blocks",
                        it.seq,
                        it.context_tokens + n
                    );
                }
                if !plan.is_empty() {
                    s.complete_step(now).unwrap();
                }
                s.clear_events();
                if s.live() == 0 {
                    break;
                }
            }
            assert_eq!(s.live(), 0, "{policy}: every request finished");
            assert!(forced > 5, "{policy}: preemption was exercised ({forced})");
            assert_eq!(s.blocks().free(), s.blocks().total());
        }
    }
}
