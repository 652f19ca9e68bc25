//! What the file-backed backends (`uring`, `sync`) share: learning a file's or block device's
//! size and logical block size, and trimming an iovec array after a short transfer.

use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::FileTypeExt;

/// `_IOR(0x12, 114, size_t)`: the device size in bytes (not in the libc crate for every
/// target; this encoding holds for x86_64 and aarch64).
const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;

/// Size and logical block size of an open file or block device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RawGeometry {
    /// Bytes.
    pub(crate) size: u64,
    /// `BLKSSZGET` for block devices, 512 for regular files.
    pub(crate) logical_block: u32,
    /// A block device (not a regular file).
    pub(crate) blockdev: bool,
}

/// The geometry of `file`; `Ok(None)` when it is neither a regular file nor a block device.
pub(crate) fn raw_geometry(file: &File) -> std::io::Result<Option<RawGeometry>> {
    let meta = file.metadata()?;
    if meta.file_type().is_block_device() {
        let fd = file.as_raw_fd();
        Ok(Some(RawGeometry {
            size: ioctl_u64(fd, BLKGETSIZE64)?,
            logical_block: ioctl_int(fd, libc::BLKSSZGET as libc::c_ulong)?,
            blockdev: true,
        }))
    } else if meta.file_type().is_file() {
        Ok(Some(RawGeometry { size: meta.len(), logical_block: 512, blockdev: false }))
    } else {
        Ok(None)
    }
}

fn ioctl_u64(fd: RawFd, req: libc::c_ulong) -> std::io::Result<u64> {
    let mut v: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 to the pointer, which points at `v`.
    let rc = unsafe { libc::ioctl(fd, req as _, &mut v as *mut u64) };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(v)
}

fn ioctl_int(fd: RawFd, req: libc::c_ulong) -> std::io::Result<u32> {
    let mut v: libc::c_int = 0;
    // SAFETY: BLKSSZGET writes one int to the pointer, which points at `v`.
    let rc = unsafe { libc::ioctl(fd, req as _, &mut v as *mut libc::c_int) };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    u32::try_from(v).map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))
}

/// Drop the first `n` transferred bytes from `iovecs[first..]` (a short transfer): whole
/// iovecs are skipped, a partly done one is trimmed in place. Returns the new `first`.
pub(crate) fn advance_iovecs(iovecs: &mut [libc::iovec], mut first: usize, n: u64) -> usize {
    let mut left = n;
    while left > 0 && first < iovecs.len() {
        let iov = &mut iovecs[first];
        if left >= iov.iov_len as u64 {
            left -= iov.iov_len as u64;
            first += 1;
        } else {
            // Only the address is computed here (`wrapping_add`); the kernel dereferences it,
            // within the caller's segment (`left < iov_len`).
            iov.iov_base = iov.iov_base.cast::<u8>().wrapping_add(left as usize).cast();
            iov.iov_len -= left as usize;
            left = 0;
        }
    }
    first
}
