//! Synthetic interval logs with known distributions, for tests and demos.

use std::path::Path;
use std::time::{Duration, Instant, UNIX_EPOCH};

use fastlane_util::SplitMix64;
use hdrhistogram::Histogram;

use crate::{HistError, HlogWriter, LatencyRecorder, RecorderConfig};

/// BaseTime of synthetic logs: fixed, so that generated files are reproducible.
pub const SYNTHETIC_BASE_TIME_S: u64 = 1_700_000_000;

/// A latency distribution, in nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Distribution {
    /// Sample k is `low_ns + k mod (high_ns - low_ns + 1)`: with `samples` equal to the range
    /// size, every value once — an exact uniform distribution.
    Sequence {
        /// First value.
        low_ns: u64,
        /// Last value (inclusive).
        high_ns: u64,
    },
    /// Exponential with mean `mean_ns`, from a SplitMix64 generator seeded with the stream's
    /// seed. Its p-th quantile is `-mean_ns * ln(1 - p)`.
    Exponential {
        /// Mean (1/λ).
        mean_ns: f64,
    },
    /// Every `high_every`-th sample is `high_ns`, the others `low_ns`.
    TwoPoint {
        /// The common value.
        low_ns: u64,
        /// The rare value.
        high_ns: u64,
        /// One sample in this many is `high_ns` (at least 1).
        high_every: u64,
    },
}

/// One tagged stream of samples, spread over consecutive 1-second intervals.
#[derive(Debug, Clone, PartialEq)]
pub struct SyntheticStream {
    /// Tag written on its intervals.
    pub tag: Option<String>,
    /// The distribution sampled.
    pub distribution: Distribution,
    /// Samples in total, split evenly (in order) over `intervals`.
    pub samples: u64,
    /// Number of intervals, at least 1.
    pub intervals: u32,
    /// Seed for random distributions.
    pub seed: u64,
}

impl SyntheticStream {
    /// An untagged stream with seed 1.
    pub fn new(distribution: Distribution, samples: u64, intervals: u32) -> Self {
        Self { tag: None, distribution, samples, intervals, seed: 1 }
    }

    /// The same stream, tagged.
    pub fn tagged(mut self, tag: &str) -> Self {
        self.tag = Some(tag.to_owned());
        self
    }

    /// The stream's interval histograms, recorded through a default [`LatencyRecorder`].
    pub fn histograms(&self) -> Result<Vec<Histogram<u64>>, HistError> {
        let intervals = u64::from(self.intervals.max(1));
        let mut recorder = LatencyRecorder::new(RecorderConfig::default())?;
        let mut rng = SplitMix64::new(self.seed);
        let mut out = Vec::with_capacity(intervals as usize);
        let t0 = Instant::now();
        let mut k = 0;
        for i in 0..intervals {
            // Interval i holds samples [samples*i/n, samples*(i+1)/n).
            let end = (u128::from(self.samples) * u128::from(i + 1) / u128::from(intervals)) as u64;
            while k < end {
                recorder.record(self.sample(k, &mut rng));
                k += 1;
            }
            out.push(recorder.take_interval_at(t0).histogram.clone());
        }
        Ok(out)
    }

    fn sample(&self, k: u64, rng: &mut SplitMix64) -> u64 {
        match self.distribution {
            Distribution::Sequence { low_ns, high_ns } => {
                let span = high_ns.saturating_sub(low_ns).saturating_add(1);
                low_ns + k % span
            }
            Distribution::Exponential { mean_ns } => {
                let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
                (-mean_ns * (1.0 - u).ln()).round() as u64
            }
            Distribution::TwoPoint { low_ns, high_ns, high_every } => {
                if k % high_every.max(1) == high_every.max(1) - 1 {
                    high_ns
                } else {
                    low_ns
                }
            }
        }
    }
}

/// Write `streams` as one interval log at `path`: interval i of every stream starts at i s
/// after [`SYNTHETIC_BASE_TIME_S`] and lasts 1 s; lines are ordered by time, then stream.
pub fn write_synthetic_hlog(
    path: impl AsRef<Path>,
    streams: &[SyntheticStream],
) -> Result<(), HistError> {
    let per_stream =
        streams.iter().map(SyntheticStream::histograms).collect::<Result<Vec<_>, _>>()?;
    let path = path.as_ref();
    let file = std::fs::File::create(path)
        .map_err(|source| HistError::Io { path: path.to_path_buf(), source })?;
    let base = UNIX_EPOCH + Duration::from_secs(SYNTHETIC_BASE_TIME_S);
    let mut writer = HlogWriter::with_base_time(std::io::BufWriter::new(file), base)?;
    writer.write_comment("[synthetic latencies from fastlane-hist]")?;
    let interval_count = per_stream.iter().map(Vec::len).max().unwrap_or(0);
    for i in 0..interval_count {
        for (stream, hists) in streams.iter().zip(&per_stream) {
            if let Some(h) = hists.get(i) {
                let start = Duration::from_secs(i as u64);
                writer.write_histogram(stream.tag.as_deref(), start, Duration::from_secs(1), h)?;
            }
        }
    }
    writer.into_inner()?;
    Ok(())
}
