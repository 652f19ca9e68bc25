//! The HTTP/1.1 listener `fastlane llm serve` and `fastlane router` share: hyper under the
//! axum router, with a header-read timeout (a client that trickles its headers is cut off),
//! a cap on open connections, and a graceful drain on SIGTERM/SIGINT.
//!
//! Drain: after the signal the listener closes (new connections are refused), idle
//! keep-alive connections close, and requests in flight, streams included, run to their end;
//! after `drain` the process stops waiting and the caller exits.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// Listener settings.
#[derive(Debug, Clone, Copy)]
pub struct HttpOptions {
    /// A client must send a request's whole header within this (hyper's
    /// `header_read_timeout`, also between requests on a kept-alive connection).
    pub header_timeout: Duration,
    /// Open connections at most; beyond, new ones wait in the kernel's accept backlog.
    pub max_connections: usize,
    /// After the shutdown signal, how long requests in flight may run on.
    pub drain: Duration,
}

impl Default for HttpOptions {
    /// Headers within 10 s, 16,384 connections, 30 s of drain.
    fn default() -> Self {
        HttpOptions {
            header_timeout: Duration::from_secs(10),
            max_connections: 16_384,
            drain: Duration::from_secs(30),
        }
    }
}

/// How serving ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drained {
    /// Every connection finished within the drain time.
    Clean,
    /// The drain time ran out with connections still open.
    TimedOut,
}

/// Resolves at SIGTERM or SIGINT (logging which).
pub async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            log::error!("cannot watch SIGTERM: {e}");
            return std::future::pending().await;
        }
    };
    tokio::select! {
        _ = term.recv() => log::info!("SIGTERM: no new requests; draining the ones in flight"),
        _ = tokio::signal::ctrl_c() => log::info!("SIGINT: no new requests; draining the ones in flight"),
    }
}

/// Raises this process's open-file soft limit to its hard limit (a server holding thousands
/// of streams needs more than the usual 1,024). Returns the limit now in force.
pub fn raise_fd_limit() -> u64 {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the one struct we pass, which lives on our stack.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
        return 1024;
    }
    if r.rlim_cur < r.rlim_max {
        let want = libc::rlimit { rlim_cur: r.rlim_max, rlim_max: r.rlim_max };
        // SAFETY: setrlimit reads the one struct we pass, which lives on our stack.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &want) } == 0 {
            r = want;
        }
    }
    r.rlim_cur
}

/// Serves `app` on `listener` until `shutdown` resolves, then drains (see the module doc).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    opts: HttpOptions,
    shutdown: impl Future<Output = ()>,
) -> Drained {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.timer(TokioTimer::new()).header_read_timeout(opts.header_timeout).keep_alive(true);
    let graceful = GracefulShutdown::new();
    let slots = Arc::new(Semaphore::new(opts.max_connections.max(1)));
    tokio::pin!(shutdown);
    // Bounded by the shutdown signal; each turn accepts one connection.
    loop {
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
            _ = &mut shutdown => break,
        };
        let (sock, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // EMFILE and friends: wait a little rather than spin.
                    log::warn!("accept: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let _ = sock.set_nodelay(true);
        let svc = TowerToHyperService::new(app.clone());
        let conn = builder.serve_connection(TokioIo::new(sock), svc);
        let fut = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = fut.await {
                log::debug!("connection from {peer}: {e}");
            }
            drop(permit);
        });
    }
    drop(listener);
    tokio::select! {
        _ = graceful.shutdown() => Drained::Clean,
        _ = tokio::time::sleep(opts.drain) => Drained::TimedOut,
    }
}
