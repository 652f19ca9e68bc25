//! Tamper evidence: walk the hash chain of a journal image and name the first record that was
//! changed, removed or reordered.

use std::fmt;

use super::format::{
    check_frame, decode_header, frame_len, Chain, Defect, SuperError, Superblock, DATA_OFFSET,
};
use super::io::ReadAt;
use super::scan::{first_nonzero, scan, ScanError, Stop};

/// What `verify` found wrong first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Problem {
    /// The superblock is damaged (every chain value depends on it).
    Superblock(SuperError),
    /// A byte of the superblock's reserved (zero) area is set.
    SuperblockReserved {
        /// Its offset.
        offset: u64,
    },
    /// The frame after seq `after_seq` (at `offset`) was changed: its bytes do not match its
    /// CRC32C, or they match a recomputed CRC but not the hash chain.
    Changed {
        /// Device offset of the frame.
        offset: u64,
        /// The last intact seq before it.
        after_seq: u64,
        /// The seq its header claims, if the header still decodes.
        seq: Option<u64>,
        /// What check failed.
        what: &'static str,
    },
    /// Records `first..=last` are missing: the frame at `offset` is intact but follows a
    /// gap and does not link to the frame before it.
    Removed {
        /// Device offset of the frame after the gap.
        offset: u64,
        /// First missing seq.
        first: u64,
        /// Last missing seq.
        last: u64,
    },
    /// An intact record stands out of order at `offset`: seq `seq` after seq `after_seq`.
    Reordered {
        /// Device offset.
        offset: u64,
        /// The seq found.
        seq: u64,
        /// The seq before it.
        after_seq: u64,
    },
    /// Non-zero bytes after the last record: a torn tail that was never recovered, or bytes
    /// written behind the journal's back.
    TrailingBytes {
        /// Offset of the first such byte.
        offset: u64,
    },
    /// The chain is intact but ends elsewhere than the caller's anchor says (records removed
    /// from the end, or the whole chain rewritten).
    AnchorMismatch {
        /// What the journal ends with: last seq.
        last_seq: u64,
        /// What the journal ends with: head chain value.
        head: Chain,
    },
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::Superblock(e) => write!(f, "superblock damaged: {e}"),
            Problem::SuperblockReserved { offset } => {
                write!(f, "superblock damaged: reserved byte at offset {offset} is not zero")
            }
            Problem::Changed { offset, after_seq, seq, what } => {
                write!(f, "record after seq {after_seq} changed at offset {offset} ({what}")?;
                if let Some(s) = seq {
                    write!(f, "; header says seq {s}")?;
                }
                write!(f, ")")
            }
            Problem::Removed { offset, first, last } => {
                write!(f, "records {first}..={last} removed (gap before offset {offset})")
            }
            Problem::Reordered { offset, seq, after_seq } => {
                write!(f, "record {seq} reordered: found after seq {after_seq} at offset {offset}")
            }
            Problem::TrailingBytes { offset } => {
                write!(f, "non-zero bytes after the last record, at offset {offset}")
            }
            Problem::AnchorMismatch { last_seq, head } => {
                write!(f, "chain ends at seq {last_seq} head {} (not the anchor)", hex(head))
            }
        }
    }
}

/// Lower-case hex.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// What `verify` reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyReport {
    /// Intact records before the first problem (all of them if none).
    pub records: u64,
    /// Seq of the last intact record.
    pub last_seq: u64,
    /// Chain value of the last intact record: an anchor to keep elsewhere.
    pub head: Chain,
    /// Device offset after the last intact record.
    pub end: u64,
    /// The first problem, if any.
    pub problem: Option<Problem>,
}

/// An anchor kept outside the journal (from an earlier verify, or the replica).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Anchor {
    /// The journal must end at this seq.
    pub last_seq: Option<u64>,
    /// The journal's chain must end with this value.
    pub head: Option<Chain>,
}

