//! The on-disk format: a superblock, then frames, each linked to the one before it by a hash
//! chain. Everything here is pure (bytes in, values out) so that recovery, `verify` and `dump`
//! share one decoder, and every input is treated as hostile: lengths are bounded before they
//! are used, arithmetic is checked, nothing panics on any byte pattern.
//!
//! All integers are little-endian. See `docs/journal.md` for the tables.

use crc32c::{crc32c, crc32c_append};

/// Superblock magic, at offset 0.
pub const SUPER_MAGIC: [u8; 8] = *b"FLJOURN1";
/// Format version this code writes: 2 (segments, producer ids in the frame flags).
pub const FORMAT_VERSION: u32 = 2;
/// The first format version: one device, frame flags always 0. Still read, verified and
/// recovered; never written by new journals.
pub const FORMAT_VERSION_V1: u32 = 1;
/// Bytes of the superblock region (the first frame starts here).
pub const DATA_OFFSET: u64 = 4096;
/// Bytes of a version-1 superblock that carry fields (the rest of its 4 KiB is zero).
pub const SUPER_LEN: usize = 72;
/// Bytes of a version-2 superblock that carry fields: the version-1 fields (with their own
/// CRC32C at 68..72), then `segment`, `prev_head` and a CRC32C over all of it.
pub const SUPER_LEN_V2: usize = 100;
/// Offset of the CRC32C of bytes `0..68` (both versions).
const SUPER_CRC_AT: usize = 68;
/// Offset of a version-2 superblock's segment index (u64).
const SUPER_SEGMENT_AT: usize = 72;
/// Offset of a version-2 superblock's `prev_head` (16 bytes).
const SUPER_PREV_HEAD_AT: usize = 80;
/// Offset of a version-2 superblock's CRC32C of bytes `0..96`.
const SUPER_CRC_V2_AT: usize = 96;
/// Frame magic `"FLJR"` as a little-endian u32.
pub const FRAME_MAGIC: u32 = u32::from_le_bytes(*b"FLJR");
/// Bytes of a frame header.
pub const FRAME_HEADER_LEN: usize = 48;
/// Bytes of the hash-chain value stored in each frame (BLAKE3, truncated).
pub const CHAIN_LEN: usize = 16;
/// Alignment of frames on disk.
pub const FRAME_ALIGN: u64 = 8;
/// Largest `max_record_bytes` a superblock may declare.
pub const MAX_RECORD_BYTES_LIMIT: u32 = 16 << 20;
/// Largest `max_batch_bytes` a superblock may declare.
pub const MAX_BATCH_BYTES_LIMIT: u32 = 256 << 20;

/// A hash-chain value.
pub type Chain = [u8; CHAIN_LEN];

/// The durability level a journal promises when it acknowledges a sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Durability {
    /// Written to the backend (page cache for a file); survives a process crash, not a power
    /// cut.
    Memory,
    /// Written and flushed: survives a power cut of this machine.
    Local,
    /// Flushed locally and acknowledged durable by the replica.
    Replicated,
}

impl Durability {
    /// The code stored in the superblock.
    pub fn code(self) -> u32 {
        match self {
            Durability::Memory => 0,
            Durability::Local => 1,
            Durability::Replicated => 2,
        }
    }

    /// The level for a superblock code.
    pub fn from_code(code: u32) -> Option<Durability> {
        match code {
            0 => Some(Durability::Memory),
            1 => Some(Durability::Local),
            2 => Some(Durability::Replicated),
            _ => None,
        }
    }
}

impl std::str::FromStr for Durability {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "memory" => Ok(Durability::Memory),
            "local" => Ok(Durability::Local),
            "replicated" => Ok(Durability::Replicated),
            _ => Err(format!("unknown durability {s:?}: memory, local or replicated")),
        }
    }
}

impl std::fmt::Display for Durability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Durability::Memory => "memory",
            Durability::Local => "local",
            Durability::Replicated => "replicated",
        })
    }
}

