//! A Redis Cluster tier for content-addressed KV blocks ([`BlockKey`]), shared by every
//! machine that can reach the cluster and outliving any one sequence or process.
//!
//! [`ClusterTier`] stores whole blocks with pipelined `SET`s and reads them back with
//! pipelined `GET`s through the `redis` crate's synchronous cluster client (slot routing,
//! `MOVED`/`ASK` redirects, slot-map refresh after a failover). It is a cache: a block may be
//! gone (evicted by `maxmemory`, lost in a failover, expired, overwritten), and whatever comes
//! back is checked before a byte of it reaches the caller.
//!
//! # Keys
//!
//! The Redis key of a block is `namespace + ":" + hex(BlockKey)` (64 lower-case hex digits),
//! e.g. `kvswap:3f5a…`. The namespace separates deployments sharing a cluster; it may not
//! contain `{` or `}`, because a hash tag would put every block in one slot (one node).
//!
//! # Value format (version 1)
//!
//! A 48-byte header, then the payload (the block's bytes); integers little endian:
//!
//! | offset | field | value |
//! | --- | --- | --- |
//! | 0 | `magic u32` | `0x4243564B` (the bytes `KVCB`) |
//! | 4 | `version u16` | 1 |
//! | 6 | `reserved u16` | 0 |
//! | 8 | `key [u8; 32]` | the [`BlockKey`] the value was stored under |
//! | 40 | `payload_len u32` | bytes after the header |
//! | 44 | `crc32c u32` | CRC32C (Castagnoli) of the payload |
//! | 48 | payload | `payload_len` bytes |
//!
//! A value is used only when the magic, version and reserved field match, the key equals the
//! key asked for (so a value copied or written under another key's name is refused), the
//! length equals both `payload_len` and the caller's buffer, and the CRC32C matches.
//! Anything else is a miss ([`MissReason::Integrity`], counted in
//! [`ClusterStats::integrity_misses`]); nothing is copied into the caller's buffer then.
//!
//! # Security
//!
//! The URLs are all `redis://` (plain TCP) or all `rediss://` (TLS through rustls, with the
//! `ring` provider); none may carry a user or password. [`ClusterTierConfig::access`] holds
//! the `AUTH` credentials, applied to every node connection (those the slot map leads to as
//! well), and the CA to trust for TLS (the system's roots without one); see
//! [`crate::cluster_access`] for where they come from. At connect a refused password is
//! [`ClusterTierError::Auth`] and a failed TLS handshake or certificate check
//! [`ClusterTierError::Tls`], both naming the URLs; the TLS handshake and `AUTH` are bounded
//! by `connect_timeout` like the TCP connection.
//!
//! # Timeouts and failures
//!
//! Every call ([`ClusterTier::put`], [`ClusterTier::get`], [`ClusterTier::exists`]) returns
//! within [`ClusterTierConfig::timeout`] (plus scheduling noise): the cluster connections live
//! on worker threads (see Lanes), and the caller waits for their answers at most that long.
//! Inside a worker each node connection attempt is bounded by `connect_timeout` and each reply by
//! `response_timeout`; a job whose caller already gave up is skipped. Any failure — a timeout,
//! a refused connection, `CLUSTERDOWN`, a redirect storm, the worker queue full — is, for a
//! `get`, a miss of every block of the failed lane ([`MissReason::Error`]); for a `put`, an error
//! returned and counted ([`ClusterStats::errors`]); for `exists`, `false`. Never a panic.
//! After an error the worker drops its cluster connection and builds a fresh one (new slot
//! map) on the next call, at most once per `reconnect_backoff`, which is how it follows a
//! failover.
//!
//! A batch `put` is all or error: when it fails some of its blocks may have been stored. That
//! is harmless, since a block's key names its content and every `get` verifies it.
//!
//! # Lanes
//!
//! A batch is spread over [`ClusterTierConfig::lanes`] connections, each on its own worker
//! thread: a key goes to lane `slot × lanes / 16384` of its hash slot, so with the slots split
//! evenly over that many primaries each lane's pipeline goes to one primary and the primaries
//! work in parallel (the `redis` crate's synchronous cluster pipeline writes to one node after
//! another). The call waits for every lane within its one timeout; a lane that fails makes its
//! keys misses (`get`), `false` (`exists`) or the whole call an error (`put`), counted once per
//! call. Calls from several threads share the workers; the queue in front of them holds
//! [`JOB_QUEUE_MAX`] × lanes lane jobs, and a call that finds it full fails at once.

#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use redis::cluster::{ClusterClient, ClusterConnection, ClusterPipeline};
use redis::{Cmd, RedisError, RedisWrite, ToRedisArgs, Value};

use crate::cas::BlockKey;
use crate::cluster_access::{ClusterAccess, PASSWORD_ENV, USERNAME_ENV};

