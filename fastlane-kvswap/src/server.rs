//! `fastlane kv serve`: the engine behind a Unix socket, for an external inference server.
//!
//! Who may connect: on accept the server reads the peer's credentials (`SO_PEERCRED`) and
//! refuses, with an error frame and a log line, a peer whose uid and gid are not on
//! [`ServerConfig`]'s allow-lists (default: the server's own uid only). What a connection
//! sees: at `HELLO` it gets its own slab of the device pool, backed by its own memfd
//! ([`SlabDeviceMemory`]), so its mapping holds only its blocks; the slab goes back to the
//! pool (zeroed) when the connection is gone and its transfers have drained. Each connection
//! is in one namespace (default `uid:<uid>`), the unit blocks are shared in.
//!
//! Content-addressed blocks ([`Server::with_store`]): one [`PrefixStore`] per server, shared
//! by every connection. `PUT` copies blocks of the connection's own slab into it, `GET` copies
//! hits back into the slab, `EXISTS`/`PIN`/`UNPIN`/`EVICT` act on keys. Every client key is
//! qualified by the connection's namespace ([`BlockKey::in_namespace`]) before the store sees
//! it, so connections of one namespace share blocks and a connection of another namespace can
//! neither read, test for, pin nor evict them. Pins are counted per connection and released
//! when it closes.
//!
//! One thread per connection (at most [`CONNECTIONS_MAX`]); the engine sits behind a mutex
//! held only for one engine call at a time (a `COMPLETE` waits in 1 ms slices). Sequence ids
//! are namespaced per connection (engine id = connection id << 32 | client id), and so are
//! tickets; a connection's sequences are dropped when it closes. A frame that does not parse
//! closes that connection only.
// Serves peers: a panic here is a client taking the server down; errors instead.
#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use crate::cas::BlockKey;
use crate::device::{DeviceMemory, Slab, SlabDeviceMemory};
use crate::engine::{SeqPhase, SwapEngine};
use crate::error::KvSwapError;
use crate::prefix::{Located, PrefixStore};
use crate::proto::{
    self, located, ErrorCode, Header, HelloReply, Key, ProtoError, Request, HEADER_LEN, MAGIC,
    PAYLOAD_MAX,
};
use crate::{BlockId, SeqId, Ticket, TierKind};

/// Most concurrent connections.
pub const CONNECTIONS_MAX: usize = 64;
/// Longest `COMPLETE` wait the server grants.
pub const COMPLETE_WAIT_MAX: Duration = Duration::from_secs(60);
/// How long a closing connection waits for its transfers to drain before it leaves its slab
/// to be reclaimed by a later `HELLO`.
pub const DRAIN_WAIT_MAX: Duration = Duration::from_secs(5);
/// How long the server waits for a refused peer's first frame before it answers anyway.
const REFUSE_READ_WAIT: Duration = Duration::from_secs(1);
/// Most pins one connection may hold on one key (with [`CONNECTIONS_MAX`] connections the
/// store's per-block pin count stays far below `u32::MAX`).
pub const PINS_PER_KEY_MAX: u32 = 1 << 16;

/// Who may connect and how much of the device pool each connection may hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// Peer uids (from `SO_PEERCRED`) allowed to connect.
    pub allow_uids: Vec<u32>,
    /// Peer primary gids (from `SO_PEERCRED`) allowed to connect.
    pub allow_gids: Vec<u32>,
    /// Most blocks one connection's slab may have.
    pub conn_blocks_max: u32,
    /// Slab size for a `HELLO` that asks for 0 blocks.
    pub conn_blocks_default: u32,
    /// Named namespaces and the uids that may join each. Every peer may also use its own
    /// `uid:<uid>` namespace (the default).
    pub namespaces: Vec<(String, Vec<u32>)>,
}

impl ServerConfig {
    /// Defaults for a pool of `blocks` blocks: only the server's own effective uid may
    /// connect; a connection may hold the whole pool and gets a quarter of it by default.
    pub fn for_pool(blocks: u32) -> ServerConfig {
        ServerConfig {
            // SAFETY: geteuid has no preconditions and cannot fail.
            allow_uids: vec![unsafe { libc::geteuid() }],
            allow_gids: Vec::new(),
            conn_blocks_max: blocks,
            conn_blocks_default: (blocks / 4).max(1),
            namespaces: Vec::new(),
        }
    }

