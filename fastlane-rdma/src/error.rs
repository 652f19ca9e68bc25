//! The one error type of the crate.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

/// What went wrong in the RDMA layer. Context (operation, offsets, peer) lives in the fields.
#[derive(Debug, thiserror::Error)]
pub enum RdmaError {
    /// No RDMA device of that name (the list of the ones present is in `available`).
    #[error("no RDMA device named {name:?} (present: {available:?})")]
    NoSuchDevice {
        /// The name asked for.
        name: String,
        /// The devices libibverbs found.
        available: Vec<String>,
    },
    /// A verbs call failed.
    #[error("{op} failed: {source}")]
    Verbs {
        /// The verbs call, e.g. `ibv_reg_mr`.
        op: &'static str,
        /// The errno it left.
        source: io::Error,
    },
    /// The peer could not be reached on its TCP address (connection setup).
    #[error("peer {addr} unreachable: {source}")]
    PeerUnreachable {
        /// The address tried.
        addr: SocketAddr,
        /// Why.
        source: io::Error,
    },
    /// The peer went away: its socket closed, or its queue pair stopped answering
    /// (transport retries exhausted, queue pair flushed).
    #[error("peer gone during {op}: {detail}")]
    PeerGone {
        /// The operation that noticed.
        op: &'static str,
        /// How it showed (socket closed, completion status).
        detail: String,
    },
    /// An access outside the region the peer granted: caught locally before posting, or
    /// refused by the remote side (`IBV_WC_REM_ACCESS_ERR`).
    #[error("remote access violation in {op}: offset {offset} + len {len} outside the granted {granted} bytes{}", if *remote { " (refused by the peer)" } else { "" })]
    RemoteAccess {
        /// The operation.
        op: &'static str,
        /// Offset asked for, relative to the granted region.
        offset: u64,
        /// Length asked for.
        len: u64,
        /// Size of the granted region, as far as this side knows.
        granted: u64,
        /// True when the remote side refused it (the local check was bypassed or wrong).
        remote: bool,
    },
    /// The pool has no free range of the size asked for.
    #[error("remote pool has no free range of {requested} bytes")]
    PoolFull {
        /// Bytes asked for.
        requested: u64,
    },
    /// A wait ran past its bound.
    #[error("{op} timed out after {after:?}")]
    Timeout {
        /// What was waited for.
        op: &'static str,
        /// The bound.
        after: Duration,
    },
    /// A work completion carried an error status not covered by the cases above.
    #[error("{op}: work completion failed with {status} (vendor error {vendor_err:#x})")]
    Completion {
        /// The operation.
        op: &'static str,
        /// `ibv_wc_status_str` of the status.
        status: String,
        /// The provider's detail.
        vendor_err: u32,
    },
    /// A local argument out of bounds (offset past a local buffer, a zero or huge size).
    #[error("invalid argument to {op}: {detail}")]
    InvalidArgument {
        /// The operation.
        op: &'static str,
        /// What was wrong.
        detail: String,
    },
    /// The peer sent a connection or control message that does not parse or makes no sense.
    #[error("bad message from peer during {op}: {detail}")]
    Protocol {
        /// The exchange.
        op: &'static str,
        /// What was wrong.
        detail: String,
    },
    /// The connection broke earlier (an error completion moved its queue pair to the error
    /// state); make a new one.
    #[error("connection unusable after an earlier error")]
    Broken,
    /// A socket error on the side channel.
    #[error("{op}: {source}")]
    Io {
        /// The exchange.
        op: &'static str,
        /// The error.
        source: io::Error,
    },
}

impl RdmaError {
    /// `Verbs` error from the current `errno`.
    pub(crate) fn last_os(op: &'static str) -> Self {
        RdmaError::Verbs { op, source: io::Error::last_os_error() }
    }

    /// `Verbs` error from a returned error number (verbs calls that return it rather than
    /// set errno).
    pub(crate) fn from_ret(op: &'static str, ret: i32) -> Self {
        let errno = if ret < 0 { -ret } else { ret };
        RdmaError::Verbs { op, source: io::Error::from_raw_os_error(errno) }
    }

    /// Whether this error means the peer is gone or unreachable.
    pub fn is_peer_failure(&self) -> bool {
        matches!(self, RdmaError::PeerGone { .. } | RdmaError::PeerUnreachable { .. })
    }
}

/// Result with [`RdmaError`].
pub type Result<T, E = RdmaError> = std::result::Result<T, E>;
