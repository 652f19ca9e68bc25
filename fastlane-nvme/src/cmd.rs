//! Command and completion entries, the commands the driver sends, completion status codes and
//! the Identify data it reads (NVMe Base Specification 2.0 sections 4.2, 4.6, 5; NVM Command
//! Set Specification 1.0 sections 3 and 4).
//!
//! Entries are plain values here; the queue module copies them into and out of DMA memory with
//! volatile accesses.

use fastlane_block::BlockError;

/// Admin opcodes.
pub mod admin {
    /// Delete I/O Submission Queue.
    pub const DELETE_SQ: u8 = 0x00;
    /// Create I/O Submission Queue.
    pub const CREATE_SQ: u8 = 0x01;
    /// Delete I/O Completion Queue.
    pub const DELETE_CQ: u8 = 0x04;
    /// Create I/O Completion Queue.
    pub const CREATE_CQ: u8 = 0x05;
    /// Identify.
    pub const IDENTIFY: u8 = 0x06;
    /// Set Features.
    pub const SET_FEATURES: u8 = 0x09;
}

/// NVM command set opcodes.
pub mod nvm {
    /// Flush.
    pub const FLUSH: u8 = 0x00;
    /// Write.
    pub const WRITE: u8 = 0x01;
    /// Read.
    pub const READ: u8 = 0x02;
    /// Write Zeroes.
    pub const WRITE_ZEROES: u8 = 0x08;
    /// Dataset Management.
    pub const DSM: u8 = 0x09;
}

/// Feature Identifier: Number of Queues.
pub const FEATURE_NUM_QUEUES: u32 = 0x07;

/// Most logical blocks one Read/Write/Write Zeroes command moves (NLB is 16 bits, 0-based).
pub const NLB_MAX: u64 = 1 << 16;

/// Most ranges in one Dataset Management command (NR is 8 bits, 0-based): 256 ranges of 16
/// bytes fill exactly one 4 KiB page.
pub const DSM_RANGES_MAX: usize = 256;

/// Most logical blocks in one Dataset Management range (a 32-bit count).
pub const DSM_RANGE_BLOCKS_MAX: u64 = u32::MAX as u64;

/// A 64-byte submission queue entry.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(C)]
pub struct Sqe {
    /// Opcode (bits 7:0), fused (9:8), PSDT (15:14, 0 = PRPs), command identifier (31:16).
    pub cdw0: u32,
    /// Namespace identifier.
    pub nsid: u32,
    /// Reserved.
    pub cdw2: u32,
    /// Reserved.
    pub cdw3: u32,
    /// Metadata pointer.
    pub mptr: u64,
    /// PRP entry 1.
    pub prp1: u64,
    /// PRP entry 2 or the PRP list pointer.
    pub prp2: u64,
    /// Command dword 10.
    pub cdw10: u32,
    /// Command dword 11.
    pub cdw11: u32,
    /// Command dword 12.
    pub cdw12: u32,
    /// Command dword 13.
    pub cdw13: u32,
    /// Command dword 14.
    pub cdw14: u32,
    /// Command dword 15.
    pub cdw15: u32,
}

const _: () = assert!(std::mem::size_of::<Sqe>() == 64);

impl Sqe {
    /// An entry with `opcode` and command identifier `cid`, everything else zero.
    pub fn new(opcode: u8, cid: u16) -> Sqe {
        Sqe { cdw0: u32::from(opcode) | (u32::from(cid) << 16), ..Sqe::default() }
    }

    /// The opcode.
    pub fn opcode(&self) -> u8 {
        self.cdw0 as u8
    }

    /// The command identifier.
    pub fn cid(&self) -> u16 {
        (self.cdw0 >> 16) as u16
    }

