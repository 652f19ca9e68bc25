//! FastLane: a userspace low-latency data path.
//!
//! This facade re-exports the public surface of the workspace crates:
//!
//! - [`ring`]: lock-free SPSC rings, in-process and across processes in shared memory.
//! - [`hist`]: latency recording into HdrHistograms and `.hlog` interval logs.
//! - [`block`]: the block-queue seam and its backends (RAM, io_uring, inline file).
//! - [`nvme`]: the userspace NVMe driver over VFIO.
//! - [`journal`]: the record journal (durable, hash-chained, replicated records).
//! - [`vhost_blk`]: the vhost-user-blk device and the backend factory of `fastlane serve`.
//! - [`rdma`]: RDMA verbs, the remote memory pool and the write mirror.
//! - [`fpga`]: the preprocessing card interface (ring ABI, software model), ITCH 5.0 decoding,
//!   order books, CRC32C and the card clock.
//! - [`kvswap`]: the KV-cache swap tier (host, NVMe and remote tiers, the swap engine), the
//!   preemptive scheduler and its simulator.
//!
//! It holds no code of its own; the root `tests/` and `benches/` live here.

pub use fastlane_block as block;
pub use fastlane_fpga as fpga;
pub use fastlane_hist as hist;
pub use fastlane_journal as journal;
pub use fastlane_market as market;
pub use fastlane_nvme as nvme;
pub use fastlane_rdma as rdma;
pub use fastlane_ring as ring;
pub use fastlane_vhost_blk as vhost_blk;
pub use kvswap;
