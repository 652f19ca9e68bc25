//! FastLane: a userspace low-latency data path.
//!
//! This facade re-exports the public surface of the workspace crates:
//!
//! - [`ring`]: lock-free SPSC rings, in-process and across processes in shared memory.
//! - [`fpga`]: the preprocessing card interface (ring ABI, software model), ITCH 5.0 decoding,
//!   order books, CRC32C and the card clock.
//! - [`hist`]: latency recording into HdrHistograms and `.hlog` interval logs.
//! - [`kvswap`]: the KV-cache swap tier (host, NVMe and remote tiers, the swap engine).
//!
//! It holds no code of its own; the root `tests/` and `benches/` live here.

pub use fastlane_fpga as fpga;
pub use fastlane_hist as hist;
pub use kvswap;
pub use fastlane_ring as ring;
