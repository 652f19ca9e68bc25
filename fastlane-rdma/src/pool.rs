//! Remote memory pool: a server registers nothing up front but owns one big mapping; each
//! client grant registers its own sub-range (its own rkey), so the server's device refuses
//! any access outside what was granted. Clients WRITE/READ their ranges directly.
//!
//! Control messages (grant, release) travel on the connection's TCP socket:
//! request `[op u8, 0 × 7, arg u64 LE]`, reply `[status u8, 0 × 3, rkey u32, id u64, addr
//! u64, len u64]` (all little endian).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use crate::buffer::Mapping;
use crate::conn::{peer_io, ConnectOptions, Connection, Listener, RemoteRegion};
use crate::error::{RdmaError, Result};
use crate::verbs::{Access, Device, MemoryRegion, ProtectionDomain};

const OP_GRANT: u8 = 1;
const OP_RELEASE: u8 = 2;
const REQ_LEN: usize = 16;
const REP_LEN: usize = 32;
const ST_OK: u8 = 0;
const ST_FULL: u8 = 1;
const ST_BAD: u8 = 2;
const ST_UNKNOWN: u8 = 3;

/// Grants are rounded up to and aligned on this many bytes.
pub const GRANT_ALIGN: u64 = 4096;
/// Grants one client may hold at once.
pub const GRANTS_PER_CLIENT_MAX: usize = 4096;

/// A granted range of the pool: what a client needs to WRITE/READ it.
///
/// The fields are public because they are only numbers from the server: forging a `Range`
/// cannot reach memory the server did not grant (its device checks the rkey and bounds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range {
    /// Server-side grant id (for release).
    pub id: u64,
    /// Remote region (address, length, rkey).
    pub region: RemoteRegion,
}

impl Range {
    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.region.len
    }

    /// Whether it is empty (never, for a real grant).
    pub fn is_empty(&self) -> bool {
        self.region.len == 0
    }
}

/// First-fit allocator over `[0, size)` in GRANT_ALIGN units; free extents kept sorted.
#[derive(Debug)]
struct Extents {
    free: Vec<(u64, u64)>,
}

impl Extents {
    fn new(size: u64) -> Self {
        Extents { free: vec![(0, size)] }
    }

    fn alloc(&mut self, len: u64) -> Option<u64> {
        let i = self.free.iter().position(|&(_, l)| l >= len)?;
        let (off, l) = self.free[i];
        if l == len {
            self.free.remove(i);
        } else {
            self.free[i] = (off + len, l - len);
        }
        Some(off)
    }

    fn release(&mut self, off: u64, len: u64) {
        let i = self.free.partition_point(|&(o, _)| o < off);
        self.free.insert(i, (off, len));
        // Merge with the next, then with the previous.
        if i + 1 < self.free.len() && self.free[i].0 + self.free[i].1 == self.free[i + 1].0 {
            self.free[i].1 += self.free[i + 1].1;
            self.free.remove(i + 1);
        }
        if i > 0 && self.free[i - 1].0 + self.free[i - 1].1 == self.free[i].0 {
            self.free[i - 1].1 += self.free[i].1;
            self.free.remove(i);
        }
    }

    fn free_bytes(&self) -> u64 {
        self.free.iter().map(|&(_, l)| l).sum()
    }
}

struct Grant {
    // Field order is drop order: the registration goes before the memory's Arc.
    _mr: MemoryRegion,
    offset: u64,
    len: u64,
    _memory: Arc<Mapping>,
}

struct PoolShared {
    memory: Arc<Mapping>,
    pd: ProtectionDomain,
    extents: Mutex<Extents>,
    next_id: AtomicU64,
    clients: AtomicU64,
    /// Counters for [`PoolMonitor`] (control path only: grants and connections).
    clients_total: AtomicU64,
    setup_failures: AtomicU64,
    grants: AtomicU64,
    grants_refused: AtomicU64,
}

/// A pool server's counters at one moment ([`PoolMonitor::stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolStats {
    /// Bytes mapped for the pool.
    pub size_bytes: u64,
    /// Bytes not granted.
    pub free_bytes: u64,
    /// Clients connected now.
    pub clients: u64,
    /// Clients whose connection was set up, since start.
    pub clients_total: u64,
    /// Connections whose setup (queue pair exchange) failed.
    pub setup_failures: u64,
    /// Grants (registered regions) held by clients now.
    pub grants: u64,
    /// Grants handed out since start.
    pub grants_total: u64,
    /// Grant requests refused (pool full, bad length, too many grants for one client).
    pub grants_refused: u64,
}

