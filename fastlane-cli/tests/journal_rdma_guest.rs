//! The journal replicated over RDMA, for real: boot a QEMU TCG guest (tests/vm), bring up
//! soft-RoCE (`rxe0` on `dummy0`) and run tests/vm/guest-journal-rdma.sh there: a
//! `replicated` journal whose every acknowledged seq must be in the `fastlane journal
//! replica` process's file (same chain head), a replica left behind that catches up on open
//! (and a diverged one that is refused, then rebuilt on request), and a replica killed with -9 under load, which
//! must become a typed error at the primary within the RDMA timeout while everything
//! acknowledged stays in both copies. Skips, with a message, only when QEMU is not installed
//! (`.ci/install-deps.sh` installs it and the RDMA packages).

mod common;

use fastlane_guest_tests::rxe_guest;

/// The checks the guest must report as ok (each printed as `CHECK <name> ok ...`).
const EXPECTED: &[&str] = &[
    "replicated-append",
    "replica-has-every-acked-seq",
    "resync-caught-up",
    "resync-same-head",
    "diverged-refused",
    "rebuild-verifies",
    "dead-replica-typed-error",
    "dead-replica-no-hang",
    "acked-survive-replica-kill",
];

#[test]
fn journal_replicated_over_soft_roce_in_a_guest() {
    let root = rxe_guest::workspace_root(env!("CARGO_MANIFEST_DIR"));
    rxe_guest::RxeGuest {
        script: root.join("tests/vm/guest-journal-rdma.sh"),
        root,
        bins: &[common::cli::FASTLANE],
        extra: &["--mem", "768M"],
        timeout_s: 150,
        expected: EXPECTED,
    }
    .run_and_check();
}
