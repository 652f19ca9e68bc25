//! How to build a [`SwapEngine`](super::SwapEngine): tiers, spill order, chunk sizes.

use std::net::SocketAddr;

use crate::checksum::ChecksumMode;
use crate::tier::{NvmeTierConfig, TierIo, TierKind};

/// Smallest transfer chunk the engine builds when extents allow it.
pub const CHUNK_BYTES_MIN: usize = 512 * 1024;

/// Where cold sequences go when the host tier is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SpillPolicy {
    /// NVMe first, then remote.
    #[default]
    NvmeFirst,
    /// Remote first, then NVMe.
    RemoteFirst,
    /// Only NVMe.
    NvmeOnly,
    /// Only remote.
    RemoteOnly,
    /// Never spill: swap-out fails with `TierFull` when the host tier is full.
    Never,
}

impl SpillPolicy {
    pub(super) fn order(self) -> &'static [TierKind] {
        match self {
            SpillPolicy::NvmeFirst => &[TierKind::Nvme, TierKind::Remote],
            SpillPolicy::RemoteFirst => &[TierKind::Remote, TierKind::Nvme],
            SpillPolicy::NvmeOnly => &[TierKind::Nvme],
            SpillPolicy::RemoteOnly => &[TierKind::Remote],
            SpillPolicy::Never => &[],
        }
    }
}

/// The remote tier's pool.
#[derive(Debug, Clone)]
pub struct RemoteTierConfig {
    /// RDMA device name (e.g. `rxe0`).
    pub device: String,
    /// Address of `fastlane rdma serve`.
    pub addr: SocketAddr,
    /// Bytes to take from the pool.
    pub bytes: u64,
}

/// How to build a [`SwapEngine`](crate::SwapEngine).
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Host tier size in bytes (rounded down to whole blocks; 0: no host tier, swap-outs
    /// go straight to the spill tiers).
    pub host_bytes: u64,
    /// The NVMe tier, if any.
    pub nvme: Option<NvmeTierConfig>,
    /// The remote tier, if any.
    pub remote: Option<RemoteTierConfig>,
    /// Spill order.
    pub spill: SpillPolicy,
    /// Per-block checksum.
    pub checksum: ChecksumMode,
    /// Target bytes per transfer chunk (at least [`CHUNK_BYTES_MIN`]; a chunk is also capped
    /// at 128 blocks).
    pub chunk_bytes: usize,
    /// Jobs each worker ring holds.
    pub ring_capacity: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            host_bytes: 0,
            nvme: None,
            remote: None,
            spill: SpillPolicy::NvmeFirst,
            checksum: ChecksumMode::Fast,
            chunk_bytes: 4 << 20,
            ring_capacity: 256,
        }
    }
}

/// Tiers built by the caller (tests, or anything that wants its own [`TierIo`]).
#[derive(Default)]
pub struct CustomTiers {
    /// Replaces the NVMe tier.
    pub nvme: Option<Box<dyn TierIo>>,
    /// Replaces the remote tier.
    pub remote: Option<Box<dyn TierIo>>,
}

impl std::fmt::Debug for CustomTiers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CustomTiers")
            .field("nvme", &self.nvme.is_some())
            .field("remote", &self.remote.is_some())
            .finish()
    }
}