/// The decoded superblock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Superblock {
    /// Format version: [`FORMAT_VERSION_V1`] (read only) or [`FORMAT_VERSION`].
    pub version: u32,
    /// Granularity of the writer's writes (a power of two, ≥ the device block size, ≥ 512).
    pub write_align: u32,
    /// Random at creation; keys the hash chain, so frames of an earlier journal on the same
    /// device never link into this one.
    pub journal_id: [u8; 16],
    /// Creation time, ns since the Unix epoch (informational).
    pub created_unix_ns: u64,
    /// Sequence number of the first record.
    pub first_seq: u64,
    /// Most bytes the writer puts into one batch write: also bounds how far a torn tail
    /// reaches past the last valid frame.
    pub max_batch_bytes: u32,
    /// Longest payload of a record.
    pub max_record_bytes: u32,
    /// Durability level at creation (informational).
    pub durability: Durability,
    /// The segment's index in its directory (0 for the first segment, a single-device
    /// journal, and every version-1 journal).
    pub segment: u64,
    /// Chain value of the last record before this segment (zero for segment 0 and version
    /// 1). Bound into [`genesis`](Superblock::genesis): the chain continues across segments.
    pub prev_head: Chain,
}

/// Why a superblock was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SuperError {
    /// Not a journal.
    #[error("bad superblock magic")]
    Magic,
    /// Checksum mismatch.
    #[error("superblock checksum mismatch (stored {stored:#010x}, computed {computed:#010x})")]
    Crc {
        /// Stored.
        stored: u32,
        /// Computed.
        computed: u32,
    },
    /// A version this code does not read.
    #[error("unsupported journal version {0}")]
    Version(u32),
    /// A field is out of range.
    #[error("superblock field {field} out of range: {value}")]
    Field {
        /// Which.
        field: &'static str,
        /// Its value.
        value: u64,
    },
}

/// The little-endian u32 at `b[off..off + 4]` (the caller has checked the length).
pub(crate) fn u32_at(b: &[u8], off: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[off..off + 4]);
    u32::from_le_bytes(w)
}

/// The little-endian u64 at `b[off..off + 8]` (the caller has checked the length).
pub(crate) fn u64_at(b: &[u8], off: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(w)
}

impl Superblock {
    /// A version-2 superblock for segment 0 (`prev_head` zero), `write_align` 4096.
    pub fn new(
        journal_id: [u8; 16],
        created_unix_ns: u64,
        first_seq: u64,
        max_batch_bytes: u32,
        max_record_bytes: u32,
        durability: Durability,
    ) -> Superblock {
        Superblock {
            version: FORMAT_VERSION,
            write_align: 4096,
            journal_id,
            created_unix_ns,
            first_seq,
            max_batch_bytes,
            max_record_bytes,
            durability,
            segment: 0,
            prev_head: [0; CHAIN_LEN],
        }
    }

    /// The superblock of the segment after this one: same journal and limits, the next
    /// index, starting at `first_seq` after a chain that ended with `prev_head`, created
    /// (rolled) at `created_unix_ns`. Always version 2.
    pub fn next_segment(&self, created_unix_ns: u64, first_seq: u64, prev_head: Chain) -> Self {
        Superblock {
            version: FORMAT_VERSION,
            created_unix_ns,
            first_seq,
            segment: self.segment.saturating_add(1),
            prev_head,
            ..*self
        }
    }

    /// Bytes [`encode`](Superblock::encode) writes: [`SUPER_LEN`] for version 1, else
    /// [`SUPER_LEN_V2`].
    pub fn encoded_len(&self) -> usize {
        if self.version == FORMAT_VERSION_V1 {
            SUPER_LEN
        } else {
            SUPER_LEN_V2
        }
    }

    /// Whether frames may carry non-zero flags (a producer id): version 2 and later.
    pub fn frames_have_flags(&self) -> bool {
        self.version != FORMAT_VERSION_V1
    }

