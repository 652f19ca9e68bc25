//! Memory the benchmarks map for themselves.

use anyhow::{Context, Result};
use memmap2::{MmapOptions, MmapRaw};

/// A private anonymous mapping of `len` bytes, populated up front (so no benchmark times its
/// page faults), unmapped when dropped. Only raw pointers to it are handed out
/// ([`MmapRaw::as_mut_ptr`]): the kernel or a device may write it while a request is in flight.
pub fn mmap_populated(len: usize) -> Result<MmapRaw> {
    let map = MmapOptions::new()
        .len(len)
        .populate()
        .map_anon()
        .with_context(|| format!("mmap of {len} bytes"))?;
    Ok(map.into())
}
