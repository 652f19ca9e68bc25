//! `fastlane journal serve --export nats://…`: the service's durable records, read back from
//! its segment directory with a [`Tailer`], shipped by `fastlane_journal_export` to a NATS
//! JetStream stream on a thread of its own (the writer never waits for it).

use std::path::PathBuf;

use fastlane_daemon::metrics::{counter, gauge, Field};
use fastlane_journal::service::DurableView;
use fastlane_journal::Tailer;
use fastlane_journal_export::{ExportRecord, ExportStats, RecordSource, SourceError};

/// The segment directory as the exporter's source: a tailer kept between calls (reopened
/// only when the exporter asks for another place, after a reconnect).
pub(super) struct DirSource {
    dir: PathBuf,
    durable: DurableView,
    tail: Option<Tailer>,
    buf: Vec<fastlane_journal::TailRecord>,
}

impl DirSource {
    pub(super) fn new(dir: PathBuf, durable: DurableView) -> DirSource {
        DirSource { dir, durable, tail: None, buf: Vec::new() }
    }
}

impl RecordSource for DirSource {
    fn durable_seq(&self) -> u64 {
        self.durable.get()
    }

    fn read_from(
        &mut self,
        from_seq: u64,
        max: usize,
        out: &mut Vec<ExportRecord>,
    ) -> Result<(), SourceError> {
        let durable = self.durable.get();
        if from_seq > durable {
            return Ok(());
        }
        if self.tail.as_ref().is_none_or(|t| t.next_seq() != from_seq) {
            self.tail = Some(Tailer::open(&self.dir, from_seq)?);
        }
        let Some(tail) = self.tail.as_mut() else { return Ok(()) };
        self.buf.clear();
        tail.read(durable, max, &mut self.buf)?;
        out.extend(self.buf.drain(..).map(|r| ExportRecord {
            seq: r.header.seq,
            producer: r.header.flags,
            timestamp_ns: r.header.timestamp_ns,
            payload: r.payload,
        }));
        Ok(())
    }
}

/// The exporter's counters as metrics.
pub(super) const EXPORT_FIELDS: &[Field<ExportStats>] = &[
    gauge("fastlane_journal_export_seq", "Highest journal seq the stream acknowledged.", |s| {
        s.exported_seq
    }),
    gauge("fastlane_journal_export_lag_records", "Durable records not yet in the stream.", |s| {
        s.lag_records
    }),
    gauge("fastlane_journal_export_connected", "1 while connected to the NATS cluster.", |s| {
        u64::from(s.connected)
    }),
    counter("fastlane_journal_export_published_total", "Records the stream acknowledged.", |s| {
        s.published_total
    }),
    counter(
        "fastlane_journal_export_publish_errors_total",
        "Publishes that failed or timed out (resent).",
        |s| s.publish_errors_total,
    ),
    counter("fastlane_journal_export_reconnects_total", "Sessions started again.", |s| {
        s.reconnects_total
    }),
    counter(
        "fastlane_journal_export_source_errors_total",
        "Reads of the segment directory that failed.",
        |s| s.source_errors_total,
    ),
];