    /// Encodes into the first [`encoded_len`](Superblock::encoded_len) bytes of `out` (the
    /// caller zeroes the rest). Version 1 is written byte for byte as before; any other
    /// version is written in the version-2 layout (and a version `decode` does not know is
    /// refused there).
    pub fn encode(&self, out: &mut [u8]) {
        let b = &mut out[..self.encoded_len()];
        b.fill(0);
        b[0..8].copy_from_slice(&SUPER_MAGIC);
        b[8..12].copy_from_slice(&self.version.to_le_bytes());
        b[12..16].copy_from_slice(&self.write_align.to_le_bytes());
        b[16..32].copy_from_slice(&self.journal_id);
        b[32..40].copy_from_slice(&self.created_unix_ns.to_le_bytes());
        b[40..48].copy_from_slice(&self.first_seq.to_le_bytes());
        b[48..52].copy_from_slice(&self.max_batch_bytes.to_le_bytes());
        b[52..56].copy_from_slice(&self.max_record_bytes.to_le_bytes());
        b[56..64].copy_from_slice(&DATA_OFFSET.to_le_bytes());
        b[64..68].copy_from_slice(&self.durability.code().to_le_bytes());
        let crc = crc32c(&b[..SUPER_CRC_AT]);
        b[SUPER_CRC_AT..SUPER_CRC_AT + 4].copy_from_slice(&crc.to_le_bytes());
        if self.version != FORMAT_VERSION_V1 {
            b[SUPER_SEGMENT_AT..SUPER_SEGMENT_AT + 8].copy_from_slice(&self.segment.to_le_bytes());
            b[SUPER_PREV_HEAD_AT..SUPER_PREV_HEAD_AT + CHAIN_LEN].copy_from_slice(&self.prev_head);
            let crc = crc32c(&b[..SUPER_CRC_V2_AT]);
            b[SUPER_CRC_V2_AT..SUPER_CRC_V2_AT + 4].copy_from_slice(&crc.to_le_bytes());
        }
    }

    /// Decodes and validates a superblock from the start of `b`: at least [`SUPER_LEN`]
    /// bytes, and [`SUPER_LEN_V2`] for version 2.
    ///
    /// The CRC32C of bytes `0..68` is checked before the version in both versions, so that
    /// code that reads only version 1 says "unsupported journal version 2" of a version-2
    /// superblock rather than "checksum mismatch".
    pub fn decode(b: &[u8]) -> Result<Superblock, SuperError> {
        if b.len() < SUPER_LEN || b[0..8] != SUPER_MAGIC {
            return Err(SuperError::Magic);
        }
        let stored = u32_at(b, SUPER_CRC_AT);
        let computed = crc32c(&b[..SUPER_CRC_AT]);
        if stored != computed {
            return Err(SuperError::Crc { stored, computed });
        }
        let field = |field, value: u64| SuperError::Field { field, value };
        let version = u32_at(b, 8);
        let (segment, prev_head) = match version {
            FORMAT_VERSION_V1 => (0, [0u8; CHAIN_LEN]),
            FORMAT_VERSION => {
                if b.len() < SUPER_LEN_V2 {
                    return Err(field("superblock length", b.len() as u64));
                }
                let stored = u32_at(b, SUPER_CRC_V2_AT);
                let computed = crc32c(&b[..SUPER_CRC_V2_AT]);
                if stored != computed {
                    return Err(SuperError::Crc { stored, computed });
                }
                let segment = u64_at(b, SUPER_SEGMENT_AT);
                if segment > u64::MAX / 2 {
                    return Err(field("segment", segment));
                }
                let mut prev_head = [0u8; CHAIN_LEN];
                prev_head.copy_from_slice(&b[SUPER_PREV_HEAD_AT..SUPER_PREV_HEAD_AT + CHAIN_LEN]);
                // Nothing comes before the first segment.
                if segment == 0 && prev_head != [0u8; CHAIN_LEN] {
                    return Err(field("prev_head of segment 0", 1));
                }
                (segment, prev_head)
            }
            v => return Err(SuperError::Version(v)),
        };
        let write_align = u32_at(b, 12);
        if !write_align.is_power_of_two() || !(512..=65536).contains(&write_align) {
            return Err(field("write_align", write_align.into()));
        }
        let mut journal_id = [0u8; 16];
        journal_id.copy_from_slice(&b[16..32]);
        let first_seq = u64_at(b, 40);
        if first_seq == 0 || first_seq > u64::MAX / 2 {
            return Err(field("first_seq", first_seq));
        }
        let max_batch_bytes = u32_at(b, 48);
        let max_record_bytes = u32_at(b, 52);
        if max_record_bytes == 0 || max_record_bytes > MAX_RECORD_BYTES_LIMIT {
            return Err(field("max_record_bytes", max_record_bytes.into()));
        }
        let min_batch = frame_len(max_record_bytes as usize) as u64 + u64::from(write_align);
        if u64::from(max_batch_bytes) < min_batch || max_batch_bytes > MAX_BATCH_BYTES_LIMIT {
            return Err(field("max_batch_bytes", max_batch_bytes.into()));
        }
        let data_offset = u64_at(b, 56);
        if data_offset != DATA_OFFSET {
            return Err(field("data_offset", data_offset));
        }
        let code = u32_at(b, 64);
        let durability = Durability::from_code(code).ok_or(field("durability", code.into()))?;
        Ok(Superblock {
            version,
            write_align,
            journal_id,
            created_unix_ns: u64_at(b, 32),
            first_seq,
            max_batch_bytes,
            max_record_bytes,
            durability,
            segment,
            prev_head,
        })
    }

