//! The journal writer: one thread that drains the record ring in batches, frames the records,
//! writes each batch with one write and (at `local` and above) one flush, mirrors it to the
//! replica, and publishes the durable sequence number — pipelined, so that batch N+1 is framed
//! and written while batch N's flush is in flight.
//!
//! # The pipeline
//!
//! The writer owns two aligned buffers of `max_batch_bytes + 2 × write_align` bytes. At any
//! moment a buffer is *spare*, *pending* (frames in it, not yet submitted: the writer keeps
//! appending records to it while the device is busy) or *writing* (its write is in flight).
//! One loop, never blocking on one thing while another could move:
//!
//! 1. reap completions: a finished write frees its buffer and (at `local`/`replicated`)
//!    makes its last seq *unflushed*; a finished flush publishes the seq it covers;
//! 2. if writes completed since the last flush was submitted, submit a flush for them (at most
//!    two flushes in flight); at `replicated`, `replica.sync()` runs right after the local
//!    flush is submitted, so the two proceed in parallel;
//! 3. if no write is in flight and a batch is pending, submit its write (and
//!    `replica.write(offset, bytes)` the same bytes);
//! 4. frame whatever the ring holds into the pending batch (or a spare buffer);
//! 5. if nothing moved: with requests in flight, sleep on the device (a completion wakes the
//!    writer at once) for at most a short slice, so that records arriving during a flush are
//!    framed and written before it ends; with nothing in flight, sleep on the ring. (Waiting
//!    on the ring while the device works was worse: the ring's spin-then-yield wait on a
//!    loaded machine noticed flush completions late.)
//!
//! The durable seq is published only from a flush completion (`memory`: a write completion),
//! and a flush for seq S is submitted only after the write holding S — and, since writes
//! are issued one at a time in device order, every earlier write — has completed. By the
//! block seam's contract ([`BlockOp::Flush`](fastlane_block::BlockOp::Flush): every write
//! *completed before* the flush was submitted is durable when it completes) S is durable when
//! it is published. Two flushes may complete out of order; publishing is a max, so the durable
//! seq never goes back.
//!
//! # Crash safety: the rewritten last block, and how far a crash can tear
//!
//! `buf[0]` of a batch is device offset `base`, the start of the `write_align` block holding
//! the journal's end when the batch was started, so `buf[..end - base]` repeats bytes the
//! previous batch wrote (kept in `carry`). A batch appends frames after them, zero-fills to the
//! next block boundary and writes `[base, round_up(end))` in one request: the partly filled
//! last block of batch N is rewritten by batch N+1 with the same leading bytes.
//!
//! That rewrite may now run while the flush that covers batch N (and so acknowledges its
//! records) is in flight. It is still safe:
//!
//! - Writes never overlap *in flight*: write N+1 is submitted only after write N completed,
//!   so the device never reorders two writes of the shared block (which could land N's zero
//!   tail over N+1's frames).
//! - Flush N was submitted after write N completed, so it makes write N durable. If write N+1
//!   reaches the same block before or while the flush persists it, the block the medium holds
//!   is write N's, write N+1's, or (torn, each byte old or new) a mix — and all three agree on
//!   every byte below N's end, because N+1 carries them unchanged. Page cache: the copy of an
//!   identical byte leaves it identical at every instant; a device cache: old or new sector,
//!   same prefix. So the records flush N acknowledges are on the medium whichever version
//!   wins, and a torn write N+1 (or a torn write of any later batch) changes only bytes at or
//!   after N's end.
//! - Recovery zeroes at most `torn_window = max_batch_bytes + 2 × write_align` past the last
//!   valid frame, and refuses non-zero bytes beyond it. With two batches unflushed at once,
//!   the writer keeps every write inside that window: it frames a record only if the batch's
//!   new end stays within `max_batch_bytes` of `flushed_end` (the end of the last batch whose
//!   flush completed; every frame before it is durable, so recovery's scan ends at or after
//!   it), and single batches are capped at half of `max_batch_bytes` so that two fit. The
//!   unflushed writes then span `[floor(flushed_end), round_up(end))`, which is at most
//!   `max_batch_bytes + 2 × write_align` long and starts at or before the scan's end.
//!
//! # [`WriterIo::Flusher`]
//!
//! The same argument holds when flusher threads run the flushes (`flusher.rs`): the writer's
//! writes are synchronous (one at a time, never overlapping in flight); it asks for the flush
//! of seq S only after the write holding S completed, and a flusher submits that flush after
//! taking the request, on its own queue of the same device (every backend's flush covers the
//! whole device); `flushed_end`, the torn-window bound, is the flushers' (a max under their
//! mutex), so nothing is framed past `flushed_end + max_batch_bytes` here either.
//!
//! The buffers are handed to the device only under `start_write_tagged`'s contract: the
//! writing buffer is not touched (only read, to copy `carry` out of it) until its completion is
//! reaped; on an error the writer returns and [`Writer`] drops `dev` (its first field; the
//! queue's drop waits for in-flight requests) before the buffers.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fastlane_ring::WaitStrategy;

