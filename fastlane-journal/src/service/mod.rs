//! The journal service: one process owns a segment directory and its writer; any number of
//! producer processes attach over `DIR/journal.sock` and append through rings of their own.
//!
//! ```text
//! producer A ─ ring A (memfd) ─┐                      ┌─► DIR/00000000000000000000.seg
//! producer B ─ ring B (memfd) ─┼─► writer: one global ─┤   DIR/00000000000000000001.seg …
//! producer C ─ ring C (memfd) ─┘   sequence, group     └─► per-producer durable seq in
//!        ▲ doorbell (one word all rings ring)  commit       each producer's control block
//! ```
//!
//! - **Attach** ([`wire`]): the producer connects to the socket; the service reads its
//!   credentials from the kernel (`SO_PEERCRED`), allows its own user, root, and the users and
//!   groups of [`ServiceConfig::allow_uids`]/[`allow_gids`](ServiceConfig::allow_gids) (and
//!   whoever can reach the socket at all is decided by the directory's permissions), then
//!   sends three sealed memfds: the producer's ring, its control block, the doorbell. The
//!   connection stays open; its end is the detach.
//! - **Merge**: the writer drains every ring round robin, gives each record the next global
//!   seq, writes the producer's id into the frame's `flags`, and acknowledges each producer's
//!   records in its own control block when a flush covers them (`sources.rs`). A producer
//!   that writes garbage into its ring is shut off alone (its control block says
//!   `ProducerFault`, [`ServiceStats::faults`] counts it); one that dies leaves a closed
//!   socket: its ring is drained, acknowledged and dropped.
//! - **Segments** ([`super::segments`]): when the next record does not fit, the
//!   writer drains, installs the next segment (prepared in the background, superblock with the
//!   next first seq and the chain head), and goes on; retention runs after each roll. With no
//!   room for a segment the roll is retried every 100 ms while the producers' rings fill and
//!   push back (their appends see `Full`); nothing already acknowledged is touched.
//! - **Recovery**: on start the last segment is recovered as a single journal is (torn tail
//!   zeroed, numbering resumed); producers attach again and number from 1 in their new ring.

mod roll;
mod spare;
pub mod wire;

use std::fs::OpenOptions;
use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fastlane_block::BlockDevice;
use fastlane_ring::shm::{doorbell, ShmRing};
use fastlane_ring::WaitStrategy;

use super::control::{Control, Doorbell};
use super::format::{self, Durability, Superblock};
use super::segments::{Retention, SegmentDir};
use super::sources::{ProducerCounters, Source};
use super::stats::WriterStats;
use super::writer::{ServiceInputs, Writer, WriterIo, WriterParts};
use super::{check_limits, open_device, random_id, JournalError, JournalProducer, Seq};
use wire::{Hello, PeerCred, Reply, Status, HELLO_LEN, REPLY_LEN};

/// The socket producers attach through, inside the service's directory.
pub const SOCKET_NAME: &str = "journal.sock";
/// The log of every attach (one line each: id, name, pid, uid, gid, time), inside the directory.
pub const PRODUCERS_LOG: &str = "producers.log";
/// How long a connecting producer has to send its hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(2);
/// Connections at once that have not sent their hello yet.
const PENDING_MAX: usize = 64;
/// How often the acceptor looks at its stop flag.
const ACCEPT_POLL: Duration = Duration::from_millis(100);
/// Default ring of one producer.
pub const RING_BYTES_DEFAULT: usize = 4 << 20;
/// Largest ring a producer may ask for.
pub const RING_BYTES_MAX: usize = 256 << 20;

/// Opens a segment file as a block device (the CLI picks the engine).
pub type OpenSegment =
    Arc<dyn Fn(&Path) -> Result<Arc<dyn BlockDevice>, JournalError> + Send + Sync>;

/// Removes a segment file that retention let go (`std::fs::remove_file` by default).
pub type RemoveSegment = Arc<dyn Fn(&Path) -> std::io::Result<()> + Send + Sync>;