    /// The key of the hash chain, derived from the journal id.
    pub fn chain_key(&self) -> [u8; 32] {
        blake3::derive_key("FastLane journal v1 hash chain", &self.journal_id)
    }

    /// The chain value "before" the first record: binds the chain to this superblock. The
    /// keyed hash of the encoded field bytes (`0..72` in version 1, unchanged; `0..100` in
    /// version 2, which include `segment` and `prev_head`, so a segment's chain continues
    /// from the record before it).
    pub fn genesis(&self) -> Chain {
        let mut raw = [0u8; SUPER_LEN_V2];
        self.encode(&mut raw);
        let h = blake3::keyed_hash(&self.chain_key(), &raw[..self.encoded_len()]);
        truncate(h.as_bytes())
    }

    /// Bytes after the last valid frame in which a torn batch may have left garbage.
    pub fn torn_window(&self) -> u64 {
        u64::from(self.max_batch_bytes) + 2 * u64::from(self.write_align)
    }
}

fn truncate(h: &[u8; 32]) -> Chain {
    let mut c = [0u8; CHAIN_LEN];
    c.copy_from_slice(&h[..CHAIN_LEN]);
    c
}

/// Bytes a frame with a `payload_len`-byte payload occupies on disk.
#[inline]
pub fn frame_len(payload_len: usize) -> usize {
    FRAME_HEADER_LEN + payload_len.div_ceil(8) * 8
}

/// The fields of a frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// Payload length.
    pub len: u32,
    /// Sequence number.
    pub seq: u64,
    /// Timestamp, ns (CLOCK_REALTIME, or the card clock).
    pub timestamp_ns: u64,
    /// Chain value of this frame.
    pub chain: Chain,
    /// Flags: 0 in version 1; the producer id of the record in version 2 (0: the
    /// journal's own, in-process producer).
    pub flags: u32,
    /// Stored CRC32C.
    pub crc: u32,
}

/// Computes a frame's chain value from the previous one.
#[inline]
pub fn chain_next(
    hasher_key: &[u8; 32],
    prev: &Chain,
    seq: u64,
    len: u32,
    timestamp_ns: u64,
    flags: u32,
    payload: &[u8],
) -> Chain {
    let mut h = blake3::Hasher::new_keyed(hasher_key);
    let mut head = [0u8; CHAIN_LEN + 24];
    head[..CHAIN_LEN].copy_from_slice(prev);
    head[CHAIN_LEN..CHAIN_LEN + 8].copy_from_slice(&seq.to_le_bytes());
    head[CHAIN_LEN + 8..CHAIN_LEN + 12].copy_from_slice(&len.to_le_bytes());
    head[CHAIN_LEN + 12..CHAIN_LEN + 16].copy_from_slice(&flags.to_le_bytes());
    head[CHAIN_LEN + 16..CHAIN_LEN + 24].copy_from_slice(&timestamp_ns.to_le_bytes());
    h.update(&head);
    h.update(payload);
    truncate(h.finalize().as_bytes())
}

