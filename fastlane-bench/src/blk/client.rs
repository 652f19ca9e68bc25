//! The vhost-user-blk client: shared memory with the backend and one connection with one
//! virtqueue.

use std::fmt;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

use anyhow::Result;
use memmap2::{MmapOptions, MmapRaw};
use virtio_driver::{
    QueueNotifier, VhostUser, VirtioBlkConfig, VirtioBlkFeatureFlags, VirtioBlkQueue,
    VirtioBlkTransport, VirtioFeatureFlags,
};

use super::{BlkBenchError, Pattern};

/// Memory shared with the backend: one memfd mapping (MAP_SHARED, prefaulted), unmapped on
/// drop. The backend has its own mapping of the memfd, so a request still in flight (after an
/// error) writes there, never into our unmapped range.
pub(super) struct SharedBuf {
    pub(super) fd: OwnedFd,
    pub(super) map: MmapRaw,
}

impl SharedBuf {
    pub(super) fn new(len: usize) -> std::io::Result<SharedBuf> {
        // SAFETY:
        // - the name is a NUL-terminated C string literal; memfd_create only reads it.
        let raw = unsafe { libc::memfd_create(c"fastlane-bench-blk".as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY:
        // - `raw` is a fresh file descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY:
        // - `fd` is a valid memfd; ftruncate only changes its size.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let map = MmapOptions::new().len(len).populate().map_raw(&fd)?;
        Ok(SharedBuf { fd, map })
    }
}

/// One vhost-user-blk connection with one queue and `qd_max` data buffers of `size` bytes.
pub(super) struct Conn {
    // Field order is drop order: the queue points into the transport's ring memory and goes
    // first.
    pub(super) queue: VirtioBlkQueue<'static, u16>,
    pub(super) kick: Box<dyn QueueNotifier>,
    /// Owns the connection, the eventfds and the ring memory `queue` points into.
    pub(super) _transport: Box<VirtioBlkTransport>,
    pub(super) buf: SharedBuf,
    pub(super) size: u32,
    pub(super) capacity_bytes: u64,
    pub(super) features: u64,
    pub(super) event_idx: bool,
    pub(super) read_only: bool,
    /// Per slot: TSC/ns tick when its request was queued, and its offset (for error messages).
    pub(super) start: Vec<u64>,
    pub(super) offset: Vec<u64>,
    /// Scratch list of completed slots, `qd_max` long (no allocation while measuring).
    pub(super) done: Vec<u16>,
}

impl fmt::Debug for Conn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Conn")
            .field("capacity_bytes", &self.capacity_bytes)
            .field("features", &format_args!("{:#x}", self.features))
            .finish_non_exhaustive()
    }
}

