//! FastLane's userspace NVMe driver over VFIO: the controller is driven directly from this
//! process, with no kernel block layer in the path, and offered as a [`BlockDevice`] (the seam
//! of `fastlane_block`).
//!
//! ```no_run
//! use fastlane_block::{BlockDevice, BlockOp, BlockRequest, Completion, Segment};
//! use fastlane_nvme::{NvmeDevice, NvmeOptions};
//! let dev = NvmeDevice::open("0000:00:04.0".parse()?, NvmeOptions::default())?;
//! let buf = dev.alloc_dma(4096)?; // zero copy: memory the device can reach
//! let mut q = dev.open_queue(32)?; // one per thread
//! let seg = [Segment { addr: buf.as_ptr(), len: 4096 }];
//! let req = BlockRequest { op: BlockOp::Read, offset: 0, len: 0, segments: &seg, tag: 1 };
//! // SAFETY: `buf` outlives the request and is not touched until its completion.
//! unsafe { q.submit(req) }.expect("queue has room");
//! q.kick()?;
//! let mut out = [Completion::EMPTY; 1];
//! while q.complete(&mut out) == 0 {
//!     q.wait(None)?;
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # What it does
//!
//! - [`NvmeDevice::open`] opens a PCI function bound to `vfio-pci` by its address (a type1
//!   IOMMU container, the group, the device, through `vfio-ioctls`), maps BAR0, enables bus
//!   mastering, resets the controller (CC.EN = 0, wait for CSTS.RDY = 0), sets up the admin
//!   queue (AQA/ASQ/ACQ), enables it, reads Identify Controller and Identify Namespace and
//!   asks for I/O queues (Set Features, Number of Queues). Doorbells are placed with the
//!   stride from CAP.DSTRD.
//! - [`BlockDevice::open_queue`] makes one I/O queue pair per calling thread: its completion
//!   queue first, then its submission queue, in one pre-allocated DMA region that also holds
//!   a PRP list page per command slot and the queue's bounce pages.
//! - Read and Write (PRP1/PRP2 and PRP lists, split into commands of at most the controller's
//!   MDTS and 1 MiB), Flush, Dataset Management with Deallocate (for `Discard`) and Write
//!   Zeroes (with DEAC for `unmap`), the last two where Identify Controller's ONCS says so.
//! - Completions are polled with the phase tag; the CQ head doorbell is written once per batch.
//!
//! # Memory
//!
//! The device reaches memory only through IOVAs mapped in the IOMMU ([`dma`]). A request's
//! segments go to the device untouched (zero copy) when they lie in memory mapped by
//! [`NvmeDevice::alloc_dma`] or [`NvmeDevice::map_external`] and their layout suits PRPs;
//! otherwise the queue copies through its bounce pages. The vhost-user-blk device registers
//! guest memory through [`fastlane_block::ExternalMemory`] ([`NvmeDevice::sync_external`]) on
//! every memory table (see `docs/vfio-nvme.md` for that hook); [`NvmeDevice::transfer_stats`]
//! counts zero-copy versus bounced requests. DMA-able memory is never turned into a Rust reference.
//!
//! # Failures
//!
//! Every wait is bounded. A command that does not complete within
//! [`NvmeOptions::command_timeout`], or a controller that sets CSTS.CFS (controller fatal
//! status), marks the controller failed: bus mastering is switched off (so the device can no
//! longer write into memory that goes back to its owners), every in-flight request completes
//! with `BlockError::Io(ETIMEDOUT)` or `Io(EIO)`, and later requests fail at once with
//! `Io(ENODEV)`. Recovering (reset and re-creating the queues) is not implemented: reopen the
//! device. Completion status codes map to [`BlockError`](fastlane_block::BlockError) through [`Status::to_block_error`].
//!
//! # Why `vfio-ioctls`
//!
//! `vfio-ioctls` 0.10 builds against the workspace's rust-vmm set (vm-memory 0.18,
//! vmm-sys-util 0.15); its default `kvm` feature is turned off, as a userspace driver has no
//! hypervisor to tell about the group. It covers container, group, device and DMA mapping;
//! this crate adds the BAR mmap and the PCI command register.
//!
//! x86_64 only as written: the doorbell store relies on x86's ordering of stores to
//! write-back memory (the SQ entry) before an uncached store (the doorbell); other
//! architectures need a device barrier there.
//!
//! # Not here
//!
//! The block seam and the other backends (`fastlane_block`), the vhost-user-blk device that
//! serves this driver to a guest and the `nvme:BDF` backend spec (`fastlane_vhost_blk`), and
//! `fastlane bench nvme` (`fastlane-cli/`). The guest-side checks of the driver are the binary
//! `vfio_guest` (in the `fastlane-guest-tests` crate, `tests/guest/src/bin/vfio_guest`), run by `tests/guest/tests/vfio_guest.rs` in a QEMU guest.

