//! RDMA verbs for FastLane, and the two services built on them: a remote memory pool
//! (kvswap's remote tier) and a write mirror (the journal's replica).
//!
//! # What is here
//!
//! * [`Device`] (open by name, port 1, GID chosen for RoCE v2 over IPv4), [`ProtectionDomain`],
//!   [`MemoryRegion`] (registration is an `unsafe fn`: the caller keeps the memory alive until
//!   deregistration *and* every request naming it has completed), [`RegisteredBuffer`] (the
//!   safe owner of memory plus registration), [`CompletionQueue`] (busy polling or a
//!   completion channel, [`PollMode`]), [`QueuePair`] (RC; raw `unsafe` post of WRITE with
//!   and without immediate, READ, SEND, RECV).
//! * [`Connection`]: a queue pair set up by exchanging endpoints over TCP ([`Listener`],
//!   loopback in tests), with its own registered buffer, so its methods are safe: the
//!   connection destroys its queue pair before it frees the buffer. Every wait is bounded
//!   ([`ConnectOptions::op_timeout`]); a peer's closed socket or exhausted transport retries
//!   become [`RdmaError::PeerGone`].
//! * [`PoolServer`] / [`RemotePool`]: `grant(len) -> Range`, then `write`/`read` into it.
//!   Each grant is its own registration, so the server's device itself refuses accesses
//!   outside it ([`RdmaError::RemoteAccess`] with `remote: true`).
//! * [`Mirror`] / [`MirrorReplica`]: ordered `write(offset, bytes)`, then `sync` by
//!   read-after-write or by an acknowledgement from the replica process.
//!
//! # Why `rdma-sys`
//!
//! The `ibverbs` crate (0.9) has no RDMA WRITE/READ, no lkey/rkey access and no raw handles
//! in its API, which are the whole point here. `rdma-sys` 0.3 is a bindgen binding of
//! libibverbs (it needs libibverbs-dev, librdmacm-dev and libclang at build time) that also
//! reimplements the header's inline functions (`ibv_post_send`, `ibv_poll_cq`,
//! `ibv_query_port`); this crate wraps the part it uses in owners with `// SAFETY:` notes.
//!
//! # What is not here
//!
//! No rdma_cm (the TCP exchange is enough and works on loopback), no SRQ, no UD, no memory
//! windows, one scatter/gather entry per request. The data path allocates nothing: requests
//! are built on the stack and completions polled into a buffer made at setup.
//!
//! Tests that need a device skip on a host without one; the real ones run inside a QEMU
//! guest over soft-RoCE (`tests/guest/tests/rdma.rs` in the `fastlane-guest-tests` crate, see `docs/rdma.md`).

mod buffer;
mod conn;
mod error;
mod mirror;
mod pool;
mod verbs;

pub use buffer::RegisteredBuffer;
pub use conn::{ConnectOptions, Connection, Listener, RemoteRegion};
pub use error::{RdmaError, Result};
pub use mirror::{Durability, Mirror, MirrorReplica, ReplicaSession};
pub use pool::{
    PoolMonitor, PoolServer, PoolStats, Range, RemotePool, GRANTS_PER_CLIENT_MAX, GRANT_ALIGN,
};
pub use verbs::{
    device_names, status_str, Access, Completion, CompletionQueue, Device, MemoryRegion, PollMode,
    ProtectionDomain, QpConfig, QpEndpoint, QueuePair, SendOp, SendRequest, Sge, PORT_NUM,
};
