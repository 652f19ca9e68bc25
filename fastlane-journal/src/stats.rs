//! The writer's counters, shared by the writer (`writer.rs`) and its flusher threads
//! (`flusher.rs`), which both count into them; in a module of their own so that the flusher
//! does not import the writer that owns it.

use std::sync::atomic::AtomicU64;

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
}
