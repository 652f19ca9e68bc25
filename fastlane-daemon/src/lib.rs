//! What every FastLane daemon (`fastlane serve`, `kv serve`, `rdma serve`, `llm serve`,
//! `router`, the journal's daemons) does the same way, written once:
//!
//! - [`http`]: the HTTP/1.1 listener (hyper under axum) with a header-read timeout, a cap on
//!   open connections and a graceful drain; the stop future for tokio daemons.
//! - [`metrics`]: Prometheus families ([`metrics::Families`]: counters, gauges, latency
//!   histograms filled from HdrHistograms the daemon already keeps), the text rendering, and
//!   the `--metrics ADDR` endpoint of daemons that are not HTTP servers themselves.
//! - [`signals`]: SIGINT/SIGTERM (and SIGUSR1) for threaded daemons, blocked everywhere and
//!   taken by one `sigwait` thread.
//! - [`notify`]: `sd_notify` READY/STATUS/STOPPING, logged and never fatal.
//! - [`logging`]: the one logger: `RUST_LOG` filters per module, RFC 3339 timestamps, text or
//!   JSON lines (`--log-format`).
//!
//! It holds no data path and links no FastLane data-path crate, so a daemon's plumbing does not
//! pull in another daemon's code (the disk daemon does not link the LLM crates).

pub mod http;
pub mod logging;
pub mod metrics;
pub mod notify;
pub mod signals;

pub use logging::{LogArgs, LogFormat};
