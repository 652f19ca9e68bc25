//! DMA memory: regions mapped through the IOMMU, the IOVA space they are placed in, and the
//! table that turns a host address into an IOVA.
//!
//! # Who keeps DMA memory alive
//!
//! A [`DmaRegion`] is anonymous shared memory the driver maps (`mmap`) and then maps into the
//! IOMMU (`VFIO_IOMMU_MAP_DMA`). On drop it first removes the IOMMU mapping and only then
//! unmaps the memory, so the device can never reach pages that have gone back to the system;
//! if the IOMMU unmap fails the memory is leaked on purpose. Queues own the region that holds
//! their SQ, CQ, PRP list pages and bounce pages, and drop it only after their controller
//! queues are deleted (or the controller is stopped).
//!
//! The memory of a region is never turned into a Rust reference: the device may write it at
//! any time. Everything goes through raw pointers with volatile accesses or
//! `ptr::copy_nonoverlapping` between raw pointers.
//!
//! # IOVAs are never reused
//!
//! [`IovaSpace`] hands out IOVA ranges from a bump pointer, starting at 4 GiB (above the x86
//! MSI window at `0xfee0_0000`) and never reused. A queue may still hold an old snapshot of the
//! [`Translations`] when a region is unmapped; with fresh IOVAs, a stale translation can only
//! make the device fault on an unmapped IOVA, never land in someone else's memory. The space
//! is 2^39 bytes (QEMU's intel-iommu and most hardware IOMMUs offer at least 39 address bits),
//! enough for a thousand remappings of a 512 GiB guest.

use std::ptr::NonNull;
use std::sync::Arc;

use vfio_ioctls::VfioContainer;

use super::regs::PAGE_SIZE;
use super::NvmeError;

/// First IOVA handed out.
pub const IOVA_BASE: u64 = 1 << 32;
/// End of the IOVA space used.
pub const IOVA_END: u64 = 1 << 39;

/// Round `n` up to a whole number of pages.
pub fn page_round_up(n: usize) -> usize {
    n.div_ceil(PAGE_SIZE) * PAGE_SIZE
}

/// Bump allocator of IOVA ranges (never reused, see the module docs).
#[derive(Debug)]
pub struct IovaSpace {
    next: u64,
    end: u64,
}

impl Default for IovaSpace {
    fn default() -> Self {
        IovaSpace { next: IOVA_BASE, end: IOVA_END }
    }
}

impl IovaSpace {
    /// A range of `len` bytes (rounded up to 2 MiB so large regions can use huge IOMMU pages).
    pub fn alloc(&mut self, len: usize) -> Result<u64, NvmeError> {
        const ALIGN: u64 = 2 << 20;
        let rounded = (len as u64).div_ceil(ALIGN) * ALIGN;
        let start = self.next;
        let end = start.checked_add(rounded).filter(|&e| e <= self.end);
        match end {
            Some(end) => {
                self.next = end;
                Ok(start)
            }
            None => Err(NvmeError::IovaExhausted { len }),
        }
    }
}

/// An IOMMU mapping of memory the driver allocated itself.
pub struct DmaRegion {
    ptr: NonNull<u8>,
    len: usize,
    iova: u64,
    container: Arc<VfioContainer>,
}

impl std::fmt::Debug for DmaRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DmaRegion")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("iova", &format_args!("{:#x}", self.iova))
            .finish()
    }
}

// SAFETY: the region owns its mapping until `Drop`; all access to its memory is through raw
// pointers (never references), so moving the owner to another thread is sound.
unsafe impl Send for DmaRegion {}
// SAFETY: shared access only hands out raw pointers and the IOVA; see `Send`.
unsafe impl Sync for DmaRegion {}

impl DmaRegion {
    /// Allocate `len` bytes (rounded up to pages) of zeroed memory, pinned and mapped for the
    /// device at an IOVA from `iovas`.
    pub fn new(
        container: &Arc<VfioContainer>,
        iovas: &mut IovaSpace,
        len: usize,
    ) -> Result<DmaRegion, NvmeError> {
        let len = page_round_up(len.max(1));
        // SAFETY: a fresh anonymous mapping chosen by the kernel overlaps nothing we own.
        // MAP_SHARED keeps the pages from being copied-on-write after a fork, which would
        // leave the device writing pages this process no longer sees. Hand-written rather than
        // memmap2: its anonymous maps are always MAP_PRIVATE (`MmapOptions::map_anon`).
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(NvmeError::DmaAlloc { len, source: std::io::Error::last_os_error() });
        }
        let ptr = NonNull::new(addr.cast::<u8>()).expect("mmap returned NULL without MAP_FIXED");
        let iova = match iovas.alloc(len) {
            Ok(iova) => iova,
            Err(e) => {
                // SAFETY: our own mapping, never handed out, not yet visible to the device.
                unsafe { libc::munmap(addr, len) };
                return Err(e);
            }
        };
        // SAFETY:
        // - `ptr..ptr+len` is the mapping made above, owned by the returned region, which
        //   unmaps the IOVA before `munmap` (Drop), so the device never reaches freed pages;
        // - no reference to this memory exists or will ever be made (module docs).
        if let Err(e) = unsafe { container.vfio_dma_map(iova, len, ptr.as_ptr()) } {
            // SAFETY: the IOMMU mapping failed, so the device cannot reach the memory.
            unsafe { libc::munmap(addr, len) };
            return Err(NvmeError::DmaMap { iova, len, source: e });
        }
        Ok(DmaRegion { ptr, len, iova, container: container.clone() })
    }

    /// Host address of byte `offset` (`offset <= len`). Computing it is safe; using it is
    /// the caller's `unsafe`, under the module's rules (raw/volatile access only).
    pub fn host(&self, offset: usize) -> *mut u8 {
        assert!(offset <= self.len, "offset {offset} past a {}-byte DMA region", self.len);
        self.ptr.as_ptr().wrapping_add(offset)
    }

    /// IOVA of byte `offset` (`offset <= len`).
    pub fn iova(&self, offset: usize) -> u64 {
        assert!(offset <= self.len, "offset {offset} past a {}-byte DMA region", self.len);
        self.iova + offset as u64
    }

    /// Length in bytes (a whole number of pages).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false (a region has at least one page).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for DmaRegion {
    fn drop(&mut self) {
        match self.container.vfio_dma_unmap(self.iova, self.len) {
            Ok(()) => {
                // SAFETY: the device can no longer reach these pages (IOMMU mapping removed
                // just above), and every raw pointer into the region came from `host`, whose
                // users (queues, the admin queue) are gone before the region is dropped.
                unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
            }
            Err(e) => {
                // Leak: the device may still be able to write these pages.
                log::error!(
                    "VFIO unmap of iova {:#x} ({} bytes) failed ({e}); leaking the memory",
                    self.iova,
                    self.len
                );
            }
        }
    }
}