/// How to run the service.
pub struct ServiceConfig {
    /// The segment directory (created if missing, mode 0750).
    pub dir: PathBuf,
    /// Bytes of each segment file (superblock included).
    pub segment_bytes: u64,
    /// When a record counts as durable (`memory` or `local`).
    pub durability: Durability,
    /// Ring of a producer that asks for none.
    pub ring_bytes: usize,
    /// Longest payload (a new directory only; an existing one keeps its own).
    pub max_record_bytes: u32,
    /// Most bytes per batch write (a new directory only).
    pub max_batch_bytes: u32,
    /// Most producers attached at once.
    pub max_producers: usize,
    /// Users allowed to attach besides the service's own and root.
    pub allow_uids: Vec<u32>,
    /// Groups allowed to attach.
    pub allow_gids: Vec<u32>,
    /// Which segments to keep.
    pub retention: Retention,
    /// How fast the next segment's file is prepared (written zeroes) in the background, bytes
    /// per second (0: as fast as the device goes). Paced so that the journal's own writes
    /// wait behind at most one piece of it; fast enough to be ready before the segment in use
    /// fills (a roll with no spare ready prepares one and waits).
    pub spare_bytes_per_s: u64,
    /// Raise the spare's pace while the segment in use fills fast enough that the spare
    /// would not be ready in time (`spare.rs`); `spare_bytes_per_s` stays the least pace.
    pub spare_adaptive: bool,
    /// Pin the writer thread to this core.
    pub writer_core: Option<usize>,
    /// How the idle writer waits on the doorbell.
    pub writer_wait: WaitStrategy,
    /// How the writer does its I/O: [`WriterIo::Pipelined`] or [`WriterIo::Dsync`] (the
    /// flusher threads acknowledge a single journal's producer only).
    pub writer_io: WriterIo,
    /// Opens a segment file.
    pub open: OpenSegment,
    /// Removes a segment retention let go, on the spare's thread, never the writer's.
    pub remove: RemoveSegment,
}

impl std::fmt::Debug for ServiceConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceConfig")
            .field("dir", &self.dir)
            .field("segment_bytes", &self.segment_bytes)
            .field("durability", &self.durability)
            .field("ring_bytes", &self.ring_bytes)
            .field("max_producers", &self.max_producers)
            .field("retention", &self.retention)
            .finish_non_exhaustive()
    }
}

/// How the service's idle writer waits for records by default: a short spin, then up to
/// 2,048 `sched_yield`s (1–2 ms on an idle core), then sleep on the doorbell. Longer than the
/// rings' default (64 yields) because a record arriving every millisecond or so otherwise
/// finds the writer asleep and pays its wake-up: at 2,000 records/s, alternating 3-round
/// runs gave ack P50/P99 92/171 µs against 113/203 µs with 64 yields, no worse at 20,000 or
/// 200,000/s or with three producers. Yielding gives the core to anything else runnable; an
/// idle service still sleeps.
pub const WRITER_WAIT: WaitStrategy = WaitStrategy::SpinYieldPark { spins: 128, yields: 2048 };

impl ServiceConfig {
    /// Defaults for `dir`: 256 MiB segments, `local`, 4 MiB rings, 64 producers, keep every
    /// segment, segments opened with io_uring (page cache).
    pub fn new(dir: impl Into<PathBuf>) -> ServiceConfig {
        ServiceConfig {
            dir: dir.into(),
            segment_bytes: 256 << 20,
            durability: Durability::Local,
            ring_bytes: RING_BYTES_DEFAULT,
            max_record_bytes: 4096,
            max_batch_bytes: 1 << 20,
            max_producers: 64,
            allow_uids: Vec::new(),
            allow_gids: Vec::new(),
            retention: Retention::default(),
            spare_bytes_per_s: 128 << 20,
            spare_adaptive: true,
            writer_core: None,
            writer_wait: WRITER_WAIT,
            writer_io: WriterIo::Pipelined,
            open: Arc::new(|p: &Path| {
                let dev = fastlane_block::uring::UringDevice::open(p, Default::default()).map_err(
                    |e| JournalError::Io {
                        op: "open segment",
                        source: std::io::Error::other(e.to_string()),
                    },
                )?;
                Ok(Arc::new(dev) as Arc<dyn BlockDevice>)
            }),
            remove: Arc::new(|p: &Path| std::fs::remove_file(p)),
        }
    }
}

/// One attached (or recently detached) producer.
#[derive(Debug, Clone)]
pub struct ProducerInfo {
    /// Its id, written into each of its frames.
    pub id: u32,
    /// The name it gave.
    pub name: String,
    /// Who it is.
    pub cred: PeerCred,
    /// Records framed.
    pub records: u64,
    /// Payload bytes framed.
    pub bytes: u64,
    /// Its local seq acknowledged durable.
    pub durable_local: u64,
    /// Its ring was shut off.
    pub faulted: bool,
    /// Its ring was dropped (detached and drained, or faulted).
    pub gone: bool,
}

