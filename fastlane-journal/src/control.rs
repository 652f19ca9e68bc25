//! The journal's control block: one 4 KiB shared mapping next to the record ring, through
//! which the writer publishes the durable sequence number and producers (in any process)
//! learn where their numbering continues.
//!
//! | offset | size | field | written by |
//! |-------:|-----:|-------|------------|
//! | 0   | 8  | magic `b"FLJRNCTL"` | creator, last |
//! | 8   | 4  | version (1) | creator |
//! | 12  | 4  | `max_record_bytes` | creator |
//! | 16  | 16 | journal id | creator |
//! | 32  | 4  | durability code | creator |
//! | 128 | 8  | **next_seq**: the next sequence number a producer assigns | producer |
//! | 256 | 8  | **durable_seq**: every seq ≤ it is durable at the journal's level | writer |
//! | 264 | 4  | durable epoch: futex word, +1 after every advance | writer |
//! | 268 | 4  | waiters: processes in `wait_durable` (futex wake only when > 0) | waiters |
//! | 384 | 4  | writer state (0 running, 1 closed, 2 failed, 3 producer fault, 4 device full) | writer |
//!
//! Integers are native-endian atomics (the mapping never leaves the machine). The writer reads
//! nothing here that a producer writes except `waiters`, and a wrong value there causes at most
//! a spurious `FUTEX_WAKE` or a missing one (the waiter's timed wait still ends); producers treat
//! the writer's fields as advisory and bound every wait.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use fastlane_ring::shm::sealed_memfd;
use fastlane_ring::WaitStrategy;
use memmap2::{MmapOptions, MmapRaw};

use super::format::Durability;
use super::JournalError;

/// Size of the control mapping.
pub const CONTROL_LEN: usize = 4096;
const MAGIC: u64 = u64::from_le_bytes(*b"FLJRNCTL");
const VERSION: u32 = 1;

/// Writer states.
pub(crate) const STATE_RUNNING: u32 = 0;
pub(crate) const STATE_CLOSED: u32 = 1;
pub(crate) const STATE_FAILED: u32 = 2;
pub(crate) const STATE_PRODUCER_FAULT: u32 = 3;
pub(crate) const STATE_DEVICE_FULL: u32 = 4;

#[repr(C, align(128))]
struct Line<T>(T);

#[repr(C)]
struct Fixed {
    magic: AtomicU64,
    version: AtomicU32,
    max_record_bytes: AtomicU32,
    id_lo: AtomicU64,
    id_hi: AtomicU64,
    durability: AtomicU32,
}

#[repr(C)]
struct Durable {
    seq: AtomicU64,
    epoch: AtomicU32,
    waiters: AtomicU32,
}

/// The layout of the mapping (see the module docs).
#[repr(C)]
struct Block {
    fixed: Line<Fixed>,
    next_seq: Line<AtomicU64>,
    durable: Line<Durable>,
    state: Line<AtomicU32>,
}

const _: () = assert!(std::mem::size_of::<Block>() <= CONTROL_LEN);
const _: () = assert!(std::mem::offset_of!(Block, next_seq) == 128);
const _: () = assert!(std::mem::offset_of!(Block, durable) == 256);
const _: () = assert!(std::mem::offset_of!(Block, state) == 384);

/// A mapped control block.
#[derive(Debug)]
pub(crate) struct Control {
    map: MmapRaw,
    file: File,
}

fn io_err(op: &'static str) -> impl FnOnce(io::Error) -> JournalError {
    move |source| JournalError::Io { op, source }
}

/// What a producer needs to know, validated at attach.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ControlInfo {
    pub(crate) max_record_bytes: u32,
}

impl Control {
    fn block(&self) -> &Block {
        // SAFETY:
        // - The mapping is `CONTROL_LEN` bytes, page-aligned, and `Block` fits in it
        //   (const-asserted above) with its 128-byte alignment.
        // - Every field of `Block` is an atomic, so concurrent writes by another process do not
        //   contradict the shared reference, and every bit pattern is valid.
        // - `self.map` keeps the mapping alive as long as the reference.
        unsafe { &*self.map.as_ptr().cast::<Block>() }
    }

