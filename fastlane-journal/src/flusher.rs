//! The flusher threads of [`WriterIo::Flusher`](super::WriterIo::Flusher): the writer writes
//! each batch itself and asks for a flush; a flusher, on its own queue of the same device,
//! runs the flush and publishes the durable seq. The writer never waits on a flush, so a
//! record that arrives while one runs is framed and written at once (the writer sleeps only on
//! the ring, where the producer's publish wakes it), and its flush starts as soon as a flusher
//! is free: with [`FLUSHERS`] threads, that many flushes are in flight at once.
//!
//! Why a flush on another queue covers the writer's writes: the writer asks for a flush of
//! seq S only after the write holding S has completed (writes are synchronous in this mode),
//! and the flusher submits its flush after it has taken that request (the mutex orders the
//! two). Every backend here flushes the whole device, not one queue: `fdatasync` of the file
//! (io_uring or inline), the NVMe namespace's volatile cache, the fault disk's shared image.
//! So the block seam's contract — every write completed before the flush was submitted is
//! durable when it completes — holds across the two queues.
//!
//! Publishing is a max under the mutex: two flushes that complete out of order never move the
//! durable seq back, and `flushed_end` only grows (the writer's torn-window bound reads it).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fastlane_block::BlockDevice;

use super::control::Control;
use super::io::Dev;
use super::stats::WriterStats;
use super::JournalError;

/// Flusher threads, so flushes in flight at once (as `FLUSHES_MAX` of the pipelined writer).
pub(crate) const FLUSHERS: usize = 2;
/// How long an idle flusher sleeps before it looks at the stop flag again.
const IDLE_SLICE: Duration = Duration::from_millis(100);

#[derive(Debug, Default)]
struct State {
    /// Seq and end offset of the newest write the writer asked to flush.
    requested: (u64, u64),
    /// The newest seq a flusher has taken (its flush submitted or about to be).
    taken: u64,
    /// Flushers waiting for work.
    idle: u32,
    /// Flushes in progress.
    busy: u32,
    /// The writer waits for a flush to complete.
    writer_waiting: bool,
    error: Option<JournalError>,
    stop: bool,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    work: Condvar,
    progress: Condvar,
    /// The newest flushed seq and the end of its batch (stored under the mutex, read without).
    flushed_seq: AtomicU64,
    flushed_end: AtomicU64,
    failed: AtomicBool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A flusher never panics while holding the lock; if one did, the state is still a
        // set of plain values, each consistent on its own.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The writer's handle on its flushers.
#[derive(Debug)]
pub(crate) struct Flushers {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl Flushers {
    /// Opens a queue per flusher on `device` and starts them. `seq`/`end`: what is durable now.
    pub(crate) fn start(
        device: &Arc<dyn BlockDevice>,
        size_bytes: u64,
        control: &Control,
        stats: &Arc<WriterStats>,
        seq: u64,
        end: u64,
    ) -> Result<Flushers, JournalError> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State { requested: (seq, end), taken: seq, ..State::default() }),
            work: Condvar::new(),
            progress: Condvar::new(),
            flushed_seq: AtomicU64::new(seq),
            flushed_end: AtomicU64::new(end),
            failed: AtomicBool::new(false),
        });
        let mut f = Flushers { shared, threads: Vec::with_capacity(FLUSHERS) };
        for i in 0..FLUSHERS {
            let queue = device
                .open_queue(2)
                .map_err(|source| JournalError::Io { op: "open flusher queue", source });
            let parts = queue.and_then(|q| Ok((Dev::new(q, size_bytes), control.reopen()?)));
            let (dev, control) = match parts {
                Ok(p) => p,
                Err(e) => {
                    let _ = f.stop();
                    return Err(e);
                }
            };
            let shared = Arc::clone(&f.shared);
            let stats = Arc::clone(stats);
            let spawned = std::thread::Builder::new()
                .name(format!("journal-flush{i}"))
                .spawn(move || run(&shared, dev, &control, &stats));
            match spawned {
                Ok(h) => f.threads.push(h),
                Err(source) => {
                    let _ = f.stop();
                    return Err(JournalError::Io { op: "spawn flusher", source });
                }
            }
        }
        Ok(f)
    }

    /// Asks for a flush covering the write of `seq` (which ends at `end`); call only after
    /// that write has completed.
    pub(crate) fn request(&self, seq: u64, end: u64) {
        let mut st = self.shared.lock();
        if seq > st.requested.0 {
            st.requested = (seq, end);
        }
        let idle = st.idle > 0;
        drop(st);
        if idle {
            self.shared.work.notify_one();
        }
    }

    /// The newest flushed seq and the end of its batch.
    pub(crate) fn flushed(&self) -> (u64, u64) {
        // Acquire pairs with the Release store of `flushed_seq` in `run`, made after
        // `flushed_end`: an end read after a seq is at least that seq's end.
        let seq = self.shared.flushed_seq.load(Ordering::Acquire);
        (seq, self.shared.flushed_end.load(Ordering::Relaxed))
    }

    /// A flusher's error, if one failed (taken once).
    pub(crate) fn take_error(&self) -> Option<JournalError> {
        if !self.shared.failed.load(Ordering::Acquire) {
            return None;
        }
        self.shared.lock().error.take().or(Some(JournalError::WriterFailed))
    }

    /// Waits until a flush newer than `seq` completed, a flusher failed, or `timeout` passed.
    pub(crate) fn wait_past(&self, seq: u64, timeout: Duration) {
        self.wait_while(timeout, |_| self.shared.flushed_seq.load(Ordering::Acquire) <= seq);
    }

    /// Whether every flusher is busy with a flush.
    pub(crate) fn all_busy(&self) -> bool {
        self.shared.lock().busy as usize >= FLUSHERS
    }

    /// Waits until a flusher is free, a flusher failed, or `timeout` passed.
    pub(crate) fn wait_free(&self, timeout: Duration) {
        self.wait_while(timeout, |st| st.busy as usize >= FLUSHERS);
    }

    /// The writer's wait on the flushers' progress: while `busy(state)` holds, no flusher
    /// failed and `timeout` has not passed, sleep on the condition variable (announcing it in
    /// `writer_waiting`).
    fn wait_while(&self, timeout: Duration, busy: impl Fn(&State) -> bool) {
        let deadline = Instant::now() + timeout;
        let mut st = self.shared.lock();
        while busy(&st) && !self.shared.failed.load(Ordering::Acquire) {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            st.writer_waiting = true;
            st = match self.shared.progress.wait_timeout(st, deadline - now) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
            st.writer_waiting = false;
        }
    }

    /// Stops the flushers (after the flush in progress, if any) and joins them.
    pub(crate) fn stop(&mut self) -> Result<(), JournalError> {
        self.shared.lock().stop = true;
        self.shared.work.notify_all();
        let mut panicked = false;
        for h in self.threads.drain(..) {
            panicked |= h.join().is_err();
        }
        match self.take_error() {
            Some(e) => Err(e),
            None if panicked => Err(JournalError::WriterFailed),
            None => Ok(()),
        }
    }
}

