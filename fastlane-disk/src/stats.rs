//! What the daemon logs about its queues: the SIGUSR1 totals and the `--stats-interval` line.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use fastlane_vhost_blk::BlkStats;

use crate::REFRESH_WAIT;

/// SIGUSR1: every queue's counters and latency since start.
pub(crate) fn log_totals(stats: &BlkStats) {
    stats.refresh(REFRESH_WAIT);
    let summary = stats.summary();
    let mut text =
        format!("totals (SIGUSR1): {} connection(s)\n", stats.connections.load(Ordering::Relaxed));
    text.push_str(if summary.is_empty() { "no requests yet\n" } else { &summary });
    for (i, q) in stats.queues().iter().enumerate() {
        let h = q.latency();
        if !h.is_empty() {
            text.push_str(&format!("queue {i}: latency {}\n", percentiles(&h)));
        }
    }
    log::info!("{}", text.trim_end());
}

/// `p50 … p99 … p99.9 … max …` in µs.
fn percentiles(h: &hdrhistogram::Histogram<u64>) -> String {
    let us = |ns: u64| ns as f64 / 1e3;
    format!(
        "p50 {:.1} µs, p99 {:.1} µs, p99.9 {:.1} µs, max {:.1} µs ({} requests)",
        us(h.value_at_quantile(0.5)),
        us(h.value_at_quantile(0.99)),
        us(h.value_at_quantile(0.999)),
        us(h.max()),
        h.len()
    )
}

/// `--stats-interval`: a thread that logs one line per interval until dropped.
pub(crate) struct StatsTicker {
    stop: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl StatsTicker {
    pub(crate) fn start(stats: Arc<BlkStats>, every: Duration) -> anyhow::Result<StatsTicker> {
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("serve-stats".into())
            .spawn(move || {
                let mut last = IntervalTotals::now(&stats);
                let mut at = Instant::now();
                while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                    stopped.recv_timeout(every)
                {
                    let now = IntervalTotals::now(&stats);
                    let secs = at.elapsed().as_secs_f64();
                    at = Instant::now();
                    log::info!("{}", now.line_since(&last, secs));
                    last = now;
                }
            })
            .context("cannot spawn the --stats-interval thread")?;
        Ok(StatsTicker { stop: Some(stop), thread: Some(thread) })
    }
}

impl Drop for StatsTicker {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Totals over every queue at one moment.
struct IntervalTotals {
    requests: u64,
    errors: u64,
    bytes_read: u64,
    bytes_written: u64,
    in_flight: u64,
    latency: hdrhistogram::Histogram<u64>,
}

impl IntervalTotals {
    fn now(stats: &BlkStats) -> IntervalTotals {
        stats.refresh(REFRESH_WAIT);
        let l = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        let mut t = IntervalTotals {
            requests: 0,
            errors: 0,
            bytes_read: 0,
            bytes_written: 0,
            in_flight: 0,
            latency: fastlane_vhost_blk::stats::new_latency_histogram(),
        };
        for q in stats.queues() {
            t.requests += l(&q.completed);
            t.errors += l(&q.failed) + q.rejected_total();
            t.bytes_read += l(&q.bytes_read);
            t.bytes_written += l(&q.bytes_written);
            t.in_flight += l(&q.in_flight);
            // Same bounds on both sides: adding cannot fail.
            let _ = t.latency.add(q.latency());
        }
        t
    }

    /// The stats line for the interval from `before` to `self`, `secs` long.
    fn line_since(&self, before: &IntervalTotals, secs: f64) -> String {
        let secs = secs.max(1e-9);
        let requests = self.requests.saturating_sub(before.requests);
        let mb = |now: u64, then: u64| now.saturating_sub(then) as f64 / 1e6 / secs;
        let mut latency = self.latency.clone();
        let latency = match latency.subtract(&before.latency) {
            Ok(()) if !latency.is_empty() => percentiles(&latency),
            _ => "no requests".to_string(),
        };
        format!(
            "stats: {requests} requests ({:.0}/s), {:.1} MB/s read, {:.1} MB/s written, {} \
             errors, {} in flight; latency {latency}",
            requests as f64 / secs,
            mb(self.bytes_read, before.bytes_read),
            mb(self.bytes_written, before.bytes_written),
            self.errors.saturating_sub(before.errors),
            self.in_flight,
        )
    }
}
