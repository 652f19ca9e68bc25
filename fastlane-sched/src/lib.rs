//! The iteration-level, preemptive, multi-tenant scheduler, and the discrete-event
//! simulator (module `sim`, feature `sim`) that drives it.
//!
//! # What it does
//!
//! - Keeps the KV cache in fixed blocks of [`BLOCK_TOKENS`] tokens ([`BlockManager`]): one
//!   block table per sequence and a free pool. A sequence gets blocks for its whole prompt
//!   when it starts (plus a free-pool watermark, as vLLM does), and one more block every
//!   16 generated tokens.
//! - Runs one step at a time ([`Scheduler::schedule`] → the caller runs the batch →
//!   [`Scheduler::complete_step`], or [`Scheduler::abandon_step`] when the caller gave the
//!   batch up part way and the step did not happen). A step holds one decode token per running sequence and
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
//! - [`SchedConfig::tier_steps`]: under [`TierSteps::Separate`] a step that carries an
//!   interactive-tier prefill carries no batch-tier work (prefill or decode), for at most a
//!   hold bound in a row; under [`TierSteps::Shared`] batch work fills what the interactive
//!   tier leaves (the simulator's rule: on a GPU the extra rows are nearly free).
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
//! runs on a wall clock or a discrete-event one. It holds no prefix cache: a caller that has
//! a sequence's leading KV already says so with [`Request::cached_tokens`] and the first prefill
//! starts after it. No speculative decoding,
//! no pipeline parallelism.
//!
//! # Where the code is
//!
//! This file holds the [`Scheduler`] with its per-sequence state, its public API and the
//! end of a step; one file per step of the work:
//! - `config`: [`SchedConfig`], [`TenantConfig`], [`Policy`], [`PreemptCosts`],
//!   [`ProtectConfig`] and [`SchedError`];
//! - `admission`: the router (bucket, concurrency limit, router queue);
//! - `plan`: forming a step's batch ([`StepPlan`]);
//! - `preempt`: preemption by swap or recompute and swap completions;
//! - `blocks`, `fair`, `port`, `stats`: the block manager, DRR and token buckets, the swap
//!   port, the latency histograms; `tests.rs` holds the scheduler's unit tests.

mod admission;
mod blocks;
mod config;
mod fair;
mod plan;
mod port;
mod preempt;
#[cfg(feature = "sim")]
pub mod sim;
mod stats;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, VecDeque};
use std::fmt;

pub use admission::{Admission, RejectReason, Request};
pub use blocks::{blocks_for_tokens, BlockError, BlockManager, PinnedBlocks, BLOCK_TOKENS};
pub use config::{
    Overflow, Policy, PreemptCosts, ProtectConfig, SchedConfig, SchedError, TenantConfig, Tier,
    TierStepStats, TierSteps,
};
pub use fair::{Drr, TokenBucket};
pub use plan::{StepItem, StepKind, StepPlan};
pub use port::{InstantPort, SwapDir, SwapDone, SwapPort, SwapPortError};
pub use preempt::PreemptMode;
pub use stats::{new_histogram, record, TenantStats, LATENCY_NS_MAX};

pub use fastlane_util::{BlockId, SeqId};

/// Live sequences by state ([`Scheduler::seq_counts`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SeqCounts {
    /// Held at the router (not admitted yet).
    pub queued: usize,
    /// Admitted, waiting to start or to restart after a recompute preemption.
    pub waiting: usize,
    /// Running (prefilling or decoding).
    pub running: usize,
    /// With a swap in flight, out or in.
    pub swapping: usize,
    /// Preempted by swap, their KV in a swap tier.
    pub swapped_out: usize,
}

/// Index of a tenant in the scheduler's tenant list.
pub type TenantIndex = usize;

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
    /// [`TierSteps::Separate`]: since when batch work has been kept out of steps without a
    /// break.
    tier_held_since_ns: Option<u64>,
    tier_stats: TierStepStats,
    /// What forming the current plan changed that [`abandon_step`](Self::abandon_step)
    /// gives back.
    undo: PlanUndo,
    /// Steps planned and then abandoned.
    abandoned: u64,
    /// Slots of finished sequences stay taken until [`release_slot`](Self::release_slot).
    hold_slots: bool,
    /// Finished sequences whose slot is still held, and their tenants.
    held: HashMap<SeqId, TenantIndex>,
}

