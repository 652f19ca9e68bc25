//! One virtqueue's worker: pops chains, parses them, submits them to its own [`BlockQueue`],
//! and pushes completions onto the used ring.
//!
//! A worker runs on its virtqueue's vhost-user-backend epoll thread (one queue per thread) and
//! owns everything it touches on the data path: the block queue, the slot table and the parser
//! scratch space. The only lock it takes per batch is its own vring's (shared with the
//! vhost-user control thread, which takes it only on control messages).
//!
//! Adaptive polling: after any activity the worker keeps polling its avail ring and its block
//! queue for `poll` (bounded), then re-enables guest notifications and returns to epoll, where
//! it sleeps on the kick eventfd and on the block queue's completion eventfd.

use std::hint::spin_loop;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use log::{error, info, warn};
use vhost_user_backend::{VringRwLock, VringState, VringT};
use virtio_bindings::virtio_blk::{VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::{QueueOwnedT, QueueT};
use vm_memory::{
    Address, Bytes, GuestAddress, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryLoadGuard,
    GuestMemoryMmap,
};

use super::chain::ChainWalk;
use super::clock::Clock;
use super::inflight::InflightQueue;
use super::request::{ParseLimits, ParsedRequest, Parser, RejectReason, RequestKind, ID_LEN};
use super::stats::{new_latency_histogram, BlkStats, QueueStats, MERGE_INTERVAL};
use fastlane_block::{
    BlockDevice, BlockError, BlockOp, BlockQueue, BlockRequest, Completion, QueueFull,
};

/// Guest memory as the vhost-user library hands it to us.
pub type GuestMem = GuestMemoryMmap<()>;
/// The shared, swappable view of guest memory.
pub type AtomicMem = GuestMemoryAtomic<GuestMem>;
/// Our vring type.
pub type BlkVring = VringRwLock<AtomicMem>;

/// Completions drained per `complete` call.
const COMPLETION_BATCH: usize = 64;
/// How long `quiesce` waits for in-flight requests before giving up.
const QUIESCE_TIMEOUT: Duration = Duration::from_secs(30);
/// At most one "guest gave us…" warning per queue per this interval.
const WARN_INTERVAL: Duration = Duration::from_secs(1);

/// What a worker needs to know, fixed for a connection.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Virtqueue index.
    pub queue_index: u16,
    /// Slots (= the largest queue size the frontend may set).
    pub queue_size_max: u16,
    /// Busy-poll window after activity.
    pub poll: Duration,
    /// GET_ID answer.
    pub serial: [u8; ID_LEN],
    /// Parser limits.
    pub limits: ParseLimits,
    /// Timestamps for latency and the poll window.
    pub clock: Clock,
}

/// Per-request state, indexed by the chain's head index (the request tag).
#[derive(Debug)]
struct Slot {
    /// Keeps the guest memory snapshot the request's segments point into mapped until the
    /// completion is drained; `Some` while the slot is in flight.
    mem: Option<GuestMemoryLoadGuard<GuestMem>>,
    status: GuestAddress,
    /// Bytes reported in the used ring on success (data written to the guest + status).
    used_len: u32,
    bytes: u32,
    op: BlockOp,
    /// When the chain was taken, in `clock` ticks.
    start: u64,
}

/// What happened to one popped chain.
enum Started {
    /// Finished without the backend; status written, ready for the used ring with this length.
    Done(u32),
    /// Handed to the block queue.
    Submitted,
    /// The block queue is full: put the chain back.
    Full,
}

/// A virtqueue worker. Fields drop in order: the block queue first (waits for in-flight
/// requests), then the slots (and the guest memory they keep mapped).
pub struct Worker {
    queue: Option<Box<dyn BlockQueue>>,
    slots: Box<[Slot]>,
    parser: Parser,
    completions: Box<[Completion]>,
    config: WorkerConfig,
    device: Arc<dyn BlockDevice>,
    mem: AtomicMem,
    vring: BlkVring,
    stats: Arc<BlkStats>,
    latency: Histogram<u64>,
    /// This queue's part of the frontend's in-flight region, when it sent one.
    inflight: Option<InflightQueue>,
    /// When `latency` was last merged into the queue's shared histogram.
    /// When (clock ticks) `latency` was last merged.
    merged_at: u64,
    /// The poll window and the merge interval, in clock ticks.
    poll_ticks: u64,
    merge_ticks: u64,
    /// The block queue's completion eventfd, once registered with epoll.
    completion_fd_registered: bool,
    /// The stats' wake-up eventfd of this queue, once registered with epoll.
    wake_fd_registered: bool,
    warn_at: Option<Instant>,
    warn_suppressed: u64,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("queue_index", &self.config.queue_index)
            .field("in_flight", &self.in_flight())
            .finish_non_exhaustive()
    }
}