/// What the service has done.
#[derive(Debug, Clone, Default)]
pub struct ServiceStats {
    /// The highest durable global seq.
    pub durable_seq: Seq,
    /// Records written since start.
    pub records: u64,
    /// Bytes written to segments since start.
    pub bytes_written: u64,
    /// Batches (one write each).
    pub batches: u64,
    /// Flushes.
    pub flushes: u64,
    /// Segments rolled to since start.
    pub rolls: u64,
    /// Rolls retried for lack of room.
    pub roll_failures: u64,
    /// Time the writer spent rolling (failed rolls and waits for the spare included): every
    /// durable ack waits meanwhile.
    pub roll_time: Duration,
    /// Attaches accepted since start.
    pub attaches: u64,
    /// Attaches refused (credentials, limit, malformed hello).
    pub refused: u64,
    /// Producers whose ring was shut off.
    pub faults: u64,
    /// Index of the segment being written.
    pub segment: u64,
    /// The next segment's file is prepared (a roll now costs only its superblock).
    pub spare_ready: bool,
    /// The pace the spare being prepared asked for last, bytes/s (0: unpaced, or no spare
    /// being written).
    pub spare_pace: u64,
    /// Rolls that found the next segment's file not ready and waited for it.
    pub spare_waits: u64,
    /// Time those rolls waited, in total.
    pub spare_wait: Duration,
    /// Segments retention removed since start.
    pub segments_removed: u64,
    /// Removals that failed (the files stay; the next roll's retention tries them again
    /// only after a restart, which lists the directory anew).
    pub retention_failures: u64,
    /// How long batches waited in the writer before they were durable.
    pub commit_latency: super::CommitLatency,
    /// Producers attached now or since the last [`Service::stats`] that reported them gone.
    pub producers: Vec<ProducerInfo>,
}

/// Counters of the acceptor.
#[derive(Debug, Default)]
struct AcceptCounters {
    attaches: AtomicU64,
    refused: AtomicU64,
    segment: AtomicU64,
    /// Set by the spare's thread when it is ready, cleared by the roll that takes it.
    spare_ready: Arc<AtomicBool>,
    /// The spare's pace, bytes/s (`SparePacer::shown`).
    spare_pace: Arc<AtomicU64>,
    spare_waits: AtomicU64,
    spare_wait_ns: AtomicU64,
    segments_removed: AtomicU64,
    retention_failures: AtomicU64,
    /// What the last failed removal said.
    retention_error: Mutex<String>,
}

impl AcceptCounters {
    /// A retention step failed (deciding, or removing on the spare's thread): counted, and
    /// `e` with its sources kept for the log.
    fn retention_failed(&self, e: &dyn std::error::Error) {
        let mut why = e.to_string();
        let mut next = e.source();
        // Bounded by the chain's length.
        while let Some(s) = next {
            why.push_str(": ");
            why.push_str(&s.to_string());
            next = s.source();
        }
        if let Ok(mut w) = self.retention_error.lock() {
            *w = why;
        }
        self.retention_failures.fetch_add(1, Ordering::Relaxed);
    }
}

struct Attached {
    info: ProducerInfo,
    counters: Arc<ProducerCounters>,
}

/// A running journal service.
pub struct Service {
    dir: PathBuf,
    control: Control,
    writer: Option<JoinHandle<Result<(), JournalError>>>,
    acceptor: Option<JoinHandle<()>>,
    stop: Arc<AtomicBool>,
    accept_stop: Arc<AtomicBool>,
    stats: Arc<WriterStats>,
    accept: Arc<AcceptCounters>,
    producers: Arc<Mutex<Vec<Attached>>>,
    superblock: Superblock,
    recovered: Recovered,
}

impl std::fmt::Debug for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Service").field("dir", &self.dir).finish_non_exhaustive()
    }
}

/// Reads the service's durable seq ([`Service::durable_view`]).
#[derive(Debug)]
pub struct DurableView {
    control: Control,
}

impl DurableView {
    /// The highest durable global seq. One load.
    pub fn get(&self) -> Seq {
        self.control.durable_seq()
    }
}

/// What start found in the directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recovered {
    /// Segments present.
    pub segments: usize,
    /// The last durable seq found (0: an empty journal).
    pub last_seq: Seq,
    /// Whether a torn tail was zeroed in the last segment.
    pub truncated: bool,
    /// Whether the directory was new.
    pub created: bool,
}

