//! The vhost-user in-flight region (QEMU `docs/interop/vhost-user.rst`, "Inflight I/O
//! tracking", split virtqueues): shared memory the frontend keeps across a backend's death, in
//! which the backend marks every request it has taken from the avail ring and not yet put on
//! the used ring. A backend that starts on a region that is not fresh resubmits exactly those
//! requests, in the order it first took them, and none that completed.
//!
//! Layout, one region per virtqueue, each [`queue_region_bytes`] long (64-byte aligned):
//!
//! ```text
//! offset  size  field
//!      0     8  features         (0: no feature of the region is used)
//!      8     2  version          (0: fresh, never used; 1: in use)
//!     10     2  desc_num         (= queue size)
//!     12     2  last_batch_head  (head whose used entry is being written)
//!     14     2  used_idx         (the used ring's idx after the last completed put)
//!     16  16*n  desc[n]: inflight u8, padding [u8; 5], next u16, counter u64
//! ```
//!
//! The protocol, per request (`desc[head]`): taken from the avail ring → `counter` = the
//! queue's submission counter, `inflight` = 1 (before the backend sees the request); completed
//! → `last_batch_head` = head, the used entry and the used idx are written (one entry at a
//! time), then `inflight` = 0 and `used_idx` = the used idx. A crash between the used idx and
//! the clear leaves `used_idx` behind the ring's idx: recovery clears `last_batch_head`, whose
//! completion the guest already has ("torn completion"). Every request taken is in flight or
//! used, so after recovery the avail position is `used idx + in-flight count`.
//!
//! The region's memory is shared with the frontend and written by no one else while a backend
//! runs; it is only ever touched through raw pointers with volatile accesses, never through
//! references. What the frontend hands us (sizes, version, desc_num, heads, counters) is
//! validated before use: a bad region is refused at `SET_INFLIGHT_FD` or, per queue, at start.

use std::fs::File;
use std::os::fd::{AsRawFd as _, FromRawFd as _};
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;

use memmap2::{MmapOptions, MmapRaw};

/// Bytes of a queue region's header (features, version, desc_num, last_batch_head, used_idx).
pub const QUEUE_HEADER_BYTES: u64 = 16;
/// Bytes of one descriptor state entry.
pub const DESC_STATE_BYTES: u64 = 16;
/// Queue regions start on this boundary.
pub const QUEUE_ALIGN: u64 = 64;
/// The region version this backend writes and reads.
pub const VERSION: u16 = 1;
/// Largest split virtqueue (VIRTIO 1.2 §2.7: queue size ≤ 32768).
pub const QUEUE_SIZE_MAX: u16 = 32768;

const OFF_VERSION: usize = 8;
const OFF_DESC_NUM: usize = 10;
const OFF_LAST_BATCH_HEAD: usize = 12;
const OFF_USED_IDX: usize = 14;
const DESC_OFF_INFLIGHT: usize = 0;
const DESC_OFF_COUNTER: usize = 8;

/// Why a region, or one queue of it, is not used.
#[derive(Debug, thiserror::Error)]
pub enum InflightError {
    /// Queue count or size out of range.
    #[error("{num_queues} queue(s) of size {queue_size}: need 1..=64 queues of a power-of-two size up to 32768")]
    Geometry {
        /// Queues named.
        num_queues: u16,
        /// Queue size named.
        queue_size: u16,
    },
    /// The mapping the frontend described is too small, misaligned or past the file's end.
    #[error("region of {mmap_size} bytes at offset {mmap_offset}: {reason}")]
    Mapping {
        /// Its size.
        mmap_size: u64,
        /// Its offset in the file.
        mmap_offset: u64,
        /// What is wrong.
        reason: &'static str,
    },
    /// A queue's header does not describe this layout.
    #[error("queue {queue}: version {version}, desc_num {desc_num} (expected version 0 or {VERSION}, desc_num {expected})")]
    Header {
        /// Queue index.
        queue: u16,
        /// Version found.
        version: u16,
        /// desc_num found.
        desc_num: u16,
        /// desc_num expected (the region's queue size).
        expected: u16,
    },
    /// A descriptor's in-flight flag is neither 0 nor 1: not a region this protocol wrote.
    #[error("queue {queue}: head {head} has in-flight flag {value} (0 or 1 expected)")]
    BadFlag {
        /// Queue index.
        queue: u16,
        /// The head.
        head: u16,
        /// The flag found.
        value: u8,
    },
    /// The vring is larger than the region's queue.
    #[error(
        "queue {queue}: vring of size {vring_size} is larger than the region's {desc_num} entries"
    )]
    VringTooLarge {
        /// Queue index.
        queue: u16,
        /// The vring's size.
        vring_size: u16,
        /// The region's entries.
        desc_num: u16,
    },
    /// A system call failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
}

