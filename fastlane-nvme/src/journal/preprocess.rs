//! The preprocessing seam: the CRC32C and the timestamp of each frame.
//!
//! The writer asks a [`Preprocess`] for both. [`SoftPreprocess`] computes them on the writer's
//! core (SSE4.2 CRC32C, `CLOCK_REALTIME`); the `fastlane-fpga` card (software model today, a
//! BAR-mapped card later) will implement the same trait by posting the batch's frames as
//! descriptors and reading the CRC and card timestamp from the completions.

use super::crc32c::crc32c_append;

/// Computes what a frame needs from the preprocessing stage.
pub trait Preprocess: Send {
    /// Continues a CRC32C over `data` (see [`crc32c_append`]).
    fn crc32c_append(&mut self, crc: u32, data: &[u8]) -> u32;

    /// The timestamp for the next frame, ns since the Unix epoch.
    fn timestamp_ns(&mut self) -> u64;

    /// A short name for the CLI.
    fn name(&self) -> &str;
}

/// CRC32C and timestamps in software on the writer's core.
#[derive(Debug, Default, Clone, Copy)]
pub struct SoftPreprocess;

impl Preprocess for SoftPreprocess {
    #[inline]
    fn crc32c_append(&mut self, crc: u32, data: &[u8]) -> u32 {
        crc32c_append(crc, data)
    }

    #[inline]
    fn timestamp_ns(&mut self) -> u64 {
        realtime_ns()
    }

    fn name(&self) -> &str {
        "software"
    }
}

/// `CLOCK_REALTIME` in ns (a vDSO call, no syscall).
pub fn realtime_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    (ts.tv_sec as u64).wrapping_mul(1_000_000_000).wrapping_add(ts.tv_nsec as u64)
}
