//! `sd_notify(3)`: readiness and status to systemd when it started us with `NOTIFY_SOCKET`
//! (`Type=notify` units); nothing when it did not.

pub use sd_notify::{listen_fds, NotifyState};

/// Sends `state` to `$NOTIFY_SOCKET`; a failure is logged, never fatal (the daemon serves
/// whether or not its supervisor hears).
pub fn notify(state: &[NotifyState<'_>]) {
    if let Err(e) = sd_notify::notify(state) {
        log::warn!("sd_notify to $NOTIFY_SOCKET failed: {e}");
    }
}

/// `READY=1` with a `STATUS=` line.
pub fn ready(status: &str) {
    notify(&[NotifyState::Ready, NotifyState::Status(status)]);
}

/// `STOPPING=1` with a `STATUS=` line.
pub fn stopping(status: &str) {
    notify(&[NotifyState::Stopping, NotifyState::Status(status)]);
}