use super::control::{
    Control, Doorbell, STATE_CLOSED, STATE_DEVICE_FULL, STATE_FAILED, STATE_PRODUCER_FAULT,
};
use super::flusher::Flushers;
use super::format::{frame_len, Chain, Durability, Superblock};
use super::io::{AlignedBuf, Dev, IO_TIMEOUT};
use super::preprocess::Preprocess;
use super::replica::Replica;
use super::sources::Source;
use super::stats::WriterStats;
use super::JournalError;
use fastlane_block::{BlockDevice, Completion};

mod dsync;
mod input;

/// How long one idle wait on the ring lasts before the writer looks at its stop flag.
const IDLE_SLICE: Duration = Duration::from_millis(5);
/// With requests in flight and the ring empty, the writer first polls both (ring tail and
/// completion queue, no syscall) for this long, then sleeps on the device for at most
/// [`BUSY_SLICE`] before looking at the ring again. Measured on the 2-core dev VM
/// (BENCHMARKS.md, "Record journal"): a 20 µs spin with 100 µs slices made the pipelined
/// writer's ack P50 1.7x and P99 1.3–1.5x *worse* than no spin and 1 ms slices — io_uring's
/// fsync worker inherits the writer's CPU mask, and a writer that wakes every 100 µs takes
/// that core from the flush it waits for. Records that arrive during a flush are what
/// [`WriterIo::Flusher`] is for (the writer there sleeps on the ring only).
const BUSY_SPIN: Duration = Duration::ZERO;
/// One sleep on the device while requests are in flight (a completion ends it at once).
const BUSY_SLICE: Duration = Duration::from_millis(1);
/// Flushes in flight at once (the queue is opened with depth 4: one write and these).
const FLUSHES_MAX: usize = 2;
/// The tag of the (single) write in flight; flushes are tagged `2 × seq` (seq ≥ 1).
const WRITE_TAG: u64 = 1;

/// How the writer does its I/O ([`JournalConfig::writer_io`](super::JournalConfig::writer_io)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WriterIo {
    /// One queue: the writer submits writes and flushes and reaps their completions (the
    /// pipeline of the module docs). The default, and what `memory` and `replicated` always
    /// run.
    #[default]
    Pipelined,
    /// At `local` durability: the writer writes each batch and waits for that write; two
    /// flusher threads, each with its own queue on the device, run the flushes and publish the
    /// durable seq themselves (`journal/flusher.rs`). The writer then never waits on a flush
    /// (a record that arrives during one is written at once), and no completion has to travel
    /// back through it before a waiter wakes. On the dev VM's fast flush (~0.2 ms), with the
    /// `sync` engine: ack P50 ~10 % lower than `Pipelined`'s, P99 about the same, P99.9 and
    /// the worst runs higher (BENCHMARKS.md, "Record journal"), so it is not the default.
    /// Other durability levels run [`WriterIo::Pipelined`].
    Flusher,
    /// At `local` (and `memory`): every batch is one write that is durable when it completes
    /// (`RWF_DSYNC`, FUA on NVMe: [`BlockOp::WriteFua`](fastlane_block::BlockOp::WriteFua)),
    /// up to four in flight, no separate flush. A record waits for its own write, not for the
    /// flush of the batch in front of it; a batch started while another is in flight begins
    /// in a block of its own (the one before ends with a padding frame), so writes never
    /// overlap. Best on a file opened with `O_DIRECT` whose blocks were written at creation
    /// (then a write carries no metadata to commit). `replicated` runs
    /// [`WriterIo::Pipelined`]. See `writer/dsync.rs`.
    Dsync,
}

/// The segment a roll goes on to: its device, its queue if opened ahead, its superblock.
pub(crate) type NextSegment = (Arc<dyn BlockDevice>, Option<Dev>, Superblock);

/// What the writer does when the next record does not fit its device: the journal service
/// rolls to a new segment.
pub(crate) trait Roll: Send {
    /// Everything written so far is durable (the writer drained first). Returns the next
    /// segment: a device whose superblock (first seq `last_seq + 1`, previous chain value
    /// `head`) is written and flushed, its queue if one was opened ahead, and the superblock.
    fn roll(&mut self, last_seq: u64, head: Chain) -> Result<NextSegment, JournalError>;