/// `KVCB` read as a little-endian `u32`.
pub const VALUE_MAGIC: u32 = 0x4243_564B;
/// The value format's version.
pub const VALUE_VERSION: u16 = 1;
/// Bytes of the value header before the payload.
pub const VALUE_HEADER_BYTES: usize = 48;
/// Calls that may wait for the workers; one more fails with [`ClusterTierError::Busy`].
pub const JOB_QUEUE_MAX: usize = 8;
/// Most lanes ([`ClusterTierConfig::lanes`]).
pub const LANES_MAX: usize = 16;
/// Hash slots of a Redis Cluster.
const SLOTS: usize = 16384;

/// Settings of a [`ClusterTier`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterTierConfig {
    /// Prefix of every Redis key (`namespace:hex`); no `{` or `}`.
    pub namespace: String,
    /// Bound on one whole call, retries and redirects included.
    pub timeout: Duration,
    /// Bound on one TCP connection attempt to one node.
    pub connect_timeout: Duration,
    /// Bound on one reply from one node.
    pub response_timeout: Duration,
    /// Retries of a command inside one call after a redirect or a broken connection.
    pub retries: u32,
    /// After a failed (re)connection, calls fail at once for this long instead of trying again.
    pub reconnect_backoff: Duration,
    /// Expiry of stored blocks (`SET .. PX`); `None`: until `maxmemory` evicts them.
    pub ttl: Option<Duration>,
    /// Connections (one worker thread each) a batch is spread over, 1 to [`LANES_MAX`]. A
    /// key goes to lane `slot × lanes / 16384` (its Redis Cluster hash slot): with slots
    /// split evenly over `lanes` primaries, as `redis-cli --cluster create` does, each lane
    /// talks to one primary and the primaries work on a batch in parallel.
    pub lanes: usize,
    /// `AUTH` credentials and the TLS CA (see the module doc, "Security").
    pub access: ClusterAccess,
}

impl Default for ClusterTierConfig {
    fn default() -> Self {
        ClusterTierConfig {
            namespace: "kvswap".to_string(),
            timeout: Duration::from_millis(1000),
            connect_timeout: Duration::from_millis(250),
            response_timeout: Duration::from_millis(500),
            retries: 2,
            reconnect_backoff: Duration::from_millis(100),
            ttl: None,
            lanes: 3,
            access: ClusterAccess::default(),
        }
    }
}

/// Why a call to the cluster failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClusterTierError {
    /// The configuration cannot work.
    #[error("bad cluster tier config: {detail}")]
    BadConfig {
        /// What is wrong.
        detail: String,
    },
    /// No node of the cluster could be reached, or the slot map could not be read.
    #[error("cannot connect to the cluster: {detail}")]
    Connect {
        /// The client's error.
        detail: String,
    },
    /// The cluster refused the credentials (or wants some and got none), at connect.
    #[error(
        "cluster {urls}: authentication failed ({detail}); the password comes from \
         {PASSWORD_ENV} or --kv-cluster-password-file, the user from {USERNAME_ENV}"
    )]
    Auth {
        /// The URLs connected to, comma separated.
        urls: String,
        /// The client's error.
        detail: String,
    },
    /// The TLS handshake or the check of a node's certificate failed, at connect.
    #[error("cluster {urls}: TLS failed ({detail}){hint}")]
    Tls {
        /// The URLs connected to, comma separated.
        urls: String,
        /// The client's error.
        detail: String,
        /// What to look at, or empty.
        hint: String,
    },
    /// The call did not finish within the configured timeout.
    #[error("cluster call timed out after {timeout_ms} ms")]
    Timeout {
        /// The timeout.
        timeout_ms: u64,
    },
    /// The worker queue was full.
    #[error("cluster tier busy: {JOB_QUEUE_MAX} calls already waiting")]
    Busy,
    /// The cluster or the connection to it answered with an error.
    #[error("cluster error: {detail}")]
    Redis {
        /// The client's error.
        detail: String,
    },
    /// A reply of a shape the command cannot give (a bug, or not a Redis server).
    #[error("unexpected reply: {detail}")]
    BadReply {
        /// What came.
        detail: String,
    },
    /// A block too large for the value format (over 4 GiB).
    #[error("block of {bytes} bytes is too large")]
    BlockTooLarge {
        /// Its size.
        bytes: usize,
    },
    /// The worker thread is gone (it panicked).
    #[error("cluster tier worker is gone")]
    WorkerGone,
}

/// Why a block was not returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissReason {
    /// No value under the key.
    Absent,
    /// A value was there but failed the checks of the value format.
    Integrity,
    /// The call failed (timeout, connection, cluster down, …).
    Error,
}

/// The outcome of one block of a [`ClusterTier::get`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockGet {
    /// The block's verified bytes are in the caller's buffer.
    Hit,
    /// The caller's buffer was not written.
    Miss(MissReason),
}