/// Bytes of one queue's region for a queue of `queue_size` entries.
pub const fn queue_region_bytes(queue_size: u16) -> u64 {
    let raw = QUEUE_HEADER_BYTES + DESC_STATE_BYTES * queue_size as u64;
    raw.div_ceil(QUEUE_ALIGN) * QUEUE_ALIGN
}

fn check_geometry(num_queues: u16, queue_size: u16) -> Result<(), InflightError> {
    if num_queues == 0 || num_queues > 64 || !queue_size.is_power_of_two() {
        return Err(InflightError::Geometry { num_queues, queue_size });
    }
    Ok(())
}

/// A mapped in-flight region: `num_queues` queue regions of `queue_size` entries.
#[derive(Debug)]
pub struct InflightRegion {
    map: MmapRaw,
    num_queues: u16,
    queue_size: u16,
    /// Some queue was in use when the region was handed to us: a backend ran on it before.
    reused: bool,
}

// SAFETY:
// - Send and Sync: the mapping is plain shared memory; every access goes through raw pointers
//   with volatile reads and writes, and each queue's part is written by one worker at a time
//   (the device hands a queue's view to that queue's worker only).
unsafe impl Send for InflightRegion {}
// SAFETY: as above.
unsafe impl Sync for InflightRegion {}

/// What `GET_INFLIGHT_FD` answers: the new region's file and its description.
#[derive(Debug)]
pub struct NewRegion {
    /// A sealed memfd holding the zeroed region (desc_num set per queue).
    pub file: File,
    /// Its size.
    pub mmap_size: u64,
    /// Always 0.
    pub mmap_offset: u64,
}

fn io_err(what: &'static str, e: std::io::Error) -> InflightError {
    InflightError::Io { what, source: e }
}

