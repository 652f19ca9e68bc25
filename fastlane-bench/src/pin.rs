//! Pinning the calling thread to one CPU (client and server on different cores).

use anyhow::{ensure, Result};

/// Pins the calling thread to CPU `core`; the error names the flag the core came from.
///
/// It does not look at the calling thread's own mask first (a thread that pinned itself
/// before sees one CPU there): the kernel refuses a CPU this process may not use.
pub fn pin_to(core: usize, flag: &str) -> Result<()> {
    ensure!(
        fastlane_util::cpu::pin(core),
        "{flag} {core}: not a CPU this process may run on (pinning failed)"
    );
    Ok(())
}

pub use fastlane_util::cpu::unpin;

#[cfg(test)]
mod tests {
    #[test]
    fn pins_to_a_cpu_it_may_use_and_names_the_flag_otherwise() {
        let first = fastlane_util::cpu::process_cpus()[0];
        super::pin_to(first, "--pin-core").unwrap();
        let err = super::pin_to(100_000, "--pin-core").unwrap_err().to_string();
        assert!(err.starts_with("--pin-core 100000: not a CPU"), "{err}");
        super::unpin();
    }
}
