//! The HTTP/1.1 listener `fastlane llm serve` and `fastlane router` share: hyper under the
//! axum router, with a header-read timeout (a client that trickles its headers is cut off),
//! a cap on open connections, a write deadline (a client that takes none of what is written
//! to it for `write_timeout` is disconnected: [`WriteDeadline`]), and a graceful drain on
//! SIGTERM/SIGINT.
//!
//! Drain: after the signal the listener closes (new connections are refused), idle
//! keep-alive connections close, and requests in flight, streams included, run to their end;
//! after `drain` the process stops waiting and the caller exits.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::time::Sleep;

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
    /// A connection whose writes make no progress for this long (the client reads nothing
    /// and its socket buffer is full) is closed; its response is dropped, which aborts the
    /// request behind it.
    pub write_timeout: Duration,
    /// `SO_SNDBUF` of each accepted socket (`None`: the kernel's autotuning, up to
    /// `net.ipv4.tcp_wmem`'s maximum, 4 MiB by default). Bounds the kernel memory a client
    /// that reads nothing can pin, and how much is queued before the write timeout runs.
    pub send_buffer: Option<usize>,
    /// Accepts wait while this is held ([`AcceptHold`]); `None`: never.
    pub accept_hold: Option<&'static AcceptHold>,
}

impl Default for HttpOptions {
    /// Headers within 10 s, 16,384 connections, 30 s of drain, 30 s of write stall.
    fn default() -> Self {
        HttpOptions {
            header_timeout: Duration::from_secs(10),
            max_connections: 16_384,
            drain: Duration::from_secs(30),
            write_timeout: Duration::from_secs(30),
            send_buffer: Some(256 << 10),
            accept_hold: None,
        }
    }
}

/// A socket whose writes fail with `TimedOut` once one has waited `timeout` without the
/// kernel taking a byte (the peer stopped reading). Reads are untouched. The timer is
/// allocated once per connection and armed only while a write waits.
#[derive(Debug)]
pub struct WriteDeadline<T> {
    io: T,
    timeout: Duration,
    sleep: Pin<Box<Sleep>>,
    armed: bool,
}

impl<T> WriteDeadline<T> {
    /// Wraps `io`.
    pub fn new(io: T, timeout: Duration) -> WriteDeadline<T> {
        WriteDeadline { io, timeout, sleep: Box::pin(tokio::time::sleep(timeout)), armed: false }
    }

