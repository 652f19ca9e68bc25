//! The workers' clock: the TSC where it is invariant (one `rdtsc`, about 9 ns here, where
//! `Instant::now` costs about 45 ns), `Instant` elsewhere. A worker reads it twice per request
//! (latency) and once per poll-loop turn, so at QD1 the difference is most of a tenth of a
//! microsecond per request.

use std::time::{Duration, Instant};

/// Timestamps in ticks, and the rate to turn them into nanoseconds.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    tsc: bool,
    ns_per_tick: f64,
    base: Instant,
}

impl Clock {
    /// The TSC if this CPU reports an invariant one (calibrated against `Instant` for 50 ms),
    /// else `Instant`.
    pub fn detect() -> Clock {
        if fastlane_util::tsc::invariant() {
            Clock {
                tsc: true,
                ns_per_tick: fastlane_util::tsc::ns_per_tick(),
                base: Instant::now(),
            }
        } else {
            Clock::instant()
        }
    }

    /// `Instant` (ticks are nanoseconds).
    pub fn instant() -> Clock {
        Clock { tsc: false, ns_per_tick: 1.0, base: Instant::now() }
    }

    /// Whether this is the TSC.
    pub fn is_tsc(&self) -> bool {
        self.tsc
    }

    /// Now, in ticks.
    #[inline]
    pub fn now(&self) -> u64 {
        if self.tsc {
            fastlane_util::tsc::read_tsc()
        } else {
            u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX)
        }
    }

    /// Nanoseconds from tick `from` to tick `to` (0 if `to` is earlier).
    #[inline]
    pub fn ns_between(&self, from: u64, to: u64) -> u64 {
        (to.saturating_sub(from) as f64 * self.ns_per_tick) as u64
    }

    /// `d` in ticks.
    pub fn ticks(&self, d: Duration) -> u64 {
        (d.as_nanos() as f64 / self.ns_per_tick) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_clocks_measure_a_sleep() {
        for clock in [Clock::detect(), Clock::instant()] {
            let a = clock.now();
            std::thread::sleep(Duration::from_millis(20));
            let ns = clock.ns_between(a, clock.now());
            assert!((15_000_000..2_000_000_000).contains(&ns), "{ns} ns (tsc {})", clock.is_tsc());
            let t = clock.ticks(Duration::from_millis(20));
            assert!(clock.ns_between(0, t).abs_diff(20_000_000) < 200_000);
        }
    }
}
