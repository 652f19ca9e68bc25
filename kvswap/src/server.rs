//! `fastlane kv serve`: the engine behind a Unix socket, for an external inference server.
//!
//! One thread per connection (at most [`CONNECTIONS_MAX`]); the engine sits behind a mutex
//! held only for one engine call at a time (a `COMPLETE` waits in 1 ms slices). Sequence ids
//! are namespaced per connection (engine id = connection id << 32 | client id), and so are
//! tickets; a connection's sequences are dropped when it closes. A frame that does not parse
//! closes that connection only.
// Serves peers: a panic here is a client taking the server down; errors instead.
#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

use std::collections::HashSet;
use std::io::{Read, Write};
use std::os::fd::RawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use crate::engine::{SeqPhase, SwapEngine};
use crate::error::KvSwapError;
use crate::proto::{self, ErrorCode, Header, ProtoError, Request, HEADER_LEN, PAYLOAD_MAX};
use crate::{BlockId, SeqId, Ticket, TierKind};

/// Most concurrent connections.
pub const CONNECTIONS_MAX: usize = 64;
/// Longest `COMPLETE` wait the server grants.
pub const COMPLETE_WAIT_MAX: Duration = Duration::from_secs(60);

/// Counters of a running server.
#[derive(Debug, Default)]
pub struct ServerCounters {
    /// Connections accepted.
    pub accepted: AtomicU64,
    /// Connections closed for a malformed frame.
    pub protocol_errors: AtomicU64,
    /// Requests served.
    pub requests: AtomicU64,
}

/// The server.
#[derive(Debug)]
pub struct Server {
    listener: UnixListener,
    engine: Arc<Mutex<SwapEngine>>,
    pool_fd: RawFd,
    pool_len: u64,
    live: Arc<AtomicUsize>,
    counters: Arc<ServerCounters>,
}

impl Server {
    /// Binds `path` (an existing socket file is replaced). `pool_fd`/`pool_len`: the memfd of
    /// the engine's device memory, sent to every client in the `HELLO` reply; it must stay
    /// open as long as the server.
    pub fn bind(
        path: &Path,
        engine: SwapEngine,
        pool_fd: RawFd,
        pool_len: u64,
    ) -> Result<Server, KvSwapError> {
        let _ = std::fs::remove_file(path);
        let listener =
            UnixListener::bind(path).map_err(|e| KvSwapError::setup("bind socket", e))?;
        listener.set_nonblocking(true).map_err(|e| KvSwapError::setup("nonblocking", e))?;
        Ok(Server {
            listener,
            engine: Arc::new(Mutex::new(engine)),
            pool_fd,
            pool_len,
            live: Arc::new(AtomicUsize::new(0)),
            counters: Arc::new(ServerCounters::default()),
        })
    }

    /// The counters.
    pub fn counters(&self) -> Arc<ServerCounters> {
        self.counters.clone()
    }

    /// The engine (for stats while serving).
    pub fn engine(&self) -> Arc<Mutex<SwapEngine>> {
        self.engine.clone()
    }

    /// Accepts and serves until `stop` is set (checked every 20 ms).
    pub fn serve(&self, stop: &AtomicBool) -> Result<(), KvSwapError> {
        let mut next_conn = 1u64;
        let mut threads = Vec::new();
        let stop_all = Arc::new(AtomicBool::new(false));
        while !stop.load(Ordering::Relaxed) {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    if self.live.load(Ordering::Relaxed) >= CONNECTIONS_MAX {
                        log::warn!("kv serve: connection refused, {CONNECTIONS_MAX} already open");
                        continue;
                    }
                    self.counters.accepted.fetch_add(1, Ordering::Relaxed);
                    self.live.fetch_add(1, Ordering::Relaxed);
                    let conn = Conn {
                        id: next_conn,
                        stream,
                        engine: self.engine.clone(),
                        pool_fd: self.pool_fd,
                        pool_len: self.pool_len,
                        tickets: HashSet::new(),
                        seqs: HashSet::new(),
                        counters: self.counters.clone(),
                        stop: stop_all.clone(),
                    };
                    next_conn += 1;
                    let live = self.live.clone();
                    threads.push(std::thread::spawn(move || {
                        conn.run();
                        live.fetch_sub(1, Ordering::Relaxed);
                    }));
                    threads.retain(|t| !t.is_finished());
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(KvSwapError::setup("accept", e)),
            }
        }
        stop_all.store(true, Ordering::Relaxed);
        for t in threads {
            let _ = t.join();
        }
        Ok(())
    }
}

