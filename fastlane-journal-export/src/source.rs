//! What the exporter reads: durable records, in sequence order, from whoever owns them.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

/// One durable journal record as the exporter ships it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportRecord {
    /// Journal sequence number (global, gap-free in a healthy journal, starting at 1).
    pub seq: u64,
    /// Producer id that appended the record.
    pub producer: u32,
    /// Timestamp the journal gave the record, ns.
    pub timestamp_ns: u64,
    /// The record's bytes.
    pub payload: Vec<u8>,
}

/// An error from a [`RecordSource`]; the exporter logs it, counts it and tries again later.
pub type SourceError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The journal as the exporter sees it. The service implements it over its segment
/// directory; [`MemorySource`] is an in-memory one for tests.
///
/// Both calls run on the exporter's thread, never on the journal's write path.
pub trait RecordSource: Send {
    /// The highest sequence number that is durable (acknowledged to its producer); 0 when
    /// none is.
    fn durable_seq(&self) -> u64;

    /// Appends to `out` the records with `seq >= from_seq`, in ascending order, at most `max`
    /// of them, none above [`RecordSource::durable_seq`]. Appending nothing is fine (nothing
    /// new yet). A first record above `from_seq` means the journal no longer holds the ones
    /// before it; the exporter logs the gap and goes on.
    fn read_from(
        &mut self,
        from_seq: u64,
        max: usize,
        out: &mut Vec<ExportRecord>,
    ) -> Result<(), SourceError>;
}

/// An in-memory [`RecordSource`] whose clones share one record list: a test or a benchmark
/// keeps a clone to append to while the exporter owns another. Every appended record is
/// durable at once. Memory grows with the records kept; [`MemorySource::trim_below`] drops old
/// ones.
#[derive(Debug, Clone, Default)]
pub struct MemorySource {
    inner: Arc<Mutex<MemoryInner>>,
}

#[derive(Debug, Default)]
struct MemoryInner {
    records: VecDeque<ExportRecord>,
    last_seq: u64,
}

impl MemorySource {
    /// An empty source; the first appended record gets seq 1.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a record and returns its seq.
    pub fn append(&self, producer: u32, timestamp_ns: u64, payload: Vec<u8>) -> u64 {
        let mut g = lock(&self.inner);
        g.last_seq += 1;
        let seq = g.last_seq;
        g.records.push_back(ExportRecord { seq, producer, timestamp_ns, payload });
        seq
    }

    /// Drops the records below `seq` (a journal that retired old segments).
    pub fn trim_below(&self, seq: u64) {
        let mut g = lock(&self.inner);
        while g.records.front().is_some_and(|r| r.seq < seq) {
            g.records.pop_front();
        }
    }
}

fn lock(m: &Mutex<MemoryInner>) -> std::sync::MutexGuard<'_, MemoryInner> {
    // A panic while holding this lock left a consistent list (every mutation is one push or
    // pop), so a poisoned lock is still usable.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl RecordSource for MemorySource {
    fn durable_seq(&self) -> u64 {
        lock(&self.inner).last_seq
    }

    fn read_from(
        &mut self,
        from_seq: u64,
        max: usize,
        out: &mut Vec<ExportRecord>,
    ) -> Result<(), SourceError> {
        let g = lock(&self.inner);
        let Some(first) = g.records.front() else { return Ok(()) };
        // Records are contiguous, so the one for `from_seq` is at a computed index.
        let start = usize::try_from(from_seq.saturating_sub(first.seq)).unwrap_or(usize::MAX);
        out.extend(g.records.iter().skip(start).take(max).cloned());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_source_reads_in_order_from_any_seq() {
        let src = MemorySource::new();
        for i in 0..10u8 {
            src.append(7, 100 + u64::from(i), vec![i]);
        }
        let mut reader = src.clone();
        assert_eq!(reader.durable_seq(), 10);
        let mut out = Vec::new();
        reader.read_from(4, 3, &mut out).unwrap();
        assert_eq!(out.iter().map(|r| r.seq).collect::<Vec<_>>(), [4, 5, 6]);
        assert_eq!(out[0].payload, [3]);
        out.clear();
        reader.read_from(11, 3, &mut out).unwrap();
        assert!(out.is_empty());
        src.trim_below(8);
        reader.read_from(2, 100, &mut out).unwrap();
        assert_eq!(out.iter().map(|r| r.seq).collect::<Vec<_>>(), [8, 9, 10]);
    }
}
