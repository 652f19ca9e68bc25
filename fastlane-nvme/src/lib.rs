//! FastLane's userspace NVMe driver and, for now, the record journal.
//!
//! - [`vfio`]: the userspace NVMe driver over VFIO, a backend behind `fastlane_block`'s seam.
//! - [`journal`]: the record journal.

pub mod journal;
pub mod vfio;
