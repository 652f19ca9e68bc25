//! Walking a segment directory: [`verify_dir`] (tamper evidence across segments) and
//! [`read_from`] (the records from a seq on, for `dump` and an exporter).
//!
//! Each segment's frames are checked by the single-file [`verify`] and [`scan`]; across
//! segments the walk checks what links them: the same journal id, indexes that follow one
//! another, a `first_seq` just after the previous segment's last record, and a `prev_head`
//! equal to the previous segment's final chain value (which the genesis of the segment binds,
//! so the chain itself runs on unbroken).

use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};

use super::format::{Chain, FrameHeader, Superblock, FORMAT_VERSION};
use super::scan::{read_superblock, scan, ScanError, Stop};
use super::segments::{list_segments, SegmentError, SegmentInfo};
use super::verify::{anchor_problem, hex, verify, Anchor, Problem};
use super::JournalError;

/// The first thing wrong with a segment directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DirProblem {
    /// Inside one segment: what the single-file verify says (offsets are in that file).
    InSegment {
        /// The segment file.
        path: PathBuf,
        /// Its index.
        index: u64,
        /// The problem.
        problem: Problem,
    },
    /// The superblock of the file carries another index than its name: segments swapped
    /// or renamed.
    Misnamed {
        /// The file.
        path: PathBuf,
        /// The index its name says.
        named: u64,
        /// The index its superblock says.
        found: u64,
    },
    /// A segment of format version 1 (a single-device journal copied in).
    Version {
        /// The file.
        path: PathBuf,
        /// Its version.
        version: u32,
    },
    /// A segment of another journal.
    JournalId {
        /// The file.
        path: PathBuf,
        /// Its index.
        index: u64,
    },
    /// Segments `first..=last` are missing before `path` (records after `after_seq` lost).
    Missing {
        /// The segment after the gap.
        path: PathBuf,
        /// First missing index.
        first: u64,
        /// Last missing index.
        last: u64,
        /// The last seq before the gap.
        after_seq: u64,
    },
    /// The segment does not start right after the previous segment's last record.
    FirstSeq {
        /// The file.
        path: PathBuf,
        /// Its index.
        index: u64,
        /// Its superblock's first seq.
        found: u64,
        /// The previous segment's last seq + 1.
        expected: u64,
    },
    /// The segment's `prev_head` is not the previous segment's final chain value: records
    /// removed from the end of the previous segment, or a segment replaced.
    PrevHead {
        /// The file.
        path: PathBuf,
        /// Its index.
        index: u64,
        /// The previous segment's last seq.
        after_seq: u64,
        /// The previous segment's final chain value.
        expected: Chain,
        /// This segment's `prev_head`.
        found: Chain,
    },
    /// The chain is intact but does not end where the caller's anchor says.
    Anchor(Problem),
}

impl fmt::Display for DirProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DirProblem::InSegment { path, index, problem } => {
                write!(f, "segment {index} ({}): {problem}", path.display())
            }
            DirProblem::Misnamed { path, named, found } => write!(
                f,
                "{}: superblock says segment {found}, name says {named} (segments swapped or \
                 renamed)",
                path.display()
            ),
            DirProblem::Version { path, version } => write!(
                f,
                "{}: format version {version} in a segment directory (segments are version \
                 {FORMAT_VERSION})",
                path.display()
            ),
            DirProblem::JournalId { path, index } => {
                write!(f, "segment {index} ({}) belongs to another journal", path.display())
            }
            DirProblem::Missing { path, first, last, after_seq } => write!(
                f,
                "segments {first}..={last} missing before {} (records after seq {after_seq} \
                 removed)",
                path.display()
            ),
            DirProblem::FirstSeq { path, index, found, expected } => write!(
                f,
                "segment {index} ({}) starts at seq {found}, expected {expected} (records \
                 removed or reordered between segments)",
                path.display()
            ),
            DirProblem::PrevHead { path, index, after_seq, expected, found } => write!(
                f,
                "segment {index} ({}) does not continue the chain after seq {after_seq}: \
                 prev_head {}, the previous segment ends with {} (records removed from its end, \
                 or a segment replaced)",
                path.display(),
                hex(found),
                hex(expected)
            ),
            DirProblem::Anchor(p) => write!(f, "{p}"),
        }
    }
}

/// What [`verify_dir`] reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirVerifyReport {
    /// Segments verified (up to and including the one with the first problem).
    pub segments: u64,
    /// Index of the first present segment (above 0: older ones were removed by retention).
    pub first_segment: u64,
    /// Index of the last segment verified.
    pub last_segment: u64,
    /// The first present segment's first seq: the directory holds records from here on.
    pub first_seq: u64,
    /// Intact records before the first problem (all of them if none).
    pub records: u64,
    /// Seq of the last intact record (`first_seq - 1` if none).
    pub last_seq: u64,
    /// Chain value of the last intact record: an anchor to keep elsewhere.
    pub head: Chain,
    /// Offset after the last intact record, in the last segment verified.
    pub end: u64,
    /// The first problem, if any.
    pub problem: Option<DirProblem>,
}

