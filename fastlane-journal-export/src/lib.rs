//! Ships the journal's durable records to a NATS JetStream stream, in sequence order and
//! exactly once, for consumers on other machines.
//!
//! An [`Exporter`] runs on its own thread (a current-thread tokio runtime) and reads from a
//! [`RecordSource`], which the journal service implements over its segment files. The
//! journal's write path never waits for it: a slow or dead cluster shows as
//! [`ExportStats::lag_records`], and the journal goes on accepting records.
//!
//! ```no_run
//! use fastlane_journal_export::{ExportConfig, Exporter, MemorySource};
//! let source = MemorySource::new();
//! let config = ExportConfig::from_urls("nats://10.0.0.1:4222,nats://10.0.0.2:4222")?;
//! let exporter = Exporter::start(config, Box::new(source.clone()))?;
//! source.append(1, 0, b"order 42 filled".to_vec());
//! println!("lag: {}", exporter.stats().lag_records);
//! let last = exporter.stop(); // exports what is durable, within drain_timeout
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! How exactly-once holds:
//! - Each record is one message on `subject` with headers `Nats-Msg-Id: <journal seq>`,
//!   `Nats-Expected-Last-Sequence: <the stream sequence before it>`, `Nats-Expected-Stream`,
//!   `Fastlane-Producer` and `Fastlane-Timestamp-Ns`; the payload is the record's bytes.
//! - The expected-last-sequence check makes the stream refuse any publish that does not
//!   directly follow the one before it, so the stream always holds a gap-free, ordered run of
//!   journal seqs, even when a reconnect loses a publish and delivers the ones after it.
//! - A session starts by reading the stream's last message; its Msg-Id is the last exported
//!   journal seq, and publishing resumes right after it. Nothing is resent that the stream
//!   has, so a restart after a crash duplicates nothing, however long ago the crash was.
//! - The Msg-Id and the stream's duplicate window are a second guard (two exporters by
//!   mistake, a publish that lands late): a repeat inside the window is not stored again.
//! - `exported_seq` advances only on acks, in order. Up to `max_in_flight` acks are
//!   outstanding; any failed ack ends the session, and the next one resumes from the stream.
//!
//! Credentials (user and password, or a token) and TLS (`tls://`, a CA, a client
//! certificate) are in [`access`]. What this crate does not do: read the journal's files (the
//! service's [`RecordSource`] does), JWT/NKey credentials, or trim the stream (set limits on
//! it with the `nats` tool). What an acknowledged publish survives on the NATS side is in
//! `docs/journal-export.md`.
#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

pub mod access;
mod config;
mod error;
mod exporter;
mod source;
mod stats;

pub use access::{AccessFiles, ExportAccess};
pub use config::{
    parse_urls, ExportConfig, ExportConfigError, DEFAULT_ACK_TIMEOUT, DEFAULT_BACKOFF_MAX,
    DEFAULT_BATCH_MAX, DEFAULT_CONNECT_TIMEOUT, DEFAULT_DRAIN_TIMEOUT, DEFAULT_DUPLICATE_WINDOW,
    DEFAULT_MAX_IN_FLIGHT, DEFAULT_POLL_INTERVAL, DEFAULT_REPLICAS, DEFAULT_STREAM,
    DEFAULT_SUBJECT,
};
pub use error::ExportError;
pub use exporter::{Exporter, HEADER_PRODUCER, HEADER_TIMESTAMP_NS};
pub use source::{ExportRecord, MemorySource, RecordSource, SourceError};
pub use stats::{ExportStats, ExportStatsHandle};