    /// The segment rolled from, its writes all complete: closing it may be slow (a file
    /// that retention already unlinked frees its blocks on the last close), so an
    /// implementation may close it on another thread. Dropped here by default.
    fn retire(&mut self, old: (Dev, Arc<dyn BlockDevice>)) {
        drop(old);
    }
}

/// The journal service's side of the writer: producers arriving, the doorbell they ring, and
/// the roll to the next segment.
pub(crate) struct ServiceInputs {
    /// New producers' rings, sent by the service's acceptor (which rings the doorbell after).
    pub(crate) incoming: Receiver<Source>,
    /// Set by the acceptor after it sent a producer (before it rings the doorbell).
    pub(crate) arrived: Arc<AtomicBool>,
    pub(crate) doorbell: Doorbell,
    pub(crate) roll: Box<dyn Roll>,
}

/// How long the writer waits before trying a failed roll again (a full file system: the
/// producers' rings fill and push back meanwhile).
const ROLL_RETRY: Duration = Duration::from_millis(100);

/// A batch of frames in one buffer.
struct Batch {
    buf: AlignedBuf,
    /// Device offset of `buf[0]` (a multiple of `write_align`).
    base: u64,
    /// Device offset after the last frame.
    end: u64,
    /// Seq of the last frame (0: none framed yet).
    last_seq: u64,
    records: u64,
    /// Which batch this is (numbers the producers' checkpoints).
    id: u64,
    /// When its first record was taken from a ring.
    first_framed: Option<Instant>,
}

impl Batch {
    /// The bytes of its last block before its end (empty when the end is on a block
    /// boundary): the leading bytes of the batch after it.
    fn partial_block(&self, align: u64) -> &[u8] {
        let from = (self.end / align * align - self.base) as usize;
        &self.buf.as_slice()[from..(self.end - self.base) as usize]
    }
}

/// Batches written and not yet published durable: `(last seq, first record framed at)`,
/// oldest first (at most a writing and two flushing batches, and the slack of a full ring).
struct Commits {
    slots: [(u64, Option<Instant>); 8],
    first: usize,
    len: usize,
}

impl Commits {
    fn new() -> Commits {
        Commits { slots: [(0, None); 8], first: 0, len: 0 }
    }

    fn push(&mut self, seq: u64, at: Option<Instant>) {
        if self.len == self.slots.len() {
            // Never expected; the oldest is dropped from the statistics, nothing else.
            self.first = (self.first + 1) % self.slots.len();
            self.len -= 1;
        }
        self.slots[(self.first + self.len) % self.slots.len()] = (seq, at);
        self.len += 1;
    }

    /// Every batch up to `durable` is durable: observes how long each waited.
    fn done(&mut self, durable: u64, stats: &WriterStats) {
        let now = Instant::now();
        while self.len > 0 && self.slots[self.first].0 <= durable {
            if let Some(t) = self.slots[self.first].1 {
                stats.commit.observe(now.saturating_duration_since(t).as_nanos() as u64);
            }
            self.first = (self.first + 1) % self.slots.len();
            self.len -= 1;
        }
    }
}

pub(crate) struct Writer {
    /// First field: dropped first, so a queue with a write in flight is drained before the
    /// buffers below are freed.
    dev: Dev,
    /// The batch being filled (not submitted yet).
    pending: Option<Batch>,
    /// The batch whose write is in flight.
    writing: Option<Batch>,
    /// Buffers neither pending nor writing.
    spare: Vec<AlignedBuf>,
    /// The bytes of the journal's last partial block (`end - floor(end)` of them).
    carry: Vec<u8>,
    /// Device offset after the last framed frame.
    end: u64,
    /// Device offset after the last frame of the last batch whose flush completed (at
    /// `memory`: whose write completed).
    flushed_end: u64,
    /// Seq and end offset of the newest completed write not yet covered by a submitted flush.
    unflushed: Option<(u64, u64)>,
    /// Flushes in flight: the seq and end offset each covers, in submission order.
    flushing: Vec<(u64, u64)>,
    /// When the oldest request now in flight was submitted (for the I/O timeout).
    busy_since: Option<Instant>,
    done: [Completion; 4],
    key: [u8; 32],
    head: Chain,
    last_seq: u64,
    durable_seq: u64,
    sb: Superblock,
    durability: Durability,
    replica: Option<Box<dyn Replica>>,
    pre: Box<dyn Preprocess>,
    /// The rings drained: a journal's one ring, or the service's producers.
    sources: Vec<Source>,
    /// Where the next drain starts (round robin over `sources`).
    next_source: usize,
    /// Batches started so far.
    batches: u64,
    /// Batches written, waiting to be published durable (for the commit latency).
    commits: Commits,
    service: Option<ServiceInputs>,
    /// How the idle service writer waits on its doorbell (a journal's ring has it set).
    writer_wait: WaitStrategy,
    control: Control,
    stats: Arc<WriterStats>,
    stop: Arc<AtomicBool>,
    core: Option<usize>,
    /// Why the writer stopped reading its (single) ring, if it did.
    fault: Option<JournalError>,
    /// The next record does not fit the device: drain, then stop with `DeviceFull` (or roll).
    device_full: bool,
    /// The service could not roll for lack of space; producers were told.
    out_of_space: bool,
    /// Bytes at the device's end no frame may use ([`WriterIo::Dsync`]: room for the padding
    /// frame that ends the last batch).
    tail_reserve: u64,
    io: WriterIo,
    device: Arc<dyn BlockDevice>,
}

