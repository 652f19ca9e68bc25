//! The four scenarios of issue 8.

use std::fmt;
use std::str::FromStr;

use super::arrivals::{ArrivalProcess, LenDist};
use super::SimError;
use crate::{Overflow, TenantConfig, Tier};

/// Which scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScenarioId {
    /// A flooder sending 30× faster than a quiet tenant.
    A,
    /// Interactive chat beside 32k-token batch summarization jobs.
    B,
    /// 20 tenants with mixed rates (Poisson and bursty AR(1) with diurnal modulation).
    C,
    /// One 4,000-token prompt among ten decoding users.
    D,
}

impl fmt::Display for ScenarioId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ScenarioId::A => "a",
            ScenarioId::B => "b",
            ScenarioId::C => "c",
            ScenarioId::D => "d",
        })
    }
}

impl FromStr for ScenarioId {
    type Err = SimError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "a" => Ok(ScenarioId::A),
            "b" => Ok(ScenarioId::B),
            "c" => Ok(ScenarioId::C),
            "d" => Ok(ScenarioId::D),
            other => Err(SimError::Config { reason: format!("unknown scenario {other:?}") }),
        }
    }
}

/// Where a tenant's requests come from.
#[derive(Debug, Clone, PartialEq)]
pub enum Load {
    /// An arrival process over the run, from `start_s`.
    Process {
        /// The process.
        process: ArrivalProcess,
        /// First possible arrival, seconds.
        start_s: f64,
    },
    /// Fixed requests: (arrival s, prompt tokens, output tokens).
    Fixed(Vec<(f64, u32, u32)>),
}

/// One tenant of a scenario.
#[derive(Debug, Clone)]
pub struct TenantSpec {
    /// Admission settings (name, tier, bucket, concurrency, overflow).
    pub config: TenantConfig,
    /// Arrivals.
    pub load: Load,
    /// Prompt lengths (for [`Load::Process`]).
    pub prompt: LenDist,
    /// Output lengths (for [`Load::Process`]).
    pub output: LenDist,
}

/// A scenario: tenants and a default length.
#[derive(Debug, Clone)]
pub struct Scenario {
    /// Which one.
    pub id: ScenarioId,
    /// Tenants.
    pub tenants: Vec<TenantSpec>,
    /// Default simulated seconds.
    pub seconds_default: f64,
    /// Tenant whose first request opens the "stall window" (scenario d): the others' token
    /// gaps between its arrival and its first token are reported separately.
    pub window_tenant: Option<usize>,
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
        weight: 1,
        overflow,
    }
}

/// Chat-like prompts: median 1,000 tokens.
const CHAT_PROMPT: LenDist = LenDist::LogNormal { median: 1000.0, sigma: 0.5, min: 32, max: 4000 };
/// Chat-like answers: median 200 tokens.
const CHAT_OUTPUT: LenDist = LenDist::LogNormal { median: 200.0, sigma: 0.5, min: 8, max: 1000 };
/// Admission generous enough never to bind (for tenants that are not under test).
const OPEN: f64 = 1e9;

impl Scenario {
    /// Build scenario `id`.
    pub fn new(id: ScenarioId) -> Self {
        match id {
            ScenarioId::A => Self::flooder(),
            ScenarioId::B => Self::chat_and_summaries(),
            ScenarioId::C => Self::twenty_tenants(),
            ScenarioId::D => Self::long_prompt(),
        }
    }

    /// (a) The quiet tenant sends 0.5 req/s, the flooder 15 req/s (30×), both Poisson, both
    /// interactive chat. Each tenant may hold 60 rpm with a burst of 10 and 16 streams;
    /// excess gets a 429.
    fn flooder() -> Self {
        let chat = |name: &str, rate: f64| TenantSpec {
            config: tenant(name, Tier::Interactive, 10.0, 60.0, 16, Overflow::Reject),
            load: Load::Process {
                process: ArrivalProcess::Poisson { rate_per_s: rate },
                start_s: 0.0,
            },
            prompt: CHAT_PROMPT,
            output: CHAT_OUTPUT,
        };
        Self {
            id: ScenarioId::A,
            tenants: vec![chat("quiet", 0.5), chat("flooder", 15.0)],
            seconds_default: 300.0,
            window_tenant: None,
        }
    }

