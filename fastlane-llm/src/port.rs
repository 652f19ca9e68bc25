//! The scheduler's [`SwapPort`] over a real [`SwapEngine`] whose device memory is the model's
//! KV pool: a preempted sequence's blocks really leave the pool for the host, NVMe or remote
//! tier, and really come back (checksummed) before it runs again.
//!
//! The scheduler's block manager owns the pool. For each transfer the port lends the
//! sequence's blocks to the swap engine ([`SwapEngine::adopt_blocks`]); the engine pins them
//! until the copy ends, and the port hands them back ([`SwapEngine::free_blocks`]) when the
//! ticket completes. So the two allocators never disagree about a block in flight.

use std::collections::HashMap;
use std::time::Instant;

use fastlane_kvswap::{BlockId, KvSwapError, SeqId, SeqPhase, SwapEngine, Ticket, TicketDone};
use fastlane_sched::{SwapDir, SwapDone, SwapPort, SwapPortError};

/// What the port has moved.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PortStats {
    /// Swap-outs started.
    pub swap_outs: u64,
    /// Swap-ins started.
    pub swap_ins: u64,
    /// Bytes of finished swap-outs.
    pub out_bytes: u64,
    /// Bytes of finished swap-ins.
    pub in_bytes: u64,
    /// Wall time of finished swap-outs, start to completion seen, ns.
    pub out_ns: u64,
    /// Wall time of finished swap-ins, ns.
    pub in_ns: u64,
    /// Swaps that failed (the scheduler recomputes the sequence).
    pub failures: u64,
    /// Swap-ins refused because a block's checksum did not match (counted in `failures`).
    pub checksum_mismatches: u64,
    /// Swaps the engine refused to start.
    pub refused: u64,
    /// Bytes of finished swap-outs by the tier they landed in: host, NVMe, remote.
    pub out_bytes_by_tier: [u64; 3],
}

impl PortStats {
    /// Measured cost per byte, one way (both directions pooled); `None` before any swap.
    pub fn ns_per_byte(&self) -> Option<f64> {
        let b = self.out_bytes + self.in_bytes;
        (b > 0).then(|| (self.out_ns + self.in_ns) as f64 / b as f64)
    }
}

struct InFlight {
    seq: SeqId,
    dir: SwapDir,
    blocks: Vec<BlockId>,
    started: Instant,
}

/// The port.
pub struct EnginePort {
    engine: SwapEngine,
    block_bytes: u64,
    tickets: HashMap<Ticket, InFlight>,
    done: Vec<TicketDone>,
    stats: PortStats,
    swap_seconds: Option<prometheus::HistogramVec>,
}

impl std::fmt::Debug for EnginePort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EnginePort")
            .field("in_flight", &self.tickets.len())
            .field("stats", &self.stats)
            .finish()
    }
}

impl EnginePort {
    /// Observe every finished swap's duration into `h` (label: `out` or `in`).
    pub fn with_histogram(mut self, h: prometheus::HistogramVec) -> EnginePort {
        self.swap_seconds = Some(h);
        self
    }

    /// A port over `engine` (built on the model's pool).
    pub fn new(engine: SwapEngine) -> EnginePort {
        let block_bytes = engine.block_bytes() as u64;
        EnginePort {
            engine,
            block_bytes,
            tickets: HashMap::new(),
            done: Vec::new(),
            stats: PortStats::default(),
            swap_seconds: None,
        }
    }

    /// Counters.
    pub fn stats(&self) -> PortStats {
        self.stats
    }

    /// The swap engine (its own statistics: tiers, bytes, checksum failures).
    pub fn engine(&self) -> &SwapEngine {
        &self.engine
    }

    /// Transfers in flight.
    pub fn in_flight(&self) -> usize {
        self.tickets.len()
    }