/// The previous segment, as the walk left it.
#[derive(Debug, Clone, Copy)]
struct Prev {
    index: u64,
    journal_id: [u8; 16],
    last_seq: u64,
    head: Chain,
}

/// What links segment `sb` (file `info`) to the one before it, if anything is wrong.
fn link_problem(info: &SegmentInfo, sb: &Superblock, prev: Option<&Prev>) -> Option<DirProblem> {
    let path = info.path.clone();
    if sb.version != FORMAT_VERSION {
        return Some(DirProblem::Version { path, version: sb.version });
    }
    if sb.segment != info.index {
        return Some(DirProblem::Misnamed { path, named: info.index, found: sb.segment });
    }
    let p = prev?;
    let index = info.index;
    if sb.journal_id != p.journal_id {
        return Some(DirProblem::JournalId { path, index });
    }
    if p.index.checked_add(1) != Some(index) {
        let (first, last, after_seq) = (p.index + 1, index.saturating_sub(1), p.last_seq);
        return Some(DirProblem::Missing { path, first, last, after_seq });
    }
    if sb.first_seq != p.last_seq + 1 {
        return Some(DirProblem::FirstSeq {
            path,
            index,
            found: sb.first_seq,
            expected: p.last_seq + 1,
        });
    }
    if sb.prev_head != p.head {
        return Some(DirProblem::PrevHead {
            path,
            index,
            after_seq: p.last_seq,
            expected: p.head,
            found: sb.prev_head,
        });
    }
    None
}

/// Verifies every segment of the directory `dir`, oldest first, and the links between them;
/// names the first problem. The newest segment may end in zeroes like a single file (a torn
/// tail that recovery has not zeroed yet is reported, as for a single file).
pub fn verify_dir(dir: &Path, anchor: Anchor) -> Result<DirVerifyReport, JournalError> {
    let segs = list_segments(dir)?;
    let Some(first) = segs.first() else {
        return Err(SegmentError::Empty { dir: dir.to_path_buf() }.into());
    };
    let mut rep = DirVerifyReport {
        segments: 0,
        first_segment: first.index,
        last_segment: first.index,
        first_seq: 0,
        records: 0,
        last_seq: 0,
        head: [0; 16],
        end: 0,
        problem: None,
    };
    let mut prev: Option<Prev> = None;
    for info in &segs {
        let io = |op| move |source| SegmentError::Io { op, path: info.path.clone(), source };
        let mut f = File::open(&info.path).map_err(io("open"))?;
        rep.segments += 1;
        rep.last_segment = info.index;
        let in_segment =
            |problem| DirProblem::InSegment { path: info.path.clone(), index: info.index, problem };
        let sb = match read_superblock(&mut f) {
            Ok(sb) => sb,
            Err(ScanError::Super(e)) => {
                rep.problem = Some(in_segment(Problem::Superblock(e)));
                return Ok(rep);
            }
            Err(ScanError::Io(e)) => return Err(io("read")(e).into()),
        };
        if prev.is_none() {
            rep.first_seq = sb.first_seq;
            rep.last_seq = sb.first_seq - 1;
            rep.head = sb.prev_head;
        }
        if let Some(p) = link_problem(info, &sb, prev.as_ref()) {
            rep.problem = Some(p);
            return Ok(rep);
        }
        let r = verify(&mut f, Anchor::default()).map_err(io("read"))?;
        rep.records += r.records;
        rep.last_seq = r.last_seq;
        rep.head = r.head;
        rep.end = r.end;
        if let Some(p) = r.problem {
            rep.problem = Some(in_segment(p));
            return Ok(rep);
        }
        prev = Some(Prev {
            index: info.index,
            journal_id: sb.journal_id,
            last_seq: r.last_seq,
            head: r.head,
        });
    }
    rep.problem = anchor_problem(&anchor, rep.last_seq, rep.head).map(DirProblem::Anchor);
    Ok(rep)
}

/// Why [`read_from`] stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadEnd {
    /// The end of what is written: a zero header, or (in the newest segment, which a writer
    /// may be appending to) an incomplete frame. Read again from `last_seq + 1` later.
    End,
    /// The visitor returned `false`.
    Visitor,
    /// Something is wrong (verify the directory for the full story).
    Problem(DirProblem),
}

/// Where [`read_from`] stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadStop {
    /// Records handed to the visitor.
    pub visited: u64,
    /// The last seq walked (handed over or skipped as below `from_seq`); the first
    /// segment's `first_seq - 1` if none.
    pub last_seq: u64,
    /// Chain value after `last_seq`.
    pub head: Chain,
    /// The first seq the walk could start from: above `from_seq` when retention removed
    /// the segments holding it.
    pub first_seq: u64,
    /// Why it stopped.
    pub end: ReadEnd,
}

