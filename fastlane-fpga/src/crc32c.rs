//! CRC32C (Castagnoli, the iSCSI/ext4/NVMe checksum), for the journal's records.
//!
//! Two implementations behind one entry point: the SSE4.2 `crc32` instruction, chosen at run
//! time when the CPU has it, and a portable slicing-by-8 table walk. Both compute the same
//! function (tested against each other and against the RFC 3720 vectors), so a record
//! checksummed on one machine verifies on any other.
//!
//! The journal calls [`crc32c`] / [`crc32c_append`] directly; the card's `OP_CRC32C` runs the
//! same code on the software model.

/// The reflected Castagnoli polynomial (0x1EDC6F41 bit-reversed).
pub const POLY_REFLECTED: u32 = 0x82F6_3B78;

/// `TABLES[k][b]`: the CRC contribution of byte `b` followed by `k` zero bytes.
static TABLES: [[u32; 256]; 8] = make_tables();

const fn make_tables() -> [[u32; 256]; 8] {
    let mut t = [[0u32; 256]; 8];
    let mut i = 0;
    while i < 256 {
        let mut crc = i as u32;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ POLY_REFLECTED } else { crc >> 1 };
            bit += 1;
        }
        t[0][i] = crc;
        i += 1;
    }
    let mut k = 1;
    while k < 8 {
        let mut i = 0;
        while i < 256 {
            let prev = t[k - 1][i];
            t[k][i] = (prev >> 8) ^ t[0][(prev & 0xff) as usize];
            i += 1;
        }
        k += 1;
    }
    t
}

/// CRC32C of `data` (initial value and final XOR as in RFC 3720).
#[inline]
pub fn crc32c(data: &[u8]) -> u32 {
    crc32c_append(0, data)
}

/// Continue a CRC32C: `crc32c_append(crc32c(a), b) == crc32c(a ++ b)`.
#[inline]
pub fn crc32c_append(crc: u32, data: &[u8]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("sse4.2") {
            // SAFETY: the CPU supports SSE4.2 (checked just above), which is the only
            // requirement of the target-feature function.
            return unsafe { crc32c_append_sse42(crc, data) };
        }
    }
    crc32c_append_software(crc, data)
}

/// Whether [`crc32c`] uses the CPU's `crc32` instruction on this machine.
pub fn hardware_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("sse4.2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The portable slicing-by-8 implementation (same results as [`crc32c_append`]).
pub fn crc32c_append_software(crc: u32, data: &[u8]) -> u32 {
    let mut c = !crc;
    let mut chunks = data.chunks_exact(8);
    for chunk in &mut chunks {
        let lo = u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]) ^ c;
        let hi = u32::from_le_bytes([chunk[4], chunk[5], chunk[6], chunk[7]]);
        c = TABLES[7][(lo & 0xff) as usize]
            ^ TABLES[6][((lo >> 8) & 0xff) as usize]
            ^ TABLES[5][((lo >> 16) & 0xff) as usize]
            ^ TABLES[4][(lo >> 24) as usize]
            ^ TABLES[3][(hi & 0xff) as usize]
            ^ TABLES[2][((hi >> 8) & 0xff) as usize]
            ^ TABLES[1][((hi >> 16) & 0xff) as usize]
            ^ TABLES[0][(hi >> 24) as usize];
    }
    for &b in chunks.remainder() {
        c = (c >> 8) ^ TABLES[0][((c ^ u32::from(b)) & 0xff) as usize];
    }
    !c
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2")]
fn crc32c_append_sse42(crc: u32, data: &[u8]) -> u32 {
    use std::arch::x86_64::{_mm_crc32_u64, _mm_crc32_u8};
    let mut c = u64::from(!crc);
    let mut chunks = data.chunks_exact(8);
    for chunk in &mut chunks {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        c = _mm_crc32_u64(c, u64::from_le_bytes(word));
    }
    // The 64-bit form keeps the CRC in the low 32 bits.
    let mut c32 = c as u32;
    for &b in chunks.remainder() {
        c32 = _mm_crc32_u8(c32, b);
    }
    !c32
}

/// An incremental CRC32C over several pieces of one record.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Crc32c {
    value: u32,
}

impl Crc32c {
    /// A checksum of nothing yet.
    pub const fn new() -> Self {
        Self { value: 0 }
    }

    /// Add `data`.
    #[inline]
    pub fn update(&mut self, data: &[u8]) {
        self.value = crc32c_append(self.value, data);
    }

    /// The CRC32C of everything added so far.
    pub fn value(&self) -> u32 {
        self.value
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 3720 appendix B.4 and the "123456789" check value.
    fn vectors() -> Vec<(Vec<u8>, u32)> {
        vec![
            (b"123456789".to_vec(), 0xE306_9283),
            (vec![0u8; 32], 0x8A91_36AA),
            (vec![0xFFu8; 32], 0x62A8_AB43),
            ((0u8..32).collect(), 0x46DD_794E),
            ((0u8..32).rev().collect(), 0x113F_DB5C),
            (Vec::new(), 0),
            (b"a".to_vec(), 0xC1D0_4330),
        ]
    }

    #[test]
    fn known_vectors_software_and_dispatch() {
        for (data, want) in vectors() {
            assert_eq!(crc32c_append_software(0, &data), want, "software {data:?}");
            assert_eq!(crc32c(&data), want, "dispatch {data:?}");
        }
    }

    #[test]
    fn iscsi_read_command_pdu() {
        // RFC 3720 B.4: the 48-byte iSCSI read command PDU.
        let pdu: [u8; 48] = [
            0x01, 0xc0, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
            0x00, 0x00, 0x14, 0x00, 0x00, 0x00, 0x00, 0x00, 0x04, 0x00, 0x00, 0x00, 0x00, 0x14,
            0x00, 0x00, 0x00, 0x18, 0x28, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x02, 0x00,
            0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        ];
        assert_eq!(crc32c(&pdu), 0xD996_3A56);
        assert_eq!(crc32c_append_software(0, &pdu), 0xD996_3A56);
    }

    #[test]
    fn hardware_matches_software_at_every_length_and_split() {
        let data: Vec<u8> =
            (0..1024u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        for len in 0..data.len() {
            let s = crc32c_append_software(0, &data[..len]);
            assert_eq!(crc32c(&data[..len]), s, "len {len}");
        }
        let whole = crc32c(&data);
        for split in [0, 1, 7, 8, 9, 63, 500, 1024] {
            let (a, b) = data.split_at(split);
            assert_eq!(crc32c_append(crc32c(a), b), whole, "split {split}");
            assert_eq!(crc32c_append_software(crc32c_append_software(0, a), b), whole);
            let mut inc = Crc32c::new();
            inc.update(a);
            inc.update(b);
            assert_eq!(inc.value(), whole);
        }
    }
}