impl BlockGet {
    /// A hit?
    pub fn is_hit(self) -> bool {
        self == BlockGet::Hit
    }
}

/// Counters of a [`ClusterTier`] since it connected.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClusterStats {
    /// Blocks stored (acknowledged by the cluster).
    pub puts: u64,
    /// Blocks asked for by `get`.
    pub gets: u64,
    /// Blocks returned.
    pub hits: u64,
    /// Blocks not returned, for any reason (absent, integrity, error).
    pub misses: u64,
    /// Misses because a value failed its checks.
    pub integrity_misses: u64,
    /// Failed calls (put, get or exists batches), timeouts included.
    pub errors: u64,
    /// Calls that ran past the timeout (also in `errors`).
    pub timeouts: u64,
    /// Value bytes (header included) of acknowledged puts.
    pub bytes_out: u64,
    /// Value bytes (header included) received by gets.
    pub bytes_in: u64,
}

#[derive(Debug, Default)]
struct Counters {
    puts: AtomicU64,
    gets: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    integrity_misses: AtomicU64,
    errors: AtomicU64,
    timeouts: AtomicU64,
    bytes_out: AtomicU64,
    bytes_in: AtomicU64,
}

fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// The value header of `payload` stored under `key`.
pub fn value_header(
    key: &BlockKey,
    payload: &[u8],
) -> Result<[u8; VALUE_HEADER_BYTES], ClusterTierError> {
    let len = u32::try_from(payload.len())
        .map_err(|_| ClusterTierError::BlockTooLarge { bytes: payload.len() })?;
    let mut h = [0u8; VALUE_HEADER_BYTES];
    h[0..4].copy_from_slice(&VALUE_MAGIC.to_le_bytes());
    h[4..6].copy_from_slice(&VALUE_VERSION.to_le_bytes());
    h[8..40].copy_from_slice(&key.0);
    h[40..44].copy_from_slice(&len.to_le_bytes());
    h[44..48].copy_from_slice(&crc32c::crc32c(payload).to_le_bytes());
    Ok(h)
}

/// The whole value (header and payload) of `payload` stored under `key`.
pub fn encode_value(key: &BlockKey, payload: &[u8]) -> Result<Vec<u8>, ClusterTierError> {
    let mut v = Vec::with_capacity(VALUE_HEADER_BYTES + payload.len());
    v.extend_from_slice(&value_header(key, payload)?);
    v.extend_from_slice(payload);
    Ok(v)
}

fn le_u32(b: &[u8], at: usize) -> Option<u32> {
    let bytes: [u8; 4] = b.get(at..at + 4)?.try_into().ok()?;
    Some(u32::from_le_bytes(bytes))
}

fn le_u16(b: &[u8], at: usize) -> Option<u16> {
    let bytes: [u8; 2] = b.get(at..at + 2)?.try_into().ok()?;
    Some(u16::from_le_bytes(bytes))
}

/// The payload of `value` if it is a well-formed version-1 value of `key` whose payload is
/// `expected_len` bytes with a matching CRC32C; `None` otherwise.
pub fn check_value<'a>(key: &BlockKey, value: &'a [u8], expected_len: usize) -> Option<&'a [u8]> {
    if le_u32(value, 0)? != VALUE_MAGIC
        || le_u16(value, 4)? != VALUE_VERSION
        || le_u16(value, 6)? != 0
        || value.get(8..40)? != key.0.as_slice()
    {
        return None;
    }
    let len = le_u32(value, 40)? as usize;
    let payload = value.get(VALUE_HEADER_BYTES..)?;
    if len != payload.len() || len != expected_len {
        return None;
    }
    if crc32c::crc32c(payload) != le_u32(value, 44)? {
        return None;
    }
    Some(payload)
}

/// `SET`'s value argument, written straight into the command buffer (one copy of the block).
struct ValueArg<'a> {
    header: [u8; VALUE_HEADER_BYTES],
    payload: &'a [u8],
}

impl ToRedisArgs for ValueArg<'_> {
    fn write_redis_args<W>(&self, out: &mut W)
    where
        W: ?Sized + RedisWrite,
    {
        let mut w = out.writer_for_next_arg();
        // Writes into the command's Vec<u8> cannot fail short of allocation failure, which
        // aborts; the results are still looked at rather than assumed.
        if w.write_all(&self.header).is_err() || w.write_all(self.payload).is_err() {
            log::error!("kvswap cluster: building a SET command failed");
        }
    }
}

/// The answer to one command of a batch.
#[derive(Debug)]
enum Reply {
    /// What the server answered.
    Value(Value),
    /// The server refused this command alone (e.g. `WRONGTYPE`: the key holds a list).
    Refused,
    /// No answer (the connection failed, or the call's time ran out).
    Failed,
}

