//! FastLane: a userspace low-latency data path.
//!
//! This facade re-exports every library crate of the workspace:
//!
//! - [`util`]: sizes, the seedable generator, the TSC clock, the ids the swap tier and the
//!   scheduler share.
//! - [`daemon`]: what every daemon shares (HTTP listener, Prometheus, signals, `sd_notify`,
//!   logging).
//! - [`ring`]: lock-free SPSC rings, in-process and across processes in shared memory.
//! - [`hist`]: latency recording into HdrHistograms and `.hlog` interval logs.
//! - [`block`]: the block-queue seam and its backends (RAM, io_uring, inline file).
//! - [`nvme`]: the userspace NVMe driver over VFIO.
//! - [`vhost_blk`]: the vhost-user-blk device and the backend factory of `fastlane serve`.
//! - [`disk`]: the disk daemon (`fastlane serve`, the `fastlane-disk` binary): options,
//!   socket, signals, stats and metrics around the vhost-user-blk device.
//! - [`journal`]: the record journal (durable, hash-chained, replicated records) and its
//!   service (many producers, rolling segments).
//! - [`journal_export`]: the journal's durable records to a NATS JetStream stream.
//!   (`fastlane-journal-c`, the C producer, is a C library: `libfastlane_journal`.)
//! - [`market`]: ITCH 5.0 decoding, order books, the normalized event, the feed generator.
//! - [`fpga`]: the preprocessing card (ring ABI, software model, CRC32C, card clock).
//! - [`rdma`]: RDMA verbs, the remote memory pool and the write mirror.
//! - [`kvswap`]: the KV-cache swap tiers (host, NVMe, remote, Redis Cluster), the swap engine,
//!   the prefix store and the socket protocol.
//! - [`sched`]: the preemptive multi-tenant scheduler and its simulator.
//! - [`openai`]: the OpenAI-compatible front end without an engine (tenants, gate, errors,
//!   metrics) and the router.
//! - [`llm`]: the inference engine and `llm serve`'s server.
//! - [`bench`](mod@bench): the benchmarks and load generators the CLI runs, and their shared helpers.
//!
//! It holds no code of its own; the root `tests/` and `benches/` live here
//! (`tests/crate_boundaries.rs` checks the dependency rules with `cargo tree`).

pub use fastlane_bench as bench;
pub use fastlane_block as block;
pub use fastlane_daemon as daemon;
pub use fastlane_disk as disk;
pub use fastlane_fpga as fpga;
pub use fastlane_hist as hist;
pub use fastlane_journal as journal;
pub use fastlane_journal_export as journal_export;
pub use fastlane_kvswap as kvswap;
pub use fastlane_llm as llm;
pub use fastlane_market as market;
pub use fastlane_nvme as nvme;
pub use fastlane_openai as openai;
pub use fastlane_rdma as rdma;
pub use fastlane_ring as ring;
pub use fastlane_sched as sched;
pub use fastlane_util as util;
pub use fastlane_vhost_blk as vhost_blk;