    fn start(&mut self, seq: SeqId, blocks: &[BlockId], dir: SwapDir) -> Result<(), SwapPortError> {
        let refuse = |e: KvSwapError| {
            log::warn!("swap {dir:?} of sequence {seq} refused: {e}");
            SwapPortError::Refused { seq, dir, reason: e.to_string() }
        };
        if let Err(e) = self.engine.adopt_blocks(seq, blocks) {
            self.stats.refused += 1;
            return Err(refuse(e));
        }
        let started = match dir {
            SwapDir::Out => self.engine.swap_out(seq, blocks),
            SwapDir::In => self.engine.swap_in(seq, blocks),
        };
        match started {
            Ok(t) => {
                match dir {
                    SwapDir::Out => self.stats.swap_outs += 1,
                    SwapDir::In => self.stats.swap_ins += 1,
                }
                self.tickets.insert(
                    t,
                    InFlight { seq, dir, blocks: blocks.to_vec(), started: Instant::now() },
                );
                Ok(())
            }
            Err(e) => {
                self.stats.refused += 1;
                // Nothing pinned them: give them straight back.
                let _ = self.engine.free_blocks(seq, blocks);
                Err(match e {
                    KvSwapError::TierFull { .. } => {
                        let need = blocks.len() as u64 * self.block_bytes;
                        SwapPortError::TierFull { need_bytes: need, free_bytes: self.free_bytes() }
                    }
                    other => refuse(other),
                })
            }
        }
    }

    fn free_bytes(&self) -> u64 {
        self.engine
            .stats()
            .tiers
            .iter()
            .filter(|t| t.present)
            .map(|t| t.capacity_bytes.saturating_sub(t.used_bytes))
            .sum()
    }
}

impl SwapPort for EnginePort {
    fn swap_out(
        &mut self,
        _now_ns: u64,
        seq: SeqId,
        blocks: &[BlockId],
    ) -> Result<(), SwapPortError> {
        self.start(seq, blocks, SwapDir::Out)
    }

    fn swap_in(
        &mut self,
        _now_ns: u64,
        seq: SeqId,
        blocks: &[BlockId],
    ) -> Result<(), SwapPortError> {
        self.start(seq, blocks, SwapDir::In)
    }

    fn poll(&mut self, now_ns: u64, done: &mut Vec<SwapDone>) {
        self.done.clear();
        self.engine.poll(&mut self.done);
        for d in self.done.drain(..) {
            let Some(f) = self.tickets.remove(&d.ticket) else { continue };
            // The ticket is over, so the engine has unpinned the blocks: lend them back.
            let _ = self.engine.free_blocks(f.seq, &f.blocks);
            let ns = f.started.elapsed().as_nanos() as u64;
            let bytes = f.blocks.len() as u64 * self.block_bytes;
            if let (Some(h), Ok(())) = (&self.swap_seconds, &d.result) {
                let dir = if f.dir == SwapDir::Out { "out" } else { "in" };
                h.with_label_values(&[dir]).observe(ns as f64 * 1e-9);
            }
            match &d.result {
                Ok(()) => match f.dir {
                    SwapDir::Out => {
                        self.stats.out_bytes += bytes;
                        self.stats.out_ns += ns;
                        if let Some(SeqPhase::Out(t)) = self.engine.lookup(f.seq).map(|i| i.phase) {
                            self.stats.out_bytes_by_tier[t.index()] += bytes;
                        }
                    }
                    SwapDir::In => {
                        self.stats.in_bytes += bytes;
                        self.stats.in_ns += ns;
                    }
                },
                Err(e) => {
                    self.stats.failures += 1;
                    if matches!(e, KvSwapError::ChecksumMismatch { .. }) {
                        self.stats.checksum_mismatches += 1;
                    }
                    // The scheduler recomputes the sequence and drops its tier copy.
                    log::warn!("swap {:?} of sequence {} failed: {e}", f.dir, f.seq);
                }
            }
            done.push(SwapDone { seq: f.seq, dir: f.dir, at_ns: now_ns, ok: d.result.is_ok() });
        }
    }

    fn drop_seq(&mut self, seq: SeqId) {
        // Unknown to the engine when it never swapped: nothing to drop.
        let _ = self.engine.drop_seq(seq);
    }

    fn can_hold(&self, bytes: u64) -> bool {
        bytes <= self.free_bytes()
    }
}
