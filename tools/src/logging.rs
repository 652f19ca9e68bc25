//! The one logging setup of the `fastlane` commands: `log` records from every FastLane crate go
//! to stderr with a wall-clock timestamp and the time since start, filtered by `RUST_LOG`
//! (`trace`, `debug`, `info` (the default), `warn`, `error`, `off`).
//!
//! `serve`, `kv`, `rdma`, `journal` and `llm` install it at the start of their `run`.

use std::time::Instant;

/// A minimal stderr logger with wall-clock timestamps; `RUST_LOG=debug|info|warn|error`.
struct StderrLogger {
    level: log::LevelFilter,
    start: Instant,
}

impl log::Log for StderrLogger {
    fn enabled(&self, meta: &log::Metadata<'_>) -> bool {
        meta.level() <= self.level
    }

    fn log(&self, record: &log::Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let now =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        eprintln!(
            "[{}.{:06} +{:.3}s {:5} {}] {}",
            now.as_secs(),
            now.subsec_micros(),
            self.start.elapsed().as_secs_f64(),
            record.level(),
            record.target(),
            record.args()
        );
    }

    fn flush(&self) {}
}

/// Installs the stderr logger (`RUST_LOG` sets the level). Every daemon and command that
/// logs calls it first thing in its `run`; a second call does nothing.
pub(crate) fn init() {
    let level = match std::env::var("RUST_LOG").ok().as_deref() {
        Some("trace") => log::LevelFilter::Trace,
        Some("debug") => log::LevelFilter::Debug,
        Some("warn") => log::LevelFilter::Warn,
        Some("error") => log::LevelFilter::Error,
        Some("off") => log::LevelFilter::Off,
        _ => log::LevelFilter::Info,
    };
    let logger = Box::leak(Box::new(StderrLogger { level, start: Instant::now() }));
    if log::set_logger(logger).is_ok() {
        log::set_max_level(level);
    }
}
