//! The soft-RoCE guest harness of this crate's tests: boot a QEMU TCG guest with
//! tests/vm/run-guest.sh, bring up `rxe0` on `dummy0`, run a guest script that prints
//! `CHECK <name> ok|FAIL …` lines, and assert that every expected check passed.
//!
//! QEMU and the RDMA userspace pieces are required (`.ci/install-deps.sh` installs both).

use std::path::{Path, PathBuf};
use std::time::Instant;

pub use crate::guest::workspace_root;
use crate::guest::Guest;

/// The rxe provider library, copied into the guest.
pub const RXE_PROVIDER: &str = "/usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so";
/// The rxe driver file (`/etc/libibverbs.d`), copied into the guest.
pub const RXE_DRIVER: &str = "/etc/libibverbs.d/rxe.driver";
/// Kernel modules soft-RoCE needs in the guest, in load order.
pub const RXE_MODULES: &str =
    "crc32_generic ib_core ib_uverbs udp_tunnel ip6_udp_tunnel rdma_rxe dummy";

/// One guest run.
#[derive(Debug)]
pub struct RxeGuest<'a> {
    /// The workspace root ([`workspace_root`]).
    pub root: PathBuf,
    /// The script to run in the guest.
    pub script: PathBuf,
    /// Host binaries to copy in (besides `/usr/bin/rdma`, always copied).
    pub bins: &'a [&'a str],
    /// More arguments for run-guest.sh (`--mem`, `--append`, …).
    pub extra: &'a [&'a str],
    /// run-guest.sh's `--timeout`, seconds.
    pub timeout_s: u32,
    /// The checks that must each print `CHECK <name> ok`.
    pub expected: &'a [&'a str],
}

impl RxeGuest<'_> {
    /// Boots the guest, runs the script and asserts: the guest exited 0, no check failed, no
    /// `ERROR` line, and every expected check passed. Panics when QEMU is not installed.
    pub fn run_and_check(&self) {
        for f in [RXE_PROVIDER, RXE_DRIVER, "/usr/bin/rdma"] {
            assert!(
                Path::new(f).exists(),
                "{f} missing: run .ci/install-deps.sh (ibverbs-providers, iproute2)"
            );
        }
        let t = Instant::now();
        let script = self.script.strip_prefix(&self.root).unwrap_or(&self.script);
        let mut guest = Guest::new(
            self.root.to_str().expect("utf-8 root"),
            script.to_str().expect("utf-8 path"),
        );
        for b in self.bins {
            guest = guest.bin(b);
        }
        guest = guest
            .bin("/usr/bin/rdma")
            .lib(RXE_PROVIDER)
            .file(RXE_DRIVER, RXE_DRIVER)
            .modules(RXE_MODULES)
            .smp(2)
            .timeout_s(u64::from(self.timeout_s));
        let mut cmd = guest.command();
        cmd.args(self.extra);
        let out = cmd.output().expect("run tests/vm/run-guest.sh");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let lines: Vec<&str> = stdout
            .lines()
            .filter(|l| l.starts_with("CHECK") || l.starts_with("RESULT") || l.starts_with("ERROR"))
            .collect();
        eprintln!("guest run took {:?}\n{}", t.elapsed(), lines.join("\n"));
        let failed: Vec<&&str> =
            lines.iter().filter(|l| l.contains(" FAIL") || l.starts_with("ERROR")).collect();
        let missing: Vec<&&str> = self
            .expected
            .iter()
            .filter(|name| !lines.iter().any(|l| l.starts_with(&format!("CHECK {name} ok"))))
            .collect();
        assert!(
            out.status.success() && failed.is_empty() && missing.is_empty(),
            "guest status {:?}; failed: {failed:?}; missing: {missing:?}\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}",
            out.status.code()
        );
    }
}
