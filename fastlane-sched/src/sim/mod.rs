//! A discrete-event simulator that drives the [scheduler](crate) with synthetic
//! tenants, prices every step with an A100 cost model, and swaps through the real kvswap
//! engine.
//!
//! # What it does
//!
//! - Time is a simulated clock in nanoseconds: a step lasts what [`CostModel::step_ns`]
//!   says; when nothing can run the clock jumps to the next arrival, swap completion or
//!   bucket refill. Nothing sleeps. Every loop is bounded ([`SimConfig::steps_max`]).
//! - Arrivals ([`arrivals`]): Poisson, or bursty AR(1) log-rate (φ ≈ 0.92) with a diurnal
//!   sine; lengths log-normal. One random stream per tenant under the seed, so a tenant's
//!   requests are identical whatever the other tenants do (the "solo" baseline of scenario
//!   (a) sees exactly the same quiet-tenant requests).
//! - Swaps: [`EnginePort`] runs each one through a real [`SwapEngine`](fastlane_kvswap::SwapEngine)
//!   host tier (scaled-down blocks, data checked on the way back) and charges
//!   `bytes × ns_per_byte` of simulated time, `ns_per_byte` being the host tier's measured
//!   cost on this machine times a PCIe factor ([`SwapTiming`]).
//! - After `seconds` of arrivals the run continues (no new arrivals) until every admitted
//!   request has its first token, or `drain_s_max` more; requests still waiting then are
//!   recorded with their wait so far (a lower bound) and counted as `unserved`.
//!
//! # What it does not do
//!
//! Model a real GPU beyond the roofline of [`CostModel`]; the numbers are simulation results.

pub mod arrivals;
pub mod cost;
pub mod port;
pub mod scenario;

use std::collections::HashMap;

use thiserror::Error;

pub use arrivals::{ArrivalProcess, LenDist, SimRng};
pub use cost::CostModel;
pub use port::{
    calibrate_host_tier, Calibration, EnginePort, EnginePortStats, PCIE_FACTOR_DEFAULT,
    SWAP_FIXED_NS,
};
pub use scenario::{Load, Scenario, ScenarioId, TenantSpec};

use crate::{
    new_histogram, record, Policy, ProtectConfig, ProtectStats, Request, SchedConfig, SchedError,
    SchedEvent, Scheduler, SeqId, TenantStats, Tier,
};
use fastlane_hist::Histogram;
use fastlane_kvswap::KvSwapError;

/// Errors of the simulator.
#[derive(Debug, Error)]
pub enum SimError {
    /// Bad settings.
    #[error("simulator config: {reason}")]
    Config {
        /// What is wrong.
        reason: String,
    },
    /// The scheduler refused something.
    #[error(transparent)]
    Sched(#[from] SchedError),
    /// The swap engine could not be built or calibrated.
    #[error("swap engine: {0}")]
    Engine(#[from] KvSwapError),
}

/// Where the simulated swap cost per byte comes from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SwapTiming {
    /// Measure the real host tier now ([`calibrate_host_tier`], 32 × 2 MiB blocks, median of
    /// 5) and multiply by `pcie_factor`.
    Calibrated {
        /// Scale from host-tier copy time to PCIe DMA time.
        pcie_factor: f64,
    },
    /// A given cost (tests, reproducible runs): ns per byte.
    Fixed {
        /// ns per byte, one way.
        ns_per_byte: f64,
    },
}

/// One simulation run.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Scenario.
    pub scenario: ScenarioId,
    /// Policy.
    pub policy: Policy,
    /// Seconds of arrivals (`None`: the scenario's default).
    pub seconds: Option<f64>,
    /// Seed.
    pub seed: u64,
    /// Prefill chunk (`None`: whole prefill).
    pub chunk_tokens: Option<u32>,
    /// Step token budget.
    pub batch_tokens_max: u32,
    /// Run only the tenant with this name (the "solo" baseline).
    pub solo: Option<String>,
    /// Swap cost.
    pub swap: SwapTiming,
    /// Max-stream-duration fence, seconds.
    pub stream_s_max: Option<f64>,
    /// Extra simulated time allowed after the last arrival for first tokens.
    pub drain_s_max: f64,
    /// Bound on simulated steps.
    pub steps_max: u64,
    /// Latency protection of under-rate interactive tenants (`None`: off).
    pub protect: Option<ProtectConfig>,
}