impl Service {
    /// Opens (or creates) the directory, recovers its last segment, starts the writer and
    /// listens on `DIR/journal.sock`.
    pub fn start(config: ServiceConfig) -> Result<Service, JournalError> {
        if !matches!(config.durability, Durability::Memory | Durability::Local) {
            return Err(JournalError::Config("the service writes at memory or local durability"));
        }
        if !(4096..=RING_BYTES_MAX).contains(&config.ring_bytes)
            || !config.ring_bytes.is_power_of_two()
        {
            return Err(JournalError::Config(
                "ring bytes must be a power of two, 4 KiB to 256 MiB",
            ));
        }
        if config.writer_io == WriterIo::Flusher {
            return Err(JournalError::Config("the service writes pipelined or dsync"));
        }
        if config.max_producers == 0 || config.max_producers > u16::MAX as usize {
            return Err(JournalError::Config("max producers must be 1 to 65535"));
        }
        let mut dir = SegmentDir::open(&config.dir, true)?;
        let (device, sb, created) = match dir.last() {
            Some(last) => {
                let device = (config.open)(&last.path)?;
                let sb = {
                    let mut dev = open_device(&*device)?;
                    let mut reader = super::io::BlockReader::new(&mut dev);
                    super::scan::read_superblock(&mut reader).map_err(|e| match e {
                        super::scan::ScanError::Super(e) => JournalError::Superblock(e),
                        super::scan::ScanError::Io(source) => {
                            JournalError::Io { op: "superblock read", source }
                        }
                    })?
                };
                (device, sb, false)
            }
            None => {
                check_limits(config.max_record_bytes, config.max_batch_bytes)?;
                let sb = Superblock::new(
                    random_id()?,
                    super::preprocess::realtime_ns(),
                    1,
                    config.max_batch_bytes,
                    config.max_record_bytes,
                    config.durability,
                );
                let path = dir.install(&sb, config.segment_bytes)?;
                ((config.open)(&path)?, sb, true)
            }
        };
        if config.segment_bytes < format::DATA_OFFSET + 2 * sb.torn_window() {
            return Err(JournalError::Config("segment too small for the journal's batch size"));
        }
        let mut dev = open_device(&*device)?;
        let (scan, buf, truncated) = super::recover(&mut dev, &mut |_| true)?;
        let recovered = Recovered {
            segments: dir.segments().len(),
            last_seq: scan.last_seq,
            truncated,
            created,
        };
        let control = Control::create_memfd(
            sb.journal_id,
            sb.max_record_bytes,
            config.durability,
            1,
            scan.last_seq,
        )?;
        let doorbell = Doorbell::create()?;
        let (tx, rx) = mpsc::channel();
        let arrived = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(WriterStats::default());
        stats.end.store(scan.end, Ordering::Relaxed);
        let accept = Arc::new(AcceptCounters::default());
        accept.segment.store(sb.segment, Ordering::Relaxed);
        let roll = roll::SegmentRoll {
            dir: config.dir.clone(),
            segments: dir,
            bytes: config.segment_bytes,
            pace: config.spare_bytes_per_s,
            adaptive: config.spare_adaptive,
            stats: Arc::clone(&stats),
            open: Arc::clone(&config.open),
            remove: Arc::clone(&config.remove),
            retention: config.retention,
            expired: Vec::new(),
            current: sb,
            spare: None,
            retired: Vec::new(),
            accept: Arc::clone(&accept),
        };
        let mut roll = roll;
        roll.prepare_next();
        let writer = Writer::new(WriterParts {
            dev,
            buf,
            end: scan.end,
            key: sb.chain_key(),
            head: scan.head,
            last_seq: scan.last_seq,
            sb,
            durability: config.durability,
            replica: None,
            pre: Box::new(super::SoftPreprocess::default()),
            sources: Vec::new(),
            service: Some(ServiceInputs {
                incoming: rx,
                arrived: Arc::clone(&arrived),
                doorbell: doorbell.reopen()?,
                roll: Box::new(roll),
            }),
            writer_wait: config.writer_wait,
            control: control.reopen()?,
            stats: Arc::clone(&stats),
            stop: Arc::clone(&stop),
            core: config.writer_core,
            io: config.writer_io,
            device,
        });
        let handle = std::thread::Builder::new()
            .name("journal-writer".into())
            .spawn(move || writer.run())
            .map_err(|source| JournalError::Io { op: "spawn writer", source })?;
        let socket = config.dir.join(SOCKET_NAME);
        let _ = std::fs::remove_file(&socket);
        let listener = UnixListener::bind(&socket)
            .map_err(|source| JournalError::Io { op: "bind journal.sock", source })?;
        // Who can reach the socket at all is the directory's business; the socket itself is
        // open to the owner and the group.
        let _ = std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o660));
        listener
            .set_nonblocking(true)
            .map_err(|source| JournalError::Io { op: "socket nonblocking", source })?;
        let producers = Arc::new(Mutex::new(Vec::new()));
        let accept_stop = Arc::new(AtomicBool::new(false));
        let acceptor = Acceptor {
            listener,
            sender: tx,
            arrived,
            doorbell,
            journal_id: sb.journal_id,
            max_record_bytes: sb.max_record_bytes,
            durability: config.durability,
            ring_bytes: config.ring_bytes,
            max_producers: config.max_producers,
            allow_uids: config.allow_uids.clone(),
            allow_gids: config.allow_gids.clone(),
            log_path: config.dir.join(PRODUCERS_LOG),
            next_id: next_producer_id(&config.dir.join(PRODUCERS_LOG)),
            producers: Arc::clone(&producers),
            counters: Arc::clone(&accept),
            stop: Arc::clone(&accept_stop),
        };
        let acceptor = std::thread::Builder::new()
            .name("journal-accept".into())
            .spawn(move || acceptor.run())
            .map_err(|source| JournalError::Io { op: "spawn acceptor", source })?;
        Ok(Service {
            dir: config.dir,
            control,
            writer: Some(handle),
            acceptor: Some(acceptor),
            stop,
            accept_stop,
            stats,
            accept,
            producers,
            superblock: sb,
            recovered,
        })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// What start found.
    pub fn recovered(&self) -> Recovered {
        self.recovered
    }

    /// The superblock of the segment the service started on.
    pub fn superblock(&self) -> Superblock {
        self.superblock
    }

    /// The highest durable global seq. One load.
    pub fn durable_seq(&self) -> Seq {
        self.control.durable_seq()
    }

    /// A handle that reads the durable seq (one load) from any thread, and keeps working after
    /// the service stopped (it then reads the final value): for a reader of the segments, such
    /// as the export, that must not read past what is durable.
    pub fn durable_view(&self) -> Result<DurableView, JournalError> {
        Ok(DurableView { control: self.control.reopen()? })
    }

    /// Waits until global `seq` is durable.
    pub fn wait_durable(&self, seq: Seq, timeout: Duration) -> Result<(), JournalError> {
        self.control.wait_durable(seq, timeout, Control::DEFAULT_WAIT)
    }

    /// The writer stopped on an error (its control block says so).
    pub fn check(&self) -> Result<(), JournalError> {
        self.control.check_state()
    }

    /// Rolls that waited for the next segment's file, and how long in total: two loads, for a
    /// caller that polls them often ([`Service::stats`] also copies every producer's entry).
    pub fn spare_waits(&self) -> (u64, Duration) {
        (
            self.accept.spare_waits.load(Ordering::Relaxed),
            Duration::from_nanos(self.accept.spare_wait_ns.load(Ordering::Relaxed)),
        )
    }

    /// The next segment's file is prepared (false while the spare is being written, and
    /// during a roll): one load, for a caller that polls it per record.
    pub fn spare_ready(&self) -> bool {
        self.accept.spare_ready.load(Ordering::Relaxed)
    }

    /// Retention removals that failed since start, and what the last one said.
    pub fn retention_failures(&self) -> (u64, String) {
        let why = self.accept.retention_error.lock().map(|w| w.clone()).unwrap_or_default();
        (self.accept.retention_failures.load(Ordering::Relaxed), why)
    }

    /// Counters, and every producer attached since start (detached ones included, marked
    /// `gone`).
    pub fn stats(&self) -> ServiceStats {
        let s = &self.stats;
        let producers: Vec<ProducerInfo> = match self.producers.lock() {
            Ok(list) => list
                .iter()
                .map(|a| {
                    let k = &a.counters;
                    let mut info = a.info.clone();
                    info.records = k.records.load(Ordering::Relaxed);
                    info.bytes = k.bytes.load(Ordering::Relaxed);
                    info.durable_local = k.durable_local.load(Ordering::Relaxed);
                    info.faulted = k.faulted.load(Ordering::Relaxed);
                    info.gone = k.gone.load(Ordering::Relaxed);
                    info
                })
                .collect(),
            Err(_) => Vec::new(),
        };
        let (spare_waits, spare_wait) = self.spare_waits();
        ServiceStats {
            durable_seq: self.durable_seq(),
            records: s.records.load(Ordering::Relaxed),
            bytes_written: s.bytes_written.load(Ordering::Relaxed),
            batches: s.batches.load(Ordering::Relaxed),
            flushes: s.flushes.load(Ordering::Relaxed),
            rolls: s.rolls.load(Ordering::Relaxed),
            roll_failures: s.roll_failures.load(Ordering::Relaxed),
            roll_time: Duration::from_nanos(s.roll_ns.load(Ordering::Relaxed)),
            attaches: self.accept.attaches.load(Ordering::Relaxed),
            refused: self.accept.refused.load(Ordering::Relaxed),
            faults: producers.iter().filter(|p| p.faulted).count() as u64,
            segment: self.accept.segment.load(Ordering::Relaxed),
            spare_ready: self.accept.spare_ready.load(Ordering::Relaxed),
            spare_pace: self.accept.spare_pace.load(Ordering::Relaxed),
            spare_waits,
            spare_wait,
            segments_removed: self.accept.segments_removed.load(Ordering::Relaxed),
            retention_failures: self.accept.retention_failures.load(Ordering::Relaxed),
            commit_latency: s.commit.snapshot(),
            producers,
        }
    }

    /// Stops taking producers, lets the writer make durable what the rings hold, and stops
    /// it. Producers still attached see `Closed`.
    pub fn stop(mut self) -> Result<ServiceStats, JournalError> {
        let r = self.shutdown();
        let stats = self.stats();
        r.map(|()| stats)
    }

    fn shutdown(&mut self) -> Result<(), JournalError> {
        self.accept_stop.store(true, Ordering::Release);
        if let Some(a) = self.acceptor.take() {
            let _ = a.join();
        }
        self.stop.store(true, Ordering::Release);
        let r = match self.writer.take() {
            Some(h) => h.join().unwrap_or(Err(JournalError::WriterFailed)),
            None => Ok(()),
        };
        let _ = std::fs::remove_file(self.dir.join(SOCKET_NAME));
        r
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        if self.writer.is_some() {
            let _ = self.shutdown();
        }
    }
}