/// Verifies the journal image read through `r`.
pub fn verify(r: &mut dyn ReadAt, anchor: Anchor) -> Result<VerifyReport, std::io::Error> {
    let s = match scan(r, &mut |_| true) {
        Ok(s) => s,
        Err(ScanError::Io(e)) => return Err(e),
        Err(ScanError::Super(e)) => {
            return Ok(VerifyReport {
                records: 0,
                last_seq: 0,
                head: [0; 16],
                end: 0,
                problem: Some(Problem::Superblock(e)),
            })
        }
    };
    // The superblock's unused bytes are zero: any other value is tampering or damage.
    let fields_end = s.superblock.encoded_len() as u64;
    if let Some(offset) = first_nonzero_in(r, fields_end, DATA_OFFSET)? {
        let head = s.head;
        let problem = Some(Problem::SuperblockReserved { offset });
        return Ok(VerifyReport {
            records: s.records,
            last_seq: s.last_seq,
            head,
            end: s.end,
            problem,
        });
    }
    let problem = match s.stop {
        Stop::Clean | Stop::DeviceEnd => match first_nonzero(r, s.end)? {
            Some(offset) => Some(Problem::TrailingBytes { offset }),
            None => anchor_problem(&anchor, s.last_seq, s.head),
        },
        Stop::Defect { offset, defect, seq } => {
            Some(Problem::Changed { offset, after_seq: s.last_seq, seq, what: defect.what() })
        }
        Stop::Seq { offset, seq, prev } => {
            Some(Problem::Reordered { offset, seq, after_seq: prev })
        }
        Stop::Chain { offset, seq } => {
            let expected = s.last_seq + 1;
            if seq == expected {
                Some(Problem::Changed {
                    offset,
                    after_seq: s.last_seq,
                    seq: Some(seq),
                    what: "does not link into the hash chain",
                })
            } else if seq_appears_later(r, &s.superblock, offset, expected)? {
                Some(Problem::Reordered { offset, seq, after_seq: s.last_seq })
            } else {
                Some(Problem::Removed { offset, first: expected, last: seq - 1 })
            }
        }
    };
    Ok(VerifyReport { records: s.records, last_seq: s.last_seq, head: s.head, end: s.end, problem })
}

pub(crate) fn anchor_problem(anchor: &Anchor, last_seq: u64, head: Chain) -> Option<Problem> {
    let seq_bad = anchor.last_seq.is_some_and(|a| a != last_seq);
    let head_bad = anchor.head.is_some_and(|a| a != head);
    (seq_bad || head_bad).then_some(Problem::AnchorMismatch { last_seq, head })
}

/// Whether a frame with an intact CRC and seq `want` lies at or after `from` (walking frame by
/// frame while frames decode; bounded by the device).
fn seq_appears_later(
    r: &mut dyn ReadAt,
    sb: &Superblock,
    from: u64,
    want: u64,
) -> Result<bool, std::io::Error> {
    let dev = r.len_bytes();
    let mut off = from;
    let mut frame = vec![0u8; frame_len(sb.max_record_bytes as usize)];
    while off + 48 <= dev {
        r.read_at(off, &mut frame[..48])?;
        let h = match decode_header(&frame[..48], sb.max_record_bytes) {
            Ok(h) => h,
            Err(Defect::Zero) | Err(_) => return Ok(false),
        };
        let n = frame_len(h.len as usize);
        if off + n as u64 > dev {
            return Ok(false);
        }
        r.read_at(off + 48, &mut frame[48..n])?;
        if check_frame(&frame[..n], &h, sb.frames_have_flags()).is_err() {
            return Ok(false);
        }
        if sb.frames_have_flags() && h.is_pad() {
            off = super::format::pad_next(off, u64::from(sb.write_align));
            continue;
        }
        if h.seq == want {
            return Ok(true);
        }
        off += n as u64;
    }
    Ok(false)
}

fn first_nonzero_in(r: &mut dyn ReadAt, from: u64, to: u64) -> Result<Option<u64>, std::io::Error> {
    let to = to.min(r.len_bytes());
    if from >= to {
        return Ok(None);
    }
    let mut buf = vec![0u8; (to - from) as usize];
    r.read_at(from, &mut buf)?;
    Ok(buf.iter().position(|&b| b != 0).map(|i| from + i as u64))
}