struct Job {
    pipe: ClusterPipeline,
    /// The same commands one by one, for a batch that may be retried command by command
    /// when the server refused one of them (small commands only: GET, EXISTS).
    singles: Option<Vec<Cmd>>,
    deadline: Instant,
    reply: SyncSender<Result<Vec<Reply>, ClusterTierError>>,
}

/// A Redis Cluster as a tier of content-addressed blocks (see the module doc). `Send + Sync`:
/// share it between threads by reference or `Arc`. Dropping it ends the worker after the job
/// it is running, without waiting for it.
#[derive(Debug)]
pub struct ClusterTier {
    cfg: ClusterTierConfig,
    jobs: SyncSender<Job>,
    counters: Counters,
}

impl ClusterTier {
    /// Connects to the cluster through any of `urls` (all `redis://host:port` or all
    /// `rediss://host:port`, no credentials in them: those are `cfg.access`), reads its slot
    /// map and starts the workers. Fails when no node answers within the timeouts
    /// ([`ClusterTierError::Connect`]), refuses the credentials ([`ClusterTierError::Auth`])
    /// or fails TLS ([`ClusterTierError::Tls`]).
    pub fn connect(
        urls: &[String],
        cfg: ClusterTierConfig,
    ) -> Result<ClusterTier, ClusterTierError> {
        let bad = |detail: &str| ClusterTierError::BadConfig { detail: detail.to_string() };
        if urls.is_empty() {
            return Err(bad("no cluster node URL"));
        }
        if cfg.namespace.contains(['{', '}']) {
            return Err(bad("namespace may not contain '{' or '}' (a hash tag)"));
        }
        for (name, d) in [
            ("timeout", cfg.timeout),
            ("connect_timeout", cfg.connect_timeout),
            ("response_timeout", cfg.response_timeout),
        ] {
            if d.is_zero() {
                return Err(bad(&format!("{name} is zero")));
            }
        }
        if cfg.ttl.is_some_and(|t| t.as_millis() == 0) {
            return Err(bad("ttl under 1 ms"));
        }
        if cfg.lanes == 0 || cfg.lanes > LANES_MAX {
            return Err(bad(&format!("lanes {} not in 1..={LANES_MAX}", cfg.lanes)));
        }
        let tls = url_scheme_is_tls(urls)?;
        if !tls && cfg.access.ca_pem.is_some() {
            return Err(bad("a CA to trust is given but the URLs are redis:// (no TLS)"));
        }
        let mut builder = ClusterClient::builder(urls.iter().map(|u| u.as_str()))
            .connection_timeout(cfg.connect_timeout)
            .response_timeout(cfg.response_timeout)
            .retries(cfg.retries)
            .min_retry_wait(1)
            .max_retry_wait(50);
        if let Some(user) = &cfg.access.username {
            builder = builder.username(user);
        }
        if let Some(password) = &cfg.access.password {
            builder = builder.password(password);
        }
        if tls {
            // rustls takes the process's default provider: ring, the one built in, unless the
            // program installed another first (then that one stays). rustls 0.23.48 marks
            // ring's provider deprecated for its lack of post-quantum key exchange; it is the
            // provider the workspace builds (no aws-lc, no cmake), as for the NATS client.
            #[allow(deprecated)]
            let _ = rustls::crypto::ring::default_provider().install_default();
            if let Some(ca) = &cfg.access.ca_pem {
                builder = builder.certs(redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(ca.clone()),
                });
            }
        }
        let client = builder.build().map_err(|e| bad(&e.to_string()))?;
        // Every lane's connection now, so that a cluster that does not answer, refuses the
        // password or fails the TLS handshake fails here.
        let mut conns = Vec::with_capacity(cfg.lanes);
        for _ in 0..cfg.lanes {
            conns.push(client.get_connection().map_err(|e| connect_error(urls, tls, &e))?);
        }
        let (jobs, rx) = mpsc::sync_channel(JOB_QUEUE_MAX * cfg.lanes);
        let rx = Arc::new(Mutex::new(rx));
        for (i, conn) in conns.into_iter().enumerate() {
            let mut worker = Worker {
                client: client.clone(),
                conn: Some(conn),
                next_connect: Instant::now(),
                cfg: cfg.clone(),
            };
            let rx = rx.clone();
            thread::Builder::new()
                .name(format!("kvswap-cluster-{i}"))
                .spawn(move || worker.run(&rx))
                .map_err(|e| ClusterTierError::Connect { detail: format!("worker thread: {e}") })?;
        }
        Ok(ClusterTier { cfg, jobs, counters: Counters::default() })
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &ClusterTierConfig {
        &self.cfg
    }

    /// The Redis key of `key`: `namespace:hex`.
    pub fn redis_key(&self, key: &BlockKey) -> String {
        format!("{}:{key}", self.cfg.namespace)
    }