impl InflightRegion {
    /// `GET_INFLIGHT_FD`: a new zeroed region in a sealed memfd (it can neither grow nor
    /// shrink, so a mapping of it can never fault past the end), with each queue's `desc_num`
    /// set to `queue_size` and `version` 0 (fresh).
    pub fn create(num_queues: u16, queue_size: u16) -> Result<NewRegion, InflightError> {
        check_geometry(num_queues, queue_size)?;
        let size = u64::from(num_queues) * queue_region_bytes(queue_size);
        // SAFETY:
        // - the name is a valid NUL-terminated C string; memfd_create only reads it.
        let fd = unsafe {
            libc::memfd_create(
                c"fastlane-vhost-blk-inflight".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if fd < 0 {
            return Err(io_err("memfd_create", std::io::Error::last_os_error()));
        }
        // SAFETY:
        // - `fd` was just created by memfd_create and is owned by nothing else.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(size).map_err(|e| io_err("ftruncate", e))?;
        let seals = libc::F_SEAL_GROW | libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL;
        // SAFETY:
        // - F_ADD_SEALS on our own memfd, which allows sealing; it only changes its seals.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(io_err("F_ADD_SEALS", std::io::Error::last_os_error()));
        }
        let region = Self::map(&file, size, 0, num_queues, queue_size)?;
        for q in 0..num_queues {
            region.write_u16(q, OFF_DESC_NUM, queue_size);
        }
        Ok(NewRegion { file, mmap_size: size, mmap_offset: 0 })
    }

    /// `SET_INFLIGHT_FD`: map what the frontend sent and check every queue's header. A region
    /// whose sizes do not fit the layout, or a queue whose version or desc_num is not ours, is
    /// refused as a whole (nothing is resubmitted from a region we cannot read).
    pub fn adopt(
        file: &File,
        mmap_size: u64,
        mmap_offset: u64,
        num_queues: u16,
        queue_size: u16,
    ) -> Result<Arc<InflightRegion>, InflightError> {
        check_geometry(num_queues, queue_size)?;
        let needed = u64::from(num_queues) * queue_region_bytes(queue_size);
        let bad = |reason| InflightError::Mapping { mmap_size, mmap_offset, reason };
        if mmap_size < needed {
            return Err(bad("smaller than the queues it names"));
        }
        if !mmap_offset.is_multiple_of(4096) {
            return Err(bad("offset not page-aligned"));
        }
        let len = file.metadata().map_err(|e| io_err("fstat of the region", e))?.len();
        if mmap_offset.checked_add(needed).is_none_or(|end| end > len) {
            return Err(bad("past the end of its file"));
        }
        let mut region = Self::map(file, needed, mmap_offset, num_queues, queue_size)?;
        for q in 0..num_queues {
            let version = region.read_u16(q, OFF_VERSION);
            region.reused |= version == VERSION;
            let desc_num = region.read_u16(q, OFF_DESC_NUM);
            let fresh = version == 0 && (desc_num == 0 || desc_num == queue_size);
            if !(fresh || version == VERSION && desc_num == queue_size) {
                return Err(InflightError::Header {
                    queue: q,
                    version,
                    desc_num,
                    expected: queue_size,
                });
            }
            if desc_num == 0 {
                region.write_u16(q, OFF_DESC_NUM, queue_size);
            }
            if version == VERSION {
                region.check_flags(q, queue_size)?;
            }
        }
        Ok(Arc::new(region))
    }

    fn map(
        file: &File,
        len: u64,
        offset: u64,
        num_queues: u16,
        queue_size: u16,
    ) -> Result<InflightRegion, InflightError> {
        let map = MmapOptions::new()
            .offset(offset)
            .len(usize::try_from(len).map_err(|_| InflightError::Mapping {
                mmap_size: len,
                mmap_offset: offset,
                reason: "larger than the address space",
            })?)
            .map_raw(file)
            .map_err(|e| io_err("mmap of the region", e))?;
        Ok(InflightRegion { map, num_queues, queue_size, reused: false })
    }

    /// Every flag of queue `q`'s first `n` entries is 0 or 1.
    fn check_flags(&self, q: u16, n: u16) -> Result<(), InflightError> {
        for head in 0..n {
            let off = QUEUE_HEADER_BYTES as usize + usize::from(head) * 16 + DESC_OFF_INFLIGHT;
            // SAFETY: `head` < n ≤ queue_size: the entry is inside queue `q`'s region.
            let value = unsafe { std::ptr::read_volatile(self.at(q, off)) };
            if value > 1 {
                return Err(InflightError::BadFlag { queue: q, head, value });
            }
        }
        Ok(())
    }

    /// Whether a backend used the region before it was handed to us (a restart).
    pub fn reused(&self) -> bool {
        self.reused
    }

    /// Queues in the region.
    pub fn num_queues(&self) -> u16 {
        self.num_queues
    }

    /// Entries per queue.
    pub fn queue_size(&self) -> u16 {
        self.queue_size
    }

    /// Pointer to byte `off` of queue `q`'s region.
    fn at(&self, q: u16, off: usize) -> *mut u8 {
        debug_assert!(q < self.num_queues);
        let base = usize::from(q) * queue_region_bytes(self.queue_size) as usize;
        debug_assert!(base + off < self.map.len());
        // SAFETY:
        // - `q` < num_queues and `off` < the queue's region (callers index desc entries below
        //   desc_num = queue_size), so the result stays inside the mapping.
        unsafe { self.map.as_mut_ptr().add(base + off) }
    }

    fn read_u16(&self, q: u16, off: usize) -> u16 {
        // SAFETY:
        // - in bounds (see `at`), and aligned: every u16 field sits at an even offset of a
        //   queue region, and queue regions start 64-byte aligned in a page-aligned mapping.
        u16::from_le(unsafe { std::ptr::read_volatile(self.at(q, off).cast::<u16>()) })
    }

    fn write_u16(&self, q: u16, off: usize, v: u16) {
        // SAFETY: as in `read_u16`.
        unsafe { std::ptr::write_volatile(self.at(q, off).cast::<u16>(), v.to_le()) }
    }

    /// The view of queue `q` for its worker, for a vring of `vring_size` entries.
    pub fn queue(
        self: &Arc<Self>,
        q: u16,
        vring_size: u16,
    ) -> Result<InflightQueue, InflightError> {
        if q >= self.num_queues {
            return Err(InflightError::Geometry { num_queues: self.num_queues, queue_size: q });
        }
        if vring_size > self.queue_size || vring_size == 0 {
            return Err(InflightError::VringTooLarge {
                queue: q,
                vring_size,
                desc_num: self.queue_size,
            });
        }
        Ok(InflightQueue { region: self.clone(), queue: q, vring_size, counter: 0 })
    }
}

/// What recovery found in a queue's region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovery {
    /// The region was fresh: nothing was ever in flight.
    pub fresh: bool,
    /// A completion was torn (its used entry published, its mark not cleared) and repaired.
    pub torn_repaired: bool,
    /// Heads to resubmit, in the order they were first taken.
    pub resubmit: Vec<u16>,
    /// Where the avail ring resumes: the used idx plus the requests in flight.
    pub next_avail: u16,
}