/// Walks the records of the directory `dir` with seq `>= from_seq`, in order across
/// segments (starting at the newest segment whose `first_seq <= from_seq`), handing each
/// header and payload to `visit` (return `false` to stop). CRC32C, seq order and the hash
/// chain are checked as it goes, and the links between segments. Tolerates a writer
/// appending to the newest segment: it stops at the first zero or incomplete frame there.
/// Memory: one frame buffer (bounded by the superblock's `max_record_bytes`, itself at most
/// 16 MiB) and one superblock per segment.
pub fn read_from(
    dir: &Path,
    from_seq: u64,
    visit: &mut dyn FnMut(&FrameHeader, &[u8]) -> bool,
) -> Result<ReadStop, JournalError> {
    let segs = list_segments(dir)?;
    if segs.is_empty() {
        return Err(SegmentError::Empty { dir: dir.to_path_buf() }.into());
    }
    let mut stop =
        ReadStop { visited: 0, last_seq: 0, head: [0; 16], first_seq: 0, end: ReadEnd::End };
    // Each segment's superblock, to find where `from_seq` lies.
    let mut sbs = Vec::with_capacity(segs.len());
    for info in &segs {
        let io = |source| SegmentError::Io { op: "read", path: info.path.clone(), source };
        let mut f = File::open(&info.path).map_err(io)?;
        match read_superblock(&mut f) {
            Ok(sb) => sbs.push(sb),
            Err(ScanError::Io(e)) => return Err(io(e).into()),
            Err(ScanError::Super(e)) => {
                let path = info.path.clone();
                let problem = Problem::Superblock(e);
                stop.end =
                    ReadEnd::Problem(DirProblem::InSegment { path, index: info.index, problem });
                return Ok(stop);
            }
        }
    }
    let start = sbs.iter().rposition(|sb| sb.first_seq <= from_seq).unwrap_or(0);
    stop.first_seq = sbs[start].first_seq;
    stop.last_seq = sbs[start].first_seq - 1;
    stop.head = sbs[start].prev_head;
    let mut prev: Option<Prev> = None;
    let newest = segs.len() - 1;
    for (k, (info, sb)) in segs.iter().zip(&sbs).enumerate().skip(start) {
        if let Some(p) = link_problem(info, sb, prev.as_ref()) {
            stop.end = ReadEnd::Problem(p);
            return Ok(stop);
        }
        let io = |source| SegmentError::Io { op: "read", path: info.path.clone(), source };
        let mut f = File::open(&info.path).map_err(io)?;
        let mut visited = 0u64;
        // The frame the visitor refused: checked and handed over, so walked.
        let mut refused: Option<(u64, Chain)> = None;
        let s = scan(&mut f, &mut |v| {
            if v.header.seq < from_seq {
                return true;
            }
            visited += 1;
            if !visit(v.header, v.payload) {
                refused = Some((v.header.seq, v.header.chain));
                return false;
            }
            true
        });
        let s = match s {
            Ok(s) => s,
            Err(ScanError::Io(e)) => return Err(io(e).into()),
            // Read once above; changed since: report, do not guess.
            Err(ScanError::Super(e)) => {
                let problem = Problem::Superblock(e);
                let index = info.index;
                let path = info.path.clone();
                stop.end = ReadEnd::Problem(DirProblem::InSegment { path, index, problem });
                return Ok(stop);
            }
        };
        stop.visited += visited;
        if let Some((seq, chain)) = refused {
            (stop.last_seq, stop.head, stop.end) = (seq, chain, ReadEnd::Visitor);
            return Ok(stop);
        }
        stop.last_seq = s.last_seq;
        stop.head = s.head;
        let problem = match s.stop {
            Stop::Clean | Stop::DeviceEnd => None,
            // A frame being written: the end of what is there, in the newest segment only.
            Stop::Defect { .. } if k == newest => None,
            Stop::Defect { offset, defect, seq } => {
                Some(Problem::Changed { offset, after_seq: s.last_seq, seq, what: defect.what() })
            }
            Stop::Seq { offset, seq, prev } => {
                Some(Problem::Reordered { offset, seq, after_seq: prev })
            }
            Stop::Chain { offset, seq } => Some(Problem::Changed {
                offset,
                after_seq: s.last_seq,
                seq: Some(seq),
                what: "does not link into the hash chain",
            }),
        };
        if let Some(problem) = problem {
            let (path, index) = (info.path.clone(), info.index);
            stop.end = ReadEnd::Problem(DirProblem::InSegment { path, index, problem });
            return Ok(stop);
        }
        prev = Some(Prev {
            index: info.index,
            journal_id: sb.journal_id,
            last_seq: s.last_seq,
            head: s.head,
        });
    }
    Ok(stop)
}
