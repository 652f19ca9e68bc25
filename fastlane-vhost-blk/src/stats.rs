//! Per-queue counters and latency histograms of the vhost-user-blk device.
//!
//! Counters are relaxed atomics, one cache-line-aligned block per queue, written only by that
//! queue's worker: readers (logs, `fastlane serve` at exit) see them without a lock and without
//! stealing the worker's cache line on every request.
//!
//! Latency (from popping a chain to pushing it on the used ring) is recorded by each worker in
//! its own histogram, without a lock, and merged into the queue's shared histogram: every
//! [`MERGE_INTERVAL`] while the queue is busy, when it goes to sleep after at least that long,
//! when the worker stops (vring stopped, frontend gone), and when a reader asks for fresh
//! numbers ([`BlkStats::refresh`]: a flag and a wake-up eventfd the worker's epoll thread
//! watches, so a sleeping queue merges too). The merge walks the histogram's buckets (tens
//! of µs), which is why it is not done per request.
//!
//! Histograms come from `fastlane_hist` (same range and precision as every other recorder in
//! FastLane) and are written with its `HlogWriter`, so `fastlane hist` reads them.

use std::io::Write;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use fastlane_hist::{HlogWriter, RecorderConfig};
use hdrhistogram::Histogram;
use log::warn;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::request::RejectReason;

/// How often a busy worker merges its latency histogram into the queue's shared one.
pub const MERGE_INTERVAL: Duration = Duration::from_millis(100);

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
    /// Requests handed to the block queue and not yet completed (set by the worker once per
    /// batch, not per request).
    pub in_flight: AtomicU64,
    /// Requests resubmitted from the in-flight region after a backend restart.
    pub resubmitted: AtomicU64,
    /// Times the guest's avail index was more than a queue ahead (the queue then sleeps until
    /// the next kick instead of spinning).
    pub broken_avail: AtomicU64,
    /// Torn completions repaired at a start (a used entry published, its mark not cleared).
    pub torn_repaired: AtomicU64,
    /// Whether a worker serves this queue now (a frontend is connected and has kicked it).
    worker_running: AtomicBool,
    /// A reader wants the worker's latency merged now ([`BlkStats::refresh`]).
    merge_requested: AtomicBool,
    /// Merges done so far: a reader waits for it to move after a request.
    merges: AtomicU64,
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
            in_flight: AtomicU64::new(0),
            resubmitted: AtomicU64::new(0),
            torn_repaired: AtomicU64::new(0),
            broken_avail: AtomicU64::new(0),
            worker_running: AtomicBool::new(false),
            merge_requested: AtomicBool::new(false),
            merges: AtomicU64::new(0),
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

    /// Merge a worker's histogram into the queue's (never per request: see the module doc),
    /// and tell a reader waiting in [`BlkStats::refresh`] that it is done.
    pub fn merge_latency(&self, h: &Histogram<u64>) {
        if !h.is_empty() {
            let mut shared = self.latency.lock().unwrap_or_else(|e| e.into_inner());
            let shared = shared.get_or_insert_with(new_latency_histogram);
            // Same bounds on both sides, so adding cannot fail.
            let _ = shared.add(h);
        }
        self.merge_requested.store(false, Ordering::Relaxed);
        // Release: pairs with the Acquire load in `BlkStats::refresh`, so a reader that sees
        // the new count also sees the merged histogram (the mutex orders it too).
        self.merges.fetch_add(1, Ordering::Release);
    }

    /// Whether a reader asked for a merge (the worker checks it once per loop turn).
    #[inline]
    pub fn merge_requested(&self) -> bool {
        self.merge_requested.load(Ordering::Relaxed)
    }

    /// The worker of this queue starts (true) or stops (false).
    pub fn set_worker_running(&self, running: bool) {
        self.worker_running.store(running, Ordering::Release);
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
    /// One per queue: written by [`BlkStats::refresh`], watched by the queue's epoll thread,
    /// which then merges its latency histogram. `None` if the eventfd could not be made
    /// (refresh then waits for the periodic merge).
    wake: Vec<Option<EventFd>>,
    /// Frontend connections accepted so far (the first one included).
    pub connections: AtomicU64,
    /// Connections that ended with an error (not a plain disconnect).
    pub connections_failed: AtomicU64,
}

impl BlkStats {
    /// Stats for `num_queues` queues.
    pub fn new(num_queues: usize) -> Self {
        let wake = (0..num_queues)
            .map(|q| match EventFd::new(EFD_NONBLOCK) {
                Ok(fd) => Some(fd),
                Err(e) => {
                    warn!("queue {q}: no wake-up eventfd for live latency ({e}); merged every {MERGE_INTERVAL:?} of activity only");
                    None
                }
            })
            .collect();
        BlkStats {
            queues: (0..num_queues).map(|_| QueueStats::default()).collect(),
            wake,
            connections: AtomicU64::new(0),
            connections_failed: AtomicU64::new(0),
        }
    }

    /// The eventfd a queue's epoll thread watches for merge requests.
    pub fn wake_fd(&self, queue: usize) -> Option<RawFd> {
        self.wake.get(queue)?.as_ref().map(|e| e.as_raw_fd())
    }

    /// Consume a wake-up (the queue's epoll thread, after the eventfd became readable).
    pub fn take_wake(&self, queue: usize) {
        if let Some(Some(e)) = self.wake.get(queue) {
            let _ = e.read();
        }
    }

    /// Bring every running queue's shared latency histogram up to date: ask each worker to
    /// merge, wake it, and wait (at most `timeout`) until each has. Control path (a scrape, a
    /// stats line); returns whether every running worker answered in time.
    pub fn refresh(&self, timeout: Duration) -> bool {
        let mut waiting: Vec<(usize, u64)> = Vec::with_capacity(self.queues.len());
        for (i, q) in self.queues.iter().enumerate() {
            if !q.worker_running.load(Ordering::Acquire) {
                continue;
            }
            let before = q.merges.load(Ordering::Acquire);
            q.merge_requested.store(true, Ordering::Relaxed);
            if let Some(Some(e)) = self.wake.get(i) {
                let _ = e.write(1);
            }
            waiting.push((i, before));
        }
        let deadline = Instant::now() + timeout;
        loop {
            waiting.retain(|&(i, before)| {
                let q = &self.queues[i];
                // Acquire: pairs with the Release increment in `merge_latency`.
                q.merges.load(Ordering::Acquire) == before
                    && q.worker_running.load(Ordering::Acquire)
            });
            if waiting.is_empty() {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
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
