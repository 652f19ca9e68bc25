//! The simulator's swap port: every swap really runs through the kvswap [`SwapEngine`]'s
//! host tier (scaled-down blocks, data written, read back and compared), and its simulated
//! duration is `fixed + bytes × ns_per_byte`, where `ns_per_byte` is the host tier's
//! measured cost per byte on this machine ([`calibrate_host_tier`], full 2 MiB
//! Llama-3.1-8B blocks) times a PCIe factor (see `docs/scheduler.md`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::{BlockId, SeqId, SwapDir, SwapDone, SwapPort, SwapPortError};
use fastlane_kvswap::{
    ChecksumMode, DeviceMemory, EngineConfig, HostDeviceMemory, KvSwapError, SwapEngine,
};

/// How long a real engine transfer may take before the port gives up on it.
const ENGINE_WAIT: Duration = Duration::from_secs(30);

/// Default PCIe factor: simulated swap time = measured host-tier time × this.
///
/// The host tier is a DRAM→DRAM copy (≈ 10 GB/s single-threaded on a typical server);
/// an A100 swap is a DMA over PCIe 4.0 x16 from pinned memory (≈ 25 GB/s measured with
/// NVIDIA's `bandwidthTest`); 10 / 25 = 0.4. The effective bandwidth this gives on the
/// machine at hand is printed with every run.
pub const PCIE_FACTOR_DEFAULT: f64 = 0.4;

/// Fixed cost per swap direction (launch + synchronisation), ns.
pub const SWAP_FIXED_NS: u64 = 50_000;

/// Result of [`calibrate_host_tier`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Calibration {
    /// Median swap-out cost per byte, ns.
    pub out_ns_per_byte: f64,
    /// Median swap-in cost per byte, ns.
    pub in_ns_per_byte: f64,
    /// Bytes per round.
    pub bytes: u64,
    /// Rounds.
    pub rounds: u32,
}

impl Calibration {
    /// The mean of the two directions.
    pub fn ns_per_byte(&self) -> f64 {
        (self.out_ns_per_byte + self.in_ns_per_byte) / 2.0
    }
}

fn engine_err(seq: SeqId, dir: SwapDir) -> impl Fn(KvSwapError) -> SwapPortError {
    move |e| SwapPortError::Refused { seq, dir, reason: e.to_string() }
}

/// Swap `blocks` blocks of `block_bytes` out and back in through a fresh engine's host tier
/// `rounds` times; the median time per byte of each direction.
pub fn calibrate_host_tier(
    block_bytes: usize,
    blocks: u32,
    rounds: u32,
) -> Result<Calibration, KvSwapError> {
    let device = Arc::new(HostDeviceMemory::new(block_bytes, blocks)?);
    let config = EngineConfig {
        host_bytes: block_bytes as u64 * u64::from(blocks),
        checksum: ChecksumMode::Fast,
        ..EngineConfig::default()
    };
    let mut engine = SwapEngine::new(config, device.clone())?;
    let bytes = block_bytes as u64 * u64::from(blocks);
    let (mut outs, mut ins) = (Vec::new(), Vec::new());
    for r in 0..rounds.max(1) {
        let seq = SeqId(u64::from(r) + 1);
        let b = engine.alloc_blocks(seq, blocks)?;
        fill(device.as_ref(), seq, &b, 0)?;
        let t0 = Instant::now();
        let t = engine.swap_out(seq, &b)?;
        engine.wait(t, ENGINE_WAIT)?;
        outs.push(t0.elapsed().as_nanos() as f64 / bytes as f64);
        engine.free_blocks(seq, &b)?;
        let b = engine.alloc_blocks(seq, blocks)?;
        let t0 = Instant::now();
        let t = engine.swap_in(seq, &b)?;
        engine.wait(t, ENGINE_WAIT)?;
        ins.push(t0.elapsed().as_nanos() as f64 / bytes as f64);
        if !verify(device.as_ref(), seq, &b, 0)? {
            return Err(KvSwapError::BadConfig {
                detail: "calibration read back other bytes".into(),
            });
        }
        engine.drop_seq(seq)?;
    }
    Ok(Calibration {
        out_ns_per_byte: fastlane_util::stats::median(outs),
        in_ns_per_byte: fastlane_util::stats::median(ins),
        bytes,
        rounds: rounds.max(1),
    })
}

/// The word written at the start of block `i` of `seq` (one word per block keeps the
/// check cheap; the engine's own checksums cover every byte).
fn stamp(seq: SeqId, i: usize, salt: u64) -> u64 {
    (seq.0 << 24) ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ salt
}

fn fill(
    dev: &dyn DeviceMemory,
    seq: SeqId,
    blocks: &[BlockId],
    salt: u64,
) -> Result<(), KvSwapError> {
    let mut buf = vec![0u8; dev.block_bytes()];
    for (i, &b) in blocks.iter().enumerate() {
        let w = stamp(seq, i, salt).to_le_bytes();
        buf[..8].copy_from_slice(&w);
        let len = buf.len();
        buf[len - 8..].copy_from_slice(&w);
        // SAFETY:
        // - `buf` holds `block_bytes` initialized bytes and outlives the call;
        // - `b` was just handed to `seq` by the engine's allocator and no transfer names it,
        //   so nothing else writes the block concurrently.
        unsafe { dev.write_block(b, buf.as_ptr())? };
    }
    Ok(())
}