/// Writes a complete frame (header, payload, zero padding) into `out[..frame_len(len)]` and
/// returns its chain value. The payload is already in place at `out[FRAME_HEADER_LEN..]`
/// (the writer copies it straight from the ring). `flags` is the producer id in version 2
/// (0 in version 1).
#[allow(clippy::too_many_arguments)]
pub fn encode_frame(
    out: &mut [u8],
    key: &[u8; 32],
    prev: &Chain,
    seq: u64,
    timestamp_ns: u64,
    flags: u32,
    payload_len: usize,
    crc_fn: &mut dyn FnMut(u32, &[u8]) -> u32,
) -> Chain {
    let total = frame_len(payload_len);
    let out = &mut out[..total];
    out[FRAME_HEADER_LEN + payload_len..].fill(0);
    let len = payload_len as u32;
    let payload = &out[FRAME_HEADER_LEN..][..payload_len];
    let chain = chain_next(key, prev, seq, len, timestamp_ns, flags, payload);
    out[0..4].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
    out[4..8].copy_from_slice(&len.to_le_bytes());
    out[8..16].copy_from_slice(&seq.to_le_bytes());
    out[16..24].copy_from_slice(&timestamp_ns.to_le_bytes());
    out[24..40].copy_from_slice(&chain);
    out[40..44].copy_from_slice(&flags.to_le_bytes());
    let head_crc = crc_fn(0, &out[..44]);
    let crc = crc_fn(head_crc, &out[FRAME_HEADER_LEN..]);
    out[44..48].copy_from_slice(&crc.to_le_bytes());
    chain
}

/// What is wrong with the bytes where a frame was expected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Defect {
    /// All-zero header: the clean end of the journal.
    Zero,
    /// The header does not start with the frame magic.
    Magic,
    /// The length is over the superblock's `max_record_bytes`.
    Length(u32),
    /// The frame runs past the end of the device.
    PastEnd,
    /// The CRC does not match the bytes.
    Crc,
    /// Flags (version 1) or padding not zero (with a matching CRC: not written by this code).
    Reserved,
}

impl Defect {
    /// Short description.
    pub fn what(self) -> &'static str {
        match self {
            Defect::Zero => "end of journal",
            Defect::Magic => "bad frame magic",
            Defect::Length(_) => "length out of range",
            Defect::PastEnd => "frame runs past the end of the device",
            Defect::Crc => "CRC32C mismatch",
            Defect::Reserved => "reserved bits set",
        }
    }
}

/// Decodes the header in `hdr` (exactly [`FRAME_HEADER_LEN`] bytes) without looking at the
/// payload: magic and length only.
pub fn decode_header(hdr: &[u8], max_record_bytes: u32) -> Result<FrameHeader, Defect> {
    if hdr.len() < FRAME_HEADER_LEN {
        return Err(Defect::PastEnd);
    }
    let hdr = &hdr[..FRAME_HEADER_LEN];
    if hdr.iter().all(|&b| b == 0) {
        return Err(Defect::Zero);
    }
    if u32_at(hdr, 0) != FRAME_MAGIC {
        return Err(Defect::Magic);
    }
    let len = u32_at(hdr, 4);
    if len > max_record_bytes {
        return Err(Defect::Length(len));
    }
    let mut chain = [0u8; CHAIN_LEN];
    chain.copy_from_slice(&hdr[24..40]);
    Ok(FrameHeader {
        len,
        seq: u64_at(hdr, 8),
        timestamp_ns: u64_at(hdr, 16),
        chain,
        flags: u32_at(hdr, 40),
        crc: u32_at(hdr, 44),
    })
}

/// `flags` of a padding frame (format 2): not a record (no seq, not in the hash chain), only a
/// marker that the frames go on at the next `write_align` boundary after its header. The
/// writer ends a batch with one when it writes with [`WriterIo::Dsync`], so that the next
/// batch can start in a block of its own while this one is still in flight. Producer ids stay
/// below it.
///
/// [`WriterIo::Dsync`]: crate::WriterIo::Dsync
pub const PAD_FLAG: u32 = 0x8000_0000;

impl FrameHeader {
    /// Whether this is a padding frame ([`PAD_FLAG`], no payload, seq 0).
    pub fn is_pad(&self) -> bool {
        self.flags == PAD_FLAG && self.len == 0 && self.seq == 0
    }
}