/// What the writer needs from `Journal::start`.
pub(crate) struct WriterParts {
    pub(crate) dev: Dev,
    /// A buffer holding, at its front, the bytes of the journal's last partial block.
    pub(crate) buf: AlignedBuf,
    pub(crate) end: u64,
    pub(crate) key: [u8; 32],
    pub(crate) head: Chain,
    pub(crate) last_seq: u64,
    pub(crate) sb: Superblock,
    pub(crate) durability: Durability,
    pub(crate) replica: Option<Box<dyn Replica>>,
    pub(crate) pre: Box<dyn Preprocess>,
    /// The single ring of a journal; empty for the service (producers arrive later).
    pub(crate) sources: Vec<Source>,
    pub(crate) service: Option<ServiceInputs>,
    pub(crate) writer_wait: WaitStrategy,
    pub(crate) control: Control,
    pub(crate) stats: Arc<WriterStats>,
    pub(crate) stop: Arc<AtomicBool>,
    pub(crate) core: Option<usize>,
    pub(crate) io: WriterIo,
    /// The device `dev` is a queue of (the flushers open their own queues on it).
    pub(crate) device: Arc<dyn BlockDevice>,
}

impl Writer {
    pub(crate) fn new(p: WriterParts) -> Writer {
        let align = u64::from(p.sb.write_align);
        let keep = (p.end - p.end / align * align) as usize;
        let carry = p.buf.as_slice()[..keep].to_vec();
        let second = AlignedBuf::new(p.buf.len());
        Writer {
            dev: p.dev,
            pending: None,
            writing: None,
            spare: vec![p.buf, second],
            carry,
            end: p.end,
            flushed_end: p.end,
            unflushed: None,
            flushing: Vec::with_capacity(FLUSHES_MAX),
            busy_since: None,
            done: [Completion::EMPTY; 4],
            key: p.key,
            head: p.head,
            last_seq: p.last_seq,
            durable_seq: p.last_seq,
            sb: p.sb,
            durability: p.durability,
            replica: p.replica,
            pre: p.pre,
            sources: p.sources,
            next_source: 0,
            batches: 0,
            commits: Commits::new(),
            service: p.service,
            writer_wait: p.writer_wait,
            control: p.control,
            stats: p.stats,
            stop: p.stop,
            core: p.core,
            fault: None,
            device_full: false,
            out_of_space: false,
            tail_reserve: if p.io == WriterIo::Dsync { 2 * u64::from(p.sb.write_align) } else { 0 },
            io: p.io,
            device: p.device,
        }
    }

    fn align(&self) -> u64 {
        u64::from(self.sb.write_align)
    }

    /// The thread body. Returns the first fatal error.
    pub(crate) fn run(mut self) -> Result<(), JournalError> {
        // The flushers start before the writer pins itself: a thread inherits its creator's
        // CPU mask, and flushers on the writer's core would wait for it to yield (measured:
        // ack P99 of tens of ms on a loaded 2-core machine).
        let flushers = if self.io == WriterIo::Flusher && self.durability == Durability::Local {
            Some(Flushers::start(
                &self.device,
                self.dev.size_bytes,
                &self.control,
                &self.stats,
                self.durable_seq,
                self.flushed_end,
            ))
        } else {
            None
        };
        if let Some(id) = self.core {
            // Best effort: a core that does not exist leaves the thread unpinned.
            let _ = fastlane_util::cpu::pin(id);
        }
        let result = match flushers {
            Some(Ok(f)) => self.run_flusher(f),
            Some(Err(e)) => Err(e),
            None if self.io == WriterIo::Dsync && self.durability != Durability::Replicated => {
                self.run_dsync()
            }
            None => self.run_loop(),
        };
        let state = match &result {
            Ok(()) if self.fault.is_some() => STATE_PRODUCER_FAULT,
            Ok(()) => STATE_CLOSED,
            Err(JournalError::DeviceFull) => STATE_DEVICE_FULL,
            Err(_) => STATE_FAILED,
        };
        self.control.set_state(state);
        result
    }

