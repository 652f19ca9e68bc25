//! NVMe controller registers (NVMe Base Specification 2.0, section 3.1) and the BAR0 mapping.
//!
//! Registers are only ever touched through [`Bar`], with volatile loads and stores of their
//! natural width on the mapping of BAR0; nothing here makes a reference to device memory.

use std::ptr::NonNull;

/// Controller Capabilities (64 bits).
pub const REG_CAP: usize = 0x00;
/// Version.
pub const REG_VS: usize = 0x08;
/// Interrupt Mask Set.
pub const REG_INTMS: usize = 0x0c;
/// Controller Configuration.
pub const REG_CC: usize = 0x14;
/// Controller Status.
pub const REG_CSTS: usize = 0x1c;
/// Admin Queue Attributes.
pub const REG_AQA: usize = 0x24;
/// Admin Submission Queue Base Address (64 bits).
pub const REG_ASQ: usize = 0x28;
/// Admin Completion Queue Base Address (64 bits).
pub const REG_ACQ: usize = 0x30;
/// First doorbell (admin SQ tail).
pub const REG_DOORBELL_BASE: usize = 0x1000;

/// CC.EN: enable.
pub const CC_EN: u32 = 1;
/// CC.SHN = 01b: normal shutdown notification.
pub const CC_SHN_NORMAL: u32 = 1 << 14;
/// CC.SHN mask.
pub const CC_SHN_MASK: u32 = 3 << 14;
/// CC.IOSQES = 6 (64-byte SQ entries) and CC.IOCQES = 4 (16-byte CQ entries); CSS = NVM,
/// MPS = 0 (4 KiB pages), AMS = round robin.
pub const CC_IO_ENTRY_SIZES: u32 = (6 << 16) | (4 << 20);

/// CSTS.RDY: ready.
pub const CSTS_RDY: u32 = 1;
/// CSTS.CFS: controller fatal status.
pub const CSTS_CFS: u32 = 1 << 1;
/// CSTS.SHST mask and "shutdown complete" value.
pub const CSTS_SHST_MASK: u32 = 3 << 2;
/// CSTS.SHST = 10b: shutdown processing complete.
pub const CSTS_SHST_DONE: u32 = 2 << 2;

/// The memory page size the driver configures (CC.MPS = 0).
pub const PAGE_SIZE: usize = 4096;

/// Decoded Controller Capabilities.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cap(pub u64);

impl Cap {
    /// Maximum Queue Entries Supported, as a count (the register is 0-based).
    pub fn max_queue_entries(self) -> u32 {
        (self.0 & 0xffff) as u32 + 1
    }

    /// Contiguous Queues Required.
    pub fn contiguous_queues_required(self) -> bool {
        self.0 & (1 << 16) != 0
    }

    /// Worst-case time to become ready or not ready (CAP.TO, 500 ms units), in milliseconds.
    pub fn ready_timeout_ms(self) -> u64 {
        ((self.0 >> 24) & 0xff) * 500
    }

    /// Doorbell stride in bytes (`4 << CAP.DSTRD`).
    pub fn doorbell_stride_bytes(self) -> usize {
        4usize << ((self.0 >> 32) & 0xf)
    }

    /// The NVM command set is supported (CAP.CSS bit 0).
    pub fn nvm_command_set(self) -> bool {
        (self.0 >> 37) & 1 != 0
    }

    /// Smallest memory page size in bytes (`2 ^ (12 + MPSMIN)`).
    pub fn page_size_min_bytes(self) -> u64 {
        1u64 << (12 + ((self.0 >> 48) & 0xf))
    }

    /// Largest memory page size in bytes (`2 ^ (12 + MPSMAX)`).
    pub fn page_size_max_bytes(self) -> u64 {
        1u64 << (12 + ((self.0 >> 52) & 0xf))
    }
}

/// Offset of queue `qid`'s SQ tail doorbell (`tail == true`) or CQ head doorbell.
pub fn doorbell_offset(qid: u16, cq_head: bool, stride_bytes: usize) -> usize {
    REG_DOORBELL_BASE + (2 * usize::from(qid) + usize::from(cq_head)) * stride_bytes
}

