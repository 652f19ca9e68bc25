//! The vhost-user-blk device: what vhost-user-backend's daemon asks us (features, config space,
//! queue layout) and where it hands us events (one worker per virtqueue).

use std::os::unix::fs::MetadataExt as _;
use std::sync::atomic::{fence, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use log::{debug, error, info, warn};
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost_user_backend::{VhostUserBackend, VringEpollHandler, VringT};
use virtio_bindings::virtio_blk::VIRTIO_BLK_F_RO;
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::QueueT;
use vm_memory::{GuestAddressSpace, GuestMemoryBackend, GuestMemoryRegion};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};

use super::clock::Clock;
use super::config::BlkGeometry;
use super::inflight::InflightRegion;
use super::request::{ParseLimits, ID_LEN};
use super::stats::BlkStats;
use super::worker::{AtomicMem, BlkVring, GuestMem, Worker, WorkerConfig};
use fastlane_block::BlockDevice;

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
    /// Track in-flight requests in a region of our own when the frontend sends none.
    pub own_inflight: bool,
    /// The workers' clock (calibrated once per export).
    pub clock: Clock,
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
    /// Guest memory tables whose regions are (or may be) registered with the device's
    /// [`ExternalMemory`]: holding them keeps those regions mapped (a `GuestRegionMmap`
    /// unmaps on its last drop). See [`BlkBackend::register_memory`].
    registered: Mutex<Vec<Arc<GuestMem>>>,
    /// The frontend's in-flight region (`SET_INFLIGHT_FD`), handed to each worker at its
    /// start.
    inflight: Mutex<Option<Arc<InflightRegion>>>,
}

/// The key that names what backs a guest region for [`ExternalMemory::sync_regions`]: its
/// file's device and inode and the offset in the file (folded into 64 bits), 0 without a
/// file. vhost-user regions always come with a file (a memfd, or hugetlbfs).
fn backing_key(region: &<GuestMem as GuestMemoryBackend>::R) -> u64 {
    use fastlane_util::mix64 as mix;
    let Some(fo) = region.file_offset() else {
        return 0;
    };
    match fo.file().metadata() {
        Ok(m) => mix(mix(mix(m.dev()) ^ m.ino()) ^ fo.start()),
        Err(_) => 0,
    }
}

