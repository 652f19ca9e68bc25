//! The crate's error type.

use crate::{BlockId, SeqId, TenantId, TierKind};

/// What went wrong in kvswap. Context lives in the fields.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvSwapError {
    /// The sequence is not known to the engine (never allocated, or dropped).
    #[error("unknown sequence {seq}")]
    UnknownSequence {
        /// The sequence.
        seq: SeqId,
    },
    /// `swap_out` of a sequence that is already swapped out or being swapped out.
    #[error("sequence {seq} is already swapped out")]
    DoubleSwapOut {
        /// The sequence.
        seq: SeqId,
    },
    /// `swap_in` of a sequence that has no swapped-out copy.
    #[error("sequence {seq} is not swapped out")]
    NotSwappedOut {
        /// The sequence.
        seq: SeqId,
    },
    /// A transfer of the sequence (its own, or a spill of its copy to a lower tier) is in
    /// flight; retry after `poll`.
    #[error("sequence {seq} has a transfer in flight")]
    Busy {
        /// The sequence.
        seq: SeqId,
    },
    /// No tier (after spilling colder sequences, as the policy allows) has room.
    #[error("tier {tier:?} full: need {needed_bytes} bytes, {free_bytes} free")]
    TierFull {
        /// The last tier tried.
        tier: TierKind,
        /// Bytes asked for.
        needed_bytes: u64,
        /// Bytes free there.
        free_bytes: u64,
    },
    /// The tenant's quota of swapped-out bytes would be exceeded.
    #[error("tenant {tenant} over quota: {used_bytes} used + {needed_bytes} > {quota_bytes}")]
    QuotaExceeded {
        /// The tenant.
        tenant: TenantId,
        /// Bytes it holds now.
        used_bytes: u64,
        /// Bytes asked for.
        needed_bytes: u64,
        /// Its quota.
        quota_bytes: u64,
    },
    /// The remote pool's peer went away (connection closed, queue pair failed).
    #[error("remote peer gone: {detail}")]
    RemotePeerGone {
        /// How it showed.
        detail: String,
    },
    /// The block is pinned by a transfer in flight and cannot be freed or reused yet.
    #[error("device block {block} is pinned by an in-flight transfer of sequence {seq}")]
    BlockPinned {
        /// The block.
        block: BlockId,
        /// The sequence whose transfer pins it.
        seq: SeqId,
    },
    /// The block does not belong to the sequence named.
    #[error("device block {block} does not belong to sequence {seq}")]
    BlockNotOwned {
        /// The block.
        block: BlockId,
        /// The sequence named.
        seq: SeqId,
    },
    /// The same device block appears twice in one request.
    #[error("device block {block} named twice")]
    DuplicateBlock {
        /// The block.
        block: BlockId,
    },
    /// The device pool has fewer free blocks than asked for.
    #[error("device pool full: {requested} blocks asked, {free} free")]
    DeviceFull {
        /// Blocks asked for.
        requested: u32,
        /// Blocks free.
        free: u32,
    },
    /// `swap_in` names a different number of blocks than were swapped out.
    #[error("sequence {seq} has {expected} blocks swapped out, {got} named")]
    BlockCountMismatch {
        /// The sequence.
        seq: SeqId,
        /// Blocks swapped out.
        expected: u32,
        /// Blocks named.
        got: u32,
    },
    /// A block read back does not match the checksum taken when it was swapped out.
    #[error("checksum mismatch on block {index} of sequence {seq} ({tier:?} tier)")]
    ChecksumMismatch {
        /// The sequence.
        seq: SeqId,
        /// Index of the block within the sequence's swap-out order.
        index: u32,
        /// The tier it came from.
        tier: TierKind,
    },
    /// A tier's I/O failed (errno).
    #[error("{tier:?} tier I/O failed: errno {errno}")]
    TierIo {
        /// The tier.
        tier: TierKind,
        /// The errno (or -1 when there is none).
        errno: i32,
    },
    /// The transfer was cancelled; the data stayed where it was.
    #[error("transfer cancelled")]
    Cancelled,
    /// The ticket is not known (never issued, or its result was already taken).
    #[error("unknown ticket {ticket}")]
    UnknownTicket {
        /// The ticket.
        ticket: u64,
    },
    /// `wait` gave up at its deadline; the transfer goes on.
    #[error("timed out waiting for ticket {ticket}")]
    Timeout {
        /// The ticket.
        ticket: u64,
    },
    /// A worker thread is gone (it panicked or could not start).
    #[error("{tier:?} worker is gone")]
    WorkerGone {
        /// Its tier.
        tier: TierKind,
    },
    /// A configuration value is out of range.
    #[error("bad configuration: {detail}")]
    BadConfig {
        /// What is wrong.
        detail: String,
    },
    /// Setting something up failed (mmap, memfd, opening a file, connecting).
    #[error("{op} failed: {detail}")]
    Setup {
        /// What was being done.
        op: &'static str,
        /// The error.
        detail: String,
    },
}

impl KvSwapError {
    pub(crate) fn setup(op: &'static str, e: impl std::fmt::Display) -> KvSwapError {
        KvSwapError::Setup { op, detail: e.to_string() }
    }
}
