//! The vhost-user-blk device: what vhost-user-backend's daemon asks us (features, config space,
//! queue layout) and where it hands us events (one worker per virtqueue).

use std::sync::{Arc, Mutex, OnceLock, Weak};

use log::{debug, info, warn};
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost_user_backend::{VhostUserBackend, VringEpollHandler};
use virtio_bindings::virtio_blk::VIRTIO_BLK_F_RO;
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use vm_memory::GuestAddressSpace;
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};

use super::config::BlkGeometry;
use super::request::{ParseLimits, ID_LEN};
use super::stats::BlkStats;
use super::worker::{AtomicMem, BlkVring, Worker, WorkerConfig};
use crate::block::BlockDevice;

/// The epoll handler type of our daemon.
pub type BlkEpollHandler = VringEpollHandler<Arc<BlkBackend>>;

/// Per-connection settings of the device.
#[derive(Debug, Clone)]
pub struct DeviceSettings {
    /// What is exported.
    pub geometry: BlkGeometry,
    /// Largest virtqueue the frontend may set up.
    pub queue_size_max: u16,
    /// Busy-poll window after activity.
    pub poll: std::time::Duration,
    /// GET_ID answer (zero-padded).
    pub serial: [u8; ID_LEN],
}

/// The vhost-user-blk backend of one frontend connection.
pub struct BlkBackend {
    settings: DeviceSettings,
    device: Arc<dyn BlockDevice>,
    stats: Arc<BlkStats>,
    mem: AtomicMem,
    /// One per virtqueue (= per worker thread); each is locked by its own worker on every event
    /// and by the control thread only in `stop_vring`: never shared between queues.
    workers: Vec<Mutex<Option<Worker>>>,
    /// The daemon's epoll handlers, to register block-queue completion eventfds. Weak: the
    /// handlers own clones of this backend.
    handlers: OnceLock<Vec<Weak<BlkEpollHandler>>>,
}

impl std::fmt::Debug for BlkBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlkBackend").field("settings", &self.settings).finish_non_exhaustive()
    }
}

impl BlkBackend {
    /// A backend for one connection, on `mem` (the same `GuestMemoryAtomic` given to the
    /// daemon).
    pub fn new(
        settings: DeviceSettings,
        device: Arc<dyn BlockDevice>,
        stats: Arc<BlkStats>,
        mem: AtomicMem,
    ) -> Self {
        let n = settings.geometry.num_queues as usize;
        BlkBackend {
            settings,
            device,
            stats,
            mem,
            workers: (0..n).map(|_| Mutex::new(None)).collect(),
            handlers: OnceLock::new(),
        }
    }

    /// Hand over the daemon's epoll handlers (call once, after creating the daemon).
    pub fn set_epoll_handlers(&self, handlers: &[Arc<BlkEpollHandler>]) {
        let _ = self.handlers.set(handlers.iter().map(Arc::downgrade).collect());
    }

    /// The epoll event id of a worker's block-queue completion eventfd (ids up to
    /// `num_queues` are the library's).
    fn completion_event(&self) -> u16 {
        self.settings.geometry.num_queues + 1
    }

    fn worker_config(&self, queue_index: u16) -> WorkerConfig {
        let g = &self.settings.geometry;
        WorkerConfig {
            queue_index,
            queue_size_max: self.settings.queue_size_max,
            poll: self.settings.poll,
            serial: self.settings.serial,
            limits: ParseLimits {
                capacity_bytes: g.capacity_bytes,
                segments_max: g.segments_max,
                read_only: g.read_only,
                discard: g.discard,
                write_zeroes: g.write_zeroes,
            },
        }
    }