/// The scheduler's fair-share state as it was before the current plan was formed: DRR of both
/// tiers and latency protection's counts and hold timer ([`Scheduler::abandon_step`]).
#[derive(Debug)]
struct PlanUndo {
    drr: [Drr; 2],
    protect_stats: ProtectStats,
    held_since_ns: Option<u64>,
    tier_held_since_ns: Option<u64>,
    tier_stats: TierStepStats,
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
        if cfg.tier_steps == (TierSteps::Separate { hold_ns_max: 0 }) {
            return bad("tier_steps: separate needs a hold bound above 0".into());
        }
        if cfg.mixed_batch_tokens == Some(0) {
            return bad("mixed_batch_tokens: 0 (the batch tier would never move beside the interactive tier; give at least 1)".into());
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
                || t.weight == 0
                || t.rpm.is_nan()
                || t.rpm < 0.0
                || t.bucket_capacity.is_nan()
                || t.bucket_capacity < 1.0
            {
                return bad(format!("tenant {}: bad admission settings", t.name));
            }
        }
        let n = tenants.len();
        let weights: Vec<u32> = tenants.iter().map(|t| t.weight).collect();
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
        let drr = [Drr::weighted(&weights, quantum), Drr::weighted(&weights, quantum)];
        Ok(Self {
            blocks: BlockManager::new(cfg.kv_blocks),
            cfg,
            tenants,
            port,
            seqs: HashMap::new(),
            fifo: VecDeque::new(),
            running: Vec::new(),
            undo: PlanUndo {
                drr: drr.clone(),
                protect_stats: ProtectStats::default(),
                held_since_ns: None,
                tier_held_since_ns: None,
                tier_stats: TierStepStats::default(),
            },
            abandoned: 0,
            drr,
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
            tier_held_since_ns: None,
            tier_stats: TierStepStats::default(),
            hold_slots: false,
            held: HashMap::new(),
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

    /// Number of tenants.
    pub fn tenant_count(&self) -> usize {
        self.tenants.len()
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

    /// Requests of `tenant` waiting at the router (0 for an unknown tenant).
    pub fn router_queued_of(&self, tenant: TenantIndex) -> usize {
        self.tenants.get(tenant).map_or(0, |t| t.router.len())
    }

    /// Live sequences by state (for gauges).
    pub fn seq_counts(&self) -> SeqCounts {
        let mut c = SeqCounts { queued: self.router_queued(), ..SeqCounts::default() };
        for s in self.seqs.values() {
            match s.state {
                State::Waiting => c.waiting += 1,
                State::Running => c.running += 1,
                State::SwappingOut(_) | State::SwappingIn => c.swapping += 1,
                State::SwappedOut => c.swapped_out += 1,
            }
        }
        c
    }

    /// Whether a stream has not produced its first token yet: admitted and waiting, or held
    /// at the router.
    pub fn waiting_first_token(&self) -> usize {
        self.router_queued() + self.seqs.values().filter(|s| s.generated == 0).count()
    }

    /// Steps scheduled so far (not counting abandoned ones).
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Steps planned and then abandoned ([`abandon_step`](Self::abandon_step)).
    pub fn abandoned_steps(&self) -> u64 {
        self.abandoned
    }

    /// What latency protection did so far (zeros when it is off).
    pub fn protect_stats(&self) -> ProtectStats {
        self.protect_stats
    }

    /// What [`TierSteps::Separate`] did so far.
    pub fn tier_stats(&self) -> TierStepStats {
        self.tier_stats
    }

    /// Events of the last [`complete_step`](Self::complete_step) and of preemptions since.
    pub fn events(&self) -> &[SchedEvent] {
        &self.events
    }

    /// Forget the recorded events.
    pub fn clear_events(&mut self) {
        self.events.clear();
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

    /// From now on a finished sequence keeps its tenant's admission slot until
    /// [`release_slot`](Self::release_slot): for a front end whose stream is over only when
    /// its last token has been written to the client, not when it was generated.
    pub fn hold_slots_until_released(&mut self) {
        self.hold_slots = true;
    }

    /// Frees the slot a finished sequence held ([`hold_slots_until_released`]); returns
    /// whether it held one (a sequence still live, refused or never admitted holds none here).
    ///
    /// [`hold_slots_until_released`]: Self::hold_slots_until_released
    pub fn release_slot(&mut self, seq: SeqId) -> bool {
        match self.held.remove(&seq) {
            Some(t) => {
                self.tenants[t].inflight -= 1;
                true
            }
            None => false,
        }
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

    /// The step planned by [`schedule`](Self::schedule) did not happen: the caller gave its
    /// batch up part way (an engine that abandons a forward pass to let an interactive
    /// request in). The plan is forgotten and the next `schedule` plans that work again.
    ///
    /// - Nothing a finished step does happens: no sequence's computed tokens advance, no
    ///   token is emitted, no prefill or output token, TTFT or gap is recorded.
    /// - What `schedule` did at the step boundary stands: fences, admissions from the
    ///   router, swaps and preemptions it started. Sequences the plan started stay running
    ///   with their blocks (blocks granted for decodes stay too), so the next plan continues
    ///   them at the same positions; the caller's partial writes there are rewritten.
    /// - What forming the plan charged is given back: the DRR state of both tiers (deficits,
    ///   cursor) is restored to what it was before the plan, so each tenant is charged once
    ///   for the work when it is planned again; latency protection's step counts too, and
    ///   its hold timer when the plan was the hold bound's work-conserving release (so the
    ///   release is planned again). A hold that began with this plan keeps its start: the
    ///   others' prefill was held back during the abandoned step as well.
    /// - [`steps`](Self::steps) no longer counts it; [`abandoned_steps`](Self::abandoned_steps)
    ///   does.
    ///
    /// Errors when no step is planned.
    pub fn abandon_step(&mut self) -> Result<(), SchedError> {
        if !self.planned {
            return Err(SchedError::Protocol { reason: "abandon_step() without a planned step" });
        }
        self.planned = false;
        self.steps -= 1;
        self.abandoned += 1;
        self.plan.items.clear();
        self.plan.prefill_tokens = 0;
        self.plan.decode_tokens = 0;
        for (drr, saved) in self.drr.iter_mut().zip(&self.undo.drr) {
            drr.clone_from(saved);
        }
        if self.protect_stats.released_steps > self.undo.protect_stats.released_steps {
            self.held_since_ns = self.undo.held_since_ns;
        }
        self.protect_stats = self.undo.protect_stats;
        self.tier_held_since_ns = self.undo.tier_held_since_ns;
        self.tier_stats = self.undo.tier_stats;
        Ok(())
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
        if self.hold_slots {
            self.held.insert(id, s.req.tenant);
        } else {
            ts.inflight -= 1;
        }
        match how {
            Ending::Fenced => ts.stats.fenced += 1,
            Ending::Done => ts.stats.completed += 1,
            Ending::Aborted => ts.stats.aborted += 1,
        }
        self.events.push(SchedEvent::Finished { seq: id, tenant: s.req.tenant, fenced });
    }
}