    /// After a write attempt: ready disarms the timer; pending arms it (once) and fails the
    /// write when it has run out.
    fn check<R>(&mut self, cx: &mut Context<'_>, r: Poll<io::Result<R>>) -> Poll<io::Result<R>> {
        match r {
            Poll::Ready(r) => {
                self.armed = false;
                Poll::Ready(r)
            }
            Poll::Pending => {
                if !self.armed {
                    self.armed = true;
                    let at = tokio::time::Instant::now() + self.timeout;
                    self.sleep.as_mut().reset(at);
                }
                match self.sleep.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "client took nothing within the write timeout",
                    ))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for WriteDeadline<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for WriteDeadline<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write(cx, buf);
        self.check(cx, r)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.check(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.io).poll_flush(cx);
        self.check(cx, r)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// hyper's per-connection buffer, at most (its default is about 400 KB): what a client that
/// reads nothing can hold in this process besides the kernel's send buffer, and the most a
/// request's headers may take.
pub const CONNECTION_BUFFER_BYTES: usize = 64 << 10;

/// How serving ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drained {
    /// Every connection finished within the drain time.
    Clean,
    /// The drain time ran out with connections still open.
    TimedOut,
}

/// A future that resolves at SIGTERM or SIGINT (logging which). The handlers are installed
/// when this is called, not when the future is first polled: a daemon that says `READY=1`
/// after calling it drains on a SIGTERM that follows at once (otherwise the default action
/// would kill it). Call it inside the runtime.
pub fn shutdown_signal() -> impl Future<Output = ()> {
    use tokio::signal::unix::{signal, SignalKind};
    let term = signal(SignalKind::terminate());
    let int = signal(SignalKind::interrupt());
    async move {
        let (mut term, mut int) = match (term, int) {
            (Ok(t), Ok(i)) => (t, i),
            (Err(e), _) | (_, Err(e)) => {
                log::error!("cannot watch SIGTERM/SIGINT: {e}");
                return std::future::pending().await;
            }
        };
        tokio::select! {
            _ = term.recv() => log::info!("SIGTERM: no new requests; draining the ones in flight"),
            _ = int.recv() => log::info!("SIGINT: no new requests; draining the ones in flight"),
        }
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

/// Sets an `int` socket option on `fd`; a failure is logged.
pub fn set_int_option(fd: std::os::fd::RawFd, level: libc::c_int, name: libc::c_int, value: usize) {
    let v = libc::c_int::try_from(value).unwrap_or(libc::c_int::MAX);
    let len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: setsockopt reads one c_int from our stack for a socket the caller holds.
    let r = unsafe { libc::setsockopt(fd, level, name, (&v as *const libc::c_int).cast(), len) };
    if r != 0 {
        log::debug!("setsockopt {level}/{name} = {value}: {}", std::io::Error::last_os_error());
    }
}

/// `TCP_NODELAY` and `SO_SNDBUF` (the kernel doubles it for its bookkeeping) on the listener:
/// Linux copies both into every socket it accepts, which saves two system calls a
/// connection (a flood of refused connections is mostly system calls).
fn set_listener_options(listener: &TcpListener, send_buffer: Option<usize>) {
    use std::os::fd::AsRawFd;
    let fd = listener.as_raw_fd();
    set_int_option(fd, libc::IPPROTO_TCP, libc::TCP_NODELAY, 1);
    if let Some(bytes) = send_buffer {
        set_int_option(fd, libc::SOL_SOCKET, libc::SO_SNDBUF, bytes);
    }
}

/// Connections the kernel holds for [`serve`] before it accepts them (capped by
/// `net.core.somaxconn`, 4,096 by default). A full backlog drops a SYN and the client retries
/// it a second later: 1,024 (what `TcpListener::bind` asks for) was overrun by a burst of
/// 2,000 reconnecting clients here, and a quiet client behind them waited 1 s.
pub const LISTEN_BACKLOG: u32 = 4096;

/// A listener on `addr` with [`LISTEN_BACKLOG`] and `SO_REUSEADDR` (what
/// `TcpListener::bind` sets on Unix), for [`serve`].
pub fn bind(addr: std::net::SocketAddr) -> io::Result<TcpListener> {
    let sock = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    sock.set_reuseaddr(true)?;
    sock.bind(addr)?;
    sock.listen(LISTEN_BACKLOG)
}

/// A flag another thread raises to keep the listener from accepting for a while: new
/// connections wait in the kernel's backlog (the handshake is the kernel's; no CPU of this
/// process is spent on them) until it is lowered. `llm serve` raises it while a step carries
/// a protected tenant's prefill, so a flood of new connections does not share the core with
/// that step (docs/serving.md, "Measured under attack"). Each accept waits at most
/// [`ACCEPT_HOLD_MAX`], whatever the flag says: a holder that never lets go cannot stop the
/// listener.
#[derive(Debug, Default)]
pub struct AcceptHold {
    held: std::sync::atomic::AtomicBool,
    waits: std::sync::atomic::AtomicU64,
}

/// The longest one accept waits for an [`AcceptHold`].
pub const ACCEPT_HOLD_MAX: Duration = Duration::from_millis(100);

/// Lowers the [`AcceptHold`] when dropped.
#[derive(Debug)]
pub struct HoldGuard<'a>(&'a AcceptHold);

impl Drop for HoldGuard<'_> {
    fn drop(&mut self) {
        self.0.held.store(false, std::sync::atomic::Ordering::Release);
    }
}

impl AcceptHold {
    /// Holds accepts until the guard is dropped (one atomic store each way).
    pub fn hold(&self) -> HoldGuard<'_> {
        self.held.store(true, std::sync::atomic::Ordering::Release);
        HoldGuard(self)
    }