impl Worker {
    /// A worker for `vring`. Allocates everything it will use; the block queue is opened on
    /// first use, by the thread that uses it.
    pub fn new(
        config: WorkerConfig,
        device: Arc<dyn BlockDevice>,
        mem: AtomicMem,
        vring: BlkVring,
        stats: Arc<BlkStats>,
    ) -> Self {
        let slots = (0..config.queue_size_max.max(1))
            .map(|_| Slot {
                mem: None,
                status: GuestAddress(0),
                used_len: 0,
                bytes: 0,
                op: BlockOp::Read,
                start: 0,
            })
            .collect();
        stats.queue(usize::from(config.queue_index)).set_worker_running(true);
        Worker {
            queue: None,
            slots,
            parser: Parser::new(config.limits),
            completions: vec![Completion::EMPTY; COMPLETION_BATCH].into_boxed_slice(),
            device,
            mem,
            vring,
            stats,
            latency: new_latency_histogram(),
            inflight: None,
            merged_at: config.clock.now(),
            poll_ticks: config.clock.ticks(config.poll),
            merge_ticks: config.clock.ticks(MERGE_INTERVAL),
            completion_fd_registered: false,
            wake_fd_registered: false,
            warn_at: None,
            warn_suppressed: 0,
            config,
        }
    }

    /// Requests handed to the block queue and not yet completed.
    pub fn in_flight(&self) -> u32 {
        self.queue.as_ref().map_or(0, |q| q.in_flight())
    }

    /// The block queue's completion eventfd, if the queue is open, has one, and it is not yet
    /// registered with epoll.
    pub fn unregistered_completion_fd(&self) -> Option<std::os::fd::RawFd> {
        if self.completion_fd_registered {
            return None;
        }
        self.queue.as_ref()?.completion_fd()
    }

    /// The completion eventfd is now watched by epoll: the worker may sleep with requests in
    /// flight.
    pub fn mark_completion_fd_registered(&mut self) {
        self.completion_fd_registered = true;
    }

    /// The stats' wake-up eventfd for this queue, if not yet registered with epoll.
    pub fn unregistered_wake_fd(&self) -> Option<std::os::fd::RawFd> {
        if self.wake_fd_registered {
            return None;
        }
        self.stats.wake_fd(usize::from(self.config.queue_index))
    }

    /// The wake-up eventfd is now watched by epoll.
    pub fn mark_wake_fd_registered(&mut self) {
        self.wake_fd_registered = true;
    }

    /// A reader woke this queue ([`BlkStats::refresh`]): consume the wake-up and merge.
    pub fn on_wake(&mut self) {
        self.stats.take_wake(usize::from(self.config.queue_index));
        if self.qstats().merge_requested() {
            self.flush_latency();
        }
    }

    fn qstats(&self) -> &QueueStats {
        self.stats.queue(self.config.queue_index as usize)
    }

    fn ready(&self) -> bool {
        let st = self.vring.get_ref();
        st.get_queue().ready() && st.is_enabled()
    }

