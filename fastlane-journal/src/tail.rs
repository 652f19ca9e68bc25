//! A tailer: reads a segment directory's records in order from a sequence number on, and
//! keeps its place, so that a reader that follows a live journal (the export to NATS) reads
//! each byte once instead of walking from the start of a segment at every call.
//!
//! Every frame is checked as `scan` checks it (header, CRC32C, seq one past the last, the hash
//! chain continuing across segments; padding frames skipped). The tailer reads only what the
//! caller says is durable (`upto`), so a frame the writer is still writing is never read; a
//! frame that fails its checks at or below `upto` is an error (damage), not the end.

use std::fs::File;
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};

use super::format::{
    chain_next, check_frame, decode_header, frame_len, pad_next, payload, Chain, Defect,
    FrameHeader, Superblock, DATA_OFFSET, FRAME_HEADER_LEN,
};
use super::segments::{list_segments, read_segment_superblock, segment_name, SegmentError};
use super::JournalError;

/// Bytes read from a segment at a time.
const CHUNK: usize = 256 << 10;

/// One record read by [`Tailer::read`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TailRecord {
    /// Its header (seq, producer id in `flags`, timestamp).
    pub header: FrameHeader,
    /// Its payload.
    pub payload: Vec<u8>,
}

struct Open {
    index: u64,
    file: File,
    sb: Superblock,
    key: [u8; 32],
    /// Device offset of the next frame.
    off: u64,
    len: u64,
}

/// Follows a segment directory from a sequence number on.
pub struct Tailer {
    dir: PathBuf,
    seg: Option<Open>,
    /// The seq the next record must have.
    next: u64,
    head: Chain,
    /// Bytes of the open segment from `buf_at`.
    buf: Vec<u8>,
    buf_at: u64,
    buf_len: usize,
}

impl std::fmt::Debug for Tailer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tailer").field("dir", &self.dir).field("next", &self.next).finish()
    }
}

fn damaged(what: &'static str, seq: u64) -> JournalError {
    JournalError::BadRecord { what, value: seq }
}

impl Tailer {
    /// A tailer whose first record will be `from_seq`, or the oldest record kept if retention
    /// removed the segments before it ([`Tailer::next_seq`] says which).
    pub fn open(dir: &Path, from_seq: u64) -> Result<Tailer, JournalError> {
        let segs = list_segments(dir)?;
        let Some(first) = segs.first() else {
            return Err(SegmentError::Empty { dir: dir.to_path_buf() }.into());
        };
        // The last segment whose first seq is at or before `from_seq`.
        let mut pick = (first.index, read_segment_superblock(&first.path)?);
        for s in &segs[1..] {
            let sb = read_segment_superblock(&s.path)?;
            if sb.first_seq > from_seq.max(1) {
                break;
            }
            pick = (s.index, sb);
        }
        let mut t = Tailer {
            dir: dir.to_path_buf(),
            seg: None,
            next: pick.1.first_seq,
            head: pick.1.genesis(),
            buf: vec![0; CHUNK],
            buf_at: 0,
            buf_len: 0,
        };
        t.enter(pick.0, pick.1)?;
        // Skip to `from_seq` (records before it are read and checked, not returned).
        let mut skipped = Vec::new();
        while t.next < from_seq {
            let upto = from_seq - 1;
            let before = t.next;
            t.read(upto, 4096, &mut skipped)?;
            skipped.clear();
            if t.next == before {
                break;
            }
        }
        Ok(t)
    }

    /// The seq of the next record [`read`](Tailer::read) returns.
    pub fn next_seq(&self) -> u64 {
        self.next
    }

    fn enter(&mut self, index: u64, sb: Superblock) -> Result<(), JournalError> {
        let path = self.dir.join(segment_name(index));
        let file = File::open(&path)
            .map_err(|source| JournalError::Io { op: "open segment for reading", source })?;
        let len = file
            .metadata()
            .map_err(|source| JournalError::Io { op: "stat segment", source })?
            .len();
        self.seg = Some(Open { index, file, key: sb.chain_key(), sb, off: DATA_OFFSET, len });
        self.head = sb.genesis();
        self.buf_len = 0;
        Ok(())
    }