    /// Whether a peer with these credentials may connect.
    pub fn allows(&self, cred: &PeerCred) -> bool {
        self.allow_uids.contains(&cred.uid) || self.allow_gids.contains(&cred.gid)
    }

    /// The namespace a peer asked for at `HELLO` (empty: its default), or why it may not
    /// have it.
    pub fn namespace_for(&self, cred: &PeerCred, asked: &str) -> Result<String, String> {
        let own = format!("uid:{}", cred.uid);
        if asked.is_empty() || asked == own {
            return Ok(own);
        }
        if asked.starts_with("uid:") {
            return Err(format!(
                "namespace {asked:?} is another uid's; uid {} may use {own:?}",
                cred.uid
            ));
        }
        match self.namespaces.iter().find(|(n, _)| n == asked) {
            Some((_, uids)) if uids.contains(&cred.uid) => Ok(asked.to_string()),
            Some(_) => Err(format!("namespace {asked:?} is not open to uid {}", cred.uid)),
            None => Err(format!("namespace {asked:?} is not configured on this server")),
        }
    }
}

/// A peer's credentials as the kernel recorded them at `connect` (`SO_PEERCRED`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCred {
    /// Process id.
    pub pid: i32,
    /// Effective user id.
    pub uid: u32,
    /// Effective group id.
    pub gid: u32,
}

/// Reads the credentials of the process at the other end of `stream`.
pub fn peer_cred(stream: &UnixStream) -> std::io::Result<PeerCred> {
    let mut c = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `c` is a writable ucred and `len` its size, as SO_PEERCRED expects; the fd is
    // the stream's, open for the duration of the call.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut c as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if len as usize != std::mem::size_of::<libc::ucred>() {
        return Err(std::io::Error::other("short SO_PEERCRED answer"));
    }
    Ok(PeerCred { pid: c.pid, uid: c.uid, gid: c.gid })
}

/// Counters of a running server.
#[derive(Debug, Default)]
pub struct ServerCounters {
    /// Connections accepted.
    pub accepted: AtomicU64,
    /// Connections closed for a malformed frame.
    pub protocol_errors: AtomicU64,
    /// Requests served.
    pub requests: AtomicU64,
    /// Peers refused for their credentials.
    pub refused: AtomicU64,
    /// Connections closed at once because [`CONNECTIONS_MAX`] were open.
    pub refused_full: AtomicU64,
    /// Connections open now: being served, or being answered with a refusal.
    pub open: AtomicU64,
    /// Content-addressed requests (`PUT` … `EVICT`) served.
    pub cas_requests: AtomicU64,
    /// Pins released because their connection closed without `UNPIN`.
    pub pins_released_on_close: AtomicU64,
}

/// The server.
#[derive(Debug)]
pub struct Server {
    listener: UnixListener,
    engine: Arc<Mutex<SwapEngine>>,
    device: Arc<SlabDeviceMemory>,
    config: Arc<ServerConfig>,
    draining: Arc<Mutex<Vec<Slab>>>,
    counters: Arc<ServerCounters>,
    store: Option<Arc<PrefixStore>>,
}

impl Server {
    /// Binds `path` (an existing socket file is replaced). `device` must be the engine's
    /// device memory: each connection gets a slab of it at `HELLO`.
    pub fn bind(
        path: &Path,
        engine: SwapEngine,
        device: Arc<SlabDeviceMemory>,
        config: ServerConfig,
    ) -> Result<Server, KvSwapError> {
        let same = std::ptr::addr_eq(Arc::as_ptr(engine.device()), Arc::as_ptr(&device));
        if !same {
            return Err(KvSwapError::BadConfig {
                detail: "kv serve: the engine does not run on the given device pool".into(),
            });
        }
        if config.conn_blocks_default == 0 || config.conn_blocks_default > config.conn_blocks_max {
            return Err(KvSwapError::BadConfig {
                detail: format!(
                    "kv serve: default slab of {} blocks, cap {}",
                    config.conn_blocks_default, config.conn_blocks_max
                ),
            });
        }
        let _ = std::fs::remove_file(path);
        let listener =
            UnixListener::bind(path).map_err(|e| KvSwapError::setup("bind socket", e))?;
        listener.set_nonblocking(true).map_err(|e| KvSwapError::setup("nonblocking", e))?;
        Ok(Server {
            listener,
            engine: Arc::new(Mutex::new(engine)),
            device,
            config: Arc::new(config),
            draining: Arc::new(Mutex::new(Vec::new())),
            counters: Arc::new(ServerCounters::default()),
            store: None,
        })
    }