    /// Read or Write `nlb` (1..=65536) blocks at `slba`.
    pub fn rw(opcode: u8, cid: u16, nsid: u32, slba: u64, nlb: u32) -> Sqe {
        debug_assert!(nlb >= 1 && u64::from(nlb) <= NLB_MAX);
        Sqe {
            nsid,
            cdw10: slba as u32,
            cdw11: (slba >> 32) as u32,
            cdw12: nlb - 1,
            ..Sqe::new(opcode, cid)
        }
    }

    /// Write Zeroes of `nlb` (1..=65536) blocks at `slba`; `deallocate` sets DEAC.
    pub fn write_zeroes(cid: u16, nsid: u32, slba: u64, nlb: u32, deallocate: bool) -> Sqe {
        let mut sqe = Sqe::rw(nvm::WRITE_ZEROES, cid, nsid, slba, nlb);
        if deallocate {
            sqe.cdw12 |= 1 << 25;
        }
        sqe
    }

    /// Dataset Management, attribute Deallocate, over `ranges` (1..=256) ranges whose list
    /// is at `list_iova`.
    pub fn deallocate(cid: u16, nsid: u32, ranges: usize, list_iova: u64) -> Sqe {
        debug_assert!((1..=DSM_RANGES_MAX).contains(&ranges));
        Sqe {
            nsid,
            prp1: list_iova,
            cdw10: (ranges - 1) as u32,
            cdw11: 1 << 2,
            ..Sqe::new(nvm::DSM, cid)
        }
    }

    /// Flush.
    pub fn flush(cid: u16, nsid: u32) -> Sqe {
        Sqe { nsid, ..Sqe::new(nvm::FLUSH, cid) }
    }

    /// Identify with `cns` (1 controller, 0 namespace) into the page at `buf_iova`.
    pub fn identify(cid: u16, cns: u32, nsid: u32, buf_iova: u64) -> Sqe {
        Sqe { nsid, prp1: buf_iova, cdw10: cns, ..Sqe::new(admin::IDENTIFY, cid) }
    }

    /// Set Features, Number of Queues: ask for `count` I/O SQs and CQs.
    pub fn set_num_queues(cid: u16, count: u16) -> Sqe {
        let n = u32::from(count.max(1) - 1);
        Sqe {
            cdw10: FEATURE_NUM_QUEUES,
            cdw11: n | (n << 16),
            ..Sqe::new(admin::SET_FEATURES, cid)
        }
    }

    /// Create I/O Completion Queue `qid` of `entries`, physically contiguous at `iova`,
    /// interrupts disabled (the driver polls).
    pub fn create_cq(cid: u16, qid: u16, entries: u32, iova: u64) -> Sqe {
        Sqe {
            prp1: iova,
            cdw10: ((entries - 1) << 16) | u32::from(qid),
            cdw11: 1, // PC = 1, IEN = 0
            ..Sqe::new(admin::CREATE_CQ, cid)
        }
    }

    /// Create I/O Submission Queue `qid` of `entries` at `iova`, completing on CQ `cqid`.
    pub fn create_sq(cid: u16, qid: u16, entries: u32, iova: u64, cqid: u16) -> Sqe {
        Sqe {
            prp1: iova,
            cdw10: ((entries - 1) << 16) | u32::from(qid),
            cdw11: (u32::from(cqid) << 16) | 1, // PC = 1, QPRIO = urgent/ignored
            ..Sqe::new(admin::CREATE_SQ, cid)
        }
    }

    /// Delete I/O Submission Queue or Completion Queue `qid` (`opcode` says which).
    pub fn delete_queue(opcode: u8, cid: u16, qid: u16) -> Sqe {
        Sqe { cdw10: u32::from(qid), ..Sqe::new(opcode, cid) }
    }
}

/// A 16-byte completion queue entry.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(C)]
pub struct Cqe {
    /// Command specific (e.g. Set Features' result).
    pub dw0: u32,
    /// Reserved.
    pub dw1: u32,
    /// The SQ head the controller has consumed up to.
    pub sq_head: u16,
    /// The SQ the command came from.
    pub sq_id: u16,
    /// The command identifier.
    pub cid: u16,
    /// Phase tag (bit 0) and status field (bits 15:1).
    pub status: u16,
}

