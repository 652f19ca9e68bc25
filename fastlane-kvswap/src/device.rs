//! The "device" block pool: where the inference engine keeps KV blocks while a sequence runs.
//!
//! [`DeviceMemory`] is the memory; [`HostDeviceMemory`] stands in for GPU memory with a
//! shared memfd mapping, [`SlabDeviceMemory`] does too but backs each client's slab with its
//! own memfd (the server hands a client only its slab's fd), and `cuda::CudaDeviceMemory`
//! (feature `cuda`) is real device memory. [`DeviceAllocator`] hands blocks to sequences and
//! is where in-flight pinning lives: a pinned block is neither free nor freeable.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use memmap2::{MmapOptions, MmapRaw};

use crate::error::KvSwapError;
use crate::{BlockId, SeqId};

/// Memory holding `blocks()` blocks of `block_bytes()` each.
pub trait DeviceMemory: Send + Sync + std::fmt::Debug {
    /// Bytes per block.
    fn block_bytes(&self) -> usize;
    /// Number of blocks.
    fn blocks(&self) -> u32;
    /// Address of a block when the memory is host-addressable (then workers copy and do I/O
    /// straight from it); `None` for GPU memory (workers stage through host buffers).
    fn block_ptr(&self, block: BlockId) -> Option<*mut u8>;
    /// Copies block `block` into `dst` (for memory that is not host-addressable; the default
    /// copies from [`block_ptr`](Self::block_ptr)).
    ///
    /// # Safety
    ///
    /// `dst..dst+block_bytes()` is writable, and no transfer writes the block meanwhile.
    unsafe fn read_block(&self, block: BlockId, dst: *mut u8) -> Result<(), KvSwapError> {
        let src = self
            .block_ptr(block)
            .ok_or(KvSwapError::BadConfig { detail: format!("block {block} outside the pool") })?;
        // SAFETY: block_ptr gives a block inside the memory; the caller guarantees dst and
        // exclusivity.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, self.block_bytes()) };
        Ok(())
    }
    /// Copies `src` into block `block` (the default copies to [`block_ptr`](Self::block_ptr)).
    ///
    /// # Safety
    ///
    /// `src..src+block_bytes()` is readable, and nobody reads or writes the block meanwhile.
    unsafe fn write_block(&self, block: BlockId, src: *const u8) -> Result<(), KvSwapError> {
        let dst = self
            .block_ptr(block)
            .ok_or(KvSwapError::BadConfig { detail: format!("block {block} outside the pool") })?;
        // SAFETY: block_ptr gives a block inside the memory; the caller guarantees src and
        // exclusivity.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, self.block_bytes()) };
        Ok(())
    }
}

/// Host memory standing in for GPU memory: one `MAP_SHARED` mapping of a memfd, 2 MiB
/// aligned in practice and always page aligned (so O_DIRECT can use it directly).
#[derive(Debug)]
pub struct HostDeviceMemory {
    /// Unmapped when the last `Arc` drops: the engine holds one in every worker, so that is
    /// after every worker has exited and no transfer names the mapping.
    map: MmapRaw,
    block_bytes: usize,
    blocks: u32,
    fd: OwnedFd,
}

// SAFETY: the mapping is plain shared memory owned by this struct until drop; who may touch
// which block at a time is decided by `DeviceAllocator` and the engine's pinning.
unsafe impl Send for HostDeviceMemory {}
// SAFETY: as above; all access is through raw pointers.
unsafe impl Sync for HostDeviceMemory {}

impl HostDeviceMemory {
    /// Maps `blocks` blocks of `block_bytes` (a multiple of 4096) in a new memfd.
    pub fn new(block_bytes: usize, blocks: u32) -> Result<HostDeviceMemory, KvSwapError> {
        if block_bytes == 0 || !block_bytes.is_multiple_of(4096) || blocks == 0 {
            return Err(KvSwapError::BadConfig {
                detail: format!("device pool of {blocks} blocks of {block_bytes} bytes"),
            });
        }
        let len = block_bytes.checked_mul(blocks as usize).ok_or_else(|| {
            KvSwapError::BadConfig { detail: "device pool size overflows".to_string() }
        })?;
        // SAFETY: a NUL-terminated name; memfd_create has no memory preconditions.
        let raw = unsafe { libc::memfd_create(c"kvswap-device".as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(KvSwapError::setup("memfd_create", std::io::Error::last_os_error()));
        }
        // SAFETY: raw is a fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: fd is a valid memfd.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(KvSwapError::setup("ftruncate", std::io::Error::last_os_error()));
        }
        let map = MmapOptions::new()
            .len(len)
            .map_raw(&fd)
            .map_err(|e| KvSwapError::setup("mmap device pool", e))?;
        Ok(HostDeviceMemory { map, block_bytes, blocks, fd })
    }