/// Where the frames go on after a padding frame at `offset`: the first `align` boundary at or
/// after the end of its header.
pub fn pad_next(offset: u64, align: u64) -> u64 {
    (offset + FRAME_HEADER_LEN as u64).div_ceil(align) * align
}

/// Writes a padding frame's header into `out[..FRAME_HEADER_LEN]` (magic, zero length, seq,
/// timestamp and chain, [`PAD_FLAG`], CRC32C of bytes 0..44).
pub fn encode_pad(out: &mut [u8]) {
    let h = &mut out[..FRAME_HEADER_LEN];
    h.fill(0);
    h[0..4].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
    h[40..44].copy_from_slice(&PAD_FLAG.to_le_bytes());
    let crc = crc32c(&h[..44]);
    h[44..48].copy_from_slice(&crc.to_le_bytes());
}

/// Checks a whole frame's CRC and reserved bits; `frame` is exactly `frame_len(h.len)` bytes.
/// `flags_allowed`: the superblock's [`Superblock::frames_have_flags`] (version 1 requires
/// the flags to be 0, version 2 stores the producer id there).
pub fn check_frame(frame: &[u8], h: &FrameHeader, flags_allowed: bool) -> Result<(), Defect> {
    if frame.len() != frame_len(h.len as usize) {
        return Err(Defect::PastEnd);
    }
    let crc = crc32c_append(crc32c(&frame[..44]), &frame[FRAME_HEADER_LEN..]);
    if crc != h.crc {
        return Err(Defect::Crc);
    }
    let pad = &frame[FRAME_HEADER_LEN + h.len as usize..];
    if (h.flags != 0 && !flags_allowed) || pad.iter().any(|&b| b != 0) {
        return Err(Defect::Reserved);
    }
    Ok(())
}

