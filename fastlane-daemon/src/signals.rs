//! How every `fastlane` daemon (`serve`, `kv serve`, `rdma serve`) stops on SIGINT/SIGTERM
//! (and how `serve` answers SIGUSR1 with its totals):
//! the signals are blocked before the daemon starts any thread, so every thread inherits the
//! mask, and one thread takes them with `sigwait` and runs the daemon's stop action.
//!
//! Not `signal-hook`: its handlers run on whichever thread has the signal unblocked, and a
//! signal taken by a queue worker or a swap-engine thread interrupts its `io_uring_enter` or
//! `epoll_wait` with EINTR (SA_RESTART does not restart those). Blocking the signals everywhere
//! but in one `sigwait` thread keeps the data-path threads free of that, and needs no handler
//! (so nothing has to be async-signal-safe).

use anyhow::Context as _;

/// SIGINT and SIGTERM (and SIGUSR1 with [`StopSignals::block_with_report`]), blocked in the
/// thread that made this and in every thread it starts afterwards; [`StopSignals::on_stop`]
/// hands them to a thread of their own.
#[derive(Debug)]
pub struct StopSignals {
    set: libc::sigset_t,
}

impl StopSignals {
    /// Blocks SIGINT and SIGTERM in the calling thread. Call it first thing, before the daemon
    /// starts any thread (threads inherit the mask from their creator).
    pub fn block() -> anyhow::Result<StopSignals> {
        Self::block_signals(false)
    }

    /// [`StopSignals::block`], and SIGUSR1 too, for [`StopSignals::on_stop_or_report`].
    pub fn block_with_report() -> anyhow::Result<StopSignals> {
        Self::block_signals(true)
    }

    fn block_signals(report: bool) -> anyhow::Result<StopSignals> {
        // SAFETY:
        // - `set` is a plain C struct that sigemptyset fully initializes before any other use.
        let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY:
        // - `set` is a valid, writable sigset_t on our stack; the call only writes into it.
        unsafe { libc::sigemptyset(&mut set) };
        // SAFETY:
        // - as above; SIGINT is a valid signal number.
        unsafe { libc::sigaddset(&mut set, libc::SIGINT) };
        // SAFETY:
        // - as above; SIGTERM is a valid signal number.
        unsafe { libc::sigaddset(&mut set, libc::SIGTERM) };
        if report {
            // SAFETY:
            // - as above; SIGUSR1 is a valid signal number.
            unsafe { libc::sigaddset(&mut set, libc::SIGUSR1) };
        }
        // SAFETY:
        // - `set` is initialized; a null old-set pointer is allowed and means "don't report".
        let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
        if rc != 0 {
            return Err(std::io::Error::from_raw_os_error(rc))
                .context("cannot block SIGINT/SIGTERM");
        }
        Ok(StopSignals { set })
    }

    /// Starts the thread that waits for SIGINT or SIGTERM (one that arrived since
    /// [`StopSignals::block`] is taken at once) and then runs `stop`, once.
    pub fn on_stop(self, stop: impl FnOnce() + Send + 'static) -> anyhow::Result<()> {
        self.on_stop_or_report(stop, || {})
    }

    /// [`StopSignals::on_stop`] that sets `flag` (with `Release`): for a daemon whose main
    /// loop polls a stop flag.
    pub fn on_stop_set(
        self,
        flag: &std::sync::Arc<std::sync::atomic::AtomicBool>,
    ) -> anyhow::Result<()> {
        let flag = std::sync::Arc::clone(flag);
        self.on_stop(move || flag.store(true, std::sync::atomic::Ordering::Release))
    }

    /// [`StopSignals::on_stop`], and `report` on every SIGUSR1 (blocked only by
    /// [`StopSignals::block_with_report`]).
    pub fn on_stop_or_report(
        self,
        stop: impl FnOnce() + Send + 'static,
        report: impl Fn() + Send + 'static,
    ) -> anyhow::Result<()> {
        let set = self.set;
        std::thread::Builder::new()
            .name("fastlane-signals".into())
            .spawn(move || loop {
                let mut sig: libc::c_int = 0;
                // SAFETY:
                // - `set` is an initialized sigset_t owned by this closure; `sig` is a valid
                //   out-parameter on our stack.
                let rc = unsafe { libc::sigwait(&set, &mut sig) };
                if rc == 0 && sig == libc::SIGUSR1 {
                    report();
                    continue;
                }
                if rc == 0 && (sig == libc::SIGINT || sig == libc::SIGTERM) {
                    log::info!("signal {sig}: shutting down");
                    stop();
                    return;
                }
            })
            .context("cannot spawn the signal thread")?;
        Ok(())
    }
}