    /// Creates a control block in a new memfd (same-process journals).
    pub(crate) fn create_memfd(
        journal_id: [u8; 16],
        max_record_bytes: u32,
        durability: Durability,
        next_seq: u64,
        durable_seq: u64,
    ) -> Result<Control, JournalError> {
        let file = sealed_memfd("fastlane-journal-ctl", CONTROL_LEN as u64)?;
        Self::init(file, journal_id, max_record_bytes, durability, next_seq, durable_seq)
    }

    /// Creates a control block in a new file at `path` (replacing a stale one).
    pub(crate) fn create_file(
        path: &Path,
        journal_id: [u8; 16],
        max_record_bytes: u32,
        durability: Durability,
        next_seq: u64,
        durable_seq: u64,
    ) -> Result<Control, JournalError> {
        let _ = std::fs::remove_file(path);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(io_err("create control file"))?;
        Self::init(file, journal_id, max_record_bytes, durability, next_seq, durable_seq)
    }

    fn init(
        file: File,
        journal_id: [u8; 16],
        max_record_bytes: u32,
        durability: Durability,
        next_seq: u64,
        durable_seq: u64,
    ) -> Result<Control, JournalError> {
        file.set_len(CONTROL_LEN as u64).map_err(io_err("ftruncate control"))?;
        let map =
            MmapOptions::new().len(CONTROL_LEN).map_raw(&file).map_err(io_err("mmap control"))?;
        let c = Control { map, file };
        let b = c.block();
        b.fixed.0.version.store(VERSION, Ordering::Relaxed);
        b.fixed.0.max_record_bytes.store(max_record_bytes, Ordering::Relaxed);
        let mut lo = [0u8; 8];
        let mut hi = [0u8; 8];
        lo.copy_from_slice(&journal_id[..8]);
        hi.copy_from_slice(&journal_id[8..]);
        b.fixed.0.id_lo.store(u64::from_le_bytes(lo), Ordering::Relaxed);
        b.fixed.0.id_hi.store(u64::from_le_bytes(hi), Ordering::Relaxed);
        b.fixed.0.durability.store(durability.code(), Ordering::Relaxed);
        b.next_seq.0.store(next_seq, Ordering::Relaxed);
        b.durable.0.seq.store(durable_seq, Ordering::Relaxed);
        b.state.0.store(STATE_RUNNING, Ordering::Relaxed);
        // Pairs with the `Acquire` load of the magic in `open`: a block with the magic is
        // initialised.
        b.fixed.0.magic.store(MAGIC, Ordering::Release);
        Ok(c)
    }