impl Drop for Flushers {
    fn drop(&mut self) {
        if !self.threads.is_empty() {
            let _ = self.stop();
        }
    }
}

/// A flusher: take the newest request, flush, publish; until stopped or failed.
fn run(shared: &Shared, mut dev: Dev, control: &Control, stats: &WriterStats) {
    // A thread inherits its creator's mask: the writer's creator may be pinned to the
    // producer's core (the bench is), and a flusher stuck there behind a producer that yields
    // in a loop waited milliseconds for the CPU.
    fastlane_util::cpu::unpin();
    loop {
        let (seq, end) = {
            let mut st = shared.lock();
            loop {
                if st.stop || st.error.is_some() {
                    return;
                }
                if st.requested.0 > st.taken {
                    break;
                }
                st.idle += 1;
                st = match shared.work.wait_timeout(st, IDLE_SLICE) {
                    Ok((g, _)) => g,
                    Err(p) => p.into_inner().0,
                };
                st.idle -= 1;
            }
            st.taken = st.requested.0;
            st.busy += 1;
            st.requested
        };
        // Submitted after the request was taken, so after the write of `seq` completed.
        let r = dev.flush();
        let mut st = shared.lock();
        st.busy -= 1;
        match r {
            Ok(()) => {
                stats.flushes.fetch_add(1, Ordering::Relaxed);
                if seq > shared.flushed_seq.load(Ordering::Relaxed) {
                    shared.flushed_end.store(end, Ordering::Relaxed);
                    // Release pairs with the Acquire in `Flushers::flushed`.
                    shared.flushed_seq.store(seq, Ordering::Release);
                    control.publish_durable(seq);
                }
            }
            Err(e) => {
                st.error.get_or_insert(e);
                shared.failed.store(true, Ordering::Release);
            }
        }
        let wake = st.writer_waiting || st.error.is_some();
        drop(st);
        if wake {
            shared.progress.notify_all();
        }
        if shared.failed.load(Ordering::Acquire) {
            return;
        }
    }
}
