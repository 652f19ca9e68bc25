//! Backend specs as written on a command line (`fastlane serve --backend SPEC`):
//!
//! - `mem:SIZE`: a [`RamDisk`] of `SIZE` bytes; `SIZE` is a number with an optional binary
//!   suffix `K`, `M`, `G`, `T` (case-insensitive, `KiB`/`MB`-style tails accepted and read as
//!   powers of 1024): `512K`, `64M`, `1G`, `4096`;
//! - `file:PATH`: a regular file or block device, served by the engine [`SpecOptions::io`]
//!   names; by default ([`IoEngine::Auto`], see [`choose_engine`]) a [`SyncFileDevice`]
//!   (`preadv`/`pwritev` inline) when the file cannot do non-blocking buffered reads (tmpfs,
//!   ramfs) and is not opened `O_DIRECT`, else a [`UringDevice`];
//! - `nvme:BDF`: an [`NvmeDevice`] (the userspace VFIO driver) on the PCI function `BDF`
//!   (`0000:00:04.0`), which must be bound to `vfio-pci`; namespace 1.
//!
//! ```
//! use fastlane_vhost_blk::spec::{BackendSpec, SpecOptions};
//! let spec: BackendSpec = "mem:64M".parse().unwrap();
//! assert_eq!(spec, BackendSpec::Mem { size_bytes: 64 << 20 });
//! let dev = spec.open(&SpecOptions::default()).unwrap();
//! assert_eq!(dev.info().size_bytes, 64 << 20);
//! ```

use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

use fastlane_block::ram::{RamDisk, RamError};
use fastlane_block::sync::{
    filesystem_name, probe_nowait, NowaitProbe, SyncFileDevice, SyncFileError, SyncFileOptions,
};
use fastlane_block::uring::{UringDevice, UringError, UringOptions};
use fastlane_block::BlockDevice;
use fastlane_nvme::{Bdf, NvmeDevice, NvmeError, NvmeOptions};
use fastlane_util::{parse_size, ParseSizeError};

/// What `--backend` names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendSpec {
    /// `mem:SIZE`.
    Mem {
        /// Size in bytes.
        size_bytes: u64,
    },
    /// `file:PATH`.
    File {
        /// The file or block device.
        path: PathBuf,
    },
    /// `nvme:BDF`.
    Nvme {
        /// The PCI function.
        bdf: Bdf,
    },
}

/// How a `file:` backend does its I/O (`fastlane serve --io`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IoEngine {
    /// `Sync` when the file cannot do non-blocking buffered reads and is not opened
    /// `O_DIRECT`, else `Uring` (see [`choose_engine`]).
    #[default]
    Auto,
    /// [`UringDevice`]: one io_uring per queue.
    Uring,
    /// [`SyncFileDevice`]: `preadv`/`pwritev` inside `submit` (no `O_DIRECT`).
    Sync,
}

impl fmt::Display for IoEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            IoEngine::Auto => "auto",
            IoEngine::Uring => "uring",
            IoEngine::Sync => "sync",
        })
    }
}

impl FromStr for IoEngine {
    type Err = SpecError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(IoEngine::Auto),
            "uring" => Ok(IoEngine::Uring),
            "sync" => Ok(IoEngine::Sync),
            _ => Err(SpecError::UnknownEngine { text: s.chars().take(32).collect() }),
        }
    }
}

/// The engine a `file:` spec is served with, and why (for logs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineChoice {
    /// `Uring` or `Sync`, never `Auto`.
    pub engine: IoEngine,
    /// One line: what decided it.
    pub reason: String,
}

/// How to open a spec's device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecOptions {
    /// Export read-only.
    pub read_only: bool,
    /// `file:` only: open with `O_DIRECT`.
    pub direct: bool,
    /// `mem:` only: the logical block size (512 or 4096).
    pub block_size: u32,
    /// `file:` only: the I/O engine.
    pub io: IoEngine,
}

impl Default for SpecOptions {
    fn default() -> Self {
        SpecOptions { read_only: false, direct: false, block_size: 512, io: IoEngine::Auto }
    }
}

