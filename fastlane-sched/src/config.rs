//! The scheduler's configuration: policy, tenants, the preemption cost model, latency
//! protection, and the errors a bad configuration or call order gives.

use std::fmt;
use std::str::FromStr;

use thiserror::Error;

use super::{blocks_for_tokens, SeqId, TenantIndex, BLOCK_TOKENS};

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
    /// The HTTP gate's rule: a request whose tenant's bucket has no token left for it (the
    /// tokens of requests already waiting are reserved) is refused at once as rate-limited
    /// (429); one that has a token but no free slot waits in the router queue without
    /// spending it (at most `depth_max`; beyond, refused as queue-full, 503). The token is
    /// spent when the request is admitted.
    Gate {
        /// Queue bound; beyond it requests are refused as queue-full.
        depth_max: usize,
    },
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
    /// DRR weight: a backlogged tenant's share of the prefill budget is proportional to it
    /// (its quantum is `drr_quantum_tokens × weight`). At least 1.
    pub weight: u32,
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
    /// How the interactive and batch tiers share a step (policies `drr` and `drr+preempt`).
    pub tier_steps: TierSteps,
    /// Under [`TierSteps::Separate`]: the most batch-tier work a step that carries
    /// interactive-tier work (its decodes, or a prefill past the hold bound) may also carry, in
    /// tokens through the linear layers: a batch token counts `1 + context /
    /// attention_context`, priced at the longest batch context in flight. At least one
    /// batch token goes into every such step, so the batch tier always moves. `None`: no bound
    /// but the token budget (on a CPU a batch prefill chunk at a long context then makes the
    /// interactive tier's every decode wait for it).
    pub mixed_batch_tokens: Option<u32>,
    /// Context tokens whose attention costs as much as the rest of one token's pass (the engine
    /// measures it at start; its fallback is the model's FLOP ratio); 0: attention is not
    /// counted.
    pub attention_context: u32,
}

/// How the two tiers share a step (policies `drr` and `drr+preempt`; `fifo` has no tiers).
///
/// On a GPU a step's time barely grows with its rows until the batch is large, so filling
/// what the interactive tier leaves with batch work is free ([`TierSteps::Shared`]). On a CPU
/// every row costs its share of the step: a batch prefill chunk beside an interactive prompt
/// doubles that prompt's step and with it its time to first token. [`TierSteps::Separate`]
/// keeps batch work out of exactly those steps; the engine stays busy (it runs the
/// interactive work, then the batch work in the next step), so nothing is idle while work
/// waits, and the batch tier's work moves one step later.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TierSteps {
    /// Batch-tier work (decodes, then DRR's prefill chunks) fills whatever budget the
    /// interactive tier leaves.
    Shared,
    /// A step that carries an interactive-tier prefill carries no batch-tier work, neither
    /// decodes nor prefill chunks. Starvation bound: when batch work has been kept out for
    /// `hold_ns_max` without a break, the next step is shared and the clock starts again.
    Separate {
        /// Longest batch work is kept out of steps before one shared step.
        hold_ns_max: u64,
    },
}

impl TierSteps {
    /// [`TierSteps::Separate`] with a 500 ms starvation bound.
    pub const SEPARATE: TierSteps = TierSteps::Separate { hold_ns_max: 500_000_000 };
}

impl std::str::FromStr for TierSteps {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "shared" => Ok(TierSteps::Shared),
            "separate" => Ok(TierSteps::SEPARATE),
            o => Err(format!("{o:?}: shared or separate")),
        }
    }
}

/// What [`TierSteps::Separate`] did over a run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierStepStats {
    /// Steps planned with an interactive prefill and without the batch work that waited.
    pub separate_steps: u64,
    /// Steps planned shared because batch work had been kept out for `hold_ns_max`.
    pub released_steps: u64,
    /// Steps that carried interactive work and so at most
    /// [`SchedConfig::mixed_batch_tokens`] of batch work.
    pub mixed_capped_steps: u64,
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
    /// Whether the unprotected tenants' decodes run in a step that carries a protected
    /// prefill under the cap. `false`: that step is the protected tenants' alone (on a CPU
    /// every decode row lengthens it); the others' decodes run in the next step, and the
    /// hold bound counts their wait too.
    pub others_decodes: bool,
}

impl Default for ProtectConfig {
    /// Half the bucket, cap 0 (the protected chunk has the step's prefill to itself), 1 s,
    /// the others' decodes still run.
    fn default() -> Self {
        Self {
            bucket_frac_min: 0.5,
            others_prefill_tokens_max: 0,
            hold_ns_max: 1_000_000_000,
            others_decodes: true,
        }
    }
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