    /// (b) Interactive chat (Poisson 1 req/s) beside a batch tenant submitting 32,000-token
    /// documents to summarize (256-token summaries, Poisson 0.25 job/s, up to 8 at once,
    /// the rest queued at the router).
    fn chat_and_summaries() -> Self {
        Self {
            id: ScenarioId::B,
            tenants: vec![
                TenantSpec {
                    config: tenant("chat", Tier::Interactive, 20.0, 600.0, 64, Overflow::Reject),
                    load: Load::Process {
                        process: ArrivalProcess::Poisson { rate_per_s: 1.0 },
                        start_s: 0.0,
                    },
                    prompt: CHAT_PROMPT,
                    output: CHAT_OUTPUT,
                },
                TenantSpec {
                    config: tenant(
                        "summarize",
                        Tier::Batch,
                        100.0,
                        600.0,
                        8,
                        Overflow::Queue { depth_max: 10_000 },
                    ),
                    load: Load::Process {
                        process: ArrivalProcess::Poisson { rate_per_s: 0.25 },
                        start_s: 0.0,
                    },
                    prompt: LenDist::Fixed(32_000),
                    output: LenDist::Fixed(256),
                },
            ],
            seconds_default: 300.0,
            window_tenant: None,
        }
    }

    /// (c) 20 tenants, rates geometric from 0.05 to 2 req/s (≈ 11 req/s offered, more
    /// than the engine serves); even tenants Poisson, odd ones bursty AR(1) (φ = 0.92) with
    /// a diurnal sine of one "day" per 300 s; tenants 16–19 are batch (4k-token prompts),
    /// the rest interactive chat. Each: 60 rpm, burst 20, 16 streams, router queue 256.
    fn twenty_tenants() -> Self {
        let n = 20;
        let ratio = (2.0f64 / 0.05).powf(1.0 / (n as f64 - 1.0));
        let tenants = (0..n)
            .map(|i| {
                let rate = 0.05 * ratio.powi(i);
                let batch = i >= 16;
                let process = if i % 2 == 0 {
                    ArrivalProcess::Poisson { rate_per_s: rate }
                } else {
                    ArrivalProcess::bursty(rate, 300.0)
                };
                TenantSpec {
                    config: tenant(
                        &format!("t{i:02}"),
                        if batch { Tier::Batch } else { Tier::Interactive },
                        20.0,
                        60.0,
                        16,
                        Overflow::Queue { depth_max: 256 },
                    ),
                    load: Load::Process { process, start_s: 0.0 },
                    prompt: if batch {
                        LenDist::LogNormal { median: 4000.0, sigma: 0.3, min: 1000, max: 16000 }
                    } else {
                        CHAT_PROMPT
                    },
                    output: CHAT_OUTPUT,
                }
            })
            .collect();
        Self { id: ScenarioId::C, tenants, seconds_default: 300.0, window_tenant: None }
    }

    /// (d) Ten users decode long answers (256-token prompts at t = 0–90 ms, 4,000 output
    /// tokens); one 4,000-token prompt arrives at t = 1 s.
    fn long_prompt() -> Self {
        let users = (0..10).map(|i| (f64::from(i) * 0.01, 256, 4000)).collect();
        Self {
            id: ScenarioId::D,
            tenants: vec![
                TenantSpec {
                    config: tenant("users", Tier::Interactive, OPEN, OPEN, 64, Overflow::Reject),
                    load: Load::Fixed(users),
                    prompt: LenDist::Fixed(256),
                    output: LenDist::Fixed(4000),
                },
                TenantSpec {
                    config: tenant("long", Tier::Interactive, OPEN, OPEN, 64, Overflow::Reject),
                    load: Load::Fixed(vec![(1.0, 4000, 16)]),
                    prompt: LenDist::Fixed(4000),
                    output: LenDist::Fixed(16),
                },
            ],
            seconds_default: 3.0,
            window_tenant: Some(1),
        }
    }
}
