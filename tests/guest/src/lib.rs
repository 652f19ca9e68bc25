//! FastLane's guest tests: each integration test under `tests/` boots a QEMU TCG guest with
//! `tests/vm/run-guest.sh` and runs a script there that drives one of this crate's binaries
//! (`src/bin/`): `fastlane-rdma-check` (verbs on soft-RoCE), `vfio_guest` (the userspace NVMe
//! driver on an emulated controller), `kvswap-remote-check` and `fastlane-llm-remote-check`
//! (the remote swap tier under kvswap and under the inference engine). They live here, not in
//! the libraries they test, so that production crates carry no test drivers. Every guest of
//! the workspace's tests (these and the disk tests of `fastlane-cli`) boots through
//! [`Guest`].

pub mod driver;
pub mod guest;
pub mod rxe_guest;

pub use guest::{workspace_root, Guest};
