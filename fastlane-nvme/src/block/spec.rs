//! Backend specs as written on a command line (`fastlane serve --backend SPEC`):
//!
//! - `mem:SIZE`: a [`RamDisk`] of `SIZE` bytes; `SIZE` is a number with an optional binary
//!   suffix `K`, `M`, `G`, `T` (case-insensitive, `KiB`/`MB`-style tails accepted and read as
//!   powers of 1024): `512K`, `64M`, `1G`, `4096`;
//! - `file:PATH`: a [`UringDevice`] on a regular file or block device;
//! - `nvme:BDF`: an [`NvmeDevice`] (the userspace VFIO driver) on the PCI function `BDF`
//!   (`0000:00:04.0`), which must be bound to `vfio-pci`; namespace 1.
//!
//! ```
//! use fastlane_nvme::block::spec::{BackendSpec, SpecOptions};
//! let spec: BackendSpec = "mem:64M".parse().unwrap();
//! assert_eq!(spec, BackendSpec::Mem { size_bytes: 64 << 20 });
//! let dev = spec.open(&SpecOptions::default()).unwrap();
//! assert_eq!(dev.info().size_bytes, 64 << 20);
//! ```

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;

use super::ram::{RamDisk, RamError};
use super::uring::{UringDevice, UringError, UringOptions};
use super::BlockDevice;
use crate::vfio::{Bdf, NvmeDevice, NvmeError, NvmeOptions};

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

/// How to open a spec's device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecOptions {
    /// Export read-only.
    pub read_only: bool,
    /// `file:` only: open with `O_DIRECT`.
    pub direct: bool,
    /// `mem:` only: the logical block size (512 or 4096).
    pub block_size: u32,
}

impl Default for SpecOptions {
    fn default() -> Self {
        SpecOptions { read_only: false, direct: false, block_size: 512 }
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
    /// Making the RAM disk failed.
    #[error(transparent)]
    Ram(#[from] RamError),
    /// Opening the file failed.
    #[error(transparent)]
    Uring(#[from] UringError),
    /// The PCI address is malformed, or opening the controller failed.
    #[error(transparent)]
    Nvme(#[from] NvmeError),
}

/// Parse `64M`-style sizes (binary multiples). Bounded: at most 32 characters.
pub fn parse_size(text: &str) -> Result<u64, SpecError> {
    let bad = || SpecError::BadSize { text: text.to_string() };
    let t = text.trim();
    if t.is_empty() || t.len() > 32 {
        return Err(bad());
    }
    let digits_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, suffix) = t.split_at(digits_end);
    let n: u64 = digits.parse().map_err(|_| bad())?;
    let shift = match suffix.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err(bad()),
    };
    n.checked_mul(1u64 << shift).ok_or_else(bad)
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

impl BackendSpec {
    /// Make the device the spec names.
    pub fn open(&self, opts: &SpecOptions) -> Result<Arc<dyn BlockDevice>, SpecError> {
        Ok(match self {
            BackendSpec::Mem { size_bytes } => {
                Arc::new(RamDisk::new(*size_bytes, opts.block_size)?.with_read_only(opts.read_only))
            }
            BackendSpec::File { path } => Arc::new(UringDevice::open(
                path,
                UringOptions {
                    direct: opts.direct,
                    read_only: opts.read_only,
                    ..UringOptions::default()
                },
            )?),
            BackendSpec::Nvme { bdf } => Arc::new(NvmeDevice::open(
                *bdf,
                NvmeOptions { read_only: opts.read_only, ..NvmeOptions::default() },
            )?),
        })
    }
}

/// Parse and open `spec` in one go.
pub fn open_backend(spec: &str, opts: &SpecOptions) -> Result<Arc<dyn BlockDevice>, SpecError> {
    spec.parse::<BackendSpec>()?.open(opts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        for (text, want) in [
            ("4096", 4096),
            ("512K", 512 << 10),
            ("64M", 64 << 20),
            ("64m", 64 << 20),
            ("1G", 1 << 30),
            ("2GiB", 2 << 30),
            ("1T", 1 << 40),
            (" 8k ", 8 << 10),
        ] {
            assert_eq!(parse_size(text).unwrap(), want, "{text}");
        }
        for text in ["", "M", "-1", "1.5G", "12X", "1GG", "99999999999999999999", "16777216T"] {
            assert!(matches!(parse_size(text), Err(SpecError::BadSize { .. })), "{text}");
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