/// Why a spec could not be parsed or opened.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    /// Neither `mem:` nor `file:`.
    #[error("unknown backend {spec:?}: expected mem:SIZE, file:PATH or nvme:BDF")]
    UnknownKind {
        /// The spec as given.
        spec: String,
    },
    /// The size is not a number with an optional K/M/G/T suffix, or overflows.
    #[error("bad size {text:?}: expected e.g. 512K, 64M, 1G")]
    BadSize {
        /// The size as given.
        text: String,
    },
    /// `file:` with nothing after it.
    #[error("file: needs a path")]
    EmptyPath,
    /// Not `auto`, `uring` or `sync`.
    #[error("unknown I/O engine {text:?}: expected auto, uring or sync")]
    UnknownEngine {
        /// The engine as given (at most 32 characters of it).
        text: String,
    },
    /// The synchronous engine does buffered I/O only.
    #[error("the sync I/O engine does not do O_DIRECT; use uring (or auto)")]
    SyncDirect,
    /// Making the RAM disk failed.
    #[error(transparent)]
    Ram(#[from] RamError),
    /// Opening the file failed.
    #[error(transparent)]
    Uring(#[from] UringError),
    /// Opening the file for the synchronous engine failed.
    #[error(transparent)]
    SyncFile(#[from] SyncFileError),
    /// The PCI address is malformed, or opening the controller failed.
    #[error(transparent)]
    Nvme(#[from] NvmeError),
}

impl From<ParseSizeError> for SpecError {
    fn from(e: ParseSizeError) -> Self {
        SpecError::BadSize { text: e.text }
    }
}

impl FromStr for BackendSpec {
    type Err = SpecError;

    fn from_str(spec: &str) -> Result<Self, Self::Err> {
        if let Some(size) = spec.strip_prefix("mem:") {
            Ok(BackendSpec::Mem { size_bytes: parse_size(size)? })
        } else if let Some(path) = spec.strip_prefix("file:") {
            if path.is_empty() {
                return Err(SpecError::EmptyPath);
            }
            Ok(BackendSpec::File { path: PathBuf::from(path) })
        } else if let Some(bdf) = spec.strip_prefix("nvme:") {
            Ok(BackendSpec::Nvme { bdf: bdf.parse()? })
        } else {
            Err(SpecError::UnknownKind { spec: spec.to_string() })
        }
    }
}

impl fmt::Display for BackendSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BackendSpec::Mem { size_bytes } => write!(f, "mem:{size_bytes}"),
            BackendSpec::File { path } => write!(f, "file:{}", path.display()),
            BackendSpec::Nvme { bdf } => write!(f, "nvme:{bdf}"),
        }
    }
}

/// Which engine serves `path` under `opts` (`opts.io`, resolved when it is `Auto`).
///
/// The auto rule: `O_DIRECT` → uring (no page cache: the kernel completes asynchronously and
/// io_uring keeps the queue depth). Otherwise one `preadv2(…, RWF_NOWAIT)` of one block
/// ([`probe_nowait`]): `EOPNOTSUPP` (tmpfs, ramfs) → sync, because io_uring would hand every
/// request to an `iou-wrk` thread that competes for the worker's CPU, while the copy it does
/// is a memcpy from memory that never waits for a device; anything else → uring, because a
/// file on a real device can miss the page cache, and only io_uring keeps other requests
/// moving while one waits for the device. Buffered writes on ext4 are punted by io_uring too,
/// but there `sync` measured no better reads, a shorter QD1 write tail and 39–46 % fewer QD32
/// write IOPS (BENCHMARKS.md, "vhost-user-blk"), so the rule looks at reads only; `--io sync`
/// makes that trade by hand. When the probe cannot open the file, uring is chosen and its open
/// reports the error.
pub fn choose_engine(path: &Path, opts: &SpecOptions) -> Result<EngineChoice, SpecError> {
    let choice = |engine, reason: String| Ok(EngineChoice { engine, reason });
    match opts.io {
        IoEngine::Sync if opts.direct => Err(SpecError::SyncDirect),
        IoEngine::Sync | IoEngine::Uring => choice(opts.io, format!("--io {} asked for", opts.io)),
        IoEngine::Auto if opts.direct => choice(
            IoEngine::Uring,
            "O_DIRECT: no page cache, io_uring completes asynchronously".into(),
        ),
        IoEngine::Auto => {
            let file = match File::open(path) {
                Ok(f) => f,
                Err(e) => return choice(IoEngine::Uring, format!("cannot probe ({e})")),
            };
            let fs = filesystem_name(&file);
            match probe_nowait(&file) {
                NowaitProbe::Unsupported => choice(
                    IoEngine::Sync,
                    format!(
                        "{fs} has no non-blocking buffered I/O (preadv2 RWF_NOWAIT: \
                         EOPNOTSUPP): io_uring would punt every request to a worker thread"
                    ),
                ),
                NowaitProbe::Supported => choice(
                    IoEngine::Uring,
                    format!(
                        "{fs} does non-blocking buffered reads: io_uring completes cached \
                         reads inline and keeps the queue depth for cache misses"
                    ),
                ),
                NowaitProbe::Failed(e) => choice(
                    IoEngine::Uring,
                    format!("{fs}: RWF_NOWAIT probe failed with errno {e}; io_uring"),
                ),
            }
        }
    }
}

