//! How fast the next segment's file is prepared: at least the configured pace, raised while
//! the segment in use fills fast enough that the spare would not be ready in time.
//!
//! The spare is written in paced pieces so that the journal's own writes wait behind at most
//! one of them (`segments::prepare_spare_with`); a fixed pace must be chosen above the fastest
//! fill rate the service will see, or a roll waits for the spare (every durable ack behind
//! it). [`SparePacer`] watches the writer's offset in the segment in use and asks for the
//! pace that finishes the spare by the time half of what is left of that segment has
//! filled at the rate it has been filling.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::stats::WriterStats;

/// The pace (bytes/s) that writes `spare_left` more bytes by the time half of
/// `segment_left` has filled at `fill_bytes_per_s`, never below `least` (the configured
/// pace). No fill seen: `least`.
pub(super) fn spare_pace(
    least: u64,
    spare_left: u64,
    segment_left: u64,
    fill_bytes_per_s: f64,
) -> u64 {
    if fill_bytes_per_s <= 0.0 || !fill_bytes_per_s.is_finite() {
        return least;
    }
    // Half the time the segment has left, and at least a millisecond.
    let time = (segment_left as f64 / fill_bytes_per_s / 2.0).max(1e-3);
    let need = spare_left as f64 / time;
    (need.min(1e15) as u64).max(least)
}

/// The pace of one spare: [`spare_pace`] from the writer's progress since the spare started
/// (or since the writer moved to a new segment, which resets its offset).
pub(super) struct SparePacer {
    /// The configured pace (0: no pacing at all).
    pub(super) least: u64,
    /// Raise the pace with the fill rate (else always `least`).
    pub(super) adaptive: bool,
    /// Bytes of a segment, the one in use and the spare alike.
    pub(super) segment_bytes: u64,
    pub(super) stats: Arc<WriterStats>,
    /// The pace last asked for, for the metrics.
    pub(super) shown: Arc<AtomicU64>,
    /// (rolls, when, offset) where the fill of the segment in use was first seen.
    pub(super) base: Option<(u64, Instant, u64)>,
}

impl SparePacer {
    /// Bytes/s for the rest of the spare, `written` bytes of it being done.
    pub(super) fn pace(&mut self, written: u64) -> u64 {
        let p = self.compute(written);
        self.shown.store(p, Ordering::Relaxed);
        p
    }

    fn compute(&mut self, written: u64) -> u64 {
        if self.least == 0 || !self.adaptive {
            return self.least;
        }
        let rolls = self.stats.rolls.load(Ordering::Acquire);
        let end = self.stats.end.load(Ordering::Relaxed);
        let now = Instant::now();
        let (_, t0, e0) = match self.base {
            Some(b) if b.0 == rolls => b,
            _ => {
                self.base = Some((rolls, now, end));
                return self.least;
            }
        };
        let secs = now.duration_since(t0).as_secs_f64();
        let grown = end.saturating_sub(e0);
        if grown == 0 || secs <= 0.0 {
            return self.least;
        }
        spare_pace(
            self.least,
            self.segment_bytes.saturating_sub(written),
            self.segment_bytes.saturating_sub(end),
            grown as f64 / secs,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: u64 = 1 << 20;

    #[test]
    fn the_pace_finishes_the_spare_in_half_the_time_the_segment_has_left() {
        // 256 MiB left to fill at 64 MiB/s: 4 s, the spare's 256 MiB in 2 s.
        assert_eq!(spare_pace(16 * M, 256 * M, 256 * M, 64.0 * M as f64), 128 * M);
        // A slow fill: the configured pace is enough and stays.
        assert_eq!(spare_pace(128 * M, 256 * M, 256 * M, 1.0 * M as f64), 128 * M);
        // Nothing filling (or nonsense): the configured pace.
        assert_eq!(spare_pace(128 * M, 256 * M, 256 * M, 0.0), 128 * M);
        assert_eq!(spare_pace(128 * M, 256 * M, 256 * M, f64::NAN), 128 * M);
        // The segment (nearly) full: as fast as a millisecond asks for, finite.
        let burst = spare_pace(M, 8 * M, 0, 10.0 * M as f64);
        assert!(burst.abs_diff(8 * M * 1000) <= 1, "{burst}");
        // The spare done: the configured pace.
        assert_eq!(spare_pace(M, 0, 8 * M, 10.0 * M as f64), M);
    }

    #[test]
    fn the_pacer_follows_the_writer_and_starts_again_after_a_roll() {
        let stats = Arc::new(WriterStats::default());
        stats.end.store(4096, Ordering::Relaxed);
        let shown = Arc::new(AtomicU64::new(0));
        let mut p = SparePacer {
            least: M,
            adaptive: true,
            segment_bytes: 64 * M,
            stats: Arc::clone(&stats),
            shown: Arc::clone(&shown),
            base: None,
        };
        assert_eq!(p.pace(0), M, "no fill seen yet");
        std::thread::sleep(std::time::Duration::from_millis(100));
        // 32 MiB in S >= 0.1 s, 32 MiB left: the spare's 64 MiB in S / 2, 128 MiB/S a second.
        stats.end.store(4096 + 32 * M, Ordering::Relaxed);
        let fast = p.pace(0);
        assert!(fast > 10 * M, "raised with the fill: {fast}");
        assert_eq!(shown.load(Ordering::Relaxed), fast, "the metric shows the pace asked for");
        // A roll: the writer's offset starts again; the old base must not count.
        stats.rolls.store(1, Ordering::Release);
        stats.end.store(4096, Ordering::Relaxed);
        assert_eq!(p.pace(0), M, "a new segment: no fill seen yet");
        // Fixed pacing ignores the fill.
        p.adaptive = false;
        stats.end.store(60 * M, Ordering::Relaxed);
        assert_eq!(p.pace(0), M);
        // Unpaced stays unpaced.
        p.least = 0;
        p.adaptive = true;
        assert_eq!(p.pace(0), 0);
    }
}
