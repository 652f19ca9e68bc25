//! The writer's counters, shared by the writer (`writer.rs`) and its flusher threads
//! (`flusher.rs`), which both count into them; in a module of their own so that the flusher
//! does not import the writer that owns it.

use std::sync::atomic::{AtomicU64, Ordering};

/// Counters the writer keeps (read with [`Journal::stats`](super::Journal::stats)).
#[derive(Debug, Default)]
pub(crate) struct WriterStats {
    pub(crate) batches: AtomicU64,
    pub(crate) records: AtomicU64,
    pub(crate) bytes_written: AtomicU64,
    pub(crate) flushes: AtomicU64,
    pub(crate) end: AtomicU64,
    /// Segments rolled to (the journal service).
    pub(crate) rolls: AtomicU64,
    /// Rolls that failed and were retried (no room for the next segment).
    pub(crate) roll_failures: AtomicU64,
    /// Time the writer spent in rolls (every ack waits meanwhile), ns.
    pub(crate) roll_ns: AtomicU64,
    /// Commit latency of each batch.
    pub(crate) commit: LatencyBuckets,
}

/// Upper bounds (ns) of the commit-latency buckets: 1 µs to 10 s, the bounds the daemons'
/// Prometheus latency histograms use.
pub const COMMIT_BUCKETS_NS: [u64; 22] = [
    1_000,
    2_000,
    5_000,
    10_000,
    20_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    500_000_000,
    1_000_000_000,
    2_500_000_000,
    5_000_000_000,
    10_000_000_000,
];

/// Commit latencies the writer observes, lock-free: one atomic add per batch.
#[derive(Debug, Default)]
pub(crate) struct LatencyBuckets {
    /// Per bucket of [`COMMIT_BUCKETS_NS`], and one past the last (+Inf); not cumulative.
    counts: [AtomicU64; COMMIT_BUCKETS_NS.len() + 1],
    sum_ns: AtomicU64,
}

impl LatencyBuckets {
    pub(crate) fn observe(&self, ns: u64) {
        let i = COMMIT_BUCKETS_NS.partition_point(|&b| b < ns);
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> CommitLatency {
        let mut counts = [0u64; COMMIT_BUCKETS_NS.len() + 1];
        for (c, a) in counts.iter_mut().zip(&self.counts) {
            *c = a.load(Ordering::Relaxed);
        }
        CommitLatency { counts, sum_ns: self.sum_ns.load(Ordering::Relaxed) }
    }
}

/// How long batches waited in the writer: from taking a batch's first record out of a ring to
/// publishing it durable (the oldest record of each batch; a producer's own wait adds the
/// time its record sat in the ring before that).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CommitLatency {
    /// Batches per bucket of [`COMMIT_BUCKETS_NS`], the last one past its end (+Inf); not
    /// cumulative.
    pub counts: [u64; COMMIT_BUCKETS_NS.len() + 1],
    /// Sum of the latencies, ns.
    pub sum_ns: u64,
}

impl CommitLatency {
    /// Batches observed.
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }
}