    /// The memfd behind the pool (for a process that shares the whole pool, e.g. a bench).
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Size of the mapping in bytes.
    pub fn len_bytes(&self) -> usize {
        self.map.len()
    }

    /// Raw base address (tests and the bench fill blocks through it).
    pub fn base(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }
}

impl DeviceMemory for HostDeviceMemory {
    fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    fn blocks(&self) -> u32 {
        self.blocks
    }

    fn block_ptr(&self, block: BlockId) -> Option<*mut u8> {
        (block.0 < self.blocks)
            // SAFETY: block < blocks, so the offset stays inside the mapping.
            .then(|| unsafe { self.base().add(block.0 as usize * self.block_bytes) })
    }
}

/// Host memory standing in for GPU memory, carved into per-client slabs: one contiguous
/// address range in this process (so [`DeviceMemory::block_ptr`] is one addition and the data
/// path stays zero-copy), where each slab of blocks is backed by its own memfd mapped over
/// its part of the range with `MAP_FIXED`. A client is handed only its slab's memfd, so its
/// mapping holds its own blocks and nobody else's. Blocks outside every slab are private
/// anonymous memory of the server.
///
/// `fastlane kv serve` gives each connection one slab ([`SlabDeviceMemory::attach`] at
/// `HELLO`, [`SlabDeviceMemory::detach`] once the connection is gone and its blocks are idle).
#[derive(Debug)]
pub struct SlabDeviceMemory {
    base: std::ptr::NonNull<u8>,
    len: usize,
    block_bytes: usize,
    blocks: u32,
    /// Slabs handed out: `(first block, blocks)`, sorted by first block.
    slabs: std::sync::Mutex<Vec<(u32, u32)>>,
}

// SAFETY: the reservation is owned by this struct until drop; which block may be touched by
// whom is decided by the engine's allocator and pinning, and slabs are remapped only when
// their blocks are idle (the contract of `detach`).
unsafe impl Send for SlabDeviceMemory {}
// SAFETY: as above; block access is through raw pointers, the slab table behind a mutex.
unsafe impl Sync for SlabDeviceMemory {}

/// A range of blocks backed by one memfd (see [`SlabDeviceMemory`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slab {
    /// First block id.
    pub first: u32,
    /// Blocks in it.
    pub blocks: u32,
}

impl Slab {
    /// The block ids of the slab.
    pub fn range(&self) -> std::ops::Range<u32> {
        self.first..self.first + self.blocks
    }
}