const _: () = assert!(std::mem::size_of::<Cqe>() == 16);

impl Cqe {
    /// The phase tag.
    pub fn phase(&self) -> bool {
        self.status & 1 != 0
    }

    /// The status without the phase tag.
    pub fn status(&self) -> Status {
        Status(self.status >> 1)
    }
}

/// A completion's status field (bits 15:1 of CQE dword 3, shifted down).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Status(pub u16);

impl std::fmt::Debug for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Status(sct {:#x}, sc {:#04x}, dnr {})", self.sct(), self.sc(), self.dnr())
    }
}

/// Status code types.
pub mod sct {
    /// Generic command status.
    pub const GENERIC: u8 = 0;
    /// Command specific status.
    pub const COMMAND_SPECIFIC: u8 = 1;
    /// Media and data integrity errors.
    pub const MEDIA: u8 = 2;
    /// Path related status.
    pub const PATH: u8 = 3;
}

impl Status {
    /// Status Code.
    pub fn sc(self) -> u8 {
        self.0 as u8
    }

    /// Status Code Type.
    pub fn sct(self) -> u8 {
        ((self.0 >> 8) & 7) as u8
    }

    /// Do Not Retry.
    pub fn dnr(self) -> bool {
        self.0 & (1 << 14) != 0
    }

    /// Successful completion.
    pub fn is_success(self) -> bool {
        self.sc() == 0 && self.sct() == sct::GENERIC
    }

    /// A short name for the common codes (for messages and logs).
    pub fn name(self) -> &'static str {
        match (self.sct(), self.sc()) {
            (sct::GENERIC, 0x00) => "success",
            (sct::GENERIC, 0x01) => "invalid opcode",
            (sct::GENERIC, 0x02) => "invalid field",
            (sct::GENERIC, 0x04) => "data transfer error",
            (sct::GENERIC, 0x05) => "aborted: power loss",
            (sct::GENERIC, 0x06) => "internal error",
            (sct::GENERIC, 0x07) => "aborted: requested",
            (sct::GENERIC, 0x08) => "aborted: SQ deleted",
            (sct::GENERIC, 0x0b) => "invalid namespace",
            (sct::GENERIC, 0x13) => "invalid PRP offset",
            (sct::GENERIC, 0x80) => "LBA out of range",
            (sct::GENERIC, 0x81) => "capacity exceeded",
            (sct::GENERIC, 0x82) => "namespace not ready",
            (sct::COMMAND_SPECIFIC, 0x01) => "invalid queue identifier",
            (sct::COMMAND_SPECIFIC, 0x02) => "invalid queue size",
            (sct::COMMAND_SPECIFIC, 0x20) => "namespace write protected",
            (sct::MEDIA, 0x80) => "write fault",
            (sct::MEDIA, 0x81) => "unrecovered read error",
            (sct::MEDIA, 0x86) => "access denied",
            (sct::MEDIA, 0x87) => "deallocated or unwritten block",
            (sct::PATH, _) => "path error",
            _ => "other",
        }
    }

    /// What a failed I/O command means for the block seam (and so for the guest, which sees
    /// `VIRTIO_BLK_S_IOERR` for `Io` and `VIRTIO_BLK_S_UNSUPP` for `Unsupported`).
    pub fn to_block_error(self) -> BlockError {
        debug_assert!(!self.is_success());
        match (self.sct(), self.sc()) {
            (sct::GENERIC, 0x01) => BlockError::Unsupported,
            (sct::COMMAND_SPECIFIC, 0x20) => BlockError::ReadOnly,
            (sct::GENERIC, 0x02) | (sct::GENERIC, 0x13) => BlockError::Io(libc::EINVAL),
            (sct::GENERIC, 0x04) => BlockError::Io(libc::EFAULT),
            (sct::GENERIC, 0x80) | (sct::GENERIC, 0x81) => BlockError::Io(libc::ENOSPC),
            (sct::GENERIC, 0x05) | (sct::GENERIC, 0x07) | (sct::GENERIC, 0x08) => {
                BlockError::Io(libc::ECANCELED)
            }
            (sct::GENERIC, 0x0b) | (sct::GENERIC, 0x82) => BlockError::Io(libc::ENODEV),
            (sct::MEDIA, 0x86) => BlockError::Io(libc::EACCES),
            (sct::PATH, _) => BlockError::Io(libc::ENOLINK),
            _ => BlockError::Io(libc::EIO),
        }
    }
}