struct Conn {
    id: u64,
    stream: UnixStream,
    engine: Arc<Mutex<SwapEngine>>,
    pool_fd: RawFd,
    pool_len: u64,
    tickets: HashSet<u64>,
    seqs: HashSet<u32>,
    counters: Arc<ServerCounters>,
    stop: Arc<AtomicBool>,
}

enum ReadErr {
    Closed,
    Proto(ProtoError),
}

impl Conn {
    fn run(mut self) {
        let _ = self.stream.set_read_timeout(Some(Duration::from_millis(100)));
        let mut buf = vec![0u8; HEADER_LEN + PAYLOAD_MAX];
        loop {
            match self.read_frame(&mut buf) {
                Ok((h, req)) => {
                    self.counters.requests.fetch_add(1, Ordering::Relaxed);
                    if self.handle(h, req).is_err() {
                        break;
                    }
                }
                Err(ReadErr::Closed) => break,
                Err(ReadErr::Proto(e)) => {
                    log::warn!(
                        "kv serve: connection {} sent a bad frame ({e}); closing it",
                        self.id
                    );
                    self.counters.protocol_errors.fetch_add(1, Ordering::Relaxed);
                    break;
                }
            }
        }
        let mut e = self.engine();
        for s in &self.seqs {
            let _ = e.drop_seq(self.seq(*s));
        }
        for t in &self.tickets {
            let _ = e.wait(Ticket(*t), Duration::ZERO);
        }
    }

