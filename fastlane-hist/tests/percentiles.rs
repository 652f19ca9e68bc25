//! Percentiles of known distributions, through the whole path: recorder → .hlog file →
//! reader → Summary.

use fastlane_hist::synth::{write_synthetic_hlog, Distribution, SyntheticStream};
use fastlane_hist::{read_hlog, HlogFile, Summary};

fn round_trip(streams: &[SyntheticStream]) -> HlogFile {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("synthetic.hlog");
    write_synthetic_hlog(&path, streams).unwrap();
    read_hlog(&path).unwrap()
}

fn assert_within(what: &str, actual: f64, expected: f64, relative: f64) {
    let error = (actual - expected).abs() / expected;
    assert!(error <= relative, "{what}: {actual} vs {expected} ({:.4}% off)", error * 100.0);
}

#[test]
fn uniform_one_to_a_million() {
    let n = 1_000_000;
    let file = round_trip(&[SyntheticStream::new(
        Distribution::Sequence { low_ns: 1, high_ns: n },
        n,
        10,
    )]);
    assert_eq!(file.intervals.len(), 10);
    assert!(file.intervals.iter().all(|iv| iv.histogram.len() == n / 10));
    let s = Summary::from_histogram(&file.merged);
    assert_eq!(s.count, n);
    // 3 significant digits: every value within 1/1024 of the true one.
    let precision = 1.0 / 1024.0;
    assert_within("P50", s.p50_ns as f64, 500_000.0, precision);
    assert_within("P90", s.p90_ns as f64, 900_000.0, precision);
    assert_within("P99", s.p99_ns as f64, 990_000.0, precision);
    assert_within("P99.9", s.p99_9_ns as f64, 999_000.0, precision);
    assert_within("P99.99", s.p99_99_ns as f64, 999_900.0, precision);
    assert_within("max", s.max_ns as f64, 1_000_000.0, precision);
    assert_within("mean", s.mean_ns, 500_000.5, precision);
    assert_eq!(s.min_ns, 1);
}

#[test]
fn exponential_fixed_seed() {
    let mean_ns = 100_000.0;
    let stream = SyntheticStream {
        seed: 42,
        ..SyntheticStream::new(Distribution::Exponential { mean_ns }, 1_000_000, 4)
    };
    let file = round_trip(&[stream]);
    let s = Summary::from_histogram(&file.merged);
    let quantile = |p: f64| -mean_ns * (1.0 - p).ln();
    // Sampling error of the p-quantile of 10^6 draws is ~0.2 % at P99, ~0.7 % at P99.9.
    assert_within("mean", s.mean_ns, mean_ns, 0.01);
    assert_within("P50", s.p50_ns as f64, quantile(0.5), 0.01);
    assert_within("P90", s.p90_ns as f64, quantile(0.9), 0.01);
    assert_within("P99", s.p99_ns as f64, quantile(0.99), 0.01);
    assert_within("P99.9", s.p99_9_ns as f64, quantile(0.999), 0.03);
}

#[test]
fn two_point_mixture_is_exact() {
    // 2 % of samples at 2000 ns: P99 is exactly 2000, P90 exactly 100 (both below 2048, where
    // a 3-digit histogram is exact).
    let two_percent = SyntheticStream::new(
        Distribution::TwoPoint { low_ns: 100, high_ns: 2000, high_every: 50 },
        100_000,
        3,
    )
    .tagged("two");
    // 0.5 %: P99 is the low value, P99.9 the high one.
    let half_percent = SyntheticStream::new(
        Distribution::TwoPoint { low_ns: 100, high_ns: 2000, high_every: 200 },
        100_000,
        3,
    )
    .tagged("half");
    let file = round_trip(&[two_percent, half_percent]);
    assert_eq!(file.tags(), vec![Some("two"), Some("half")]);

    let s = Summary::from_histogram(&file.merged_for_tag(Some("two")).unwrap());
    assert_eq!(s.count, 100_000);
    assert_eq!((s.p50_ns, s.p90_ns, s.p99_ns, s.p99_9_ns, s.max_ns), (100, 100, 2000, 2000, 2000));
    assert_eq!(s.mean_ns, 0.98 * 100.0 + 0.02 * 2000.0);

    let s = Summary::from_histogram(&file.merged_for_tag(Some("half")).unwrap());
    assert_eq!((s.p90_ns, s.p99_ns, s.p99_9_ns), (100, 100, 2000));

    assert_eq!(file.merged.len(), 200_000);
}
