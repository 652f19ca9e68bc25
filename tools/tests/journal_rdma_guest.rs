//! The journal replicated over RDMA, for real: boot a QEMU TCG guest (tests/vm), bring up
//! soft-RoCE (`rxe0` on `dummy0`) and run tests/vm/guest-journal-rdma.sh there: a
//! `replicated` journal whose every acknowledged seq must be in the `fastlane journal
//! replica` process's file (same chain head), and a replica killed with -9 under load, which
//! must become a typed error at the primary within the RDMA timeout while everything
//! acknowledged stays in both copies. Skips, with a message, only when QEMU is not installed
//! (`.ci/install-deps.sh` installs it and the RDMA packages).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

const RXE_PROVIDER: &str = "/usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so";
const RXE_DRIVER: &str = "/etc/libibverbs.d/rxe.driver";
const RXE_MODULES: &str =
    "crc32_generic ib_core ib_uverbs udp_tunnel ip6_udp_tunnel rdma_rxe dummy";

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

fn root() -> PathBuf {
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
fn journal_replicated_over_soft_roce_in_a_guest() {
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
        .arg(root.join("tests/vm/guest-journal-rdma.sh"))
        .args(["--bin", env!("CARGO_BIN_EXE_fastlane"), "--bin", "/usr/bin/rdma"])
        .args(["--lib", RXE_PROVIDER, "--file", &format!("{RXE_DRIVER}:{RXE_DRIVER}")])
        .args(["--modules", RXE_MODULES, "--smp", "2", "--mem", "768M", "--timeout", "150"])
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