    fn io_in_flight(&self) -> bool {
        self.writing.is_some() || !self.flushing.is_empty()
    }

    /// Nothing framed, written or flushed is left to finish.
    fn drained(&self) -> bool {
        !self.io_in_flight() && self.pending.is_none() && self.unflushed.is_none()
    }

    fn run_loop(&mut self) -> Result<(), JournalError> {
        let mut fault_published = false;
        loop {
            let stopping = self.stop.load(Ordering::Acquire);
            debug_assert_eq!(
                self.spare.len()
                    + usize::from(self.pending.is_some())
                    + usize::from(self.writing.is_some()),
                2,
                "the writer owns two buffers"
            );
            self.sync_sources();
            let mut moved = self.reap()?;
            moved |= self.submit_flush()?;
            moved |= self.submit_write()?;
            let reading = self.fault.is_none() && !self.device_full;
            if reading && self.can_frame() {
                // With the device busy, look at the ring without waiting on it and sleep on
                // the device instead (woken by the completion, or after a short slice to pick
                // up records that arrived meanwhile); idle, sleep on the ring.
                let busy = self.io_in_flight() || self.pending.is_some();
                let wait = if moved || stopping || busy { None } else { Some(IDLE_SLICE) };
                if self.frame(wait)? > 0 {
                    continue;
                }
                let still_reading = self.fault.is_none() && !self.device_full;
                if stopping && still_reading && self.drained() {
                    // `frame` peeked at the ring and found nothing: all of it is durable.
                    return Ok(());
                }
                if !moved && self.io_in_flight() {
                    self.wait_busy()?;
                }
                continue;
            }
            if moved {
                continue;
            }
            if reading {
                // No buffer (or no room in the torn window) for more records: the device
                // holds all the work.
                self.wait_device()?;
                continue;
            }
            // Not reading the ring any more (producer fault, device full): finish what was
            // framed, then report.
            if !self.drained() {
                self.wait_device()?;
                continue;
            }
            if self.stopped_reading(&mut fault_published, stopping)? {
                return Ok(());
            }
        }
    }

    /// One idle turn of a writer loop that no longer reads the ring (producer fault or full
    /// device) and has nothing in flight: a full device is the error; a producer fault is
    /// published once (what came before the bad record is durable); then `true` when asked
    /// to stop, else a short sleep and `false`.
    fn stopped_reading(
        &mut self,
        fault_published: &mut bool,
        stopping: bool,
    ) -> Result<bool, JournalError> {
        if self.device_full {
            if self.service.is_some() && !stopping {
                self.roll()?;
                return Ok(false);
            }
            return Err(JournalError::DeviceFull);
        }
        if !*fault_published {
            self.control.set_state(STATE_PRODUCER_FAULT);
            *fault_published = true;
        }
        if stopping {
            return Ok(true);
        }
        std::thread::sleep(IDLE_SLICE);
        Ok(false)
    }

    /// [`WriterIo::Flusher`] at `local`: frame what the ring holds, write it and wait for the
    /// write, ask the flushers for a flush, and go back to the ring (sleeping there when it is
    /// empty: the producer's publish wakes the writer). Flushes complete on the flushers'
    /// threads, which publish the durable seq; the writer reads back only how far they got,
    /// for the torn-window bound and to drain at the end.
    fn run_flusher(&mut self, mut flushers: Flushers) -> Result<(), JournalError> {
        let result = self.flusher_loop(&flushers);
        let stopped = flushers.stop();
        result.and(stopped)
    }

