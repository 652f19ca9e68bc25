//! Per-queue counters and latency histograms of the vhost-user-blk device.
//!
//! Counters are relaxed atomics, one cache-line-aligned block per queue, written only by that
//! queue's worker: readers (logs, `fastlane serve` at exit) see them without a lock and without
//! stealing the worker's cache line on every request.
//!
//! Latency (from popping a chain to pushing it on the used ring) is recorded by each worker in
//! its own histogram, without a lock, and merged into the queue's shared histogram when the
//! worker stops (vring stopped, frontend gone).
//!
//! Histograms come from `fastlane_hist` (same range and precision as every other recorder in
//! FastLane) and are written with its `HlogWriter`, so `fastlane hist` reads them.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use fastlane_hist::{HlogWriter, RecorderConfig};
use hdrhistogram::Histogram;

use super::request::RejectReason;

/// Highest latency a histogram records (larger values are clamped): 60 s in ns.
pub const LATENCY_NS_MAX: u64 = fastlane_hist::DEFAULT_LATENCY_NS_MAX;

/// A latency histogram with the bounds every FastLane recorder uses (1 ns to 60 s, 3
/// significant digits).
// Cannot fail: the bounds are the constant defaults (lowest 1, highest 60 s in ns, 3
// significant digits), inside what `Histogram::new_with_bounds` accepts (highest at least
// twice lowest, at most 5 digits); nothing from a guest reaches them.
#[allow(clippy::expect_used)]
pub fn new_latency_histogram() -> Histogram<u64> {
    RecorderConfig::default().new_histogram().expect("default recorder bounds are valid")
}

/// Counters of one virtqueue.
#[derive(Debug)]
#[repr(align(128))]
pub struct QueueStats {
    /// Requests completed successfully.
    pub completed: AtomicU64,
    /// Requests the backend failed (I/O error, out of range, …).
    pub failed: AtomicU64,
    /// Bytes read by the guest.
    pub bytes_read: AtomicU64,
    /// Bytes written by the guest.
    pub bytes_written: AtomicU64,
    /// Flush requests completed successfully (also counted in `completed`).
    pub flushes: AtomicU64,
    /// Discard and write-zeroes requests completed successfully (also counted in `completed`).
    pub discards: AtomicU64,
    /// Times the worker slept on its eventfds after a poll window ran out.
    pub sleeps: AtomicU64,
    /// Requests refused before reaching the backend, per [`RejectReason`].
    pub rejected: [AtomicU64; RejectReason::COUNT],
    latency: Mutex<Option<Histogram<u64>>>,
}

impl Default for QueueStats {
    fn default() -> Self {
        QueueStats {
            completed: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            bytes_read: AtomicU64::new(0),
            bytes_written: AtomicU64::new(0),
            flushes: AtomicU64::new(0),
            discards: AtomicU64::new(0),
            sleeps: AtomicU64::new(0),
            rejected: std::array::from_fn(|_| AtomicU64::new(0)),
            latency: Mutex::new(None),
        }
    }
}

impl QueueStats {
    /// Count one rejected request.
    #[inline]
    pub fn reject(&self, reason: RejectReason) {
        self.rejected[reason.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// Rejections for one reason.
    pub fn rejected(&self, reason: RejectReason) -> u64 {
        self.rejected[reason.index()].load(Ordering::Relaxed)
    }

    /// All rejections.
    pub fn rejected_total(&self) -> u64 {
        self.rejected.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }

    /// Merge a worker's histogram into the queue's (control path: worker stop).
    pub fn merge_latency(&self, h: &Histogram<u64>) {
        if h.is_empty() {
            return;
        }
        let mut shared = self.latency.lock().unwrap_or_else(|e| e.into_inner());
        let shared = shared.get_or_insert_with(new_latency_histogram);
        // Same bounds on both sides, so adding cannot fail.
        let _ = shared.add(h);
    }

    /// A copy of the queue's merged latency histogram.
    pub fn latency(&self) -> Histogram<u64> {
        let shared = self.latency.lock().unwrap_or_else(|e| e.into_inner());
        shared.clone().unwrap_or_else(new_latency_histogram)
    }
}

/// Counters of every queue of one export; outlives connections.
#[derive(Debug)]
pub struct BlkStats {
    queues: Vec<QueueStats>,
}

impl BlkStats {
    /// Stats for `num_queues` queues.
    pub fn new(num_queues: usize) -> Self {
        BlkStats { queues: (0..num_queues).map(|_| QueueStats::default()).collect() }
    }

    /// One queue's counters.
    pub fn queue(&self, index: usize) -> &QueueStats {
        &self.queues[index]
    }

    /// All queues.
    pub fn queues(&self) -> &[QueueStats] {
        &self.queues
    }

    /// One line per queue with non-zero counters, for logs.
    pub fn summary(&self) -> String {
        let mut s = String::new();
        for (i, q) in self.queues.iter().enumerate() {
            let done = q.completed.load(Ordering::Relaxed);
            let rej = q.rejected_total();
            let failed = q.failed.load(Ordering::Relaxed);
            if done + rej + failed == 0 {
                continue;
            }
            s.push_str(&format!(
                "queue {i}: {done} ok, {failed} failed, {rej} rejected, {} B read, {} B written, \
                 {} flushes, {} discards",
                q.bytes_read.load(Ordering::Relaxed),
                q.bytes_written.load(Ordering::Relaxed),
                q.flushes.load(Ordering::Relaxed),
                q.discards.load(Ordering::Relaxed)
            ));
            for r in RejectReason::ALL {
                let n = q.rejected(r);
                if n > 0 {
                    s.push_str(&format!(", {}={n}", r.name()));
                }
            }
            s.push('\n');
        }
        s
    }

    /// Write every queue's latency histogram (ns) as one interval of an HdrHistogram log
    /// (`.hlog`), tagged `queue<N>`.
    pub fn write_hlog<W: Write>(&self, out: W, elapsed_s: f64) -> std::io::Result<()> {
        let mut w = HlogWriter::new(out).map_err(std::io::Error::other)?;
        w.write_comment("fastlane serve: vhost-user-blk request latency, ns, per queue")
            .map_err(std::io::Error::other)?;
        let length = std::time::Duration::from_secs_f64(elapsed_s.max(0.0));
        for (i, q) in self.queues.iter().enumerate() {
            let tag = format!("queue{i}");
            w.write_histogram(Some(&tag), std::time::Duration::ZERO, length, &q.latency())
                .map_err(std::io::Error::other)?;
        }
        w.flush().map_err(std::io::Error::other)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_and_write_hlog() {
        let stats = BlkStats::new(2);
        let mut h = new_latency_histogram();
        h.record(1500).unwrap();
        h.record(2500).unwrap();
        stats.queue(1).merge_latency(&h);
        stats.queue(1).merge_latency(&h);
        assert_eq!(stats.queue(1).latency().len(), 4);
        assert!(stats.queue(0).latency().is_empty());
        stats.queue(0).reject(RejectReason::OutOfRange);
        assert_eq!(stats.queue(0).rejected(RejectReason::OutOfRange), 1);
        let mut out = Vec::new();
        stats.write_hlog(&mut out, 1.0).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains("Tag=queue1"), "{text}");
        assert!(text.contains("Tag=queue0"));
        let log = fastlane_hist::parse_hlog(text.as_bytes()).unwrap();
        assert_eq!(log.merged_for_tag(Some("queue1")).unwrap().len(), 4);
        assert_eq!(log.merged_for_tag(Some("queue0")).unwrap().len(), 0);
    }
}
