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
/// Without a checksum the copy writes its destination with non-temporal stores on x86-64
/// (`movnti`, whole 64-byte lines, then an `sfence` so they are ordered before the completion
/// the caller publishes): a block (2 MiB for Llama-3.1-8B) is not read again soon, and plain
/// `memcpy` of one block does not stream (glibc streams only above about ¾ of the L3), so its
/// stores pay a read-for-ownership of every line. Measured on this VM (BENCHMARKS.md, kvswap):
/// 1.3× `memcpy` of the whole sequence, against 0.95× with `memcpy` per block. The fused hash
/// and CRC32C keep plain stores: streaming measured slower for both (0.73–0.87× against
/// 0.97–1.06× for the hash, 0.47–0.56× against 0.58–0.62× for CRC32C, same runs).
///
/// # Safety
///
/// `src..src+len` is readable and `dst..dst+len` writable for the whole call, the two do not
/// overlap, and nobody writes either range meanwhile.
pub unsafe fn copy_checksum(mode: ChecksumMode, src: *const u8, dst: *mut u8, len: usize) -> u64 {
    match mode {
        ChecksumMode::Off => {
            if cfg!(target_arch = "x86_64") && (dst as usize).is_multiple_of(8) {
                // SAFETY: the caller's contract; dst is 8-byte aligned.
                unsafe { stream_copy(src, dst, len) };
                store_fence();
            } else {
                // SAFETY: the caller guarantees both ranges are valid and disjoint.
                unsafe { ptr::copy_nonoverlapping(src, dst, len) };
            }
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

/// Copies `len` bytes with non-temporal stores for the whole 64-byte stripes, plain copies
/// for the rest.
///
/// # Safety
///
/// As [`copy_checksum`]; `dst` is 8-byte aligned.
unsafe fn stream_copy(src: *const u8, dst: *mut u8, len: usize) {
    let stripes = len / STRIPE;
    for s in 0..stripes {
        let base = s * STRIPE;
        let mut words = [0u64; LANES];
        for (i, w) in words.iter_mut().enumerate() {
            // SAFETY: base + i * 8 + 8 <= len, inside the source range.
            *w = unsafe { ptr::read_unaligned(src.wrapping_add(base + i * 8) as *const u64) };
        }
        // SAFETY: base + 64 <= len; dst + base is 8-byte aligned.
        unsafe { stream_line(dst.wrapping_add(base), &words) };
    }
    let done = stripes * STRIPE;
    // SAFETY: the tails [done, len) of both ranges are valid and disjoint.
    unsafe { ptr::copy_nonoverlapping(src.wrapping_add(done), dst.wrapping_add(done), len - done) };
}

/// Writes 64 bytes at `dst` with non-temporal stores (x86-64), or plainly elsewhere.
///
/// # Safety
///
/// `dst..dst+64` is writable, nobody else touches it, and `dst` is 8-byte aligned.
#[inline(always)]
unsafe fn stream_line(dst: *mut u8, words: &[u64; LANES]) {
    #[cfg(target_arch = "x86_64")]
    for (i, w) in words.iter().enumerate() {
        // SAFETY: dst + 8 * i is 8-byte aligned and writable (caller); movnti is SSE2,
        // which every x86-64 CPU has.
        unsafe {
            std::arch::x86_64::_mm_stream_si64(dst.wrapping_add(i * 8) as *mut i64, *w as i64)
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: as above.
    unsafe {
        ptr::copy_nonoverlapping(words.as_ptr() as *const u8, dst, STRIPE)
    };
}

/// Orders the non-temporal stores before any later store (the completion's publication).
#[inline(always)]
fn store_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: sfence has no preconditions (SSE, which every x86-64 CPU has).
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
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

    #[test]
    fn every_mode_copies_exactly_at_any_alignment_and_length() {
        let data: Vec<u8> = (0..70_000u32).map(|i| (i * 31 + i / 7) as u8).collect();
        for mode in [ChecksumMode::Off, ChecksumMode::Fast, ChecksumMode::Crc32c] {
            for (src_off, dst_off, len) in
                [(0, 0, 65_536), (3, 0, 40_001), (0, 8, 1000), (5, 3, 777), (0, 0, 63), (0, 0, 0)]
            {
                let mut out = vec![0u8; 70_100];
                let src = &data[src_off..src_off + len];
                let to = out.as_mut_ptr().wrapping_add(dst_off);
                // SAFETY: src and out are distinct live Vecs with room for len bytes.
                let h = unsafe { copy_checksum(mode, src.as_ptr(), to, len) };
                assert_eq!(&out[dst_off..dst_off + len], src, "{mode:?} {src_off} {dst_off} {len}");
                assert!(out[..dst_off].iter().all(|&b| b == 0), "nothing written before");
                assert!(out[dst_off + len..].iter().all(|&b| b == 0), "nothing written after");
                assert_eq!(h, checksum(mode, src), "{mode:?} {src_off} {dst_off} {len}");
            }
        }
    }
}