impl Conn {
    pub(super) fn connect(socket: &Path, qd_max: u16, size: u32) -> Result<Conn, BlkBenchError> {
        use std::os::unix::fs::FileTypeExt as _;
        let path = socket.to_path_buf();
        match std::fs::metadata(socket) {
            Err(_) => return Err(BlkBenchError::SocketMissing { path }),
            Ok(m) if !m.file_type().is_socket() => return Err(BlkBenchError::NotASocket { path }),
            Ok(_) => {}
        }
        let wanted = VirtioFeatureFlags::VERSION_1.bits()
            | VirtioFeatureFlags::RING_EVENT_IDX.bits()
            | VirtioBlkFeatureFlags::RO.bits()
            | VirtioBlkFeatureFlags::BLK_SIZE.bits()
            | VirtioBlkFeatureFlags::FLUSH.bits();
        let path_str = socket.to_str().ok_or_else(|| BlkBenchError::Connect {
            path: path.clone(),
            source: std::io::Error::other("socket path is not UTF-8"),
        })?;
        let vu = VhostUser::<VirtioBlkConfig, _>::new(path_str, wanted)
            .map_err(|source| BlkBenchError::Connect { path: path.clone(), source })?;
        let mut transport: Box<VirtioBlkTransport> = Box::new(vu);
        let features = transport.get_features();
        if features & VirtioFeatureFlags::VERSION_1.bits() == 0 {
            return Err(BlkBenchError::FeatureRefused { path, feature: "VIRTIO_F_VERSION_1" });
        }
        let event_idx = features & VirtioFeatureFlags::RING_EVENT_IDX.bits() != 0;
        let read_only = features & VirtioBlkFeatureFlags::RO.bits() != 0;
        let cfg = transport
            .get_config()
            .map_err(|source| BlkBenchError::Setup { step: "GET_CONFIG", source })?;
        let capacity_bytes = u64::from(cfg.capacity).saturating_mul(512);
        if capacity_bytes < u64::from(size) {
            return Err(BlkBenchError::Disk {
                reason: format!("{capacity_bytes} bytes, smaller than one {size}-byte request"),
            });
        }

        let page = 4096usize;
        let len = (usize::from(qd_max) * size as usize).div_ceil(page) * page;
        let buf = SharedBuf::new(len)
            .map_err(|source| BlkBenchError::Setup { step: "memfd for data buffers", source })?;
        // Written requests carry a non-zero pattern; the memory is ours until it is shared.
        // SAFETY:
        // - `buf.map` is a fresh `len`-byte mapping nothing else references yet.
        unsafe { std::ptr::write_bytes(buf.map.as_mut_ptr(), 0xa5, len) };
        transport
            .map_mem_region(buf.map.as_mut_ptr() as usize, buf.map.len(), buf.fd.as_raw_fd(), 0)
            .map_err(|source| BlkBenchError::Setup {
                step: "ADD_MEM_REG (data buffers)",
                source,
            })?;
        // Three descriptors per request; the ring is a power of two.
        let queue_size = (u32::from(qd_max) * 3).next_power_of_two().clamp(16, 1024) as u16;
        let mut queues = VirtioBlkQueue::setup_queues(&mut *transport, 1, queue_size)
            .map_err(|source| BlkBenchError::Setup { step: "virtqueue setup", source })?;
        let mut queue = queues.pop().ok_or_else(|| BlkBenchError::Setup {
            step: "virtqueue setup",
            source: std::io::Error::other("no queue returned"),
        })?;
        // Busy polling: ask for no used-buffer notifications (with EVENT_IDX the used_event
        // index stays behind; without it VIRTQ_AVAIL_F_NO_INTERRUPT is set).
        queue.set_used_notif_enabled(false);
        let kick = transport.get_submission_notifier(0);
        let n = usize::from(qd_max);
        Ok(Conn {
            queue,
            kick,
            _transport: transport,
            buf,
            size,
            capacity_bytes,
            features,
            event_idx,
            read_only,
            start: vec![0; n],
            offset: vec![0; n],
            done: Vec::with_capacity(n),
        })
    }

    /// Queue one request for `slot` at `offset` (not yet kicked).
    #[inline]
    pub(super) fn queue(
        &mut self,
        pattern: Pattern,
        slot: u16,
        offset: u64,
    ) -> std::io::Result<()> {
        let data = self.slot_ptr(slot);
        let len = self.size as usize;
        match pattern {
            // SAFETY:
            // - `data..data + len` is slot `slot`'s range of `self.buf`, which lives as long as
            //   `self` (and the backend maps the memfd itself, see `SharedBuf::drop`);
            // - one request per slot at a time: a slot is reused only after its completion was
            //   seen, and this client never reads or writes a buffer while it is in flight.
            Pattern::Randread => unsafe { self.queue.read_raw(offset, data, len, slot) },
            // SAFETY: as for the read: the slot's range, alive and untouched until completion.
            Pattern::Randwrite => unsafe { self.queue.write_raw(offset, data, len, slot) },
        }
    }

    pub(super) fn slot_ptr(&self, slot: u16) -> *mut u8 {
        let off = usize::from(slot) * self.size as usize;
        assert!(off + self.size as usize <= self.buf.map.len(), "slot {slot} beyond the buffers");
        // SAFETY:
        // - `off + size <= len` (asserted above): inside the mapping.
        unsafe { self.buf.map.as_mut_ptr().add(off) }
    }

    /// Kick the device if it asked to be notified (always without EVENT_IDX, unless it set
    /// VIRTQ_USED_F_NO_NOTIFY).
    #[inline]
    pub(super) fn kick_if_needed(&mut self) -> std::io::Result<bool> {
        if self.queue.avail_notif_needed() {
            self.kick.notify()?;
            return Ok(true);
        }
        Ok(false)
    }
}
