//! The byte pattern the VFIO guest check writes, shared with the host-side test that checks
//! the backing file (`tests/vfio_guest.rs` includes this file).

use fastlane_util::splitmix64;

/// Fill `buf` with the pattern of `seed` as it lies at byte `disk_offset` (a multiple of 8)
/// of the disk: the same disk bytes always get the same values for one seed, whatever the
/// request sizes.
pub fn fill(seed: u64, disk_offset: u64, buf: &mut [u8]) {
    assert_eq!(disk_offset % 8, 0);
    for (i, chunk) in buf.chunks_mut(8).enumerate() {
        let word = splitmix64(seed.wrapping_mul(0x1000_0000_01b3) ^ (disk_offset / 8 + i as u64));
        chunk.copy_from_slice(&word.to_le_bytes()[..chunk.len()]);
    }
}