use std::time::Duration;

use fastlane_block::BlockDevice;

pub mod cmd;
mod controller;
mod device;
pub mod dma;
pub mod pci;
pub mod prp;
mod queue;
pub mod regs;
mod rings;

pub use cmd::{ControllerId, NamespaceId, Status};
pub use controller::TransferStats;
pub use device::{DmaBuffer, NvmeDevice};
pub use pci::Bdf;
pub use queue::NvmeQueue;

/// How to open an [`NvmeDevice`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NvmeOptions {
    /// The namespace to export.
    pub nsid: u32,
    /// Refuse writes, discards and write-zeroes.
    pub read_only: bool,
    /// I/O queue pairs to ask the controller for (queues open at once, at most).
    pub io_queues_max: u16,
    /// How long one command may take before the controller is declared failed.
    pub command_timeout: Duration,
    /// Bounce memory per queue, for segments outside mapped memory (bytes, rounded to pages).
    /// A read or write larger than this needs mapped memory.
    pub bounce_bytes: usize,
    /// Most segments one request may carry.
    pub max_segments: u32,
    /// Largest data transfer of one NVMe command (further capped by the controller's MDTS
    /// and by 1 MiB); larger requests are split.
    pub max_transfer_bytes: u32,
}

impl Default for NvmeOptions {
    fn default() -> Self {
        NvmeOptions {
            nsid: 1,
            read_only: false,
            io_queues_max: 64,
            command_timeout: Duration::from_secs(10),
            bounce_bytes: 2 << 20,
            max_segments: 256,
            max_transfer_bytes: 1 << 20,
        }
    }
}

