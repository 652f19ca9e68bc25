//! Write mirror: ordered RDMA WRITEs of a primary into a replica's registered memory, for
//! the journal (and kvswap) to keep a second copy on another node.
//!
//! * [`Mirror::write`] returns when the replica's device acknowledged the WRITE. On one RC
//!   queue pair WRITEs are placed in the order posted, so a returned `write` also covers all
//!   earlier ones. With soft-RoCE the bytes are in the replica's memory at that point.
//! * [`Mirror::sync`] is the explicit durability step, for hardware whose acknowledgement
//!   may precede placement, or for callers that need the replica process to have seen the
//!   data: [`Durability::ReadAfterWrite`] issues a small RDMA READ behind the writes (a READ
//!   is answered only after the earlier WRITEs are placed); [`Durability::ReplicaAck`] sends
//!   a message the replica process answers after its `on_sync` hook ran (e.g. an msync).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::buffer::RegisteredBuffer;
use crate::conn::{ConnectOptions, Connection, Listener};
use crate::error::{RdmaError, Result};
use crate::verbs::Device;

/// Bytes at the end of the primary's buffer kept for the read-after-write target.
const SCRATCH: usize = 64;
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
        Ok(Mirror { conn, writes: 0, last: None })
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
    /// write; returns when the replica's device acknowledged it.
    pub fn write(&mut self, offset: u64, data: &[u8]) -> Result<()> {
        let region = self.conn.remote();
        region.checked_addr("mirror write", offset, data.len() as u64)?;
        let chunk = self.conn.buffer().len() - SCRATCH;
        for (i, part) in data.chunks(chunk).enumerate() {
            // The previous chunk's WRITE completed (it was waited for), so the staging bytes
            // are free to reuse.
            self.conn.buffer().write_at(0, part)?;
            let off = offset + (i * chunk) as u64;
            self.conn.write_to(&region, 0, off, part.len(), None)?;
        }
        if !data.is_empty() {
            self.last = Some((offset, data.len()));
        }
        self.writes += 1;
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
                self.conn.read_from(&region, scratch, at, 1)
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
                Ok(())
            }
        }
    }

    /// Reads back `out.len()` bytes at `offset` of the replica (an RDMA READ; for checks).
    pub fn read_back(&mut self, offset: u64, out: &mut [u8]) -> Result<()> {
        let region = self.conn.remote();
        region.checked_addr("mirror read", offset, out.len() as u64)?;
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
