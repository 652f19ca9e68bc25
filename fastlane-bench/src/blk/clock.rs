//! The benchmark's clock: TSC ticks (calibrated against `Instant`) or `Instant` nanoseconds.

use std::time::{Duration, Instant};

use anyhow::Result;
use fastlane_util::tsc;
use fastlane_util::tsc::read_tsc;

use super::report::ClockReport;
use super::ClockChoice;

/// Timestamps in ticks: TSC cycles or nanoseconds since `base`.
#[derive(Debug)]
pub(super) struct Clock {
    pub(super) tsc: bool,
    pub(super) base: Instant,
    pub(super) ns_per_tick: f64,
    pub(super) tsc_call_ns: f64,
    pub(super) instant_call_ns: f64,
}

impl Clock {
    pub(super) fn new(choice: ClockChoice) -> Result<Clock> {
        let invariant = invariant_tsc();
        let tsc = match choice {
            ClockChoice::Tsc => {
                anyhow::ensure!(
                    invariant,
                    "--clock tsc: this CPU does not report an invariant TSC (constant_tsc, \
                     nonstop_tsc)"
                );
                true
            }
            ClockChoice::Instant => false,
            // Measured on the 2-core dev hosts: rdtsc ≈ 7 ns, Instant::now ≈ 20 ns (vDSO);
            // under TCG guests Instant costs ≈ 1 µs. The TSC is never worse.
            ClockChoice::Auto => invariant,
        };
        let base = Instant::now();
        let ns_per_tick = if tsc { tsc::ns_per_tick() } else { 1.0 };
        let mut c = Clock { tsc, base, ns_per_tick, tsc_call_ns: f64::NAN, instant_call_ns: 0.0 };
        c.instant_call_ns = cost_per_call(|| Instant::now().elapsed().as_nanos() as u64 / 2);
        if invariant {
            c.tsc_call_ns = cost_per_call(read_tsc);
        }
        Ok(c)
    }

    #[inline(always)]
    pub(super) fn now(&self) -> u64 {
        if self.tsc {
            read_tsc()
        } else {
            self.base.elapsed().as_nanos() as u64
        }
    }

    #[inline(always)]
    pub(super) fn ns(&self, ticks: u64) -> u64 {
        if self.tsc {
            (ticks as f64 * self.ns_per_tick) as u64
        } else {
            ticks
        }
    }

    pub(super) fn ticks(&self, d: Duration) -> u64 {
        (d.as_nanos() as f64 / self.ns_per_tick) as u64
    }

    pub(super) fn report(&self) -> ClockReport {
        ClockReport {
            source: if self.tsc { "tsc" } else { "instant" }.into(),
            ns_per_tick: self.ns_per_tick,
            tsc_call_ns: if self.tsc_call_ns.is_nan() { None } else { Some(self.tsc_call_ns) },
            instant_call_ns: self.instant_call_ns,
        }
    }
}

/// Average cost of one call of `f` over 200 000 calls, in ns.
pub(super) fn cost_per_call(f: impl Fn() -> u64) -> f64 {
    const N: u32 = 200_000;
    let t = Instant::now();
    let mut acc = 0u64;
    for _ in 0..N {
        acc = acc.wrapping_add(f());
    }
    std::hint::black_box(acc);
    t.elapsed().as_nanos() as f64 / f64::from(N)
}

/// Whether /proc/cpuinfo lists `constant_tsc` and `nonstop_tsc` (a TSC that ticks at one rate
/// in every P- and C-state, the same on all cores).
pub(super) fn invariant_tsc() -> bool {
    fastlane_util::tsc::invariant()
}