/// One host range the device can reach, and where.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mapping {
    /// Host virtual address of the first byte.
    pub host: usize,
    /// Length in bytes.
    pub len: usize,
    /// IOVA of the first byte.
    pub iova: u64,
}

/// Host-to-IOVA table of externally mapped memory (vhost guest regions, caller buffers from
/// [`super::NvmeDevice::alloc_dma`]), sorted by host address, non-overlapping. Immutable:
/// a change publishes a new table (`Controller::publish` in the controller module); queues
/// keep an `Arc` snapshot.
#[derive(Debug, Clone, Default)]
pub struct Translations {
    maps: Vec<Mapping>,
}

impl Translations {
    /// The IOVA of `host..host+len`, if one mapping holds all of it.
    pub fn lookup(&self, host: usize, len: usize) -> Option<u64> {
        let i = self.maps.partition_point(|m| m.host <= host);
        let m = self.maps.get(i.checked_sub(1)?)?;
        let off = host - m.host;
        (off.checked_add(len)? <= m.len).then(|| m.iova + off as u64)
    }

    /// A table with `m` added. Fails on overlap with an existing mapping.
    pub fn with(&self, m: Mapping) -> Result<Translations, NvmeError> {
        let i = self.maps.partition_point(|x| x.host < m.host);
        let overlaps_prev = i > 0 && self.maps[i - 1].host + self.maps[i - 1].len > m.host;
        let overlaps_next = self.maps.get(i).is_some_and(|x| m.host + m.len > x.host);
        if overlaps_prev || overlaps_next {
            return Err(NvmeError::MappingOverlap { host: m.host, len: m.len });
        }
        let mut maps = self.maps.clone();
        maps.insert(i, m);
        Ok(Translations { maps })
    }

    /// A table without the mapping that starts at `host`, and that mapping.
    pub fn without(&self, host: usize) -> Option<(Translations, Mapping)> {
        let i = self.maps.iter().position(|m| m.host == host)?;
        let mut maps = self.maps.clone();
        let m = maps.remove(i);
        Some((Translations { maps }, m))
    }

    /// The mappings, sorted by host address.
    pub fn mappings(&self) -> &[Mapping] {
        &self.maps
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iova_bump() {
        let mut s = IovaSpace::default();
        let a = s.alloc(4096).unwrap();
        let b = s.alloc(3 << 20).unwrap();
        let c = s.alloc(1).unwrap();
        assert_eq!(a, IOVA_BASE);
        assert_eq!(b, IOVA_BASE + (2 << 20));
        assert_eq!(c, b + (4 << 20));
        let mut small = IovaSpace { next: IOVA_BASE, end: IOVA_BASE + (4 << 20) };
        small.alloc(4 << 20).unwrap();
        assert!(matches!(small.alloc(1), Err(NvmeError::IovaExhausted { len: 1 })));
    }

    #[test]
    fn translation_table() {
        let t = Translations::default()
            .with(Mapping { host: 0x10000, len: 0x4000, iova: 0x1_0000_0000 })
            .unwrap()
            .with(Mapping { host: 0x40000, len: 0x1000, iova: 0x2_0000_0000 })
            .unwrap();
        assert_eq!(t.lookup(0x10000, 0x4000), Some(0x1_0000_0000));
        assert_eq!(t.lookup(0x12345, 16), Some(0x1_0000_2345));
        assert_eq!(t.lookup(0x13fff, 2), None, "crosses the end");
        assert_eq!(t.lookup(0x0fff, 1), None);
        assert_eq!(t.lookup(0x40800, 0x800), Some(0x2_0000_0800));
        assert_eq!(t.lookup(0x20000, 1), None);
        assert_eq!(t.lookup(usize::MAX - 1, 8), None, "overflow");
        assert!(t.with(Mapping { host: 0x13000, len: 0x2000, iova: 0 }).is_err());
        assert!(t.with(Mapping { host: 0x3f000, len: 0x2000, iova: 0 }).is_err());
        assert!(t.with(Mapping { host: 0x14000, len: 0x2000, iova: 0 }).is_ok());
        let (t2, m) = t.without(0x10000).unwrap();
        assert_eq!(m.iova, 0x1_0000_0000);
        assert_eq!(t2.lookup(0x10000, 1), None);
        assert_eq!(t2.mappings().len(), 1);
        assert!(t2.without(0x10000).is_none());
    }
}
