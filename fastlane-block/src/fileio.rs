//! What the file-backed backends (`uring`, `sync`) share: opening a file or block device and
//! learning its size and logical block size (and the errors of doing so), and trimming an iovec
//! array after a short transfer.

use std::fs::{File, OpenOptions};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Why a file backend ([`SyncFileDevice`](super::sync::SyncFileDevice),
/// [`UringDevice`](super::uring::UringDevice)) could not open its file or device.
#[derive(Debug, thiserror::Error)]
pub enum FileOpenError {
    /// `open(2)` failed (`EINVAL` with `O_DIRECT`: the filesystem has no direct I/O).
    #[error("cannot open {path:?}")]
    Open {
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Reading the size or block size failed.
    #[error("cannot query the geometry of {path:?}")]
    Geometry {
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Neither a regular file nor a block device.
    #[error("{path:?} is not a regular file or block device")]
    NotADisk {
        /// The path.
        path: PathBuf,
    },
    /// Smaller than one block, or an unusable block size.
    #[error("{path:?}: unusable geometry, {size_bytes} bytes in {block_size}-byte blocks")]
    BadGeometry {
        /// The path.
        path: PathBuf,
        /// Its size.
        size_bytes: u64,
        /// Its block size.
        block_size: u32,
    },
    /// `max_segments` is 0 or above the backend's limit.
    #[error("max_segments {max_segments} not in 1..={limit}")]
    MaxSegments {
        /// The value asked for.
        max_segments: u32,
        /// The backend's limit.
        limit: u32,
    },
}

/// Checks `max_segments` against `limit`, opens `path` read-only or read-write with
/// `O_CLOEXEC | extra_flags`, and reads its geometry.
pub(crate) fn open_disk(
    path: &Path,
    read_only: bool,
    extra_flags: libc::c_int,
    max_segments: u32,
    limit: u32,
) -> Result<(File, RawGeometry), FileOpenError> {
    let pb = || path.to_path_buf();
    if max_segments == 0 || max_segments > limit {
        return Err(FileOpenError::MaxSegments { max_segments, limit });
    }
    let file = OpenOptions::new()
        .read(true)
        .write(!read_only)
        .custom_flags(libc::O_CLOEXEC | extra_flags)
        .open(path)
        .map_err(|source| FileOpenError::Open { path: pb(), source })?;
    match raw_geometry(&file) {
        Ok(Some(g)) => Ok((file, g)),
        Ok(None) => Err(FileOpenError::NotADisk { path: pb() }),
        Err(source) => Err(FileOpenError::Geometry { path: pb(), source }),
    }
}

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
