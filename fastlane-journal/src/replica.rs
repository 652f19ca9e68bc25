//! The replica seam: where the writer mirrors each batch, in parallel with the local write.
//!
//! The writer hands a replica exactly the bytes it writes locally, at the same device offsets
//! (superblock included), so a replica is an image of the journal device: the RDMA write
//! mirror of `fastlane-rdma` (`mirror.write(offset, bytes)` plus its durability step) maps onto
//! [`Replica::write`] and [`Replica::sync`] one to one. Until that lands, [`MemReplica`] (an
//! in-process image, for tests) and [`FileReplica`] (a second file, e.g. on another disk)
//! implement it.
//!
//! # Where a replica stands
//!
//! On open (and create) the journal asks the replica for its [`ReplicaPosition`]: blank, not a
//! journal, or a journal with its id, last valid seq, end offset and chain head (what a scan of
//! the replica's own image finds). The journal treats the answer as a claim: it re-sends only
//! what the replica lacks after checking the claim against its own hash chain (see
//! `journal::resync`), and refuses a replica whose content diverges.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::format::{frame_len, Chain, DATA_OFFSET};
use super::io::ReadAt;
use super::scan::{self, ScanError};

/// Why a replica failed. The writer stops (a `replicated` journal cannot acknowledge anything
/// without its replica).
#[derive(Debug, thiserror::Error)]
pub enum ReplicaError {
    /// The replica's storage failed.
    #[error("replica I/O failed at offset {offset}")]
    Io {
        /// Offset of the write.
        offset: u64,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The write does not fit the replica.
    #[error("replica too small: write at {offset} of {len} bytes, replica has {size}")]
    TooSmall {
        /// Offset.
        offset: u64,
        /// Length.
        len: usize,
        /// Replica size.
        size: u64,
    },
    /// The remote side is gone or answered nonsense.
    #[error("replica link failed: {0}")]
    Link(String),
    /// The replica holds something other than a prefix of this journal. Nothing was written
    /// to it; rebuild it from the primary (`JournalConfig::replica_rebuild`,
    /// `--rebuild-replica`) if the primary is the copy to keep.
    #[error("replica diverged from the journal: {0}")]
    Diverged(String),
}

/// Where a replica's image stands, as the replica reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaPosition {
    /// The superblock area reads as zeroes: a new replica (assumed zero throughout, like a
    /// device `create` formatted).
    Blank,
    /// Bytes that are not a valid journal superblock.
    Foreign,
    /// A journal.
    Journal(ReplicaJournal),
}

/// What a replica holding a journal reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicaJournal {
    /// Its superblock's journal id.
    pub journal_id: [u8; 16],
    /// Valid records.
    pub records: u64,
    /// Seq of the last valid record (`first_seq - 1` if none).
    pub last_seq: u64,
    /// Offset after it.
    pub end: u64,
    /// Its chain value (the genesis value if none).
    pub head: Chain,
    /// Whether the image reads as zero past the torn-tail window after `end` (the same check
    /// `open` makes of the primary): if not, there is data the scan could not reach.
    pub clean: bool,
    /// For a probed offset: the seq and chain value of the replica's valid frame that ends
    /// exactly there (`first_seq - 1` and the genesis value for the data offset), if any.
    pub probe: Option<(u64, Chain)>,
}

/// A remote (or second local) copy of the journal device.
pub trait Replica: Send {
    /// Starts writing `bytes` at byte `offset` of the replica's image. May return before the
    /// bytes are durable; the writer calls [`Replica::sync`] before acknowledging.
    fn write(&mut self, offset: u64, bytes: &[u8]) -> Result<(), ReplicaError>;

    /// Returns once every write started so far is durable at the replica.
    fn sync(&mut self) -> Result<(), ReplicaError>;

    /// Where the replica's image stands (what a scan of it finds), with the frame that ends
    /// at `probe_end` if asked. Called before anything is written to it.
    fn position(&mut self, probe_end: Option<u64>) -> Result<ReplicaPosition, ReplicaError>;

    /// A short name for logs and the CLI.
    fn name(&self) -> &str;
}

/// An in-process image: a shared byte vector (tests, and a loopback for benchmarks).
#[derive(Debug, Clone)]
pub struct MemReplica {
    image: Arc<Mutex<Vec<u8>>>,
    sync_delay: Duration,
}

impl MemReplica {
    /// An image of `size` zero bytes.
    pub fn new(size: usize) -> MemReplica {
        MemReplica { image: Arc::new(Mutex::new(vec![0; size])), sync_delay: Duration::ZERO }
    }

