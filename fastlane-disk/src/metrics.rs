//! `--metrics`: the Prometheus families of the disk daemon, read at each scrape from what the
//! queues already count and record.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use fastlane_daemon::metrics::{set_gauge, set_total, Families, LatencyFamily};
use fastlane_vhost_blk::{BlkStats, RejectReason};

use crate::REFRESH_WAIT;

/// The Prometheus families of `fastlane serve --metrics`, label `queue` = the virtqueue index.
pub(crate) struct BlkMetrics {
    requests: fastlane_daemon::metrics::IntCounterVec,
    rejected: fastlane_daemon::metrics::IntCounterVec,
    bytes: fastlane_daemon::metrics::IntCounterVec,
    flushes: fastlane_daemon::metrics::IntCounterVec,
    discards: fastlane_daemon::metrics::IntCounterVec,
    sleeps: fastlane_daemon::metrics::IntCounterVec,
    queues: fastlane_daemon::metrics::IntGaugeVec,
    capacity: fastlane_daemon::metrics::IntGaugeVec,
    latency: LatencyFamily,
    in_flight: fastlane_daemon::metrics::IntGaugeVec,
    connections: fastlane_daemon::metrics::IntCounterVec,
    connection_errors: fastlane_daemon::metrics::IntCounterVec,
    resubmitted: fastlane_daemon::metrics::IntCounterVec,
    torn: fastlane_daemon::metrics::IntCounterVec,
    broken_avail: fastlane_daemon::metrics::IntCounterVec,
}

impl BlkMetrics {
    pub(crate) fn new(f: &Families) -> BlkMetrics {
        BlkMetrics {
            requests: f.counter(
                "fastlane_vhost_blk_requests_total",
                "Requests finished, by queue and result (ok, failed: the backend failed it, \
                 rejected: refused before the backend)",
                &["queue", "result"],
            ),
            rejected: f.counter(
                "fastlane_vhost_blk_rejected_total",
                "Requests refused before the backend, by queue and reason",
                &["queue", "reason"],
            ),
            bytes: f.counter(
                "fastlane_vhost_blk_bytes_total",
                "Bytes read and written by the guest, by queue and direction",
                &["queue", "direction"],
            ),
            flushes: f.counter(
                "fastlane_vhost_blk_flushes_total",
                "Flush requests completed, by queue (also in requests_total)",
                &["queue"],
            ),
            discards: f.counter(
                "fastlane_vhost_blk_discards_total",
                "Discard and write-zeroes requests completed, by queue (also in requests_total)",
                &["queue"],
            ),
            sleeps: f.counter(
                "fastlane_vhost_blk_sleeps_total",
                "Times a queue's worker slept on its eventfds after its poll window",
                &["queue"],
            ),
            queues: f.gauge("fastlane_vhost_blk_queues", "Virtqueues exported", &[]),
            capacity: f.gauge("fastlane_vhost_blk_capacity_bytes", "Disk capacity", &[]),
            latency: f.latency(
                "fastlane_vhost_blk_request_duration_seconds",
                "Request latency from popping the chain to its used-ring entry, by queue \
                 (the histograms --hlog writes)",
                &["queue"],
            ),
            in_flight: f.gauge(
                "fastlane_vhost_blk_in_flight",
                "Requests at the backend now, by queue",
                &["queue"],
            ),
            connections: f.counter(
                "fastlane_vhost_blk_connections_total",
                "Frontend connections accepted (each reconnect counts one more)",
                &[],
            ),
            resubmitted: f.counter(
                "fastlane_vhost_blk_resubmitted_total",
                "Requests resubmitted from the in-flight region when a frontend reattached \
                 after a backend restart, by queue",
                &["queue"],
            ),
            torn: f.counter(
                "fastlane_vhost_blk_torn_completions_total",
                "Completions found torn at a restart (used entry published, mark not cleared) \
                 and repaired, by queue",
                &["queue"],
            ),
            broken_avail: f.counter(
                "fastlane_vhost_blk_broken_avail_total",
                "Times a queue found the guest's avail index more than a queue ahead and slept \
                 instead of spinning, by queue",
                &["queue"],
            ),
            connection_errors: f.counter(
                "fastlane_vhost_blk_connection_errors_total",
                "Frontend connections that ended with an error rather than a disconnect",
                &[],
            ),
        }
    }

    pub(crate) fn update(&self, stats: &Arc<BlkStats>, capacity_bytes: u64) {
        let l = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        stats.refresh(REFRESH_WAIT);
        set_total(&self.connections, &[], l(&stats.connections));
        set_total(&self.connection_errors, &[], l(&stats.connections_failed));
        for (i, q) in stats.queues().iter().enumerate() {
            let queue = i.to_string();
            let queue = queue.as_str();
            self.latency.set(&[queue], &q.latency());
            set_gauge(&self.in_flight, &[queue], l(&q.in_flight));
            set_total(&self.resubmitted, &[queue], l(&q.resubmitted));
            set_total(&self.torn, &[queue], l(&q.torn_repaired));
            set_total(&self.broken_avail, &[queue], l(&q.broken_avail));
            set_total(&self.requests, &[queue, "ok"], l(&q.completed));
            set_total(&self.requests, &[queue, "failed"], l(&q.failed));
            set_total(&self.requests, &[queue, "rejected"], q.rejected_total());
            for r in RejectReason::ALL {
                set_total(&self.rejected, &[queue, r.name()], q.rejected(r));
            }
            set_total(&self.bytes, &[queue, "read"], l(&q.bytes_read));
            set_total(&self.bytes, &[queue, "write"], l(&q.bytes_written));
            set_total(&self.flushes, &[queue], l(&q.flushes));
            set_total(&self.discards, &[queue], l(&q.discards));
            set_total(&self.sleeps, &[queue], l(&q.sleeps));
        }
        set_gauge(&self.queues, &[], stats.queues().len() as u64);
        set_gauge(&self.capacity, &[], capacity_bytes);
    }
}