/// The payload of a checked frame.
pub fn payload<'a>(frame: &'a [u8], h: &FrameHeader) -> &'a [u8] {
    &frame[FRAME_HEADER_LEN..FRAME_HEADER_LEN + h.len as usize]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A version-1 superblock (what every journal before format 2 holds).
    fn sb() -> Superblock {
        Superblock {
            version: FORMAT_VERSION_V1,
            ..Superblock::new([7; 16], 42, 1, 1 << 20, 4096, Durability::Local)
        }
    }

    /// A version-2 superblock of segment 3.
    fn sb_v2() -> Superblock {
        Superblock {
            segment: 3,
            prev_head: *b"0123456789abcdef",
            ..Superblock::new([7; 16], 42, 1001, 1 << 20, 4096, Durability::Local)
        }
    }

    /// The version-1 superblock bytes written from the table in `docs/journal.md`, not by
    /// `encode`.
    fn v1_bytes_by_hand() -> [u8; SUPER_LEN] {
        let mut b = [0u8; SUPER_LEN];
        b[0..8].copy_from_slice(b"FLJOURN1");
        b[8] = 1;
        b[12..16].copy_from_slice(&4096u32.to_le_bytes());
        b[16..32].fill(7);
        b[32] = 42;
        b[40] = 1;
        b[48..52].copy_from_slice(&(1u32 << 20).to_le_bytes());
        b[52..56].copy_from_slice(&4096u32.to_le_bytes());
        b[56..64].copy_from_slice(&4096u64.to_le_bytes());
        b[64] = 1;
        let crc = crc32c(&b[..68]);
        b[68..72].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Version 1 is kept byte for byte: the encoding matches the table, and its genesis is
    /// the keyed hash of those 72 bytes, equal to the value the version-1 code computed.
    #[test]
    fn v1_superblock_and_genesis_are_unchanged() {
        let mut raw = [0u8; DATA_OFFSET as usize];
        sb().encode(&mut raw);
        assert_eq!(raw[..SUPER_LEN], v1_bytes_by_hand());
        assert!(raw[SUPER_LEN..].iter().all(|&b| b == 0), "nothing past the v1 fields");
        assert_eq!(sb().encoded_len(), SUPER_LEN);
        let key = blake3::derive_key("FastLane journal v1 hash chain", &[7; 16]);
        let want = blake3::keyed_hash(&key, &v1_bytes_by_hand());
        assert_eq!(sb().genesis()[..], want.as_bytes()[..CHAIN_LEN]);
        // Computed by the version-1 code (commit 2073877), for this superblock.
        assert_eq!(crate::verify::hex(&sb().genesis()), V1_GENESIS);
        let d = Superblock::decode(&v1_bytes_by_hand()).unwrap();
        assert_eq!((d.version, d.segment, d.prev_head), (1, 0, [0; 16]));
        assert!(!d.frames_have_flags());
    }

    const V1_GENESIS: &str = "af5e5fb0c56b731ff06429ccc6603f3b";

    #[test]
    fn v2_superblock_round_trip_and_every_flip_is_refused() {
        let s = sb_v2();
        let mut raw = [0u8; SUPER_LEN_V2];
        s.encode(&mut raw);
        assert_eq!(Superblock::decode(&raw), Ok(s));
        assert_eq!(u32_at(&raw, 8), 2);
        // The version-1 CRC slot still checks bytes 0..68: version-1 code reads "version 2".
        assert_eq!(u32_at(&raw, 68), crc32c(&raw[..68]));
        assert!(s.frames_have_flags());
        for i in 0..SUPER_LEN_V2 {
            for bit in 0..8 {
                let mut bad = raw;
                bad[i] ^= 1 << bit;
                assert!(Superblock::decode(&bad).is_err(), "byte {i} bit {bit}");
            }
        }
        // Too short for its version.
        assert!(Superblock::decode(&raw[..SUPER_LEN]).is_err());
        // The genesis binds the segment index and the previous head.
        let g = s.genesis();
        assert_ne!(g, Superblock { prev_head: [1; 16], ..s }.genesis());
        assert_ne!(g, Superblock { segment: 4, ..s }.genesis());
        assert_ne!(g, Superblock { version: 1, segment: 0, prev_head: [0; 16], ..s }.genesis());
        // Segment 0 with a previous head is refused.
        let mut zero = [0u8; SUPER_LEN_V2];
        Superblock { segment: 0, ..s }.encode(&mut zero);
        assert!(Superblock::decode(&zero).is_err());
        let next = s.next_segment(77, 2001, [9; 16]);
        assert_eq!((next.segment, next.first_seq, next.prev_head), (4, 2001, [9; 16]));
        assert_eq!((next.journal_id, next.created_unix_ns), (s.journal_id, 77));
    }

    /// Hostile bytes never panic the decoders: random buffers, random lengths, and valid
    /// superblocks and headers with random bytes overwritten.
    #[test]
    fn decoding_garbage_never_panics() {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut valid = [0u8; SUPER_LEN_V2];
        sb_v2().encode(&mut valid);
        for round in 0..20_000 {
            let len = (next() % 160) as usize;
            let mut b: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            if round % 2 == 0 {
                // Mostly valid: a few bytes changed, CRCs recomputed half the time.
                b = valid.to_vec();
                b.truncate(len.max(SUPER_LEN));
                for _ in 0..(next() % 4) {
                    let i = (next() as usize) % b.len();
                    b[i] = next() as u8;
                }
                if round % 4 == 0 && b.len() >= SUPER_LEN_V2 {
                    let c = crc32c(&b[..68]);
                    b[68..72].copy_from_slice(&c.to_le_bytes());
                    let c = crc32c(&b[..96]);
                    b[96..100].copy_from_slice(&c.to_le_bytes());
                }
            }
            if let Ok(s) = Superblock::decode(&b) {
                let _ = s.genesis();
                let mut again = [0u8; SUPER_LEN_V2];
                s.encode(&mut again);
                assert_eq!(Superblock::decode(&again[..s.encoded_len()]), Ok(s));
            }
            let mut hdr = b.clone();
            hdr.resize(FRAME_HEADER_LEN, 0);
            if round % 3 == 0 {
                hdr[0..4].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
            }
            if let Ok(h) = decode_header(&hdr, 64) {
                let mut frame = hdr.clone();
                frame.resize(frame_len(h.len as usize), 0);
                let _ = check_frame(&frame, &h, round % 2 == 0);
                let _ = check_frame(&frame[..frame.len() - 1], &h, true);
            }
        }
    }

    /// The frames' checksum is CRC32C (Castagnoli) as RFC 3720 defines it: the appendix B.4
    /// vectors, the "123456789" check value, and appending equals checksumming the whole.
    #[test]
    fn crc_is_castagnoli() {
        let vectors: [(Vec<u8>, u32); 7] = [
            (b"123456789".to_vec(), 0xE306_9283),
            (vec![0u8; 32], 0x8A91_36AA),
            (vec![0xFFu8; 32], 0x62A8_AB43),
            ((0u8..32).collect(), 0x46DD_794E),
            ((0u8..32).rev().collect(), 0x113F_DB5C),
            (Vec::new(), 0),
            (b"a".to_vec(), 0xC1D0_4330),
        ];
        for (data, want) in vectors {
            assert_eq!(crc32c(&data), want, "{data:?}");
        }
        let data: Vec<u8> =
            (0..1024u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        for split in [0, 1, 7, 8, 9, 63, 500, 1024] {
            let (a, b) = data.split_at(split);
            assert_eq!(crc32c_append(crc32c(a), b), crc32c(&data), "split {split}");
        }
    }

    #[test]
    fn superblock_round_trip_and_every_flip_is_refused() {
        let mut raw = [0u8; SUPER_LEN];
        sb().encode(&mut raw);
        assert_eq!(Superblock::decode(&raw), Ok(sb()));
        for i in 0..SUPER_LEN {
            for bit in 0..8 {
                let mut bad = raw;
                bad[i] ^= 1 << bit;
                assert!(Superblock::decode(&bad).is_err(), "byte {i} bit {bit}");
            }
        }
        assert!(Superblock::decode(&raw[..10]).is_err());
    }

    #[test]
    fn frame_round_trip_and_flips() {
        let s = sb();
        let key = s.chain_key();
        let g = s.genesis();
        let mut buf = vec![0u8; 256];
        buf[FRAME_HEADER_LEN..FRAME_HEADER_LEN + 13].copy_from_slice(b"hello, world!");
        let chain = encode_frame(&mut buf, &key, &g, 1, 99, 0, 13, &mut crc32c_append);
        let n = frame_len(13);
        assert_eq!(n, 64);
        let h = decode_header(&buf[..FRAME_HEADER_LEN], 4096).unwrap();
        assert_eq!((h.len, h.seq, h.timestamp_ns, h.chain), (13, 1, 99, chain));
        check_frame(&buf[..n], &h, false).unwrap();
        assert_eq!(payload(&buf[..n], &h), b"hello, world!");
        assert_eq!(chain_next(&key, &g, 1, 13, 99, 0, b"hello, world!"), chain);
        for i in 0..n {
            let mut bad = buf.clone();
            bad[i] ^= 0x20;
            let ok = decode_header(&bad[..FRAME_HEADER_LEN], 4096)
                .and_then(|h| check_frame(&bad[..frame_len(h.len as usize).min(256)], &h, true));
            assert!(ok.is_err(), "flip at {i} not caught");
        }
    }

    /// A producer id rides in the flags, is chained, and is refused only by version 1.
    #[test]
    fn producer_id_in_the_flags() {
        let s = sb_v2();
        let key = s.chain_key();
        let g = s.genesis();
        let mut buf = vec![0u8; 64];
        buf[FRAME_HEADER_LEN..FRAME_HEADER_LEN + 5].copy_from_slice(b"hello");
        let chain = encode_frame(&mut buf, &key, &g, 1001, 5, 0xBEEF, 5, &mut crc32c_append);
        let h = decode_header(&buf[..FRAME_HEADER_LEN], 4096).unwrap();
        assert_eq!(h.flags, 0xBEEF);
        assert_eq!(chain_next(&key, &g, 1001, 5, 5, 0xBEEF, b"hello"), chain);
        assert_ne!(chain_next(&key, &g, 1001, 5, 5, 0, b"hello"), chain);
        let frame = &buf[..frame_len(5)];
        assert_eq!(check_frame(frame, &h, s.frames_have_flags()), Ok(()));
        assert_eq!(check_frame(frame, &h, sb().frames_have_flags()), Err(Defect::Reserved));
    }
}
