//! Per-block checksums: taken on swap-out, verified on swap-in.
//!
//! [`ChecksumMode::Fast`] is a 64-bit multiply-rotate hash over eight independent lanes (the
//! xxHash64 round, not its exact output), fused with the copy so the bytes are read once;
//! [`ChecksumMode::Crc32c`] is [`crc32c::crc32c`] (SSE4.2 where present) run over the
//! destination after the copy; [`ChecksumMode::Off`] copies with `memcpy` and records nothing.

use std::ptr;

/// Which checksum the engine takes per block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ChecksumMode {
    /// No checksum (plain `memcpy`).
    Off,
    /// The fused copy + 64-bit lane hash (default).
    #[default]
    Fast,
    /// CRC32C over the copied bytes.
    Crc32c,
}

impl ChecksumMode {
    /// Parses `off`, `fast` or `crc32c`.
    pub fn parse(text: &str) -> Option<ChecksumMode> {
        match text {
            "off" | "none" => Some(ChecksumMode::Off),
            "fast" => Some(ChecksumMode::Fast),
            "crc32c" => Some(ChecksumMode::Crc32c),
            _ => None,
        }
    }
}

const P1: u64 = 0x9E37_79B1_85EB_CA87;
const P2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const P3: u64 = 0x1656_67B1_9E37_79F9;
const LANES: usize = 8;
const STRIPE: usize = LANES * 8;

#[inline(always)]
fn round(acc: u64, v: u64) -> u64 {
    acc.wrapping_add(v.wrapping_mul(P2)).rotate_left(31).wrapping_mul(P1)
}

fn finish(acc: &[u64; LANES], tail: &[u8], len: usize) -> u64 {
    let mut h = (len as u64).wrapping_mul(P3);
    for (i, a) in acc.iter().enumerate() {
        h = (h ^ round(0, *a)).rotate_left(27 + i as u32).wrapping_mul(P1).wrapping_add(P3);
    }
    for b in tail {
        h = (h ^ u64::from(*b).wrapping_mul(P3)).rotate_left(11).wrapping_mul(P1);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(P2);
    h ^ (h >> 29)
}

fn seed() -> [u64; LANES] {
    let mut acc = [0u64; LANES];
    for (i, a) in acc.iter_mut().enumerate() {
        *a = P1.wrapping_add((i as u64).wrapping_mul(P2));
    }
    acc
}

/// The fast hash of `data`.
pub fn fast_hash(data: &[u8]) -> u64 {
    let mut acc = seed();
    let stripes = data.len() / STRIPE;
    for s in 0..stripes {
        let base = s * STRIPE;
        for (i, a) in acc.iter_mut().enumerate() {
            let mut w = [0u8; 8];
            w.copy_from_slice(&data[base + i * 8..base + i * 8 + 8]);
            *a = round(*a, u64::from_le_bytes(w));
        }
    }
    finish(&acc, &data[stripes * STRIPE..], data.len())
}

/// Checksum of `data` in `mode` (0 for `Off`).
pub fn checksum(mode: ChecksumMode, data: &[u8]) -> u64 {
    match mode {
        ChecksumMode::Off => 0,
        ChecksumMode::Fast => fast_hash(data),
        ChecksumMode::Crc32c => u64::from(crc32c::crc32c(data)),
    }
}

/// Copies `len` bytes from `src` to `dst` and returns the checksum of those bytes.
///
/// # Safety
///
/// `src..src+len` is readable and `dst..dst+len` writable for the whole call, the two do not
/// overlap, and nobody writes either range meanwhile.
pub unsafe fn copy_checksum(mode: ChecksumMode, src: *const u8, dst: *mut u8, len: usize) -> u64 {
    match mode {
        ChecksumMode::Off => {
            // SAFETY: the caller guarantees both ranges are valid and disjoint.
            unsafe { ptr::copy_nonoverlapping(src, dst, len) };
            0
        }
        ChecksumMode::Crc32c => {
            // SAFETY: as above.
            unsafe { ptr::copy_nonoverlapping(src, dst, len) };
            // SAFETY: dst..dst+len was just written and nobody else writes it (caller).
            let out = unsafe { std::slice::from_raw_parts(dst, len) };
            u64::from(crc32c::crc32c(out))
        }
        ChecksumMode::Fast => {
            let mut acc = seed();
            let stripes = len / STRIPE;
            for s in 0..stripes {
                let base = s * STRIPE;
                for (i, a) in acc.iter_mut().enumerate() {
                    let off = base + i * 8;
                    // SAFETY: off + 8 <= len, inside the caller's source range.
                    let sp = unsafe { src.add(off) } as *const u64;
                    // SAFETY: off + 8 <= len, inside the caller's destination range.
                    let dp = unsafe { dst.add(off) } as *mut u64;
                    // SAFETY: sp names 8 readable bytes (caller's contract).
                    let v = unsafe { ptr::read_unaligned(sp) };
                    // SAFETY: dp names 8 writable bytes nobody else touches (caller's contract).
                    unsafe { ptr::write_unaligned(dp, v) };
                    *a = round(*a, u64::from_le(v));
                }
            }
            let done = stripes * STRIPE;
            // SAFETY: done <= len, inside the source range.
            let st = unsafe { src.add(done) };
            // SAFETY: done <= len, inside the destination range.
            let dt = unsafe { dst.add(done) };
            // SAFETY: the tails [done, len) of both ranges are valid and disjoint.
            unsafe { ptr::copy_nonoverlapping(st, dt, len - done) };
            // SAFETY: the tail was just written and nobody else writes it (caller).
            let tail = unsafe { std::slice::from_raw_parts(dt, len - done) };
            finish(&acc, tail, len)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_matches_hash_and_detects_flips() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 + i / 13) as u8).collect();
        for mode in [ChecksumMode::Fast, ChecksumMode::Crc32c] {
            let mut out = vec![0u8; data.len()];
            // SAFETY: two distinct live Vecs of the same length.
            let h = unsafe { copy_checksum(mode, data.as_ptr(), out.as_mut_ptr(), data.len()) };
            assert_eq!(out, data);
            assert_eq!(h, checksum(mode, &data));
            for pos in [0usize, 63, 64, 5000, 9999] {
                let mut flipped = data.clone();
                flipped[pos] ^= 1;
                assert_ne!(checksum(mode, &flipped), h, "{mode:?} missed a flip at {pos}");
            }
        }
        assert_eq!(checksum(ChecksumMode::Off, &data), 0);
    }
}
