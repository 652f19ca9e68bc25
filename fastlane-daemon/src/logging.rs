//! The one logger of every `fastlane` command and daemon: `log` records from every crate (and
//! `tracing` events) go to stderr through `tracing-subscriber`.
//!
//! - `RUST_LOG` takes the `tracing-subscriber` filter syntax: a level (`debug`), or per-module
//!   directives (`info,fastlane_vhost_blk=debug,hyper=warn`). Unset: `info`. A filter that
//!   does not parse is reported on stderr and `info` is used.
//! - Text lines: `2026-12-04T20:37:01.123456Z  INFO fastlane_vhost_blk::worker: message` (RFC
//!   3339 UTC timestamp, level, module path).
//! - JSON lines (`--log-format json`): one object per record with `timestamp`, `level`,
//!   `target` and `fields.message`, for log shippers.
//!
//! The first [`init`] wins; later calls do nothing (tests and nested commands may call it).

use std::str::FromStr;

use tracing_subscriber::EnvFilter;

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// One human-readable line per record.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// The logging flag every daemon takes (`#[command(flatten)]` it into the daemon's CLI).
#[derive(Debug, Clone, clap::Args)]
pub struct LogArgs {
    /// Log lines as `text` (RFC 3339 timestamp, level, module, message) or `json` (one object
    /// per line). `RUST_LOG` filters: a level, or per module (`info,fastlane_vhost_blk=debug`).
    #[arg(long, global = true, default_value = "text")]
    pub log_format: LogFormat,
}

impl FromStr for LogFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<LogFormat, String> {
        match s {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            other => Err(format!("unknown log format {other:?} (text or json)")),
        }
    }
}

impl std::fmt::Display for LogFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        })
    }
}

/// The filter from `RUST_LOG`, `info` when it is unset or does not parse (said on stderr).
fn filter() -> EnvFilter {
    match std::env::var("RUST_LOG") {
        Ok(spec) if !spec.trim().is_empty() => match EnvFilter::try_new(&spec) {
            Ok(f) => f,
            Err(e) => {
                eprintln!("RUST_LOG={spec:?} does not parse ({e}); logging at info");
                EnvFilter::new("info")
            }
        },
        _ => EnvFilter::new("info"),
    }
}

/// Installs the logger writing `format` lines to stderr. Returns false when a logger was
/// already installed (this call changed nothing).
pub fn init(format: LogFormat) -> bool {
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter())
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_target(true);
    let installed = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(false).try_init(),
    };
    installed.is_ok()
}