/// The next free producer id: one past the largest in the attach log (ids are never reused
/// within a directory, so a frame's producer id names one attach).
fn next_producer_id(log: &Path) -> u32 {
    let Ok(text) = std::fs::read_to_string(log) else { return 1 };
    let max = text
        .lines()
        .filter_map(|l| l.split_whitespace().next()?.parse::<u32>().ok())
        .max()
        .unwrap_or(0);
    max.saturating_add(1).max(1)
}

/// A connection on its way to attaching.
struct Pending {
    stream: UnixStream,
    cred: PeerCred,
    since: Instant,
    got: usize,
    buf: [u8; HELLO_LEN],
}

/// An attached producer's connection.
struct Live {
    stream: UnixStream,
    detached: Arc<AtomicBool>,
}

struct Acceptor {
    listener: UnixListener,
    sender: Sender<Source>,
    arrived: Arc<AtomicBool>,
    doorbell: Doorbell,
    journal_id: [u8; 16],
    max_record_bytes: u32,
    durability: Durability,
    ring_bytes: usize,
    max_producers: usize,
    allow_uids: Vec<u32>,
    allow_gids: Vec<u32>,
    log_path: PathBuf,
    next_id: u32,
    producers: Arc<Mutex<Vec<Attached>>>,
    counters: Arc<AcceptCounters>,
    stop: Arc<AtomicBool>,
}

