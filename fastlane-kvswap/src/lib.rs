//! kvswap: the KV-cache swap tier of an inference scheduler, on FastLane's transport.
//!
//! # What it does
//!
//! An inference server that preempts a sequence parks its paged KV blocks here and gets them
//! back before the sequence runs again.
//!
//! - [`KvGeometry`]: bytes per token and per block from a model config (Llama-3.1-8B fp16:
//!   128 KiB per token, 2 MiB per 16-token block).
//! - The "device" block pool: [`DeviceMemory`] (host memory standing in for GPU memory,
//!   [`HostDeviceMemory`]; [`SlabDeviceMemory`], carved into per-client slabs with a memfd
//!   each; `device::cuda::CudaDeviceMemory` with the `cuda` feature) and the engine's
//!   allocator of its blocks.
//! - Tiers ([`TierKind`]): **host** (pre-allocated, pre-faulted, mlock'd — when
//!   RLIMIT_MEMLOCK refuses, a warning is logged and [`TierStats::locked`] is false),
//!   **nvme** (a file or block device through `fastlane_block`'s io_uring backend with
//!   O_DIRECT), **remote** (a range of a `fastlane rdma serve` pool). Byte movers implement
//!   [`TierIo`]; space is counted in block-sized slots allocated as contiguous extents.
//! - [`SwapEngine`]: the asynchronous engine. One worker thread per tier, fed over
//!   `fastlane_ring::spsc` rings; a sequence's transfer is cut into jobs of one contiguous
//!   tier extent each, at least 512 KiB ([`EngineConfig::chunk_bytes`], default 4 MiB, at
//!   most 128 blocks) wherever the extents allow.
//! - [`cas`]: content-addressed block keys ([`BlockKey`], chained hashes of a [`ModelDigest`]
//!   and the token ids, as vLLM's prefix-cache hashes), so a block can outlive its sequence
//!   and be found again by any sequence with the same prefix.
//! - `cluster` (cargo feature `cluster`, on by default): `cluster::ClusterTier`, a Redis
//!   Cluster holding such blocks for every machine that reaches it, each value checked
//!   (key, length, CRC32C) before use; every call bounded by a timeout, failures are misses.
//!   `redis://` or `rediss://` (TLS); [`cluster_access`]: the `AUTH` credentials (from the
//!   environment or a private file, never the command line) and the CA to trust.
//! - [`prefix`]: [`PrefixStore`], the content-addressed block store of prefix reuse: a
//!   host-memory LRU bounded in bytes, optionally an NVMe tier of fixed slots under it (blocks
//!   the host evicts are spilled there by a background thread; reads checked by CRC32C) and
//!   the cluster tier under both (lookups host, then NVMe, then cluster; puts to the cluster
//!   and spills to NVMe asynchronous through bounded queues).
//! - [`server`] and [`client`]: `fastlane kv serve`, a versioned binary protocol over a Unix
//!   socket ([`proto`]; spec in `docs/kvswap.md`): peers checked by `SO_PEERCRED` against an
//!   allow-list, each connection mapping only its own slab of the device pool; per-sequence
//!   swap ops, and content-addressed ops (`PUT`/`GET`/`EXISTS`/`PIN`/`UNPIN`/`EVICT`) on one
//!   [`PrefixStore`] per server, keys qualified by the connection's namespace.
//! - [`daemon`]: the process of `fastlane kv serve` ([`daemon::ServeConfig`] →
//!   [`daemon::serve`]): the engine, the store and the server wired together, stop signals,
//!   Prometheus metrics.
//!
//! # The engine's API (stable)
//!
//! ```text
//! SwapEngine::new(EngineConfig, Arc<dyn DeviceMemory>) / with_tiers(.., CustomTiers)
//! alloc_blocks(seq, n) -> Vec<BlockId>     free_blocks(seq, &[BlockId])  (refused while pinned)
//! register_seq(seq, tenant)  set_quota(tenant, Option<bytes>)  touch(seq)  lookup(seq)
//! swap_out(seq, &[BlockId]) -> Ticket      swap_in(seq, &[BlockId]) -> Ticket
//! poll(&mut Vec<TicketDone>) -> usize      wait(ticket, timeout) -> Result<(), KvSwapError>
//! cancel(ticket)   drop_seq(seq)   stats() -> EngineStats   in_flight()
//! ```
//!
//! All methods take `&mut self` and never block except `wait` (bounded by its timeout). A
//! ticket's result is delivered exactly once, by `poll` or by `wait`.
//!
//! **Life of a preemption.** `swap_out(seq, &blocks)` pins the blocks and returns a ticket;
//! when it finishes OK the caller frees the device blocks (`free_blocks`) for other
//! sequences. Later `alloc_blocks(seq, n)` + `swap_in(seq, &new_blocks)` brings the copy
//! back into (any) blocks of `seq`; the tier copy is released when the swap-in succeeds.
//!
//! **Pinning by construction.** Blocks named by an in-flight transfer are pinned in the
//! engine's allocator: `free_blocks` refuses them ([`KvSwapError::BlockPinned`]) and
//! `alloc_blocks` cannot return them (they are not free), so device memory being copied can
//! never be handed to another sequence early.
//!
//! **Placement.** Swap-out lands in the host tier. When it is full, the least recently used
//! swapped-out host sequences (`touch` and every swap refresh recency) spill to the NVMe or
//! remote tier as [`SpillPolicy`] orders; the new copy is written into their host slots only
//! after their spill completed. If that cannot make room, the sequence goes straight to a
//! spill tier; otherwise `TierFull`. Per-tenant quotas cap swapped-out bytes across tiers.
//!
//! **Nothing lost.** A failed or cancelled swap-out leaves the sequence resident (its device
//! blocks still hold the data); a failed swap-in keeps the tier copy; a failed spill leaves
//! the victim in host memory. Errors are [`KvSwapError`] (unknown sequence, double swap-out,
//! tier full, remote peer gone, checksum mismatch, …).
//!
//! **Integrity.** Each block gets a checksum on the way out (computed while copying for the
//! host tier), verified on the way in ([`ChecksumMode`]: `Fast` 64-bit lane hash, `Crc32c`,
//! or `Off`).
//!
//! # What it does not do
//!
//! - No cross-process sharing of the engine itself: one owner (the server, or a scheduler
//!   thread) drives it.
//! - The remote tier (`fastlane_rdma::RemotePool`) runs only where RDMA does: its test boots a
//!   QEMU guest with soft-RoCE (`tests/guest/tests/kvswap_remote.rs`); elsewhere `testing::MemTier` (feature `test-utils`)
//!   stands in for it.
//! - The `cuda` feature compiles everywhere (cudarc, dynamic loading) but is run only where
//!   a GPU is present.
//!
//! The preemptive multi-tenant scheduler and its simulator (crate `fastlane-sched`) build on
//! this: the simulator swaps through [`SwapEngine`]'s host tier.