impl BackendSpec {
    /// Make the device the spec names.
    pub fn open(&self, opts: &SpecOptions) -> Result<Arc<dyn BlockDevice>, SpecError> {
        Ok(match self {
            BackendSpec::Mem { size_bytes } => {
                Arc::new(RamDisk::new(*size_bytes, opts.block_size)?.with_read_only(opts.read_only))
            }
            BackendSpec::File { path } => open_file(path, opts)?.0,
            BackendSpec::Nvme { bdf } => Arc::new(NvmeDevice::open(
                *bdf,
                NvmeOptions { read_only: opts.read_only, ..NvmeOptions::default() },
            )?),
        })
    }
}

impl BackendSpec {
    /// Make the device the spec names; for `file:`, also which engine serves it and why.
    pub fn open_explained(
        &self,
        opts: &SpecOptions,
    ) -> Result<(Arc<dyn BlockDevice>, Option<EngineChoice>), SpecError> {
        match self {
            BackendSpec::File { path } => {
                let (dev, choice) = open_file(path, opts)?;
                Ok((dev, Some(choice)))
            }
            _ => Ok((self.open(opts)?, None)),
        }
    }
}

/// Open `file:PATH` with the engine [`choose_engine`] picks.
fn open_file(
    path: &Path,
    opts: &SpecOptions,
) -> Result<(Arc<dyn BlockDevice>, EngineChoice), SpecError> {
    let choice = choose_engine(path, opts)?;
    let dev: Arc<dyn BlockDevice> = if choice.engine == IoEngine::Sync {
        Arc::new(SyncFileDevice::open(
            path,
            SyncFileOptions { read_only: opts.read_only, ..SyncFileOptions::default() },
        )?)
    } else {
        Arc::new(UringDevice::open(
            path,
            UringOptions {
                direct: opts.direct,
                read_only: opts.read_only,
                ..UringOptions::default()
            },
        )?)
    };
    Ok((dev, choice))
}

