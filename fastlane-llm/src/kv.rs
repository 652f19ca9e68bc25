//! The paged KV cache in kvswap's device pool.
//!
//! A block holds K and V of every layer for [`TOKENS_PER_BLOCK`] consecutive positions of
//! one sequence, f32, laid out `[layer][K|V][kv_head][slot][head_dim]`: one head's keys
//! for a block are contiguous, and a whole block is one contiguous range of the pool, which
//! is the unit kvswap swaps and checksums. A sequence's block table (the scheduler's) maps
//! position `p` to block `table[p / 16]`, slot `p % 16`.

use std::sync::Arc;

use fastlane_kvswap::{BlockId, DeviceMemory, HostDeviceMemory, KvGeometry};

use crate::error::LlmError;
use crate::model::TOKENS_PER_BLOCK;

/// The device pool as the model sees it.
#[derive(Debug, Clone)]
pub struct KvPool {
    mem: Arc<HostDeviceMemory>,
    base: usize,
    blocks: u32,
    block_floats: usize,
    kv_heads: usize,
    head_dim: usize,
}

/// Bytes of one block for `g` (kvswap's geometry, rounded up to a 4 KiB multiple so that
/// blocks can be written to an O_DIRECT NVMe tier as they are).
pub fn block_bytes(g: &KvGeometry) -> usize {
    (g.block_bytes() as usize).div_ceil(4096) * 4096
}

impl KvPool {
    /// A pool of `blocks` blocks for geometry `g` (f32).
    pub fn new(g: &KvGeometry, blocks: u32) -> Result<KvPool, LlmError> {
        let mem = Arc::new(HostDeviceMemory::new(block_bytes(g), blocks)?);
        Ok(KvPool::over(mem, g))
    }

    /// The pool over existing device memory.
    pub fn over(mem: Arc<HostDeviceMemory>, g: &KvGeometry) -> KvPool {
        assert_eq!(g.dtype, fastlane_kvswap::DType::F32, "the CPU engine keeps K and V in f32");
        assert!(mem.block_bytes() >= g.block_bytes() as usize);
        KvPool {
            base: mem.base() as usize,
            blocks: mem.blocks(),
            block_floats: mem.block_bytes() / 4,
            kv_heads: g.kv_heads as usize,
            head_dim: g.head_dim as usize,
            mem,
        }
    }

    /// The device memory (handed to the swap engine).
    pub fn memory(&self) -> &Arc<HostDeviceMemory> {
        &self.mem
    }

    /// Blocks in the pool.
    pub fn blocks(&self) -> u32 {
        self.blocks
    }

    /// Checks that every block of a table exists.
    pub fn check_blocks(&self, table: &[BlockId]) -> Result<(), LlmError> {
        match table.iter().find(|b| b.0 >= self.blocks) {
            Some(b) => Err(LlmError::BadRequest {
                reason: format!("block {b} outside the pool of {}", self.blocks),
            }),
            None => Ok(()),
        }
    }

    fn offset(&self, layer: usize, which: usize, kv_head: usize, slot: usize) -> usize {
        (((layer * 2 + which) * self.kv_heads + kv_head) * TOKENS_PER_BLOCK + slot) * self.head_dim
    }

    fn ptr(
        &self,
        table: &[BlockId],
        layer: usize,
        which: usize,
        kvh: usize,
        pos: usize,
    ) -> *mut f32 {
        let b = table[pos / TOKENS_PER_BLOCK].0;
        assert!(b < self.blocks, "block {b} outside the pool (checked by forward)");
        let off = self.offset(layer, which, kvh, pos % TOKENS_PER_BLOCK);
        debug_assert!(off + self.head_dim <= self.block_floats);
        (self.base as *mut f32).wrapping_add(b as usize * self.block_floats + off)
    }

    /// Stores K and V of one head at `pos`.
    pub fn write(
        &self,
        table: &[BlockId],
        layer: usize,
        kvh: usize,
        pos: usize,
        k: &[f32],
        v: &[f32],
    ) {
        let d = self.head_dim;
        assert!(k.len() == d && v.len() == d);
        // SAFETY: `ptr` points inside the pool mapping (block < blocks, offset + head_dim
        // inside a block). The block belongs to the sequence being computed: the scheduler
        // hands each block to one sequence, and blocks under a swap are pinned and never in
        // a step, so no one else reads or writes these floats now. The mapping lives as
        // long as `self.mem`.
        unsafe {
            std::ptr::copy_nonoverlapping(k.as_ptr(), self.ptr(table, layer, 0, kvh, pos), d)
        };
        // SAFETY: as above, for the value.
        unsafe {
            std::ptr::copy_nonoverlapping(v.as_ptr(), self.ptr(table, layer, 1, kvh, pos), d)
        };
    }

    /// Key of one head at `pos`.
    pub fn key(&self, table: &[BlockId], layer: usize, kvh: usize, pos: usize) -> &[f32] {
        // SAFETY: as in `write`; positions ≤ the row's are written before attention reads
        // them (earlier steps, or this step's K/V phase), and nothing writes them meanwhile.
        unsafe { std::slice::from_raw_parts(self.ptr(table, layer, 0, kvh, pos), self.head_dim) }
    }

    /// Value of one head at `pos`.
    pub fn value(&self, table: &[BlockId], layer: usize, kvh: usize, pos: usize) -> &[f32] {
        // SAFETY: as in `key`.
        unsafe { std::slice::from_raw_parts(self.ptr(table, layer, 1, kvh, pos), self.head_dim) }
    }

    /// Bytes of one block of the pool.
    pub fn block_size(&self) -> usize {
        self.block_floats * 4
    }

    /// Overwrites block `b` with `data` (a prefix-cache hit loaded before the step that reads
    /// it). `data` must be exactly one block.
    pub fn write_block(&self, b: BlockId, data: &[u8]) {
        assert!(b.0 < self.blocks, "block {b} outside the pool");
        assert_eq!(data.len(), self.block_floats * 4, "one whole block");
        // SAFETY: the destination is block `b` of the pool mapping (checked above), which
        // lives as long as `self.mem`. The block belongs to the sequence being loaded: the
        // scheduler gave it to that sequence alone, no step is running (the engine thread
        // calls this between planning and the forward pass), and a block under a swap is
        // never in a plan. `data` is a separate heap buffer, so the ranges do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                (self.base as *mut u8).wrapping_add(b.0 as usize * self.block_floats * 4),
                data.len(),
            )
        };
    }

    /// A block's bytes (the prefix cache's copies; tests: corruption and comparisons).
    pub fn block_bytes_of(&self, b: BlockId) -> &[u8] {
        assert!(b.0 < self.blocks);
        // SAFETY: inside the mapping; callers read blocks no step or swap is writing.
        unsafe {
            std::slice::from_raw_parts(
                (self.base as *const u8).wrapping_add(b.0 as usize * self.block_floats * 4),
                self.block_floats * 4,
            )
        }
    }
}