/// A handle on a [`PoolServer`]'s counters that another thread (a metrics exporter) reads
/// while the server serves; it keeps the pool's mapping alive as long as it lives.
#[derive(Clone)]
pub struct PoolMonitor {
    shared: Arc<PoolShared>,
}

impl std::fmt::Debug for PoolMonitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolMonitor").field("stats", &self.stats()).finish()
    }
}

impl PoolMonitor {
    /// The counters now (relaxed reads: each is exact, the set is not one snapshot).
    pub fn stats(&self) -> PoolStats {
        let s = &self.shared;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        PoolStats {
            size_bytes: s.memory.len() as u64,
            free_bytes: s.free_bytes(),
            clients: l(&s.clients),
            clients_total: l(&s.clients_total),
            setup_failures: l(&s.setup_failures),
            grants: l(&s.grants),
            // Ids start at 1 and are taken once per grant handed out.
            grants_total: l(&s.next_id).saturating_sub(1),
            grants_refused: l(&s.grants_refused),
        }
    }
}

impl PoolShared {
    fn free_bytes(&self) -> u64 {
        self.extents.lock().map(|x| x.free_bytes()).unwrap_or(0)
    }

    fn grant(&self, len: u64, grants: &mut HashMap<u64, Grant>) -> std::result::Result<Range, u8> {
        if len == 0 || grants.len() >= GRANTS_PER_CLIENT_MAX {
            return Err(ST_BAD);
        }
        let len = len.checked_add(GRANT_ALIGN - 1).ok_or(ST_BAD)? / GRANT_ALIGN * GRANT_ALIGN;
        let offset = self.extents.lock().map_err(|_| ST_BAD)?.alloc(len).ok_or(ST_FULL)?;
        // SAFETY: `offset + len <= size` (the allocator hands out ranges of the mapping); the
        // mapping is kept alive by the Arc stored in the Grant, dropped after the
        // registration (field order), so it outlives the rkey and every peer access through it.
        let mr = unsafe {
            MemoryRegion::register(
                &self.pd,
                self.memory.as_ptr().wrapping_add(offset as usize),
                len as usize,
                Access::REMOTE_RW,
            )
        };
        let mr = match mr {
            Ok(mr) => mr,
            Err(e) => {
                log::warn!("pool: registering {len} bytes failed: {e}");
                if let Ok(mut x) = self.extents.lock() {
                    x.release(offset, len);
                }
                return Err(ST_FULL);
            }
        };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let region = RemoteRegion { addr: mr.addr(), len, rkey: mr.rkey() };
        grants.insert(id, Grant { _mr: mr, offset, len, _memory: self.memory.clone() });
        self.grants.fetch_add(1, Ordering::Relaxed);
        Ok(Range { id, region })
    }

    fn release(&self, grant: Grant) {
        let (offset, len) = (grant.offset, grant.len);
        drop(grant); // deregister first: from here the client's rkey is dead
        if let Ok(mut x) = self.extents.lock() {
            x.release(offset, len);
        }
        self.grants.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The pool server: one mapping, grants registered per client request.
pub struct PoolServer {
    shared: Arc<PoolShared>,
    device: Device,
    listener: Listener,
    options: ConnectOptions,
}

impl std::fmt::Debug for PoolServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolServer").field("size", &self.shared.memory.len()).finish()
    }
}

impl PoolServer {
    /// Maps `size` bytes on `device` and listens on `addr`.
    pub fn bind(device: &Device, addr: SocketAddr, size: u64) -> Result<Self> {
        let size = usize::try_from(size).map_err(|_| RdmaError::InvalidArgument {
            op: "PoolServer::bind",
            detail: format!("size {size} too large"),
        })?;
        let memory = Arc::new(Mapping::new(size)?);
        let pd = device.alloc_pd()?;
        let shared = Arc::new(PoolShared {
            extents: Mutex::new(Extents::new(size as u64 / GRANT_ALIGN * GRANT_ALIGN)),
            memory,
            pd,
            next_id: AtomicU64::new(1),
            clients: AtomicU64::new(0),
            clients_total: AtomicU64::new(0),
            setup_failures: AtomicU64::new(0),
            grants: AtomicU64::new(0),
            grants_refused: AtomicU64::new(0),
        });
        // The server's own connection buffer is small: clients never touch it.
        let options = ConnectOptions { buffer_len: 4096, ..ConnectOptions::default() };
        Ok(PoolServer { shared, device: device.clone(), listener: Listener::bind(addr)?, options })
    }

