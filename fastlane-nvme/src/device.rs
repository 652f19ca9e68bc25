//! [`NvmeDevice`], the handle callers hold (cheap to clone; the [`Controller`] inside is
//! shared with the queues it opens), and [`DmaBuffer`], memory it maps for the device.

use std::sync::Arc;

use super::cmd::{ControllerId, NamespaceId};
use super::controller::{Controller, TransferStats, NVME_QUEUE_DEPTH_MAX};
use super::dma::{DmaRegion, Mapping};
use super::pci::{Bdf, VfioPci};
use super::queue::NvmeQueue;
use super::{NvmeError, NvmeOptions};
use fastlane_block::{BlockDevice, BlockQueue, DeviceInfo, ExternalMemory};

/// An NVMe namespace driven from userspace over VFIO. Cheap to share (`Arc` inside); open one
/// queue per thread.
#[derive(Debug, Clone)]
pub struct NvmeDevice {
    ctrl: Arc<Controller>,
}

impl NvmeDevice {
    /// Open the controller at `bdf` (bound to `vfio-pci`), reset and enable it, identify it
    /// and namespace `opts.nsid`.
    pub fn open(bdf: Bdf, opts: NvmeOptions) -> Result<NvmeDevice, NvmeError> {
        let pci = VfioPci::open(bdf)?;
        Ok(NvmeDevice { ctrl: Arc::new(Controller::bring_up(pci, opts)?) })
    }

    /// Identify Controller, as read at open.
    pub fn controller(&self) -> &ControllerId {
        &self.ctrl.ctrl_id
    }

    /// Identify Namespace, as read at open.
    pub fn namespace(&self) -> NamespaceId {
        self.ctrl.ns
    }

    /// Bytes one command moves at most; larger reads and writes are split.
    pub fn max_transfer_bytes(&self) -> u32 {
        self.ctrl.max_transfer_bytes
    }

    /// CAP.DSTRD as a stride in bytes.
    pub fn doorbell_stride_bytes(&self) -> usize {
        self.ctrl.cap.doorbell_stride_bytes()
    }

    /// Whether the controller has been declared failed (timeout or fatal status).
    pub fn failed(&self) -> bool {
        self.ctrl.failed_errno() != 0
    }

    /// Open an I/O queue pair (see [`BlockDevice::open_queue`]), with its concrete type.
    pub fn open_nvme_queue(&self, depth: u32) -> Result<NvmeQueue, NvmeError> {
        if !(1..=NVME_QUEUE_DEPTH_MAX).contains(&depth) {
            return Err(NvmeError::QueueDepth { depth, max: NVME_QUEUE_DEPTH_MAX });
        }
        NvmeQueue::open(self.ctrl.clone(), depth)
    }

    /// Memory the device reaches directly: requests whose segments lie in it go without a
    /// copy. Zeroed. Dropping it unmaps it (after every request naming it has completed, by
    /// [`fastlane_block::BlockQueue::submit`]'s contract).
    pub fn alloc_dma(&self, len: usize) -> Result<DmaBuffer, NvmeError> {
        let region = self.ctrl.alloc_region(len)?;
        let m = Mapping { host: region.host(0) as usize, len: region.len(), iova: region.iova(0) };
        self.ctrl.publish(|t| t.with(m))?;
        Ok(DmaBuffer { region: Some(region), ctrl: self.ctrl.clone() })
    }

    /// Map `host..host+len` for the device (zero copy for requests into it, e.g. guest memory
    /// regions from vhost-user `SET_MEM_TABLE`/`ADD_MEM_REG`). Returns the IOVA chosen.
    ///
    /// # Safety
    ///
    /// Until [`NvmeDevice::unmap_external`] has returned for `host` (or the device is dropped):
    /// - `host..host+len` stays mapped in this process and is not replaced (no `munmap`, no
    ///   `mmap(MAP_FIXED)` over it): the IOMMU pins the pages that are there now;
    /// - no Rust reference (`&`/`&mut`) to that memory is made or live: the device reads and
    ///   writes it by DMA at any time (vm-memory's volatile accessors are fine);
    /// - `host` and `len` are page-aligned (checked, an error otherwise).
    pub unsafe fn map_external(&self, host: *mut u8, len: usize) -> Result<u64, NvmeError> {
        // SAFETY: the caller's contract is this function's.
        unsafe { self.ctrl.map_external(host, len, false, 0) }
    }

