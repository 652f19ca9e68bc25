//! The remote tier against a real `fastlane_rdma` pool: boots a QEMU TCG guest (tests/vm),
//! brings up soft-RoCE and runs tests/vm/guest-kvswap.sh there (spill to the pool,
//! swap back, bytes compared; the pool server killed with -9 under the engine). Skips, with a
//! message, only when QEMU is not installed (`.ci/install-deps.sh` installs it and the RDMA
//! packages).

use fastlane_guest_tests::rxe_guest;

/// The checks the guest must report as ok.
const EXPECTED: &[&str] = &[
    "remote-connect",
    "remote-spill",
    "remote-direct",
    "remote-accounting",
    "remote-round-trip",
    "remote-peer-gone",
    "remote-gone-data-kept",
    "remote-gone-swap-in",
];

#[test]
fn remote_tier_over_soft_roce_in_a_guest() {
    let root = rxe_guest::workspace_root(env!("CARGO_MANIFEST_DIR"));
    rxe_guest::RxeGuest {
        script: root.join("tests/vm/guest-kvswap.sh"),
        root,
        bins: &[env!("CARGO_BIN_EXE_kvswap-remote-check")],
        extra: &[],
        timeout_s: 240,
        expected: EXPECTED,
    }
    .run_and_check();
}
