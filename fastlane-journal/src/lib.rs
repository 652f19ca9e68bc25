//! FastLane's record journal: durable, replicated audit and order-book records.
//!
//! A producer — in this process or another one attached to the shared mapping — calls
//! [`JournalProducer::append`], which copies the record into a shared-memory byte ring
//! ([`fastlane_ring::shm`]) and returns its sequence number: no allocation, no lock, no
//! syscall. One writer thread drains the ring in batches, frames each record (seq, length,
//! timestamp, CRC32C, and a BLAKE3 hash chain linking it to the record before it), writes the
//! batch through the block seam ([`fastlane_block`]) with one write and one flush (group commit),
//! mirrors it to a [`Replica`] in parallel, and publishes the durable seq in a shared control
//! block: [`Journal::durable_seq`] / [`JournalProducer::durable_seq`] read it with one load,
//! `wait_durable` sleeps on it.
//!
//! ```no_run
//! # fn main() -> Result<(), fastlane_journal::JournalError> {
//! use std::time::Duration;
//! use std::sync::Arc;
//! use fastlane_block::uring::{UringDevice, UringOptions};
//! use fastlane_journal::{Durability, Journal, JournalConfig};
//! let dev = UringDevice::open("/var/lib/audit.journal", UringOptions::default()).unwrap();
//! let journal = Journal::open_or_create(JournalConfig::new(Arc::new(dev), Durability::Local))?;
//! let mut tx = journal.producer()?;
//! let seq = tx.append(b"order 42 filled")?;
//! tx.wait_durable(seq, Duration::from_secs(1))?;
//! # Ok(()) }
//! ```
//!
//! Recovery ([`Journal::open`]) scans to the last valid frame (length, CRC, seq, chain),
//! zeroes the torn tail after it and resumes numbering; a damaged frame *followed by more
//! data* than one batch could have torn is refused as [`JournalError::Corrupt`] rather than
//! silently truncated. [`verify()`] walks the chain and names the first changed, removed or
//! reordered record. The on-disk format is described in `docs/journal.md` and [`mod@format`].
//!
//! What this crate does not do: more than one producer per journal at a time (one ring, one
//! producer role), or reuse of space (a journal fills its device and then reports
//! [`JournalError::DeviceFull`]). A replica that fell behind is brought up to date on open,
//! after its claimed position was checked against the hash chain (see `resync`).
// Files on disk are outside input (format, scan, verify): errors, not panics.
#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

mod control;
pub mod dir_verify;
mod flusher;
pub mod format;
pub mod fuzzing;
mod io;
pub mod preprocess;
mod producer;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod replica;
mod resync;
pub mod scan;
pub mod segments;
pub mod service;
mod sources;
mod stats;
pub mod tail;
pub mod verify;
mod writer;

#[cfg(test)]
mod fault;
#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use fastlane_ring::shm::{Consumer, ShmError, ShmRing};
use fastlane_ring::WaitStrategy;

pub use dir_verify::{read_from, verify_dir, DirProblem, DirVerifyReport, ReadEnd, ReadStop};
use fastlane_block::{BlockDevice, BlockError, BlockOp, BlockRequest};
pub use format::{Durability, Superblock};
pub use io::ReadAt;
pub use preprocess::{CardPreprocess, FrameSlot, Preprocess, PreprocessError, SoftPreprocess};
pub use producer::{control_path, JournalProducer};
pub use replica::{
    image_position, FileReplica, MemReplica, Replica, ReplicaError, ReplicaJournal, ReplicaPosition,
};
pub use resync::{ResyncAction, ResyncReport};
pub use scan::{scan, Scan, Stop};
pub use segments::{
    prepare_spare, prepare_spare_paced, Retention, SegmentDir, SegmentError, SegmentInfo,
};
pub use sources::ProducerCounters;
pub use stats::{CommitLatency, COMMIT_BUCKETS_NS};
pub use tail::{TailRecord, Tailer};
pub use verify::{verify, Anchor, Problem, VerifyReport};