    fn lock_worker(&self, index: usize) -> std::sync::MutexGuard<'_, Option<Worker>> {
        self.workers[index].lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl VhostUserBackend for BlkBackend {
    type Bitmap = ();
    type Vring = BlkVring;

    fn num_queues(&self) -> usize {
        self.settings.geometry.num_queues as usize
    }

    fn max_queue_size(&self) -> usize {
        self.settings.queue_size_max as usize
    }

    fn features(&self) -> u64 {
        self.settings.geometry.features() | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
    }

    fn acked_features(&self, features: u64) {
        info!(
            "frontend negotiated features {features:#x}: event_idx {}, read-only {}, {} queue(s)",
            features & (1 << VIRTIO_RING_F_EVENT_IDX) != 0,
            features & (1 << VIRTIO_BLK_F_RO) != 0,
            self.settings.geometry.num_queues,
        );
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
    }

    fn set_event_idx(&self, enabled: bool) {
        debug!("EVENT_IDX {}", if enabled { "on" } else { "off" });
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        self.settings.geometry.read_config(offset, size)
    }

    fn set_config(&self, offset: u32, buf: &[u8]) -> std::io::Result<()> {
        // Only `writeback` is writable in virtio-blk, and we do not offer CONFIG_WCE.
        debug!("frontend wrote {} config bytes at {offset}; ignored", buf.len());
        Ok(())
    }

    fn update_memory(&self, mem: AtomicMem) -> std::io::Result<()> {
        // The daemon swaps the regions inside the `GuestMemoryAtomic` we gave it (and that the
        // workers hold); nothing to store.
        let m = mem.memory();
        debug!(
            "guest memory now has {} region(s)",
            vm_memory::GuestMemoryBackend::num_regions(&*m)
        );
        Ok(())
    }

    fn queues_per_thread(&self) -> Vec<u64> {
        // One virtqueue per worker thread.
        (0..self.settings.geometry.num_queues).map(|i| 1u64 << i).collect()
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        // Without one the library cannot stop (and join) the worker threads.
        match new_event_consumer_and_notifier(EventFlag::NONBLOCK | EventFlag::CLOEXEC) {
            Ok(pair) => Some(pair),
            Err(e) => {
                warn!("cannot create a worker exit eventfd: {e}");
                None
            }
        }
    }

    fn stop_vring(&self, queue_index: u32) -> std::io::Result<()> {
        if let Some(w) = self.lock_worker(queue_index as usize).as_mut() {
            w.quiesce();
        }
        debug!("queue {queue_index} stopped");
        Ok(())
    }

    fn handle_event(
        &self,
        device_event: u16,
        _evset: EventSet,
        vrings: &[BlkVring],
        thread_id: usize,
    ) -> std::io::Result<()> {
        let Some(vring) = vrings.first() else {
            return Ok(());
        };
        if thread_id >= self.workers.len() {
            return Ok(());
        }
        if device_event != 0 && device_event != self.completion_event() {
            return Ok(());
        }
        let mut guard = self.lock_worker(thread_id);
        let worker = guard.get_or_insert_with(|| {
            Worker::new(
                self.worker_config(thread_id as u16),
                self.device.clone(),
                self.mem.clone(),
                vring.clone(),
                self.stats.clone(),
            )
        });
        worker.run();
        // The block queue is opened lazily by the worker; sleep on its completions too.
        if let Some(fd) = worker.unregistered_completion_fd() {
            let handler =
                self.handlers.get().and_then(|h| h.get(thread_id)).and_then(Weak::upgrade);
            let registered = match handler {
                Some(h) => h.register_listener(
                    fd,
                    EventSet::IN | EventSet::EDGE_TRIGGERED,
                    u64::from(self.completion_event()),
                ),
                None => Err(std::io::Error::other("no epoll handler")),
            };
            // Unregistered, the worker keeps waiting on the block queue itself (bounded waits)
            // while requests are in flight: slower, still correct.
            match registered {
                Ok(()) => worker.mark_completion_fd_registered(),
                Err(e) => {
                    warn!("queue {thread_id}: cannot watch the block queue's completions: {e}")
                }
            }
            // Completions may have arrived before the registration: look once more.
            worker.run();
        }
        Ok(())
    }
}