/// One queue's part of the region, owned by that queue's worker.
#[derive(Debug)]
pub struct InflightQueue {
    region: Arc<InflightRegion>,
    queue: u16,
    vring_size: u16,
    /// The next submission counter.
    counter: u64,
}

impl InflightQueue {
    fn desc(&self, head: u16, off: usize) -> *mut u8 {
        debug_assert!(head < self.vring_size);
        self.region.at(self.queue, QUEUE_HEADER_BYTES as usize + usize::from(head) * 16 + off)
    }

    fn inflight(&self, head: u16) -> u8 {
        // SAFETY: `head` < vring_size ≤ desc_num (checked in `queue` and by callers), so the
        // entry is inside the mapping.
        unsafe { std::ptr::read_volatile(self.desc(head, DESC_OFF_INFLIGHT)) }
    }

    fn set_inflight(&self, head: u16, v: u8) {
        // SAFETY: as in `inflight`.
        unsafe { std::ptr::write_volatile(self.desc(head, DESC_OFF_INFLIGHT), v) }
    }

    fn counter_of(&self, head: u16) -> u64 {
        // SAFETY: as in `inflight`; the counter is at offset 8 of a 16-byte entry of a 64-byte
        // aligned region, so it is 8-byte aligned.
        u64::from_le(unsafe { std::ptr::read_volatile(self.desc(head, DESC_OFF_COUNTER).cast()) })
    }

    fn set_counter(&self, head: u16, v: u64) {
        // SAFETY: as in `counter_of`.
        unsafe { std::ptr::write_volatile(self.desc(head, DESC_OFF_COUNTER).cast(), v.to_le()) }
    }

    /// Whether `head` can be tracked (a head the vring could never give is refused).
    #[inline]
    pub fn covers(&self, head: u16) -> bool {
        head < self.vring_size
    }

    /// The request at `head` was taken from the avail ring: mark it before the backend sees
    /// it.
    #[inline]
    pub fn mark(&mut self, head: u16) {
        if !self.covers(head) {
            return;
        }
        self.set_counter(head, self.counter);
        self.counter += 1;
        // Release: the counter is written before the flag (a reader after our death sees a
        // marked entry with its counter); and both before the request reaches the backend
        // (the submission that follows in program order).
        fence(Ordering::Release);
        self.set_inflight(head, 1);
        fence(Ordering::Release);
    }

