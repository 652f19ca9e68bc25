//! The on-disk format: a superblock, then frames, each linked to the one before it by a hash
//! chain. Everything here is pure (bytes in, values out) so that recovery, `verify` and `dump`
//! share one decoder, and every input is treated as hostile: lengths are bounded before they
//! are used, arithmetic is checked, nothing panics on any byte pattern.
//!
//! All integers are little-endian. See `docs/journal.md` for the tables.

use crc32c::{crc32c, crc32c_append};

/// Superblock magic, at offset 0.
pub const SUPER_MAGIC: [u8; 8] = *b"FLJOURN1";
/// Format version.
pub const FORMAT_VERSION: u32 = 1;
/// Bytes of the superblock region (the first frame starts here).
pub const DATA_OFFSET: u64 = 4096;
/// Bytes of the superblock that carry fields (the rest of its 4 KiB is zero).
pub const SUPER_LEN: usize = 72;
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

fn u32_at(b: &[u8], off: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[off..off + 4]);
    u32::from_le_bytes(w)
}

fn u64_at(b: &[u8], off: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(w)
}

impl Superblock {
    /// Encodes into the first [`SUPER_LEN`] bytes of `out` (the caller zeroes the rest).
    pub fn encode(&self, out: &mut [u8]) {
        let b = &mut out[..SUPER_LEN];
        b.fill(0);
        b[0..8].copy_from_slice(&SUPER_MAGIC);
        b[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&self.write_align.to_le_bytes());
        b[16..32].copy_from_slice(&self.journal_id);
        b[32..40].copy_from_slice(&self.created_unix_ns.to_le_bytes());
        b[40..48].copy_from_slice(&self.first_seq.to_le_bytes());
        b[48..52].copy_from_slice(&self.max_batch_bytes.to_le_bytes());
        b[52..56].copy_from_slice(&self.max_record_bytes.to_le_bytes());
        b[56..64].copy_from_slice(&DATA_OFFSET.to_le_bytes());
        b[64..68].copy_from_slice(&self.durability.code().to_le_bytes());
        let crc = crc32c(&b[..68]);
        b[68..72].copy_from_slice(&crc.to_le_bytes());
    }

    /// Decodes and validates the first [`SUPER_LEN`] bytes of `b` (at least that long).
    pub fn decode(b: &[u8]) -> Result<Superblock, SuperError> {
        if b.len() < SUPER_LEN || b[0..8] != SUPER_MAGIC {
            return Err(SuperError::Magic);
        }
        let stored = u32_at(b, 68);
        let computed = crc32c(&b[..68]);
        if stored != computed {
            return Err(SuperError::Crc { stored, computed });
        }
        let version = u32_at(b, 8);
        if version != FORMAT_VERSION {
            return Err(SuperError::Version(version));
        }
        let field = |field, value: u64| SuperError::Field { field, value };
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
            write_align,
            journal_id,
            created_unix_ns: u64_at(b, 32),
            first_seq,
            max_batch_bytes,
            max_record_bytes,
            durability,
        })
    }

    /// The key of the hash chain, derived from the journal id.
    pub fn chain_key(&self) -> [u8; 32] {
        blake3::derive_key("FastLane journal v1 hash chain", &self.journal_id)
    }

    /// The chain value "before" the first record: binds the chain to this superblock.
    pub fn genesis(&self) -> Chain {
        let mut raw = [0u8; SUPER_LEN];
        self.encode(&mut raw);
        let h = blake3::keyed_hash(&self.chain_key(), &raw);
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
    /// Flags (0 in version 1).
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
/// returns its chain value. `payload` is already in place at `out[FRAME_HEADER_LEN..]` when
/// `payload_in_place` (the writer copies it straight from the ring), else it is copied.
#[allow(clippy::too_many_arguments)]
pub fn encode_frame(
    out: &mut [u8],
    key: &[u8; 32],
    prev: &Chain,
    seq: u64,
    timestamp_ns: u64,
    payload_len: usize,
    crc_fn: &mut dyn FnMut(u32, &[u8]) -> u32,
) -> Chain {
    let total = frame_len(payload_len);
    let out = &mut out[..total];
    out[FRAME_HEADER_LEN + payload_len..].fill(0);
    let len = payload_len as u32;
    let chain =
        chain_next(key, prev, seq, len, timestamp_ns, 0, &out[FRAME_HEADER_LEN..][..payload_len]);
    out[0..4].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
    out[4..8].copy_from_slice(&len.to_le_bytes());
    out[8..16].copy_from_slice(&seq.to_le_bytes());
    out[16..24].copy_from_slice(&timestamp_ns.to_le_bytes());
    out[24..40].copy_from_slice(&chain);
    out[40..44].copy_from_slice(&0u32.to_le_bytes());
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
    /// Flags or padding not zero (with a matching CRC: not written by this code).
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

/// Checks a whole frame's CRC and reserved bits; `frame` is exactly `frame_len(h.len)` bytes.
pub fn check_frame(frame: &[u8], h: &FrameHeader) -> Result<(), Defect> {
    if frame.len() != frame_len(h.len as usize) {
        return Err(Defect::PastEnd);
    }
    let crc = crc32c_append(crc32c(&frame[..44]), &frame[FRAME_HEADER_LEN..]);
    if crc != h.crc {
        return Err(Defect::Crc);
    }
    let pad = &frame[FRAME_HEADER_LEN + h.len as usize..];
    if h.flags != 0 || pad.iter().any(|&b| b != 0) {
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

    fn sb() -> Superblock {
        Superblock {
            write_align: 4096,
            journal_id: [7; 16],
            created_unix_ns: 42,
            first_seq: 1,
            max_batch_bytes: 1 << 20,
            max_record_bytes: 4096,
            durability: Durability::Local,
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
        let chain = encode_frame(&mut buf, &key, &g, 1, 99, 13, &mut crc32c_append);
        let n = frame_len(13);
        assert_eq!(n, 64);
        let h = decode_header(&buf[..FRAME_HEADER_LEN], 4096).unwrap();
        assert_eq!((h.len, h.seq, h.timestamp_ns, h.chain), (13, 1, 99, chain));
        check_frame(&buf[..n], &h).unwrap();
        assert_eq!(payload(&buf[..n], &h), b"hello, world!");
        assert_eq!(chain_next(&key, &g, 1, 13, 99, 0, b"hello, world!"), chain);
        for i in 0..n {
            let mut bad = buf.clone();
            bad[i] ^= 0x20;
            let ok = decode_header(&bad[..FRAME_HEADER_LEN], 4096)
                .and_then(|h| check_frame(&bad[..frame_len(h.len as usize).min(256)], &h));
            assert!(ok.is_err(), "flip at {i} not caught");
        }
    }
}