/// What the driver uses from Identify Controller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControllerId {
    /// PCI vendor id.
    pub vid: u16,
    /// Serial number (trimmed).
    pub serial: String,
    /// Model number (trimmed).
    pub model: String,
    /// Firmware revision (trimmed).
    pub firmware: String,
    /// Maximum Data Transfer Size as a power of two of the minimum page size; 0 = no limit.
    pub mdts: u8,
    /// Number of namespaces.
    pub nn: u32,
    /// Optional NVM Command Support (bit 2 DSM, bit 3 Write Zeroes).
    pub oncs: u16,
    /// Volatile Write Cache present.
    pub vwc: bool,
}

impl ControllerId {
    /// Dataset Management is supported.
    pub fn dsm(&self) -> bool {
        self.oncs & (1 << 2) != 0
    }

    /// Write Zeroes is supported.
    pub fn write_zeroes(&self) -> bool {
        self.oncs & (1 << 3) != 0
    }

    /// Parse the 4096-byte Identify Controller data structure.
    pub fn parse(data: &[u8; 4096]) -> ControllerId {
        let text = |r: std::ops::Range<usize>| {
            String::from_utf8_lossy(&data[r]).trim_end_matches([' ', '\0']).trim().to_string()
        };
        ControllerId {
            vid: u16::from_le_bytes([data[0], data[1]]),
            serial: text(4..24),
            model: text(24..64),
            firmware: text(64..72),
            mdts: data[77],
            nn: u32::from_le_bytes([data[516], data[517], data[518], data[519]]),
            oncs: u16::from_le_bytes([data[520], data[521]]),
            vwc: data[525] & 1 != 0,
        }
    }
}

/// What the driver uses from Identify Namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NamespaceId {
    /// Namespace size in logical blocks.
    pub nsze: u64,
    /// Logical block size in bytes (of the format in use).
    pub block_size: u32,
    /// Metadata bytes per block of the format in use (the driver needs 0).
    pub metadata_bytes: u16,
}

