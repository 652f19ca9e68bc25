//! The real tests of fastlane-rdma: boot a QEMU TCG guest (tests/vm), bring up soft-RoCE
//! (`rxe0` on `dummy0`) and run every scenario of the `fastlane-rdma-check` driver there as
//! pairs of processes on 127.0.0.1 (see tests/vm/guest-rdma.sh). Skips, with a message, only
//! when QEMU is not installed (`.ci/install-deps.sh` installs it and the RDMA packages).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

const RXE_PROVIDER: &str = "/usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so";
const RXE_DRIVER: &str = "/etc/libibverbs.d/rxe.driver";
const RXE_MODULES: &str =
    "crc32_generic ib_core ib_uverbs udp_tunnel ip6_udp_tunnel rdma_rxe dummy";

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

fn root() -> PathBuf {
    // Canonical, so a symlinked checkout of the crate still finds the workspace's tests/vm.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    dir.parent().expect("workspace root").to_path_buf()
}

fn have(cmd: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {cmd} >/dev/null 2>&1")])
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

#[test]
fn rdma_over_soft_roce_in_a_guest() {
    if !have("qemu-system-x86_64") {
        eprintln!("SKIPPED: qemu-system-x86_64 is not installed (run .ci/install-deps.sh)");
        return;
    }
    for f in [RXE_PROVIDER, RXE_DRIVER, "/usr/bin/rdma"] {
        assert!(
            Path::new(f).exists(),
            "{f} missing: run .ci/install-deps.sh (ibverbs-providers, iproute2)"
        );
    }
    let root = root();
    let t = Instant::now();
    let out = Command::new(root.join("tests/vm/run-guest.sh"))
        .args(["--script"])
        .arg(root.join("tests/vm/guest-rdma.sh"))
        .args(["--bin", env!("CARGO_BIN_EXE_fastlane-rdma-check"), "--bin", "/usr/bin/rdma"])
        .args(["--lib", RXE_PROVIDER, "--file", &format!("{RXE_DRIVER}:{RXE_DRIVER}")])
        .args(["--modules", RXE_MODULES, "--smp", "2", "--timeout", "240"])
        .args(["--append", "fl_rdma_phase=test"])
        .output()
        .expect("run tests/vm/run-guest.sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("CHECK") || l.starts_with("RESULT") || l.starts_with("ERROR"))
        .collect();
    eprintln!("guest run took {:?}\n{}", t.elapsed(), lines.join("\n"));
    let failed: Vec<&&str> =
        lines.iter().filter(|l| l.contains(" FAIL") || l.starts_with("ERROR")).collect();
    let missing: Vec<&&str> = EXPECTED
        .iter()
        .filter(|name| !lines.iter().any(|l| l.starts_with(&format!("CHECK {name} ok"))))
        .collect();
    assert!(
        out.status.success() && failed.is_empty() && missing.is_empty(),
        "guest status {:?}; failed: {failed:?}; missing: {missing:?}\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}",
        out.status.code()
    );
}
