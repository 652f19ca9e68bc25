//! [`Summary`]: the numbers every report prints, and [`format_ns`] for human units.

use hdrhistogram::Histogram;
use serde::Serialize;

/// Count, mean, the standard percentiles and max of a nanosecond histogram.
///
/// Percentiles are hdrhistogram's `value_at_quantile`: the highest value equivalent (within the
/// histogram's precision) to the one at that rank, as Java's tools report them. An empty
/// histogram gives all zeros.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Summary {
    /// Samples.
    pub count: u64,
    /// Smallest sample (lowest equivalent value).
    pub min_ns: u64,
    /// Arithmetic mean.
    pub mean_ns: f64,
    /// Median.
    pub p50_ns: u64,
    /// 90th percentile.
    pub p90_ns: u64,
    /// 99th percentile.
    pub p99_ns: u64,
    /// 99.9th percentile.
    pub p99_9_ns: u64,
    /// 99.99th percentile.
    pub p99_99_ns: u64,
    /// Largest sample (highest equivalent value).
    pub max_ns: u64,
}

/// One latency figure of a [`Summary`], for tables and comparisons.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Metric {
    /// Short name used as a table column / JSON key: `mean`, `p50`, …, `max`.
    pub key: &'static str,
    /// Label for humans: `mean`, `P50`, `P99.9`, …, `max`.
    pub label: &'static str,
    /// Value in nanoseconds.
    pub value_ns: f64,
}

impl Summary {
    /// Summarise `histogram` (values in nanoseconds).
    pub fn from_histogram(histogram: &Histogram<u64>) -> Self {
        if histogram.is_empty() {
            return Self {
                count: 0,
                min_ns: 0,
                mean_ns: 0.0,
                p50_ns: 0,
                p90_ns: 0,
                p99_ns: 0,
                p99_9_ns: 0,
                p99_99_ns: 0,
                max_ns: 0,
            };
        }
        let q = |quantile: f64| histogram.value_at_quantile(quantile);
        Self {
            count: histogram.len(),
            min_ns: histogram.min(),
            mean_ns: histogram.mean(),
            p50_ns: q(0.5),
            p90_ns: q(0.9),
            p99_ns: q(0.99),
            p99_9_ns: q(0.999),
            p99_99_ns: q(0.9999),
            max_ns: histogram.max(),
        }
    }

    /// mean, P50, P90, P99, P99.9, P99.99 and max, in that order.
    pub fn metrics(&self) -> [Metric; 7] {
        let m = |key, label, value_ns| Metric { key, label, value_ns };
        [
            m("mean", "mean", self.mean_ns),
            m("p50", "P50", self.p50_ns as f64),
            m("p90", "P90", self.p90_ns as f64),
            m("p99", "P99", self.p99_ns as f64),
            m("p99_9", "P99.9", self.p99_9_ns as f64),
            m("p99_99", "P99.99", self.p99_99_ns as f64),
            m("max", "max", self.max_ns as f64),
        ]
    }
}

/// Format nanoseconds with three significant digits in the unit that keeps the number in
/// `1..1000`: `512 ns`, `1.50 µs`, `45.6 ms`, `2.00 s` (seconds beyond 1000 stay in seconds).
pub fn format_ns(value_ns: f64) -> String {
    if !value_ns.is_finite() {
        return format!("{value_ns}");
    }
    const UNITS: [(&str, f64); 4] = [("ns", 1.0), ("µs", 1e3), ("ms", 1e6), ("s", 1e9)];
    let magnitude = value_ns.abs();
    let mut unit = 0;
    while unit + 1 < UNITS.len() && magnitude >= UNITS[unit + 1].1 {
        unit += 1;
    }
    loop {
        let scaled = value_ns / UNITS[unit].1;
        let decimals = if scaled.abs() < 10.0 {
            2
        } else if scaled.abs() < 100.0 {
            1
        } else {
            0
        };
        let text = format!("{scaled:.decimals$}");
        // 999.7 ns rounds to "1000": say 1.00 µs instead.
        if unit + 1 < UNITS.len() && text.trim_start_matches('-').len() >= 4 && decimals == 0 {
            if let Ok(v) = text.parse::<f64>() {
                if v.abs() >= 1000.0 {
                    unit += 1;
                    continue;
                }
            }
        }
        if unit == 0 && value_ns.fract() == 0.0 {
            return format!("{value_ns:.0} {}", UNITS[0].0);
        }
        return format!("{text} {}", UNITS[unit].0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_units() {
        assert_eq!(format_ns(0.0), "0 ns");
        assert_eq!(format_ns(7.0), "7 ns");
        assert_eq!(format_ns(512.0), "512 ns");
        assert_eq!(format_ns(1.5), "1.50 ns");
        assert_eq!(format_ns(999.0), "999 ns");
        assert_eq!(format_ns(999.7), "1.00 µs");
        assert_eq!(format_ns(1_500.0), "1.50 µs");
        assert_eq!(format_ns(45_600_000.0), "45.6 ms");
        assert_eq!(format_ns(999_999.0), "1.00 ms");
        assert_eq!(format_ns(2_000_895.0), "2.00 ms");
        assert_eq!(format_ns(3e9), "3.00 s");
        assert_eq!(format_ns(1.2e12), "1200 s");
    }

    #[test]
    fn empty_histogram_is_zero() {
        let h = Histogram::<u64>::new(3).unwrap();
        let s = Summary::from_histogram(&h);
        assert_eq!(s.count, 0);
        assert_eq!(s.max_ns, 0);
    }
}