impl SlabDeviceMemory {
    /// Reserves `blocks` blocks of `block_bytes` (a multiple of 4096), no slab attached.
    pub fn new(block_bytes: usize, blocks: u32) -> Result<SlabDeviceMemory, KvSwapError> {
        if block_bytes == 0 || !block_bytes.is_multiple_of(4096) || blocks == 0 {
            return Err(KvSwapError::BadConfig {
                detail: format!("device pool of {blocks} blocks of {block_bytes} bytes"),
            });
        }
        let len = block_bytes.checked_mul(blocks as usize).ok_or_else(|| {
            KvSwapError::BadConfig { detail: "device pool size overflows".to_string() }
        })?;
        // SAFETY: a fresh anonymous mapping at an address the kernel picks; no Rust object
        // refers to it yet.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(KvSwapError::setup("mmap device pool", std::io::Error::last_os_error()));
        }
        let base = std::ptr::NonNull::new(p.cast::<u8>()).ok_or_else(|| {
            KvSwapError::setup("mmap device pool", std::io::Error::other("null mapping"))
        })?;
        Ok(SlabDeviceMemory {
            base,
            len,
            block_bytes,
            blocks,
            slabs: std::sync::Mutex::new(Vec::new()),
        })
    }

    /// Size of the whole reservation in bytes.
    pub fn len_bytes(&self) -> usize {
        self.len
    }

    /// Blocks not in any slab.
    pub fn unattached_blocks(&self) -> u32 {
        let slabs = self.lock_slabs();
        self.blocks - slabs.iter().map(|s| s.1).sum::<u32>()
    }

    /// The slab table. Its lock is held only for table edits that cannot panic, so a
    /// poisoned lock still holds a consistent table.
    fn lock_slabs(&self) -> std::sync::MutexGuard<'_, Vec<(u32, u32)>> {
        self.slabs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes the first free run of `blocks` blocks, backs it with a new sealed memfd (it can
    /// neither shrink nor grow, so a client cannot make the server's accesses fault) mapped
    /// over that part of the pool, and returns the slab and the memfd to hand to its client.
    /// The slab starts zero-filled. `DeviceFull` when no free run is long enough.
    pub fn attach(&self, blocks: u32) -> Result<(Slab, OwnedFd), KvSwapError> {
        let mut slabs = self.lock_slabs();
        let mut at = 0u32;
        let mut found = None;
        let mut largest = 0u32;
        for (i, &(first, n)) in slabs.iter().chain([(self.blocks, 0)].iter()).enumerate() {
            let gap = first - at;
            largest = largest.max(gap);
            if found.is_none() && gap >= blocks && blocks > 0 {
                found = Some((i, at));
            }
            at = first + n;
        }
        let Some((i, first)) = found else {
            return Err(KvSwapError::DeviceFull { requested: blocks, free: largest });
        };
        let slab = Slab { first, blocks };
        let fd = self.map_slab(slab)?;
        slabs.insert(i, (first, blocks));
        Ok((slab, fd))
    }

    /// Start address of a slab that lies inside the pool.
    fn slab_addr(&self, slab: Slab) -> Result<*mut libc::c_void, KvSwapError> {
        if slab.first.checked_add(slab.blocks).is_none_or(|end| end > self.blocks) {
            return Err(KvSwapError::BadConfig { detail: format!("{slab:?} outside the pool") });
        }
        self.block_ptr(BlockId(slab.first))
            .map(|p| p.cast())
            .ok_or(KvSwapError::BadConfig { detail: format!("{slab:?} outside the pool") })
    }

    fn map_slab(&self, slab: Slab) -> Result<OwnedFd, KvSwapError> {
        let len = slab.blocks as usize * self.block_bytes;
        // SAFETY: a NUL-terminated name; memfd_create has no memory preconditions.
        let raw = unsafe {
            libc::memfd_create(c"kvswap-slab".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if raw < 0 {
            return Err(KvSwapError::setup("memfd_create", std::io::Error::last_os_error()));
        }
        // SAFETY: raw is a fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: fd is a valid memfd; ftruncate changes only its size.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(KvSwapError::setup("ftruncate", std::io::Error::last_os_error()));
        }
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: fd is a valid memfd created with MFD_ALLOW_SEALING; F_ADD_SEALS takes an int.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(KvSwapError::setup("seal memfd", std::io::Error::last_os_error()));
        }
        let addr = self.slab_addr(slab)?;
        // SAFETY: the target range lies inside our reservation (slab.first + slab.blocks <=
        // blocks, checked by `attach`), and it is in no slab: its blocks are owned by no
        // sequence, so no transfer and no Rust reference touches it while it is replaced.
        let p = unsafe {
            libc::mmap(
                addr,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(KvSwapError::setup("mmap slab", std::io::Error::last_os_error()));
        }
        Ok(fd)
    }

    /// Gives a slab back: its part of the pool becomes fresh private anonymous memory again
    /// (the slab's data is gone from this process; the memfd lives on only in mappings a
    /// client may still hold, which never see the pool again).
    ///
    /// # Safety
    ///
    /// `slab` came from [`SlabDeviceMemory::attach`] on this pool and was not detached yet,
    /// and none of its blocks is owned or pinned in the engine's allocator (no transfer
    /// reads or writes them, now or later, until they are handed out again).
    pub unsafe fn detach(&self, slab: Slab) -> Result<(), KvSwapError> {
        let mut slabs = self.lock_slabs();
        let Some(i) = slabs.iter().position(|s| *s == (slab.first, slab.blocks)) else {
            return Err(KvSwapError::BadConfig { detail: format!("{slab:?} is not attached") });
        };
        let addr = self.slab_addr(slab)?;
        // SAFETY: the range is inside the reservation (it was attached), and by the caller's
        // contract nothing reads or writes it while it is replaced.
        let p = unsafe {
            libc::mmap(
                addr,
                slab.blocks as usize * self.block_bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(KvSwapError::setup("unmap slab", std::io::Error::last_os_error()));
        }
        slabs.remove(i);
        Ok(())
    }
}

impl Drop for SlabDeviceMemory {
    fn drop(&mut self) {
        // SAFETY: base..base+len is our reservation; the engine and its workers hold Arcs of
        // this struct, so when it drops nothing names the memory any more.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

impl DeviceMemory for SlabDeviceMemory {
    fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    fn blocks(&self) -> u32 {
        self.blocks
    }

    fn block_ptr(&self, block: BlockId) -> Option<*mut u8> {
        (block.0 < self.blocks)
            // SAFETY: block < blocks, so the offset stays inside the reservation.
            .then(|| unsafe { self.base.as_ptr().add(block.0 as usize * self.block_bytes) })
    }
}

const FREE: u64 = u64::MAX;

/// Hands device blocks to sequences. A block is free, owned by one sequence, or owned and
/// pinned (a transfer reads or writes it). Pinned blocks cannot be freed, so they cannot be
/// handed to another sequence until the transfer that pins them completes.
#[derive(Debug)]
pub struct DeviceAllocator {
    owner: Vec<u64>,
    pins: Vec<u32>,
    free: Vec<u32>,
}

impl DeviceAllocator {
    /// All `blocks` free.
    pub fn new(blocks: u32) -> DeviceAllocator {
        DeviceAllocator {
            owner: vec![FREE; blocks as usize],
            pins: vec![0; blocks as usize],
            free: (0..blocks).rev().collect(),
        }
    }

    /// Free blocks.
    pub fn free_count(&self) -> u32 {
        self.free.len() as u32
    }

    /// Blocks pinned by transfers in flight.
    pub fn pinned_count(&self) -> u32 {
        self.pins.iter().filter(|p| **p > 0).count() as u32
    }

    /// Total blocks.
    pub fn total(&self) -> u32 {
        self.owner.len() as u32
    }

    /// Owner of a block.
    pub fn owner(&self, block: BlockId) -> Option<SeqId> {
        match self.owner.get(block.0 as usize) {
            Some(&o) if o != FREE => Some(SeqId(o)),
            _ => None,
        }
    }

    /// Whether a block is pinned.
    pub fn is_pinned(&self, block: BlockId) -> bool {
        self.pins.get(block.0 as usize).is_some_and(|p| *p > 0)
    }

    /// Takes `n` free blocks for `seq`, appending them to `out`. All or nothing.
    pub fn alloc(&mut self, seq: SeqId, n: u32, out: &mut Vec<BlockId>) -> Result<(), KvSwapError> {
        if n as usize > self.free.len() {
            return Err(KvSwapError::DeviceFull { requested: n, free: self.free.len() as u32 });
        }
        for _ in 0..n {
            let b = self.free.pop().expect("checked above");
            debug_assert_eq!(self.owner[b as usize], FREE);
            debug_assert_eq!(self.pins[b as usize], 0);
            self.owner[b as usize] = seq.0;
            out.push(BlockId(b));
        }
        Ok(())
    }

    /// Takes `n` free blocks for `seq` from the block ids in `range` only (a client's slab),
    /// appending them to `out`. All or nothing. Costs a scan of the range and of the free
    /// list: a control-path call, not a per-token one.
    pub fn alloc_in(
        &mut self,
        seq: SeqId,
        n: u32,
        range: std::ops::Range<u32>,
        out: &mut Vec<BlockId>,
    ) -> Result<(), KvSwapError> {
        let end = range.end.min(self.total());
        let start = range.start.min(end);
        let free_here = (start..end).filter(|b| self.owner[*b as usize] == FREE).count() as u32;
        if n > free_here {
            return Err(KvSwapError::DeviceFull { requested: n, free: free_here });
        }
        let mut taken = 0;
        for b in start..end {
            if taken == n {
                break;
            }
            if self.owner[b as usize] == FREE {
                debug_assert_eq!(self.pins[b as usize], 0);
                self.owner[b as usize] = seq.0;
                out.push(BlockId(b));
                taken += 1;
            }
        }
        let owner = &self.owner;
        self.free.retain(|f| owner[*f as usize] == FREE);
        Ok(())
    }

    /// Whether every block in `range` is free and unpinned.
    pub fn range_idle(&self, range: std::ops::Range<u32>) -> bool {
        range.into_iter().all(|b| {
            self.owner.get(b as usize) == Some(&FREE) && self.pins.get(b as usize) == Some(&0)
        })
    }

    /// Gives the named free blocks to `seq` (for an owner that runs its own block manager
    /// over the pool and hands the engine only what a transfer touches). All or nothing:
    /// refused when a block is outside the pool, not free, or named twice.
    pub fn adopt(&mut self, seq: SeqId, blocks: &[BlockId]) -> Result<(), KvSwapError> {
        for (i, b) in blocks.iter().enumerate() {
            match self.owner.get(b.0 as usize) {
                None => {
                    return Err(KvSwapError::BadConfig {
                        detail: format!("block {b} outside the pool of {}", self.owner.len()),
                    })
                }
                Some(&o) if o != FREE => return Err(KvSwapError::BlockNotOwned { block: *b, seq }),
                Some(_) => {}
            }
            if blocks[..i].contains(b) {
                return Err(KvSwapError::DuplicateBlock { block: *b });
            }
        }
        for b in blocks {
            self.owner[b.0 as usize] = seq.0;
        }
        self.free.retain(|f| self.owner[*f as usize] == FREE);
        Ok(())
    }

    /// Checks that every block exists, belongs to `seq`, and appears once.
    pub fn check_owned(&self, seq: SeqId, blocks: &[BlockId]) -> Result<(), KvSwapError> {
        for (i, b) in blocks.iter().enumerate() {
            if self.owner(*b) != Some(seq) {
                return Err(KvSwapError::BlockNotOwned { block: *b, seq });
            }
            // Quadratic only for tiny lists; larger ones use the pin counts as marks below.
            if blocks.len() <= 16 && blocks[..i].contains(b) {
                return Err(KvSwapError::DuplicateBlock { block: *b });
            }
        }
        if blocks.len() > 16 {
            let mut seen = std::collections::HashSet::with_capacity(blocks.len());
            for b in blocks {
                if !seen.insert(b.0) {
                    return Err(KvSwapError::DuplicateBlock { block: *b });
                }
            }
        }
        Ok(())
    }

    /// Frees blocks of `seq`. Refused, with nothing freed, when one is pinned or not `seq`'s.
    pub fn free(&mut self, seq: SeqId, blocks: &[BlockId]) -> Result<(), KvSwapError> {
        self.check_owned(seq, blocks)?;
        if let Some(b) = blocks.iter().find(|b| self.is_pinned(**b)) {
            return Err(KvSwapError::BlockPinned { block: *b, seq });
        }
        for b in blocks {
            self.owner[b.0 as usize] = FREE;
            self.free.push(b.0);
        }
        Ok(())
    }

    /// Frees every unpinned block of `seq`; returns how many stay (pinned).
    pub(crate) fn free_all_unpinned(&mut self, seq: SeqId) -> u32 {
        let mut left = 0;
        for b in 0..self.owner.len() {
            if self.owner[b] == seq.0 {
                if self.pins[b] > 0 {
                    left += 1;
                } else {
                    self.owner[b] = FREE;
                    self.free.push(b as u32);
                }
            }
        }
        left
    }

    pub(crate) fn pin(&mut self, blocks: &[BlockId]) {
        for b in blocks {
            self.pins[b.0 as usize] += 1;
        }
    }

    pub(crate) fn unpin(&mut self, blocks: &[BlockId]) {
        for b in blocks {
            let p = &mut self.pins[b.0 as usize];
            assert!(*p > 0, "unpin of unpinned block {b}");
            *p -= 1;
        }
    }
}

#[cfg(feature = "cuda")]
pub mod cuda {
    //! Device memory on a CUDA GPU (driver API through cudarc, loaded at run time).

    use std::sync::{Arc, Mutex};

    use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};

    use super::DeviceMemory;
    use crate::error::KvSwapError;
    use crate::BlockId;

    /// `blocks` blocks of `block_bytes` in one device allocation. Workers stage through
    /// their own host buffers: `block_ptr` is `None`.
    pub struct CudaDeviceMemory {
        stream: Arc<CudaStream>,
        slab: Mutex<CudaSlice<u8>>,
        block_bytes: usize,
        blocks: u32,
    }

    impl std::fmt::Debug for CudaDeviceMemory {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("CudaDeviceMemory")
                .field("block_bytes", &self.block_bytes)
                .field("blocks", &self.blocks)
                .finish()
        }
    }

    impl CudaDeviceMemory {
        /// Allocates the pool on GPU `ordinal`.
        pub fn new(ordinal: usize, block_bytes: usize, blocks: u32) -> Result<Self, KvSwapError> {
            let ctx = CudaContext::new(ordinal).map_err(|e| KvSwapError::setup("cuda init", e))?;
            let stream = ctx.default_stream();
            let slab = stream
                .alloc_zeros::<u8>(block_bytes * blocks as usize)
                .map_err(|e| KvSwapError::setup("cuda alloc", e))?;
            Ok(CudaDeviceMemory { stream, slab: Mutex::new(slab), block_bytes, blocks })
        }

        /// Device address of the pool (for the inference engine's kernels).
        pub fn device_ptr(&self) -> u64 {
            let slab = self.slab.lock().expect("cuda slab lock");
            let (p, _sync) = slab.device_ptr(&self.stream);
            p
        }
    }

    impl DeviceMemory for CudaDeviceMemory {
        fn block_bytes(&self) -> usize {
            self.block_bytes
        }

        fn blocks(&self) -> u32 {
            self.blocks
        }

        fn block_ptr(&self, _block: BlockId) -> Option<*mut u8> {
            None
        }

        unsafe fn read_block(&self, block: BlockId, dst: *mut u8) -> Result<(), KvSwapError> {
            let start = block.0 as usize * self.block_bytes;
            let slab = self.slab.lock().expect("cuda slab lock");
            let view = slab.slice(start..start + self.block_bytes);
            // SAFETY: the caller guarantees dst..dst+block_bytes is writable and unshared.
            let out = unsafe { std::slice::from_raw_parts_mut(dst, self.block_bytes) };
            self.stream.memcpy_dtoh(&view, out).map_err(|e| KvSwapError::setup("cuda dtoh", e))?;
            self.stream.synchronize().map_err(|e| KvSwapError::setup("cuda sync", e))
        }

        unsafe fn write_block(&self, block: BlockId, src: *const u8) -> Result<(), KvSwapError> {
            let start = block.0 as usize * self.block_bytes;
            let mut slab = self.slab.lock().expect("cuda slab lock");
            let mut view = slab.slice_mut(start..start + self.block_bytes);
            // SAFETY: the caller guarantees src..src+block_bytes is readable.
            let inp = unsafe { std::slice::from_raw_parts(src, self.block_bytes) };
            self.stream
                .memcpy_htod(inp, &mut view)
                .map_err(|e| KvSwapError::setup("cuda htod", e))?;
            self.stream.synchronize().map_err(|e| KvSwapError::setup("cuda sync", e))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinned_blocks_cannot_be_freed_or_reallocated() {
        let mut a = DeviceAllocator::new(4);
        let mut blocks = Vec::new();
        a.alloc(SeqId(1), 2, &mut blocks).unwrap();
        a.pin(&blocks);
        assert!(matches!(a.free(SeqId(1), &blocks), Err(KvSwapError::BlockPinned { .. })));
        let mut other = Vec::new();
        a.alloc(SeqId(2), 2, &mut other).unwrap();
        assert!(other.iter().all(|b| !blocks.contains(b)));
        assert!(a.alloc(SeqId(3), 1, &mut Vec::new()).is_err());
        assert!(matches!(a.free(SeqId(2), &blocks), Err(KvSwapError::BlockNotOwned { .. })));
        a.unpin(&blocks);
        a.free(SeqId(1), &blocks).unwrap();
        assert_eq!(a.free_count(), 2);
    }

    #[test]
    fn alloc_in_stays_inside_its_range() {
        let mut a = DeviceAllocator::new(8);
        let mut got = Vec::new();
        a.alloc_in(SeqId(1), 3, 2..5, &mut got).unwrap();
        assert_eq!(got, [BlockId(2), BlockId(3), BlockId(4)]);
        assert!(matches!(
            a.alloc_in(SeqId(2), 1, 2..5, &mut Vec::new()),
            Err(KvSwapError::DeviceFull { requested: 1, free: 0 })
        ));
        assert!(!a.range_idle(2..5) && a.range_idle(5..8));
        let mut rest = Vec::new();
        a.alloc(SeqId(3), 5, &mut rest).unwrap();
        assert!(rest.iter().all(|b| !got.contains(b)), "global alloc reused slab blocks");
        a.free(SeqId(1), &got).unwrap();
        assert!(a.range_idle(2..5));
    }

    #[test]
    fn slabs_are_separate_memfds_and_detach_clears_them() {
        let bb = 4096;
        let m = SlabDeviceMemory::new(bb, 8).unwrap();
        let (a, fa) = m.attach(3).unwrap();
        let (b, fb) = m.attach(3).unwrap();
        assert_eq!((a.range(), b.range()), (0..3, 3..6));
        assert!(matches!(m.attach(3), Err(KvSwapError::DeviceFull { requested: 3, free: 2 })));
        let map_a = MmapOptions::new().len(3 * bb).map_raw(&fa).unwrap();
        let map_b = MmapOptions::new().len(3 * bb).map_raw(&fb).unwrap();
        // SAFETY: block 1 is inside the pool and the test is its only user.
        unsafe { m.block_ptr(BlockId(1)).unwrap().write_bytes(0xa5, bb) };
        // SAFETY: the mapping is 3 blocks long and only read here.
        let ra = unsafe { std::slice::from_raw_parts(map_a.as_ptr(), 3 * bb) };
        // SAFETY: as above.
        let rb = unsafe { std::slice::from_raw_parts(map_b.as_ptr(), 3 * bb) };
        assert!(ra[bb..2 * bb].iter().all(|x| *x == 0xa5), "slab memfd is not the pool memory");
        assert!(rb.iter().all(|x| *x == 0), "another slab sees the write");
        // Sealed: a client cannot shrink the memfd under the server.
        // SAFETY: ftruncate on our own fd.
        assert_ne!(unsafe { libc::ftruncate(fa.as_raw_fd(), 0) }, 0);
        // SAFETY: nothing owns or pins the slab's blocks in this test.
        unsafe { m.detach(a).unwrap() };
        // SAFETY: block 1 is inside the pool; the test is its only user.
        let first = unsafe { *m.block_ptr(BlockId(1)).unwrap() };
        assert_eq!(first, 0, "the pool still shows the detached slab's data");
        let (c, fc) = m.attach(2).unwrap();
        assert_eq!(c.range(), 0..2);
        let map_c = MmapOptions::new().len(2 * bb).map_raw(&fc).unwrap();
        // SAFETY: the mapping is 2 blocks long and only read here.
        let rc = unsafe { std::slice::from_raw_parts(map_c.as_ptr(), 2 * bb) };
        assert!(rc.iter().all(|x| *x == 0), "a new slab shows an old client's data");
        assert_eq!(m.unattached_blocks(), 3);
    }

    #[test]
    fn adopt_takes_exactly_the_named_free_blocks() {
        let mut a = DeviceAllocator::new(6);
        a.adopt(SeqId(1), &[BlockId(4), BlockId(1)]).unwrap();
        assert_eq!(a.free_count(), 4);
        assert_eq!(a.owner(BlockId(4)), Some(SeqId(1)));
        // Taken, duplicated or outside the pool: refused, nothing taken.
        assert!(a.adopt(SeqId(2), &[BlockId(0), BlockId(1)]).is_err());
        assert!(a.adopt(SeqId(2), &[BlockId(0), BlockId(0)]).is_err());
        assert!(a.adopt(SeqId(2), &[BlockId(9)]).is_err());
        assert_eq!(a.free_count(), 4);
        let mut got = Vec::new();
        a.alloc(SeqId(3), 4, &mut got).unwrap();
        assert!(!got.contains(&BlockId(4)) && !got.contains(&BlockId(1)));
        a.free(SeqId(1), &[BlockId(4), BlockId(1)]).unwrap();
        assert_eq!(a.free_count(), 2);
    }
}
