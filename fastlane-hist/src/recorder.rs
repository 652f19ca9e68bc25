//! [`LatencyRecorder`]: record nanosecond latencies on the hot path, rotate intervals.

use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

use crate::HistError;

/// Default highest latency a recorder tracks: 60 s in nanoseconds.
pub const DEFAULT_LATENCY_NS_MAX: u64 = 60_000_000_000;
/// Default precision: 3 significant decimal digits (values within 0.1 %).
pub const DEFAULT_SIGNIFICANT_DIGITS: u8 = 3;

/// Range and precision of a [`LatencyRecorder`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecorderConfig {
    /// Largest latency recorded as itself; larger ones are recorded as this value and counted
    /// in [`LatencyRecorder::overflow_count`]. At least 2.
    pub latency_ns_max: u64,
    /// Significant decimal digits kept, 0..=5.
    pub significant_digits: u8,
}

impl Default for RecorderConfig {
    fn default() -> Self {
        Self {
            latency_ns_max: DEFAULT_LATENCY_NS_MAX,
            significant_digits: DEFAULT_SIGNIFICANT_DIGITS,
        }
    }
}

impl RecorderConfig {
    /// A fresh, empty histogram with this range and precision, auto-resize off.
    pub fn new_histogram(&self) -> Result<Histogram<u64>, HistError> {
        let mut h = Histogram::new_with_bounds(1, self.latency_ns_max, self.significant_digits)
            .map_err(|e| HistError::Config { reason: format!("{e:?}") })?;
        h.auto(false);
        Ok(h)
    }
}

/// One finished interval, handed out by [`LatencyRecorder::take_interval`].
///
/// It borrows the recorder's spare histogram: read or log it, then drop it before recording
/// again.
#[derive(Debug, Clone, Copy)]
pub struct RecordedInterval<'a> {
    /// The interval's latencies, nanoseconds.
    pub histogram: &'a Histogram<u64>,
    /// When the interval began (construction or previous rotation).
    pub start: Instant,
    /// When it was taken.
    pub end: Instant,
    /// Samples in this interval above `latency_ns_max`, recorded as `latency_ns_max`.
    pub overflow_count: u64,
}

impl RecordedInterval<'_> {
    /// `end - start`.
    pub fn length(&self) -> Duration {
        self.end.saturating_duration_since(self.start)
    }
}

/// Records latencies in nanoseconds into an HdrHistogram, one interval at a time.
///
/// Three histograms of the same configuration are allocated at construction: the active one,
/// a spare that holds the last finished interval, and a running total of finished intervals.
/// Nothing allocates afterwards: [`record`](Self::record) is an index computation and an add,
/// [`take_interval`](Self::take_interval) swaps the active and spare histograms, zeroes the new
/// active one in place and adds the finished one to the total.
///
/// Owned by one thread (`&mut self`); give each thread its own recorder and merge their
/// intervals (`Histogram::add`) off the hot path.
#[derive(Debug)]
pub struct LatencyRecorder {
    config: RecorderConfig,
    active: Histogram<u64>,
    spare: Histogram<u64>,
    total: Histogram<u64>,
    overflow_count: u64,
    overflow_count_total: u64,
    interval_start: Instant,
}

impl LatencyRecorder {
    /// A recorder with the given range and precision; the first interval starts now.
    pub fn new(config: RecorderConfig) -> Result<Self, HistError> {
        if config.latency_ns_max < 2 {
            return Err(HistError::Config { reason: "latency_ns_max must be at least 2".into() });
        }
        Ok(Self {
            active: config.new_histogram()?,
            spare: config.new_histogram()?,
            total: config.new_histogram()?,
            config,
            overflow_count: 0,
            overflow_count_total: 0,
            interval_start: Instant::now(),
        })
    }

    /// A recorder tracking 1 ns ..= `latency_ns_max` at 3 significant digits.
    pub fn with_max(latency_ns_max: u64) -> Result<Self, HistError> {
        Self::new(RecorderConfig { latency_ns_max, ..RecorderConfig::default() })
    }

    /// The configuration this recorder was built with.
    pub fn config(&self) -> RecorderConfig {
        self.config
    }