    /// The request at `head` was put back (the block queue was full): it was not taken.
    #[inline]
    pub fn unmark(&mut self, head: u16) {
        if self.covers(head) {
            self.set_inflight(head, 0);
            self.counter = self.counter.saturating_sub(1);
        }
    }

    /// Before writing `head`'s used entry.
    #[inline]
    pub fn pre_put(&self, head: u16) {
        if self.covers(head) {
            self.region.write_u16(self.queue, OFF_LAST_BATCH_HEAD, head);
            // Release: last_batch_head is written before the used entry and idx (the
            // add_used that follows).
            fence(Ordering::Release);
        }
    }

    /// After `head`'s used entry and the used idx (`used_idx`, the idx just published) were
    /// written. `clear` is false for a request that was never marked by us (a guest that
    /// republished a head still in flight): its entry belongs to the request in flight.
    #[inline]
    pub fn post_put(&self, head: u16, used_idx: u16, clear: bool) {
        // Release: pairs with the used idx store of add_used (program order): the flag is
        // cleared only after the guest can see the completion, and used_idx last.
        fence(Ordering::Release);
        if clear && self.covers(head) {
            self.set_inflight(head, 0);
        }
        fence(Ordering::Release);
        self.region.write_u16(self.queue, OFF_USED_IDX, used_idx);
    }

    /// Requests marked now (for tests and logs).
    pub fn in_flight(&self) -> u32 {
        (0..self.vring_size).filter(|&h| self.inflight(h) == 1).count() as u32
    }