/// Why the driver could not do something.
#[derive(Debug, thiserror::Error)]
pub enum NvmeError {
    /// Not a PCI address.
    #[error("bad PCI address {text:?}: expected DDDD:BB:DD.F")]
    BadBdf {
        /// As given.
        text: String,
    },
    /// The function is not bound to vfio-pci.
    #[error("{bdf} is not bound to vfio-pci (driver: {driver:?})")]
    NotVfio {
        /// The address.
        bdf: String,
        /// The driver it is bound to, if any.
        driver: Option<String>,
    },
    /// A VFIO ioctl failed.
    #[error("VFIO {what} setup failed")]
    Vfio {
        /// What was being set up.
        what: &'static str,
        /// The cause.
        #[source]
        source: vfio_ioctls::VfioError,
    },
    /// BAR0 is missing, cannot be mapped, or has an odd size.
    #[error("unusable BAR0: flags {flags:#x}, size {size:#x}")]
    Bar0 {
        /// VFIO region flags.
        flags: u32,
        /// Region size.
        size: u64,
    },
    /// `mmap` of BAR0 failed.
    #[error("mmap of BAR0 failed")]
    Bar0Map {
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Allocating DMA memory failed.
    #[error("cannot allocate {len} bytes of DMA memory")]
    DmaAlloc {
        /// Bytes asked for.
        len: usize,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// `VFIO_IOMMU_MAP_DMA` failed.
    #[error("IOMMU map of {len} bytes at iova {iova:#x} failed")]
    DmaMap {
        /// The IOVA.
        iova: u64,
        /// Length.
        len: usize,
        /// The cause.
        #[source]
        source: vfio_ioctls::VfioError,
    },
    /// `VFIO_IOMMU_UNMAP_DMA` failed.
    #[error("IOMMU unmap of {len} bytes at iova {iova:#x} failed")]
    DmaUnmap {
        /// The IOVA.
        iova: u64,
        /// Length.
        len: usize,
        /// The cause.
        #[source]
        source: vfio_ioctls::VfioError,
    },
    /// The IOVA space is used up (IOVAs are never reused).
    #[error("IOVA space exhausted ({len} bytes asked)")]
    IovaExhausted {
        /// Bytes asked for.
        len: usize,
    },
    /// The range overlaps memory that is already mapped.
    #[error("host range {host:#x}+{len:#x} overlaps a mapped range")]
    MappingOverlap {
        /// Host address.
        host: usize,
        /// Length.
        len: usize,
    },
    /// External memory must be page-aligned and a non-zero number of pages.
    #[error("host range {host:#x}+{len:#x} is not page-aligned")]
    Unaligned {
        /// Host address.
        host: usize,
        /// Length.
        len: usize,
    },
    /// No mapping starts at this address.
    #[error("no mapping at host address {host:#x}")]
    NotMapped {
        /// Host address.
        host: usize,
    },
    /// The controller lacks something the driver needs.
    #[error("controller unsupported: {what}")]
    Unsupported {
        /// What is missing.
        what: &'static str,
    },
    /// The controller set CSTS.CFS.
    #[error("controller fatal status (CSTS {csts:#x})")]
    ControllerFatal {
        /// CSTS as read.
        csts: u32,
    },
    /// A bounded wait ran out.
    #[error("timed out after {ms} ms waiting for {what}")]
    Timeout {
        /// What was awaited.
        what: &'static str,
        /// The bound.
        ms: u64,
    },
    /// An admin command failed.
    #[error("{what} failed: {} ({status:?})", status.name())]
    Command {
        /// The command.
        what: &'static str,
        /// Its completion status.
        status: Status,
    },
    /// The namespace is inactive or has a format the driver cannot use.
    #[error("namespace {nsid} is inactive or unusable")]
    Namespace {
        /// The namespace.
        nsid: u32,
    },
    /// Every I/O queue the controller granted is in use.
    #[error("all {max} I/O queues are in use")]
    NoQueues {
        /// Queues granted.
        max: u16,
    },
    /// `open_queue` depth out of range.
    #[error("queue depth {depth} not in 1..={max}")]
    QueueDepth {
        /// Asked for.
        depth: u32,
        /// Most allowed.
        max: u32,
    },
    /// The controller was declared failed earlier.
    #[error("controller has failed (errno {errno})")]
    Failed {
        /// What in-flight requests completed with.
        errno: i32,
    },
}

impl From<NvmeError> for std::io::Error {
    fn from(e: NvmeError) -> std::io::Error {
        let kind = match &e {
            NvmeError::Timeout { .. } => std::io::ErrorKind::TimedOut,
            NvmeError::NoQueues { .. } => std::io::ErrorKind::ResourceBusy,
            NvmeError::QueueDepth { .. } => std::io::ErrorKind::InvalidInput,
            _ => std::io::ErrorKind::Other,
        };
        std::io::Error::new(kind, e)
    }
}

/// Open `bdf` as a block device (for `--backend nvme:BDF`).
pub fn open_device(bdf: &str, opts: NvmeOptions) -> Result<NvmeDevice, NvmeError> {
    NvmeDevice::open(bdf.parse()?, opts)
}

/// Compile-time check that the device is a [`BlockDevice`].
const _: fn() = || {
    fn is_block_device<T: BlockDevice>() {}
    is_block_device::<NvmeDevice>();
};