    /// The listening address.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Pool size in bytes.
    pub fn size(&self) -> u64 {
        self.shared.memory.len() as u64
    }

    /// Bytes not granted.
    pub fn free_bytes(&self) -> u64 {
        self.shared.free_bytes()
    }

    /// Clients connected now.
    pub fn clients(&self) -> u64 {
        self.shared.clients.load(Ordering::Relaxed)
    }

    /// A handle on the counters, for another thread while [`serve`](Self::serve) runs.
    pub fn monitor(&self) -> PoolMonitor {
        PoolMonitor { shared: self.shared.clone() }
    }

    /// Serves until `stop` is set: one thread per client; a client's grants are released
    /// when its socket closes. Checks `stop` at least every 200 ms.
    pub fn serve(&self, stop: &AtomicBool) -> Result<()> {
        let mut workers = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            let Some(stream) = self.listener.accept_tcp(Duration::from_millis(200))? else {
                workers.retain(|w: &thread::JoinHandle<()>| !w.is_finished());
                continue;
            };
            let conn = match Connection::accept_stream_in(
                &self.device,
                &self.shared.pd,
                stream,
                self.options,
            ) {
                Ok(c) => c,
                Err(e) => {
                    log::warn!("pool: client setup failed: {e}");
                    self.shared.setup_failures.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
            };
            let shared = self.shared.clone();
            shared.clients.fetch_add(1, Ordering::Relaxed);
            shared.clients_total.fetch_add(1, Ordering::Relaxed);
            workers.push(thread::spawn(move || {
                if let Err(e) = serve_client(&shared, conn) {
                    log::info!("pool: client ended: {e}");
                }
                shared.clients.fetch_sub(1, Ordering::Relaxed);
            }));
        }
        for w in workers {
            let _ = w.join();
        }
        Ok(())
    }
}

fn serve_client(shared: &PoolShared, conn: Connection) -> Result<()> {
    let mut grants: HashMap<u64, Grant> = HashMap::new();
    let mut s = conn.stream();
    // Idle clients are fine: no read timeout here; EOF ends the loop.
    s.set_read_timeout(None).map_err(|source| RdmaError::Io { op: "pool", source })?;
    let result = loop {
        let mut req = [0u8; REQ_LEN];
        if let Err(e) = s.read_exact(&mut req) {
            break Err(peer_io("pool request", e));
        }
        let mut arg = [0u8; 8];
        arg.copy_from_slice(&req[8..16]);
        let arg = u64::from_le_bytes(arg);
        let mut rep = [0u8; REP_LEN];
        match req[0] {
            OP_GRANT => match shared.grant(arg, &mut grants) {
                Ok(r) => {
                    rep[4..8].copy_from_slice(&r.region.rkey.to_le_bytes());
                    rep[8..16].copy_from_slice(&r.id.to_le_bytes());
                    rep[16..24].copy_from_slice(&r.region.addr.to_le_bytes());
                    rep[24..32].copy_from_slice(&r.region.len.to_le_bytes());
                }
                Err(st) => {
                    shared.grants_refused.fetch_add(1, Ordering::Relaxed);
                    rep[0] = st;
                }
            },
            OP_RELEASE => match grants.remove(&arg) {
                Some(g) => shared.release(g),
                None => rep[0] = ST_UNKNOWN,
            },
            _ => rep[0] = ST_BAD,
        }
        if let Err(e) = s.write_all(&rep) {
            break Err(peer_io("pool reply", e));
        }
    };
    // The client is gone: destroy its QP first, then free its grants.
    drop(conn);
    for (_, g) in grants.drain() {
        shared.release(g);
    }
    result
}

/// A client of a [`PoolServer`].
#[derive(Debug)]
pub struct RemotePool {
    conn: Connection,
}

impl RemotePool {
    /// Connects to the pool at `addr` with a 1 MiB staging buffer.
    pub fn connect(device: &Device, addr: SocketAddr) -> Result<Self> {
        Self::connect_with(device, addr, ConnectOptions::default())
    }

    /// Connects with explicit options (`buffer_len` is the staging size per transfer).
    pub fn connect_with(
        device: &Device,
        addr: SocketAddr,
        options: ConnectOptions,
    ) -> Result<Self> {
        let options = ConnectOptions { expose_buffer: false, ..options };
        Ok(RemotePool { conn: Connection::connect(device, addr, options)? })
    }

