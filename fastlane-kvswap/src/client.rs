//! A Rust client of `fastlane kv serve` (the protocol of [`crate::proto`]).
// Reads a server's replies: errors, not panics.
#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use memmap2::{MmapOptions, MmapRaw};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use crate::proto::{
    self, located, ErrorCode, Header, HelloReply, Key, ProtoError, Request, HEADER_LEN, PAYLOAD_MAX,
};

/// What went wrong on the client side.
#[derive(Debug, thiserror::Error)]
pub enum KvClientError {
    /// Socket or mapping failure.
    #[error("kv client I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The server answered with an error status.
    #[error("server error {code:?}: {detail}")]
    Server {
        /// The status.
        code: ErrorCode,
        /// Its message.
        detail: String,
    },
    /// The reply did not parse.
    #[error("bad reply: {0}")]
    BadReply(&'static str),
}

/// Where a sequence is, as `LOOKUP` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lookup {
    /// 0 resident, 1 swapping out, 2 out, 3 spilling, 4 swapping in.
    pub phase: u8,
    /// 0 host, 1 nvme, 2 remote, 255 none.
    pub tier: u8,
    /// Blocks in the swapped-out copy.
    pub blocks_out: u32,
    /// Device blocks the sequence holds.
    pub device_blocks: u32,
}

/// Where `EXISTS` found a key's block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Where {
    /// On no tier.
    Absent,
    /// In the server's host memory.
    Host,
    /// On the server's NVMe tier.
    Nvme,
    /// In the shared cluster (a hint: a later `GET` may still miss).
    Cluster,
}

/// What a client asks for at `HELLO`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HelloOptions {
    /// Blocks wanted in this connection's slab of the device pool; 0: the server's default.
    pub blocks: u32,
    /// Namespace; empty: the server's default for this peer (`uid:<uid>`).
    pub namespace: String,
}

/// A connection, with its own slab of the server's device pool mapped.
#[derive(Debug)]
pub struct KvClient {
    stream: UnixStream,
    next_id: u32,
    block_bytes: usize,
    first_block: u32,
    blocks: u32,
    namespace: String,
    /// This connection's slab (MAP_SHARED of the memfd the server made for it), unmapped on
    /// drop.
    map: MmapRaw,
    _fd: OwnedFd,
}

// SAFETY: the mapping is owned by the client; access goes through raw-pointer copies.
unsafe impl Send for KvClient {}

impl KvClient {
    /// Connects and does the handshake with the server's default slab size and namespace.
    pub fn connect(path: &Path) -> Result<KvClient, KvClientError> {
        KvClient::connect_with(path, &HelloOptions::default())
    }

