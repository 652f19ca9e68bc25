//! Small helpers that several FastLane crates and the `fastlane` CLI need, each written once
//! here instead of once per user:
//!
//! - [`parse_size`]: `64M`-style byte sizes (binary multiples), for specs and command lines;
//! - [`SplitMix64`], [`splitmix64`], [`mix64`]: the seedable generator behind test data,
//!   synthetic latencies, the simulator and the disk verification pattern;
//! - [`pattern`]: the seeded, position-addressed test-data pattern of the data-path checks;
//! - [`tsc`]: the x86 time-stamp counter as a cheap clock for benchmarks;
//! - [`cpu`]: pinning a thread to a CPU, unpinning it, the process's CPU list;
//! - [`stats`]: median and nearest-rank quantiles;
//! - [`secret`]: passwords, tokens and PEM certificates read from files, checked;
//! - [`testcert`]: a throwaway CA and certificate for TLS tests, and a time-bounded command;
//! - [`SeqId`], [`BlockId`]: the ids the swap tier and the scheduler share;
//! - [`CountingAlloc`]: the global allocator of the "allocates nothing" tests.
//!
//! It holds no data path and depends on no other FastLane crate, so every crate can depend on
//! it. It does not hold helpers that a maintained crate already provides (memory maps are
//! `memmap2`, cache padding is `crossbeam-utils`, fd passing is `vmm-sys-util`).

mod alloc_count;
pub mod cpu;
mod ids;
pub mod pattern;
mod rng;
pub mod secret;
mod size;
pub mod stats;
pub mod testcert;
pub mod tsc;

pub use alloc_count::CountingAlloc;
pub use ids::{BlockId, SeqId};
pub use rng::{mix64, splitmix64, SplitMix64};
pub use size::{parse_size, ParseSizeError};
