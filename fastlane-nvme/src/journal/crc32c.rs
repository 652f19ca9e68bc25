//! CRC32C (Castagnoli, reflected polynomial `0x82F63B78`), the checksum of every frame.
//!
//! A stopgap until `fastlane-fpga`'s CRC32C entry point lands: the SSE4.2 `crc32` instruction
//! when the CPU has it (checked once), a slicing-by-8 table otherwise. Both give identical
//! results (a unit test compares them on random inputs and on the RFC 3720 check values).

use std::sync::OnceLock;

const POLY: u32 = 0x82F6_3B78;

/// Eight 256-entry tables for slicing-by-8, built once.
fn tables() -> &'static [[u32; 256]; 8] {
    static TABLES: OnceLock<Box<[[u32; 256]; 8]>> = OnceLock::new();
    TABLES.get_or_init(|| {
        let mut t = Box::new([[0u32; 256]; 8]);
        for i in 0..256u32 {
            let mut c = i;
            for _ in 0..8 {
                c = if c & 1 != 0 { (c >> 1) ^ POLY } else { c >> 1 };
            }
            t[0][i as usize] = c;
        }
        for i in 0..256 {
            for k in 1..8 {
                let prev = t[k - 1][i];
                t[k][i] = (prev >> 8) ^ t[0][(prev & 0xFF) as usize];
            }
        }
        t
    })
}

/// CRC32C of `data`.
#[inline]
pub fn crc32c(data: &[u8]) -> u32 {
    crc32c_append(0, data)
}

/// Continues a CRC32C: `crc32c_append(crc32c(a), b) == crc32c(a ++ b)`.
#[inline]
pub fn crc32c_append(crc: u32, data: &[u8]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    {
        if hardware() {
            // SAFETY: `hardware()` checked that the CPU has SSE4.2.
            return unsafe { crc32c_sse42(crc, data) };
        }
    }
    crc32c_append_software(crc, data)
}

#[cfg(target_arch = "x86_64")]
fn hardware() -> bool {
    static HW: OnceLock<bool> = OnceLock::new();
    *HW.get_or_init(|| std::is_x86_feature_detected!("sse4.2"))
}

/// The table implementation (also the reference the hardware path is tested against).
pub fn crc32c_append_software(crc: u32, data: &[u8]) -> u32 {
    let t = tables();
    let mut c = !crc;
    let mut chunks = data.chunks_exact(8);
    for ch in &mut chunks {
        let lo = u32::from_le_bytes([ch[0], ch[1], ch[2], ch[3]]) ^ c;
        let hi = u32::from_le_bytes([ch[4], ch[5], ch[6], ch[7]]);
        c = t[7][(lo & 0xFF) as usize]
            ^ t[6][((lo >> 8) & 0xFF) as usize]
            ^ t[5][((lo >> 16) & 0xFF) as usize]
            ^ t[4][(lo >> 24) as usize]
            ^ t[3][(hi & 0xFF) as usize]
            ^ t[2][((hi >> 8) & 0xFF) as usize]
            ^ t[1][((hi >> 16) & 0xFF) as usize]
            ^ t[0][(hi >> 24) as usize];
    }
    for &b in chunks.remainder() {
        c = (c >> 8) ^ t[0][((c ^ u32::from(b)) & 0xFF) as usize];
    }
    !c
}

/// # Safety
///
/// The CPU must support SSE4.2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2")]
unsafe fn crc32c_sse42(crc: u32, data: &[u8]) -> u32 {
    use std::arch::x86_64::{_mm_crc32_u64, _mm_crc32_u8};
    let mut c = u64::from(!crc);
    let mut chunks = data.chunks_exact(8);
    for ch in &mut chunks {
        let mut w = [0u8; 8];
        w.copy_from_slice(ch);
        c = _mm_crc32_u64(c, u64::from_le_bytes(w));
    }
    let mut c = c as u32;
    for &b in chunks.remainder() {
        c = _mm_crc32_u8(c, b);
    }
    !c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_values() {
        // RFC 3720 B.4 and the common "123456789" check value.
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(&[0xFFu8; 32]), 0x62A8_AB43);
        let inc: Vec<u8> = (0u8..32).collect();
        assert_eq!(crc32c(&inc), 0x46DD_794E);
        assert_eq!(crc32c(b""), 0);
    }

    #[test]
    fn hardware_matches_software_and_appends() {
        let mut x = 0x1234_5678_9ABC_DEF0u64;
        for len in 0..300usize {
            let data: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            let want = crc32c_append_software(0, &data);
            assert_eq!(crc32c(&data), want, "len {len}");
            let split = len / 3;
            assert_eq!(crc32c_append(crc32c(&data[..split]), &data[split..]), want);
        }
    }
}