    /// Connects, sends `HELLO` with `opts` and maps the slab's memfd from the reply. A
    /// refusal (credentials, namespace, slab size, protocol version) is
    /// [`KvClientError::Server`] with the server's message.
    pub fn connect_with(path: &Path, opts: &HelloOptions) -> Result<KvClient, KvClientError> {
        let stream = UnixStream::connect(path)?;
        stream.set_read_timeout(Some(Duration::from_secs(120)))?;
        let hello = Request::Hello { blocks: opts.blocks, namespace: opts.namespace.clone() };
        // A refused peer may find the socket closed under its HELLO: read the answer anyway.
        let sent = (&stream).write_all(&hello.encode(0));
        let mut buf = vec![0u8; HEADER_LEN + PAYLOAD_MAX];
        // A reply with more than one fd, or a truncated control message, is an error
        // (ENOBUFS) and its fds are closed.
        let (mut got, fd) = match stream.recv_with_fd(&mut buf[..HEADER_LEN + 256]) {
            Ok(r) => r,
            Err(e) => return Err(sent.err().unwrap_or_else(|| std::io::Error::from(e)).into()),
        };
        let fd = fd.map(OwnedFd::from);
        if let Some(fd) = &fd {
            // vmm-sys-util's recvmsg passes no MSG_CMSG_CLOEXEC: close the fd on exec from
            // here on, so a child the caller spawns does not keep the slab alive.
            // SAFETY:
            // - `fd` is an open descriptor we own; F_SETFD only changes its close-on-exec flag.
            if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) } != 0 {
                return Err(std::io::Error::last_os_error().into());
            }
        }
        while got < HEADER_LEN {
            let n = (&stream).read(&mut buf[got..HEADER_LEN])?;
            if n == 0 {
                if let Err(e) = sent {
                    return Err(e.into());
                }
                return Err(KvClientError::BadReply(
                    "server closed the connection during HELLO (a server of protocol version 1 \
                     closes a version 2 HELLO)",
                ));
            }
            got += n;
        }
        let h = Header::decode(&buf[..HEADER_LEN]).map_err(|e| match e {
            ProtoError::BadVersion(_) => {
                KvClientError::BadReply("HELLO reply in another protocol version")
            }
            _ => KvClientError::BadReply("header"),
        })?;
        if h.op != proto::op::HELLO | proto::REPLY {
            return Err(KvClientError::BadReply("reply does not match HELLO"));
        }
        let end = HEADER_LEN + h.len as usize;
        if got < end {
            (&stream).read_exact(&mut buf[got..end])?;
        }
        let p = check(&buf[HEADER_LEN..end])?;
        let fd = fd.ok_or(KvClientError::BadReply("HELLO reply without a file descriptor"))?;
        let r = HelloReply::decode(p).map_err(|_| KvClientError::BadReply("HELLO payload"))?;
        let map_len =
            usize::try_from(r.map_len).map_err(|_| KvClientError::BadReply("slab size"))?;
        let block_bytes =
            usize::try_from(r.block_bytes).map_err(|_| KvClientError::BadReply("block size"))?;
        let map = MmapOptions::new().len(map_len).map_raw(&fd)?;
        Ok(KvClient {
            stream,
            next_id: 1,
            block_bytes,
            first_block: r.first_block,
            blocks: r.blocks,
            namespace: r.namespace,
            map,
            _fd: fd,
        })
    }

    /// Bytes per device block.
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// Blocks in this connection's slab.
    pub fn blocks(&self) -> u32 {
        self.blocks
    }

    /// The (pool-wide) block ids of this connection's slab: every block `ALLOC` gives it is
    /// in here, and the mapping holds these blocks and no others.
    pub fn slab(&self) -> std::ops::Range<u32> {
        self.first_block..self.first_block + self.blocks
    }

    /// The namespace the server put this connection in.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// Offset of `block` in the mapping, for a block of the slab and `len` at most a block.
    fn offset(&self, block: u32, len: usize) -> usize {
        assert!(
            self.slab().contains(&block) && len <= self.block_bytes,
            "block {block} is not in this connection's slab {:?}",
            self.slab()
        );
        (block - self.first_block) as usize * self.block_bytes
    }

    /// Copies `data` (at most one block) into device block `block` (a block of this
    /// connection's slab; others are not mapped: panics). Only meaningful for blocks this
    /// client owns and that no transfer pins.
    pub fn write_block(&mut self, block: u32, data: &[u8]) {
        let off = self.offset(block, data.len());
        // SAFETY: `offset` checked the block is in the slab, so the offset is inside the
        // mapping.
        let dst = unsafe { self.map.as_mut_ptr().add(off) };
        // SAFETY: dst..dst+len is inside the mapping; shared memory the server reads only while
        // the block is pinned by a swap-out, which the caller does not overlap with writes.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) };
    }

    /// Copies device block `block` (of this connection's slab; panics otherwise) into `out`
    /// (at most one block).
    pub fn read_block(&self, block: u32, out: &mut [u8]) {
        let off = self.offset(block, out.len());
        // SAFETY: `offset` checked the block is in the slab, so the offset is inside the
        // mapping.
        let src = unsafe { self.map.as_mut_ptr().add(off) };
        // SAFETY: src..src+len is inside the mapping; out is a distinct Rust buffer.
        unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), out.len()) };
    }

    /// Sends a request and returns the reply payload after the status.
    pub fn call(&mut self, req: &Request) -> Result<Vec<u8>, KvClientError> {
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);
        self.stream.write_all(&req.encode(id))?;
        let mut hb = [0u8; HEADER_LEN];
        self.stream.read_exact(&mut hb)?;
        let h = Header::decode(&hb).map_err(|_| KvClientError::BadReply("header"))?;
        if h.op != req.op() | proto::REPLY || h.req_id != id || h.len as usize > PAYLOAD_MAX {
            return Err(KvClientError::BadReply("reply does not match request"));
        }
        let mut p = vec![0u8; h.len as usize];
        self.stream.read_exact(&mut p)?;
        Ok(check(&p)?.to_vec())
    }

    /// Raw bytes on the socket (tests of hostile input).
    pub fn send_raw(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.stream.write_all(bytes)
    }

    /// Takes `n` device blocks for `seq`.
    pub fn alloc(&mut self, seq: u32, n: u32) -> Result<Vec<u32>, KvClientError> {
        let p = self.call(&Request::Alloc { seq, n })?;
        let n = u32_at(&p, 0)? as usize;
        if p.len() != 4 + 4 * n {
            return Err(KvClientError::BadReply("ALLOC payload"));
        }
        (0..n).map(|i| u32_at(&p, 4 + 4 * i)).collect()
    }

    /// Gives blocks back.
    pub fn free(&mut self, seq: u32, blocks: &[u32]) -> Result<(), KvClientError> {
        self.call(&Request::Free { seq, blocks: blocks.to_vec() }).map(|_| ())
    }

    /// Where `seq` is.
    pub fn lookup(&mut self, seq: u32) -> Result<Lookup, KvClientError> {
        let p = self.call(&Request::Lookup { seq })?;
        if p.len() != 12 {
            return Err(KvClientError::BadReply("LOOKUP payload"));
        }
        Ok(Lookup {
            phase: p[0],
            tier: p[1],
            blocks_out: u32_at(&p, 4)?,
            device_blocks: u32_at(&p, 8)?,
        })
    }

    /// Starts a swap-out; returns the ticket.
    pub fn prepare_store(&mut self, seq: u32, blocks: &[u32]) -> Result<u64, KvClientError> {
        ticket(&self.call(&Request::PrepareStore { seq, blocks: blocks.to_vec() })?)
    }

    /// Starts a swap-in; returns the ticket.
    pub fn prepare_load(&mut self, seq: u32, blocks: &[u32]) -> Result<u64, KvClientError> {
        ticket(&self.call(&Request::PrepareLoad { seq, blocks: blocks.to_vec() })?)
    }

    /// Waits for a ticket (swap-out: `complete_store`; swap-in: `complete_load`).
    pub fn complete(&mut self, ticket: u64, timeout: Duration) -> Result<(), KvClientError> {
        let timeout_ms = timeout.as_millis().min(u128::from(u32::MAX)) as u32;
        self.call(&Request::Complete { ticket, timeout_ms }).map(|_| ())
    }

    /// Marks `seq` used.
    pub fn touch(&mut self, seq: u32) -> Result<(), KvClientError> {
        self.call(&Request::Touch { seq }).map(|_| ())
    }

    /// Forgets `seq`.
    pub fn drop_seq(&mut self, seq: u32) -> Result<(), KvClientError> {
        self.call(&Request::Drop { seq }).map(|_| ())
    }

    /// Cancels a ticket.
    pub fn cancel(&mut self, ticket: u64) -> Result<(), KvClientError> {
        self.call(&Request::Cancel { ticket }).map(|_| ())
    }

    /// Copies each `(key, block)`'s device block (held by a sequence of this connection, no
    /// transfer in flight) into the server's content-addressed store under `key`, shared with
    /// the connections of this namespace. Per key: `true` stored, `false` refused.
    pub fn put(&mut self, items: &[(Key, u32)]) -> Result<Vec<bool>, KvClientError> {
        let p = self.call(&Request::Put { items: items.to_vec() })?;
        flags(&p, items.len())
    }

    /// For each `(key, block)`: on a hit the block now holds the stored bytes (`true`), on a
    /// miss it is untouched (`false`). Blocks as for [`KvClient::put`], each named once.
    pub fn get(&mut self, items: &[(Key, u32)]) -> Result<Vec<bool>, KvClientError> {
        let p = self.call(&Request::Get { items: items.to_vec() })?;
        flags(&p, items.len())
    }

    /// Where each key's block is in this namespace.
    pub fn exists(&mut self, keys: &[Key]) -> Result<Vec<Where>, KvClientError> {
        let p = self.call(&Request::Exists { keys: keys.to_vec() })?;
        per_key(&p, keys.len())?
            .iter()
            .map(|c| match *c {
                located::ABSENT => Ok(Where::Absent),
                located::HOST => Ok(Where::Host),
                located::NVME => Ok(Where::Nvme),
                located::CLUSTER => Ok(Where::Cluster),
                _ => Err(KvClientError::BadReply("EXISTS: unknown tier")),
            })
            .collect()
    }

    /// Pins each key's block in the server's host memory for this connection (never evicted
    /// until as many [`KvClient::unpin`]s or this connection closes). Per key: `true` pinned,
    /// `false` on no tier or no room.
    pub fn pin(&mut self, keys: &[Key]) -> Result<Vec<bool>, KvClientError> {
        let p = self.call(&Request::Pin { keys: keys.to_vec() })?;
        flags(&p, keys.len())
    }

    /// Releases one of this connection's pins of each key; `false` where it holds none.
    pub fn unpin(&mut self, keys: &[Key]) -> Result<Vec<bool>, KvClientError> {
        let p = self.call(&Request::Unpin { keys: keys.to_vec() })?;
        flags(&p, keys.len())
    }

    /// Removes each key's block from the server's own tiers; `false` where it is absent or
    /// pinned (by any connection). Copies in a shared cluster stay.
    pub fn evict(&mut self, keys: &[Key]) -> Result<Vec<bool>, KvClientError> {
        let p = self.call(&Request::Evict { keys: keys.to_vec() })?;
        flags(&p, keys.len())
    }

    /// `(capacity, used)` bytes per tier (host, nvme, remote), device free and pinned blocks.
    #[allow(clippy::type_complexity)]
    pub fn stats(&mut self) -> Result<([(u64, u64); 3], u32, u32), KvClientError> {
        let p = self.call(&Request::Stats)?;
        if p.len() != 56 {
            return Err(KvClientError::BadReply("STATS payload"));
        }
        let tiers = [
            (u64_at(&p, 0)?, u64_at(&p, 8)?),
            (u64_at(&p, 16)?, u64_at(&p, 24)?),
            (u64_at(&p, 32)?, u64_at(&p, 40)?),
        ];
        Ok((tiers, u32_at(&p, 48)?, u32_at(&p, 52)?))
    }
}