    /// Opens an existing control block (a producer in another process).
    pub(crate) fn open_file(path: &Path) -> Result<(Control, ControlInfo), JournalError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(io_err("open control file"))?;
        Self::map_existing(file)
    }

    /// Maps a control block received as a file descriptor (a producer of the journal service,
    /// which gets its own block over the attach socket) and validates it.
    pub(crate) fn from_fd(fd: OwnedFd) -> Result<(Control, ControlInfo), JournalError> {
        Self::map_existing(File::from(fd))
    }

    /// Maps a block someone else created and validates it.
    fn map_existing(file: File) -> Result<(Control, ControlInfo), JournalError> {
        let len = file.metadata().map_err(io_err("fstat control"))?.len();
        if len < CONTROL_LEN as u64 {
            return Err(JournalError::BadControl { what: "control file too short", value: len });
        }
        let map =
            MmapOptions::new().len(CONTROL_LEN).map_raw(&file).map_err(io_err("mmap control"))?;
        let c = Control { map, file };
        let info = c.validate()?;
        Ok((c, info))
    }

    /// The file behind the mapping (to pass to another process).
    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    /// A second mapping of the same block (for another handle in this process).
    pub(crate) fn reopen(&self) -> Result<Control, JournalError> {
        let file = self.file.try_clone().map_err(io_err("dup control"))?;
        let map =
            MmapOptions::new().len(CONTROL_LEN).map_raw(&file).map_err(io_err("mmap control"))?;
        Ok(Control { map, file })
    }

    pub(crate) fn validate(&self) -> Result<ControlInfo, JournalError> {
        let b = self.block();
        let magic = b.fixed.0.magic.load(Ordering::Acquire);
        if magic != MAGIC {
            return Err(JournalError::BadControl { what: "bad control magic", value: magic });
        }
        let version = b.fixed.0.version.load(Ordering::Relaxed);
        if version != VERSION {
            return Err(JournalError::BadControl {
                what: "unsupported control version",
                value: version.into(),
            });
        }
        let max_record_bytes = b.fixed.0.max_record_bytes.load(Ordering::Relaxed);
        if max_record_bytes == 0 || max_record_bytes > super::format::MAX_RECORD_BYTES_LIMIT {
            return Err(JournalError::BadControl {
                what: "max_record_bytes out of range",
                value: max_record_bytes.into(),
            });
        }
        Ok(ControlInfo { max_record_bytes })
    }

    /// The next seq a producer would assign (advisory).
    pub(crate) fn next_seq(&self) -> u64 {
        self.block().next_seq.0.load(Ordering::Acquire)
    }

    /// A producer claims `seq` by storing `seq + 1` before publishing the record.
    #[inline]
    pub(crate) fn set_next_seq(&self, next: u64) {
        // Release pairs with the `Acquire` in `next_seq` of a producer that attaches later.
        self.block().next_seq.0.store(next, Ordering::Release);
    }

    #[inline]
    pub(crate) fn durable_seq(&self) -> u64 {
        // Acquire pairs with the writer's `Release` store in `publish_durable`.
        self.block().durable.0.seq.load(Ordering::Acquire)
    }

    pub(crate) fn state(&self) -> u32 {
        self.block().state.0.load(Ordering::Acquire)
    }

    /// Writer: sets the state and wakes every waiter so it sees it.
    pub(crate) fn set_state(&self, state: u32) {
        self.block().state.0.store(state, Ordering::Release);
        self.bump_and_wake();
    }

    /// Writer: publishes a new durable seq and wakes waiters if any announced themselves.
    pub(crate) fn publish_durable(&self, seq: u64) {
        // Release pairs with the `Acquire` load in `durable_seq` (any process).
        self.block().durable.0.seq.store(seq, Ordering::Release);
        self.bump_and_wake();
    }

    fn bump_and_wake(&self) {
        let d = &self.block().durable.0;
        d.epoch.fetch_add(1, Ordering::Release);
        // SeqCst fence pairs with the waiter's fence between its `waiters` increment and its
        // load of `seq`: either the waiter sees the new seq, or we see its announcement.
        fence(Ordering::SeqCst);
        if d.waiters.load(Ordering::Relaxed) != 0 {
            futex_wake(&d.epoch);
        }
    }

    /// Waits until `durable_seq() >= seq`, the writer stops, or `timeout` passes, as
    /// `strategy` says: spin, then `sched_yield` (checking the writer's state and the deadline
    /// every 64 turns), then — [`WaitStrategy::SpinYieldPark`] only — sleep on the epoch
    /// futex in slices of at most 10 ms (so a lost wake-up from a misbehaving peer costs at
    /// most that). [`WaitStrategy::BusySpin`] spins until the deadline.
    pub(crate) fn wait_durable(
        &self,
        seq: u64,
        timeout: Duration,
        strategy: WaitStrategy,
    ) -> Result<(), JournalError> {
        // Turns of spinning, then of yielding, before parking (`u64::MAX`: until the deadline).
        let (spins, yields) = match strategy {
            WaitStrategy::BusySpin => (u64::MAX, 0),
            WaitStrategy::SpinYield { spins } => (u64::from(spins), u64::MAX),
            WaitStrategy::SpinYieldPark { spins, yields } => (u64::from(spins), u64::from(yields)),
        };
        let d = &self.block().durable.0;
        let deadline = Instant::now() + timeout;
        let busy = spins.saturating_add(yields);
        let mut i = 0u64;
        // Bounded by the deadline, checked (with the writer's state) every 64 turns.
        while i < busy {
            if self.durable_seq() >= seq {
                return Ok(());
            }
            if i % 64 == 63 {
                self.check_state()?;
                if Instant::now() >= deadline {
                    return Err(JournalError::Timeout { seq, durable: self.durable_seq() });
                }
            }
            if i < spins {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
            i += 1;
        }
        loop {
            let epoch = d.epoch.load(Ordering::Acquire);
            if self.durable_seq() >= seq {
                return Ok(());
            }
            self.check_state()?;
            let now = Instant::now();
            if now >= deadline {
                return Err(JournalError::Timeout { seq, durable: self.durable_seq() });
            }
            d.waiters.fetch_add(1, Ordering::Relaxed);
            // Pairs with the writer's fence in `bump_and_wake`.
            fence(Ordering::SeqCst);
            if self.durable_seq() < seq && d.epoch.load(Ordering::Relaxed) == epoch {
                let slice = (deadline - now).min(Duration::from_millis(10));
                futex_wait(&d.epoch, epoch, slice);
            }
            d.waiters.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// How [`Journal::wait_durable`](super::Journal::wait_durable) waits: 2048 spins (a few
    /// µs), then sleep on the futex.
    pub(crate) const DEFAULT_WAIT: WaitStrategy =
        WaitStrategy::SpinYieldPark { spins: 2048, yields: 0 };

    /// An error if the writer is no longer running.
    pub(crate) fn check_state(&self) -> Result<(), JournalError> {
        match self.state() {
            STATE_RUNNING => Ok(()),
            STATE_CLOSED => Err(JournalError::Closed),
            STATE_PRODUCER_FAULT => Err(JournalError::ProducerFault),
            STATE_DEVICE_FULL => Err(JournalError::DeviceFull),
            _ => Err(JournalError::WriterFailed),
        }
    }
}

fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY:
    // - `word` is a valid, aligned u32 in a mapping that outlives the call.
    // - A shared (non-private) futex: the writer may be another process. The kernel only reads
    //   the word; `ts` lives across the call. Any result (EAGAIN, ETIMEDOUT, EINTR) is fine:
    //   the caller re-checks its condition.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a valid, aligned u32 in a live mapping; the kernel reads nothing
    // else and writes nothing.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            0usize,
            0usize,
            0u32,
        );
    }
}

