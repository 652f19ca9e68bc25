//! The time-stamp counter as a benchmark clock: one `rdtsc` (about 7 ns on the 2-core dev
//! hosts, against about 20 ns for `Instant::now`) per timestamp, converted to nanoseconds
//! with a ratio calibrated against `Instant`.
//!
//! Ticks are only comparable on one machine, and only mean time when the CPU reports an
//! invariant TSC (`constant_tsc` and `nonstop_tsc`). Off x86_64 the "ticks" are nanoseconds
//! since the first call, so [`ns_per_tick`] comes out at about 1.

use std::time::{Duration, Instant};

/// The current TSC value (x86_64), or nanoseconds since the first call elsewhere.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub fn read_tsc() -> u64 {
    // SAFETY:
    // - RDTSC exists on every x86_64 CPU and has no memory effects.
    unsafe { core::arch::x86_64::_rdtsc() }
}

/// The current TSC value (x86_64), or nanoseconds since the first call elsewhere.
#[cfg(not(target_arch = "x86_64"))]
#[inline(always)]
pub fn read_tsc() -> u64 {
    static BASE: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    BASE.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// Whether the TSC counts time at a constant rate across frequency changes and idle states
/// (`constant_tsc` and `nonstop_tsc` in `/proc/cpuinfo`); false off x86_64.
pub fn invariant() -> bool {
    if !cfg!(target_arch = "x86_64") {
        return false;
    }
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let flags = info.lines().find(|l| l.starts_with("flags")).unwrap_or("");
    let has = |f: &str| flags.split_whitespace().any(|w| w == f);
    has("constant_tsc") && has("nonstop_tsc")
}

/// Nanoseconds per [`read_tsc`] tick, from 50 ms of both clocks.
pub fn ns_per_tick() -> f64 {
    let (t0, c0) = (Instant::now(), read_tsc());
    std::thread::sleep(Duration::from_millis(50));
    let (t1, c1) = (Instant::now(), read_tsc());
    (t1 - t0).as_nanos() as f64 / c1.wrapping_sub(c0).max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_advance_and_calibrate_to_a_plausible_rate() {
        let a = read_tsc();
        let npt = ns_per_tick();
        let b = read_tsc();
        assert!(b > a);
        // From a 100 MHz to a 20 GHz counter (or 1 ns ticks off x86_64).
        assert!((0.05..=10.0).contains(&npt), "{npt} ns per tick");
    }
}
