//! FastLane's paravirtual NVMe backend.
//!
//! - [`block`]: block backends behind one submit/complete seam (RAM, io_uring).
//!
//! Being built: the vhost-user-blk device that QEMU attaches to, the VFIO NVMe driver and the
//! record journal.

pub mod block;
pub mod journal;
pub mod vfio;
pub mod vhost;
