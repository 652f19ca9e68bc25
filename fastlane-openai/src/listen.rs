//! The listener flags of the HTTP front ends (`llm serve`, `fastlane router`): limits and
//! timeouts checked at start with errors that name the flag, then the toolkit's runner.

use std::time::Duration;

use anyhow::{bail, Result};
use clap::Args;

/// Listener flags shared by `llm serve` and `router`.
#[derive(Debug, Args, Clone)]
pub struct HttpArgs {
    /// After SIGTERM or SIGINT: stop accepting, let open streams finish for at most this
    /// many seconds, then exit 0.
    #[arg(long, default_value_t = 30)]
    pub drain_seconds: u64,
    /// A client must send a request's headers within this many seconds (slow-header clients
    /// are cut off).
    #[arg(long, default_value_t = 10.0)]
    pub header_timeout_seconds: f64,
    /// Open connections at most (beyond, new ones wait in the accept backlog).
    #[arg(long, default_value_t = 16_384)]
    pub max_connections: usize,
    /// Request bodies over this size are refused with 413 (K/M suffixes); a Content-Length
    /// over it is refused before any byte of the body is read.
    #[arg(long, default_value = "1M", value_name = "SIZE")]
    pub max_body_bytes: String,
    /// A request's body must arrive within this many seconds, else 408 (a client that
    /// trickles its body is cut off). The API key is checked before the body is read.
    #[arg(long, default_value_t = crate::api::BODY_TIMEOUT_SECONDS)]
    pub body_timeout_seconds: f64,
    /// A client that takes none of the bytes written to it for this many seconds (its
    /// socket buffer full) is disconnected, and its request aborted in the engine.
    #[arg(long, default_value_t = 30.0)]
    pub client_write_timeout_seconds: f64,
    /// Send buffer of each client connection (SO_SNDBUF; K/M suffixes; 0: the kernel's
    /// autotuning, up to 4 MiB a connection). Bounds the kernel memory a client that reads
    /// nothing pins; streams need little.
    #[arg(long, default_value = "256K", value_name = "SIZE")]
    pub send_buffer_bytes: String,
}

use crate::api::SECONDS_MAX;

/// `value` seconds as a duration, or an error naming `flag` and the limits.
pub fn seconds(flag: &str, value: f64) -> Result<Duration> {
    if !(value.is_finite() && value > 0.0 && value <= SECONDS_MAX) {
        bail!("{flag} {value}: more than 0 and at most {SECONDS_MAX} (a week)");
    }
    Ok(Duration::from_secs_f64(value))
}

impl HttpArgs {
    /// The listener options.
    pub fn options(&self) -> Result<fastlane_daemon::http::HttpOptions> {
        if self.drain_seconds as f64 > SECONDS_MAX {
            bail!("--drain-seconds {}: at most {SECONDS_MAX} (a week)", self.drain_seconds);
        }
        if self.max_connections == 0 {
            bail!("--max-connections must be at least 1");
        }
        Ok(fastlane_daemon::http::HttpOptions {
            header_timeout: seconds("--header-timeout-seconds", self.header_timeout_seconds)?,
            max_connections: self.max_connections,
            drain: Duration::from_secs(self.drain_seconds),
            write_timeout: seconds(
                "--client-write-timeout-seconds",
                self.client_write_timeout_seconds,
            )?,
            send_buffer: match fastlane_util::parse_size(&self.send_buffer_bytes)
                .map_err(|e| anyhow::anyhow!("--send-buffer-bytes: {e}"))?
            {
                0 => None,
                n if !(4096..=64 << 20).contains(&n) => {
                    bail!("--send-buffer-bytes {}: 0, or 4K to 64M", self.send_buffer_bytes)
                }
                n => Some(n as usize),
            },
            accept_hold: None,
        })
    }

    /// Request bodies' limits (`--max-body-bytes`, `--body-timeout-seconds`).
    pub fn body_limits(&self) -> Result<crate::api::BodyLimits> {
        let bytes = fastlane_util::parse_size(&self.max_body_bytes)
            .map_err(|e| anyhow::anyhow!("--max-body-bytes: {e}"))?;
        if !(1..=1 << 30).contains(&bytes) {
            bail!("--max-body-bytes {}: 1 byte to 1G", self.max_body_bytes);
        }
        Ok(crate::api::BodyLimits {
            max_bytes: bytes as usize,
            timeout: seconds("--body-timeout-seconds", self.body_timeout_seconds)?,
        })
    }

    /// Serves `app` on `addr` until SIGTERM/SIGINT, then drains
    /// ([`fastlane_daemon::http::run`]: prints `listening on http://ADDR`, tells systemd).
    pub fn run(&self, addr: std::net::SocketAddr, app: crate::Router, what: &str) -> Result<()> {
        self.run_with(addr, what, move || app)
    }

    /// [`HttpArgs::run`] with the app built inside the runtime (it may spawn tasks).
    pub fn run_with(
        &self,
        addr: std::net::SocketAddr,
        what: &str,
        app: impl FnOnce() -> crate::Router + Send + 'static,
    ) -> Result<()> {
        fastlane_daemon::http::run(addr, what, self.options()?, app)
    }
}