    /// At the queue's start: repair a torn completion, find the requests in flight (sorted by
    /// the order they were taken) and where the avail ring resumes. `used_idx` is the used
    /// ring's idx as the guest sees it now. A fresh region is marked in use.
    pub fn recover(&mut self, used_idx: u16) -> Result<Recovery, InflightError> {
        let q = self.queue;
        if self.region.read_u16(q, OFF_VERSION) == 0 {
            for h in 0..self.vring_size {
                self.set_inflight(h, 0);
            }
            self.region.write_u16(q, OFF_USED_IDX, used_idx);
            fence(Ordering::Release);
            self.region.write_u16(q, OFF_VERSION, VERSION);
            self.counter = 0;
            return Ok(Recovery {
                fresh: true,
                torn_repaired: false,
                resubmit: Vec::new(),
                next_avail: used_idx,
            });
        }
        let mut torn_repaired = false;
        if self.region.read_u16(q, OFF_USED_IDX) != used_idx {
            let last = self.region.read_u16(q, OFF_LAST_BATCH_HEAD);
            if self.covers(last) && self.inflight(last) != 0 {
                self.set_inflight(last, 0);
                torn_repaired = true;
            }
            fence(Ordering::Release);
            self.region.write_u16(q, OFF_USED_IDX, used_idx);
        }
        self.region.check_flags(q, self.vring_size)?;
        let marked: Vec<(u64, u16)> = (0..self.vring_size)
            .filter(|&h| self.inflight(h) == 1)
            .map(|h| (self.counter_of(h), h))
            .collect();
        let in_flight = marked.len() as u32;
        let mut marked = marked;
        marked.sort_unstable();
        self.counter = marked.last().map_or(0, |&(c, _)| c.wrapping_add(1));
        Ok(Recovery {
            fresh: false,
            torn_repaired,
            resubmit: marked.into_iter().map(|(_, h)| h).collect(),
            // At most vring_size (≤ 32768) in flight, so this fits the u16 ring arithmetic.
            next_avail: used_idx.wrapping_add(in_flight as u16),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fresh(queues: u16, size: u16) -> (NewRegion, Arc<InflightRegion>) {
        let r = InflightRegion::create(queues, size).unwrap();
        let region = InflightRegion::adopt(&r.file, r.mmap_size, 0, queues, size).unwrap();
        (r, region)
    }

    #[test]
    fn layout_sizes_are_64_byte_aligned() {
        assert_eq!(queue_region_bytes(1), 64);
        assert_eq!(queue_region_bytes(4), 128);
        assert_eq!(queue_region_bytes(128), 16 + 16 * 128 + 48);
        assert_eq!(queue_region_bytes(32768) % 64, 0);
    }

    #[test]
    fn created_region_is_sealed_zeroed_and_names_its_size() {
        let r = InflightRegion::create(2, 128).unwrap();
        assert_eq!(r.mmap_size, 2 * queue_region_bytes(128));
        // SAFETY: F_GET_SEALS on our own fd only reads its seals.
        let seals = unsafe { libc::fcntl(r.file.as_raw_fd(), libc::F_GET_SEALS) };
        assert_eq!(seals & libc::F_SEAL_GROW, libc::F_SEAL_GROW);
        assert_eq!(seals & libc::F_SEAL_SHRINK, libc::F_SEAL_SHRINK);
        assert!(r.file.set_len(r.mmap_size * 2).is_err(), "cannot grow");
        let region = InflightRegion::adopt(&r.file, r.mmap_size, 0, 2, 128).unwrap();
        assert_eq!(region.read_u16(1, OFF_DESC_NUM), 128);
        assert_eq!(region.read_u16(1, OFF_VERSION), 0);
    }

    #[test]
    fn bad_regions_are_refused() {
        let r = InflightRegion::create(2, 128).unwrap();
        let small = InflightRegion::adopt(&r.file, r.mmap_size - 1, 0, 2, 128);
        assert!(matches!(small, Err(InflightError::Mapping { .. })), "{small:?}");
        let past = InflightRegion::adopt(&r.file, r.mmap_size, 4096, 2, 128);
        assert!(matches!(past, Err(InflightError::Mapping { .. })), "{past:?}");
        let odd = InflightRegion::adopt(&r.file, r.mmap_size, 100, 2, 128);
        assert!(matches!(odd, Err(InflightError::Mapping { .. })), "{odd:?}");
        let geometry = InflightRegion::adopt(&r.file, r.mmap_size, 0, 2, 100);
        assert!(matches!(geometry, Err(InflightError::Geometry { .. })), "{geometry:?}");
        let none = InflightRegion::adopt(&r.file, r.mmap_size, 0, 0, 128);
        assert!(matches!(none, Err(InflightError::Geometry { .. })), "{none:?}");
        // The same file read as queues of 64: desc_num 128 is not what that layout says.
        let other = InflightRegion::adopt(&r.file, r.mmap_size, 0, 2, 64);
        assert!(matches!(other, Err(InflightError::Header { desc_num: 128, .. })), "{other:?}");
        // A version we do not know.
        let region = InflightRegion::adopt(&r.file, r.mmap_size, 0, 2, 128).unwrap();
        region.write_u16(1, OFF_VERSION, 7);
        let v = InflightRegion::adopt(&r.file, r.mmap_size, 0, 2, 128);
        assert!(matches!(v, Err(InflightError::Header { queue: 1, version: 7, .. })), "{v:?}");
        // A vring larger than the region's queue.
        region.write_u16(1, OFF_VERSION, 0);
        let region = InflightRegion::adopt(&r.file, r.mmap_size, 0, 2, 128).unwrap();
        assert!(matches!(region.queue(0, 256), Err(InflightError::VringTooLarge { .. })));
        assert!(region.queue(2, 128).is_err());
    }

    #[test]
    fn in_flight_requests_are_resubmitted_in_order_and_completed_ones_are_not() {
        let (_r, region) = fresh(1, 8);
        let mut q = region.queue(0, 8).unwrap();
        let rec = q.recover(0).unwrap();
        assert!(rec.fresh && rec.resubmit.is_empty());
        // Taken: 5, 2, 7, 0 (in that order); completed out of order: 7 then 2.
        for h in [5, 2, 7, 0] {
            q.mark(h);
        }
        let mut used = 0u16;
        for h in [7, 2] {
            q.pre_put(h);
            used += 1;
            q.post_put(h, used, true);
        }
        assert_eq!(q.in_flight(), 2);
        // The backend dies; a new one starts on the same region.
        drop(q);
        let mut q = region.queue(0, 8).unwrap();
        let rec = q.recover(used).unwrap();
        assert!(!rec.fresh && !rec.torn_repaired);
        assert_eq!(rec.resubmit, [5, 0], "in the order taken; 7 and 2 completed");
        assert_eq!(rec.next_avail, 4, "2 used + 2 in flight");
        // Counters continue after the largest one found.
        q.mark(3);
        assert_eq!(q.counter_of(3), 4);
    }

    #[test]
    fn a_region_a_backend_used_is_known_as_reused() {
        let r = InflightRegion::create(1, 8).unwrap();
        let region = InflightRegion::adopt(&r.file, r.mmap_size, 0, 1, 8).unwrap();
        assert!(!region.reused(), "fresh from GET_INFLIGHT_FD");
        region.queue(0, 8).unwrap().recover(0).unwrap();
        let again = InflightRegion::adopt(&r.file, r.mmap_size, 0, 1, 8).unwrap();
        assert!(again.reused(), "handed to the next backend after the first used it");
    }

    #[test]
    fn a_torn_completion_is_repaired() {
        let (_r, region) = fresh(1, 8);
        let mut q = region.queue(0, 8).unwrap();
        q.recover(10).unwrap();
        q.mark(1);
        q.mark(4);
        // Head 4's used entry and idx are published (11), then the backend dies before
        // post_put: its mark is still set, used_idx still says 10.
        q.pre_put(4);
        drop(q);
        let mut q = region.queue(0, 8).unwrap();
        let rec = q.recover(11).unwrap();
        assert!(rec.torn_repaired);
        assert_eq!(rec.resubmit, [1]);
        assert_eq!(rec.next_avail, 12);

        // Died after pre_put but before the used idx moved: nothing is torn, both resubmit.
        let (_r, region) = fresh(1, 8);
        let mut q = region.queue(0, 8).unwrap();
        q.recover(0).unwrap();
        q.mark(1);
        q.mark(4);
        q.pre_put(4);
        drop(q);
        let mut q = region.queue(0, 8).unwrap();
        let rec = q.recover(0).unwrap();
        assert!(!rec.torn_repaired);
        assert_eq!(rec.resubmit, [1, 4]);
        assert_eq!(rec.next_avail, 2);
    }

    #[test]
    fn an_unmarked_put_keeps_the_entry_of_the_request_in_flight() {
        let (_r, region) = fresh(1, 8);
        let mut q = region.queue(0, 8).unwrap();
        q.recover(0).unwrap();
        q.mark(3);
        // A hostile guest republished head 3: its rejection is put without clearing.
        q.pre_put(3);
        q.post_put(3, 1, false);
        assert_eq!(q.in_flight(), 1);
        // A put back (queue full) is not in flight.
        q.mark(5);
        q.unmark(5);
        assert_eq!(q.in_flight(), 1);
    }

    #[test]
    fn used_idx_wraps() {
        let (_r, region) = fresh(1, 4);
        let mut q = region.queue(0, 4).unwrap();
        q.recover(65534).unwrap();
        for h in 0..4 {
            q.mark(h);
        }
        q.pre_put(0);
        q.post_put(0, 65535, true);
        drop(q);
        let mut q = region.queue(0, 4).unwrap();
        let rec = q.recover(65535).unwrap();
        assert_eq!(rec.resubmit, [1, 2, 3]);
        assert_eq!(rec.next_avail, 2, "65535 + 3 wraps to 2");
    }

    #[test]
    fn corrupt_flags_and_smaller_vrings() {
        let (_r, region) = fresh(1, 8);
        let mut q = region.queue(0, 8).unwrap();
        q.recover(0).unwrap();
        q.set_inflight(6, 9);
        assert!(matches!(q.recover(0), Err(InflightError::BadFlag { head: 6, value: 9, .. })));
        q.set_inflight(6, 0);
        // A vring smaller than the region only reads its own heads.
        q.mark(6);
        let mut small = region.queue(0, 4).unwrap();
        assert!(!small.covers(6));
        assert_eq!(small.recover(0).unwrap().resubmit, Vec::<u16>::new());
    }
}
