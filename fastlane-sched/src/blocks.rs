//! The paged KV block manager: fixed-size blocks of [`BLOCK_TOKENS`] tokens, one block table
//! per sequence, a free pool.
//!
//! Blocks that are being copied out by a swap are *pinned*: [`BlockManager::pin`] moves a
//! sequence's table out of the manager into a [`PinnedBlocks`] value, and the blocks return
//! to the free pool only through [`BlockManager::unpin`] — which the scheduler calls when the
//! swap-out has completed. Until then no allocation can hand them to another sequence.

use std::collections::HashMap;

use thiserror::Error;

use super::{BlockId, SeqId};

/// Tokens per KV block (vLLM's default block size on CUDA).
pub const BLOCK_TOKENS: u32 = 16;

/// Blocks needed to hold `tokens` tokens of KV.
pub const fn blocks_for_tokens(tokens: u32) -> u32 {
    tokens.div_ceil(BLOCK_TOKENS)
}

/// Errors of the block manager.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum BlockError {
    /// Not enough free blocks; nothing was allocated.
    #[error("out of KV blocks: need {need}, free {free}")]
    OutOfBlocks {
        /// Blocks the request needed.
        need: u32,
        /// Blocks free at the time.
        free: u32,
    },
    /// The sequence has no block table.
    #[error("sequence {seq:?} has no block table")]
    UnknownSeq {
        /// The sequence.
        seq: SeqId,
    },
}

/// A sequence's blocks held out of the pool while a copy reads them.
#[derive(Debug)]
#[must_use = "pinned blocks return to the pool only through BlockManager::unpin"]
pub struct PinnedBlocks {
    seq: SeqId,
    blocks: Vec<BlockId>,
}

impl PinnedBlocks {
    /// The pinned blocks, in block-table order.
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// The sequence they belonged to.
    pub fn seq(&self) -> SeqId {
        self.seq
    }
}

/// Block tables and the free pool of one device.
#[derive(Debug)]
pub struct BlockManager {
    total: u32,
    free: Vec<BlockId>,
    tables: HashMap<SeqId, Vec<BlockId>>,
    pinned: u32,
}

impl BlockManager {
    /// A device with `total` blocks, all free. Block ids are `0..total`.
    pub fn new(total: u32) -> Self {
        // Popped from the end: hand out low ids first (deterministic).
        let free = (0..total).rev().map(BlockId).collect();
        Self { total, free, tables: HashMap::new(), pinned: 0 }
    }

    /// Blocks on the device.
    pub fn total(&self) -> u32 {
        self.total
    }

    /// Blocks in the free pool.
    pub fn free(&self) -> u32 {
        self.free.len() as u32
    }

    /// Blocks pinned by in-flight swap-outs.
    pub fn pinned(&self) -> u32 {
        self.pinned
    }

    /// Blocks held in block tables.
    pub fn used(&self) -> u32 {
        self.total - self.free() - self.pinned
    }

    /// The block table of `seq`, if it has one.
    pub fn table(&self, seq: SeqId) -> Option<&[BlockId]> {
        self.tables.get(&seq).map(Vec::as_slice)
    }

    /// Blocks `seq` would need to add to hold `tokens` tokens.
    pub fn shortfall(&self, seq: SeqId, tokens: u32) -> u32 {
        let have = self.tables.get(&seq).map_or(0, |t| t.len() as u32);
        blocks_for_tokens(tokens).saturating_sub(have)
    }

    /// Grow `seq`'s table (creating it) to hold `tokens` tokens: all or nothing.
    pub fn grow(&mut self, seq: SeqId, tokens: u32) -> Result<(), BlockError> {
        let need = self.shortfall(seq, tokens);
        if need > self.free() {
            return Err(BlockError::OutOfBlocks { need, free: self.free() });
        }
        let table = self.tables.entry(seq).or_default();
        for _ in 0..need {
            // Cannot fail: checked above.
            if let Some(b) = self.free.pop() {
                table.push(b);
            }
        }
        Ok(())
    }

