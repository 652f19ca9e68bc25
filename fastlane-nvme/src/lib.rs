//! FastLane's paravirtual NVMe backend.
//!
//! - [`vhost`]: the vhost-user-blk device QEMU attaches to.
//! - [`vfio`]: the userspace NVMe driver over VFIO, a backend behind `fastlane_block`'s seam.
//! - [`journal`]: the record journal.
//! - [`spec`]: the backend factory (`mem:`, `file:`, `nvme:` specs).

pub mod journal;
pub mod spec;
pub mod vfio;
pub mod vhost;