    fn flusher_loop(&mut self, flushers: &Flushers) -> Result<(), JournalError> {
        let mut fault_published = false;
        loop {
            if let Some(e) = flushers.take_error() {
                return Err(e);
            }
            let stopping = self.stop.load(Ordering::Acquire);
            let (flushed_seq, flushed_end) = flushers.flushed();
            self.flushed_end = self.flushed_end.max(flushed_end);
            self.durable_seq = self.durable_seq.max(flushed_seq);
            self.commits.done(flushed_seq, &self.stats);
            let reading = self.fault.is_none() && !self.device_full;
            if self.pending.is_some() {
                // Group commit: the batch is written when a flusher can take its flush at
                // once. With every flusher busy, writing it now would only re-dirty the block
                // the running flushes write back (measured: flushes 10x slower with one write
                // per record); it keeps collecting records instead, unless it is full.
                let free = !flushers.all_busy();
                if free && reading && self.can_frame() {
                    self.frame(None)?;
                }
                if free || stopping || !reading || !self.can_frame() {
                    self.write_pending(flushers)?;
                } else {
                    flushers.wait_free(IDLE_SLICE);
                }
                continue;
            }
            if reading && self.can_frame() {
                let wait = if stopping { None } else { Some(IDLE_SLICE) };
                if self.frame(wait)? > 0 {
                    continue;
                }
                let still_reading = self.fault.is_none() && !self.device_full;
                if !(stopping && still_reading) {
                    continue;
                }
            } else if reading {
                // The torn window is full: wait for a flush to move it.
                flushers.wait_past(flushed_seq, IDLE_SLICE);
                continue;
            }
            // Stopping with an empty ring, or not reading any more (nothing pending): what
            // was written must be flushed before the writer reports.
            if self.durable_seq < self.last_seq {
                let deadline = Instant::now() + IO_TIMEOUT;
                while flushers.flushed().0 < self.last_seq {
                    if let Some(e) = flushers.take_error() {
                        return Err(e);
                    }
                    if Instant::now() >= deadline {
                        return Err(JournalError::Io {
                            op: "flush",
                            source: std::io::Error::new(
                                std::io::ErrorKind::TimedOut,
                                "block request timed out",
                            ),
                        });
                    }
                    flushers.wait_past(flushers.flushed().0, IDLE_SLICE);
                }
                continue;
            }
            if stopping && reading {
                return Ok(());
            }
            if self.stopped_reading(&mut fault_published, stopping)? {
                return Ok(());
            }
        }
    }

    /// Flusher mode: writes the pending batch, waits for that write, asks for its flush.
    /// Returns whether there was one.
    fn write_pending(&mut self, flushers: &Flushers) -> Result<bool, JournalError> {
        let Some(mut b) = self.pending.take() else { return Ok(false) };
        if b.records == 0 {
            self.spare.push(b.buf);
            return Ok(false);
        }
        let wlen = self.seal(&mut b);
        // Synchronous: `write` returns after the completion, so the buffer is free again and
        // no two writes are ever in flight together.
        let written = self.dev.write(&mut b.buf, 0, wlen, b.base);
        let replica_result = match (&written, self.replica.as_mut()) {
            (Ok(()), Some(r)) => r.write(b.base, &b.buf.as_slice()[..wlen]),
            _ => Ok(()),
        };
        let (records, end, seq) = (b.records, b.end, b.last_seq);
        self.commits.push(seq, b.first_framed);
        self.spare.push(b.buf);
        written?;
        replica_result?;
        self.stats.batches.fetch_add(1, Ordering::Relaxed);
        self.stats.records.fetch_add(records, Ordering::Relaxed);
        self.stats.bytes_written.fetch_add(wlen as u64, Ordering::Relaxed);
        self.stats.end.store(end, Ordering::Relaxed);
        // The write holding `seq` (and every earlier one) has completed.
        flushers.request(seq, end);
        Ok(true)
    }

    /// A record of the largest size could be framed now: a buffer has room for it and the
    /// torn window allows it.
    fn can_frame(&self) -> bool {
        let max_frame = frame_len(self.sb.max_record_bytes as usize) as u64;
        if self.end + max_frame > self.flushed_end + u64::from(self.sb.max_batch_bytes) {
            return false;
        }
        match &self.pending {
            Some(b) => self.room(b),
            None => !self.spare.is_empty(),
        }
    }

    /// The pending batch can take at least one more largest frame.
    fn room(&self, b: &Batch) -> bool {
        let max_frame = frame_len(self.sb.max_record_bytes as usize) as u64;
        let pos = b.end - b.base;
        pos + max_frame <= self.batch_cap() as u64
            && b.end + max_frame <= self.flushed_end + u64::from(self.sb.max_batch_bytes)
    }

    /// Bytes (from `buf[0]`) a batch may use: half of `max_batch_bytes` so that two batches
    /// fit the torn window, but at least one largest frame past the carried block.
    fn batch_cap(&self) -> usize {
        let max_frame = frame_len(self.sb.max_record_bytes as usize);
        let half = self.sb.max_batch_bytes as usize / 2;
        half.max(max_frame + self.align() as usize)
    }