/// `(host address, length, key)` of every region of `mem`.
fn regions_of(mem: &GuestMem, out: &mut Vec<(*mut u8, usize, u64)>) {
    for r in mem.iter() {
        out.push((r.as_ptr(), r.len() as usize, backing_key(r)));
    }
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
            registered: Mutex::new(Vec::new()),
            inflight: Mutex::new(None),
        }
    }

    /// `SET_INFLIGHT_FD`: track requests in `region` from now on. Workers of an earlier start
    /// (the frontend stopped the rings before sending a new region) are finished, so each
    /// queue starts again on the new region, recovering what it says was in flight.
    pub fn set_inflight(&self, region: Arc<InflightRegion>) {
        for w in &self.workers {
            drop(w.lock().unwrap_or_else(|p| p.into_inner()).take());
        }
        *self.inflight.lock().unwrap_or_else(|p| p.into_inner()) = Some(region);
    }

    /// `--own-inflight-region`: the frontend sent no region, so make one (nothing survives a
    /// restart of ours in it; the data path does the same work as with the frontend's).
    fn make_own_inflight(&self) {
        let queues = self.settings.geometry.num_queues;
        let size = self.settings.queue_size_max;
        let made = InflightRegion::create(queues, size)
            .and_then(|r| InflightRegion::adopt(&r.file, r.mmap_size, r.mmap_offset, queues, size));
        match made {
            Ok(region) => {
                info!("in-flight region of our own: {queues} queue(s) of {size} (the frontend sent none)");
                let mut slot = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
                if slot.is_none() {
                    *slot = Some(region);
                }
            }
            Err(e) => warn!("cannot make an in-flight region of our own: {e}"),
        }
    }

    /// The region, if the frontend sent one.
    pub fn inflight(&self) -> Option<Arc<InflightRegion>> {
        self.inflight.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// A new worker for queue `index` on `vring`: tracked in the in-flight region when there
    /// is one, after recovering what it says (resubmissions are logged by the worker).
    fn start_worker(&self, index: usize, vring: &BlkVring) -> Worker {
        let mut worker = Worker::new(
            self.worker_config(index as u16),
            self.device.clone(),
            self.mem.clone(),
            vring.clone(),
            self.stats.clone(),
        );
        if self.inflight().is_none() && self.settings.own_inflight {
            self.make_own_inflight();
        }
        if let Some(region) = self.inflight() {
            let size = vring.get_ref().get_queue().size();
            match region.queue(index as u16, size) {
                Ok(q) => {
                    worker.track_inflight(q);
                    worker.recover_inflight();
                }
                Err(e) => error!(
                    "queue {index}: in-flight region does not fit this queue: {e}; requests of \
                     this queue are not tracked"
                ),
            }
        }
        worker
    }

    /// Register the guest memory with the device for zero copy, if it takes registrations
    /// (the VFIO NVMe driver maps it in the IOMMU; other backends need nothing).
    ///
    /// Registered: every region of `current`, plus every region of an older table some
    /// in-flight request still holds (a worker's batch or a request slot keeps a guard of the
    /// table its segments point into): a region the frontend removed stays registered, and
    /// its in-flight requests undisturbed, until the first update after its last request.
    ///
    /// A failed registration is logged and the connection goes on: requests into memory
    /// that is not registered are copied through the driver's bounce pages (correct, one
    /// copy slower), whereas failing `SET_MEM_TABLE`/`ADD_MEM_REG` would take the disk away
    /// from the guest (the frontend treats it as a broken backend).
    fn register_memory(&self, current: Arc<GuestMem>) {
        let Some(ext) = self.device.external_memory() else {
            return;
        };
        let mut registered = self.registered.lock().unwrap_or_else(|p| p.into_inner());
        // Tables only we hold can no longer be reached by anyone: the library has replaced
        // them (workers load the current one) and no guard of them is left to clone.
        let (in_use, idle): (Vec<_>, Vec<_>) =
            registered.drain(..).partition(|t| Arc::strong_count(t) > 1);
        // Acquire: pairs with the Release decrement of the last other `Arc` of each idle
        // table (a worker dropping a request's guard after its completion), so the device's
        // DMA for those requests happened before the unregistration below.
        fence(Ordering::Acquire);
        let mut regions = Vec::new();
        regions_of(&current, &mut regions);
        for t in &in_use {
            regions_of(t, &mut regions);
        }
        regions.sort_unstable();
        regions.dedup();
        // SAFETY:
        // - every region listed belongs to `current` or to a table in `in_use`, all kept in
        //   `registered` below: their `GuestRegionMmap`s, and so the mmaps, live until a
        //   later successful call no longer lists them; the idle tables are dropped only
        //   after this call succeeded, and kept (with everything else) when it failed;
        // - nothing makes a `&`/`&mut` into guest memory: the workers access it through
        //   vm-memory's volatile accessors and hand the block device raw `Segment`s;
        // - region addresses and lengths come from vhost-user's `mmap`s (page-aligned; the
        //   driver checks).
        match unsafe { ext.sync_regions(&regions) } {
            Ok(()) => {
                let bytes: usize = regions.iter().map(|r| r.1).sum();
                info!(
                    "guest memory: {} region(s), {} MiB registered for zero copy{}",
                    regions.len(),
                    bytes >> 20,
                    if in_use.is_empty() {
                        String::new()
                    } else {
                        format!(" ({} older table(s) still in use)", in_use.len())
                    }
                );
                *registered = in_use;
                registered.push(current);
                drop(idle);
            }
            Err(e) => {
                warn!(
                    "guest memory: registering {} region(s) for zero copy failed: {e}; \
                     requests outside registered memory are copied",
                    regions.len()
                );
                registered.extend(in_use);
                registered.extend(idle);
                registered.push(current);
            }
        }
    }

    /// The frontend is gone: finish every worker (each waits for its in-flight requests and
    /// closes its block queue), then unregister all guest memory and let it go. Idempotent;
    /// also run on drop.
    pub fn disconnect(&self) {
        for w in &self.workers {
            drop(w.lock().unwrap_or_else(|p| p.into_inner()).take());
        }
        let mut registered = self.registered.lock().unwrap_or_else(|p| p.into_inner());
        if registered.is_empty() {
            return;
        }
        let Some(ext) = self.device.external_memory() else {
            registered.clear();
            return;
        };
        // SAFETY: an empty list registers nothing.
        match unsafe { ext.sync_regions(&[]) } {
            Ok(()) => registered.clear(),
            Err(e) => {
                // The device may still reach those regions: never unmap them.
                error!("guest memory: unregistering failed: {e}; leaking its mappings");
                for t in registered.drain(..) {
                    std::mem::forget(t);
                }
            }
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

    /// The epoll event id of the stats' wake-up eventfd (a reader wants fresh latency).
    fn wake_event(&self) -> u16 {
        self.settings.geometry.num_queues + 2
    }

    /// Register `fd` with the epoll handler of thread `thread_id`.
    fn watch(
        &self,
        thread_id: usize,
        fd: std::os::fd::RawFd,
        events: EventSet,
        id: u16,
    ) -> std::io::Result<()> {
        let handler = self.handlers.get().and_then(|h| h.get(thread_id)).and_then(Weak::upgrade);
        match handler {
            Some(h) => h.register_listener(fd, events, u64::from(id)),
            None => Err(std::io::Error::other("no epoll handler")),
        }
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
            clock: self.settings.clock,
        }
    }

    fn lock_worker(&self, index: usize) -> std::sync::MutexGuard<'_, Option<Worker>> {
        self.workers[index].lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Drop for BlkBackend {
    fn drop(&mut self) {
        self.disconnect();
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
            // GET_INFLIGHT_FD / SET_INFLIGHT_FD are answered by the connection's interposer
            // (interpose.rs), which hands the region to `set_inflight`.
            | VhostUserProtocolFeatures::INFLIGHT_SHMFD
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
        // The daemon has swapped the table inside the `GuestMemoryAtomic` we gave it (and that
        // the workers hold) before calling us, so a worker may already use the new regions:
        // until they are registered below, the driver copies requests into them (correct).
        // Old regions stay registered until their requests are done (`register_memory`).
        let m = mem.memory().into_inner();
        debug!("guest memory now has {} region(s)", m.num_regions());
        self.register_memory(m);
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
        if device_event != 0
            && device_event != self.completion_event()
            && device_event != self.wake_event()
        {
            return Ok(());
        }
        let mut guard = self.lock_worker(thread_id);
        if device_event == self.wake_event() && guard.is_none() {
            // A refresh between two starts: nothing to merge. Only a kick starts a worker.
            self.stats.take_wake(thread_id);
            return Ok(());
        }
        let worker = guard.get_or_insert_with(|| self.start_worker(thread_id, vring));
        if let Some(fd) = worker.unregistered_wake_fd() {
            // Level-triggered: `on_wake` reads the eventfd empty. Still registered by the
            // worker of an earlier start on this connection: that is fine too.
            match self.watch(thread_id, fd, EventSet::IN, self.wake_event()) {
                Ok(()) => worker.mark_wake_fd_registered(),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    worker.mark_wake_fd_registered()
                }
                Err(e) => warn!(
                    "queue {thread_id}: cannot watch for latency refreshes: {e}; merged every \
                     100 ms of activity only"
                ),
            }
        }
        if device_event == self.wake_event() {
            worker.on_wake();
            return Ok(());
        }
        worker.run();
        // The block queue is opened lazily by the worker; sleep on its completions too.
        if let Some(fd) = worker.unregistered_completion_fd() {
            let registered = self.watch(
                thread_id,
                fd,
                EventSet::IN | EventSet::EDGE_TRIGGERED,
                self.completion_event(),
            );
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::VhostBlkOptions;
    use fastlane_block::ram::RamDisk;
    use fastlane_block::{BlockQueue, DeviceInfo, ExternalMemory};
    use vm_memory::{GuestAddress, GuestMemoryAtomic};

    /// A RAM disk that records what it is told to register.
    struct Recorder {
        disk: RamDisk,
        calls: Mutex<Vec<Vec<(usize, usize, u64)>>>,
    }

    impl BlockDevice for Recorder {
        fn info(&self) -> DeviceInfo {
            self.disk.info()
        }
        fn open_queue(&self, depth: u32) -> std::io::Result<Box<dyn BlockQueue>> {
            self.disk.open_queue(depth)
        }
        fn external_memory(&self) -> Option<&dyn ExternalMemory> {
            Some(self)
        }
    }

    impl ExternalMemory for Recorder {
        unsafe fn sync_regions(&self, regions: &[(*mut u8, usize, u64)]) -> std::io::Result<()> {
            let r = regions.iter().map(|&(p, l, k)| (p as usize, l, k)).collect();
            self.calls.lock().unwrap().push(r);
            Ok(())
        }
    }

    fn table(start: u64) -> GuestMem {
        GuestMem::from_ranges(&[(GuestAddress(start), 1 << 16)]).unwrap()
    }

    fn ptrs(mem: &GuestMem) -> Vec<usize> {
        mem.iter().map(|r| r.as_ptr() as usize).collect()
    }

    #[test]
    fn removed_regions_stay_registered_while_requests_hold_them() {
        let rec = Arc::new(Recorder {
            disk: RamDisk::new(1 << 20, 512).unwrap(),
            calls: Mutex::new(Vec::new()),
        });
        let settings = VhostBlkOptions::default().settings(&*rec).unwrap();
        let atomic = GuestMemoryAtomic::new(table(0));
        let backend =
            BlkBackend::new(settings, rec.clone(), Arc::new(BlkStats::new(1)), atomic.clone());
        let calls = || rec.calls.lock().unwrap().clone();

        backend.update_memory(atomic.clone()).unwrap();
        let a = ptrs(&atomic.memory());
        assert_eq!(calls().last().unwrap().iter().map(|r| r.0).collect::<Vec<_>>(), a);

        // A request in flight holds the old table (as a worker's slot does) while the
        // frontend replaces the region.
        let in_flight = atomic.memory();
        atomic.lock().unwrap().replace(table(1 << 20));
        backend.update_memory(atomic.clone()).unwrap();
        let b = ptrs(&atomic.memory());
        let mut both: Vec<usize> = a.iter().chain(&b).copied().collect();
        both.sort_unstable();
        assert_eq!(calls().last().unwrap().iter().map(|r| r.0).collect::<Vec<_>>(), both);

        // Its completion drops the guard: the next update unregisters the old region.
        drop(in_flight);
        backend.update_memory(atomic.clone()).unwrap();
        assert_eq!(calls().last().unwrap().iter().map(|r| r.0).collect::<Vec<_>>(), b);

        backend.disconnect();
        assert!(calls().last().unwrap().is_empty());
        let n = calls().len();
        drop(backend);
        assert_eq!(calls().len(), n, "disconnect is idempotent");
    }
}
