//! [`RegisteredBuffer`]: the safe owner of memory plus its registration.

use std::fmt;
use std::ptr;

use memmap2::{MmapOptions, MmapRaw};

use crate::error::{RdmaError, Result};
use crate::verbs::{Access, MemoryRegion, ProtectionDomain, Sge};

/// Page-aligned anonymous memory, unmapped on drop: after every registration of it, as owners
/// declare the MemoryRegion field before the Mapping field.
pub(crate) struct Mapping {
    map: MmapRaw,
}

// SAFETY: plain memory; all access goes through raw pointers with explicit bounds checks.
unsafe impl Send for Mapping {}
// SAFETY: as above; concurrent writers race only on bytes, never on Rust references.
unsafe impl Sync for Mapping {}

impl Mapping {
    pub(crate) fn new(len: usize) -> Result<Self> {
        if len == 0 {
            return Err(RdmaError::InvalidArgument { op: "mmap", detail: "zero length".into() });
        }
        let map = MmapOptions::new()
            .len(len)
            .map_anon()
            .map_err(|source| RdmaError::Verbs { op: "mmap", source })?;
        Ok(Mapping { map: map.into() })
    }

    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    fn check(&self, offset: usize, len: usize, op: &'static str) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(()),
            _ => Err(RdmaError::InvalidArgument {
                op,
                detail: format!("local offset {offset} + len {len} past {} bytes", self.len()),
            }),
        }
    }

    pub(crate) fn write_at(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.check(offset, data.len(), "write_at")?;
        // SAFETY: bounds checked above; the mapping lives as long as `self`; the device may
        // read these bytes concurrently, which is why no `&mut [u8]` is ever made of them.
        unsafe {
            ptr::copy_nonoverlapping(data.as_ptr(), self.as_ptr().wrapping_add(offset), data.len())
        };
        Ok(())
    }

    pub(crate) fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.check(offset, out.len(), "read_at")?;
        // SAFETY: bounds checked above; the device may write these bytes concurrently (a
        // torn copy is the caller's protocol concern, not undefined behaviour on a raw copy).
        unsafe {
            ptr::copy_nonoverlapping(
                self.as_ptr().wrapping_add(offset),
                out.as_mut_ptr(),
                out.len(),
            )
        };
        Ok(())
    }

    pub(crate) fn read_volatile_u8(&self, offset: usize) -> Result<u8> {
        self.check(offset, 1, "read_volatile_u8")?;
        // SAFETY: in bounds; volatile because a peer's RDMA WRITE changes it behind our back.
        Ok(unsafe { ptr::read_volatile(self.as_ptr().wrapping_add(offset)) })
    }

    pub(crate) fn write_volatile_u8(&self, offset: usize, v: u8) -> Result<()> {
        self.check(offset, 1, "write_volatile_u8")?;
        // SAFETY: in bounds; volatile to pair with a poller reading it the same way.
        unsafe { ptr::write_volatile(self.as_ptr().wrapping_add(offset), v) };
        Ok(())
    }
}

/// Memory registered with a device, owned together with its registration.
///
/// The registration is dropped (deregistered) before the memory is unmapped, so a peer
/// holding the rkey can never reach freed memory. Work requests naming the buffer are the
/// poster's concern: the safe [`crate::Connection`] owns its buffer and destroys its queue
/// pair before it, which covers its own requests.
pub struct RegisteredBuffer {
    // Field order is drop order: deregister, then unmap.
    mr: MemoryRegion,
    map: Mapping,
}

impl fmt::Debug for RegisteredBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegisteredBuffer").field("mr", &self.mr).finish()
    }
}

impl RegisteredBuffer {
    /// Maps `len` bytes (rounded up to whole pages by the kernel) and registers them.
    pub fn new(pd: &ProtectionDomain, len: usize, access: Access) -> Result<Self> {
        let map = Mapping::new(len)?;
        // SAFETY: the memory is owned by `map`, which is stored next to the registration and
        // dropped after it (field order), so it outlives the registration; requests posted on
        // it are covered by the poster's own contract (`QueuePair::post_send`).
        let mr = unsafe { MemoryRegion::register(pd, map.as_ptr(), map.len(), access)? };
        Ok(RegisteredBuffer { mr, map })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Always false.
    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    /// Start address (what a peer uses as the remote address).
    pub fn addr(&self) -> u64 {
        self.map.as_ptr() as u64
    }

    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.mr.lkey()
    }

    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.mr.rkey()
    }

    /// Scatter/gather entry for `offset..offset + len`.
    pub fn sge(&self, offset: usize, len: usize) -> Result<Sge> {
        self.map.check(offset, len, "sge")?;
        let len = u32::try_from(len).map_err(|_| RdmaError::InvalidArgument {
            op: "sge",
            detail: format!("length {len} over 4 GiB"),
        })?;
        Ok(Sge { addr: self.addr() + offset as u64, len, lkey: self.lkey() })
    }

    /// Copies `data` into the buffer at `offset`.
    pub fn write_at(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.map.write_at(offset, data)
    }

    /// Copies from the buffer at `offset` into `out`.
    pub fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.map.read_at(offset, out)
    }

    /// Reads one byte the way a poller must (a peer may WRITE it at any time).
    pub fn read_volatile_u8(&self, offset: usize) -> Result<u8> {
        self.map.read_volatile_u8(offset)
    }

    /// Writes one byte with a volatile store.
    pub fn write_volatile_u8(&self, offset: usize, v: u8) -> Result<()> {
        self.map.write_volatile_u8(offset, v)
    }
}
