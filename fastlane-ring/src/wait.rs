//! Waiting for the other side of a ring: spin, then yield, then park on a futex.
//!
//! The `try_*` operations of the rings never come here and never make a syscall. The blocking
//! variants call [`ParkFlag::wait_until`] with a condition ("there is room", "there is data").
//! A sleeper announces itself in a [`ParkFlag`] word before it sleeps, and the other side calls
//! [`ParkFlag::notify`] after every publish; `notify` costs one fence and one relaxed load when
//! nobody sleeps, and a `futex(FUTEX_WAKE)` only when somebody does.
//!
//! # The handshake
//!
//! ```text
//!   waiter                              notifier
//!   flag.store(1)                       cursor.store(new, Release)     (publish)
//!   fence(SeqCst)  ───── pairs with ─── fence(SeqCst)
//!   if ready() { return }               if flag.load() == 1 {
//!   futex_wait(flag, 1)                     flag.store(0); futex_wake(flag)
//!                                       }
//! ```
//!
//! The two `SeqCst` fences order each side's store before its load, so at least one of them
//! sees the other's store: either the waiter sees the new cursor and does not sleep, or the
//! notifier sees the flag and wakes it. `futex_wait` only sleeps while the word still holds 1,
//! so a wake that lands between the waiter's check and its sleep is not lost.
//!
//! For the shared-memory ring the flag lives in the mapping and the futex is a shared
//! (non-private) one, so the two sides may be different processes. A hostile peer can write
//! anything into the flag; the worst it can cause is a spurious wake-up or a sleep that ends at
//! the caller's timeout, never undefined behaviour.

use std::time::{Duration, Instant};

use crate::sync::{fence, spin_loop, yield_now, AtomicU32, Ordering};

/// How a blocking ring operation waits for the other side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitStrategy {
    /// Spin forever (lowest latency, burns a core). Still honours deadlines.
    BusySpin,
    /// Spin `spins` times, then `sched_yield` in a loop. Never sleeps in the kernel.
    SpinYield {
        /// Busy-wait iterations before the first yield.
        spins: u32,
    },
    /// Spin `spins` times, yield `yields` times, then sleep on a futex until notified.
    SpinYieldPark {
        /// Busy-wait iterations before the first yield.
        spins: u32,
        /// `sched_yield` calls before parking.
        yields: u32,
    },
}

impl Default for WaitStrategy {
    /// A short spin (a few microseconds), then up to 64 `sched_yield`s, then sleep. Yielding
    /// early matters when the two sides share a core or the machine is loaded: a long spin
    /// steals the time the other side needs to make progress (on a loaded 2-core machine, 4096
    /// spins made a 10M-item blocking transfer 25× slower than 64). Latency-critical pairs
    /// pinned to their own cores should choose [`WaitStrategy::BusySpin`].
    fn default() -> Self {
        WaitStrategy::SpinYieldPark { spins: 128, yields: 64 }
    }
}

/// Whether the futex word is shared with other processes.
// Loom builds leave out the shared-memory ring, the only user of `Shared`.
#[cfg_attr(loom, allow(dead_code))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scope {
    /// Both sides are threads of this process (`FUTEX_PRIVATE_FLAG`, cheaper).
    Private,
    /// The word lives in a shared mapping and the other side may be another process.
    Shared,
}

/// A word a waiter announces itself in before it sleeps (0: nobody sleeps, 1: a waiter may).
#[cfg_attr(not(loom), repr(transparent))]
#[derive(Debug, Default)]
pub(crate) struct ParkFlag {
    word: AtomicU32,
    #[cfg(loom)]
    emu: loom_futex::Futex,
}

impl ParkFlag {
    /// A flag with nobody waiting.
    #[cfg(not(loom))]
    pub(crate) const fn new() -> Self {
        ParkFlag { word: AtomicU32::new(0) }
    }

    /// A flag with nobody waiting.
    #[cfg(loom)]
    pub(crate) fn new() -> Self {
        ParkFlag { word: AtomicU32::new(0), emu: loom_futex::Futex::default() }
    }

    /// The raw word (for the shared-memory header, which places it at a fixed offset).
    #[cfg(not(loom))]
    pub(crate) fn from_word(word: &AtomicU32) -> &ParkFlag {
        // SAFETY:
        // - `ParkFlag` is `repr(transparent)` over `AtomicU32` outside loom, so the layouts match.
        // - The returned reference borrows `word`, so it cannot outlive it.
        unsafe { &*(word as *const AtomicU32).cast::<ParkFlag>() }
    }

