//! The virtio-blk configuration space (`struct virtio_blk_config`, VIRTIO 1.2 §5.2.4) and the
//! feature bits we offer.

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_BLK_SIZE, VIRTIO_BLK_F_DISCARD, VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_MQ,
    VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_TOPOLOGY, VIRTIO_BLK_F_WRITE_ZEROES,
};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};

use fastlane_block::DeviceInfo;

/// virtio-blk sectors are always 512 bytes, whatever the logical block size.
pub const SECTOR_SIZE: u64 = 512;
/// `log2(SECTOR_SIZE)`.
pub const SECTOR_SHIFT: u32 = 9;
/// Size of `struct virtio_blk_config` up to and including its trailing padding.
pub const CONFIG_SPACE_LEN: usize = 60;
/// Largest discard one request may ask for, in sectors (QEMU's limit: 2 GiB - 512).
pub const DISCARD_SECTORS_MAX: u32 = (1 << 22) - 1;
/// Largest write-zeroes one request may ask for, in sectors.
pub const WRITE_ZEROES_SECTORS_MAX: u32 = (1 << 22) - 1;
/// Ranges per discard / write-zeroes request (QEMU supports one as well).
pub const DISCARD_SEGMENTS_MAX: u32 = 1;

/// What the device exports, after applying the serve options to the backend's [`DeviceInfo`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlkGeometry {
    /// Capacity in bytes (a multiple of 512).
    pub capacity_bytes: u64,
    /// Logical block size in bytes.
    pub block_size: u32,
    /// Writes, discards and write-zeroes are refused.
    pub read_only: bool,
    /// Offer `VIRTIO_BLK_F_DISCARD`.
    pub discard: bool,
    /// Offer `VIRTIO_BLK_F_WRITE_ZEROES`.
    pub write_zeroes: bool,
    /// Data segments one request may carry (`seg_max`).
    pub segments_max: u32,
    /// Number of virtqueues.
    pub num_queues: u16,
}

impl BlkGeometry {
    /// Derive the exported geometry from a backend and the serve options.
    pub fn new(info: &DeviceInfo, read_only: bool, num_queues: u16, queue_size_max: u16) -> Self {
        let read_only = read_only || info.read_only;
        // seg_max = queue size - 2 (header and status), as QEMU does; never more than the
        // backend takes.
        let segments_max =
            info.max_segments.min(u32::from(queue_size_max).saturating_sub(2)).max(1);
        BlkGeometry {
            capacity_bytes: info.size_bytes - info.size_bytes % SECTOR_SIZE,
            block_size: info.block_size.max(512),
            read_only,
            discard: info.discard && !read_only,
            write_zeroes: info.write_zeroes && !read_only,
            segments_max,
            num_queues,
        }
    }

    /// The virtio feature bits we offer (device-specific and transport ones; the vhost-user
    /// `PROTOCOL_FEATURES` bit is added by the device).
    ///
    /// Not `VIRTIO_BLK_F_SIZE_MAX`: nothing here limits a segment's size, and SeaBIOS 1.16
    /// (QEMU's default BIOS, which drives every virtio-blk disk at boot) truncates the request
    /// size it derives from `size_max` to 16 bits. With `size_max` = 1 MiB that came out 0: it
    /// sent the same zero-length read forever and the guest never booted (found by
    /// fastlane-cli/tests/vm_blk.rs with SeaBIOS 1.16.2; 0xFE00 booted). QEMU's own virtio-blk and
    /// qemu-storage-daemon do not offer the feature either.
    pub fn features(&self) -> u64 {
        let mut f = (1u64 << VIRTIO_F_VERSION_1)
            | (1u64 << VIRTIO_RING_F_INDIRECT_DESC)
            | (1u64 << VIRTIO_RING_F_EVENT_IDX)
            | (1u64 << VIRTIO_BLK_F_SEG_MAX)
            | (1u64 << VIRTIO_BLK_F_BLK_SIZE)
            | (1u64 << VIRTIO_BLK_F_FLUSH)
            | (1u64 << VIRTIO_BLK_F_TOPOLOGY)
            | (1u64 << VIRTIO_BLK_F_MQ);
        if self.read_only {
            f |= 1u64 << VIRTIO_BLK_F_RO;
        }
        if self.discard {
            f |= 1u64 << VIRTIO_BLK_F_DISCARD;
        }
        if self.write_zeroes {
            f |= 1u64 << VIRTIO_BLK_F_WRITE_ZEROES;
        }
        f
    }

