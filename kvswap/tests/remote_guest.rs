//! The remote tier against a real `fastlane_rdma` pool: boots a QEMU TCG guest (tests/vm),
//! brings up soft-RoCE and runs kvswap/tests/vm/guest-kvswap.sh there (spill to the pool,
//! swap back, bytes compared; the pool server killed with -9 under the engine). Skips, with a
//! message, only when QEMU is not installed (`.ci/install-deps.sh` installs it and the RDMA
//! packages).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

const RXE_PROVIDER: &str = "/usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so";
const RXE_DRIVER: &str = "/etc/libibverbs.d/rxe.driver";
const RXE_MODULES: &str =
    "crc32_generic ib_core ib_uverbs udp_tunnel ip6_udp_tunnel rdma_rxe dummy";

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

fn have(cmd: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {cmd} >/dev/null 2>&1")])
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

#[test]
fn remote_tier_over_soft_roce_in_a_guest() {
    if !have("qemu-system-x86_64") {
        eprintln!("SKIPPED: qemu-system-x86_64 is not installed (run .ci/install-deps.sh)");
        return;
    }
    for f in [RXE_PROVIDER, RXE_DRIVER, "/usr/bin/rdma"] {
        assert!(Path::new(f).exists(), "{f} missing: run .ci/install-deps.sh");
    }
    let krate = Path::new(env!("CARGO_MANIFEST_DIR"));
    let krate = krate.canonicalize().unwrap_or_else(|_| krate.to_path_buf());
    let root: PathBuf = krate.parent().expect("workspace root").to_path_buf();
    let t = Instant::now();
    let out = Command::new(root.join("tests/vm/run-guest.sh"))
        .args(["--script"])
        .arg(krate.join("tests/vm/guest-kvswap.sh"))
        .args(["--bin", env!("CARGO_BIN_EXE_kvswap-remote-check"), "--bin", "/usr/bin/rdma"])
        .args(["--lib", RXE_PROVIDER, "--file", &format!("{RXE_DRIVER}:{RXE_DRIVER}")])
        .args(["--modules", RXE_MODULES, "--smp", "2", "--timeout", "240"])
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
