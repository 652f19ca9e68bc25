//! Latency histograms for FastLane: record on the hot path, log intervals, report.
//!
//! Built on the `hdrhistogram` crate. Every latency is recorded in **nanoseconds**.
//!
//! # What it does
//!
//! - [`LatencyRecorder`] records `u64` nanosecond values into a fixed-range histogram
//!   (default 1 ns ..= 60 s, 3 significant digits). A value above the range is recorded as
//!   the range's top and counted ([`LatencyRecorder::overflow_count`]), never an error.
//!   Construction allocates three histograms; [`record`](LatencyRecorder::record) and
//!   [`take_interval`](LatencyRecorder::take_interval) never allocate, lock or make a
//!   syscall (`take_interval` reads the monotonic clock; `take_interval_at` does not).
//! - [`HlogWriter`] writes HdrHistogram interval logs (`.hlog`, log format 1.3, V2
//!   deflate-compressed histograms, optional `Tag=`), the files Java's `HistogramLogProcessor`
//!   and the `hdrhistogram` crate's `IntervalLogIterator` read. The `Interval_Max` column is
//!   in milliseconds ([`MAX_VALUE_DIVISOR`] = 10⁶), matching Java's default, so the Java tool
//!   prints milliseconds unless given `-outputValueUnitRatio 1000` (µs).
//! - [`read_hlog`] / [`parse_hlog`] read such a log back into [`HlogFile`]: every interval
//!   (tag, start, length, histogram) plus all of them merged. The file is treated as
//!   hostile: a malformed line is a [`HistError::Corrupt`] naming the line, never a panic,
//!   and lengths are checked before anything is allocated.
//! - [`Summary`] holds count, min, mean, P50, P90, P99, P99.9, P99.99 and max, serializes to
//!   JSON (fields in ns), and [`format_ns`] prints a value in ns, µs, ms or s.
//! - [`percentile_plot_svg`] draws the percentile distribution of several histograms as SVG
//!   on HdrHistogram's "nines" axis.
//! - [`report`] makes `fastlane hist`'s tables and comparisons (text, JSON, CSV).
//! - [`synth`] writes logs with known distributions for tests.
//!
//! # What it does not do
//!
//! - No cross-thread recording: a recorder is `&mut`; give each thread its own and merge
//!   intervals with `Histogram::add` off the hot path.
//! - No coordinated-omission correction: record what you measured from the intended start
//!   time if you need it.
//! - The reader keeps every interval in memory (about 8 bytes per histogram counter, ~210 KiB
//!   per interval at the default range) and refuses files over 1 GiB or 1 GiB of counters.
//!   It reads only V2 compressed histograms (cookie `0x1c849314`), which is what every
//!   current writer emits; StartTime/BaseTime are reported but not used to filter.
//!
//! # Example
//!
//! ```
//! use fastlane_hist::{parse_hlog, HlogWriter, LatencyRecorder, Summary};
//!
//! let mut rec = LatencyRecorder::with_max(1_000_000_000)?; // 1 s
//! let mut log = HlogWriter::new(Vec::new())?;
//! for v in 1..=1000 {
//!     rec.record(v * 1000); // 1 µs ..= 1 ms
//! }
//! let interval = rec.take_interval();
//! log.write_interval(Some("op"), &interval)?;
//! let bytes = log.into_inner()?;
//!
//! let file = parse_hlog(&bytes)?;
//! let summary = Summary::from_histogram(&file.merged);
//! assert_eq!(summary.count, 1000);
//! assert!(file.merged.equivalent(summary.p50_ns, 500_000));
//! # Ok::<(), fastlane_hist::HistError>(())
//! ```

mod error;
mod hlog;
mod plot;
mod recorder;
pub mod report;
mod summary;
pub mod synth;

pub use error::HistError;
pub use hdrhistogram::Histogram;
pub use hlog::{
    parse_hlog, read_hlog, HlogFile, HlogInterval, HlogWriter, LEGEND, MAX_COUNTERS_TOTAL,
    MAX_FILE_BYTES, MAX_INFLATED_BYTES, MAX_VALUE_DIVISOR, V2_COMPRESSED_COOKIE, V2_COOKIE,
};
pub use plot::{percentile_plot_svg, PlotSeries};
pub use recorder::{
    LatencyRecorder, RecordedInterval, RecorderConfig, DEFAULT_LATENCY_NS_MAX,
    DEFAULT_SIGNIFICANT_DIGITS,
};
pub use summary::{format_ns, Metric, Summary};
