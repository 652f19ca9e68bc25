//! The replica seam: where the writer mirrors each batch, in parallel with the local write.
//!
//! The writer hands a replica exactly the bytes it writes locally, at the same device offsets
//! (superblock included), so a replica is an image of the journal device: the RDMA write
//! mirror of `fastlane-rdma` (`mirror.write(offset, bytes)` plus its durability step) maps onto
//! [`Replica::write`] and [`Replica::sync`] one to one. Until that lands, [`MemReplica`] (an
//! in-process image, for tests) and [`FileReplica`] (a second file, e.g. on another disk)
//! implement it.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

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
}

/// A remote (or second local) copy of the journal device.
pub trait Replica: Send {
    /// Starts writing `bytes` at byte `offset` of the replica's image. May return before the
    /// bytes are durable; the writer calls [`Replica::sync`] before acknowledging.
    fn write(&mut self, offset: u64, bytes: &[u8]) -> Result<(), ReplicaError>;

    /// Returns once every write started so far is durable at the replica.
    fn sync(&mut self) -> Result<(), ReplicaError>;

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

    fn name(&self) -> &str {
        "file"
    }
}