    /// Makes `n` bytes of the open segment at `off` available in the chunk buffer (refilled
    /// as needed) and returns where they start in it; `None` past the segment's end.
    fn fill(&mut self, off: u64, n: usize) -> Result<Option<usize>, JournalError> {
        let Some(seg) = &self.seg else { return Ok(None) };
        if off + n as u64 > seg.len {
            return Ok(None);
        }
        let have = off >= self.buf_at && off + n as u64 <= self.buf_at + self.buf_len as u64;
        if !have {
            if n > self.buf.len() {
                self.buf.resize(n, 0);
            }
            let want = (self.buf.len() as u64).min(seg.len - off) as usize;
            seg.file
                .read_exact_at(&mut self.buf[..want], off)
                .map_err(|source| JournalError::Io { op: "read segment", source })?;
            self.buf_at = off;
            self.buf_len = want;
        }
        Ok(Some((off - self.buf_at) as usize))
    }

    /// Appends to `out` the records from [`next_seq`](Tailer::next_seq) up to `upto` (at most
    /// `max`): only durable records, so every frame up to `upto` must be there and intact.
    /// Returns how many it appended.
    pub fn read(
        &mut self,
        upto: u64,
        max: usize,
        out: &mut Vec<TailRecord>,
    ) -> Result<usize, JournalError> {
        let mut n = 0;
        // Whether the chunk buffer was read from the file for this frame (a chunk read earlier
        // may predate the frame: the file grows while the tailer holds the chunk).
        let mut fresh = false;
        // Bounded by `max` and by `upto`: every turn returns a record, moves past a padding
        // frame or into the next segment, rereads a stale chunk once, or returns.
        while n < max && self.next <= upto {
            let Some(seg) = &self.seg else { return Ok(n) };
            let (off, sb, key, index) = (seg.off, seg.sb, seg.key, seg.index);
            let hdr = match self.fill(off, FRAME_HEADER_LEN)? {
                Some(at) => {
                    decode_header(&self.buf[at..at + FRAME_HEADER_LEN], sb.max_record_bytes)
                }
                None => Err(Defect::Zero),
            };
            let stale = |t: &mut Tailer, fresh: &mut bool| {
                let retry = !*fresh;
                t.buf_len = 0;
                *fresh = true;
                retry
            };
            let h = match hdr {
                Ok(h) => h,
                Err(_) if stale(self, &mut fresh) => continue,
                Err(Defect::Zero) => {
                    // The end of this segment's records: the next one must follow.
                    let path = self.dir.join(segment_name(index + 1));
                    if !path.exists() {
                        return Err(damaged("durable record missing", self.next));
                    }
                    let next_sb = read_segment_superblock(&path)?;
                    if next_sb.first_seq != self.next || next_sb.prev_head != self.head {
                        return Err(damaged("next segment does not continue the chain", self.next));
                    }
                    self.enter(index + 1, next_sb)?;
                    continue;
                }
                Err(_) => return Err(damaged("damaged frame header", self.next)),
            };
            let len = frame_len(h.len as usize);
            let Some(at) = self.fill(off, len)? else {
                return Err(damaged("frame past the segment's end", self.next));
            };
            if check_frame(&self.buf[at..at + len], &h, sb.frames_have_flags()).is_err() {
                if stale(self, &mut fresh) {
                    continue;
                }
                return Err(damaged("frame checksum", self.next));
            }
            // A padding frame or a wrong seq in a chunk read earlier may be a block the writer
            // has since rewritten (a batch that went on where the padding was): reread once.
            let suspect = (sb.frames_have_flags() && h.is_pad()) || h.seq != self.next;
            if suspect && stale(self, &mut fresh) {
                continue;
            }
            fresh = false;
            if sb.frames_have_flags() && h.is_pad() {
                if let Some(seg) = &mut self.seg {
                    seg.off = pad_next(off, u64::from(sb.write_align));
                }
                continue;
            }
            if h.seq != self.next {
                return Err(damaged("sequence number out of order", h.seq));
            }
            let p = payload(&self.buf[at..at + len], &h);
            let want = chain_next(&key, &self.head, h.seq, h.len, h.timestamp_ns, h.flags, p);
            if want != h.chain {
                return Err(damaged("hash chain broken", h.seq));
            }
            out.push(TailRecord { header: h, payload: p.to_vec() });
            self.head = h.chain;
            self.next += 1;
            n += 1;
            if let Some(seg) = &mut self.seg {
                seg.off = off + len as u64;
            }
        }
        Ok(n)
    }
}