impl SimConfig {
    /// Defaults: chunk 512, budget 2,048 tokens, calibrated swaps, 30 min fence.
    pub fn new(scenario: ScenarioId, policy: Policy) -> Self {
        Self {
            scenario,
            policy,
            seconds: None,
            seed: 1,
            chunk_tokens: Some(512),
            batch_tokens_max: 2048,
            solo: None,
            swap: SwapTiming::Calibrated { pcie_factor: PCIE_FACTOR_DEFAULT },
            stream_s_max: Some(1800.0),
            drain_s_max: 600.0,
            steps_max: 5_000_000,
            protect: None,
        }
    }
}

/// One tenant's results.
#[derive(Debug, Clone)]
pub struct TenantReport {
    /// Name.
    pub name: String,
    /// Tier.
    pub tier: Tier,
    /// Counters and histograms.
    pub stats: TenantStats,
    /// Requests still without a first token when the run stopped.
    pub unserved: u64,
    /// Output tokens per simulated second of arrivals.
    pub tokens_per_s: f64,
}

impl TenantReport {
    /// TTFT at quantile `q`, ns.
    pub fn ttft_ns(&self, q: f64) -> u64 {
        if self.stats.ttft.is_empty() {
            0
        } else {
            self.stats.ttft.value_at_quantile(q)
        }
    }
}

/// Swap cost provenance and counters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SwapReport {
    /// The host tier's measured cost per byte (when calibrated).
    pub host_ns_per_byte: Option<f64>,
    /// PCIe factor (when calibrated).
    pub pcie_factor: Option<f64>,
    /// Simulated cost per byte used.
    pub ns_per_byte: f64,
    /// Real engine transfers and bytes.
    pub port: EnginePortStats,
}

/// A run's results.
#[derive(Debug, Clone)]
pub struct SimReport {
    /// Scenario.
    pub scenario: ScenarioId,
    /// Policy.
    pub policy: Policy,
    /// Seconds of arrivals.
    pub seconds: f64,
    /// Seed.
    pub seed: u64,
    /// Prefill chunk.
    pub chunk_tokens: Option<u32>,
    /// Per tenant.
    pub tenants: Vec<TenantReport>,
    /// Scenario (d): other tenants' token gaps while the window tenant's prompt waited for
    /// its first token.
    pub window_token_gap: Option<Histogram<u64>>,
    /// Steps simulated.
    pub steps: u64,
    /// Simulated end time, ns.
    pub end_ns: u64,
    /// KV blocks of the simulated GPU.
    pub kv_blocks: u32,
    /// Swap provenance.
    pub swap: SwapReport,
    /// Latency protection settings (`None`: off).
    pub protect: Option<ProtectConfig>,
    /// What latency protection did.
    pub protect_stats: ProtectStats,
}

impl SimReport {
    /// The tenant called `name`.
    pub fn tenant(&self, name: &str) -> Option<&TenantReport> {
        self.tenants.iter().find(|t| t.name == name)
    }
}

/// Blocks of the scaled-down engine that stand in for one 2 MiB KV block.
const REAL_BLOCK_BYTES: usize = 4096;
/// Host tier of the simulated server: 64 GiB of pinned memory for swapped KV.
const HOST_TIER_SIM_BYTES: u64 = 64 << 30;