    /// Serves the content-addressed ops from `store` (shared by every connection; its
    /// blocks must be the device pool's size). Without a store those ops are answered with
    /// [`ErrorCode::StoreDisabled`].
    pub fn with_store(mut self, store: Arc<PrefixStore>) -> Result<Server, KvSwapError> {
        let (sb, db) = (store.config().block_bytes, self.device.block_bytes());
        if sb != db {
            return Err(KvSwapError::BadConfig {
                detail: format!("kv serve: store blocks of {sb} bytes, device blocks of {db}"),
            });
        }
        self.store = Some(store);
        Ok(self)
    }

    /// The content-addressed store, if any (for its counters while serving).
    pub fn store(&self) -> Option<Arc<PrefixStore>> {
        self.store.clone()
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
                    if self.counters.open.load(Ordering::Relaxed) >= CONNECTIONS_MAX as u64 {
                        log::warn!("kv serve: connection refused, {CONNECTIONS_MAX} already open");
                        self.counters.refused_full.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    let cred = peer_cred(&stream);
                    let refusal = match &cred {
                        Ok(c) if self.config.allows(c) => None,
                        Ok(c) => Some(format!(
                            "peer pid {} uid {} gid {} is not allowed to use this kv server \
                             (allowed uids {:?}, gids {:?}; see --allow-uid/--allow-gid)",
                            c.pid, c.uid, c.gid, self.config.allow_uids, self.config.allow_gids
                        )),
                        Err(e) => Some(format!("the peer's credentials are unreadable ({e})")),
                    };
                    let counters = self.counters.clone();
                    self.counters.open.fetch_add(1, Ordering::Relaxed);
                    let (Ok(cred), None) = (cred, &refusal) else {
                        let msg = refusal.unwrap_or_default();
                        log::warn!("kv serve: refused a connection: {msg}");
                        self.counters.refused.fetch_add(1, Ordering::Relaxed);
                        threads.push(std::thread::spawn(move || {
                            refuse(stream, ErrorCode::PeerRefused, &msg);
                            counters.open.fetch_sub(1, Ordering::Relaxed);
                        }));
                        continue;
                    };
                    self.counters.accepted.fetch_add(1, Ordering::Relaxed);
                    let conn = Conn {
                        id: next_conn,
                        stream,
                        cred,
                        engine: self.engine.clone(),
                        device: self.device.clone(),
                        config: self.config.clone(),
                        draining: self.draining.clone(),
                        slab: None,
                        namespace: None,
                        tickets: HashSet::new(),
                        seqs: HashSet::new(),
                        store: self.store.clone(),
                        pins: HashMap::new(),
                        counters: self.counters.clone(),
                        stop: stop_all.clone(),
                    };
                    next_conn += 1;
                    threads.push(std::thread::spawn(move || {
                        conn.run();
                        counters.open.fetch_sub(1, Ordering::Relaxed);
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

/// Answers a peer that may not be served: reads its first frame (bounded in time), replies
/// to it with `code` and `msg` in the peer's protocol version, and closes.
fn refuse(mut stream: UnixStream, code: ErrorCode, msg: &str) {
    let _ = stream.set_read_timeout(Some(Duration::from_millis(50)));
    let deadline = Instant::now() + REFUSE_READ_WAIT;
    let mut hb = [0u8; HEADER_LEN];
    let mut got = 0;
    while got < HEADER_LEN && Instant::now() < deadline {
        match stream.read(&mut hb[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(_) => {}
        }
    }
    let mut version = proto::VERSION;
    let (mut op, mut req_id) = (proto::op::HELLO, 0);
    if got == HEADER_LEN && hb[0..4] == MAGIC.to_le_bytes() {
        version = u16::from_le_bytes([hb[4], hb[5]]);
        op = u16::from_le_bytes([hb[6], hb[7]]) & !proto::REPLY;
        req_id = u32::from_le_bytes([hb[8], hb[9], hb[10], hb[11]]);
        // Drain the payload so the close does not reset the reply away.
        let mut left =
            (u32::from_le_bytes([hb[12], hb[13], hb[14], hb[15]]) as usize).min(PAYLOAD_MAX);
        let mut sink = [0u8; 4096];
        while left > 0 && Instant::now() < deadline {
            let want = left.min(sink.len());
            match stream.read(&mut sink[..want]) {
                Ok(0) => break,
                Ok(n) => left -= n,
                Err(_) => {}
            }
        }
    }
    let frame = error_frame(version, op, req_id, code, msg);
    let _ = stream.write_all(&frame);
    let _ = stream.shutdown(std::net::Shutdown::Both);
}

/// A reply frame carrying an error status and message, in protocol `version`.
fn error_frame(version: u16, op: u16, req_id: u32, code: ErrorCode, msg: &str) -> Vec<u8> {
    let mut payload = (code as u32).to_le_bytes().to_vec();
    payload.extend_from_slice(msg.as_bytes());
    payload.truncate(PAYLOAD_MAX);
    let h = Header { op: op | proto::REPLY, req_id, len: payload.len() as u32 };
    let mut frame = h.encode_version(version).to_vec();
    frame.extend_from_slice(&payload);
    frame
}

struct Conn {
    id: u64,
    stream: UnixStream,
    cred: PeerCred,
    engine: Arc<Mutex<SwapEngine>>,
    device: Arc<SlabDeviceMemory>,
    config: Arc<ServerConfig>,
    /// Slabs of closed connections whose blocks were still busy; reclaimed at a later HELLO.
    draining: Arc<Mutex<Vec<Slab>>>,
    /// This connection's slab of the device pool, from its HELLO on.
    slab: Option<Slab>,
    /// This connection's namespace, from its HELLO on.
    namespace: Option<String>,
    tickets: HashSet<u64>,
    seqs: HashSet<u32>,
    /// The server's content-addressed store (`None`: the ops are refused).
    store: Option<Arc<PrefixStore>>,
    /// This connection's pins, by store key: released when it closes.
    pins: HashMap<BlockKey, u32>,
    counters: Arc<ServerCounters>,
    stop: Arc<AtomicBool>,
}

enum ReadErr {
    Closed,
    Proto(ProtoError),
    /// A well-formed header of another protocol version.
    Version {
        version: u16,
        op: u16,
        req_id: u32,
    },
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
                Err(ReadErr::Version { version, op, req_id }) => {
                    log::warn!(
                        "kv serve: connection {} speaks protocol version {version}, not {}; \
                         closing it",
                        self.id,
                        proto::VERSION
                    );
                    self.counters.protocol_errors.fetch_add(1, Ordering::Relaxed);
                    let msg = format!(
                        "kv serve speaks protocol version {} (per-connection device pools, \
                         HELLO with slab size and namespace); this client speaks version \
                         {version}: upgrade the client",
                        proto::VERSION
                    );
                    let f = error_frame(version, op, req_id, ErrorCode::VersionUnsupported, &msg);
                    let _ = (&self.stream).write_all(&f);
                    let _ = self.stream.shutdown(std::net::Shutdown::Write);
                    break;
                }
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
        self.release_pins();
        let mut e = self.engine();
        for s in &self.seqs {
            let _ = e.drop_seq(self.seq(*s));
        }
        drop(e);
        // Dropping cancelled what had not started; wait (bounded, the lock taken per slice)
        // for what had, so that the slab is idle and can go back to the pool now.
        let deadline = Instant::now() + DRAIN_WAIT_MAX;
        let tickets: Vec<u64> = self.tickets.drain().collect();
        for t in tickets {
            loop {
                let r = self.engine().wait(Ticket(t), Duration::from_millis(1));
                match r {
                    Err(KvSwapError::Timeout { .. })
                        if Instant::now() < deadline && !self.stop.load(Ordering::Relaxed) => {}
                    _ => break,
                }
            }
        }
        if let Some(slab) = self.slab.take() {
            let mut e = self.engine();
            if e.range_idle(slab.range()) {
                // SAFETY: the slab was attached for this connection and not detached; its
                // blocks are owned by no sequence and pinned by no transfer (just checked,
                // under the engine lock, which every allocation and transfer start takes),
                // and only this connection's sequences could allocate in its range.
                if let Err(err) = unsafe { self.device.detach(slab) } {
                    log::error!("kv serve: connection {}: giving back {slab:?}: {err}", self.id);
                }
            } else {
                // Not under the engine lock: `reclaim_draining` takes this list's lock first.
                drop(e);
                log::warn!(
                    "kv serve: connection {} closed with transfers in flight; its {slab:?} \
                     is reclaimed once they drain",
                    self.id
                );
                lock_draining(&self.draining).push(slab);
            }
        }
        log::debug!(
            "kv serve: connection {} (pid {} uid {}, namespace {:?}) closed",
            self.id,
            self.cred.pid,
            self.cred.uid,
            self.namespace
        );
    }

    /// Gives back the slabs of closed connections whose transfers have drained since.
    fn reclaim_draining(&self) {
        let mut draining = lock_draining(&self.draining);
        if draining.is_empty() {
            return;
        }
        let mut e = self.engine();
        draining.retain(|slab| {
            if !e.range_idle(slab.range()) {
                return true;
            }
            // SAFETY: the slab was attached for a connection that is gone and was put here
            // instead of being detached; no live connection allocates in its range, and the
            // engine (locked) reports its blocks unowned and unpinned.
            match unsafe { self.device.detach(*slab) } {
                Ok(()) => false,
                Err(err) => {
                    log::error!("kv serve: giving back {slab:?}: {err}");
                    true
                }
            }
        });
    }

    fn hello(&mut self, blocks: u32, namespace: &str) -> Result<(Vec<u8>, OwnedFd), Refusal> {
        if self.slab.is_some() {
            return Err((ErrorCode::Other, "HELLO twice on one connection".into()));
        }
        let ns = self
            .config
            .namespace_for(&self.cred, namespace)
            .map_err(|m| (ErrorCode::NamespaceRefused, m))?;
        let want = if blocks == 0 { self.config.conn_blocks_default } else { blocks };
        if want > self.config.conn_blocks_max {
            return Err((
                ErrorCode::QuotaExceeded,
                format!(
                    "asked for a slab of {want} blocks; this server allows at most {} per \
                     connection",
                    self.config.conn_blocks_max
                ),
            ));
        }
        self.reclaim_draining();
        let (slab, fd) = self.device.attach(want).map_err(|e| match e {
            KvSwapError::DeviceFull { free, .. } => (
                ErrorCode::DeviceFull,
                format!(
                    "no free run of {want} blocks in the device pool (largest {free}); other \
                     connections hold the rest"
                ),
            ),
            e => (ErrorCode::of(&e), e.to_string()),
        })?;
        let reply = HelloReply {
            block_bytes: self.device.block_bytes() as u64,
            first_block: slab.first,
            blocks: slab.blocks,
            map_len: (slab.blocks as usize * self.device.block_bytes()) as u64,
            namespace: ns.clone(),
        };
        log::info!(
            "kv serve: connection {} (pid {} uid {} gid {}) in namespace {ns:?} holds blocks \
             {}..{}",
            self.id,
            self.cred.pid,
            self.cred.uid,
            self.cred.gid,
            slab.first,
            slab.first + slab.blocks
        );
        self.slab = Some(slab);
        self.namespace = Some(ns);
        Ok((reply.encode(), fd))
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
        let h = match Header::decode(&buf[..HEADER_LEN]) {
            Ok(h) => h,
            Err(ProtoError::BadVersion(version)) => {
                return Err(ReadErr::Version {
                    version,
                    op: u16::from_le_bytes([buf[6], buf[7]]) & !proto::REPLY,
                    req_id: u32::from_le_bytes([buf[8], buf[9], buf[10], buf[11]]),
                })
            }
            Err(e) => return Err(ReadErr::Proto(e)),
        };
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
        body: Result<Vec<u8>, Refusal>,
        fd: Option<RawFd>,
    ) -> std::io::Result<()> {
        let mut payload = Vec::with_capacity(64);
        match body {
            Ok(b) => {
                payload.extend_from_slice(&(ErrorCode::Ok as u32).to_le_bytes());
                payload.extend_from_slice(&b);
            }
            Err((code, msg)) => {
                payload.extend_from_slice(&(code as u32).to_le_bytes());
                payload.extend_from_slice(msg.as_bytes());
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
        let slab = match (&req, self.slab) {
            (Request::Hello { blocks, namespace }, _) => {
                return match self.hello(*blocks, namespace) {
                    // The memfd is closed here once sent: the mappings keep the slab alive.
                    Ok((b, fd)) => self.reply(h, Ok(b), Some(fd.as_raw_fd())),
                    Err(r) => self.reply(h, Err(r), None),
                };
            }
            (_, Some(slab)) => slab,
            (_, None) => {
                let msg = format!(
                    "send HELLO first (protocol version {}): it gives this connection its slab \
                     of the device pool",
                    proto::VERSION
                );
                return self.reply(h, Err((ErrorCode::HelloRequired, msg)), None);
            }
        };
        if let Some(r) = self.content_addressed(slab, &req) {
            self.counters.cas_requests.fetch_add(1, Ordering::Relaxed);
            return self.reply(h, r, None);
        }
        let r: Result<Vec<u8>, KvSwapError> = match req {
            Request::Hello { .. } => Ok(Vec::new()),
            Request::Alloc { seq, n } => {
                let r = self.engine().alloc_blocks_in(self.seq(seq), n, slab.range());
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
            // Answered by `content_addressed` above.
            Request::Put { .. }
            | Request::Get { .. }
            | Request::Exists { .. }
            | Request::Pin { .. }
            | Request::Unpin { .. }
            | Request::Evict { .. } => Ok(Vec::new()),
        };
        self.reply(h, r.map_err(|e| (ErrorCode::of(&e), e.to_string())), None)
    }
}

impl Conn {
    /// Serves a content-addressed op (`None`: `req` is not one). The reply body is one `u8`
    /// per key, in request order.
    fn content_addressed(&mut self, slab: Slab, req: &Request) -> Option<Result<Vec<u8>, Refusal>> {
        let r = match req {
            Request::Put { items } => self.put(slab, items),
            Request::Get { items } => self.get(slab, items),
            Request::Exists { keys } => self.with_store(keys, |_, store, keys| {
                let code = |l: Option<Located>| match l {
                    None => located::ABSENT,
                    Some(Located::Host) => located::HOST,
                    Some(Located::Nvme) => located::NVME,
                    Some(Located::Cluster) => located::CLUSTER,
                };
                store.exists(keys).into_iter().map(code).collect()
            }),
            Request::Pin { keys } => self.with_store(keys, Conn::pin),
            Request::Unpin { keys } => self.with_store(keys, Conn::unpin),
            Request::Evict { keys } => self.with_store(keys, |_, store, keys| {
                store.evict(keys).into_iter().map(u8::from).collect()
            }),
            _ => return None,
        };
        Some(r)
    }

    /// The store, or the refusal of a server without one.
    fn store(&self) -> Result<Arc<PrefixStore>, Refusal> {
        self.store.clone().ok_or_else(|| {
            (
                ErrorCode::StoreDisabled,
                "this kv server has no content-addressed store (started with --cas-bytes 0)".into(),
            )
        })
    }

    /// The store keys of a client's keys: each qualified by this connection's namespace.
    fn store_keys<'a>(&self, keys: impl IntoIterator<Item = &'a Key>) -> Vec<BlockKey> {
        // HELLO sets the slab and the namespace together; ops reach here only after it.
        let ns = self.namespace.as_deref().unwrap_or_default();
        keys.into_iter().map(|k| BlockKey::in_namespace(ns, k)).collect()
    }

    /// A key-only op: the store keys, then `f` with them.
    fn with_store(
        &mut self,
        keys: &[Key],
        f: impl FnOnce(&mut Conn, &PrefixStore, &[BlockKey]) -> Vec<u8>,
    ) -> Result<Vec<u8>, Refusal> {
        let store = self.store()?;
        let keys = self.store_keys(keys);
        Ok(f(self, &store, &keys))
    }

    /// Checks that every block is this connection's to copy to or from: in its slab, held by
    /// one of its sequences (`ALLOC`), not read or written by a transfer in flight, and (with
    /// `distinct`) named once.
    ///
    /// What this checks stays true until this connection's next request: only this
    /// connection's own requests, served one at a time on this thread, allocate, free, pin
    /// or drop blocks of its slab (other connections allocate in their own slabs only).
    fn check_blocks(&self, slab: Slab, blocks: &[u32], distinct: bool) -> Result<(), Refusal> {
        let range = slab.range();
        let mut e = self.engine();
        for (i, &b) in blocks.iter().enumerate() {
            let ours = range.contains(&b)
                && e.block_owner(BlockId(b)).is_some_and(|s| s.0 >> 32 == self.id);
            if !ours {
                return Err((
                    ErrorCode::BlockNotOwned,
                    format!(
                        "block {b} (key {i}) is not held by a sequence of this connection                          (its slab is {range:?}; ALLOC blocks before PUT or GET)"
                    ),
                ));
            }
        }
        let ids: Vec<BlockId> = blocks.iter().map(|b| BlockId(*b)).collect();
        if let Some(b) = e.first_pinned(&ids) {
            return Err((
                ErrorCode::BlockPinned,
                format!("block {b} is being swapped; COMPLETE its transfer first"),
            ));
        }
        drop(e);
        if distinct {
            let mut seen = HashSet::with_capacity(blocks.len());
            if let Some(b) = blocks.iter().find(|b| !seen.insert(**b)) {
                return Err((
                    ErrorCode::DuplicateBlock,
                    format!("block {b} is named twice: a GET writes each block once"),
                ));
            }
        }
        Ok(())
    }

    /// `PUT`: copies each block into the store under its key; per key 1 stored, 0 refused.
    fn put(&mut self, slab: Slab, items: &[(Key, u32)]) -> Result<Vec<u8>, Refusal> {
        let store = self.store()?;
        let blocks: Vec<u32> = items.iter().map(|i| i.1).collect();
        self.check_blocks(slab, &blocks, false)?;
        let keys = self.store_keys(items.iter().map(|i| &i.0));
        let bb = self.device.block_bytes();
        let mut out = Vec::with_capacity(items.len());
        for (key, &b) in keys.into_iter().zip(&blocks) {
            let mut data = Arc::<[u8]>::new_uninit_slice(bb);
            let Some(dst) = Arc::get_mut(&mut data) else {
                return Err((ErrorCode::Other, "fresh block buffer is shared".into()));
            };
            // SAFETY:
            // - `dst` is a fresh buffer of `bb` = block_bytes bytes, writable and ours alone.
            // - `b` is a block of this connection's slab, held by one of its sequences and
            //   pinned by no transfer (`check_blocks`), and nothing but this thread's requests
            //   can start one on it before this copy ends: no worker writes it meanwhile.
            //   (The client may write its own mapping meanwhile; it then stores torn bytes of
            //   its own, as with a swap-out.)
            if let Err(e) = unsafe { self.device.read_block(BlockId(b), dst.as_mut_ptr().cast()) } {
                return Err((ErrorCode::of(&e), e.to_string()));
            }
            // SAFETY: `read_block` wrote all `bb` bytes (it returned Ok).
            let data = unsafe { data.assume_init() };
            out.push(u8::from(store.insert(key, data)));
        }
        Ok(out)
    }

    /// `GET`: copies each hit into its block; per key 1 hit (the block now holds it), 0 miss
    /// (the block is untouched).
    fn get(&mut self, slab: Slab, items: &[(Key, u32)]) -> Result<Vec<u8>, Refusal> {
        let store = self.store()?;
        let blocks: Vec<u32> = items.iter().map(|i| i.1).collect();
        self.check_blocks(slab, &blocks, true)?;
        let keys = self.store_keys(items.iter().map(|i| &i.0));
        let bb = self.device.block_bytes();
        let mut out = Vec::with_capacity(items.len());
        for (hit, &b) in store.get(&keys).into_iter().zip(&blocks) {
            let Some(data) = hit.filter(|d| d.len() == bb) else {
                out.push(0);
                continue;
            };
            // SAFETY:
            // - `data` holds `bb` = block_bytes readable bytes (checked above), kept alive by
            //   its `Arc` for the call.
            // - `b` is a block of this connection's slab held by one of its sequences, pinned by
            //   no transfer and named once in this request (`check_blocks`); only this thread's
            //   requests could start a transfer on it, so no worker reads or writes it
            //   meanwhile.
            if let Err(e) = unsafe { self.device.write_block(BlockId(b), data.as_ptr()) } {
                return Err((ErrorCode::of(&e), e.to_string()));
            }
            out.push(1);
        }
        Ok(out)
    }

    /// `PIN`: per key 1 when pinned for this connection, 0 when the block is on no tier,
    /// cannot be held in host memory, or this connection holds [`PINS_PER_KEY_MAX`] pins of it.
    fn pin(&mut self, store: &PrefixStore, keys: &[BlockKey]) -> Vec<u8> {
        let mut out = vec![0u8; keys.len()];
        let (asked, at) = self
            .pin_requests(keys, |held, pending| held.saturating_add(pending) < PINS_PER_KEY_MAX);
        for ((k, i), ok) in asked.iter().zip(at).zip(store.pin(&asked)) {
            if ok {
                *self.pins.entry(*k).or_insert(0) += 1;
                out[i] = 1;
            }
        }
        out
    }

    /// `UNPIN`: per key 1 when one of this connection's pins of it was released, 0 when this
    /// connection holds none (another connection's pins are not its to release).
    fn unpin(&mut self, store: &PrefixStore, keys: &[BlockKey]) -> Vec<u8> {
        let mut out = vec![0u8; keys.len()];
        let (asked, at) = self.pin_requests(keys, |held, pending| pending < held);
        for ((k, i), ok) in asked.iter().zip(at).zip(store.unpin(&asked)) {
            if ok {
                out[i] = 1;
            }
            // Our count goes down either way: a pin the store no longer has is not ours.
            if let Some(n) = self.pins.get_mut(k) {
                *n -= 1;
                if *n == 0 {
                    self.pins.remove(k);
                }
            }
        }
        out
    }

    /// The keys of a PIN or UNPIN to pass to the store, and their positions in `keys`: a key
    /// goes on while `ok(pins this connection holds, times it is already in this request)`.
    fn pin_requests(
        &self,
        keys: &[BlockKey],
        ok: impl Fn(u32, u32) -> bool,
    ) -> (Vec<BlockKey>, Vec<usize>) {
        let mut asked = Vec::with_capacity(keys.len());
        let mut at = Vec::with_capacity(keys.len());
        let mut pending: HashMap<BlockKey, u32> = HashMap::new();
        for (i, k) in keys.iter().enumerate() {
            let held = self.pins.get(k).copied().unwrap_or(0);
            let p = pending.entry(*k).or_insert(0);
            if ok(held, *p) {
                *p += 1;
                asked.push(*k);
                at.push(i);
            }
        }
        (asked, at)
    }

    /// Releases every pin this connection still holds (it is closing).
    fn release_pins(&mut self) {
        let Some(store) = self.store.clone() else { return };
        let mut released = 0u64;
        for (k, n) in self.pins.drain() {
            // In slices, so that a key pinned many times does not need one long vector.
            let mut left = n as usize;
            while left > 0 {
                let now = left.min(1024);
                released += store.unpin(&vec![k; now]).iter().filter(|u| **u).count() as u64;
                left -= now;
            }
        }
        if released > 0 {
            self.counters.pins_released_on_close.fetch_add(released, Ordering::Relaxed);
            log::debug!("kv serve: connection {} closed holding {released} pins", self.id);
        }
    }
}

/// An error status and its message.
type Refusal = (ErrorCode, String);

/// The list of slabs waiting to drain. Held only for `Vec` edits and `range_idle`/`detach`
/// calls that return errors rather than panic, so a poisoned lock still holds a valid list.
fn lock_draining(m: &Mutex<Vec<Slab>>) -> MutexGuard<'_, Vec<Slab>> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allow_lists_and_namespaces() {
        let mut c = ServerConfig::for_pool(8);
        c.allow_uids = vec![10];
        c.allow_gids = vec![20];
        c.namespaces = vec![("team".into(), vec![10, 11])];
        let peer = |uid, gid| PeerCred { pid: 1, uid, gid };
        assert!(c.allows(&peer(10, 99)) && c.allows(&peer(99, 20)));
        assert!(!c.allows(&peer(11, 21)));
        assert_eq!(c.namespace_for(&peer(11, 0), "").unwrap(), "uid:11");
        assert_eq!(c.namespace_for(&peer(11, 0), "uid:11").unwrap(), "uid:11");
        assert_eq!(c.namespace_for(&peer(11, 0), "team").unwrap(), "team");
        assert!(c.namespace_for(&peer(12, 0), "team").is_err());
        assert!(c.namespace_for(&peer(11, 0), "uid:10").is_err());
        assert!(c.namespace_for(&peer(11, 0), "other").is_err());
        assert_eq!(ServerConfig::for_pool(8).conn_blocks_default, 2);
        // SAFETY: geteuid has no preconditions.
        assert_eq!(ServerConfig::for_pool(1).allow_uids, vec![unsafe { libc::geteuid() }]);
    }
}
