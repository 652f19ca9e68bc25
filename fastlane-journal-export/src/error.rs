//! The exporter's errors: the ones [`crate::Exporter::start`] returns, and the ones that end a
//! session (logged, counted, followed by a reconnect).

use crate::config::ExportConfigError;

/// An exporter error.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    /// A setting was refused.
    #[error(transparent)]
    Config(#[from] ExportConfigError),
    /// The tokio runtime could not be built.
    #[error("journal export: cannot build the runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// The exporter thread could not be started.
    #[error("journal export: cannot start the thread: {0}")]
    Spawn(#[source] std::io::Error),
    /// No server of the list answered.
    #[error("journal export: cannot connect to {urls}: {reason}")]
    Connect {
        /// The URLs tried.
        urls: String,
        /// The client's error.
        reason: String,
    },
    /// The connection dropped mid-session.
    #[error("journal export: connection lost")]
    ConnectionLost,
    /// A JetStream API request about the stream failed.
    #[error("journal export: stream {stream}: {reason}")]
    Stream {
        /// Stream name.
        stream: String,
        /// The client's error.
        reason: String,
    },
    /// The stream exists with other subjects or another replica count.
    #[error(
        "journal export: stream {stream} has subjects {subjects:?} and {replicas} replicas; \
         the exporter needs subject {want_subject:?} and {want_replicas} replicas"
    )]
    StreamMismatch {
        /// Stream name.
        stream: String,
        /// Its subjects.
        subjects: Vec<String>,
        /// Its replicas.
        replicas: usize,
        /// The configured subject.
        want_subject: String,
        /// The configured replicas.
        want_replicas: usize,
    },
    /// The stream's last message was not published by an exporter (no numeric Nats-Msg-Id).
    #[error(
        "journal export: stream {stream}'s last message (seq {stream_seq}) has Nats-Msg-Id \
         {msg_id:?}, not a journal seq; was something else published on the subject?"
    )]
    ForeignMessage {
        /// Stream name.
        stream: String,
        /// The message's stream sequence.
        stream_seq: u64,
        /// Its Msg-Id header, if any.
        msg_id: Option<String>,
    },
    /// A publish or its ack failed (timeout, refusal, lost connection).
    #[error("journal export: publish of journal seq {seq}: {reason}")]
    Publish {
        /// Journal seq of the record.
        seq: u64,
        /// The client's or the server's error.
        reason: String,
    },
    /// The stream answered that a record was already stored: the session resynchronises.
    #[error("journal export: journal seq {seq} was already in the stream (seq {stream_seq})")]
    Resync {
        /// Journal seq of the record.
        seq: u64,
        /// Stream sequence it is stored at (0: the server did not say).
        stream_seq: u64,
    },
    /// An ack named another stream or sequence than the publish expected.
    #[error(
        "journal export: journal seq {seq} acked by stream {stream} at seq {got}, expected {want}"
    )]
    AckMismatch {
        /// Journal seq of the record.
        seq: u64,
        /// The stream sequence the publish expected.
        want: u64,
        /// The one acked.
        got: u64,
        /// The stream named in the ack.
        stream: String,
    },
}