    /// Shrink `seq`'s table to the blocks that hold `tokens` tokens, freeing the rest.
    pub fn truncate(&mut self, seq: SeqId, tokens: u32) -> Result<(), BlockError> {
        let table = self.tables.get_mut(&seq).ok_or(BlockError::UnknownSeq { seq })?;
        let keep = blocks_for_tokens(tokens) as usize;
        while table.len() > keep {
            if let Some(b) = table.pop() {
                self.free.push(b);
            }
        }
        Ok(())
    }

    /// Free every block of `seq` and drop its table; returns how many were freed.
    pub fn release(&mut self, seq: SeqId) -> u32 {
        match self.tables.remove(&seq) {
            Some(table) => {
                let n = table.len() as u32;
                self.free.extend(table);
                n
            }
            None => 0,
        }
    }

    /// Take `seq`'s whole table out of the manager for a copy: the blocks stay allocated
    /// (neither free nor in any table) until [`unpin`](Self::unpin).
    pub fn pin(&mut self, seq: SeqId) -> Result<PinnedBlocks, BlockError> {
        let blocks = self.tables.remove(&seq).ok_or(BlockError::UnknownSeq { seq })?;
        self.pinned += blocks.len() as u32;
        Ok(PinnedBlocks { seq, blocks })
    }

    /// Return pinned blocks to the free pool (the copy that read them has completed).
    pub fn unpin(&mut self, pinned: PinnedBlocks) {
        self.pinned -= pinned.blocks.len() as u32;
        self.free.extend(pinned.blocks);
    }

    /// Check the accounting: every block is exactly once in the pool, a table or a pin.
    /// Returns the number of blocks accounted for (`== total` when consistent).
    pub fn accounted(&self) -> u32 {
        self.free() + self.pinned + self.tables.values().map(|t| t.len() as u32).sum::<u32>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grow_is_all_or_nothing_and_release_returns_blocks() {
        let mut bm = BlockManager::new(10);
        bm.grow(SeqId(1), 100).unwrap(); // 7 blocks
        assert_eq!(bm.free(), 3);
        assert_eq!(bm.grow(SeqId(2), 64), Err(BlockError::OutOfBlocks { need: 4, free: 3 }));
        assert_eq!(bm.free(), 3);
        assert!(bm.table(SeqId(2)).is_none());
        bm.grow(SeqId(1), 112).unwrap(); // still 7
        assert_eq!(bm.free(), 3);
        bm.grow(SeqId(1), 113).unwrap();
        assert_eq!(bm.free(), 2);
        assert_eq!(bm.release(SeqId(1)), 8);
        assert_eq!(bm.free(), 10);
        assert_eq!(bm.accounted(), 10);
    }

    #[test]
    fn pinned_blocks_are_not_reallocated_until_unpinned() {
        let mut bm = BlockManager::new(4);
        bm.grow(SeqId(1), 64).unwrap();
        let pinned = bm.pin(SeqId(1)).unwrap();
        assert_eq!(bm.free(), 0);
        assert_eq!(bm.pinned(), 4);
        assert!(matches!(bm.grow(SeqId(2), 1), Err(BlockError::OutOfBlocks { .. })));
        let ids: Vec<BlockId> = pinned.blocks().to_vec();
        bm.unpin(pinned);
        bm.grow(SeqId(2), 64).unwrap();
        let mut got = bm.table(SeqId(2)).unwrap().to_vec();
        got.sort();
        let mut want = ids;
        want.sort();
        assert_eq!(got, want);
        assert_eq!(bm.accounted(), 4);
    }

    #[test]
    fn truncate_frees_the_tail() {
        let mut bm = BlockManager::new(8);
        bm.grow(SeqId(3), 128).unwrap();
        bm.truncate(SeqId(3), 17).unwrap();
        assert_eq!(bm.table(SeqId(3)).unwrap().len(), 2);
        assert_eq!(bm.free(), 6);
    }
}