    /// The indexes of `keys` by lane (lanes with no key left out), each in the keys' order.
    fn lanes_of(&self, keys: impl Iterator<Item = BlockKey>) -> Vec<Vec<usize>> {
        let lanes = self.cfg.lanes;
        let mut by_lane: Vec<Vec<usize>> = vec![Vec::new(); lanes];
        for (i, key) in keys.enumerate() {
            // No hash tag in our keys (the namespace may not hold braces): the slot is the
            // CRC16 of the whole key.
            let slot = crc16::State::<crc16::XMODEM>::calculate(self.redis_key(&key).as_bytes())
                as usize
                % SLOTS;
            by_lane[slot * lanes / SLOTS].push(i);
        }
        by_lane.retain(|l| !l.is_empty());
        by_lane
    }

    /// Stores every `(key, block)` in one pipelined batch of `SET`s. All or error: on error
    /// (counted in [`ClusterStats::errors`]) some blocks may have been stored.
    pub fn put(&self, items: &[(BlockKey, &[u8])]) -> Result<(), ClusterTierError> {
        if items.is_empty() {
            return Ok(());
        }
        let lanes = self.lanes_of(items.iter().map(|(k, _)| *k));
        let mut jobs = Vec::with_capacity(lanes.len());
        let mut bytes = 0u64;
        for lane in &lanes {
            let mut pipe = ClusterPipeline::with_capacity(lane.len());
            for &i in lane {
                let (key, payload) = &items[i];
                let header = match value_header(key, payload) {
                    Ok(h) => h,
                    Err(e) => {
                        add(&self.counters.errors, 1);
                        return Err(e);
                    }
                };
                bytes += (VALUE_HEADER_BYTES + payload.len()) as u64;
                pipe.cmd("SET").arg(self.redis_key(key)).arg(ValueArg { header, payload });
                if let Some(ttl) = self.cfg.ttl {
                    pipe.arg("PX").arg(ttl.as_millis() as u64);
                }
            }
            jobs.push((pipe, None));
        }
        let mut replies = Vec::with_capacity(items.len());
        for (lane, r) in lanes.iter().zip(self.call_lanes(jobs).0) {
            let r = r?;
            if r.len() != lane.len() {
                add(&self.counters.errors, 1);
                return Err(ClusterTierError::BadReply {
                    detail: format!("{} replies to {} SETs", r.len(), lane.len()),
                });
            }
            replies.extend(r);
        }
        for r in &replies {
            let ok = match r {
                Reply::Value(Value::Okay) => true,
                Reply::Value(Value::SimpleString(s)) => s == "OK",
                _ => false,
            };
            if !ok {
                add(&self.counters.errors, 1);
                return Err(ClusterTierError::BadReply { detail: format!("SET answered {r:?}") });
            }
        }
        add(&self.counters.puts, items.len() as u64);
        add(&self.counters.bytes_out, bytes);
        Ok(())
    }

    /// Reads `keys[i]` into `out[i]` in one pipelined batch of `GET`s. A block is a hit only
    /// when its value passes every check of the value format and its payload is exactly
    /// `out[i].len()` bytes; on a miss `out[i]` is left as it was.
    ///
    /// # Panics
    ///
    /// When `keys` and `out` differ in length (a bug of the caller).
    pub fn get(&self, keys: &[BlockKey], out: &mut [&mut [u8]]) -> Vec<BlockGet> {
        assert_eq!(keys.len(), out.len(), "one output buffer per key");
        if keys.is_empty() {
            return Vec::new();
        }
        let n = keys.len() as u64;
        add(&self.counters.gets, n);
        let replies = self.small_batches("GET", keys);
        let mut result = Vec::with_capacity(keys.len());
        for ((key, buf), reply) in keys.iter().zip(out.iter_mut()).zip(replies) {
            let outcome = match reply {
                Reply::Failed => {
                    // Counted as an error once per call, by `call` or just above.
                    BlockGet::Miss(MissReason::Error)
                }
                Reply::Value(Value::Nil) => BlockGet::Miss(MissReason::Absent),
                Reply::Value(Value::BulkString(value)) => {
                    add(&self.counters.bytes_in, value.len() as u64);
                    match check_value(key, &value, buf.len()) {
                        Some(payload) => {
                            buf.copy_from_slice(payload);
                            BlockGet::Hit
                        }
                        None => {
                            add(&self.counters.integrity_misses, 1);
                            BlockGet::Miss(MissReason::Integrity)
                        }
                    }
                }
                // A key holding another type (refused), or an odd reply: not a block of ours.
                Reply::Refused | Reply::Value(_) => {
                    add(&self.counters.integrity_misses, 1);
                    BlockGet::Miss(MissReason::Integrity)
                }
            };
            if outcome.is_hit() {
                add(&self.counters.hits, 1);
            } else {
                add(&self.counters.misses, 1);
            }
            result.push(outcome);
        }
        result
    }

