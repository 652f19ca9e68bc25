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

/// An error status and its message.
type Refusal = (ErrorCode, String);

mod conn;
mod store_ops;

use conn::refuse;

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