/// A mapping of BAR0 (made and unmapped by [`super::pci::VfioPci`]).
#[derive(Debug, Clone, Copy)]
pub struct Bar {
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: a `Bar` is an address and length of a device mapping that its owner keeps alive for
// as long as any `Bar` copy is used (the `VfioPci` is held by an `Arc` that every user holds);
// accesses are single volatile loads and stores, which the device serializes.
unsafe impl Send for Bar {}
// SAFETY: as for `Send`; no `&`/`&mut` to device memory is ever made.
unsafe impl Sync for Bar {}

impl Bar {
    /// # Safety
    ///
    /// `base..base+len` is a mapping of the controller's BAR0 that stays mapped for as long as
    /// this `Bar` (and every copy of it) is used.
    pub unsafe fn new(base: NonNull<u8>, len: usize) -> Bar {
        Bar { base, len }
    }

    /// Length of the mapping in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false (a BAR is never empty); for clippy's `len_without_is_empty`.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn at<T>(&self, offset: usize) -> *mut T {
        assert!(
            offset.is_multiple_of(std::mem::size_of::<T>())
                && offset + std::mem::size_of::<T>() <= self.len,
            "register offset {offset:#x} outside BAR0 ({:#x} bytes) or misaligned",
            self.len
        );
        self.base.as_ptr().wrapping_add(offset).cast()
    }

    /// Read a 32-bit register.
    pub fn read32(&self, offset: usize) -> u32 {
        // SAFETY: `at` checked that the naturally aligned register lies inside the mapping,
        // which `new`'s contract keeps alive; a volatile load of device memory.
        unsafe { self.at::<u32>(offset).read_volatile() }
    }

    /// Write a 32-bit register.
    pub fn write32(&self, offset: usize, value: u32) {
        // SAFETY: as in `read32`; a volatile store to device memory.
        unsafe { self.at::<u32>(offset).write_volatile(value) }
    }

    /// Read a 64-bit register (one 8-byte access, which NVMe controllers accept).
    pub fn read64(&self, offset: usize) -> u64 {
        // SAFETY: as in `read32`.
        unsafe { self.at::<u64>(offset).read_volatile() }
    }

    /// Write a 64-bit register as two 32-bit stores, low dword first (valid for ASQ/ACQ).
    pub fn write64(&self, offset: usize, value: u64) {
        self.write32(offset, value as u32);
        self.write32(offset + 4, (value >> 32) as u32);
    }

    /// A raw pointer to a doorbell, for queues that ring it on the hot path without the
    /// bounds check. The pointer is valid while the mapping is.
    pub fn doorbell(&self, offset: usize) -> *mut u32 {
        self.at::<u32>(offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cap_fields() {
        // QEMU's emulated controller: MQES 2047, CQR, TO 15, DSTRD 0, CSS NVM, MPSMIN 0,
        // MPSMAX 4.
        let cap = Cap(0x0040_0020_0f01_07ff);
        assert_eq!(cap.max_queue_entries(), 2048);
        assert!(cap.contiguous_queues_required());
        assert_eq!(cap.ready_timeout_ms(), 7500);
        assert_eq!(cap.doorbell_stride_bytes(), 4);
        assert!(cap.nvm_command_set());
        assert_eq!(cap.page_size_min_bytes(), 4096);
        assert_eq!(cap.page_size_max_bytes(), 65536);
        let wide = Cap(0x0000_0023_0000_0000);
        assert_eq!(wide.doorbell_stride_bytes(), 32);
    }

    #[test]
    fn doorbells() {
        assert_eq!(doorbell_offset(0, false, 4), 0x1000);
        assert_eq!(doorbell_offset(0, true, 4), 0x1004);
        assert_eq!(doorbell_offset(3, false, 4), 0x1018);
        assert_eq!(doorbell_offset(3, true, 16), 0x1000 + 7 * 16);
    }

    #[test]
    fn bar_access_in_plain_memory() {
        let mut mem = vec![0u64; 1024];
        let base = NonNull::new(mem.as_mut_ptr().cast::<u8>()).unwrap();
        // SAFETY: `mem` outlives `bar` and is only accessed through it below.
        let bar = unsafe { Bar::new(base, 8192) };
        bar.write64(REG_ASQ, 0x1234_5678_9abc_def0);
        assert_eq!(bar.read64(REG_ASQ), 0x1234_5678_9abc_def0);
        assert_eq!(bar.read32(REG_ASQ + 4), 0x1234_5678);
    }

    #[test]
    #[should_panic(expected = "outside BAR0")]
    fn bar_bounds() {
        let mut mem = vec![0u32; 4];
        let base = NonNull::new(mem.as_mut_ptr().cast::<u8>()).unwrap();
        // SAFETY: `mem` outlives `bar`.
        let bar = unsafe { Bar::new(base, 16) };
        bar.read32(16);
    }
}
