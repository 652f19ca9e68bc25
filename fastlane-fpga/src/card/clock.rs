//! The card's clock: nanoseconds since the card was reset, read from the host's monotonic clock.
//!
//! A real card stamps with its own free-running counter (exposed in the register map as
//! `CLOCK_LO`/`CLOCK_HI`, see `docs/fpga-abi.md`); the software model reads
//! `CLOCK_MONOTONIC`, which is what such a counter is disciplined to. The journal stamps its
//! records with [`CardClock::now_ns`] directly (no ring round trip) or asks the card for a
//! stamp with `OP_TIMESTAMP`; both read the same clock when the card is the software model.

/// `CLOCK_MONOTONIC` in nanoseconds (vDSO, no syscall on Linux).
#[inline]
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec on our stack; CLOCK_MONOTONIC always exists
    // on Linux, so the call cannot fail (its return value is checked in debug builds).
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    debug_assert_eq!(rc, 0);
    (ts.tv_sec as u64).wrapping_mul(1_000_000_000).wrapping_add(ts.tv_nsec as u64)
}

/// A card clock: monotonic nanoseconds since its epoch (the card's reset).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CardClock {
    epoch_ns: u64,
}

impl CardClock {
    /// A clock whose epoch is now.
    pub fn new() -> Self {
        Self { epoch_ns: monotonic_ns() }
    }

    /// A clock whose epoch is a given `CLOCK_MONOTONIC` reading (for sharing one epoch).
    pub const fn with_epoch(epoch_ns: u64) -> Self {
        Self { epoch_ns }
    }

    /// The epoch, as a `CLOCK_MONOTONIC` reading in nanoseconds.
    pub const fn epoch_ns(&self) -> u64 {
        self.epoch_ns
    }

    /// Nanoseconds since the epoch; never decreases.
    #[inline]
    pub fn now_ns(&self) -> u64 {
        monotonic_ns().saturating_sub(self.epoch_ns)
    }
}

impl Default for CardClock {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clock_is_monotonic_and_tracks_sleep() {
        let c = CardClock::new();
        let a = c.now_ns();
        std::thread::sleep(std::time::Duration::from_millis(5));
        let b = c.now_ns();
        assert!(b >= a + 4_000_000, "{a} -> {b}");
        assert!(b < a + 5_000_000_000, "{a} -> {b}");
        let mut prev = c.now_ns();
        for _ in 0..10_000 {
            let now = c.now_ns();
            assert!(now >= prev);
            prev = now;
        }
    }
}
