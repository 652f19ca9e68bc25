//! Thread placement: pin the calling thread to a CPU, let it run anywhere again, and the
//! process's CPU list read once (written here once for the benches, the journal's writer and
//! flushers).

use std::sync::OnceLock;

/// Pins the calling thread to CPU `core` (its number in the system). `false`: the kernel
/// refused it (a CPU this process may not use, or none of that number); the thread keeps its
/// mask.
pub fn pin(core: usize) -> bool {
    if core >= libc::CPU_SETSIZE as usize {
        return false;
    }
    // SAFETY: `cpu_set_t` is a plain bit array; all zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `core < CPU_SETSIZE`, so the bit lies inside `set`.
    unsafe { libc::CPU_SET(core, &mut set) };
    // SAFETY: pid 0 is the calling thread; `set` lives across the call and its size is passed.
    unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0 }
}

/// Lets the calling thread run on every CPU the process may use (the kernel intersects the
/// full set with the cpuset). A thread inherits its creator's mask, so a thread started by a
/// pinned one is pinned too until it calls this. Best effort: on failure it keeps its mask.
pub fn unpin() {
    // SAFETY: as in `pin`.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for cpu in 0..libc::CPU_SETSIZE as usize {
        // SAFETY: `cpu < CPU_SETSIZE`.
        unsafe { libc::CPU_SET(cpu, &mut set) };
    }
    // SAFETY: as in `pin`.
    let _ = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
}

/// The CPUs this process may run on, read once, at the first call. Read later, the list
/// would be the calling thread's mask, which after a [`pin`] is that one CPU (and a thread
/// spawned by a pinned thread inherits it): call this before pinning anything.
pub fn process_cpus() -> &'static [usize] {
    static CPUS: OnceLock<Vec<usize>> = OnceLock::new();
    CPUS.get_or_init(|| {
        // SAFETY: as in `pin`.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: pid 0 is the calling thread; the kernel writes at most the size passed.
        let got =
            unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
        if got != 0 {
            return Vec::new();
        }
        // SAFETY: `cpu < CPU_SETSIZE`; `set` is initialised.
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
            .collect()
    })
}

/// Pins the calling thread to the process's `i`-th CPU (modulo their number) when the
/// process has two CPUs at least (a bench's client and server on different cores); `false`
/// when it has fewer or the kernel refused.
pub fn pin_nth(i: usize) -> bool {
    let cpus = process_cpus();
    cpus.len() >= 2 && pin(cpus[i % cpus.len()])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The calling thread's CPUs, as the kernel reports them now.
    fn mask() -> Vec<usize> {
        // SAFETY: as in `process_cpus`.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: as in `process_cpus`.
        let got =
            unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
        assert_eq!(got, 0);
        // SAFETY: as in `process_cpus`.
        (0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect()
    }

    #[test]
    fn pins_unpins_and_refuses_cpus_that_do_not_exist() {
        std::thread::spawn(|| {
            let all = process_cpus().to_vec();
            assert!(!all.is_empty());
            assert!(pin(all[0]));
            assert_eq!(mask(), vec![all[0]]);
            // Read once: still every CPU, not the pinned thread's one.
            assert_eq!(process_cpus(), &all[..]);
            assert!(!pin(100_000));
            assert!(!pin(libc::CPU_SETSIZE as usize - 1) || all.contains(&1023));
            unpin();
            assert_eq!(mask(), all);
            assert_eq!(pin_nth(1), all.len() >= 2);
            if all.len() >= 2 {
                assert_eq!(mask(), vec![all[1]]);
            }
        })
        .join()
        .unwrap();
    }
}