use control::Control;
use format::{SuperError, DATA_OFFSET};
use io::{AlignedBuf, BlockReader, Dev};
use stats::WriterStats;
pub use writer::WriterIo;
use writer::{Writer, WriterParts};

/// A record's sequence number. The first record of a journal is 1; 0 means "none".
pub type Seq = u64;

/// The ring record type of journal records.
pub(crate) const RECORD_TYPE: u32 = 0x4A52;
/// Bytes of the seq that precedes each payload in the ring.
pub(crate) const SEQ_PREFIX_LEN: usize = 8;
/// The writer's granularity (and the alignment of `O_DIRECT` memory).
const WRITE_ALIGN: u32 = 4096;

/// Errors of the journal.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JournalError {
    /// The ring is full; nothing was appended. Retry after the writer drains it.
    #[error("journal ring full")]
    Full,
    /// The record is longer than the journal's `max_record_bytes`.
    #[error("record of {len} bytes too large (max {max})")]
    TooLarge {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// `wait_durable` reached its timeout.
    #[error("seq {seq} not durable in time (durable: {durable})")]
    Timeout {
        /// The seq waited for.
        seq: Seq,
        /// The durable seq at the timeout.
        durable: Seq,
    },
    /// The journal was closed.
    #[error("journal closed")]
    Closed,
    /// The writer stopped on an error (see [`Journal::close`]).
    #[error("journal writer failed")]
    WriterFailed,
    /// The writer stopped reading the ring because the producer wrote something impossible.
    #[error("producer fault: the writer stopped reading the ring")]
    ProducerFault,
    /// The device has no room for the next record.
    #[error("journal device full")]
    DeviceFull,
    /// A record in the ring is malformed (hostile or buggy producer).
    #[error("bad record from the producer: {what} ({value})")]
    BadRecord {
        /// What.
        what: &'static str,
        /// The offending value.
        value: u64,
    },
    /// The control block is not what it should be.
    #[error("bad control block: {what} ({value})")]
    BadControl {
        /// What.
        what: &'static str,
        /// The offending value.
        value: u64,
    },
    /// The shared ring failed.
    #[error("ring: {0}")]
    Ring(#[from] ShmError),
    /// A system call failed.
    #[error("{op} failed")]
    Io {
        /// Which.
        op: &'static str,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// A block request failed.
    #[error("block {op} at offset {offset} failed")]
    Block {
        /// Which.
        op: &'static str,
        /// Device offset.
        offset: u64,
        /// Cause.
        #[source]
        source: BlockError,
    },
    /// The block queue refused a request (it should never be full: one request at a time).
    #[error("block queue full")]
    QueueFull,
    /// The device holds no valid journal superblock.
    #[error("superblock: {0}")]
    Superblock(#[from] SuperError),
    /// Damage in the middle of the journal (valid-looking data after it, beyond what one torn
    /// batch could explain). Open refuses rather than truncating acknowledged records; run
    /// `fastlane journal verify`.
    #[error("journal damaged at offset {offset}: {what}; data continues at {data_at}")]
    Corrupt {
        /// Where the last valid frame ends.
        offset: u64,
        /// What is wrong there.
        what: &'static str,
        /// Where non-zero data was found past the torn-tail window.
        data_at: u64,
    },
    /// The configuration cannot work.
    #[error("bad journal configuration: {0}")]
    Config(&'static str),
    /// The replica failed.
    #[error("replica: {0}")]
    Replica(#[from] ReplicaError),
    /// The journal service this producer was attached to went away (its connection closed):
    /// records it did not acknowledge may be lost; attach again when it is back.
    #[error("the journal service went away")]
    ServiceGone,
    /// The journal service refused to attach this producer.
    #[error("the journal service refused the attach ({status:?}): {message}")]
    Refused {
        /// Why.
        status: service::wire::Status,
        /// The service's words.
        message: String,
    },
    /// The preprocessing stage (the card) failed; the writer stopped.
    #[error("preprocess: {0}")]
    Preprocess(#[from] PreprocessError),
}

/// How to create or open a journal.
pub struct JournalConfig {
    /// The device the journal lives on (the whole device: superblock at 0).
    pub device: Arc<dyn BlockDevice>,
    /// When a seq counts as durable.
    pub durability: Durability,
    /// Capacity of the shared ring in bytes (power of two). Default 4 MiB.
    pub ring_bytes: usize,
    /// Where the shared ring lives (control block at this path + `.ctl`) so that other
    /// processes can [`JournalProducer::attach`]; `None`: memfds, this process only. Stale
    /// files at these paths are replaced.
    pub shm_path: Option<PathBuf>,
    /// Longest payload (create only; open takes it from the superblock). Default 4096.
    pub max_record_bytes: u32,
    /// Most bytes per batch write (create only; at most a quarter of the device). Default
    /// 1 MiB.
    pub max_batch_bytes: u32,
    /// Pin the writer thread to this core.
    pub writer_core: Option<usize>,
    /// How the writer waits for records when the ring is empty. Default: spin, yield, then
    /// sleep (a producer then pays one `FUTEX_WAKE`); [`WaitStrategy::BusySpin`] or
    /// `SpinYield` for a writer on its own core.
    pub writer_wait: WaitStrategy,
    /// The replica (required for [`Durability::Replicated`]). On open and create it is
    /// brought up to date from its reported position; one that diverged is refused.
    pub replica: Option<Box<dyn Replica>>,
    /// Rewrite the replica from this journal whatever it holds (instead of refusing a
    /// diverged one). Default false.
    pub replica_rebuild: bool,
    /// The preprocessing stage (CRC32C and timestamps). Default [`SoftPreprocess`].
    pub preprocess: Option<Box<dyn Preprocess>>,
    /// Create only: zero the device with plain writes of zeroes instead of write-zeroes
    /// (`fallocate(ZERO_RANGE)` on a file, which leaves *unwritten* extents that every later
    /// flush must convert: a metadata commit per `fdatasync`). Prefilled, a flush carries
    /// data only, as a WAL that pre-writes its segment. Costs one write of the whole device
    /// at create. Default false.
    pub prefill: bool,
    /// How the writer does its I/O. Default [`WriterIo::Pipelined`].
    pub writer_io: WriterIo,
}

impl std::fmt::Debug for JournalConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JournalConfig")
            .field("durability", &self.durability)
            .field("ring_bytes", &self.ring_bytes)
            .field("shm_path", &self.shm_path)
            .field("max_record_bytes", &self.max_record_bytes)
            .field("max_batch_bytes", &self.max_batch_bytes)
            .field("writer_core", &self.writer_core)
            .field("writer_wait", &self.writer_wait)
            .field("replica", &self.replica.as_ref().map(|r| r.name().to_string()))
            .field("prefill", &self.prefill)
            .field("writer_io", &self.writer_io)
            .finish()
    }
}

impl JournalConfig {
    /// Defaults for `device` at `durability`.
    pub fn new(device: Arc<dyn BlockDevice>, durability: Durability) -> JournalConfig {
        JournalConfig {
            device,
            durability,
            ring_bytes: 4 << 20,
            shm_path: None,
            max_record_bytes: 4096,
            max_batch_bytes: 1 << 20,
            writer_core: None,
            writer_wait: WaitStrategy::default(),
            replica: None,
            replica_rebuild: false,
            preprocess: None,
            prefill: false,
            writer_io: WriterIo::default(),
        }
    }
}

/// What recovery found on open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recovery {
    /// Valid records.
    pub records: u64,
    /// Seq of the last one (`first_seq - 1` if none).
    pub last_seq: Seq,
    /// Device offset after it.
    pub end: u64,
    /// Why the scan stopped there.
    pub stop: Stop,
    /// Whether a torn tail was zeroed.
    pub truncated: bool,
    /// What bringing the replica up to date did (`None` without a replica).
    pub replica: Option<ResyncReport>,
}

/// Writer counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct JournalStats {
    /// Batches written (one write, one flush at `local` and above).
    pub batches: u64,
    /// Records written.
    pub records: u64,
    /// Bytes written to the device (including rewritten partial blocks).
    pub bytes_written: u64,
    /// Flushes.
    pub flushes: u64,
    /// Device offset after the last frame.
    pub end: u64,
}

/// An open journal: the shared ring, the control block and the writer thread.
#[derive(Debug)]
pub struct Journal {
    ring: ShmRing,
    control: Control,
    writer: Option<JoinHandle<Result<(), JournalError>>>,
    stop: Arc<AtomicBool>,
    stats: Arc<WriterStats>,
    recovery: Recovery,
    superblock: Superblock,
    shm_path: Option<PathBuf>,
}

impl Journal {
    /// Formats `config.device` as a new, empty journal (everything on it is lost) and starts
    /// the writer.
    pub fn create(mut config: JournalConfig) -> Result<Journal, JournalError> {
        let mut dev = open_dev(&config)?;
        // A small device gets smaller batches: at most a quarter of it (the torn-tail window
        // must fit comfortably), never less than one largest frame plus a block.
        let quarter = (dev.size_bytes / 4 / u64::from(WRITE_ALIGN) * u64::from(WRITE_ALIGN))
            .min(u64::from(u32::MAX)) as u32;
        let min_batch = format::frame_len(config.max_record_bytes as usize) as u32 + WRITE_ALIGN;
        config.max_batch_bytes = config.max_batch_bytes.min(quarter.max(min_batch));
        check_limits(config.max_record_bytes, config.max_batch_bytes)?;
        let sb = Superblock {
            write_align: WRITE_ALIGN,
            journal_id: random_id()?,
            created_unix_ns: preprocess::realtime_ns(),
            first_seq: 1,
            max_batch_bytes: config.max_batch_bytes,
            max_record_bytes: config.max_record_bytes,
            durability: config.durability,
            version: format::FORMAT_VERSION,
            segment: 0,
            prev_head: [0; format::CHAIN_LEN],
        };
        if dev.size_bytes < DATA_OFFSET + sb.torn_window() + u64::from(WRITE_ALIGN) {
            return Err(JournalError::Config("device too small for the journal's batch size"));
        }
        let mut buf = AlignedBuf::new(sb.max_batch_bytes as usize + 2 * WRITE_ALIGN as usize);
        zero_device(&mut dev, &mut buf, config.device.info().write_zeroes && !config.prefill)?;
        buf.as_mut_slice().fill(0);
        sb.encode(buf.as_mut_slice());
        dev.write(&mut buf, 0, DATA_OFFSET as usize, 0)?;
        dev.flush()?;
        let replica = match config.replica.as_mut() {
            Some(r) => {
                let first = r.position(None)?;
                let local = resync::Local {
                    sb,
                    end: DATA_OFFSET,
                    last_seq: sb.first_seq - 1,
                    head: sb.genesis(),
                    size: dev.size_bytes,
                };
                let mut reader = BlockReader::new(&mut dev);
                let rebuild = config.replica_rebuild;
                Some(resync::resync(&mut **r, &mut reader, &local, first, None, rebuild)?)
            }
            None => None,
        };
        buf.as_mut_slice().fill(0);
        let recovery = Recovery {
            records: 0,
            last_seq: 0,
            end: DATA_OFFSET,
            stop: Stop::Clean,
            truncated: false,
            replica,
        };
        Self::start(config, dev, buf, sb, sb.genesis(), recovery)
    }

    /// Opens the journal on `config.device`: recovers to the last valid record, zeroes a torn
    /// tail, resumes numbering, starts the writer. The superblock's limits win over the
    /// config's.
    pub fn open(mut config: JournalConfig) -> Result<Journal, JournalError> {
        let mut dev = open_dev(&config)?;
        // Ask the replica first, so that the scan below can note this journal's chain value
        // where the replica says it ends.
        let replica_at = match config.replica.as_mut() {
            Some(r) => Some(r.position(None)?),
            None => None,
        };
        let replica_end = match replica_at {
            Some(ReplicaPosition::Journal(j)) => Some(j.end),
            _ => None,
        };
        let mut local_at = None;
        let mut note = |v: scan::Visit<'_>| {
            if Some(v.offset + format::frame_len(v.header.len as usize) as u64) == replica_end {
                local_at = Some((v.header.seq, v.header.chain));
            }
            true
        };
        let (s, buf, window_dirty) = recover(&mut dev, &mut note)?;
        let sb = s.superblock;
        // The replica catches up (or is refused) before the writer acknowledges anything.
        let replica = match (config.replica.as_mut(), replica_at) {
            (Some(r), Some(first)) => {
                let local = resync::Local {
                    sb,
                    end: s.end,
                    last_seq: s.last_seq,
                    head: s.head,
                    size: dev.size_bytes,
                };
                let mut reader = BlockReader::new(&mut dev);
                let rebuild = config.replica_rebuild;
                Some(resync::resync(&mut **r, &mut reader, &local, first, local_at, rebuild)?)
            }
            _ => None,
        };
        let recovery = Recovery {
            records: s.records,
            last_seq: s.last_seq,
            end: s.end,
            stop: s.stop,
            truncated: window_dirty,
            replica,
        };
        config.max_record_bytes = sb.max_record_bytes;
        config.max_batch_bytes = sb.max_batch_bytes;
        Self::start(config, dev, buf, sb, s.head, recovery)
    }

    /// [`open`](Journal::open) if the device holds a journal (bad magic: none), else
    /// [`create`](Journal::create).
    pub fn open_or_create(config: JournalConfig) -> Result<Journal, JournalError> {
        let has_journal = {
            let mut dev = open_dev(&config)?;
            let mut reader = BlockReader::new(&mut dev);
            match scan::read_superblock(&mut reader) {
                Ok(_) => true,
                Err(scan::ScanError::Super(SuperError::Magic)) => false,
                Err(scan::ScanError::Super(e)) => return Err(JournalError::Superblock(e)),
                Err(scan::ScanError::Io(source)) => {
                    return Err(JournalError::Io { op: "superblock read", source })
                }
            }
        };
        if has_journal {
            Self::open(config)
        } else {
            Self::create(config)
        }
    }

    fn start(
        mut config: JournalConfig,
        dev: Dev,
        buf: AlignedBuf,
        sb: Superblock,
        head: format::Chain,
        recovery: Recovery,
    ) -> Result<Journal, JournalError> {
        if config.durability == Durability::Replicated && config.replica.is_none() {
            return Err(JournalError::Config("replicated durability needs a replica"));
        }
        let next_seq = recovery.last_seq + 1;
        let ring = match &config.shm_path {
            Some(p) => {
                let _ = std::fs::remove_file(p);
                ShmRing::create_file(p, config.ring_bytes)?
            }
            None => ShmRing::create_memfd("fastlane-journal", config.ring_bytes)?,
        };
        let control = match &config.shm_path {
            Some(p) => Control::create_file(
                &control_path(p),
                sb.journal_id,
                sb.max_record_bytes,
                config.durability,
                next_seq,
                recovery.last_seq,
            )?,
            None => Control::create_memfd(
                sb.journal_id,
                sb.max_record_bytes,
                config.durability,
                next_seq,
                recovery.last_seq,
            )?,
        };
        let mut consumer = ring.consumer()?;
        consumer.set_wait_strategy(config.writer_wait);
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(WriterStats::default());
        stats.end.store(recovery.end, Ordering::Relaxed);
        prefault_ring(&ring, &mut consumer)?;
        let writer = Writer::new(WriterParts {
            dev,
            buf,
            end: recovery.end,
            key: sb.chain_key(),
            head,
            last_seq: recovery.last_seq,
            sb,
            durability: config.durability,
            replica: config.replica.take(),
            pre: config.preprocess.take().unwrap_or_else(|| Box::new(SoftPreprocess::default())),
            sources: vec![sources::Source::single(consumer, recovery.last_seq)],
            service: None,
            writer_wait: config.writer_wait,
            control: control.reopen()?,
            stats: Arc::clone(&stats),
            stop: Arc::clone(&stop),
            core: config.writer_core,
            io: config.writer_io,
            device: Arc::clone(&config.device),
        });
        let handle = std::thread::Builder::new()
            .name("journal-writer".into())
            .spawn(move || writer.run())
            .map_err(|source| JournalError::Io { op: "spawn writer", source })?;
        Ok(Journal {
            ring,
            control,
            writer: Some(handle),
            stop,
            stats,
            recovery,
            superblock: sb,
            shm_path: config.shm_path.clone(),
        })
    }

    /// A producer for this process (one at a time; drop it to attach another, here or in
    /// another process).
    pub fn producer(&self) -> Result<JournalProducer, JournalError> {
        self.control.check_state()?;
        let tx = self.ring.producer()?;
        JournalProducer::new(tx, self.control.reopen()?, self.superblock.max_record_bytes)
    }

    /// The highest durable seq (0: none). One load.
    pub fn durable_seq(&self) -> Seq {
        self.control.durable_seq()
    }

    /// Waits until `seq` is durable (or the writer stops, or `timeout` passes).
    pub fn wait_durable(&self, seq: Seq, timeout: Duration) -> Result<(), JournalError> {
        self.control.wait_durable(seq, timeout, Control::DEFAULT_WAIT)
    }

    /// [`wait_durable`](Self::wait_durable) with a chosen strategy (see
    /// [`JournalProducer::wait_durable_with`]).
    pub fn wait_durable_with(
        &self,
        seq: Seq,
        timeout: Duration,
        strategy: WaitStrategy,
    ) -> Result<(), JournalError> {
        self.control.wait_durable(seq, timeout, strategy)
    }

    /// What recovery found.
    pub fn recovery(&self) -> Recovery {
        self.recovery
    }

    /// The superblock.
    pub fn superblock(&self) -> Superblock {
        self.superblock
    }

    /// Where other processes attach ([`JournalProducer::attach`]), if the ring is in a file.
    pub fn shm_path(&self) -> Option<&Path> {
        self.shm_path.as_deref()
    }

    /// The writer's counters.
    pub fn stats(&self) -> JournalStats {
        let s = &self.stats;
        JournalStats {
            batches: s.batches.load(Ordering::Relaxed),
            records: s.records.load(Ordering::Relaxed),
            bytes_written: s.bytes_written.load(Ordering::Relaxed),
            flushes: s.flushes.load(Ordering::Relaxed),
            end: s.end.load(Ordering::Relaxed),
        }
    }

    /// Stops the writer after it has written what the ring holds, and returns its error if
    /// it failed. Removes the shared files.
    pub fn close(mut self) -> Result<JournalStats, JournalError> {
        let result = self.shutdown();
        result.map(|()| self.stats())
    }

    fn shutdown(&mut self) -> Result<(), JournalError> {
        self.stop.store(true, Ordering::Release);
        let result = match self.writer.take() {
            Some(h) => h.join().unwrap_or(Err(JournalError::WriterFailed)),
            None => Ok(()),
        };
        if let Some(p) = &self.shm_path {
            let _ = std::fs::remove_file(p);
            let _ = std::fs::remove_file(control_path(p));
        }
        result
    }
}

impl Drop for Journal {
    fn drop(&mut self) {
        if self.writer.is_some() {
            let _ = self.shutdown();
        }
    }
}

/// Recovery of a journal device: scans to the last valid frame (`note` sees every frame),
/// refuses damage followed by more data than one torn batch could leave
/// ([`JournalError::Corrupt`]), zeroes the torn tail. Returns the scan, a batch buffer holding
/// at its front the bytes of the last partial block, and whether a torn tail was zeroed.
pub(crate) fn recover(
    dev: &mut Dev,
    note: &mut dyn FnMut(scan::Visit<'_>) -> bool,
) -> Result<(Scan, AlignedBuf, bool), JournalError> {
    let (s, data_at) = {
        let mut reader = BlockReader::new(dev);
        let s = match scan::scan(&mut reader, note) {
            Ok(s) => s,
            Err(scan::ScanError::Super(e)) => return Err(JournalError::Superblock(e)),
            Err(scan::ScanError::Io(source)) => {
                return Err(JournalError::Io { op: "recovery read", source })
            }
        };
        // Past the window one torn batch can reach, the device must be untouched.
        let probe = s.end.saturating_add(s.superblock.torn_window());
        let clean = scan::is_zero(&mut reader, probe, u64::from(WRITE_ALIGN))
            .map_err(|source| JournalError::Io { op: "recovery read", source })?;
        let window_zero = scan::is_zero(&mut reader, s.end, s.superblock.torn_window())
            .map_err(|source| JournalError::Io { op: "recovery read", source })?;
        (s, (!clean).then_some(probe).map(|p| (p, window_zero)))
    };
    let sb = s.superblock;
    if let Some((data_at, _)) = data_at {
        let what = match s.stop {
            Stop::Clean | Stop::DeviceEnd => "zero header",
            Stop::Defect { defect, .. } => defect.what(),
            Stop::Seq { .. } => "sequence number out of order",
            Stop::Chain { .. } => "hash chain broken",
        };
        return Err(JournalError::Corrupt { offset: s.end, what, data_at });
    }
    let mut buf = AlignedBuf::new(sb.max_batch_bytes as usize + 2 * WRITE_ALIGN as usize);
    // Zero the torn tail: [end, end + window), keeping the bytes before `end` in its block.
    let align = u64::from(WRITE_ALIGN);
    let base = s.end / align * align;
    let keep = (s.end - base) as usize;
    if keep > 0 {
        let mut reader = BlockReader::new(dev);
        reader
            .read_at(base, &mut buf.as_mut_slice()[..keep])
            .map_err(|source| JournalError::Io { op: "recovery read", source })?;
    }
    let torn_end = (s.end + sb.torn_window()).div_ceil(align) * align;
    let torn_end = torn_end.min(dev.size_bytes);
    let window_dirty = {
        let mut reader = BlockReader::new(dev);
        !scan::is_zero(&mut reader, s.end, torn_end.saturating_sub(s.end))
            .map_err(|source| JournalError::Io { op: "recovery read", source })?
    };
    if window_dirty {
        let mut off = base;
        let mut first = true;
        while off < torn_end {
            let n = ((torn_end - off) as usize).min(buf.len());
            if !first {
                buf.as_mut_slice()[..n].fill(0);
            }
            dev.write(&mut buf, 0, n, off)?;
            first = false;
            off += n as u64;
        }
        dev.flush()?;
        // Restore the kept block prefix at the front of the buffer.
        buf.as_mut_slice().fill(0);
        let mut reader = BlockReader::new(dev);
        reader
            .read_at(base, &mut buf.as_mut_slice()[..keep])
            .map_err(|source| JournalError::Io { op: "recovery read", source })?;
    }
    Ok((s, buf, window_dirty))
}

/// Ring record type of the prefault lap (never seen by the writer).
const PREFAULT_TYPE: u32 = 0x4A50;

/// Writes and consumes one lap of the ring before the writer starts, so that every page of
/// the mapping is present: otherwise the producer's first pass over each 4 KiB page takes a
/// page fault (1–3 µs) inside `append`, which was most of the hot path's P99.9 (one append in
/// 512 with 64-byte records). A producer in another process still maps the (now resident)
/// pages on first touch, a minor fault.
fn prefault_ring(ring: &ShmRing, consumer: &mut Consumer) -> Result<(), JournalError> {
    let mut tx = ring.producer()?;
    let chunk = tx.max_record_len().clamp(1, 64 << 10);
    let lap = ring.capacity() + 2 * chunk;
    let mut written = 0usize;
    // Bounded: each step writes `chunk` bytes and consumes them, `lap / chunk + 1` steps.
    while written < lap {
        let buf = tx.reserve(chunk)?;
        buf.fill(0);
        tx.commit(PREFAULT_TYPE);
        let mut batch = consumer.peek_batch(usize::MAX)?;
        while batch.next_record()?.is_some() {}
        batch.release();
        written += chunk;
    }
    Ok(())
}

fn check_limits(max_record_bytes: u32, max_batch_bytes: u32) -> Result<(), JournalError> {
    if max_record_bytes == 0 || max_record_bytes > format::MAX_RECORD_BYTES_LIMIT {
        return Err(JournalError::Config("max_record_bytes out of range"));
    }
    let min_batch = format::frame_len(max_record_bytes as usize) as u64 + u64::from(WRITE_ALIGN);
    if u64::from(max_batch_bytes) < min_batch || max_batch_bytes > format::MAX_BATCH_BYTES_LIMIT {
        return Err(JournalError::Config(
            "max_batch_bytes must hold one largest frame plus a block, and be <= 256 MiB",
        ));
    }
    Ok(())
}

fn open_dev(config: &JournalConfig) -> Result<Dev, JournalError> {
    open_device(&*config.device)
}

/// A queue on `device` for the writer, after checking that the journal can use it.
pub(crate) fn open_device(device: &dyn BlockDevice) -> Result<Dev, JournalError> {
    let info = device.info();
    if info.read_only {
        return Err(JournalError::Config("device is read-only"));
    }
    if info.block_size > WRITE_ALIGN || !info.block_size.is_power_of_two() {
        return Err(JournalError::Config("device block size must be a power of two <= 4096"));
    }
    let queue = device
        .open_queue(4)
        .map_err(|source| JournalError::Io { op: "open block queue", source })?;
    let size = info.size_bytes / u64::from(WRITE_ALIGN) * u64::from(WRITE_ALIGN);
    Ok(Dev::new(queue, size))
}

/// Makes the whole device read as zeroes (write-zeroes where offered, else plain writes).
fn zero_device(
    dev: &mut Dev,
    buf: &mut AlignedBuf,
    write_zeroes: bool,
) -> Result<(), JournalError> {
    let size = dev.size_bytes;
    if write_zeroes {
        let req = BlockRequest {
            op: BlockOp::WriteZeroes { unmap: false },
            offset: 0,
            len: size,
            segments: &[],
            tag: 4,
        };
        // SAFETY: write-zeroes names no memory.
        unsafe { dev.queue.submit(req) }.map_err(|_| JournalError::QueueFull)?;
        dev.queue.kick().map_err(|source| JournalError::Io { op: "kick", source })?;
        if dev.wait("write-zeroes", 0).is_ok() {
            return Ok(());
        }
    }
    buf.as_mut_slice().fill(0);
    let mut off = 0;
    while off < size {
        let n = ((size - off) as usize).min(buf.len());
        dev.write(buf, 0, n, off)?;
        off += n as u64;
    }
    Ok(())
}

fn random_id() -> Result<[u8; 16], JournalError> {
    let mut id = [0u8; 16];
    let mut got = 0;
    // Bounded: getrandom returns at most 256 bytes per call and only fails on EINTR early in
    // boot or on a broken system.
    for _ in 0..16 {
        // SAFETY: the pointer and length name the unfilled part of `id`, valid for writes.
        let n = unsafe { libc::getrandom(id[got..].as_mut_ptr().cast(), id.len() - got, 0) };
        if n > 0 {
            got += n as usize;
            if got == id.len() {
                return Ok(id);
            }
        }
    }
    Err(JournalError::Io { op: "getrandom", source: std::io::Error::last_os_error() })
}
