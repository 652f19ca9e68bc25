//! The crate's error type.

use std::io;
use std::path::PathBuf;

/// Errors of the histogram subsystem: configuration, interval-log i/o and parsing.
#[derive(Debug, thiserror::Error)]
pub enum HistError {
    /// A recorder or writer was configured with values hdrhistogram cannot represent.
    #[error("invalid histogram config: {reason}")]
    Config {
        /// What was wrong.
        reason: String,
    },
    /// A tag contains a character the interval-log format cannot carry (`,`, space, CR, LF)
    /// or is empty.
    #[error("invalid tag {tag:?}")]
    InvalidTag {
        /// The rejected tag.
        tag: String,
    },
    /// Opening, reading or creating a file failed.
    #[error("i/o error on {}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// Writing an interval log to its sink failed.
    #[error("writing interval log failed")]
    Write(#[source] io::Error),
    /// A histogram could not be encoded (a count above `i64::MAX`).
    #[error("histogram encoding failed: {reason}")]
    Encode {
        /// The encoder's message.
        reason: String,
    },
    /// An interval log is malformed; `line` is 1-based.
    #[error("corrupt interval log at line {line}: {reason}")]
    Corrupt {
        /// 1-based line number of the offending line.
        line: usize,
        /// What was wrong with it.
        reason: String,
    },
    /// Reading one of a report's logs failed (the file named here; what went wrong below).
    #[error("reading {}", path.display())]
    Reading {
        /// The log.
        path: PathBuf,
        /// Why.
        #[source]
        source: Box<HistError>,
    },
    /// A report cannot be made from these logs (no intervals, no such tag, no tag in common).
    #[error("{reason}")]
    Report {
        /// What is missing, naming the file.
        reason: String,
    },
    /// An interval log is larger than this reader is willing to hold in memory.
    #[error("interval log too large at line {line}: {reason}")]
    TooLarge {
        /// 1-based line at which the limit was crossed (0: the file as a whole).
        line: usize,
        /// Which limit.
        reason: String,
    },
}