impl Acceptor {
    fn run(mut self) {
        let mut pending: Vec<Pending> = Vec::new();
        let mut live: Vec<Live> = Vec::new();
        while !self.stop.load(Ordering::Acquire) {
            let mut fds = Vec::with_capacity(1 + pending.len() + live.len());
            fds.push(pollfd(self.listener.as_fd()));
            fds.extend(pending.iter().map(|p| pollfd(p.stream.as_fd())));
            fds.extend(live.iter().map(|l| pollfd(l.stream.as_fd())));
            let timeout = ACCEPT_POLL.as_millis() as i32;
            // SAFETY: `fds` is a live array of `fds.len()` pollfd structs.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
            if n < 0 {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            // Attached producers whose socket ended (or sent anything: they never should).
            let base = 1 + pending.len();
            let mut i = live.len();
            while i > 0 {
                i -= 1;
                if fds[base + i].revents != 0 {
                    let mut b = [0u8; 64];
                    let mut s = &live[i].stream;
                    let gone = !matches!(s.read(&mut b), Err(ref e) if e.kind() == std::io::ErrorKind::WouldBlock);
                    if gone {
                        let l = live.swap_remove(i);
                        l.detached.store(true, Ordering::Release);
                        doorbell::ring(self.doorbell.word());
                    }
                }
            }
            // Hellos.
            let mut i = pending.len();
            while i > 0 {
                i -= 1;
                let ready = fds[1 + i].revents != 0;
                let expired = pending[i].since.elapsed() > HELLO_TIMEOUT;
                if !ready && !expired {
                    continue;
                }
                let mut p = pending.swap_remove(i);
                match read_hello(&mut p) {
                    Ok(None) if !expired => pending.push(p),
                    Ok(None) => self.refuse(&p.stream, Status::BadHello, "no hello in time"),
                    Ok(Some(h)) => {
                        if let Some(l) = self.attach(p, h, live.len()) {
                            live.push(l);
                        }
                    }
                    Err(why) => self.refuse(&p.stream, Status::BadHello, why),
                }
            }
            // New connections (bounded per turn).
            for _ in 0..64 {
                match self.listener.accept() {
                    Ok((stream, _)) => {
                        let cred = match wire::peer_cred(&stream) {
                            Ok(c) => c,
                            Err(_) => continue,
                        };
                        if stream.set_nonblocking(true).is_err() {
                            continue;
                        }
                        if pending.len() >= PENDING_MAX {
                            self.refuse(&stream, Status::TooMany, "too many connections");
                            continue;
                        }
                        pending.push(Pending {
                            stream,
                            cred,
                            since: Instant::now(),
                            got: 0,
                            buf: [0; HELLO_LEN],
                        });
                    }
                    Err(_) => break,
                }
            }
        }
    }

    fn refuse(&self, s: &UnixStream, status: Status, why: &str) {
        self.counters.refused.fetch_add(1, Ordering::Relaxed);
        let _ = wire::send_with_fds(s, &Reply::refused(status, why).encode(), &[]);
    }

    fn allowed(&self, c: &PeerCred) -> bool {
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        c.uid == me
            || c.uid == 0
            || self.allow_uids.contains(&c.uid)
            || self.allow_gids.contains(&c.gid)
    }

    fn attach(&mut self, p: Pending, h: Hello, attached: usize) -> Option<Live> {
        if !self.allowed(&p.cred) {
            self.refuse(&p.stream, Status::Denied, "user not allowed");
            return None;
        }
        if attached >= self.max_producers {
            self.refuse(&p.stream, Status::TooMany, "producer limit reached");
            return None;
        }
        let ring_bytes = match h.ring_bytes as usize {
            0 => self.ring_bytes,
            n if n.is_power_of_two() && (4096..=RING_BYTES_MAX).contains(&n) => n,
            _ => {
                self.refuse(&p.stream, Status::BadHello, "ring bytes: power of two, 4K..256M");
                return None;
            }
        };
        let made =
            (|| -> Result<(ShmRing, Control, fastlane_ring::shm::Consumer), JournalError> {
                let ring = ShmRing::create_memfd("fastlane-journal-producer", ring_bytes)?;
                let consumer = ring.consumer()?;
                let control = Control::create_memfd(
                    self.journal_id,
                    self.max_record_bytes,
                    self.durability,
                    1,
                    0,
                )?;
                Ok((ring, control, consumer))
            })();
        // The consumer role is taken before the producer gets the ring, so nothing it does to
        // the ring afterwards can keep the writer from seeing (and faulting) it.
        let Ok((ring, control, consumer)) = made else {
            self.refuse(&p.stream, Status::Failed, "cannot make the ring");
            return None;
        };
        let id = self.next_id;
        self.next_id = self.next_id.saturating_add(1);
        let line = format!(
            "{id} {} pid={} uid={} gid={} at={}\n",
            h.name,
            p.cred.pid,
            p.cred.uid,
            p.cred.gid,
            super::preprocess::realtime_ns()
        );
        let logged = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o640)
            .open(&self.log_path)
            .and_then(|mut f| f.write_all(line.as_bytes()).and_then(|()| f.sync_data()));
        if logged.is_err() {
            self.refuse(&p.stream, Status::Failed, "cannot log the attach");
            return None;
        }
        let reply = Reply {
            status: Status::Ok,
            producer_id: id,
            max_record_bytes: self.max_record_bytes,
            ring_bytes: ring_bytes as u64,
            journal_id: self.journal_id,
            message: String::new(),
        };
        let sent = wire::send_with_fds(
            &p.stream,
            &reply.encode(),
            &[ring.as_fd(), control.file().as_fd(), self.doorbell.file().as_fd()],
        );
        if sent.is_err() {
            return None;
        }
        let detached = Arc::new(AtomicBool::new(false));
        let counters = Arc::new(ProducerCounters::default());
        let source =
            Source::attached(consumer, control, id, Arc::clone(&detached), Arc::clone(&counters));
        if self.sender.send(source).is_err() {
            return None;
        }
        self.arrived.store(true, Ordering::Release);
        doorbell::ring(self.doorbell.word());
        self.counters.attaches.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut list) = self.producers.lock() {
            // Keep the list bounded: forget producers that are gone, beyond the newest 256.
            if list.len() > 256 {
                list.retain(|a| !a.counters.gone.load(Ordering::Relaxed));
            }
            list.push(Attached {
                info: ProducerInfo {
                    id,
                    name: h.name,
                    cred: p.cred,
                    records: 0,
                    bytes: 0,
                    durable_local: 0,
                    faulted: false,
                    gone: false,
                },
                counters,
            });
        }
        Some(Live { stream: p.stream, detached })
    }
}