/// The little-endian `u32` at byte `i` of a reply; a reply too short for it is `BadReply`.
fn u32_at(b: &[u8], i: usize) -> Result<u32, KvClientError> {
    b.get(i..i + 4)
        .and_then(|s| s.try_into().ok())
        .map(u32::from_le_bytes)
        .ok_or(KvClientError::BadReply("reply shorter than its fields"))
}

/// The little-endian `u64` at byte `i` of a reply; a reply too short for it is `BadReply`.
fn u64_at(b: &[u8], i: usize) -> Result<u64, KvClientError> {
    b.get(i..i + 8)
        .and_then(|s| s.try_into().ok())
        .map(u64::from_le_bytes)
        .ok_or(KvClientError::BadReply("reply shorter than its fields"))
}

/// A per-key reply body: exactly one byte per key asked.
fn per_key(p: &[u8], n: usize) -> Result<&[u8], KvClientError> {
    if p.len() != n {
        return Err(KvClientError::BadReply("per-key reply of another length than the keys"));
    }
    Ok(p)
}

/// A per-key reply of 0/1 bytes.
fn flags(p: &[u8], n: usize) -> Result<Vec<bool>, KvClientError> {
    per_key(p, n)?
        .iter()
        .map(|b| match b {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(KvClientError::BadReply("per-key result not 0 or 1")),
        })
        .collect()
}

fn ticket(p: &[u8]) -> Result<u64, KvClientError> {
    p.try_into().map(u64::from_le_bytes).map_err(|_| KvClientError::BadReply("ticket"))
}

fn check(p: &[u8]) -> Result<&[u8], KvClientError> {
    if p.len() < 4 {
        return Err(KvClientError::BadReply("no status"));
    }
    match ErrorCode::from_u32(u32_at(p, 0)?) {
        ErrorCode::Ok => Ok(&p[4..]),
        code => Err(KvClientError::Server {
            code,
            detail: String::from_utf8_lossy(&p[4..]).into_owned(),
        }),
    }
}
