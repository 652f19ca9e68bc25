//! The engine's accounting: per-tier bytes, device blocks, per-tenant swapped-out bytes.

use super::SwapEngine;
use crate::TenantId;

/// One tier's accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TierStats {
    /// Configured.
    pub present: bool,
    /// Capacity in bytes (whole blocks).
    pub capacity_bytes: u64,
    /// Bytes allocated to sequences (copies and transfers in flight).
    pub used_bytes: u64,
    /// Host tier: page-locked (false when mlock was refused).
    pub locked: bool,
}

/// The engine's accounting, exact at any moment between calls.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EngineStats {
    /// Host, NVMe, remote (index by [`TierKind::index`](crate::TierKind::index)).
    pub tiers: [TierStats; 3],
    /// Device blocks in the pool.
    pub device_blocks: u32,
    /// Device blocks free.
    pub device_free: u32,
    /// Device blocks pinned by transfers.
    pub device_pinned: u32,
    /// Swapped-out bytes held per tenant (all tiers), sorted by tenant.
    pub tenant_bytes: Vec<(TenantId, u64)>,
    /// Bytes copied out, in, and spilled, by finished jobs.
    pub bytes_out: u64,
    /// See `bytes_out`.
    pub bytes_in: u64,
    /// See `bytes_out`.
    pub bytes_spilled: u64,
    /// Checksum mismatches seen.
    pub checksum_failures: u64,
    /// Spills started.
    pub spills: u64,
}

impl SwapEngine {
    /// The accounting.
    pub fn stats(&self) -> EngineStats {
        let mut st = self.stats.clone();
        for (i, w) in self.workers.iter().enumerate() {
            if let Some(w) = w {
                let bb = self.block_bytes as u64;
                st.tiers[i] = TierStats {
                    present: true,
                    capacity_bytes: w.space.slots() * bb,
                    used_bytes: (w.space.slots() - w.space.free_slots()) * bb,
                    locked: w.locked,
                };
            }
        }
        st.device_blocks = self.alloc.total();
        st.device_free = self.alloc.free_count();
        st.device_pinned = self.alloc.pinned_count();
        let mut t: Vec<_> =
            self.tenant_bytes.iter().filter(|e| *e.1 > 0).map(|(k, v)| (*k, *v)).collect();
        t.sort();
        st.tenant_bytes = t;
        st
    }
}
