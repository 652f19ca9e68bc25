//! The seeded test-data pattern every data-path check writes and reads back: the disk
//! verification of `fastlane bench blk --verify`, the VFIO guest check and the host test that
//! reads its backing file, the swap tiers' and the RDMA pool's round-trip tests.
//!
//! The pattern is addressed by position: the 8-byte word at byte `offset` of a seed's pattern
//! is `splitmix64(seed × 0x1000_0000_01b3 ^ offset / 8)`, so the same disk (or block) bytes
//! always hold the same values for one seed, whatever the request sizes that wrote them, and a
//! shifted, stale or foreign buffer differs in its first word.

use crate::splitmix64;

/// The pattern word at word index `word` of `seed`'s pattern.
#[inline]
fn word(seed: u64, word: u64) -> u64 {
    splitmix64(seed.wrapping_mul(0x1000_0000_01b3) ^ word)
}

/// Fill `buf` with `seed`'s pattern as it lies at byte `offset` (a multiple of 8) onwards.
///
/// # Panics
/// If `offset` is not a multiple of 8 (a caller's bug: the pattern is word-addressed).
pub fn fill(seed: u64, offset: u64, buf: &mut [u8]) {
    assert_eq!(offset % 8, 0, "pattern offsets are multiples of 8");
    for (i, chunk) in buf.chunks_mut(8).enumerate() {
        let w = word(seed, offset / 8 + i as u64);
        chunk.copy_from_slice(&w.to_le_bytes()[..chunk.len()]);
    }
}

/// `len` bytes of `seed`'s pattern from offset 0.
pub fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0; len];
    fill(seed, 0, &mut v);
    v
}

/// The index in `buf` of the first byte that differs from `seed`'s pattern at `offset`
/// (a multiple of 8), or `None` when all of `buf` matches. Allocates nothing.
///
/// # Panics
/// If `offset` is not a multiple of 8.
pub fn first_mismatch(seed: u64, offset: u64, buf: &[u8]) -> Option<usize> {
    assert_eq!(offset % 8, 0, "pattern offsets are multiples of 8");
    for (i, chunk) in buf.chunks(8).enumerate() {
        let want = word(seed, offset / 8 + i as u64).to_le_bytes();
        if let Some(j) = chunk.iter().zip(want).position(|(a, b)| *a != b) {
            return Some(i * 8 + j);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pattern_is_addressed_by_position_not_by_request() {
        let whole = bytes(7, 4096);
        let mut part = vec![0; 1000];
        fill(7, 2048, &mut part);
        assert_eq!(part, whole[2048..3048]);
        assert_eq!(first_mismatch(7, 2048, &part), None);
        assert_eq!(first_mismatch(7, 0, &whole), None);
    }

    #[test]
    fn a_changed_shifted_or_foreign_buffer_is_caught_at_its_first_byte() {
        let mut b = bytes(3, 256);
        b[77] ^= 1;
        assert_eq!(first_mismatch(3, 0, &b), Some(77));
        let b = bytes(3, 256);
        assert_eq!(first_mismatch(3, 8, &b[..248]), Some(0), "shifted by one word");
        assert_eq!(first_mismatch(4, 0, &b), Some(0), "another seed");
        assert_ne!(bytes(3, 64), bytes(4, 64));
    }

    #[test]
    #[should_panic(expected = "multiples of 8")]
    fn an_unaligned_offset_is_a_bug() {
        fill(1, 3, &mut [0; 8]);
    }
}