/// Parse and open `spec` in one go.
pub fn open_backend(spec: &str, opts: &SpecOptions) -> Result<Arc<dyn BlockDevice>, SpecError> {
    spec.parse::<BackendSpec>()?.open(opts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use fastlane_block::FileOpenError;

    #[test]
    fn mem_sizes() {
        assert_eq!(
            "mem:64M".parse::<BackendSpec>().unwrap(),
            BackendSpec::Mem { size_bytes: 64 << 20 }
        );
        assert_eq!(
            "mem:2GiB".parse::<BackendSpec>().unwrap(),
            BackendSpec::Mem { size_bytes: 2 << 30 }
        );
        for text in ["mem:", "mem:12X", "mem:1.5G", "mem:16777216T"] {
            assert!(
                matches!(text.parse::<BackendSpec>(), Err(SpecError::BadSize { .. })),
                "{text}"
            );
        }
    }

    #[test]
    fn specs() {
        assert_eq!(
            "file:/dev/nvme0n1".parse::<BackendSpec>().unwrap(),
            BackendSpec::File { path: "/dev/nvme0n1".into() }
        );
        assert_eq!("mem:1G".parse::<BackendSpec>().unwrap().to_string(), "mem:1073741824");
        assert!(matches!("file:".parse::<BackendSpec>(), Err(SpecError::EmptyPath)));
        assert!(matches!("nbd:x".parse::<BackendSpec>(), Err(SpecError::UnknownKind { .. })));
        let nvme = "nvme:0000:00:04.0".parse::<BackendSpec>().unwrap();
        assert_eq!(nvme.to_string(), "nvme:0000:00:04.0");
        assert_eq!("nvme:00:04.0".parse::<BackendSpec>().unwrap(), nvme);
        assert!(matches!(
            "nvme:00:04".parse::<BackendSpec>(),
            Err(SpecError::Nvme(NvmeError::BadBdf { .. }))
        ));
        assert!(matches!(
            open_backend("mem:1000", &SpecOptions::default()),
            Err(SpecError::Ram(RamError::InvalidSize { .. }))
        ));
    }

    #[test]
    fn engines_parse_and_print() {
        for e in [IoEngine::Auto, IoEngine::Uring, IoEngine::Sync] {
            assert_eq!(e.to_string().parse::<IoEngine>().unwrap(), e);
        }
        assert!(matches!("aio".parse::<IoEngine>(), Err(SpecError::UnknownEngine { .. })));
        assert_eq!(SpecOptions::default().io, IoEngine::Auto);
    }

    fn file_in(dir: &Path) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new_in(dir).unwrap();
        f.as_file().set_len(1 << 20).unwrap();
        f
    }

    #[test]
    fn auto_picks_sync_on_tmpfs() {
        let shm = Path::new("/dev/shm");
        if !shm.is_dir() {
            eprintln!("skipped: no /dev/shm");
            return;
        }
        let f = file_in(shm);
        let choice = choose_engine(f.path(), &SpecOptions::default()).unwrap();
        assert_eq!(choice.engine, IoEngine::Sync, "{}", choice.reason);
        assert!(choice.reason.contains("tmpfs"), "{}", choice.reason);
        let spec = BackendSpec::File { path: f.path().into() };
        let (dev, choice) = spec.open_explained(&SpecOptions::default()).unwrap();
        assert_eq!(choice.unwrap().engine, IoEngine::Sync);
        // An inline backend has no completion eventfd; io_uring always has one.
        assert!(dev.open_queue(4).unwrap().completion_fd().is_none());
        // The override wins.
        let uring = SpecOptions { io: IoEngine::Uring, ..SpecOptions::default() };
        let (dev, choice) = spec.open_explained(&uring).unwrap();
        assert_eq!(choice.unwrap().engine, IoEngine::Uring);
        assert!(dev.open_queue(4).unwrap().completion_fd().is_some());
    }

    #[test]
    fn auto_picks_uring_for_o_direct_and_nowait_filesystems() {
        let f = file_in(&std::env::temp_dir());
        let direct = SpecOptions { direct: true, ..SpecOptions::default() };
        let choice = choose_engine(f.path(), &direct).unwrap();
        assert_eq!(choice.engine, IoEngine::Uring, "{}", choice.reason);
        assert!(choice.reason.contains("O_DIRECT"));
        // Where /tmp takes O_DIRECT (not tmpfs on old kernels), the device opens on io_uring.
        let spec = BackendSpec::File { path: f.path().into() };
        match spec.open_explained(&direct) {
            Ok((dev, choice)) => {
                assert_eq!(choice.unwrap().engine, IoEngine::Uring);
                assert!(dev.open_queue(4).unwrap().completion_fd().is_some());
            }
            Err(SpecError::Uring(UringError::File(FileOpenError::Open { source, .. })))
                if source.raw_os_error() == Some(libc::EINVAL) => {}
            Err(e) => panic!("O_DIRECT open: {e}"),
        }
        let sync = SpecOptions { io: IoEngine::Sync, ..direct };
        assert!(matches!(choose_engine(f.path(), &sync), Err(SpecError::SyncDirect)));
        // A page-cache filesystem with RWF_NOWAIT reads (ext4, xfs, btrfs) stays on io_uring.
        let choice = choose_engine(f.path(), &SpecOptions::default()).unwrap();
        if ["ext4", "xfs", "btrfs"].iter().any(|fs| choice.reason.starts_with(fs)) {
            assert_eq!(choice.engine, IoEngine::Uring, "{}", choice.reason);
        }
        // A missing file: uring's open reports it.
        let gone = std::env::temp_dir().join("fastlane-spec-no-such-file");
        let spec = BackendSpec::File { path: gone };
        assert!(matches!(spec.open(&SpecOptions::default()), Err(SpecError::Uring(_))));
    }

    #[test]
    fn opens_both_kinds() {
        let ro = SpecOptions { read_only: true, block_size: 4096, ..SpecOptions::default() };
        let dev = open_backend("mem:1M", &ro).unwrap();
        assert_eq!(dev.info().block_size, 4096);
        assert!(dev.info().read_only);
        let f = tempfile::NamedTempFile::new().unwrap();
        f.as_file().set_len(1 << 20).unwrap();
        let spec = format!("file:{}", f.path().display());
        let dev = open_backend(&spec, &SpecOptions::default()).unwrap();
        assert_eq!(dev.info().size_bytes, 1 << 20);
        dev.open_queue(4).unwrap();
    }
}
