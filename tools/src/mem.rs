//! Memory the benchmarks map for themselves.

use anyhow::{bail, Result};

/// A private anonymous mapping of `len` bytes, populated up front (so no benchmark times its
/// page faults). The caller unmaps it with `munmap(ptr, len)`.
pub fn mmap_populated(len: usize) -> Result<*mut u8> {
    // SAFETY: a fresh anonymous mapping chosen by the kernel overlaps nothing we own.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        bail!("mmap of {len} bytes: {}", std::io::Error::last_os_error());
    }
    Ok(p.cast())
}