    /// Serve the queue until it has been idle for the poll window, then re-enable guest
    /// notifications and return (the caller goes back to sleep in epoll).
    pub fn run(&mut self) {
        let _ = self.vring.disable_notification();
        let clock = self.config.clock;
        let mut active_at = clock.now();
        loop {
            if !self.ready() {
                // GET_VRING_BASE or SET_VRING_ENABLE 0: stop touching the rings; `quiesce`
                // drains what is in flight.
                return;
            }
            let work = self.drain_avail() + self.reap();
            let now = clock.now();
            if now.wrapping_sub(self.merged_at) >= self.merge_ticks
                || self.qstats().merge_requested()
            {
                self.flush_latency();
            }
            if work > 0 {
                active_at = now;
                self.qstats().in_flight.store(u64::from(self.in_flight()), Ordering::Relaxed);
                continue;
            }
            if now.wrapping_sub(active_at) < self.poll_ticks {
                spin_loop();
                continue;
            }
            if self.in_flight() > 0 && !self.completion_fd_registered {
                // A backend without a completion eventfd: wait on it (bounded) instead of epoll.
                if let Some(q) = self.queue.as_mut() {
                    let _ = q.wait(Some(Duration::from_micros(200)));
                }
                continue;
            }
            // Going to sleep: re-arm notifications; if the guest slipped a request in before
            // that, go round again.
            match self.vring.enable_notification() {
                Ok(true) => {
                    let _ = self.vring.disable_notification();
                    if let Some((avail, next, size)) = self.avail_out_of_range() {
                        // Nothing was taken this turn, yet the ring says there is work: the
                        // guest (or a stale ring base) put the avail index more than a queue
                        // ahead, and every pop fails (VIRTIO 1.2 §2.7.13.3: the driver never
                        // makes more than a queue's worth available). Spinning here would pin
                        // this thread and keep its stop event from being seen: sleep until
                        // the next kick instead.
                        self.qstats().broken_avail.fetch_add(1, Ordering::Relaxed);
                        self.warn_guest(format_args!(
                            "comes from an avail ring whose index {avail} is more than the queue \
                             size {size} ahead of the next entry {next}; waiting for the next kick"
                        ));
                        return;
                    }
                    active_at = clock.now();
                }
                Ok(false) => {
                    let qs = self.qstats();
                    qs.sleeps.fetch_add(1, Ordering::Relaxed);
                    qs.in_flight.store(u64::from(self.in_flight()), Ordering::Relaxed);
                    if !self.latency.is_empty()
                        && clock.now().wrapping_sub(self.merged_at) >= self.merge_ticks
                    {
                        self.flush_latency();
                    }
                    return;
                }
                Err(e) => {
                    self.warn_guest(format_args!("has a broken avail ring ({e})"));
                    return;
                }
            }
        }
    }

    /// `(avail idx, next avail, queue size)` when the guest's avail index is more than a queue
    /// ahead of where we are (no pop can succeed).
    fn avail_out_of_range(&self) -> Option<(u16, u16, u16)> {
        let mem = self.mem.memory();
        let st = self.vring.get_ref();
        let q = st.get_queue();
        let avail = q.avail_idx(&*mem, Ordering::Acquire).ok()?.0;
        let next = q.next_avail();
        (avail.wrapping_sub(next) > q.size()).then_some((avail, next, q.size()))
    }

    /// Rate-limited "guest gave us a descriptor chain that …" warning.
    fn warn_guest(&mut self, what: std::fmt::Arguments<'_>) {
        let now = Instant::now();
        if self.warn_at.is_some_and(|t| now.duration_since(t) < WARN_INTERVAL) {
            self.warn_suppressed += 1;
            return;
        }
        let more = std::mem::take(&mut self.warn_suppressed);
        self.warn_at = Some(now);
        if more > 0 {
            warn!(
                "queue {}: guest gave us a descriptor chain that {what} ({more} more bad chains since the last report)",
                self.config.queue_index
            );
        } else {
            warn!(
                "queue {}: guest gave us a descriptor chain that {what}",
                self.config.queue_index
            );
        }
    }

    /// Wait for every in-flight request and put it on the used ring (GET_VRING_BASE: the
    /// frontend may only read the ring base once nothing is in flight). Bounded.
    pub fn quiesce(&mut self) {
        let deadline = Instant::now() + QUIESCE_TIMEOUT;
        while self.in_flight() > 0 {
            if Instant::now() > deadline {
                error!(
                    "queue {}: {} requests still in flight after {:?}; giving up on them",
                    self.config.queue_index,
                    self.in_flight(),
                    QUIESCE_TIMEOUT
                );
                break;
            }
            if let Some(q) = self.queue.as_mut() {
                let _ = q.wait(Some(Duration::from_millis(10)));
            }
            self.reap();
        }
        self.flush_latency();
    }

    /// Merge the worker's latency histogram into the queue's shared one.
    pub fn flush_latency(&mut self) {
        self.qstats().merge_latency(&self.latency);
        self.latency.reset();
        self.merged_at = self.config.clock.now();
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Finish what is in flight so the block queue's drop does not wait on it unaccounted.
        if self.in_flight() > 0 {
            info!(
                "queue {}: waiting for {} in-flight requests",
                self.config.queue_index,
                self.in_flight()
            );
        }
        self.quiesce();
        let qs = self.qstats();
        qs.in_flight.store(u64::from(self.in_flight()), Ordering::Relaxed);
        qs.set_worker_running(false);
    }
}

mod complete;
mod recover;
mod submit;
#[cfg(test)]
mod tests;

use complete::{notify, put_used};