    /// Makes every `sync` sleep this long (a stand-in for the network round trip).
    pub fn with_sync_delay(mut self, delay: Duration) -> MemReplica {
        self.sync_delay = delay;
        self
    }

    /// A copy of the image.
    pub fn snapshot(&self) -> Vec<u8> {
        self.image.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl Replica for MemReplica {
    fn write(&mut self, offset: u64, bytes: &[u8]) -> Result<(), ReplicaError> {
        let mut img = self.image.lock().unwrap_or_else(|p| p.into_inner());
        let size = img.len() as u64;
        let end = offset.checked_add(bytes.len() as u64).filter(|&e| e <= size);
        let Some(end) = end else {
            return Err(ReplicaError::TooSmall { offset, len: bytes.len(), size });
        };
        img[offset as usize..end as usize].copy_from_slice(bytes);
        Ok(())
    }

    fn sync(&mut self) -> Result<(), ReplicaError> {
        if !self.sync_delay.is_zero() {
            std::thread::sleep(self.sync_delay);
        }
        Ok(())
    }

    fn position(&mut self, probe_end: Option<u64>) -> Result<ReplicaPosition, ReplicaError> {
        let img = self.image.lock().unwrap_or_else(|p| p.into_inner());
        image_position(&mut &img[..], probe_end)
            .map_err(|source| ReplicaError::Io { offset: 0, source })
    }

    fn name(&self) -> &str {
        "mem"
    }
}

/// A replica in a second file: `pwrite` each batch, `fdatasync` on sync.
#[derive(Debug)]
pub struct FileReplica {
    file: File,
}

impl FileReplica {
    /// Uses `file` (opened for writing) as the image.
    pub fn new(file: File) -> FileReplica {
        FileReplica { file }
    }
}

impl Replica for FileReplica {
    fn write(&mut self, offset: u64, bytes: &[u8]) -> Result<(), ReplicaError> {
        self.file.write_all_at(bytes, offset).map_err(|source| ReplicaError::Io { offset, source })
    }

    fn sync(&mut self) -> Result<(), ReplicaError> {
        self.file.sync_data().map_err(|source| ReplicaError::Io { offset: 0, source })
    }

    fn position(&mut self, probe_end: Option<u64>) -> Result<ReplicaPosition, ReplicaError> {
        image_position(&mut FileImage(&self.file), probe_end)
            .map_err(|source| ReplicaError::Io { offset: 0, source })
    }

    fn name(&self) -> &str {
        "file"
    }
}

/// [`ReadAt`] over a shared file reference.
#[derive(Debug)]
pub(crate) struct FileImage<'a>(pub(crate) &'a File);

impl ReadAt for FileImage<'_> {
    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.0.read_exact_at(buf, offset)
    }
    fn len_bytes(&self) -> u64 {
        self.0.metadata().map(|m| m.len()).unwrap_or(0)
    }
}

/// Where the journal image read through `r` stands: what a replica reports about itself.
/// Damage is not an error here (the scan stops at the first bad frame and says whether data
/// follows); only a failed read is.
pub fn image_position(r: &mut dyn ReadAt, probe_end: Option<u64>) -> io::Result<ReplicaPosition> {
    if r.len_bytes() < DATA_OFFSET {
        return Ok(ReplicaPosition::Foreign);
    }
    if scan::is_zero(r, 0, DATA_OFFSET)? {
        return Ok(ReplicaPosition::Blank);
    }
    let mut probe = None;
    let s = scan::scan(r, &mut |v| {
        if Some(v.offset + frame_len(v.header.len as usize) as u64) == probe_end {
            probe = Some((v.header.seq, v.header.chain));
        }
        true
    });
    let s = match s {
        Ok(s) => s,
        Err(ScanError::Super(_)) => return Ok(ReplicaPosition::Foreign),
        Err(ScanError::Io(e)) => return Err(e),
    };
    if probe_end == Some(DATA_OFFSET) {
        probe = Some((s.superblock.first_seq - 1, s.superblock.genesis()));
    }
    let past_window = s.end.saturating_add(s.superblock.torn_window());
    let clean = scan::is_zero(r, past_window, 4096)?;
    Ok(ReplicaPosition::Journal(ReplicaJournal {
        journal_id: s.superblock.journal_id,
        records: s.records,
        last_seq: s.last_seq,
        end: s.end,
        head: s.head,
        clean,
        probe,
    }))
}