impl NamespaceId {
    /// Parse the 4096-byte Identify Namespace data structure. `None` for an inactive
    /// namespace (all zeroes) or a format the driver cannot use (a block size outside
    /// 512..=65536).
    pub fn parse(data: &[u8; 4096]) -> Option<NamespaceId> {
        let nsze = u64::from_le_bytes(data[0..8].try_into().ok()?);
        let nlbaf = usize::from(data[25]);
        let flbas = data[26];
        // FLBAS bits 3:0 pick the format, bits 6:5 extend it past 16 formats.
        let index = usize::from(flbas & 0xf) | (usize::from((flbas >> 5) & 3) << 4);
        if nsze == 0 || index > nlbaf || index >= 64 {
            return None;
        }
        let off = 128 + 4 * index;
        let lbaf = u32::from_le_bytes(data[off..off + 4].try_into().ok()?);
        let lbads = (lbaf >> 16) & 0xff;
        if !(9..=16).contains(&lbads) {
            return None;
        }
        Some(NamespaceId { nsze, block_size: 1 << lbads, metadata_bytes: lbaf as u16 })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_encoding() {
        let sqe = Sqe::rw(nvm::WRITE, 7, 1, 0x1_2345_6789, 8);
        assert_eq!(sqe.opcode(), nvm::WRITE);
        assert_eq!(sqe.cid(), 7);
        assert_eq!((sqe.cdw10, sqe.cdw11, sqe.cdw12), (0x2345_6789, 1, 7));
        let wz = Sqe::write_zeroes(1, 1, 0, 65536, true);
        assert_eq!(wz.cdw12, 0xffff | (1 << 25));
        let dsm = Sqe::deallocate(2, 1, 3, 0x4000);
        assert_eq!((dsm.cdw10, dsm.cdw11, dsm.prp1), (2, 4, 0x4000));
        let cq = Sqe::create_cq(3, 2, 1024, 0x8000);
        assert_eq!((cq.cdw10, cq.cdw11), ((1023 << 16) | 2, 1));
        let sq = Sqe::create_sq(4, 2, 1024, 0x9000, 2);
        assert_eq!((sq.cdw10, sq.cdw11), ((1023 << 16) | 2, (2 << 16) | 1));
        assert_eq!(Sqe::set_num_queues(0, 4).cdw11, 0x0003_0003);
    }

    #[test]
    fn statuses() {
        let ok = Cqe { status: 1, ..Cqe::default() };
        assert!(ok.phase() && ok.status().is_success());
        let lba = Status(0x80);
        assert_eq!(lba.name(), "LBA out of range");
        assert_eq!(lba.to_block_error(), BlockError::Io(libc::ENOSPC));
        let opcode = Status(0x01 | (1 << 14));
        assert!(opcode.dnr());
        assert_eq!(opcode.to_block_error(), BlockError::Unsupported);
        let media = Status((2 << 8) | 0x81);
        assert_eq!(media.sct(), sct::MEDIA);
        assert_eq!(media.name(), "unrecovered read error");
        assert_eq!(media.to_block_error(), BlockError::Io(libc::EIO));
        assert_eq!(Status((1 << 8) | 0x20).to_block_error(), BlockError::ReadOnly);
    }

    #[test]
    fn identify_parsing() {
        let mut c = [0u8; 4096];
        c[0..2].copy_from_slice(&0x1b36u16.to_le_bytes());
        c[4..24].copy_from_slice(b"fl0                 ");
        c[24..64].copy_from_slice(&[b' '; 40]);
        c[24..36].copy_from_slice(b"QEMU NVMe Ct");
        c[77] = 7;
        c[516..520].copy_from_slice(&256u32.to_le_bytes());
        c[520..522].copy_from_slice(&0x000cu16.to_le_bytes());
        c[525] = 1;
        let id = ControllerId::parse(&c);
        assert_eq!(
            (id.vid, id.serial.as_str(), id.model.as_str()),
            (0x1b36, "fl0", "QEMU NVMe Ct")
        );
        assert_eq!((id.mdts, id.nn), (7, 256));
        assert!(id.dsm() && id.write_zeroes() && id.vwc);

        let mut n = [0u8; 4096];
        assert_eq!(NamespaceId::parse(&n), None);
        n[0..8].copy_from_slice(&131072u64.to_le_bytes());
        n[25] = 1; // two formats
        n[26] = 1; // using format 1
        n[128..132].copy_from_slice(&(9u32 << 16).to_le_bytes());
        n[132..136].copy_from_slice(&(12u32 << 16).to_le_bytes());
        let ns = NamespaceId::parse(&n).unwrap();
        assert_eq!((ns.nsze, ns.block_size, ns.metadata_bytes), (131072, 4096, 0));
        n[26] = 2; // beyond NLBAF
        assert_eq!(NamespaceId::parse(&n), None);
        n[26] = 0;
        n[128..132].copy_from_slice(&(30u32 << 16).to_le_bytes());
        assert_eq!(NamespaceId::parse(&n), None);
    }
}
