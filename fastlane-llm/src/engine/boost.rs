//! The engine's threads at a higher priority while a protected tenant's prefill computes
//! (`llm serve --protected-nice`, docs/serving.md "Fairness within a tier"). On a core shared with
//! the HTTP workers, the quiet tenant's own step otherwise waited for the core most of its
//! time under attack (the threads' run-queue wait, `/proc/self/task/*/schedstat`, was up to
//! 17 ms of a 20 ms step). Only for the length of such a pass: at that priority all the time
//! the engine's batch work would starve the HTTP workers, the quiet tenant's own admission
//! included. Lowering a nice value needs `CAP_SYS_NICE` or an `RLIMIT_NICE` that allows it
//! (systemd's `LimitNICE=`); without, the boost is off and the start says so.
//!
//! The thread that sends a protected submission raises it too (`Arrivals::sent`): the step in
//! flight, given up for that arrival, otherwise ran to its next abort check at the threads'
//! own priority, behind the HTTP workers (the quiet request's abort wait, P99 6.3 ms in the
//! attack run of 7ae8e60, was the given-up step waiting for the core). The engine thread
//! lowers it after a protected pass or a pass that ran to its end.

use std::sync::Mutex;

/// The engine thread and the compute pool's threads, with their nice values to return to.
#[derive(Debug)]
pub(super) struct Boost {
    tids: Vec<(libc::pid_t, libc::c_int)>,
    nice: libc::c_int,
    /// Whether the threads are at `nice`. A lock, not an atomic: a raise and a lower from two
    /// threads must not interleave their system calls (left half raised, the flag would say
    /// neither). Taken once a protected submission and once a step, uncontended but for those.
    raised: Mutex<bool>,
}

fn set_nice(tid: libc::pid_t, nice: libc::c_int) -> std::io::Result<()> {
    // SAFETY: setpriority takes plain integers; a thread id of this process.
    let r = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

fn nice_of(tid: libc::pid_t) -> libc::c_int {
    // -1 is a valid nice value; what is read is only restored, so an error reads as 0.
    // SAFETY: getpriority takes plain integers.
    let n = unsafe { libc::getpriority(libc::PRIO_PROCESS, tid as libc::id_t) };
    n.clamp(-20, 19)
}

impl Boost {
    /// On the engine thread: its id and the pool's, and a try of `nice` on this thread; `None`
    /// (logged) when not permitted.
    pub(super) fn start(nice: i32) -> Option<Boost> {
        // SAFETY: gettid has no arguments.
        let me = unsafe { libc::gettid() };
        // SAFETY: as above, on each of the pool's threads.
        let pool: Vec<libc::pid_t> = rayon::broadcast(|_| unsafe { libc::gettid() });
        let tids: Vec<(libc::pid_t, libc::c_int)> =
            std::iter::once(me).chain(pool).map(|t| (t, nice_of(t))).collect();
        let b = Boost { tids, nice: nice.clamp(-20, 19), raised: Mutex::new(true) };
        if let Err(e) = set_nice(me, b.nice) {
            log::warn!(
                "--protected-nice {nice}: {e} (needs CAP_SYS_NICE, or LimitNICE= under systemd): \
                 protected steps run at the threads' own priority"
            );
            return None;
        }
        b.lower();
        log::info!(
            "protected steps run at nice {} ({} threads: the engine's and the compute pool's)",
            b.nice,
            b.tids.len()
        );
        Some(b)
    }

    fn raised(&self) -> std::sync::MutexGuard<'_, bool> {
        // The flag is only ever set after the calls: a poisoned lock holds a true value.
        self.raised.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Before a pass with a protected prefill, or when a protected request was sent while
    /// another pass may be in flight (a system call a thread, once until lowered).
    pub(super) fn raise(&self) {
        let mut raised = self.raised();
        if !*raised {
            for &(t, _) in &self.tids {
                let _ = set_nice(t, self.nice);
            }
            *raised = true;
        }
    }

    /// After it: each thread back to its own nice value.
    pub(super) fn lower(&self) {
        let mut raised = self.raised();
        if *raised {
            for &(t, base) in &self.tids {
                let _ = set_nice(t, base);
            }
            *raised = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_threads_are_raised_and_lowered_or_the_boost_is_off_without_the_right() {
        // SAFETY: gettid has no arguments.
        let me = unsafe { libc::gettid() };
        // CAP_SYS_NICE is bit 23 of the effective set (a container's root may lack it).
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let cap_eff = status.lines().find_map(|l| l.strip_prefix("CapEff:")).unwrap();
        let may = u64::from_str_radix(cap_eff.trim(), 16).unwrap() & (1 << 23) != 0;
        let before = nice_of(me);
        let Some(b) = Boost::start(-5) else {
            // Without CAP_SYS_NICE: off, and nothing changed.
            assert!(!may, "CAP_SYS_NICE allows a lower nice value: the boost should be on");
            assert_eq!(nice_of(me), before);
            return;
        };
        assert!(b.tids.len() >= 2, "the engine thread and the pool's: {:?}", b.tids);
        assert!(!*b.raised(), "start leaves the threads at their own priority");
        assert!(b.tids.iter().all(|&(t, base)| nice_of(t) == base));
        // From another thread, as the submit path does.
        std::thread::scope(|s| s.spawn(|| b.raise()).join().unwrap());
        assert!(b.tids.iter().all(|&(t, _)| nice_of(t) == -5), "{:?}", b.tids);
        b.raise();
        b.lower();
        assert!(b.tids.iter().all(|&(t, base)| nice_of(t) == base));
        assert_eq!(nice_of(me), before);
    }
}
