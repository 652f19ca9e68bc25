//! Pinning the calling thread to one CPU (client and server on different cores).

use anyhow::{ensure, Result};

/// Pins the calling thread to CPU `core`; the error names the flag the core came from.
///
/// It does not look at the calling thread's own mask first (a thread that pinned itself
/// before sees one CPU there): the kernel refuses a CPU this process may not use.
pub fn pin_to(core: usize, flag: &str) -> Result<()> {
    // CPU_SET panics beyond CPU_SETSIZE: no such CPU can exist anyway.
    let ok = core < libc::CPU_SETSIZE as usize
        && core_affinity::set_for_current(core_affinity::CoreId { id: core });
    ensure!(ok, "{flag} {core}: not a CPU this process may run on (pinning failed)");
    Ok(())
}

/// Lets the calling thread run on every CPU again (a thread inherits its creator's mask).
pub fn unpin() {
    // SAFETY: `cpu_set_t` is a plain bit array; all zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for cpu in 0..libc::CPU_SETSIZE as usize {
        // SAFETY: `cpu` is below CPU_SETSIZE and `set` is a valid, writable cpu_set_t.
        unsafe { libc::CPU_SET(cpu, &mut set) };
    }
    // SAFETY: pid 0 is the calling thread; `set` is initialised and its size is passed.
    let _ = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
}

#[cfg(test)]
mod tests {
    #[test]
    fn pins_to_a_cpu_it_may_use_and_names_the_flag_otherwise() {
        let first = core_affinity::get_core_ids().unwrap()[0].id;
        super::pin_to(first, "--pin-core").unwrap();
        let err = super::pin_to(100_000, "--pin-core").unwrap_err().to_string();
        assert!(err.starts_with("--pin-core 100000: not a CPU"), "{err}");
        super::unpin();
    }
}
