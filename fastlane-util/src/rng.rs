//! SplitMix64 (Steele, Lea, Flood 2014): tiny, seedable, and the same stream on every platform
//! for a given seed. Good enough for test data and simulation; not for cryptography.

/// The golden-ratio increment SplitMix64 adds to its state on every step.
const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// SplitMix64's finaliser: a 64-bit mix (bijective), to derive well-spread values from keys.
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// One SplitMix64 step without state: the output a generator in state `z` gives next.
/// Counter-based uses (`splitmix64(seed ^ index)`) get random access into a pattern.
#[inline]
pub fn splitmix64(z: u64) -> u64 {
    mix64(z.wrapping_add(GAMMA))
}

/// The SplitMix64 generator.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator from a seed.
    pub const fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GAMMA);
        mix64(self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_stream() {
        // The first outputs for seed 1234567 of the reference implementation
        // (prng.di.unimi.it/splitmix64.c).
        let mut r = SplitMix64::new(1_234_567);
        assert_eq!(r.next_u64(), 6_457_827_717_110_365_317);
        assert_eq!(r.next_u64(), 3_203_168_211_198_807_973);
        assert_eq!(splitmix64(1_234_567), 6_457_827_717_110_365_317);
    }
}