    /// Whether a value exists under each key (one pipelined batch of `EXISTS`). A hint only:
    /// the value is not read, so a later `get` may still miss. `false` for all on error.
    pub fn exists(&self, keys: &[BlockKey]) -> Vec<bool> {
        if keys.is_empty() {
            return Vec::new();
        }
        self.small_batches("EXISTS", keys)
            .iter()
            .map(|v| matches!(v, Reply::Value(Value::Int(1) | Value::Boolean(true))))
            .collect()
    }

    /// The counters so far.
    pub fn stats(&self) -> ClusterStats {
        let c = &self.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ClusterStats {
            puts: l(&c.puts),
            gets: l(&c.gets),
            hits: l(&c.hits),
            misses: l(&c.misses),
            integrity_misses: l(&c.integrity_misses),
            errors: l(&c.errors),
            timeouts: l(&c.timeouts),
            bytes_out: l(&c.bytes_out),
            bytes_in: l(&c.bytes_in),
        }
    }

    /// `op key` for every key, spread over the lanes (each lane one pipeline, and its
    /// commands one by one for a retry); one reply per key in the keys' order, `Failed` for
    /// the keys of a lane whose call failed (counted once per call).
    fn small_batches(&self, op: &str, keys: &[BlockKey]) -> Vec<Reply> {
        let lanes = self.lanes_of(keys.iter().copied());
        let mut jobs = Vec::with_capacity(lanes.len());
        for lane in &lanes {
            let mut pipe = ClusterPipeline::with_capacity(lane.len());
            let mut singles = Vec::with_capacity(lane.len());
            for &i in lane {
                let mut c = redis::cmd(op);
                c.arg(self.redis_key(&keys[i]));
                singles.push(c.clone());
                pipe.add_command(c);
            }
            jobs.push((pipe, Some(singles)));
        }
        let mut out: Vec<Reply> = keys.iter().map(|_| Reply::Failed).collect();
        let mut odd = false;
        let (results, counted) = self.call_lanes(jobs);
        for (lane, r) in lanes.iter().zip(results) {
            match r {
                Ok(r) if r.len() == lane.len() => {
                    for (&i, reply) in lane.iter().zip(r) {
                        out[i] = reply;
                    }
                }
                Ok(r) => {
                    log::warn!("kvswap cluster: {} replies to {} {op}s", r.len(), lane.len());
                    odd = true;
                }
                // Counted by `call_lanes`.
                Err(_) => {}
            }
        }
        let failed_inside = out.iter().any(|r| matches!(r, Reply::Failed));
        // One error per call: `call_lanes` counted a failed lane already.
        if !counted && (odd || failed_inside) {
            add(&self.counters.errors, 1);
        }
        out
    }

    /// Runs one pipeline per lane on the workers in parallel, all within one timeout; one
    /// result per job, in order, and whether an error was counted: a call with any failed
    /// lane counts one error (and one timeout if a lane timed out).
    #[allow(clippy::type_complexity)]
    fn call_lanes(
        &self,
        jobs: Vec<(ClusterPipeline, Option<Vec<Cmd>>)>,
    ) -> (Vec<Result<Vec<Reply>, ClusterTierError>>, bool) {
        let deadline = Instant::now() + self.cfg.timeout;
        let waiting: Vec<Result<Receiver<_>, ClusterTierError>> = jobs
            .into_iter()
            .map(|(pipe, singles)| {
                let (reply, rx) = mpsc::sync_channel(1);
                match self.jobs.try_send(Job { pipe, singles, deadline, reply }) {
                    Ok(()) => Ok(rx),
                    Err(TrySendError::Full(_)) => Err(ClusterTierError::Busy),
                    Err(TrySendError::Disconnected(_)) => Err(ClusterTierError::WorkerGone),
                }
            })
            .collect();
        let out: Vec<Result<Vec<Reply>, ClusterTierError>> = waiting
            .into_iter()
            .map(|w| {
                let rx = w?;
                match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                    Ok(r) => r,
                    Err(RecvTimeoutError::Timeout) => Err(ClusterTierError::Timeout {
                        timeout_ms: self.cfg.timeout.as_millis() as u64,
                    }),
                    Err(RecvTimeoutError::Disconnected) => Err(ClusterTierError::WorkerGone),
                }
            })
            .collect();
        let first_err = out.iter().find_map(|r| r.as_ref().err());
        if out.iter().any(|r| matches!(r, Err(ClusterTierError::Timeout { .. }))) {
            add(&self.counters.timeouts, 1);
        }
        if let Some(e) = first_err {
            add(&self.counters.errors, 1);
            log::debug!("kvswap cluster: {e}");
        }
        let counted = first_err.is_some();
        (out, counted)
    }
}

/// Owns one lane's cluster connection; runs jobs one at a time until the tier is dropped.
struct Worker {
    client: ClusterClient,
    conn: Option<ClusterConnection>,
    next_connect: Instant,
    cfg: ClusterTierConfig,
}