    /// Record one latency. Values above `latency_ns_max` are recorded as `latency_ns_max`
    /// and counted as overflow. Never allocates, never fails.
    #[inline]
    pub fn record(&mut self, latency_ns: u64) {
        self.record_n(latency_ns, 1);
    }

    /// Record `count` occurrences of one latency (e.g. a batch that completed together).
    #[inline]
    pub fn record_n(&mut self, latency_ns: u64, count: u64) {
        let value = if latency_ns > self.config.latency_ns_max {
            self.overflow_count = self.overflow_count.saturating_add(count);
            self.config.latency_ns_max
        } else {
            latency_ns
        };
        // Cannot fail: value <= latency_ns_max <= the histogram's highest trackable value.
        let recorded = self.active.record_n(value, count);
        debug_assert!(recorded.is_ok(), "value {value} within configured range");
    }

    /// Record a [`Duration`], saturating at `u64::MAX` ns before the overflow check.
    #[inline]
    pub fn record_duration(&mut self, latency: Duration) {
        self.record(u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX));
    }

    /// Record the time elapsed since `start` (reads the monotonic clock).
    #[inline]
    pub fn record_since(&mut self, start: Instant) {
        self.record_duration(start.elapsed());
    }

    /// The interval being recorded.
    pub fn current(&self) -> &Histogram<u64> {
        &self.active
    }

    /// Overflowed samples in the interval being recorded.
    pub fn overflow_count(&self) -> u64 {
        self.overflow_count
    }

    /// All finished intervals added together (the current interval is not included).
    pub fn total(&self) -> &Histogram<u64> {
        &self.total
    }

    /// Overflowed samples in all finished intervals.
    pub fn overflow_count_total(&self) -> u64 {
        self.overflow_count_total
    }

    /// End the current interval now and start the next one. See
    /// [`take_interval_at`](Self::take_interval_at).
    pub fn take_interval(&mut self) -> RecordedInterval<'_> {
        self.take_interval_at(Instant::now())
    }

    /// End the current interval at `now` and start the next one; returns the finished
    /// interval. Allocation-free: swaps in the spare histogram and zeroes it in place.
    pub fn take_interval_at(&mut self, now: Instant) -> RecordedInterval<'_> {
        std::mem::swap(&mut self.active, &mut self.spare);
        self.active.reset();
        // Same configuration, auto-resize off: the add is a counts-array walk, it cannot fail.
        let added = self.total.add(&self.spare);
        debug_assert!(added.is_ok(), "same-config add");
        let overflow_count = std::mem::take(&mut self.overflow_count);
        self.overflow_count_total = self.overflow_count_total.saturating_add(overflow_count);
        let start = std::mem::replace(&mut self.interval_start, now);
        RecordedInterval { histogram: &self.spare, start, end: now, overflow_count }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saturates_and_counts_overflow() {
        let mut rec = LatencyRecorder::with_max(1_000_000).unwrap();
        rec.record(10);
        rec.record(2_000_000);
        rec.record_n(5_000_000, 3);
        assert_eq!(rec.current().len(), 5);
        assert_eq!(rec.overflow_count(), 4);
        assert!(rec.current().equivalent(rec.current().max(), 1_000_000));
    }

    #[test]
    fn rotation_swaps_and_totals() {
        let mut rec = LatencyRecorder::with_max(1_000_000).unwrap();
        let t0 = Instant::now();
        for v in 1..=100 {
            rec.record(v);
        }
        rec.record(u64::MAX);
        let iv = rec.take_interval_at(t0 + Duration::from_secs(1));
        assert_eq!(iv.histogram.len(), 101);
        assert_eq!(iv.overflow_count, 1);
        assert_eq!(rec.current().len(), 0);
        rec.record(7);
        let iv = rec.take_interval_at(t0 + Duration::from_secs(2));
        assert_eq!(iv.histogram.len(), 1);
        assert_eq!(iv.length(), Duration::from_secs(1));
        assert_eq!(iv.overflow_count, 0);
        assert_eq!(rec.total().len(), 102);
        assert_eq!(rec.overflow_count_total(), 1);
    }

    #[test]
    fn rejects_bad_config() {
        assert!(LatencyRecorder::with_max(1).is_err());
        let bad = RecorderConfig { latency_ns_max: 1_000, significant_digits: 6 };
        assert!(LatencyRecorder::new(bad).is_err());
    }
}