    /// Make the external mappings exactly `regions` (host address, length, key), for the
    /// vhost-user memory table hook: a region already mapped with the same address, length
    /// and key stays mapped (its in-flight requests are undisturbed); every other external
    /// mapping is removed first, then the new regions are mapped. `key` names what backs the
    /// range (e.g. the memfd's inode and offset, or a generation the caller bumps on every
    /// table), so an address that was unmapped and reused for other memory is remapped, not
    /// kept pointing at the old pages.
    ///
    /// On error the mappings are partly updated; call again or unmap.
    ///
    /// # Safety
    ///
    /// Every region in `regions` meets [`NvmeDevice::map_external`]'s contract.
    pub unsafe fn sync_external(&self, regions: &[(*mut u8, usize, u64)]) -> Result<(), NvmeError> {
        let current: Vec<(Mapping, u64)> =
            self.ctrl.external.lock().unwrap_or_else(|p| p.into_inner()).clone();
        for (m, key) in &current {
            let keep =
                regions.iter().any(|&(h, l, k)| h as usize == m.host && l == m.len && k == *key);
            if !keep {
                self.ctrl.unmap_external(m.host)?;
            }
        }
        for &(host, len, key) in regions {
            let have =
                current.iter().any(|(m, k)| m.host == host as usize && m.len == len && *k == key);
            if !have {
                // SAFETY: the caller's contract covers every region.
                unsafe { self.ctrl.map_external(host, len, false, key) }?;
            }
        }
        Ok(())
    }

    /// Remove a mapping made by [`NvmeDevice::map_external`]. Requests in flight into it
    /// complete with an error (the device faults on the IOVA); IOVAs are never reused, so a
    /// queue's stale translation cannot reach other memory.
    pub fn unmap_external(&self, host: *mut u8) -> Result<(), NvmeError> {
        self.ctrl.unmap_external(host as usize)
    }

    /// The current external mappings (host address, length, IOVA), sorted by host address.
    pub fn mappings(&self) -> Vec<Mapping> {
        self.ctrl.translations().mappings().to_vec()
    }

    /// Reads and writes so far, zero copy versus bounced, over all queues (open and closed).
    /// Also logged when the device closes.
    pub fn transfer_stats(&self) -> TransferStats {
        self.ctrl.transfer_stats()
    }
}

impl BlockDevice for NvmeDevice {
    fn info(&self) -> DeviceInfo {
        self.ctrl.info()
    }

    fn open_queue(&self, depth: u32) -> std::io::Result<Box<dyn BlockQueue>> {
        Ok(Box::new(self.open_nvme_queue(depth)?))
    }

    fn external_memory(&self) -> Option<&dyn ExternalMemory> {
        Some(self)
    }
}

impl ExternalMemory for NvmeDevice {
    unsafe fn sync_regions(&self, regions: &[(*mut u8, usize, u64)]) -> std::io::Result<()> {
        // SAFETY: `ExternalMemory::sync_regions`'s contract is `sync_external`'s: every region
        // stays mapped, unreplaced and reference-free until a later successful call drops it.
        unsafe { self.sync_external(regions) }.map_err(std::io::Error::from)
    }
}

/// Memory from [`NvmeDevice::alloc_dma`]: mapped for the device, accessed only through raw
/// pointers (the device writes it by DMA). Unmapped when dropped.
pub struct DmaBuffer {
    region: Option<DmaRegion>,
    ctrl: Arc<Controller>,
}

impl std::fmt::Debug for DmaBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DmaBuffer").field("region", &self.region).finish()
    }
}

impl DmaBuffer {
    fn region(&self) -> &DmaRegion {
        self.region.as_ref().expect("region present until drop")
    }

    /// Start of the buffer, for [`fastlane_block::Segment`]s.
    pub fn as_ptr(&self) -> *mut u8 {
        self.region().host(0)
    }

    /// Length in bytes (whole pages).
    pub fn len(&self) -> usize {
        self.region().len()
    }

    /// Always false.
    pub fn is_empty(&self) -> bool {
        self.region().is_empty()
    }

    /// The IOVA of the first byte.
    pub fn iova(&self) -> u64 {
        self.region().iova(0)
    }

    /// Copy `data` in at `offset`. Racing with a read request in flight into the same bytes
    /// leaves them unspecified (never undefined: the memory is only touched by raw copies).
    pub fn write_at(&self, offset: usize, data: &[u8]) {
        let end = offset.checked_add(data.len()).expect("overflow");
        assert!(end <= self.len(), "write past the end of a DMA buffer");
        // SAFETY: in bounds (checked); a raw copy into memory no reference points to.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.as_ptr().wrapping_add(offset),
                data.len(),
            )
        };
    }

    /// Copy out to `out` from `offset` (same rules as `write_at`).
    pub fn read_at(&self, offset: usize, out: &mut [u8]) {
        let end = offset.checked_add(out.len()).expect("overflow");
        assert!(end <= self.len(), "read past the end of a DMA buffer");
        // SAFETY: in bounds (checked); a raw copy out of memory no reference points to.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.as_ptr().wrapping_add(offset),
                out.as_mut_ptr(),
                out.len(),
            )
        };
    }
}

impl Drop for DmaBuffer {
    fn drop(&mut self) {
        let host = self.as_ptr() as usize;
        if let Err(e) = self
            .ctrl
            .publish(|t| Ok(t.without(host).map(|(t2, _)| t2).unwrap_or_else(|| t.clone())))
        {
            log::warn!("dropping DMA buffer: {e}");
        }
        // The region unmaps its IOVA, then its memory.
        drop(self.region.take());
    }
}