fn verify(
    dev: &dyn DeviceMemory,
    seq: SeqId,
    blocks: &[BlockId],
    salt: u64,
) -> Result<bool, KvSwapError> {
    let mut buf = vec![0u8; dev.block_bytes()];
    for (i, &b) in blocks.iter().enumerate() {
        // SAFETY:
        // - `buf` has room for `block_bytes` bytes and outlives the call;
        // - the swap-in that wrote `b` has completed (waited on), so no transfer writes it.
        unsafe { dev.read_block(b, buf.as_mut_ptr())? };
        let w = stamp(seq, i, salt).to_le_bytes();
        if buf[..8] != w || buf[buf.len() - 8..] != w {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Counters of the real transfers behind the simulated ones.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EnginePortStats {
    /// Real swap-outs + swap-ins completed.
    pub transfers: u64,
    /// Real bytes moved (scaled-down blocks).
    pub real_bytes: u64,
    /// Wall time spent in them, ns.
    pub real_ns: u64,
    /// Simulated bytes (full-size blocks).
    pub sim_bytes: u64,
    /// Swap-ins that read back other bytes than were swapped out (must stay 0).
    pub mismatches: u64,
    /// Engine errors turned into refusals.
    pub engine_errors: u64,
}

/// The simulator's [`SwapPort`] over a real [`SwapEngine`].
pub struct EnginePort {
    engine: SwapEngine,
    device: Arc<HostDeviceMemory>,
    sim_block_bytes: u64,
    ns_per_byte: f64,
    fixed_ns: u64,
    host_sim_bytes: u64,
    held: HashMap<SeqId, u64>,
    pending: Vec<SwapDone>,
    busy_out_ns: u64,
    busy_in_ns: u64,
    stats: EnginePortStats,
}

impl std::fmt::Debug for EnginePort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EnginePort")
            .field("ns_per_byte", &self.ns_per_byte)
            .field("held", &self.held.len())
            .field("stats", &self.stats)
            .finish()
    }
}

impl EnginePort {
    /// A port whose engine has `device_blocks` blocks of `real_block_bytes` (a multiple of
    /// 4096 standing in for `sim_block_bytes`) and a host tier holding `host_sim_bytes` of
    /// simulated KV. Simulated transfers cost `fixed_ns + sim_bytes × ns_per_byte`; the two
    /// directions overlap (PCIe is full duplex), transfers of one direction queue.
    pub fn new(
        device_blocks: u32,
        real_block_bytes: usize,
        sim_block_bytes: u64,
        host_sim_bytes: u64,
        ns_per_byte: f64,
        fixed_ns: u64,
    ) -> Result<Self, KvSwapError> {
        let device = Arc::new(HostDeviceMemory::new(real_block_bytes, device_blocks)?);
        let host_blocks = host_sim_bytes / sim_block_bytes.max(1);
        let config = EngineConfig {
            host_bytes: host_blocks * real_block_bytes as u64,
            checksum: ChecksumMode::Fast,
            ..EngineConfig::default()
        };
        let engine = SwapEngine::new(config, device.clone())?;
        Ok(Self {
            engine,
            device,
            sim_block_bytes,
            ns_per_byte,
            fixed_ns,
            host_sim_bytes,
            held: HashMap::new(),
            pending: Vec::new(),
            busy_out_ns: 0,
            busy_in_ns: 0,
            stats: EnginePortStats::default(),
        })
    }

    /// Counters.
    pub fn stats(&self) -> EnginePortStats {
        self.stats
    }

    /// Simulated cost per byte.
    pub fn ns_per_byte(&self) -> f64 {
        self.ns_per_byte
    }

    fn held_bytes(&self) -> u64 {
        self.held.values().sum()
    }

    fn transfer(&mut self, seq: SeqId, n: u32, dir: SwapDir) -> Result<(), SwapPortError> {
        let err = engine_err(seq, dir);
        let blocks = self.engine.alloc_blocks(seq, n).map_err(&err)?;
        let t0 = Instant::now();
        let result = match dir {
            SwapDir::Out => fill(self.device.as_ref(), seq, &blocks, 1)
                .and_then(|()| self.engine.swap_out(seq, &blocks))
                .and_then(|t| self.engine.wait(t, ENGINE_WAIT)),
            SwapDir::In => self
                .engine
                .swap_in(seq, &blocks)
                .and_then(|t| self.engine.wait(t, ENGINE_WAIT))
                .and_then(|()| verify(self.device.as_ref(), seq, &blocks, 1))
                .map(|same| {
                    if !same {
                        self.stats.mismatches += 1;
                    }
                }),
        };
        self.stats.real_ns += t0.elapsed().as_nanos() as u64;
        // The device blocks stand in for the scheduler's: the scheduler keeps its own pinning;
        // here they are only the staging area of one transfer.
        let freed = self.engine.free_blocks(seq, &blocks);
        result.and(freed).map_err(|e| {
            self.stats.engine_errors += 1;
            err(e)
        })?;
        self.stats.transfers += 1;
        self.stats.real_bytes += u64::from(n) * self.device.block_bytes() as u64;
        Ok(())
    }

    fn finish_at(&mut self, now_ns: u64, bytes: u64, dir: SwapDir) -> u64 {
        let busy = match dir {
            SwapDir::Out => &mut self.busy_out_ns,
            SwapDir::In => &mut self.busy_in_ns,
        };
        let end = now_ns.max(*busy) + self.fixed_ns + (bytes as f64 * self.ns_per_byte) as u64;
        *busy = end;
        end
    }
}

impl SwapPort for EnginePort {
    fn swap_out(
        &mut self,
        now_ns: u64,
        seq: SeqId,
        blocks: &[BlockId],
    ) -> Result<(), SwapPortError> {
        let bytes = blocks.len() as u64 * self.sim_block_bytes;
        if !self.can_hold(bytes) {
            let free = self.host_sim_bytes.saturating_sub(self.held_bytes());
            return Err(SwapPortError::TierFull { need_bytes: bytes, free_bytes: free });
        }
        self.transfer(seq, blocks.len() as u32, SwapDir::Out)?;
        self.held.insert(seq, bytes);
        self.stats.sim_bytes += bytes;
        let at_ns = self.finish_at(now_ns, bytes, SwapDir::Out);
        self.pending.push(SwapDone { seq, dir: SwapDir::Out, at_ns, ok: true });
        Ok(())
    }

    fn swap_in(
        &mut self,
        now_ns: u64,
        seq: SeqId,
        blocks: &[BlockId],
    ) -> Result<(), SwapPortError> {
        let bytes = blocks.len() as u64 * self.sim_block_bytes;
        self.transfer(seq, blocks.len() as u32, SwapDir::In)?;
        self.held.remove(&seq);
        self.stats.sim_bytes += bytes;
        let at_ns = self.finish_at(now_ns, bytes, SwapDir::In);
        self.pending.push(SwapDone { seq, dir: SwapDir::In, at_ns, ok: true });
        Ok(())
    }

    fn poll(&mut self, now_ns: u64, done: &mut Vec<SwapDone>) {
        // Bounded by the pending list.
        let mut i = 0;
        while i < self.pending.len() {
            if self.pending[i].at_ns <= now_ns {
                done.push(self.pending.swap_remove(i));
            } else {
                i += 1;
            }
        }
        done.sort_by_key(|d| (d.at_ns, d.seq));
    }

    fn drop_seq(&mut self, seq: SeqId) {
        self.held.remove(&seq);
        // Unknown to the engine when it never swapped: nothing to drop.
        let _ = self.engine.drop_seq(seq);
    }

    fn can_hold(&self, bytes: u64) -> bool {
        bytes <= self.host_sim_bytes.saturating_sub(self.held_bytes())
    }

    fn next_completion_ns(&self) -> Option<u64> {
        self.pending.iter().map(|d| d.at_ns).min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swaps_really_round_trip_through_the_engine() {
        let mut p = EnginePort::new(64, 4096, 2 << 20, 64 << 20, 0.04, 1000).unwrap();
        let blocks: Vec<BlockId> = (0..10).map(BlockId).collect();
        p.swap_out(0, SeqId(9), &blocks).unwrap();
        assert_eq!(p.next_completion_ns(), Some(1000 + (10.0 * 2097152.0 * 0.04) as u64));
        let mut done = Vec::new();
        p.poll(u64::MAX, &mut done);
        assert_eq!(done.len(), 1);
        p.swap_in(10, SeqId(9), &blocks).unwrap();
        p.poll(u64::MAX, &mut done);
        assert_eq!(done.len(), 2);
        let s = p.stats();
        assert_eq!((s.transfers, s.mismatches, s.engine_errors), (2, 0, 0));
        assert_eq!(s.real_bytes, 2 * 10 * 4096);
        // Host tier of 32 simulated blocks: a 40-block swap-out does not fit.
        let big: Vec<BlockId> = (0..40).map(BlockId).collect();
        assert!(matches!(p.swap_out(0, SeqId(10), &big), Err(SwapPortError::TierFull { .. })));
    }

    #[test]
    fn swapping_in_an_unknown_sequence_is_refused() {
        let mut p = EnginePort::new(16, 4096, 2 << 20, 64 << 20, 0.04, 1000).unwrap();
        let err = p.swap_in(0, SeqId(5), &[BlockId(0)]).unwrap_err();
        assert!(matches!(err, SwapPortError::Refused { dir: SwapDir::In, .. }), "{err}");
    }

    #[test]
    fn calibration_measures_a_plausible_copy_cost() {
        let c = calibrate_host_tier(1 << 20, 8, 3).unwrap();
        // Between 1 TB/s and 10 MB/s, even in a debug build on a loaded machine.
        assert!(c.ns_per_byte() > 0.001 && c.ns_per_byte() < 100.0, "{c:?}");
    }
}
