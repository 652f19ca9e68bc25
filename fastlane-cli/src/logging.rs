//! The log format chosen on the command line (`--log-format text|json`, global), for the
//! commands that log. `main` calls [`init`] before `serve` runs (`fastlane-disk`'s own binary
//! does the same); `kv serve`, `rdma serve`, `journal`, `llm` and `router` call it at the start
//! of their `run`; the logger itself
//! is `fastlane_daemon::logging` (`RUST_LOG` per-module filters, RFC 3339 timestamps).

use std::sync::OnceLock;

use fastlane_daemon::LogFormat;

static FORMAT: OnceLock<LogFormat> = OnceLock::new();

/// Remembers the format `main` parsed; the first call wins.
pub(crate) fn set_format(format: LogFormat) {
    let _ = FORMAT.set(format);
}

/// Installs the logger in the chosen format; a second call does nothing.
pub(crate) fn init() {
    fastlane_daemon::logging::init(FORMAT.get().copied().unwrap_or_default());
}
