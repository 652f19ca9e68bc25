//! FastLane's userspace NVMe driver.
//!
//! - [`vfio`]: the userspace NVMe driver over VFIO, a backend behind `fastlane_block`'s seam.

pub mod vfio;
