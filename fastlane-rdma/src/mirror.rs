//! Write mirror: ordered RDMA WRITEs of a primary into a replica's registered memory, for
//! the journal (and kvswap) to keep a second copy on another node.
//!
//! * [`Mirror::write`] posts the WRITEs and returns without waiting for them: they are
//!   pipelined, up to [`STAGING_SLOTS`] in flight, each from its own slice of the staging
//!   buffer (a slice is reused once the WRITE that read it completed). On one RC queue pair
//!   WRITEs are placed in the order posted. A failed WRITE breaks the connection and shows as
//!   the error of a later `write` or of `sync`.
//! * [`Mirror::sync`] is the durability step, and the only one: it returns when every
//!   earlier WRITE completed and, with [`Durability::ReadAfterWrite`], a small RDMA READ
//!   behind them was answered (a READ is answered only after the earlier WRITEs are placed),
//!   or with [`Durability::ReplicaAck`], a message the replica process answers after its
//!   `on_sync` hook ran (e.g. an msync) was answered. The request goes out right behind the
//!   WRITEs (one round trip for the lot, not one per WRITE plus one for the sync).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::buffer::RegisteredBuffer;
use crate::conn::{ConnectOptions, Connection, Listener};
use crate::error::{RdmaError, Result};
use crate::verbs::{Device, PollMode, SendOp};

/// Bytes at the end of the primary's buffer kept for the read-after-write target.
const SCRATCH: usize = 64;
/// WRITEs [`Mirror::write`] keeps in flight at most (the staging buffer is cut into this many
/// slices; fewer when the send queue is shallower).
pub const STAGING_SLOTS: usize = 8;
/// Receives the replica keeps posted.
const REPLICA_RECVS: usize = 16;

/// What [`Mirror::sync`] waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// An RDMA READ after the writes: the data is placed in the replica's memory.
    ReadAfterWrite,
    /// A SEND the replica process answers after its `on_sync` hook.
    ReplicaAck,
}

/// The primary side of a mirror.
#[derive(Debug)]
pub struct Mirror {
    conn: Connection,
    writes: u64,
    last: Option<(u64, usize)>,
    /// Bytes of one staging slice.
    slot_bytes: usize,
    /// Per slice, the wr_id of the WRITE that reads it (0: none); made once at connect.
    slots: Vec<u64>,
    next: usize,
}

impl Mirror {
    /// Connects to a [`MirrorReplica`] at `addr`. `options.buffer_len` is the staging size
    /// per WRITE (larger writes are split).
    pub fn connect(device: &Device, addr: SocketAddr, options: ConnectOptions) -> Result<Self> {
        let options = ConnectOptions {
            expose_buffer: false,
            buffer_len: options.buffer_len.max(SCRATCH * 2),
            ..options
        };
        let conn = Connection::connect(device, addr, options)?;
        if conn.remote().len == 0 {
            return Err(RdmaError::Protocol {
                op: "mirror connect",
                detail: "the replica exposed no memory".into(),
            });
        }
        // One request beside the WRITEs (the sync's READ or SEND) must always fit.
        let n = STAGING_SLOTS.min(conn.send_depth().saturating_sub(1).max(1) as usize);
        let slot_bytes = (conn.buffer().len() - SCRATCH) / n;
        Ok(Mirror { conn, writes: 0, last: None, slot_bytes, slots: vec![0; n], next: 0 })
    }

    /// Bytes of the replica's region.
    pub fn capacity(&self) -> u64 {
        self.conn.remote().len
    }

    /// Writes completed so far.
    pub fn writes(&self) -> u64 {
        self.writes
    }

    /// Writes `data` at `offset` of the replica's region, in order after every earlier
    /// write. Returns once the WRITEs are posted (module docs): only [`Mirror::sync`] says
    /// they arrived. Waits only for a staging slice to come free.
    pub fn write(&mut self, offset: u64, data: &[u8]) -> Result<()> {
        let region = self.conn.remote();
        region.checked_addr("mirror write", offset, data.len() as u64)?;
        for (i, part) in data.chunks(self.slot_bytes).enumerate() {
            let slot = self.next;
            self.next = (slot + 1) % self.slots.len();
            // The slice's previous WRITE must have read it before it is overwritten.
            if self.slots[slot] != 0 {
                self.conn.wait_send("mirror write", self.slots[slot])?;
                self.slots[slot] = 0;
            }
            let local = slot * self.slot_bytes;
            self.conn.buffer().write_at(local, part)?;
            let off = offset + (i * self.slot_bytes) as u64;
            let remote_addr = region.checked_addr("mirror write", off, part.len() as u64)?;
            let op = SendOp::Write { remote_addr, rkey: region.rkey, imm: None };
            self.slots[slot] = self.conn.post(op, local, part.len(), true)?;
        }
        if !data.is_empty() {
            self.last = Some((offset, data.len()));
        }
        self.writes += 1;
        Ok(())
    }

    /// Waits (bounded) until every request posted so far completed: the staging buffer is
    /// free, and any WRITE that failed has said so.
    fn drain(&mut self, op: &'static str) -> Result<()> {
        let posted = self.conn.posted();
        if posted > 0 {
            self.conn.wait_send(op, posted)?;
        }
        self.slots.fill(0);
        Ok(())
    }