/// Run one simulation.
pub fn run(cfg: &SimConfig) -> Result<SimReport, SimError> {
    let scenario = Scenario::new(cfg.scenario);
    let seconds = cfg.seconds.unwrap_or(scenario.seconds_default);
    if !(seconds > 0.0 && seconds.is_finite()) {
        return Err(SimError::Config { reason: format!("seconds {seconds}") });
    }
    let model = CostModel::a100_40gb_llama31_8b();
    let kv_blocks = model.kv_blocks();

    // Tenants (all, or the solo one) and their requests, one random stream per tenant.
    let mut specs: Vec<(usize, &TenantSpec)> = scenario.tenants.iter().enumerate().collect();
    if let Some(name) = &cfg.solo {
        specs.retain(|(_, s)| &s.config.name == name);
        if specs.is_empty() {
            return Err(SimError::Config { reason: format!("no tenant {name:?} in scenario") });
        }
    }
    let mut requests = Vec::new();
    let mut next_seq = 1u64;
    for (idx, (orig, spec)) in specs.iter().enumerate() {
        let mut rng = SimRng::stream(cfg.seed, *orig as u64);
        let list: Vec<(u64, u32, u32)> = match &spec.load {
            Load::Process { process, start_s } => process
                .times_ns(&mut rng, *start_s, seconds, 10_000_000)
                .into_iter()
                .map(|t| (t, spec.prompt.sample(&mut rng), spec.output.sample(&mut rng)))
                .collect(),
            Load::Fixed(v) => v
                .iter()
                .filter(|(at, _, _)| *at < seconds)
                .map(|&(at, p, o)| ((at * 1e9) as u64, p, o))
                .collect(),
        };
        for (at, prompt, output) in list {
            requests.push(Request {
                seq: SeqId(next_seq),
                tenant: idx,
                prompt_tokens: prompt,
                output_tokens: output,
                arrival_ns: at,
                cached_tokens: 0,
            });
            next_seq += 1;
        }
    }
    requests.sort_by_key(|r| (r.arrival_ns, r.seq));
    let window_tenant =
        scenario.window_tenant.and_then(|w| specs.iter().position(|(orig, _)| *orig == w));

    // Swap cost.
    let (host_ns_per_byte, pcie_factor, ns_per_byte) = match cfg.swap {
        SwapTiming::Calibrated { pcie_factor } => {
            let c = calibrate_host_tier(model.block_bytes() as usize, 32, 5)?;
            (Some(c.ns_per_byte()), Some(pcie_factor), c.ns_per_byte() * pcie_factor)
        }
        SwapTiming::Fixed { ns_per_byte } => (None, None, ns_per_byte),
    };
    let port = EnginePort::new(
        kv_blocks,
        REAL_BLOCK_BYTES,
        model.block_bytes(),
        HOST_TIER_SIM_BYTES,
        ns_per_byte,
        SWAP_FIXED_NS,
    )?;
    let sched_cfg = SchedConfig {
        policy: cfg.policy,
        kv_blocks,
        watermark_blocks: kv_blocks / 100,
        chunk_tokens: cfg.chunk_tokens,
        batch_tokens_max: cfg.batch_tokens_max,
        batch_seqs_max: 256,
        drr_quantum_tokens: 512,
        stream_ns_max: cfg.stream_s_max.map(|s| (s * 1e9) as u64),
        preempt: model.preempt_costs(ns_per_byte, SWAP_FIXED_NS),
        protect: cfg.protect,
        // The simulator prices a GPU step, where batch rows beside an interactive prompt are
        // nearly free: the tiers share steps.
        tier_steps: crate::TierSteps::Shared,
        mixed_batch_tokens: None,
        attention_context: 0,
    };
    let tenants = specs.iter().map(|(_, s)| s.config.clone()).collect();
    let mut sched = Scheduler::new(sched_cfg, tenants, port)?;

    // The event loop.
    let horizon_ns = (seconds * 1e9) as u64;
    let stop_ns = horizon_ns + (cfg.drain_s_max * 1e9) as u64;
    let mut now = 0u64;
    let mut next = 0usize;
    let mut window: Option<(u64, Option<u64>)> = None; // (opened at, closed at)
    let mut window_hist = window_tenant.map(|_| new_histogram());
    let mut pending_window: Vec<(u64, u64)> = Vec::new(); // (token at, gap) of other tenants
    let mut arrived_unserved: HashMap<SeqId, (usize, u64)> = HashMap::new();
    for _ in 0..cfg.steps_max {
        while next < requests.len() && requests[next].arrival_ns <= now {
            let r = requests[next];
            next += 1;
            if Some(r.tenant) == window_tenant && window.is_none() {
                window = Some((r.arrival_ns, None));
            }
            let adm = sched.submit(r.arrival_ns, r)?;
            if !matches!(adm, crate::Admission::Rejected(_)) {
                arrived_unserved.insert(r.seq, (r.tenant, r.arrival_ns));
            }
        }
        let arrivals_done = next >= requests.len();
        if arrivals_done
            && sched.waiting_first_token() == 0
            && (now >= horizon_ns || sched.live() == 0)
        {
            break;
        }
        if now >= stop_ns {
            break;
        }
        let plan = sched.schedule(now)?;
        if plan.is_empty() {
            let a = requests.get(next).map(|r| r.arrival_ns);
            let w = sched.next_wakeup_ns(now);
            let t = match (a, w) {
                (Some(a), Some(w)) => a.min(w),
                (Some(x), None) | (None, Some(x)) => x,
                (None, None) => break,
            };
            now = t.max(now + 1);
            continue;
        }
        now += model.step_ns(plan);
        sched.clear_events();
        for ev in sched.complete_step(now)? {
            if let SchedEvent::Token { seq, tenant, first, gap_ns, at_ns } = *ev {
                if first {
                    arrived_unserved.remove(&seq);
                    if Some(tenant) == window_tenant {
                        if let Some((_, close @ None)) = &mut window {
                            *close = Some(at_ns);
                        }
                    }
                } else if window_tenant.is_some() && Some(tenant) != window_tenant {
                    pending_window.push((at_ns, gap_ns));
                }
            }
        }
    }
    // Requests that never got a first token: record how long they waited (a lower bound).
    let mut unserved = vec![0u64; specs.len()];
    let mut stats: Vec<TenantStats> =
        (0..specs.len()).map(|t| sched.stats(t).cloned().unwrap_or_default()).collect();
    let mut left: Vec<_> = arrived_unserved.into_values().collect();
    left.sort_unstable();
    for (t, arrival) in left {
        unserved[t] += 1;
        record(&mut stats[t].ttft, now.saturating_sub(arrival));
    }
    if let (Some(h), Some((open, close))) = (window_hist.as_mut(), window) {
        let close = close.unwrap_or(now);
        for &(at, gap) in &pending_window {
            if at > open && at <= close {
                record(h, gap);
            }
        }
    }
    let tenants = specs
        .iter()
        .zip(stats)
        .zip(unserved)
        .map(|(((_, spec), stats), unserved)| TenantReport {
            name: spec.config.name.clone(),
            tier: spec.config.tier,
            tokens_per_s: stats.output_tokens as f64 / seconds,
            stats,
            unserved,
        })
        .collect();
    Ok(SimReport {
        scenario: cfg.scenario,
        policy: cfg.policy,
        seconds,
        seed: cfg.seed,
        chunk_tokens: cfg.chunk_tokens,
        tenants,
        window_token_gap: window_hist,
        steps: sched.steps(),
        end_ns: now,
        kv_blocks,
        swap: SwapReport { host_ns_per_byte, pcie_factor, ns_per_byte, port: sched.port().stats() },
        protect: cfg.protect,
        protect_stats: sched.protect_stats(),
    })
}
