//! The scheduler's view of a swap engine: start a swap-out or swap-in of one sequence's
//! blocks, and learn when it has finished.
//!
//! The scheduler never waits on a swap: it starts one at a step boundary and polls for
//! completions at later boundaries. Implementations: [`InstantPort`] (a test double whose
//! swaps finish after a fixed simulated delay), the simulator's port over the real kvswap
//! host tier (`sim::EnginePort`), and any adapter over a real engine.

use thiserror::Error;

use super::{BlockId, SeqId};

/// Direction of a swap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SwapDir {
    /// Device → host.
    Out,
    /// Host → device.
    In,
}

/// A finished swap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SwapDone {
    /// The sequence.
    pub seq: SeqId,
    /// Which way it went.
    pub dir: SwapDir,
    /// When it finished (the port's clock, ns).
    pub at_ns: u64,
    /// Whether the data made it (a failed swap-out leaves the data on the device).
    pub ok: bool,
}

/// Errors a port reports when a swap cannot start.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum SwapPortError {
    /// The host tier has no room for the sequence.
    #[error("swap tier full: need {need_bytes} bytes, free {free_bytes}")]
    TierFull {
        /// Bytes the swap needed.
        need_bytes: u64,
        /// Bytes free.
        free_bytes: u64,
    },
    /// The engine refused the request.
    #[error("swap engine refused {dir:?} of {seq:?}: {reason}")]
    Refused {
        /// The sequence.
        seq: SeqId,
        /// Direction.
        dir: SwapDir,
        /// The engine's error, as text.
        reason: String,
    },
}

/// What the scheduler needs from a swap engine.
pub trait SwapPort {
    /// Start copying `blocks` of `seq` out to the host tier. The blocks stay pinned by the
    /// scheduler until the matching [`SwapDone`] arrives.
    fn swap_out(
        &mut self,
        now_ns: u64,
        seq: SeqId,
        blocks: &[BlockId],
    ) -> Result<(), SwapPortError>;
    /// Start copying `seq` back into `blocks` (freshly allocated device blocks, same count).
    fn swap_in(&mut self, now_ns: u64, seq: SeqId, blocks: &[BlockId])
        -> Result<(), SwapPortError>;
    /// Append the swaps finished at or before `now_ns` to `done`.
    fn poll(&mut self, now_ns: u64, done: &mut Vec<SwapDone>);
    /// Forget `seq`'s host copy (it finished or was cancelled).
    fn drop_seq(&mut self, seq: SeqId);
    /// Whether the host tier can take `bytes` more now.
    fn can_hold(&self, bytes: u64) -> bool;
    /// The earliest pending completion time, if the port knows it (simulated ports do; real
    /// engines return `None` and are polled).
    fn next_completion_ns(&self) -> Option<u64> {
        None
    }
}

/// A test double: every swap takes `fixed_ns + bytes * ns_per_byte` and succeeds; host
/// capacity is `host_bytes`. Swaps of the port are serialized on one copy engine, as on a
/// GPU's copy queue.
#[derive(Debug, Clone)]
pub struct InstantPort {
    /// Bytes per block.
    pub block_bytes: u64,
    /// Cost per byte.
    pub ns_per_byte: f64,
    /// Cost per swap.
    pub fixed_ns: u64,
    /// Host tier capacity.
    pub host_bytes: u64,
    held: std::collections::HashMap<SeqId, u64>,
    pending: Vec<SwapDone>,
    busy_until_ns: u64,
}

impl InstantPort {
    /// A port with the given geometry and costs.
    pub fn new(block_bytes: u64, ns_per_byte: f64, fixed_ns: u64, host_bytes: u64) -> Self {
        Self {
            block_bytes,
            ns_per_byte,
            fixed_ns,
            host_bytes,
            held: Default::default(),
            pending: Vec::new(),
            busy_until_ns: 0,
        }
    }

    fn held_bytes(&self) -> u64 {
        self.held.values().sum()
    }

    fn finish_at(&mut self, now_ns: u64, bytes: u64) -> u64 {
        let start = now_ns.max(self.busy_until_ns);
        let end = start + self.fixed_ns + (bytes as f64 * self.ns_per_byte) as u64;
        self.busy_until_ns = end;
        end
    }
}

impl SwapPort for InstantPort {
    fn swap_out(
        &mut self,
        now_ns: u64,
        seq: SeqId,
        blocks: &[BlockId],
    ) -> Result<(), SwapPortError> {
        let bytes = blocks.len() as u64 * self.block_bytes;
        let free = self.host_bytes.saturating_sub(self.held_bytes());
        if bytes > free {
            return Err(SwapPortError::TierFull { need_bytes: bytes, free_bytes: free });
        }
        if self.held.contains_key(&seq) {
            return Err(SwapPortError::Refused {
                seq,
                dir: SwapDir::Out,
                reason: "double swap-out".into(),
            });
        }
        self.held.insert(seq, bytes);
        let at_ns = self.finish_at(now_ns, bytes);
        self.pending.push(SwapDone { seq, dir: SwapDir::Out, at_ns, ok: true });
        Ok(())
    }

    fn swap_in(
        &mut self,
        now_ns: u64,
        seq: SeqId,
        blocks: &[BlockId],
    ) -> Result<(), SwapPortError> {
        let Some(&bytes) = self.held.get(&seq) else {
            return Err(SwapPortError::Refused {
                seq,
                dir: SwapDir::In,
                reason: "unknown sequence".into(),
            });
        };
        debug_assert_eq!(bytes, blocks.len() as u64 * self.block_bytes);
        let at_ns = self.finish_at(now_ns, bytes);
        self.pending.push(SwapDone { seq, dir: SwapDir::In, at_ns, ok: true });
        Ok(())
    }

    fn poll(&mut self, now_ns: u64, done: &mut Vec<SwapDone>) {
        let mut i = 0;
        while i < self.pending.len() {
            if self.pending[i].at_ns <= now_ns {
                let d = self.pending.remove(i);
                if d.dir == SwapDir::In {
                    self.held.remove(&d.seq);
                }
                done.push(d);
            } else {
                i += 1;
            }
        }
    }

    fn drop_seq(&mut self, seq: SeqId) {
        self.held.remove(&seq);
        self.pending.retain(|d| d.seq != seq);
    }

    fn can_hold(&self, bytes: u64) -> bool {
        bytes <= self.host_bytes.saturating_sub(self.held_bytes())
    }

    fn next_completion_ns(&self) -> Option<u64> {
        self.pending.iter().map(|d| d.at_ns).min()
    }
}