    /// The shared engine, locked.
    ///
    /// The lock is poisoned only when another connection's thread panicked while it held it,
    /// i.e. inside a `SwapEngine` call: an assertion of ours failed, never a peer's input
    /// (requests are validated before they reach the engine). Going on with an engine left
    /// half-updated could hand one sequence's blocks to another, so this thread stops too.
    #[allow(clippy::expect_used)]
    fn engine(&self) -> MutexGuard<'_, SwapEngine> {
        self.engine.lock().expect("kv serve: engine lock poisoned by a panic in the engine")
    }

    fn read_exact(&mut self, out: &mut [u8]) -> Result<(), ReadErr> {
        let mut got = 0;
        while got < out.len() {
            if self.stop.load(Ordering::Relaxed) {
                return Err(ReadErr::Closed);
            }
            match self.stream.read(&mut out[got..]) {
                Ok(0) => return Err(ReadErr::Closed),
                Ok(n) => got += n,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock
                            | std::io::ErrorKind::TimedOut
                            | std::io::ErrorKind::Interrupted
                    ) => {}
                Err(_) => return Err(ReadErr::Closed),
            }
        }
        Ok(())
    }

    fn read_frame(&mut self, buf: &mut [u8]) -> Result<(Header, Request), ReadErr> {
        self.read_exact(&mut buf[..HEADER_LEN])?;
        let h = Header::decode(&buf[..HEADER_LEN]).map_err(ReadErr::Proto)?;
        let end = HEADER_LEN + h.len as usize;
        self.read_exact(&mut buf[HEADER_LEN..end])?;
        let req = Request::decode(h.op, &buf[HEADER_LEN..end]).map_err(ReadErr::Proto)?;
        Ok((h, req))
    }

    fn seq(&self, s: u32) -> SeqId {
        SeqId(self.id << 32 | u64::from(s))
    }

    fn reply(
        &mut self,
        h: Header,
        body: Result<Vec<u8>, KvSwapError>,
        fd: Option<RawFd>,
    ) -> std::io::Result<()> {
        let mut payload = Vec::with_capacity(64);
        match body {
            Ok(b) => {
                payload.extend_from_slice(&(ErrorCode::Ok as u32).to_le_bytes());
                payload.extend_from_slice(&b);
            }
            Err(e) => {
                payload.extend_from_slice(&(ErrorCode::of(&e) as u32).to_le_bytes());
                payload.extend_from_slice(e.to_string().as_bytes());
            }
        }
        let rh = Header { op: h.op | proto::REPLY, req_id: h.req_id, len: payload.len() as u32 };
        let mut frame = rh.encode().to_vec();
        frame.extend_from_slice(&payload);
        match fd {
            // SCM_RIGHTS: the fd rides on the first bytes; a short send finishes without it.
            Some(fd) => {
                let sent =
                    self.stream.send_with_fd(&frame[..], fd).map_err(std::io::Error::from)?;
                (&self.stream).write_all(&frame[sent..])
            }
            None => self.stream.write_all(&frame),
        }
    }

    fn handle(&mut self, h: Header, req: Request) -> std::io::Result<()> {
        let blocks = |v: &[u32]| v.iter().map(|b| BlockId(*b)).collect::<Vec<_>>();
        let r: Result<Vec<u8>, KvSwapError> = match req {
            Request::Hello => {
                let e = self.engine();
                let mut b = Vec::new();
                b.extend_from_slice(&(e.block_bytes() as u64).to_le_bytes());
                b.extend_from_slice(&e.device().blocks().to_le_bytes());
                b.extend_from_slice(&self.pool_len.to_le_bytes());
                drop(e);
                let fd = self.pool_fd;
                return self.reply(h, Ok(b), Some(fd));
            }
            Request::Alloc { seq, n } => {
                let r = self.engine().alloc_blocks(self.seq(seq), n);
                r.map(|v| {
                    self.seqs.insert(seq);
                    let mut b = (v.len() as u32).to_le_bytes().to_vec();
                    for x in v {
                        b.extend_from_slice(&x.0.to_le_bytes());
                    }
                    b
                })
            }
            Request::Free { seq, blocks: bl } => {
                self.engine().free_blocks(self.seq(seq), &blocks(&bl)).map(|_| Vec::new())
            }
            Request::Lookup { seq } => {
                let info = self.engine().lookup(self.seq(seq));
                match info {
                    None => Err(KvSwapError::UnknownSequence { seq: SeqId(u64::from(seq)) }),
                    Some(i) => {
                        let (phase, tier) = match i.phase {
                            SeqPhase::Resident => (0u8, 255u8),
                            SeqPhase::SwappingOut => (1, 255),
                            SeqPhase::Out(t) => (2, t.index() as u8),
                            SeqPhase::Spilling => (3, TierKind::Host.index() as u8),
                            SeqPhase::SwappingIn => (4, 255),
                        };
                        let mut b = vec![phase, tier, 0, 0];
                        b.extend_from_slice(&i.blocks_out.to_le_bytes());
                        b.extend_from_slice(&i.device_blocks.to_le_bytes());
                        Ok(b)
                    }
                }
            }
            Request::PrepareStore { seq, blocks: bl } => {
                let r = self.engine().swap_out(self.seq(seq), &blocks(&bl));
                r.map(|t| {
                    self.tickets.insert(t.0);
                    t.0.to_le_bytes().to_vec()
                })
            }
            Request::PrepareLoad { seq, blocks: bl } => {
                let r = self.engine().swap_in(self.seq(seq), &blocks(&bl));
                r.map(|t| {
                    self.tickets.insert(t.0);
                    t.0.to_le_bytes().to_vec()
                })
            }
            Request::Complete { ticket, timeout_ms } => {
                if !self.tickets.contains(&ticket) {
                    Err(KvSwapError::UnknownTicket { ticket })
                } else {
                    let deadline = Instant::now()
                        + Duration::from_millis(u64::from(timeout_ms)).min(COMPLETE_WAIT_MAX);
                    loop {
                        let r = self.engine().wait(Ticket(ticket), Duration::from_millis(1));
                        match r {
                            Err(KvSwapError::Timeout { .. })
                                if Instant::now() < deadline
                                    && !self.stop.load(Ordering::Relaxed) =>
                            {
                                continue
                            }
                            Err(KvSwapError::Timeout { .. }) => {
                                break Err(KvSwapError::Timeout { ticket })
                            }
                            other => {
                                self.tickets.remove(&ticket);
                                break other.map(|_| Vec::new());
                            }
                        }
                    }
                }
            }
            Request::Touch { seq } => self.engine().touch(self.seq(seq)).map(|_| Vec::new()),
            Request::Drop { seq } => {
                let r = self.engine().drop_seq(self.seq(seq));
                self.seqs.remove(&seq);
                r.map(|_| Vec::new())
            }
            Request::Cancel { ticket } => {
                if !self.tickets.contains(&ticket) {
                    Err(KvSwapError::UnknownTicket { ticket })
                } else {
                    self.engine().cancel(Ticket(ticket)).map(|_| Vec::new())
                }
            }
            Request::Stats => {
                let st = self.engine().stats();
                let mut b = Vec::new();
                for t in &st.tiers {
                    b.extend_from_slice(&t.capacity_bytes.to_le_bytes());
                    b.extend_from_slice(&t.used_bytes.to_le_bytes());
                }
                b.extend_from_slice(&st.device_free.to_le_bytes());
                b.extend_from_slice(&st.device_pinned.to_le_bytes());
                Ok(b)
            }
        };
        self.reply(h, r, None)
    }
}