    fn call(&mut self, op: u8, arg: u64) -> Result<[u8; REP_LEN]> {
        let mut req = [0u8; REQ_LEN];
        req[0] = op;
        req[8..16].copy_from_slice(&arg.to_le_bytes());
        let mut s = self.conn.stream();
        s.write_all(&req).map_err(|e| peer_io("pool request", e))?;
        let mut rep = [0u8; REP_LEN];
        s.read_exact(&mut rep).map_err(|e| peer_io("pool reply", e))?;
        Ok(rep)
    }

    /// Asks for `len` bytes (rounded up to [`GRANT_ALIGN`]).
    pub fn grant(&mut self, len: u64) -> Result<Range> {
        let rep = self.call(OP_GRANT, len)?;
        match rep[0] {
            ST_OK => {}
            ST_FULL => return Err(RdmaError::PoolFull { requested: len }),
            st => {
                return Err(RdmaError::Protocol {
                    op: "pool grant",
                    detail: format!("server refused {len} bytes (status {st})"),
                })
            }
        }
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&rep[i..i + 8]);
            u64::from_le_bytes(a)
        };
        let rkey = u32::from_le_bytes([rep[4], rep[5], rep[6], rep[7]]);
        let region = RemoteRegion { addr: u64_at(16), len: u64_at(24), rkey };
        if region.len < len || region.addr.checked_add(region.len).is_none() {
            return Err(RdmaError::Protocol {
                op: "pool grant",
                detail: format!("grant of {} bytes for {len} asked", region.len),
            });
        }
        Ok(Range { id: u64_at(8), region })
    }

    /// Gives a range back; its rkey stops working.
    pub fn release(&mut self, range: Range) -> Result<()> {
        let rep = self.call(OP_RELEASE, range.id)?;
        if rep[0] != ST_OK {
            return Err(RdmaError::Protocol {
                op: "pool release",
                detail: format!("unknown grant {}", range.id),
            });
        }
        Ok(())
    }

    /// Writes `data` at `offset` of `range` (staged through the connection buffer, in
    /// chunks of its size). Returns when the server's device acknowledged the last chunk.
    pub fn write(&mut self, range: &Range, offset: u64, data: &[u8]) -> Result<()> {
        range.region.checked_addr("pool write", offset, data.len() as u64)?;
        let chunk = self.conn.buffer().len();
        for (i, part) in data.chunks(chunk).enumerate() {
            self.conn.buffer().write_at(0, part)?;
            let off = offset + (i * chunk) as u64;
            self.conn.write_to(&range.region, 0, off, part.len(), None)?;
        }
        Ok(())
    }

    /// Reads `out.len()` bytes at `offset` of `range`.
    pub fn read(&mut self, range: &Range, offset: u64, out: &mut [u8]) -> Result<()> {
        range.region.checked_addr("pool read", offset, out.len() as u64)?;
        let chunk = self.conn.buffer().len();
        for (i, part) in out.chunks_mut(chunk).enumerate() {
            let off = offset + (i * chunk) as u64;
            self.conn.read_from(&range.region, 0, off, part.len())?;
            self.conn.buffer().read_at(0, part)?;
        }
        Ok(())
    }

    /// The underlying connection (for zero-copy use of its buffer, or raw verbs).
    pub fn connection(&mut self) -> &mut Connection {
        &mut self.conn
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extents_first_fit_and_merge() {
        let mut x = Extents::new(16 * GRANT_ALIGN);
        let a = x.alloc(4 * GRANT_ALIGN).unwrap();
        let b = x.alloc(4 * GRANT_ALIGN).unwrap();
        let c = x.alloc(8 * GRANT_ALIGN).unwrap();
        assert_eq!((a, b, c), (0, 4 * GRANT_ALIGN, 8 * GRANT_ALIGN));
        assert!(x.alloc(GRANT_ALIGN).is_none());
        x.release(b, 4 * GRANT_ALIGN);
        x.release(a, 4 * GRANT_ALIGN);
        assert_eq!(x.free, vec![(0, 8 * GRANT_ALIGN)]);
        x.release(c, 8 * GRANT_ALIGN);
        assert_eq!(x.free, vec![(0, 16 * GRANT_ALIGN)]);
        assert_eq!(x.free_bytes(), 16 * GRANT_ALIGN);
    }
}