impl Worker {
    fn run(&mut self, rx: &Mutex<Receiver<Job>>) {
        // Ends when the ClusterTier (the only sender) is dropped. One idle worker at a time
        // waits in `recv` holding the lock; the others wait for the lock.
        loop {
            let job = {
                let Ok(rx) = rx.lock() else { return };
                match rx.recv() {
                    Ok(job) => job,
                    Err(_) => return,
                }
            };
            if Instant::now() >= job.deadline {
                continue; // its caller has given up already
            }
            let r = self.execute(&job);
            // The caller may have timed out meanwhile; then nobody wants the answer.
            let _ = job.reply.try_send(r);
        }
    }

    fn execute(&mut self, job: &Job) -> Result<Vec<Reply>, ClusterTierError> {
        let now = Instant::now();
        if self.conn.is_none() {
            if now < self.next_connect {
                return Err(ClusterTierError::Connect {
                    detail: "not connected (waiting to reconnect)".to_string(),
                });
            }
            match self.client.get_connection() {
                Ok(c) => self.conn = Some(c),
                Err(e) => {
                    self.next_connect = Instant::now() + self.cfg.reconnect_backoff;
                    return Err(ClusterTierError::Connect { detail: e.to_string() });
                }
            }
        }
        let Some(conn) = self.conn.as_mut() else {
            return Err(ClusterTierError::Connect { detail: "no connection".to_string() });
        };
        if !set_io_timeouts(conn, &self.cfg, job.deadline) {
            self.conn = None;
            return Err(ClusterTierError::Connect {
                detail: "setting socket timeouts".to_string(),
            });
        }
        let e = match job.pipe.query::<Vec<Value>>(conn) {
            Ok(v) => return Ok(v.into_iter().map(Reply::Value).collect()),
            Err(e) => e,
        };
        if connection_broken(&e) {
            // A fresh connection (and slot map) on the next call: the sync client does not
            // always drop a dead node's connection or refresh its slots after a failover.
            self.conn = None;
            return Err(ClusterTierError::Redis { detail: e.to_string() });
        }
        // The server refused a command of the batch (all replies were read, the connection
        // is in step). Small commands are retried one by one, so one key holding something
        // else fails only itself.
        let Some(singles) = &job.singles else {
            return Err(ClusterTierError::Redis { detail: e.to_string() });
        };
        let mut out = Vec::with_capacity(singles.len());
        for c in singles {
            if Instant::now() >= job.deadline || !set_io_timeouts(conn, &self.cfg, job.deadline) {
                out.push(Reply::Failed);
                continue;
            }
            match c.query::<Value>(conn) {
                Ok(v) => out.push(Reply::Value(v)),
                Err(e) if connection_broken(&e) => {
                    self.conn = None;
                    out.resize_with(singles.len(), || Reply::Failed);
                    break;
                }
                Err(_) => out.push(Reply::Refused),
            }
        }
        Ok(out)
    }
}

/// Whether the URLs are `rediss://` (TLS), all of them, or `redis://`, all of them; a URL
/// with a user or password is refused (credentials come from [`ClusterAccess`]).
fn url_scheme_is_tls(urls: &[String]) -> Result<bool, ClusterTierError> {
    let bad = |detail: String| ClusterTierError::BadConfig { detail };
    let mut tls = None;
    for u in urls {
        let (t, rest) = if let Some(r) = u.strip_prefix("rediss://") {
            (true, r)
        } else if let Some(r) = u.strip_prefix("redis://") {
            (false, r)
        } else {
            return Err(bad(format!("{u:?}: not a redis:// or rediss:// URL")));
        };
        if let Some((_, host)) = rest.rsplit_once('@') {
            return Err(bad(format!(
                "a URL carries a user or password (…@{host}): credentials come from \
                 {USERNAME_ENV}/{PASSWORD_ENV} or a password file, never the URL"
            )));
        }
        if *tls.get_or_insert(t) != t {
            return Err(bad("the URLs mix redis:// and rediss://".to_string()));
        }
    }
    Ok(tls.unwrap_or(false))
}

