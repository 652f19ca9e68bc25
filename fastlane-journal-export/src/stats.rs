//! Counters the exporter thread writes and any thread reads, without a lock.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// The exporter's counters. Each is written by the exporter thread only and read with a
/// relaxed load: they are independent gauges and counters, not a consistent snapshot.
#[derive(Debug, Default)]
pub(crate) struct ExportMetrics {
    pub(crate) exported_seq: AtomicU64,
    pub(crate) durable_seq: AtomicU64,
    pub(crate) published: AtomicU64,
    pub(crate) duplicates: AtomicU64,
    pub(crate) publish_errors: AtomicU64,
    pub(crate) reconnects: AtomicU64,
    pub(crate) source_errors: AtomicU64,
    pub(crate) source_gaps: AtomicU64,
    pub(crate) connected: AtomicBool,
}

impl ExportMetrics {
    pub(crate) fn add(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn set(gauge: &AtomicU64, v: u64) {
        gauge.store(v, Ordering::Relaxed);
    }

    fn snapshot(&self) -> ExportStats {
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let exported_seq = r(&self.exported_seq);
        let durable_seq = r(&self.durable_seq);
        ExportStats {
            exported_seq,
            durable_seq,
            lag_records: durable_seq.saturating_sub(exported_seq),
            published_total: r(&self.published),
            duplicates_total: r(&self.duplicates),
            publish_errors_total: r(&self.publish_errors),
            reconnects_total: r(&self.reconnects),
            source_errors_total: r(&self.source_errors),
            source_gaps_total: r(&self.source_gaps),
            connected: self.connected.load(Ordering::Relaxed),
        }
    }
}

/// A snapshot of the exporter's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ExportStats {
    /// Highest journal seq the stream has acknowledged, all below it acknowledged too.
    pub exported_seq: u64,
    /// The source's durable seq as the exporter last read it (it reads it every poll
    /// interval, connected or not).
    pub durable_seq: u64,
    /// `durable_seq - exported_seq`: records durable here and not yet in the stream.
    pub lag_records: u64,
    /// Publishes acknowledged as newly stored.
    pub published_total: u64,
    /// Publishes acknowledged as duplicates of a stored message (a resend).
    pub duplicates_total: u64,
    /// Sessions ended by a failed publish or ack (timeout, refusal, lost connection).
    pub publish_errors_total: u64,
    /// Sessions after the first: each reconnects and resumes from what the stream holds.
    pub reconnects_total: u64,
    /// Failed or malformed reads from the source.
    pub source_errors_total: u64,
    /// Times the source's first record was above the seq asked for (records skipped).
    pub source_gaps_total: u64,
    /// Whether a session with the stream is up.
    pub connected: bool,
}

/// A cheap, clonable reader of a running exporter's counters (for a metrics thread).
#[derive(Debug, Clone)]
pub struct ExportStatsHandle(pub(crate) Arc<ExportMetrics>);

impl ExportStatsHandle {
    /// The counters now.
    pub fn get(&self) -> ExportStats {
        self.0.snapshot()
    }
}