    /// The durability step: returns when every earlier write is in the replica's memory
    /// (`ReadAfterWrite`) or acknowledged by the replica process (`ReplicaAck`).
    pub fn sync(&mut self, mode: Durability) -> Result<()> {
        let scratch = self.conn.buffer().len() - SCRATCH;
        match mode {
            Durability::ReadAfterWrite => {
                let Some((off, len)) = self.last else { return Ok(()) };
                // Read the last byte written: the READ is answered after the WRITEs before it.
                let region = self.conn.remote();
                let at = off + len as u64 - 1;
                // Completions come in order: the READ's covers every WRITE before it.
                self.conn.read_from(&region, scratch, at, 1)?;
                self.slots.fill(0);
                Ok(())
            }
            Durability::ReplicaAck => {
                let token = (self.writes as u32).wrapping_mul(2654435761) | 1;
                self.conn.post_recv(0, 0)?;
                self.conn.send(0, 0, Some(token))?;
                let timeout = self.conn.options().op_timeout;
                let c = self.conn.wait_recv(timeout)?;
                if c.imm != Some(token) {
                    return Err(RdmaError::Protocol {
                        op: "mirror sync",
                        detail: format!("ack {:?}, expected {token:#x}", c.imm),
                    });
                }
                // The SEND completed (`send` waits for it), and completions come in order.
                self.slots.fill(0);
                Ok(())
            }
        }
    }

    /// Reads back `out.len()` bytes at `offset` of the replica (an RDMA READ; for checks).
    pub fn read_back(&mut self, offset: u64, out: &mut [u8]) -> Result<()> {
        let region = self.conn.remote();
        region.checked_addr("mirror read", offset, out.len() as u64)?;
        // The READs land where WRITEs in flight may still read from.
        self.drain("mirror read")?;
        let chunk = self.conn.buffer().len() - SCRATCH;
        for (i, part) in out.chunks_mut(chunk).enumerate() {
            self.conn.read_from(&region, 0, offset + (i * chunk) as u64, part.len())?;
            self.conn.buffer().read_at(0, part)?;
        }
        Ok(())
    }
}

/// The replica side: listens, exposes `size` bytes to one primary at a time.
#[derive(Debug)]
pub struct MirrorReplica {
    device: Device,
    listener: Listener,
    size: usize,
    options: ConnectOptions,
}

impl MirrorReplica {
    /// Listens on `addr`; each accepted primary gets a fresh region of `size` bytes.
    pub fn bind(device: &Device, addr: SocketAddr, size: usize) -> Result<Self> {
        let options =
            ConnectOptions { buffer_len: size, expose_buffer: true, ..Default::default() };
        Ok(MirrorReplica { device: device.clone(), listener: Listener::bind(addr)?, size, options })
    }

    /// How sessions wait for the primary's requests: [`PollMode::Busy`] (the default: the
    /// lowest latency, a core kept busy) or [`PollMode::Event`] (sleep on the completion
    /// channel: one wake-up a request, no core spent while idle).
    pub fn with_poll(mut self, poll: PollMode) -> Self {
        self.options.poll = poll;
        self
    }

    /// The listening address.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Region size.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Waits up to `timeout` for a primary.
    pub fn accept(&self, timeout: Duration) -> Result<ReplicaSession> {
        let options = ConnectOptions { op_timeout: timeout, ..self.options };
        let mut conn = self.listener.accept(&self.device, options)?;
        for _ in 0..REPLICA_RECVS {
            conn.post_recv(0, 0)?;
        }
        Ok(ReplicaSession { conn, acks: 0 })
    }
}

/// One primary's mirror on the replica.
#[derive(Debug)]
pub struct ReplicaSession {
    conn: Connection,
    acks: u64,
}

impl ReplicaSession {
    /// The mirrored memory (read it with [`RegisteredBuffer::read_at`]).
    pub fn memory(&self) -> &RegisteredBuffer {
        self.conn.buffer()
    }

    /// Sync requests answered.
    pub fn acks(&self) -> u64 {
        self.acks
    }

    /// Answers sync requests until the primary goes away (`Ok`) or `stop` is set. Runs
    /// `on_sync(memory)` before each acknowledgement.
    pub fn serve(
        &mut self,
        stop: &AtomicBool,
        on_sync: &mut dyn FnMut(&RegisteredBuffer) -> Result<()>,
    ) -> Result<u64> {
        while !stop.load(Ordering::Relaxed) {
            let c = match self.conn.wait_recv(Duration::from_millis(200)) {
                Ok(c) => c,
                Err(RdmaError::Timeout { .. }) => continue,
                Err(RdmaError::PeerGone { .. }) => break,
                Err(e) => return Err(e),
            };
            let Some(token) = c.imm else {
                return Err(RdmaError::Protocol {
                    op: "replica",
                    detail: "sync request without immediate data".into(),
                });
            };
            on_sync(self.conn.buffer())?;
            self.conn.post_recv(0, 0)?;
            self.conn.send(0, 0, Some(token))?;
            self.acks += 1;
        }
        Ok(self.acks)
    }
}