/// The error of a first connection that failed: a refused password and a failed TLS
/// handshake or certificate check are told apart from an unreachable cluster, and the URLs
/// are named. The client reports each node's error in one text (it has no finer kinds for
/// them), so the text is what is looked at.
fn connect_error(urls: &[String], tls: bool, e: &RedisError) -> ClusterTierError {
    let detail = e.to_string();
    let urls = urls.join(",");
    let has = |words: &[&str]| words.iter().any(|w| detail.contains(w));
    if e.kind() == redis::ErrorKind::AuthenticationFailed
        || has(&["WRONGPASS", "NOAUTH", "AuthenticationFailed", "invalid password"])
    {
        return ClusterTierError::Auth { urls, detail };
    }
    if has(&["certificate", "Certificate", "UnknownIssuer", "NotValidForName"]) {
        let hint = if detail.contains("UnknownIssuer") {
            "; is the CA that signed the nodes' certificates given (--kv-cluster-ca)?"
        } else {
            ""
        };
        return ClusterTierError::Tls { urls, detail, hint: hint.to_string() };
    }
    if tls && has(&["InvalidContentType", "CorruptMessage", "InvalidMessage", "HandshakeFailure"]) {
        return ClusterTierError::Tls {
            urls,
            detail,
            hint: "; do the nodes serve TLS on these ports?".to_string(),
        };
    }
    // A read timeout shows as EAGAIN ("Resource temporarily unavailable") on a socket with
    // SO_RCVTIMEO.
    let timed_out = e.is_timeout() || has(&["timed out", "TimedOut", "os error 11"]);
    let hint = if tls && timed_out {
        " (no answer to the TLS handshake: if the nodes serve plain TCP, use redis://)"
    } else if !tls && has(&["reset by peer", "Broken pipe", "dropped", "end of file", "EOF"]) {
        " (the node closed the connection: if it serves TLS, use rediss://)"
    } else {
        ""
    };
    ClusterTierError::Connect { detail: format!("{urls}: {detail}{hint}") }
}

/// Whether `e` leaves the connection or the slot map unusable (as opposed to the server
/// refusing one command).
fn connection_broken(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_cluster_error()
        || e.is_unrecoverable_error()
        || !matches!(e.kind(), redis::ErrorKind::Server(_) | redis::ErrorKind::Extension)
}

/// Per-node reads and writes get no more than what is left of the call.
fn set_io_timeouts(conn: &ClusterConnection, cfg: &ClusterTierConfig, deadline: Instant) -> bool {
    let left = deadline.saturating_duration_since(Instant::now());
    let io = cfg.response_timeout.min(left).max(Duration::from_millis(1));
    conn.set_read_timeout(Some(io)).is_ok() && conn.set_write_timeout(Some(io)).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cas::ModelDigest;
    use crate::geometry::KvGeometry;

    fn key(i: u32) -> BlockKey {
        BlockKey::chain(&ModelDigest::new("m", &KvGeometry::LLAMA31_8B), None, &[i])
    }

    #[test]
    fn value_round_trip_and_every_check() {
        let payload: Vec<u8> = (0..1000u32).map(|i| (i * 31 + 7) as u8).collect();
        let k = key(1);
        let v = encode_value(&k, &payload).unwrap();
        assert_eq!(v.len(), VALUE_HEADER_BYTES + payload.len());
        assert_eq!(&v[0..4], b"KVCB");
        assert_eq!(check_value(&k, &v, payload.len()), Some(payload.as_slice()));
        // Another key, another length, a truncated or extended value.
        assert_eq!(check_value(&key(2), &v, payload.len()), None);
        assert_eq!(check_value(&k, &v, payload.len() - 1), None);
        assert_eq!(check_value(&k, &v[..v.len() - 1], payload.len()), None);
        let mut longer = v.clone();
        longer.push(0);
        assert_eq!(check_value(&k, &longer, payload.len()), None);
        // Any flipped bit anywhere: header fields or payload.
        for pos in [0, 4, 6, 8, 39, 40, 44, 48, 500, v.len() - 1] {
            let mut bad = v.clone();
            bad[pos] ^= 0x10;
            assert_eq!(check_value(&k, &bad, payload.len()), None, "flip at {pos}");
        }
        for n in 0..VALUE_HEADER_BYTES {
            assert_eq!(check_value(&k, &v[..n], payload.len()), None, "header cut at {n}");
        }
        // An empty payload is a valid block of zero bytes.
        let e = encode_value(&k, &[]).unwrap();
        assert_eq!(check_value(&k, &e, 0), Some(&[][..]));
    }

    #[test]
    fn tier_is_shareable() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<ClusterTier>();
    }

    #[test]
    fn config_refused() {
        let urls = vec!["redis://127.0.0.1:1".to_string()];
        let bad = |cfg: ClusterTierConfig| {
            matches!(ClusterTier::connect(&urls, cfg), Err(ClusterTierError::BadConfig { .. }))
        };
        assert!(bad(ClusterTierConfig { namespace: "a{b}".into(), ..Default::default() }));
        assert!(bad(ClusterTierConfig { timeout: Duration::ZERO, ..Default::default() }));
        assert!(bad(ClusterTierConfig {
            ttl: Some(Duration::from_micros(10)),
            ..Default::default()
        }));
        assert!(bad(ClusterTierConfig { lanes: 0, ..Default::default() }));
        assert!(bad(ClusterTierConfig { lanes: LANES_MAX + 1, ..Default::default() }));
        assert!(matches!(
            ClusterTier::connect(&[], ClusterTierConfig::default()),
            Err(ClusterTierError::BadConfig { .. })
        ));
    }
}