    /// Requests in flight, the ring empty: poll the ring and the completion queue for
    /// [`BUSY_SPIN`], then sleep on the device for at most [`BUSY_SLICE`]. Returns early when
    /// a record arrives or a request completes (reaped here; the loop acts on it next).
    fn wait_busy(&mut self) -> Result<(), JournalError> {
        let start = Instant::now();
        // Bounded by BUSY_SPIN.
        loop {
            if self.reap()? || !self.io_in_flight() || self.ring_ready() {
                return Ok(());
            }
            if start.elapsed() >= BUSY_SPIN {
                break;
            }
            std::hint::spin_loop();
        }
        self.wait_device_for(BUSY_SLICE)
    }

    /// Blocks on the device until a request completes (bounded by the I/O timeout).
    fn wait_device(&mut self) -> Result<(), JournalError> {
        self.wait_device_for(IO_TIMEOUT)
    }

    fn wait_device_for(&mut self, slice: Duration) -> Result<(), JournalError> {
        if !self.io_in_flight() {
            return Ok(());
        }
        let since = self.busy_since.unwrap_or_else(Instant::now);
        let deadline = since + IO_TIMEOUT;
        let now = Instant::now();
        if now >= deadline {
            return Err(JournalError::Io {
                op: if self.writing.is_some() { "write" } else { "flush" },
                source: std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "block request timed out",
                ),
            });
        }
        self.dev.block_wait(slice.min(deadline - now))
    }

    /// Drains completions. Returns whether anything completed.
    fn reap(&mut self) -> Result<bool, JournalError> {
        let n = self.dev.reap(&mut self.done);
        for i in 0..n {
            let c = self.done[i];
            if c.tag == WRITE_TAG {
                let b = self.writing.take().ok_or(JournalError::WriterFailed)?;
                if let Err(e) = c.result {
                    return Err(JournalError::Block { op: "write", offset: b.base, source: e });
                }
                let (seq, end) = (b.last_seq, b.end);
                self.spare.push(b.buf);
                if self.durability == Durability::Memory {
                    self.flushed_end = end;
                    self.publish(seq);
                } else {
                    self.unflushed = Some((seq, end));
                }
            } else {
                if let Err(e) = c.result {
                    return Err(JournalError::Block { op: "flush", offset: 0, source: e });
                }
                let seq = c.tag / 2;
                let at = self.flushing.iter().position(|&(s, _)| s == seq);
                let Some(at) = at else { return Err(JournalError::WriterFailed) };
                let (_, end) = self.flushing.remove(at);
                self.stats.flushes.fetch_add(1, Ordering::Relaxed);
                self.flushed_end = self.flushed_end.max(end);
                self.publish(seq);
            }
        }
        if n > 0 {
            self.busy_since = self.io_in_flight().then(Instant::now);
        }
        Ok(n > 0)
    }

    fn publish(&mut self, seq: u64) {
        if seq > self.durable_seq {
            self.durable_seq = seq;
            self.control.publish_durable(seq);
            for s in &mut self.sources {
                s.publish(seq);
            }
            self.commits.done(seq, &self.stats);
        }
    }

    /// Submits a flush for the completed writes not yet covered by one.
    fn submit_flush(&mut self) -> Result<bool, JournalError> {
        if self.flushing.len() >= FLUSHES_MAX {
            return Ok(false);
        }
        let Some((seq, end)) = self.unflushed.take() else { return Ok(false) };
        self.dev.start_flush_tagged(2 * seq)?;
        self.flushing.push((seq, end));
        self.busy_since.get_or_insert_with(Instant::now);
        if self.durability == Durability::Replicated {
            if let Some(r) = self.replica.as_mut() {
                // Covers every replica write so far (those of `seq` included), in parallel
                // with the local flush; the flush's completion is reaped after this returns.
                r.sync()?;
            }
        }
        Ok(true)
    }

    /// Zero-fills batch `b` from its end to the next block boundary and returns the length to
    /// write (from `b.base`). Checks the torn-window bound (module docs): every unflushed byte
    /// lies within `max_batch_bytes` of the last flushed end, which recovery's scan reaches.
    fn seal(&self, b: &mut Batch) -> usize {
        debug_assert!(
            b.end <= self.flushed_end + u64::from(self.sb.max_batch_bytes),
            "batch [{}, {}) outside the torn window of flushed end {}",
            b.base,
            b.end,
            self.flushed_end
        );
        let align = self.align();
        let used = (b.end - b.base) as usize;
        let wlen = ((used as u64).div_ceil(align) * align) as usize;
        b.buf.as_mut_slice()[used..wlen].fill(0);
        wlen
    }

    /// Submits the pending batch's write if the device has none in flight.
    fn submit_write(&mut self) -> Result<bool, JournalError> {
        if self.writing.is_some() || self.pending.as_ref().is_none_or(|b| b.records == 0) {
            return Ok(false);
        }
        let Some(mut b) = self.pending.take() else { return Ok(false) };
        let wlen = self.seal(&mut b);
        self.dev.start_write_tagged(&mut b.buf, 0, wlen, b.base, WRITE_TAG)?;
        self.busy_since.get_or_insert_with(Instant::now);
        self.commits.push(b.last_seq, b.first_framed);
        let (base, records, end) = (b.base, b.records, b.end);
        // The device only reads the buffer during the write; so does the replica.
        let replica_result = match self.replica.as_mut() {
            Some(r) => r.write(base, &b.buf.as_slice()[..wlen]),
            None => Ok(()),
        };
        self.writing = Some(b);
        replica_result?;
        self.stats.batches.fetch_add(1, Ordering::Relaxed);
        self.stats.records.fetch_add(records, Ordering::Relaxed);
        self.stats.bytes_written.fetch_add(wlen as u64, Ordering::Relaxed);
        self.stats.end.store(end, Ordering::Relaxed);
        Ok(true)
    }

    /// Takes a pending batch to frame into: the one not yet submitted, or a fresh one in a
    /// spare buffer starting with the carried block.
    fn take_batch(&mut self) -> Option<Batch> {
        if let Some(b) = self.pending.take() {
            return Some(b);
        }
        let mut buf = self.spare.pop()?;
        let align = self.align();
        let base = self.end / align * align;
        let keep = (self.end - base) as usize;
        buf.as_mut_slice()[..keep].copy_from_slice(&self.carry[..keep]);
        self.batches += 1;
        Some(Batch {
            buf,
            base,
            end: self.end,
            last_seq: self.last_seq,
            records: 0,
            id: self.batches,
            first_framed: None,
        })
    }

    /// Drains the ring into the pending batch (waiting up to `wait` for the first record).
    /// Returns how many records were framed.
    fn frame(&mut self, wait: Option<Duration>) -> Result<u64, JournalError> {
        let Some(mut b) = self.take_batch() else { return Ok(0) };
        let r = self.frame_into(&mut b, wait);
        if b.records > 0 && b.first_framed.is_none() {
            b.first_framed = Some(Instant::now());
        }
        // Keep the last partial block for the next batch.
        self.carry.clear();
        self.carry.extend_from_slice(b.partial_block(self.align()));
        if b.records > 0 {
            self.pending = Some(b);
        } else {
            self.spare.push(b.buf);
        }
        r
    }

    /// Service, the device full: everything written is durable; roll to the next segment.
    /// A failure (no space for it) is retried after [`ROLL_RETRY`] while the rings push back.
    fn roll(&mut self) -> Result<bool, JournalError> {
        let Some(svc) = self.service.as_mut() else { return Ok(false) };
        let started = Instant::now();
        let rolled = svc.roll.roll(self.last_seq, self.head);
        let (device, dev, sb) = match rolled {
            Ok(next) => next,
            Err(_) => {
                let ns = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
                self.stats.roll_ns.fetch_add(ns, Ordering::Relaxed);
                self.stats.roll_failures.fetch_add(1, Ordering::Relaxed);
                // Appends that cannot be made durable now fail with `DeviceFull` (the rings
                // are full or filling); it ends when a roll succeeds.
                self.set_out_of_space(true);
                std::thread::sleep(ROLL_RETRY);
                return Ok(false);
            }
        };
        let dev = match dev {
            Some(d) => d,
            None => super::open_device(&*device)?,
        };
        let old =
            (std::mem::replace(&mut self.dev, dev), std::mem::replace(&mut self.device, device));
        svc.roll.retire(old);
        let ns = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.stats.roll_ns.fetch_add(ns, Ordering::Relaxed);
        self.sb = sb;
        self.end = super::format::DATA_OFFSET;
        self.flushed_end = self.end;
        self.carry.clear();
        self.head = sb.genesis();
        self.device_full = false;
        self.set_out_of_space(false);
        self.stats.rolls.fetch_add(1, Ordering::Relaxed);
        self.stats.end.store(self.end, Ordering::Relaxed);
        Ok(true)
    }
}
