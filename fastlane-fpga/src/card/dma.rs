//! Memory a card reads or writes by DMA.
//!
//! [`DmaBuffer`] is a page-aligned, zeroed allocation that is only ever touched through raw
//! pointers (never `&`/`&mut` while a card may write it). The software model uses virtual
//! addresses as IOVAs (the identity map a VFIO container gets when the driver maps buffers at
//! IOVA = VA); a VFIO backend would `VFIO_IOMMU_MAP_DMA` the buffer and keep the IOVA here.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

use super::error::CardError;

/// Alignment of every DMA buffer (one page).
pub const DMA_ALIGN: usize = 4096;

/// An owned, page-aligned, zero-initialised buffer for a card's rings or data.
#[derive(Debug)]
pub struct DmaBuffer {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the buffer is plain owned memory; the only shared access is by the card, which the
// owner's protocol (rings, completions) orders. No thread-affine state.
unsafe impl Send for DmaBuffer {}
// SAFETY: `&DmaBuffer` hands out only a raw pointer and the length; every access through the
// pointer is the caller's (unsafe) business.
unsafe impl Sync for DmaBuffer {}

impl DmaBuffer {
    /// `len` bytes (rounded up to a page), zeroed.
    pub fn new(len: usize) -> Result<Self, CardError> {
        let size = len.max(1).div_ceil(DMA_ALIGN) * DMA_ALIGN;
        let layout = Layout::from_size_align(size, DMA_ALIGN)
            .map_err(|_| CardError::Alloc { bytes: len })?;
        // SAFETY: `layout` has a non-zero size (at least one page).
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or(CardError::Alloc { bytes: len })?;
        Ok(Self { ptr, layout })
    }

    /// The first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Usable bytes (a whole number of pages).
    pub fn len(&self) -> usize {
        self.layout.size()
    }

    /// Never empty (at least one page); for symmetry with `len`.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The address the card uses for this buffer (IOVA = VA in the software model).
    pub fn iova(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }
}

impl Drop for DmaBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with exactly this layout and not freed before. Owners
        // drop DMA buffers only after the card has stopped using them (see `SoftCard`'s Drop).
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) };
    }
}