pub mod cas;
pub mod checksum;
pub mod client;
#[cfg(feature = "cluster")]
pub mod cluster;
pub mod cluster_access;
pub mod daemon;
pub mod device;
pub mod engine;
pub mod error;
pub mod geometry;
pub mod prefix;
pub mod proto;
pub mod server;
#[cfg(feature = "test-utils")]
pub mod testing;
pub mod tier;
mod worker;

pub use cas::{prefix_keys, BlockKey, ModelDigest};
pub use checksum::ChecksumMode;
pub use cluster_access::ClusterAccess;
pub use device::{DeviceAllocator, DeviceMemory, HostDeviceMemory, Slab, SlabDeviceMemory};
pub use engine::{
    CustomTiers, EngineConfig, EngineStats, RemoteTierConfig, SeqInfo, SeqPhase, SpillPolicy,
    SwapEngine, TicketDone, TierStats, TransferKind, CHUNK_BYTES_MIN,
};
pub use error::KvSwapError;
pub use geometry::{DType, KvGeometry};
pub use prefix::{Located, PrefixNvmeConfig, PrefixStats, PrefixStore, PrefixStoreConfig};
pub use tier::{NvmeTierConfig, TierIo, TierKind};

pub use fastlane_util::{BlockId, SeqId};

/// A tenant, for quotas.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TenantId(pub u32);

/// A transfer in flight; `poll`/`wait` report its outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ticket(pub u64);

impl std::fmt::Display for TenantId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}
