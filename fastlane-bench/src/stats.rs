//! Statistics the benchmarks share (written once in [`fastlane_util::stats`]).

pub use fastlane_util::stats::{median, nearest_rank};