fn pollfd(fd: std::os::fd::BorrowedFd<'_>) -> libc::pollfd {
    use std::os::fd::AsRawFd;
    libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 }
}

/// Reads what has arrived of a hello; `Ok(None)`: not complete yet.
fn read_hello(p: &mut Pending) -> Result<Option<Hello>, &'static str> {
    // Bounded: each read either fills bytes or returns WouldBlock/EOF.
    while p.got < HELLO_LEN {
        match (&p.stream).read(&mut p.buf[p.got..]) {
            Ok(0) => return Err("closed before its hello"),
            Ok(n) => p.got += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(None),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return Err("read failed"),
        }
    }
    Hello::decode(&p.buf).map(Some)
}

impl JournalProducer {
    /// Attaches to the journal service of directory `dir` (its socket `DIR/journal.sock`) as
    /// `name`, with the service's default ring. The records get global seqs in the service;
    /// [`append`](JournalProducer::append) returns this producer's own seq (1, 2, 3, …), and
    /// `durable_seq`/`wait_durable` speak of those. Dropping the producer detaches it (so does
    /// the process's exit or death): what it appended is still written.
    pub fn connect(dir: impl AsRef<Path>, name: &str) -> Result<JournalProducer, JournalError> {
        Self::connect_with(dir, name, 0)
    }

