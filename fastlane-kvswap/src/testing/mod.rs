//! Test doubles and harnesses: an in-memory [`TierIo`] that can stand in for the NVMe or remote
//! tier and inject faults (failed writes, a peer that goes away, corrupted bytes), and
//! [`RedisCluster`], a real six-node Redis Cluster of `redis-server` processes.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fastlane_block::Segment;

use crate::tier::{TierDone, TierIo, TierKind, REMOTE_GONE_ERRNO};

pub mod redis_cluster;
pub use redis_cluster::{RedisCluster, RedisClusterOptions, RedisHarnessError};

/// Faults to inject into a [`MemTier`], shared with the test.
#[derive(Debug, Default)]
pub struct MemTierFaults {
    /// Stores fail with EIO (or, for a remote tier, the peer is gone).
    pub fail_stores: AtomicBool,
    /// Loads fail.
    pub fail_loads: AtomicBool,
    /// XOR this into the byte at `corrupt_offset` on the next load (0: off).
    pub corrupt_xor: AtomicU64,
    /// Byte offset in the tier to corrupt.
    pub corrupt_offset: AtomicU64,
    /// Stores done.
    pub stores: AtomicU64,
}

/// An in-memory tier that completes inline.
#[derive(Debug)]
pub struct MemTier {
    kind: TierKind,
    data: Vec<u8>,
    done: Vec<TierDone>,
    faults: Arc<MemTierFaults>,
}

impl MemTier {
    /// A tier of `bytes` reporting itself as `kind`.
    pub fn new(kind: TierKind, bytes: usize) -> (MemTier, Arc<MemTierFaults>) {
        let faults = Arc::new(MemTierFaults::default());
        (
            MemTier {
                kind,
                data: vec![0; bytes],
                done: Vec::with_capacity(8),
                faults: faults.clone(),
            },
            faults,
        )
    }

    fn errno(&self) -> i32 {
        if self.kind == TierKind::Remote {
            REMOTE_GONE_ERRNO
        } else {
            libc::EIO
        }
    }
}

impl TierIo for MemTier {
    fn kind(&self) -> TierKind {
        self.kind
    }
    fn capacity_bytes(&self) -> u64 {
        self.data.len() as u64
    }
    fn depth(&self) -> u32 {
        4
    }
    fn host_ptr(&self, _: u64) -> Option<*mut u8> {
        None
    }
    unsafe fn store(&mut self, tag: u64, offset: u64, segs: &[Segment]) -> Result<(), TierDone> {
        if self.faults.fail_stores.load(Ordering::Relaxed) {
            return Err(TierDone { tag, result: Err(self.errno()) });
        }
        let mut off = offset as usize;
        for s in segs {
            // SAFETY: the caller keeps the segment valid and unwritten until completion.
            let src = unsafe { std::slice::from_raw_parts(s.addr, s.len as usize) };
            self.data[off..off + src.len()].copy_from_slice(src);
            off += src.len();
        }
        self.faults.stores.fetch_add(1, Ordering::Relaxed);
        self.done.push(TierDone { tag, result: Ok(()) });
        Ok(())
    }
    unsafe fn load(&mut self, tag: u64, offset: u64, segs: &[Segment]) -> Result<(), TierDone> {
        if self.faults.fail_loads.load(Ordering::Relaxed) {
            return Err(TierDone { tag, result: Err(self.errno()) });
        }
        let x = self.faults.corrupt_xor.swap(0, Ordering::Relaxed);
        if x != 0 {
            let at = self.faults.corrupt_offset.load(Ordering::Relaxed) as usize;
            self.data[at] ^= x as u8;
        }
        let mut off = offset as usize;
        for s in segs {
            // SAFETY: the caller keeps the segment valid and unshared until completion.
            let dst = unsafe { std::slice::from_raw_parts_mut(s.addr, s.len as usize) };
            dst.copy_from_slice(&self.data[off..off + dst.len()]);
            off += dst.len();
        }
        self.done.push(TierDone { tag, result: Ok(()) });
        Ok(())
    }
    fn complete(&mut self, out: &mut [TierDone]) -> usize {
        let n = out.len().min(self.done.len());
        for (o, d) in out.iter_mut().zip(self.done.drain(..n)) {
            *o = d;
        }
        n
    }
    fn wait(&mut self, _: Duration) {}
    fn in_flight(&self) -> u32 {
        self.done.len() as u32
    }
}
