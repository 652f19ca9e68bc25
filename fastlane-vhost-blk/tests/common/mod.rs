//! Helpers shared by this crate's integration tests (`mod common;` in each).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use memmap2::{MmapOptions, MmapRaw};

/// A memfd of `len` bytes and its MAP_SHARED mapping: memory a test shares with the server
/// (guest RAM, buffers). The mapping is unmapped when dropped; the server maps the fd itself.
pub fn shared_memfd(len: usize) -> (OwnedFd, MmapRaw) {
    // SAFETY:
    // - the name is a NUL-terminated C string literal; memfd_create only reads it.
    let raw = unsafe { libc::memfd_create(c"fastlane-test-mem".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(raw >= 0, "memfd_create");
    // SAFETY:
    // - `raw` is a fresh file descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY:
    // - `fd` is a valid memfd; ftruncate only changes its size.
    assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) }, 0);
    let map = MmapOptions::new().len(len).map_raw(&fd).expect("mmap the memfd");
    (fd, map)
}