/// The journal service's doorbell: one shared page whose first word the writer sleeps on when
/// every producer ring is empty, and which every producer rings after publishing
/// ([`fastlane_ring::shm::doorbell`]). A page of its own, so that a producer that scribbles on
/// it reaches nothing but the wake-ups (which the writer bounds by its idle slice).
#[derive(Debug)]
pub(crate) struct Doorbell {
    map: MmapRaw,
    file: File,
}

impl Doorbell {
    /// A new doorbell in a memfd.
    pub(crate) fn create() -> Result<Doorbell, JournalError> {
        Self::map(sealed_memfd("fastlane-journal-doorbell", DOORBELL_LEN as u64)?)
    }

    /// Maps a doorbell received as a file descriptor.
    pub(crate) fn from_fd(fd: OwnedFd) -> Result<Doorbell, JournalError> {
        let file = File::from(fd);
        let len = file.metadata().map_err(io_err("fstat doorbell"))?.len();
        if len < DOORBELL_LEN as u64 {
            return Err(JournalError::BadControl { what: "doorbell too short", value: len });
        }
        Self::map(file)
    }

    fn map(file: File) -> Result<Doorbell, JournalError> {
        let map =
            MmapOptions::new().len(DOORBELL_LEN).map_raw(&file).map_err(io_err("mmap doorbell"))?;
        Ok(Doorbell { map, file })
    }

    /// The futex word.
    #[inline]
    pub(crate) fn word(&self) -> &AtomicU32 {
        // SAFETY: the mapping is `DOORBELL_LEN` bytes, page-aligned (so aligned for u32), lives
        // as long as `self`; an atomic accepts every bit pattern and concurrent writes from
        // other processes.
        unsafe { &*self.map.as_ptr().cast::<AtomicU32>() }
    }

    /// The file behind the mapping (to pass to a producer).
    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    /// A second mapping of the same page (for another thread's handle).
    pub(crate) fn reopen(&self) -> Result<Doorbell, JournalError> {
        Self::map(self.file.try_clone().map_err(io_err("dup doorbell"))?)
    }
}

/// Size of the doorbell mapping.
const DOORBELL_LEN: usize = 4096;
