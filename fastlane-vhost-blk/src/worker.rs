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

    /// Pop every available chain and start it. Returns how many chains were consumed.
    fn drain_avail(&mut self) -> usize {
        let mem = self.mem.memory();
        let vring = self.vring.clone();
        let mut st = vring.get_mut();
        if !st.get_queue().ready() || !st.is_enabled() {
            return 0;
        }
        let mut consumed = 0usize;
        let mut used = 0usize;
        while let Some(chain) = st.get_queue_mut().pop_descriptor_chain(&*mem) {
            let head = chain.head_index();
            // Every chain taken is marked in flight before anything else happens to it, so
            // that after a crash "taken = used + in flight" holds (inflight.rs). A head the
            // guest republished while it is still in flight is not marked again: its entry
            // belongs to the request in flight, and the chain is refused in `start`.
            let republished = self.slots.get(usize::from(head)).is_some_and(|s| s.mem.is_some());
            if !republished {
                if let Some(t) = self.inflight.as_mut() {
                    t.mark(head);
                }
            }
            let descs = chain.into_iter();
            match self.start(&mem, head, descs) {
                Started::Done(len) => {
                    let q = self.config.queue_index;
                    put_used(&mut st, self.inflight.as_ref(), q, head, len, !republished);
                    used += 1;
                    consumed += 1;
                }
                Started::Submitted => consumed += 1,
                Started::Full => {
                    if let Some(t) = self.inflight.as_mut() {
                        t.unmark(head);
                    }
                    st.get_queue_mut().go_to_previous_position();
                    break;
                }
            }
        }
        if used > 0 {
            notify(&mut st);
        }
        drop(st);
        if consumed > used {
            if let Some(q) = self.queue.as_mut() {
                if let Err(e) = q.kick() {
                    error!("queue {}: block queue kick failed: {e}", self.config.queue_index);
                }
            }
        }
        consumed
    }

    /// Parse one chain and either finish it here or submit it.
    fn start(
        &mut self,
        mem: &GuestMemoryLoadGuard<GuestMem>,
        head: u16,
        descs: impl IntoIterator<Item = Descriptor>,
    ) -> Started {
        let start = self.config.clock.now();
        let req = match self.parser.parse(&**mem, descs) {
            Ok(req) => req,
            Err(rej) => return self.finish_rejected(mem, head, rej.reason, rej.status),
        };
        let slot_free = self.slots.get(head as usize).is_some_and(|s| s.mem.is_none());
        if !slot_free {
            return self.finish_rejected(mem, head, RejectReason::HeadInFlight, Some(req.status));
        }
        let op = match req.kind {
            RequestKind::GetId => {
                let serial = self.config.serial;
                let used_len = match self.parser.write_id(&**mem, &req, &serial) {
                    Some(n) => {
                        self.finish_ok(mem, &req, start);
                        n + 1
                    }
                    None => {
                        self.finish_status(mem, req.status, VIRTIO_BLK_S_IOERR as u8);
                        self.qstats().failed.fetch_add(1, Ordering::Relaxed);
                        1
                    }
                };
                return Started::Done(used_len);
            }
            RequestKind::Read | RequestKind::Write if req.len == 0 => {
                self.finish_ok(mem, &req, start);
                return Started::Done(1);
            }
            RequestKind::Read => BlockOp::Read,
            RequestKind::Write => BlockOp::Write,
            RequestKind::Flush => BlockOp::Flush,
            RequestKind::Discard => BlockOp::Discard,
            RequestKind::WriteZeroes { unmap } => BlockOp::WriteZeroes { unmap },
        };
        if self.queue.is_none() {
            match self.device.open_queue(u32::from(self.config.queue_size_max)) {
                Ok(q) => self.queue = Some(q),
                Err(e) => {
                    error!(
                        "queue {}: cannot open a block queue: {e}; failing the request",
                        self.config.queue_index
                    );
                    self.finish_status(mem, req.status, VIRTIO_BLK_S_IOERR as u8);
                    self.qstats().failed.fetch_add(1, Ordering::Relaxed);
                    return Started::Done(1);
                }
            }
        }
        let Some(queue) = self.queue.as_mut() else {
            unreachable!("opened above");
        };
        let breq = BlockRequest {
            op,
            offset: req.offset,
            len: req.len,
            segments: self.parser.segments(),
            tag: u64::from(head),
        };
        // SAFETY:
        // - every segment was checked by the parser to lie inside one region of `mem`, and the
        //   slot below keeps a clone of that memory snapshot (an `Arc` of the mappings) until the
        //   completion with this tag is drained in `reap`/`quiesce`, or the block queue is
        //   dropped (it is dropped before the slots: field order), so the memory stays mapped;
        // - the memory is the guest's: the guest promised (by publishing the chain) not to touch
        //   a request's buffers until it is on the used ring, and we do not touch them either;
        //   a guest that breaks that promise only corrupts its own data.
        let submitted = unsafe { queue.submit(breq) };
        match submitted {
            Ok(()) => {
                let used_len = match op {
                    // Read: the data plus the status byte went to the guest.
                    BlockOp::Read => u32::try_from(req.len + 1).unwrap_or(u32::MAX),
                    _ => 1,
                };
                let slot = &mut self.slots[head as usize];
                slot.mem = Some(mem.clone());
                slot.status = req.status;
                slot.used_len = used_len;
                slot.bytes = u32::try_from(req.len).unwrap_or(u32::MAX);
                slot.op = op;
                slot.start = start;
                Started::Submitted
            }
            Err(QueueFull(_)) => Started::Full,
        }
    }

    fn finish_ok(&mut self, mem: &GuestMem, req: &ParsedRequest, start: u64) {
        self.finish_status(mem, req.status, VIRTIO_BLK_S_OK as u8);
        self.qstats().completed.fetch_add(1, Ordering::Relaxed);
        self.record_latency(start);
    }

    fn finish_rejected(
        &mut self,
        mem: &GuestMem,
        head: u16,
        reason: RejectReason,
        status: Option<GuestAddress>,
    ) -> Started {
        self.qstats().reject(reason);
        self.warn_guest(format_args!("{} (head {head})", reason.describe()));
        match status {
            Some(addr) => {
                self.finish_status(mem, addr, reason.status());
                Started::Done(1)
            }
            // No status byte to write: hand the chain back with length 0.
            None => Started::Done(0),
        }
    }

    fn finish_status(&self, mem: &GuestMem, addr: GuestAddress, status: u8) {
        // The parser checked the address lies in guest memory; a failure here means the memory
        // changed under us, and the guest gets what it asked for.
        let _ = mem.write_obj(status, addr);
    }

    fn record_latency(&mut self, start: u64) {
        let clock = self.config.clock;
        let ns = clock.ns_between(start, clock.now());
        self.latency.saturating_record(ns.max(1));
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

    /// Drain finished requests onto the used ring. Returns how many.
    fn reap(&mut self) -> usize {
        let Some(queue) = self.queue.as_mut() else {
            return 0;
        };
        if queue.in_flight() == 0 {
            return 0;
        }
        let n = queue.complete(&mut self.completions);
        if n == 0 {
            return 0;
        }
        let vring = self.vring.clone();
        let mut st = vring.get_mut();
        for i in 0..n {
            let c = self.completions[i];
            self.finish_completion(&mut st, c);
        }
        notify(&mut st);
        n
    }

    fn finish_completion(&mut self, st: &mut VringState<AtomicMem>, c: Completion) {
        let head = c.tag as u16;
        let slot = self
            .slots
            .get_mut(head as usize)
            .filter(|s| s.mem.is_some() && u64::from(head) == c.tag);
        // A completion for a tag we never submitted is the backend's bug, not the guest's.
        let Some(slot) = slot else {
            debug_assert!(false, "completion for unknown tag {}", c.tag);
            error!(
                "queue {}: block queue completed unknown tag {}",
                self.config.queue_index, c.tag
            );
            return;
        };
        let Some(mem) = slot.mem.take() else {
            return;
        };
        let (status, len) = match c.result {
            Ok(_) => (VIRTIO_BLK_S_OK as u8, slot.used_len),
            Err(BlockError::Unsupported) => (VIRTIO_BLK_S_UNSUPP as u8, 1),
            Err(_) => (VIRTIO_BLK_S_IOERR as u8, 1),
        };
        let _ = mem.write_obj(status, slot.status);
        let qs = self.stats.queue(self.config.queue_index as usize);
        if c.result.is_ok() {
            qs.completed.fetch_add(1, Ordering::Relaxed);
            match slot.op {
                BlockOp::Read if slot.used_len > 1 => {
                    qs.bytes_read.fetch_add(u64::from(slot.bytes), Ordering::Relaxed);
                }
                BlockOp::Read => {}
                BlockOp::Write => {
                    qs.bytes_written.fetch_add(u64::from(slot.bytes), Ordering::Relaxed);
                }
                BlockOp::Flush => {
                    qs.flushes.fetch_add(1, Ordering::Relaxed);
                }
                BlockOp::Discard | BlockOp::WriteZeroes { .. } => {
                    qs.discards.fetch_add(1, Ordering::Relaxed);
                }
            }
        } else {
            qs.failed.fetch_add(1, Ordering::Relaxed);
        }
        let clock = self.config.clock;
        let ns = clock.ns_between(slot.start, clock.now());
        self.latency.saturating_record(ns.max(1));
        put_used(st, self.inflight.as_ref(), self.config.queue_index, head, len, true);
    }

    /// Track this queue's requests in the frontend's in-flight region (call before the
    /// worker first runs, then [`Worker::recover_inflight`]).
    pub fn track_inflight(&mut self, q: InflightQueue) {
        self.inflight = Some(q);
    }

    /// At the queue's start on an in-flight region: repair a torn completion, move the avail
    /// position past everything taken before, and resubmit the requests that were in flight,
    /// in the order they were first taken. Returns how many were resubmitted. On a region it
    /// cannot read, tracking is turned off for this queue (logged) and the queue starts where
    /// the frontend said.
    pub fn recover_inflight(&mut self) -> usize {
        let qi = self.config.queue_index;
        let Some(tracker) = self.inflight.as_mut() else {
            return 0;
        };
        let mem = self.mem.memory();
        let vring = self.vring.clone();
        let mut st = vring.get_mut();
        let (used_ring, desc_table, size) = {
            let q = st.get_queue();
            (q.used_ring(), q.desc_table(), q.size())
        };
        // The used ring's idx (VIRTIO 1.2 §2.7.8: flags u16, idx u16, ring[]), as the guest
        // sees it.
        let used_idx = match GuestAddress(used_ring)
            .checked_add(2)
            .and_then(|a| mem.read_obj::<u16>(a).ok())
        {
            Some(v) => u16::from_le(v),
            None => {
                error!("queue {qi}: used ring at {used_ring:#x} is not in guest memory; in-flight tracking off for this queue");
                self.inflight = None;
                return 0;
            }
        };
        let rec = match tracker.recover(used_idx) {
            Ok(r) => r,
            Err(e) => {
                error!("queue {qi}: in-flight region refused: {e}; tracking off for this queue, it starts where the frontend said");
                self.inflight = None;
                return 0;
            }
        };
        st.get_queue_mut().set_next_avail(rec.next_avail);
        st.get_queue_mut().set_next_used(used_idx);
        let mut submitted = 0usize;
        let mut used = 0usize;
        for &head in &rec.resubmit {
            let walk = ChainWalk::new(&*mem, GuestAddress(desc_table), size, head);
            match self.start(&mem, head, walk) {
                Started::Submitted => submitted += 1,
                Started::Done(len) => {
                    put_used(&mut st, self.inflight.as_ref(), qi, head, len, true);
                    used += 1;
                }
                Started::Full => {
                    // The block queue is fresh and as deep as the largest vring: not reached.
                    error!("queue {qi}: block queue full while resubmitting head {head}; the rest stay in flight");
                    break;
                }
            }
        }
        if used > 0 {
            notify(&mut st);
        }
        drop(st);
        if submitted > 0 {
            if let Some(q) = self.queue.as_mut() {
                if let Err(e) = q.kick() {
                    error!("queue {qi}: block queue kick failed: {e}");
                }
            }
        }
        let n = rec.resubmit.len();
        let qs = self.qstats();
        qs.resubmitted.fetch_add(n as u64, Ordering::Relaxed);
        if rec.torn_repaired {
            qs.torn_repaired.fetch_add(1, Ordering::Relaxed);
        }
        if rec.fresh {
            info!("queue {qi}: in-flight region fresh; tracking every request from used idx {used_idx}");
        } else {
            info!(
                "queue {qi}: in-flight region: resubmitted {n} request(s), resuming at avail idx {} (used idx {used_idx}{})",
                rec.next_avail,
                if rec.torn_repaired { ", a torn completion repaired" } else { "" }
            );
        }
        n
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

/// Put `head` on the used ring, with the in-flight region's protocol around it when the queue
/// is tracked: `last_batch_head` before, the mark cleared (when `clear`) and `used_idx` after.
fn put_used(
    st: &mut VringState<AtomicMem>,
    tracker: Option<&InflightQueue>,
    queue_index: u16,
    head: u16,
    len: u32,
    clear: bool,
) {
    if let Some(t) = tracker {
        t.pre_put(head);
    }
    if let Err(e) = st.add_used(head, len) {
        error!("queue {queue_index}: cannot add to the used ring: {e}");
        return;
    }
    if let Some(t) = tracker {
        t.post_put(head, st.get_queue().next_used(), clear);
    }
}

fn notify(st: &mut VringState<AtomicMem>) {
    // EVENT_IDX: only when the guest asked (used_event); otherwise always.
    if st.needs_notification().unwrap_or(true) {
        if let Err(e) = st.signal_used_queue() {
            warn!("cannot signal the call eventfd: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fastlane_block::ram::RamDisk;
    use virtio_bindings::virtio_blk::{
        VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN,
        VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_WRITE_ZEROES,
    };
    use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
    use virtio_queue::desc::split::Descriptor as SplitDescriptor;
    use virtio_queue::desc::RawDescriptor;
    use virtio_queue::mock::MockSplitQueue;

    const QSIZE: u16 = 32;
    const DISK: u64 = 1 << 20;
    const R: u16 = 0;
    const W: u16 = VRING_DESC_F_WRITE as u16;
    const HDR: u64 = 0x10_000;
    const STATUS: u64 = 0x11_000;
    const DATA: u64 = 0x20_000;
    const IOERR: u8 = VIRTIO_BLK_S_IOERR as u8;
    const UNSUPP: u8 = VIRTIO_BLK_S_UNSUPP as u8;
    const OK: u8 = VIRTIO_BLK_S_OK as u8;

    /// A worker on a mock split queue over two guest memory regions and a 1 MiB RAM disk.
    struct Rig {
        mem: &'static GuestMem,
        mock: MockSplitQueue<'static, GuestMem>,
        disk: Arc<RamDisk>,
        stats: Arc<BlkStats>,
        worker: Worker,
        next_desc: u16,
        chains: u16,
    }

    impl Rig {
        fn new(read_only: bool) -> Rig {
            // Leaked so the mock queue can borrow it for the whole test.
            let mem: &'static GuestMem = Box::leak(Box::new(
                GuestMem::from_ranges(&[
                    (GuestAddress(0), 0x10_0000),
                    (GuestAddress(0x10_0000), 0x10_0000),
                ])
                .unwrap(),
            ));
            let atomic = GuestMemoryAtomic::new(mem.clone());
            let mock = MockSplitQueue::new(mem, QSIZE);
            let vring = BlkVring::new(atomic.clone(), QSIZE).unwrap();
            vring.set_queue_size(QSIZE);
            vring
                .set_queue_info(mock.desc_table_addr().0, mock.avail_addr().0, mock.used_addr().0)
                .unwrap();
            vring.set_queue_ready(true);
            vring.set_enabled(true);
            let disk = Arc::new(RamDisk::new(DISK, 512).unwrap());
            let stats = Arc::new(BlkStats::new(1));
            let config = WorkerConfig {
                queue_index: 0,
                queue_size_max: QSIZE,
                poll: Duration::ZERO,
                serial: *b"fastlane-test-serial",
                limits: ParseLimits {
                    capacity_bytes: DISK,
                    segments_max: 4,
                    read_only,
                    discard: true,
                    write_zeroes: true,
                },
                clock: Clock::instant(),
            };
            let worker = Worker::new(config, disk.clone(), atomic, vring, stats.clone());
            Rig { mem, mock, disk, stats, worker, next_desc: 0, chains: 0 }
        }

        fn header(&self, t: u32, sector: u64) {
            let mut h = [0u8; 16];
            h[0..4].copy_from_slice(&t.to_le_bytes());
            h[8..16].copy_from_slice(&sector.to_le_bytes());
            self.mem.write_slice(&h, GuestAddress(HDR)).unwrap();
        }

        /// Publish a chain of (addr, len, flags), let the worker run, and return (status byte,
        /// used length) after checking there is exactly one new used entry for it.
        fn run(&mut self, descs: &[(u64, u32, u16)]) -> (u8, u32) {
            self.mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
            let base = self.next_desc;
            let raw: Vec<RawDescriptor> = descs
                .iter()
                .enumerate()
                .map(|(i, &(addr, len, flags))| {
                    let last = i + 1 == descs.len();
                    let flags = if last { flags } else { flags | VRING_DESC_F_NEXT as u16 };
                    let next = if last { 0 } else { base + i as u16 + 1 };
                    RawDescriptor::from(SplitDescriptor::new(addr, len, flags, next))
                })
                .collect();
            self.mock.add_desc_chains(&raw, base).unwrap();
            self.next_desc = (base + descs.len() as u16) % (QSIZE - 8);
            self.worker.run();
            let used = self.mock.used().ring().ref_at(self.chains as usize).unwrap().load();
            self.chains += 1;
            assert_eq!(self.mock.used().idx().load(), self.chains, "one used entry per chain");
            assert_eq!(used.id(), u32::from(base));
            let status = self.mem.read_obj::<u8>(GuestAddress(STATUS)).unwrap();
            (status, used.len())
        }

        fn rejected(&self, r: RejectReason) -> u64 {
            self.stats.queue(0).rejected(r)
        }
    }

    #[test]
    fn write_then_read_back_through_guest_memory() {
        let mut rig = Rig::new(false);
        let pattern: Vec<u8> = (0..1024u32).map(|i| (i * 7 + 3) as u8).collect();
        rig.mem.write_slice(&pattern[..512], GuestAddress(DATA)).unwrap();
        // The second data descriptor is in the other memory region.
        rig.mem.write_slice(&pattern[512..], GuestAddress(0x10_0000 + DATA)).unwrap();
        rig.header(VIRTIO_BLK_T_OUT, 8);
        let chain = [(HDR, 16, R), (DATA, 512, R), (0x10_0000 + DATA, 512, R), (STATUS, 1, W)];
        assert_eq!(rig.run(&chain), (OK, 1));
        let mut back = vec![0u8; 1024];
        rig.disk.read_at(8 * 512, &mut back).unwrap();
        assert_eq!(back, pattern);

        rig.header(VIRTIO_BLK_T_IN, 8);
        let (st, len) = rig.run(&[(HDR, 16, R), (DATA + 0x1000, 1024, W), (STATUS, 1, W)]);
        assert_eq!((st, len), (OK, 1025));
        let mut got = vec![0u8; 1024];
        rig.mem.read_slice(&mut got, GuestAddress(DATA + 0x1000)).unwrap();
        assert_eq!(got, pattern);
        let q = rig.stats.queue(0);
        assert_eq!(q.completed.load(Ordering::Relaxed), 2);
        assert_eq!(q.bytes_written.load(Ordering::Relaxed), 1024);
        assert_eq!(q.bytes_read.load(Ordering::Relaxed), 1024);
        assert_eq!(q.rejected_total(), 0);
    }

    #[test]
    fn flush_discard_write_zeroes_get_id() {
        let mut rig = Rig::new(false);
        rig.disk.write_at(0, &[0xaa; 4096]).unwrap();
        rig.header(VIRTIO_BLK_T_FLUSH, 0);
        assert_eq!(rig.run(&[(HDR, 16, R), (STATUS, 1, W)]), (OK, 1));

        let range = |sector: u64, n: u32, flags: u32| {
            let mut r = [0u8; 16];
            r[0..8].copy_from_slice(&sector.to_le_bytes());
            r[8..12].copy_from_slice(&n.to_le_bytes());
            r[12..16].copy_from_slice(&flags.to_le_bytes());
            r
        };
        rig.mem.write_slice(&range(0, 2, 0), GuestAddress(DATA)).unwrap();
        rig.header(VIRTIO_BLK_T_DISCARD, 0);
        assert_eq!(rig.run(&[(HDR, 16, R), (DATA, 16, R), (STATUS, 1, W)]), (OK, 1));
        rig.mem.write_slice(&range(2, 2, 1), GuestAddress(DATA)).unwrap();
        rig.header(VIRTIO_BLK_T_WRITE_ZEROES, 0);
        assert_eq!(rig.run(&[(HDR, 16, R), (DATA, 16, R), (STATUS, 1, W)]), (OK, 1));
        let mut back = [0u8; 4096];
        rig.disk.read_at(0, &mut back).unwrap();
        assert!(back[..2048].iter().all(|&b| b == 0));
        assert!(back[2048..].iter().all(|&b| b == 0xaa));
        let q = rig.stats.queue(0);
        assert_eq!(q.flushes.load(Ordering::Relaxed), 1);
        assert_eq!(q.discards.load(Ordering::Relaxed), 2, "discard and write-zeroes");

        rig.header(VIRTIO_BLK_T_GET_ID, 0);
        assert_eq!(rig.run(&[(HDR, 16, R), (DATA, 20, W), (STATUS, 1, W)]), (OK, 21));
        let mut id = [0u8; 20];
        rig.mem.read_slice(&mut id, GuestAddress(DATA)).unwrap();
        assert_eq!(&id, b"fastlane-test-serial");
    }

    #[test]
    fn missing_status_descriptor_returns_len_0() {
        let mut rig = Rig::new(false);
        rig.header(VIRTIO_BLK_T_IN, 0);
        let (st, len) = rig.run(&[(HDR, 16, R), (DATA, 512, W), (STATUS, 1, R)]);
        assert_eq!((st, len), (0xff, 0), "status untouched, chain returned empty");
        assert_eq!(rig.rejected(RejectReason::StatusUnusable), 1);
    }

    #[test]
    fn status_descriptor_too_small_returns_len_0() {
        let mut rig = Rig::new(false);
        rig.header(VIRTIO_BLK_T_FLUSH, 0);
        assert_eq!(rig.run(&[(HDR, 16, R), (STATUS, 0, W)]), (0xff, 0));
        assert_eq!(rig.rejected(RejectReason::StatusUnusable), 1);
    }

    #[test]
    fn status_outside_guest_memory_returns_len_0() {
        let mut rig = Rig::new(false);
        rig.header(VIRTIO_BLK_T_FLUSH, 0);
        assert_eq!(rig.run(&[(HDR, 16, R), (0x4000_0000, 1, W)]), (0xff, 0));
        assert_eq!(rig.rejected(RejectReason::StatusUnusable), 1);
    }

    #[test]
    fn missing_header_is_ioerr() {
        let mut rig = Rig::new(false);
        assert_eq!(rig.run(&[(HDR, 8, R), (STATUS, 1, W)]), (IOERR, 1));
        assert_eq!(rig.rejected(RejectReason::HeaderMissing), 1);
    }

    #[test]
    fn header_in_write_only_descriptor_is_ioerr() {
        let mut rig = Rig::new(false);
        rig.header(VIRTIO_BLK_T_IN, 0);
        assert_eq!(rig.run(&[(HDR, 16, W), (DATA, 512, W), (STATUS, 1, W)]), (IOERR, 1));
        assert_eq!(rig.rejected(RejectReason::HeaderWriteOnly), 1);
    }

    #[test]
    fn data_of_wrong_direction_is_ioerr() {
        let mut rig = Rig::new(false);
        rig.header(VIRTIO_BLK_T_IN, 0);
        assert_eq!(rig.run(&[(HDR, 16, R), (DATA, 512, R), (STATUS, 1, W)]), (IOERR, 1));
        rig.header(VIRTIO_BLK_T_OUT, 0);
        assert_eq!(rig.run(&[(HDR, 16, R), (DATA, 512, W), (STATUS, 1, W)]), (IOERR, 1));
        assert_eq!(rig.rejected(RejectReason::WrongDirection), 2);
    }

    #[test]
    fn length_not_multiple_of_512_is_ioerr() {
        let mut rig = Rig::new(false);
        rig.header(VIRTIO_BLK_T_IN, 0);
        assert_eq!(rig.run(&[(HDR, 16, R), (DATA, 100, W), (STATUS, 1, W)]), (IOERR, 1));
        assert_eq!(rig.rejected(RejectReason::LengthNotSectorMultiple), 1);
    }

    #[test]
    fn sector_range_past_capacity_or_overflowing_is_ioerr() {
        let mut rig = Rig::new(false);
        rig.header(VIRTIO_BLK_T_IN, DISK / 512);
        assert_eq!(rig.run(&[(HDR, 16, R), (DATA, 512, W), (STATUS, 1, W)]), (IOERR, 1));
        rig.header(VIRTIO_BLK_T_IN, DISK / 512 - 1);
        assert_eq!(rig.run(&[(HDR, 16, R), (DATA, 1024, W), (STATUS, 1, W)]), (IOERR, 1));
        rig.header(VIRTIO_BLK_T_IN, u64::MAX);
        assert_eq!(rig.run(&[(HDR, 16, R), (DATA, 512, W), (STATUS, 1, W)]), (IOERR, 1));
        assert_eq!(rig.rejected(RejectReason::OutOfRange), 3);
    }

    #[test]
    fn too_many_segments_is_ioerr() {
        let mut rig = Rig::new(false);
        rig.header(VIRTIO_BLK_T_IN, 0);
        let mut chain = vec![(HDR, 16, R)];
        for i in 0..5 {
            chain.push((DATA + i * 0x1000, 512, W));
        }
        chain.push((STATUS, 1, W));
        assert_eq!(rig.run(&chain), (IOERR, 1));
        assert_eq!(rig.rejected(RejectReason::TooManySegments), 1);
    }

    #[test]
    fn data_outside_guest_memory_is_ioerr() {
        let mut rig = Rig::new(false);
        rig.header(VIRTIO_BLK_T_IN, 0);
        assert_eq!(rig.run(&[(HDR, 16, R), (0x4000_0000, 512, W), (STATUS, 1, W)]), (IOERR, 1));
        // Straddling the two regions.
        let straddle = [(HDR, 16, R), (0x10_0000 - 256, 512, W), (STATUS, 1, W)];
        assert_eq!(rig.run(&straddle), (IOERR, 1));
        assert_eq!(rig.rejected(RejectReason::BadAddress), 2);
    }

    #[test]
    fn unknown_type_is_unsupp() {
        let mut rig = Rig::new(false);
        rig.header(99, 0);
        assert_eq!(rig.run(&[(HDR, 16, R), (STATUS, 1, W)]), (UNSUPP, 1));
        assert_eq!(rig.rejected(RejectReason::Unsupported), 1);
    }

    #[test]
    fn read_only_export_refuses_writes() {
        let mut rig = Rig::new(true);
        rig.header(VIRTIO_BLK_T_OUT, 0);
        rig.mem.write_slice(&[0x55; 512], GuestAddress(DATA)).unwrap();
        assert_eq!(rig.run(&[(HDR, 16, R), (DATA, 512, R), (STATUS, 1, W)]), (IOERR, 1));
        assert_eq!(rig.rejected(RejectReason::ReadOnly), 1);
        let mut back = [0u8; 512];
        rig.disk.read_at(0, &mut back).unwrap();
        assert_eq!(back, [0u8; 512]);
        rig.header(VIRTIO_BLK_T_IN, 0);
        assert_eq!(rig.run(&[(HDR, 16, R), (DATA, 512, W), (STATUS, 1, W)]), (OK, 513));
    }

    #[test]
    fn bad_write_zeroes_flags_are_unsupp() {
        let mut rig = Rig::new(false);
        let mut r = [0u8; 16];
        r[8..12].copy_from_slice(&1u32.to_le_bytes());
        r[12..16].copy_from_slice(&2u32.to_le_bytes());
        rig.mem.write_slice(&r, GuestAddress(DATA)).unwrap();
        rig.header(VIRTIO_BLK_T_WRITE_ZEROES, 0);
        assert_eq!(rig.run(&[(HDR, 16, R), (DATA, 16, R), (STATUS, 1, W)]), (UNSUPP, 1));
        assert_eq!(rig.rejected(RejectReason::BadDiscardFlags), 1);
    }

    #[test]
    fn an_avail_index_more_than_a_queue_ahead_does_not_spin() {
        let mut rig = Rig::new(false);
        rig.header(VIRTIO_BLK_T_IN, 0);
        assert_eq!(rig.run(&[(HDR, 16, R), (DATA, 512, W), (STATUS, 1, W)]), (OK, 513));
        // The guest claims 100 new entries on a queue of 32: no pop can succeed. `run` must
        // return (a spin would hang this test) and count it.
        rig.mock.avail().idx().store(u16::to_le(100));
        rig.worker.run();
        rig.worker.run();
        assert_eq!(rig.stats.queue(0).broken_avail.load(Ordering::Relaxed), 2);
        assert_eq!(rig.mock.used().idx().load(), 1, "nothing was used");
    }

    #[test]
    fn latency_is_recorded_and_merged() {
        let mut rig = Rig::new(false);
        rig.header(VIRTIO_BLK_T_IN, 0);
        rig.run(&[(HDR, 16, R), (DATA, 512, W), (STATUS, 1, W)]);
        rig.worker.flush_latency();
        assert_eq!(rig.stats.queue(0).latency().len(), 1);
    }
}