    /// The configuration space, little-endian, exactly [`CONFIG_SPACE_LEN`] bytes.
    pub fn config_space(&self) -> [u8; CONFIG_SPACE_LEN] {
        let mut c = [0u8; CONFIG_SPACE_LEN];
        let put = |c: &mut [u8; CONFIG_SPACE_LEN], off: usize, bytes: &[u8]| {
            c[off..off + bytes.len()].copy_from_slice(bytes);
        };
        let align_sectors = self.block_size / SECTOR_SIZE as u32;
        put(&mut c, 0, &(self.capacity_bytes >> SECTOR_SHIFT).to_le_bytes()); // capacity
        put(&mut c, 12, &self.segments_max.to_le_bytes()); // seg_max (8..12: size_max, not offered)
                                                           // 16..20: geometry (cylinders, heads, sectors): not offered.
        put(&mut c, 20, &self.block_size.to_le_bytes()); // blk_size
        c[24] = 0; // physical_block_exp: physical == logical
        c[25] = 0; // alignment_offset
        put(&mut c, 26, &1u16.to_le_bytes()); // min_io_size, in logical blocks
        put(&mut c, 28, &0u32.to_le_bytes()); // opt_io_size: none
        c[32] = 0; // writeback (CONFIG_WCE not offered)
        put(&mut c, 34, &self.num_queues.to_le_bytes()); // num_queues
        if self.discard {
            put(&mut c, 36, &DISCARD_SECTORS_MAX.to_le_bytes());
            put(&mut c, 40, &DISCARD_SEGMENTS_MAX.to_le_bytes());
            put(&mut c, 44, &align_sectors.to_le_bytes());
        }
        if self.write_zeroes {
            put(&mut c, 48, &WRITE_ZEROES_SECTORS_MAX.to_le_bytes());
            put(&mut c, 52, &DISCARD_SEGMENTS_MAX.to_le_bytes());
            c[56] = 1; // write_zeroes_may_unmap
        }
        c
    }

    /// `get_config(offset, size)`: exactly `size` bytes, zero past the end of the structure
    /// (frontends ask for 57 or 60 bytes, or just one field).
    pub fn read_config(&self, offset: u32, size: u32) -> Vec<u8> {
        let space = self.config_space();
        let mut out = vec![0u8; size as usize];
        let start = (offset as usize).min(CONFIG_SPACE_LEN);
        let end = (offset as usize).saturating_add(size as usize).min(CONFIG_SPACE_LEN);
        out[..end - start].copy_from_slice(&space[start..end]);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geo() -> BlkGeometry {
        BlkGeometry::new(
            &DeviceInfo {
                size_bytes: 64 << 20,
                block_size: 4096,
                read_only: false,
                discard: true,
                write_zeroes: true,
                volatile_cache: false,
                max_segments: 1024,
            },
            false,
            4,
            256,
        )
    }

    #[test]
    fn config_fields_land_at_spec_offsets() {
        let c = geo().config_space();
        assert_eq!(u64::from_le_bytes(c[0..8].try_into().unwrap()), (64 << 20) / 512);
        assert_eq!(u32::from_le_bytes(c[12..16].try_into().unwrap()), 254);
        assert_eq!(u32::from_le_bytes(c[20..24].try_into().unwrap()), 4096);
        assert_eq!(u16::from_le_bytes(c[34..36].try_into().unwrap()), 4);
        assert_eq!(u32::from_le_bytes(c[44..48].try_into().unwrap()), 8);
        assert_eq!(c[56], 1);
    }

    #[test]
    fn get_config_returns_exactly_size_bytes() {
        let g = geo();
        assert_eq!(g.read_config(0, 57).len(), 57);
        assert_eq!(g.read_config(0, 60).len(), 60);
        assert_eq!(g.read_config(0, 100).len(), 100);
        assert_eq!(g.read_config(200, 8), vec![0; 8]);
        assert_eq!(g.read_config(u32::MAX, 4), vec![0; 4]);
        assert_eq!(g.read_config(34, 2), 4u16.to_le_bytes().to_vec());
    }

    #[test]
    fn size_max_is_not_offered() {
        // SeaBIOS hangs at boot on a size_max that is a multiple of 64 KiB; see `features`.
        let g = geo();
        assert_eq!(g.features() & (1 << virtio_bindings::virtio_blk::VIRTIO_BLK_F_SIZE_MAX), 0);
        assert_eq!(u32::from_le_bytes(g.config_space()[8..12].try_into().unwrap()), 0);
    }

    #[test]
    fn read_only_hides_discard_and_sets_ro() {
        let mut info = DeviceInfo {
            size_bytes: 1 << 20,
            block_size: 512,
            read_only: false,
            discard: true,
            write_zeroes: true,
            volatile_cache: false,
            max_segments: 16,
        };
        let g = BlkGeometry::new(&info, true, 1, 128);
        assert_ne!(g.features() & (1 << VIRTIO_BLK_F_RO), 0);
        assert_eq!(g.features() & (1 << VIRTIO_BLK_F_DISCARD), 0);
        info.read_only = true;
        assert!(BlkGeometry::new(&info, false, 1, 128).read_only);
    }
}
