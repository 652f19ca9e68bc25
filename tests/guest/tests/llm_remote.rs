//! Swap through the remote tier is invisible: boots a QEMU TCG guest (tests/vm), brings up
//! soft-RoCE and runs tests/vm/guest-llm.sh there (a `fastlane_rdma` pool server
//! and the engine preempting by swap into it, outputs compared with solo runs). Skips, with a
//! message, only when QEMU is not installed (`.ci/install-deps.sh` installs it and the RDMA
//! packages).

use fastlane_guest_tests::rxe_guest;

#[test]
fn swap_through_the_remote_tier_is_invisible_in_a_guest() {
    let root = rxe_guest::workspace_root(env!("CARGO_MANIFEST_DIR"));
    rxe_guest::RxeGuest {
        script: root.join("tests/vm/guest-llm.sh"),
        root,
        bins: &[env!("CARGO_BIN_EXE_fastlane-llm-remote-check")],
        extra: &["--mem", "1024"],
        timeout_s: 480,
        expected: &[
            "llm-solo",
            "llm-remote-connect",
            "llm-remote-swapped",
            "llm-remote-invisible",
            "llm-remote-blocks",
        ],
    }
    .run_and_check();
}
