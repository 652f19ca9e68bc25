//! The real tests of fastlane-rdma: boot a QEMU TCG guest (tests/vm), bring up soft-RoCE
//! (`rxe0` on `dummy0`) and run every scenario of the `fastlane-rdma-check` driver there as
//! pairs of processes on 127.0.0.1 (see tests/vm/guest-rdma.sh). Skips, with a message, only
//! when QEMU is not installed (`.ci/install-deps.sh` installs it and the RDMA packages).

use fastlane_guest_tests::rxe_guest;

/// The checks the guest must report as ok (each printed as `CHECK <name> ok ...`).
const EXPECTED: &[&str] = &[
    "connect",
    "write-read-1MiB",
    "imm-and-send",
    "server-checksum",
    "server-imm",
    "out-of-range-local",
    "usable-after-local-refusal",
    "out-of-range-remote",
    "broken-after-remote-refusal",
    "pool-grant",
    "pool-write-read",
    "pool-out-of-range-local",
    "pool-full",
    "pool-released-range-refused",
    "pool-forged-range-refused",
    "mirror-connect",
    "mirror-ordered-writes",
    "mirror-out-of-range",
    "mirror-replica-memory",
    "peer-gone-write",
    "peer-gone-recv",
];

#[test]
fn rdma_over_soft_roce_in_a_guest() {
    let root = rxe_guest::workspace_root(env!("CARGO_MANIFEST_DIR"));
    rxe_guest::RxeGuest {
        script: root.join("tests/vm/guest-rdma.sh"),
        root,
        bins: &[env!("CARGO_BIN_EXE_fastlane-rdma-check")],
        extra: &["--append", "fl_rdma_phase=test"],
        timeout_s: 240,
        expected: EXPECTED,
    }
    .run_and_check();
}