    /// Wait until `ready()` returns true or `deadline` passes. Returns the last value of
    /// `ready()`. `ready` must be cheap and free of side effects beyond its loads; it is called
    /// many times.
    pub(crate) fn wait_until(
        &self,
        scope: Scope,
        strategy: WaitStrategy,
        deadline: Option<Instant>,
        mut ready: impl FnMut() -> bool,
    ) -> bool {
        let (spins, yields, park) = match strategy {
            WaitStrategy::BusySpin => (u32::MAX, 0, false),
            WaitStrategy::SpinYield { spins } => (spins, u32::MAX, false),
            WaitStrategy::SpinYieldPark { spins, yields } => (spins, yields, true),
        };
        let mut i: u32 = 0;
        loop {
            if ready() {
                return true;
            }
            // Deadlines are read every 256 iterations: `Instant::now` is a vDSO call, but under
            // TCG guests it costs about a microsecond.
            if i % 256 == 255 && deadline.is_some_and(|d| Instant::now() >= d) {
                return ready();
            }
            if i < spins {
                spin_loop();
            } else if !park || i - spins < yields {
                yield_now();
            } else {
                break;
            }
            i = i.saturating_add(1);
        }
        loop {
            self.word.store(1, Ordering::Relaxed);
            // Pairs with the fence in `notify`, between the notifier's publish and its load of
            // this flag (see the module docs).
            fence(Ordering::SeqCst);
            if ready() {
                self.word.store(0, Ordering::Relaxed);
                return true;
            }
            let timeout = match deadline {
                None => None,
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(left) if !left.is_zero() => Some(left),
                    _ => {
                        self.word.store(0, Ordering::Relaxed);
                        return ready();
                    }
                },
            };
            self.futex_wait(scope, 1, timeout);
        }
    }

    /// Wake the waiter, if there is one. Call after the store that publishes progress.
    #[inline]
    pub(crate) fn notify(&self, scope: Scope) {
        // Pairs with the fence in `wait_until`, between the waiter's store of the flag and its
        // check of the condition.
        fence(Ordering::SeqCst);
        if self.word.load(Ordering::Relaxed) != 0 {
            self.word.store(0, Ordering::Relaxed);
            self.futex_wake(scope);
        }
    }

    #[cfg(not(loom))]
    fn futex_wait(&self, scope: Scope, expected: u32, timeout: Option<Duration>) {
        let ts = timeout.map(|t| libc::timespec {
            tv_sec: t.as_secs().min(i64::MAX as u64) as libc::time_t,
            tv_nsec: t.subsec_nanos() as libc::c_long,
        });
        let ts_ptr = ts.as_ref().map_or(std::ptr::null(), |t| t as *const libc::timespec);
        let op = match scope {
            Scope::Private => libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            Scope::Shared => libc::FUTEX_WAIT,
        };
        // SAFETY:
        // - `self.word` is a live, aligned 4-byte atomic for the whole call (we hold `&self`).
        // - `ts_ptr` is null or points at `ts`, which lives until the call returns.
        // - FUTEX_WAIT only reads the word; EINTR, EAGAIN and ETIMEDOUT are all fine here since
        //   the caller re-checks its condition in a loop.
        unsafe {
            libc::syscall(libc::SYS_futex, self.word.as_ptr(), op, expected, ts_ptr);
        }
    }

    #[cfg(not(loom))]
    fn futex_wake(&self, scope: Scope) {
        let op = match scope {
            Scope::Private => libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
            Scope::Shared => libc::FUTEX_WAKE,
        };
        // SAFETY: `self.word` is a live, aligned atomic; FUTEX_WAKE does not access memory
        // through the pointer beyond using its address as a key.
        unsafe {
            libc::syscall(libc::SYS_futex, self.word.as_ptr(), op, i32::MAX);
        }
    }

    #[cfg(loom)]
    fn futex_wait(&self, _scope: Scope, expected: u32, _timeout: Option<Duration>) {
        self.emu.wait(&self.word, expected);
    }

    #[cfg(loom)]
    fn futex_wake(&self, _scope: Scope) {
        self.emu.wake();
    }
}

/// A futex for loom models: a mutex and a condition variable that check the word under the
/// lock, which is what the kernel does under its hash-bucket lock. Loom then reports a lost
/// wake-up as a deadlock.
#[cfg(loom)]
mod loom_futex {
    use loom::sync::{Condvar, Mutex};

    use crate::sync::{AtomicU32, Ordering};

    #[derive(Debug, Default)]
    pub(crate) struct Futex {
        lock: Mutex<()>,
        cond: Condvar,
    }

    impl Futex {
        pub(crate) fn wait(&self, word: &AtomicU32, expected: u32) {
            let guard = self.lock.lock().unwrap();
            if word.load(Ordering::SeqCst) == expected {
                drop(self.cond.wait(guard).unwrap());
            }
        }

        pub(crate) fn wake(&self) {
            let _guard = self.lock.lock().unwrap();
            self.cond.notify_all();
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    #[test]
    fn parked_waiter_is_woken_by_notify() {
        let flag = Arc::new(ParkFlag::new());
        let ready = Arc::new(AtomicBool::new(false));
        let (f2, r2) = (flag.clone(), ready.clone());
        let strategy = WaitStrategy::SpinYieldPark { spins: 0, yields: 0 };
        let t = std::thread::spawn(move || {
            f2.wait_until(Scope::Private, strategy, None, || r2.load(Ordering::Acquire))
        });
        std::thread::sleep(Duration::from_millis(50));
        ready.store(true, Ordering::Release);
        flag.notify(Scope::Private);
        assert!(t.join().unwrap());
    }

    #[test]
    fn deadline_ends_the_wait() {
        let flag = ParkFlag::new();
        let start = Instant::now();
        let deadline = Some(start + Duration::from_millis(30));
        for strategy in
            [WaitStrategy::default(), WaitStrategy::BusySpin, WaitStrategy::SpinYield { spins: 10 }]
        {
            assert!(!flag.wait_until(Scope::Private, strategy, deadline, || false));
        }
        assert!(start.elapsed() >= Duration::from_millis(30));
        assert!(start.elapsed() < Duration::from_secs(5));
    }
}