    /// Accepts that waited for a hold so far.
    pub fn waits(&self) -> u64 {
        self.waits.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Waits while held, polling each millisecond, at most [`ACCEPT_HOLD_MAX`].
    async fn wait(&self) {
        use std::sync::atomic::Ordering;
        if !self.held.load(Ordering::Acquire) {
            return;
        }
        self.waits.fetch_add(1, Ordering::Relaxed);
        let until = tokio::time::Instant::now() + ACCEPT_HOLD_MAX;
        while self.held.load(Ordering::Acquire) && tokio::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}

/// Serves `app` on `listener` until `shutdown` resolves, then drains (see the module doc).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    opts: HttpOptions,
    shutdown: impl Future<Output = ()>,
) -> Drained {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(opts.header_timeout)
        .keep_alive(true)
        .max_buf_size(CONNECTION_BUFFER_BYTES);
    set_listener_options(&listener, opts.send_buffer);
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
        // Held: this connection waits before it is served, the next ones in the backlog.
        if let Some(hold) = opts.accept_hold {
            hold.wait().await;
        }
        let svc = TowerToHyperService::new(app.clone());
        let io = TokioIo::new(WriteDeadline::new(sock, opts.write_timeout));
        let conn = builder.serve_connection(io, svc);
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

/// How many tasks a worker polls from its own queue before it looks at the runtime's shared
/// one (tokio's default: 61). A stream's tokens are woken from the engine thread, outside the
/// runtime, so they wait in the shared queue; the tasks of hostile connections are woken by
/// their sockets and fill the workers' own queues. Under 1,000 connections of each hostile
/// kind the quiet tenant's TTFT P99 was 11.0/12.2 ms at 4 against 16.4/17.5 at 61 (alternating
/// 45 s runs; with keep-alive 11.1/10.7 against 15.8/13.2): docs/serving.md, "Measured under attack".
const GLOBAL_QUEUE_INTERVAL: u32 = 4;

/// Runs an HTTP front end the way `llm serve` and `fastlane router` run: a two-worker tokio
/// runtime, the server as a task on it (accepting in `block_on` on the main thread made every
/// connection a wake-up of a worker, a context switch each on a shared core: docs/serving.md,
/// "Measured under attack"), [`bind`] with its backlog, `listening on http://ADDR` on stdout
/// (scripts read it), `READY=1` to systemd, [`serve`] until SIGTERM/SIGINT, `STOPPING=1`, drain.
/// `app` is built inside the runtime (it may spawn tasks); `what` is the log line's subject.
pub fn run(
    addr: std::net::SocketAddr,
    what: &str,
    opts: HttpOptions,
    app: impl FnOnce() -> axum::Router + Send + 'static,
) -> anyhow::Result<()> {
    use anyhow::Context;
    let fds = raise_fd_limit();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .global_queue_interval(GLOBAL_QUEUE_INTERVAL)
        .enable_all()
        .thread_name("fastlane-http")
        .build()?;
    let what = what.to_string();
    let served = rt.spawn(async move {
        let listener = bind(addr).with_context(|| format!("binding {addr}"))?;
        let local = listener.local_addr()?;
        let app = app();
        println!("listening on http://{local}");
        log::info!(
            "{what} on http://{local} (header timeout {:.1}s, {} connections at most, {fds} fds)",
            opts.header_timeout.as_secs_f64(),
            opts.max_connections
        );
        let signal = shutdown_signal();
        crate::notify::ready(&format!("serving on http://{local}"));
        let stop = async {
            signal.await;
            crate::notify::stopping("draining");
        };
        match serve(listener, app, opts, stop).await {
            Drained::Clean => log::info!("drained: every stream finished"),
            Drained::TimedOut => log::warn!(
                "drain timeout ({}s): exiting with streams still open",
                opts.drain.as_secs()
            ),
        }
        Ok::<(), anyhow::Error>(())
    });
    rt.block_on(served).context("the HTTP server task panicked")?
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;

    fn int_option(fd: std::os::fd::RawFd, level: libc::c_int, name: libc::c_int) -> libc::c_int {
        let mut v: libc::c_int = -1;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into `v`, on our stack.
        let r = unsafe {
            libc::getsockopt(fd, level, name, (&mut v as *mut libc::c_int).cast(), &mut len)
        };
        assert_eq!(r, 0, "getsockopt: {}", std::io::Error::last_os_error());
        v
    }

    #[tokio::test]
    async fn accepted_sockets_inherit_the_listeners_nodelay_and_send_buffer() {
        let listener = super::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        super::set_listener_options(&listener, Some(256 << 10));
        let addr = listener.local_addr().unwrap();
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (sock, _) = listener.accept().await.unwrap();
        let fd = sock.as_raw_fd();
        assert_eq!(int_option(fd, libc::IPPROTO_TCP, libc::TCP_NODELAY), 1);
        // The kernel doubles what was asked for its bookkeeping.
        assert_eq!(int_option(fd, libc::SOL_SOCKET, libc::SO_SNDBUF), 512 << 10);
    }

    /// The time to a 200 for `GET /` on a fresh connection to `addr` (a blocking client on
    /// a thread of its own, every read bounded).
    async fn answer_time(addr: std::net::SocketAddr) -> std::time::Duration {
        tokio::task::spawn_blocking(move || {
            use std::io::{Read, Write};
            let t0 = std::time::Instant::now();
            let mut c = std::net::TcpStream::connect(addr).unwrap();
            c.set_read_timeout(Some(std::time::Duration::from_secs(5))).unwrap();
            c.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
            let mut out = Vec::new();
            c.read_to_end(&mut out).unwrap();
            assert!(out.starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&out));
            t0.elapsed()
        })
        .await
        .unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_held_listener_accepts_when_let_go_or_after_the_bound() {
        let hold: &'static super::AcceptHold = Box::leak(Box::default());
        let listener = super::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = listener.local_addr().unwrap();
        let opts = super::HttpOptions { accept_hold: Some(hold), ..Default::default() };
        let app = axum::Router::new().route("/", axum::routing::get(|| async { "ok" }));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(super::serve(listener, app, opts, async {
            let _ = stopped.await;
        }));
        // Not held: answered at once, nothing waited.
        assert!(answer_time(addr).await < super::ACCEPT_HOLD_MAX);
        assert_eq!(hold.waits(), 0);
        // Held and never let go: the connection waits in the backlog for the bound, no more.
        let guard = hold.hold();
        let t = answer_time(addr).await;
        assert!(t >= super::ACCEPT_HOLD_MAX, "answered after {t:?} while held");
        assert!(t < super::ACCEPT_HOLD_MAX * 10, "answered after {t:?}");
        // Held, then let go after 30 ms: accepted then, well before the bound.
        let waiting = tokio::spawn(answer_time(addr));
        tokio::time::sleep(std::time::Duration::from_millis(30)).await;
        drop(guard);
        let t = waiting.await.unwrap();
        assert!(t >= std::time::Duration::from_millis(25), "answered after {t:?} while held");
        assert!(t < super::ACCEPT_HOLD_MAX, "answered after {t:?}, after it was let go at 30 ms");
        assert!(hold.waits() >= 2, "{} accepts waited", hold.waits());
        let _ = stop.send(());
        server.await.unwrap();
    }
}
