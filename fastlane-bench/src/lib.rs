//! FastLane's benchmarks and load generators, as a library: each module holds one benchmark's
//! flags (a clap `Args` struct, its configuration) and its `run`, which the `fastlane` CLI
//! calls from the matching subcommand. Every benchmark compares against its peer or physical
//! floor in the same run, prints a table and, with `--json`, the same results.
//!
//! - [`suite`]: `fastlane bench ring|blk|nvme`, the ring benchmarks (atomic floor, rtrb,
//!   crossbeam) and the dispatch to [`blk`] and [`nvme`].
//! - [`blk`]: `fastlane bench blk`, a vhost-user-blk frontend (virtio-driver) against
//!   `fastlane serve` or any backend, with `--verify`.
//! - [`nvme`]: `fastlane bench nvme`, the userspace NVMe driver against the kernel's.
//! - [`kv_cluster`]: `fastlane kv bench-cluster`, the Redis Cluster tier against
//!   `redis-benchmark`.
//! - [`kv_sim`]: `fastlane kv sim`, the scheduler simulator's scenarios.
//! - [`kv_tiers`]: `fastlane kv bench`, the swap tiers against `memcpy` and O_DIRECT.
//! - [`llm_bench`], [`llm_load`], [`llm_sched`]: `fastlane llm bench`: the engine against its
//!   floors, the HTTP load generator, the scheduler scenarios on the real engine.
//! - [`rdma`]: `fastlane rdma bench`, RDMA WRITE latency (ping-pong) and bandwidth, as perftest.
//! - [`journal`]: `fastlane journal bench`, durable-ack latency against `pwrite` + `fdatasync`.
//! - [`itch`]: `fastlane itch replay`, a feed through the order books in software or through
//!   the software card's rings, with message rates and the card's latency.
//! - Helpers written once: [`stats`] (median), [`pin`] (core pinning), [`load`] (load
//!   average), [`mem`] (populated anonymous memory).

pub mod blk;
pub mod itch;
pub mod journal;
pub mod kv_cluster;
pub mod kv_sim;
pub mod kv_tiers;
pub mod llm_attack;
pub mod llm_bench;
pub mod llm_load;
pub mod llm_sched;
pub mod load;
pub mod mem;
pub mod nvme;
pub mod pin;
pub mod rdma;
pub mod router_floor;
pub mod stats;
pub mod suite;