    /// [`connect`](JournalProducer::connect) with a ring of `ring_bytes` (a power of two,
    /// 4 KiB to 256 MiB; 0: the service's default).
    pub fn connect_with(
        dir: impl AsRef<Path>,
        name: &str,
        ring_bytes: usize,
    ) -> Result<JournalProducer, JournalError> {
        let path = dir.as_ref().join(SOCKET_NAME);
        let mut s = UnixStream::connect(&path)
            .map_err(|source| JournalError::Io { op: "connect to the journal service", source })?;
        let io = |op| move |source| JournalError::Io { op, source };
        s.set_read_timeout(Some(Duration::from_secs(10))).map_err(io("socket timeout"))?;
        let ring_bytes = u32::try_from(ring_bytes)
            .map_err(|_| JournalError::Config("ring bytes: at most 256 MiB"))?;
        wire::send_hello(&mut s, &Hello { ring_bytes, name: name.to_string() })
            .map_err(io("send hello"))?;
        let mut buf = [0u8; REPLY_LEN];
        let mut fds = wire::recv_with_fds(&s, &mut buf, 3).map_err(io("read attach reply"))?;
        let reply =
            Reply::decode(&buf).map_err(|what| JournalError::BadControl { what, value: 0 })?;
        if reply.status != Status::Ok {
            return Err(JournalError::Refused { status: reply.status, message: reply.message });
        }
        if fds.len() != 3 {
            return Err(JournalError::BadControl {
                what: "attach reply without its descriptors",
                value: fds.len() as u64,
            });
        }
        let bell = Doorbell::from_fd(fds.remove(2))?;
        let (control, info) = Control::from_fd(fds.remove(1))?;
        let ring = ShmRing::from_fd(fds.remove(0))?;
        control.check_state()?;
        let tx = ring.producer()?;
        let mut p = JournalProducer::new(tx, control, info.max_record_bytes)?;
        p.attach_service(bell, s, reply.producer_id)?;
        Ok(p)
    }
}

#[cfg(test)]
mod tests;
