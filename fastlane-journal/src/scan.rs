//! Walking the frames of a journal image: recovery on open, `verify` and `dump` share this.
//!
//! The scan reads the superblock, then frame after frame from [`DATA_OFFSET`], checking each
//! one's length, CRC32C, sequence number (strictly increasing, from the superblock's first seq)
//! and hash-chain link. It stops at the first frame that fails any check; what lies there is
//! reported, and the caller decides whether it is a torn tail (recovery truncates it) or
//! tampering (`verify` names it).

use std::io;

use super::format::{
    chain_next, check_frame, decode_header, frame_len, pad_next, payload, Chain, Defect,
    FrameHeader, SuperError, Superblock, DATA_OFFSET, FRAME_HEADER_LEN, SUPER_LEN_V2,
};
use super::io::ReadAt;

/// Why the scan stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// An all-zero header: the clean end.
    Clean,
    /// The device ends (no room for another header).
    DeviceEnd,
    /// The bytes at `offset` are not a valid frame.
    Defect {
        /// Device offset.
        offset: u64,
        /// What is wrong.
        defect: Defect,
        /// The seq in the header, if the header decoded.
        seq: Option<u64>,
    },
    /// A frame with a valid CRC whose seq does not follow: not greater than the previous one.
    Seq {
        /// Device offset.
        offset: u64,
        /// Its seq.
        seq: u64,
        /// The previous frame's seq.
        prev: u64,
    },
    /// A frame with a valid CRC that does not link to the previous frame's chain value.
    Chain {
        /// Device offset.
        offset: u64,
        /// Its seq.
        seq: u64,
    },
}

/// The outcome of a scan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scan {
    /// The superblock.
    pub superblock: Superblock,
    /// Device offset just after the last valid frame.
    pub end: u64,
    /// Seq of the last valid frame (`first_seq - 1` when there is none).
    pub last_seq: u64,
    /// Chain value of the last valid frame (the genesis value when there is none).
    pub head: Chain,
    /// Valid frames.
    pub records: u64,
    /// Why the scan stopped.
    pub stop: Stop,
}

/// Why a scan could not even start.
#[derive(Debug, thiserror::Error)]
pub enum ScanError {
    /// Reading failed.
    #[error("read failed")]
    Io(#[from] io::Error),
    /// The superblock is invalid.
    #[error("superblock: {0}")]
    Super(#[from] SuperError),
}

/// One valid frame, as handed to the visitor.
#[derive(Debug, Clone, Copy)]
pub struct Visit<'a> {
    /// Device offset of the frame.
    pub offset: u64,
    /// Its header.
    pub header: &'a FrameHeader,
    /// Its payload.
    pub payload: &'a [u8],
}

/// Reads and decodes the superblock (either version).
pub fn read_superblock(r: &mut dyn ReadAt) -> Result<Superblock, ScanError> {
    let mut raw = [0u8; SUPER_LEN_V2];
    // A device shorter than a version-2 superblock: decode what there is (and refuse it).
    let n = r.len_bytes().min(SUPER_LEN_V2 as u64) as usize;
    r.read_at(0, &mut raw[..n])?;
    Ok(Superblock::decode(&raw[..n])?)
}

/// Scans every valid frame, calling `visit` for each (return `false` to stop early, which
/// reports [`Stop::Clean`] at that point).
pub fn scan(
    r: &mut dyn ReadAt,
    visit: &mut dyn FnMut(Visit<'_>) -> bool,
) -> Result<Scan, ScanError> {
    let sb = read_superblock(r)?;
    let dev_len = r.len_bytes();
    let key = sb.chain_key();
    let flags_allowed = sb.frames_have_flags();
    let mut head = sb.genesis();
    let mut prev = sb.first_seq - 1;
    let mut off = DATA_OFFSET;
    let mut records = 0u64;
    let mut frame = vec![0u8; frame_len(sb.max_record_bytes as usize)];
    let stop = loop {
        if dev_len < FRAME_HEADER_LEN as u64 || off > dev_len - FRAME_HEADER_LEN as u64 {
            break Stop::DeviceEnd;
        }
        r.read_at(off, &mut frame[..FRAME_HEADER_LEN])?;
        let h = match decode_header(&frame[..FRAME_HEADER_LEN], sb.max_record_bytes) {
            Ok(h) => h,
            Err(Defect::Zero) => break Stop::Clean,
            Err(defect) => break Stop::Defect { offset: off, defect, seq: None },
        };
        let n = frame_len(h.len as usize);
        if off + n as u64 > dev_len {
            break Stop::Defect { offset: off, defect: Defect::PastEnd, seq: Some(h.seq) };
        }
        r.read_at(off + FRAME_HEADER_LEN as u64, &mut frame[FRAME_HEADER_LEN..n])?;
        if let Err(defect) = check_frame(&frame[..n], &h, flags_allowed) {
            break Stop::Defect { offset: off, defect, seq: Some(h.seq) };
        }
        if flags_allowed && h.is_pad() {
            // Padding: the frames go on at the next block (or the journal ends there).
            off = pad_next(off, u64::from(sb.write_align));
            continue;
        }
        if h.seq <= prev {
            break Stop::Seq { offset: off, seq: h.seq, prev };
        }
        let p = payload(&frame[..n], &h);
        let want = chain_next(&key, &head, h.seq, h.len, h.timestamp_ns, h.flags, p);
        if want != h.chain {
            break Stop::Chain { offset: off, seq: h.seq };
        }
        if !visit(Visit { offset: off, header: &h, payload: p }) {
            break Stop::Clean;
        }
        head = h.chain;
        prev = h.seq;
        records += 1;
        off += n as u64;
    };
    Ok(Scan { superblock: sb, end: off, last_seq: prev, head, records, stop })
}

/// Whether `len` bytes at `offset` are all zero (bounded by the device end).
pub fn is_zero(r: &mut dyn ReadAt, offset: u64, len: u64) -> io::Result<bool> {
    let end = offset.saturating_add(len).min(r.len_bytes());
    let mut buf = [0u8; 4096];
    let mut off = offset;
    while off < end {
        let n = (end - off).min(buf.len() as u64) as usize;
        r.read_at(off, &mut buf[..n])?;
        if buf[..n].iter().any(|&b| b != 0) {
            return Ok(false);
        }
        off += n as u64;
    }
    Ok(true)
}

/// The first non-zero byte in `[offset, end of device)`, if any.
pub fn first_nonzero(r: &mut dyn ReadAt, offset: u64) -> io::Result<Option<u64>> {
    let end = r.len_bytes();
    let mut buf = vec![0u8; 1 << 16];
    let mut off = offset;
    while off < end {
        let n = (end - off).min(buf.len() as u64) as usize;
        r.read_at(off, &mut buf[..n])?;
        if let Some(i) = buf[..n].iter().position(|&b| b != 0) {
            return Ok(Some(off + i as u64));
        }
        off += n as u64;
    }
    Ok(None)
}
