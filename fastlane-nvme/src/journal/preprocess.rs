//! The preprocessing seam: the CRC32C and the timestamp of each frame.
//!
//! The writer asks a [`Preprocess`] for both. [`SoftPreprocess`] calls `fastlane-fpga`'s
//! direct entry points on the writer's core: [`fastlane_fpga::crc32c_append`] (SSE4.2, or
//! slicing-by-8) and the card clock ([`fastlane_fpga::CardClock`], monotonic), offset once to
//! the Unix epoch so frames carry wall-clock nanoseconds that never go backwards. A card behind
//! the descriptor rings (the `SoftCard` model today, a BAR-mapped FPGA later) implements the same
//! trait by posting a batch's frames as `OP_CRC32C`/`OP_TIMESTAMP` descriptors.

use fastlane_fpga::CardClock;

/// Computes what a frame needs from the preprocessing stage.
pub trait Preprocess: Send {
    /// Continues a CRC32C over `data` (`crc32c_append(crc32c(a), b) == crc32c(a ++ b)`).
    fn crc32c_append(&mut self, crc: u32, data: &[u8]) -> u32;

    /// The timestamp for the next frame, ns since the Unix epoch.
    fn timestamp_ns(&mut self) -> u64;

    /// A short name for the CLI.
    fn name(&self) -> &str;
}

/// CRC32C and card-clock timestamps through `fastlane-fpga`'s direct entry points.
#[derive(Debug, Clone, Copy)]
pub struct SoftPreprocess {
    clock: CardClock,
    /// `CLOCK_REALTIME` at the clock's epoch.
    epoch_unix_ns: u64,
}

impl Default for SoftPreprocess {
    fn default() -> Self {
        SoftPreprocess { clock: CardClock::new(), epoch_unix_ns: realtime_ns() }
    }
}

impl Preprocess for SoftPreprocess {
    #[inline]
    fn crc32c_append(&mut self, crc: u32, data: &[u8]) -> u32 {
        fastlane_fpga::crc32c_append(crc, data)
    }

    #[inline]
    fn timestamp_ns(&mut self) -> u64 {
        self.epoch_unix_ns.wrapping_add(self.clock.now_ns())
    }

    fn name(&self) -> &str {
        "fpga-direct"
    }
}

/// `CLOCK_REALTIME` in ns (a vDSO call, no syscall).
pub fn realtime_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    (ts.tv_sec as u64).wrapping_mul(1_000_000_000).wrapping_add(ts.tv_nsec as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc_matches_the_check_value_and_time_moves_forward() {
        let mut p = SoftPreprocess::default();
        assert_eq!(p.crc32c_append(0, b"123456789"), 0xE306_9283);
        let a = p.timestamp_ns();
        let b = p.timestamp_ns();
        assert!(b >= a && a > 1_600_000_000_000_000_000);
    }
}
