//! [`Connection`]: an RC queue pair set up by exchanging endpoints over TCP, with its own
//! registered buffer, and synchronous (bounded-wait) and pipelined verbs on it.
//!
//! The TCP socket stays open for the life of the connection: a closed socket is how a dead
//! peer shows up while we wait for something only it could send.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use crate::buffer::RegisteredBuffer;
use crate::error::{RdmaError, Result};
use crate::verbs::{
    completion_error, Access, Completion, CompletionQueue, Device, PollMode, ProtectionDomain,
    QpConfig, QpEndpoint, QueuePair, SendOp, SendRequest,
};

/// A region of the peer's memory this side may WRITE/READ: address, length and rkey.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RemoteRegion {
    /// Remote virtual address of byte 0.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Remote key.
    pub rkey: u32,
}

impl RemoteRegion {
    /// The remote address of `offset`, if `offset..offset + len` lies inside the region.
    pub fn checked_addr(&self, op: &'static str, offset: u64, len: u64) -> Result<u64> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(self.addr + offset),
            _ => Err(RdmaError::RemoteAccess { op, offset, len, granted: self.len, remote: false }),
        }
    }
}

/// Settings of a connection.
#[derive(Debug, Clone, Copy)]
pub struct ConnectOptions {
    /// How completions are awaited.
    pub poll: PollMode,
    /// Size of the connection's own registered buffer (staging, receive and READ target).
    pub buffer_len: usize,
    /// Whether the peer may WRITE/READ our buffer (it is then advertised to it).
    pub expose_buffer: bool,
    /// Queue pair settings.
    pub qp: QpConfig,
    /// Bound on every wait (a completion, a receive, the handshake).
    pub op_timeout: Duration,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            poll: PollMode::Busy,
            buffer_len: 1 << 20,
            expose_buffer: false,
            qp: QpConfig::default(),
            op_timeout: Duration::from_secs(5),
        }
    }
}

const MAGIC: u32 = 0x464c_5244; // "FLRD"
const VERSION: u16 = 1;
const HELLO_LEN: usize = 64;

fn encode_hello(ep: &QpEndpoint, region: &RemoteRegion) -> [u8; HELLO_LEN] {
    let mut b = [0u8; HELLO_LEN];
    b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    b[4..6].copy_from_slice(&VERSION.to_le_bytes());
    b[8..12].copy_from_slice(&ep.qpn.to_le_bytes());
    b[12..16].copy_from_slice(&ep.psn.to_le_bytes());
    b[16..18].copy_from_slice(&ep.lid.to_le_bytes());
    b[20..36].copy_from_slice(&ep.gid);
    b[36..44].copy_from_slice(&region.addr.to_le_bytes());
    b[44..52].copy_from_slice(&region.len.to_le_bytes());
    b[52..56].copy_from_slice(&region.rkey.to_le_bytes());
    b
}

fn le_u32(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    u32::from_le_bytes(a)
}

fn le_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

/// Parses and validates the peer's hello (it is untrusted input).
fn decode_hello(b: &[u8; HELLO_LEN]) -> Result<(QpEndpoint, RemoteRegion)> {
    let bad = |detail: String| RdmaError::Protocol { op: "handshake", detail };
    if le_u32(&b[0..4]) != MAGIC {
        return Err(bad("not a fastlane-rdma peer (bad magic)".into()));
    }
    let version = u16::from_le_bytes([b[4], b[5]]);
    if version != VERSION {
        return Err(bad(format!("protocol version {version}, expected {VERSION}")));
    }
    let qpn = le_u32(&b[8..12]);
    let psn = le_u32(&b[12..16]);
    if qpn == 0 || qpn > 0x00ff_ffff || psn > 0x00ff_ffff {
        return Err(bad(format!("qpn {qpn:#x} / psn {psn:#x} out of 24-bit range")));
    }
    let lid = u16::from_le_bytes([b[16], b[17]]);
    let mut gid = [0u8; 16];
    gid.copy_from_slice(&b[20..36]);
    let region = RemoteRegion {
        addr: le_u64(&b[36..44]),
        len: le_u64(&b[44..52]),
        rkey: le_u32(&b[52..56]),
    };
    if region.addr.checked_add(region.len).is_none() {
        return Err(bad("advertised region wraps the address space".into()));
    }
    Ok((QpEndpoint { qpn, psn, lid, gid }, region))
}

/// Checks, without blocking, whether the peer closed the socket.
fn socket_alive(stream: &TcpStream, op: &'static str) -> Result<()> {
    let mut b = [0u8; 1];
    // SAFETY: a valid socket descriptor and a 1-byte buffer; MSG_PEEK leaves data queued.
    let n = unsafe {
        libc::recv(
            stream.as_raw_fd(),
            b.as_mut_ptr().cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    if n == 0 {
        return Err(RdmaError::PeerGone { op, detail: "peer closed its socket".into() });
    }
    if n < 0 {
        let e = std::io::Error::last_os_error();
        match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted => {}
            _ => return Err(RdmaError::PeerGone { op, detail: format!("socket: {e}") }),
        }
    }
    Ok(())
}

/// A TCP listener that hands out [`Connection`]s.
#[derive(Debug)]
pub struct Listener {
    inner: TcpListener,
}

impl Listener {
    /// Binds `addr` (use a loopback address in tests).
    pub fn bind(addr: impl ToSocketAddrs) -> Result<Self> {
        let inner =
            TcpListener::bind(addr).map_err(|source| RdmaError::Io { op: "bind", source })?;
        inner.set_nonblocking(true).map_err(|source| RdmaError::Io { op: "bind", source })?;
        Ok(Listener { inner })
    }

    /// The bound address.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.inner.local_addr().map_err(|source| RdmaError::Io { op: "local_addr", source })
    }

    /// Waits up to `timeout` for a TCP client (`Ok(None)` when none came).
    pub fn accept_tcp(&self, timeout: Duration) -> Result<Option<TcpStream>> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.inner.accept() {
                Ok((s, _)) => {
                    s.set_nonblocking(false)
                        .map_err(|source| RdmaError::Io { op: "accept", source })?;
                    return Ok(Some(s));
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Ok(None);
                    }
                    let mut pfd = libc::pollfd {
                        fd: self.inner.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    };
                    let ms = (deadline - now).as_millis().clamp(1, 1000) as i32;
                    // SAFETY: one valid pollfd for our listening socket.
                    unsafe { libc::poll(&mut pfd, 1, ms) };
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(source) => return Err(RdmaError::Io { op: "accept", source }),
            }
        }
    }

    /// Waits up to `options.op_timeout` for a client and sets up the connection.
    pub fn accept(&self, device: &Device, options: ConnectOptions) -> Result<Connection> {
        match self.accept_tcp(options.op_timeout)? {
            Some(s) => Connection::handshake(device, None, s, options),
            None => Err(RdmaError::Timeout { op: "accept", after: options.op_timeout }),
        }
    }
}

/// One reliable connection to a peer, with its own registered buffer.
///
/// Every operation names byte ranges of that buffer (`local_off`); the connection owns the
/// buffer and destroys its queue pair before freeing it, so nothing posted here can reach
/// freed memory — which is what makes these methods safe. Waits are bounded by
/// [`ConnectOptions::op_timeout`]; an error completion or a timeout leaves the connection
/// [`RdmaError::Broken`].
pub struct Connection {
    // Field order is drop order: the QP goes first (no more device access), then the CQs,
    // then the buffer (deregister, unmap).
    qp: QueuePair,
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
    buf: RegisteredBuffer,
    stream: TcpStream,
    remote: RemoteRegion,
    options: ConnectOptions,
    /// Send-queue requests posted; the wr_id of each is its number.
    posted: u64,
    /// Highest wr_id known complete (completions arrive in order on one QP).
    completed: u64,
    recv_posted: u64,
    broken: bool,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("qp", &self.qp)
            .field("remote", &self.remote)
            .field("broken", &self.broken)
            .finish()
    }
}

impl Connection {
    /// Connects to a peer listening at `addr` (a [`Listener`]).
    pub fn connect(device: &Device, addr: SocketAddr, options: ConnectOptions) -> Result<Self> {
        let stream = TcpStream::connect_timeout(&addr, options.op_timeout)
            .map_err(|source| RdmaError::PeerUnreachable { addr, source })?;
        Self::handshake(device, None, stream, options)
    }

    /// Sets up the connection on a TCP stream already accepted (the server side).
    pub fn accept_stream(
        device: &Device,
        stream: TcpStream,
        options: ConnectOptions,
    ) -> Result<Self> {
        Self::handshake(device, None, stream, options)
    }

    /// As [`accept_stream`](Self::accept_stream), with the queue pair in `pd`: the peer can
    /// then reach memory registered in `pd` by others (the pool's grants).
    pub fn accept_stream_in(
        device: &Device,
        pd: &ProtectionDomain,
        stream: TcpStream,
        options: ConnectOptions,
    ) -> Result<Self> {
        Self::handshake(device, Some(pd), stream, options)
    }

    fn handshake(
        device: &Device,
        pd: Option<&ProtectionDomain>,
        stream: TcpStream,
        options: ConnectOptions,
    ) -> Result<Self> {
        let io = |source| RdmaError::Io { op: "handshake", source };
        stream.set_nodelay(true).map_err(io)?;
        stream.set_read_timeout(Some(options.op_timeout)).map_err(io)?;
        stream.set_write_timeout(Some(options.op_timeout)).map_err(io)?;
        let pd = match pd {
            Some(pd) => pd.clone(),
            None => device.alloc_pd()?,
        };
        let depth = options.qp.max_send_wr.max(options.qp.max_recv_wr) + 16;
        let send_cq = CompletionQueue::new(device, depth, options.poll)?;
        let mut recv_cq = CompletionQueue::new(device, depth, options.poll)?;
        recv_cq.set_batch(1);
        let access = if options.expose_buffer { Access::REMOTE_RW } else { Access::LOCAL };
        let buf = RegisteredBuffer::new(&pd, options.buffer_len, access)?;
        let qp = QueuePair::new(&pd, &send_cq, &recv_cq, options.qp)?;
        let mine = if options.expose_buffer {
            RemoteRegion { addr: buf.addr(), len: buf.len() as u64, rkey: buf.rkey() }
        } else {
            RemoteRegion::default()
        };
        let mut s = &stream;
        s.write_all(&encode_hello(&qp.endpoint(), &mine)).map_err(io)?;
        let mut hello = [0u8; HELLO_LEN];
        s.read_exact(&mut hello).map_err(|e| peer_io("handshake", e))?;
        let (ep, remote) = decode_hello(&hello)?;
        qp.connect(&ep)?;
        // Both sides must be in RTR before either sends: one ready byte each way.
        s.write_all(b"R").map_err(io)?;
        let mut r = [0u8; 1];
        s.read_exact(&mut r).map_err(|e| peer_io("handshake", e))?;
        if r[0] != b'R' {
            return Err(RdmaError::Protocol { op: "handshake", detail: "bad ready byte".into() });
        }
        Ok(Connection {
            qp,
            send_cq,
            recv_cq,
            buf,
            stream,
            remote,
            options,
            posted: 0,
            completed: 0,
            recv_posted: 0,
            broken: false,
        })
    }

    /// The region the peer exposed to us (empty when it exposed none).
    pub fn remote(&self) -> RemoteRegion {
        self.remote
    }

    /// This connection's own buffer (copy data in and out with its methods).
    pub fn buffer(&self) -> &RegisteredBuffer {
        &self.buf
    }

    /// The side-channel socket (control messages of the pool; closed = peer gone).
    pub fn stream(&self) -> &TcpStream {
        &self.stream
    }

    /// The options it was made with.
    pub fn options(&self) -> &ConnectOptions {
        &self.options
    }

    /// Whether an earlier error made it unusable.
    pub fn is_broken(&self) -> bool {
        self.broken
    }

    /// Send-queue requests posted and not yet known complete.
    pub fn in_flight(&self) -> u64 {
        self.posted - self.completed
    }

    /// Send-queue requests posted so far; also the wr_id of the newest one.
    pub fn posted(&self) -> u64 {
        self.posted
    }

    /// Maximum send-queue requests in flight.
    pub fn send_depth(&self) -> u64 {
        u64::from(self.options.qp.max_send_wr)
    }

    /// Bytes a write may carry inline.
    pub fn max_inline(&self) -> u32 {
        self.qp.max_inline()
    }

    /// Posts one send-queue request on the connection's own buffer, without waiting.
    /// Returns its wr_id. Unsignaled requests complete when a later signaled one does.
    pub fn post(
        &mut self,
        op: SendOp,
        local_off: usize,
        len: usize,
        signaled: bool,
    ) -> Result<u64> {
        if self.broken {
            return Err(RdmaError::Broken);
        }
        if self.in_flight() >= self.send_depth() {
            return Err(RdmaError::InvalidArgument {
                op: "post",
                detail: format!("send queue full ({} in flight)", self.in_flight()),
            });
        }
        let local = if len == 0 { None } else { Some(self.buf.sge(local_off, len)?) };
        let inline =
            !matches!(op, SendOp::Read { .. }) && len > 0 && len <= self.qp.max_inline() as usize;
        let wr_id = self.posted + 1;
        let wr = SendRequest { wr_id, op, signaled, inline };
        // SAFETY: `local` lies inside `self.buf` (checked by `sge`), which is owned by this
        // connection and freed only after `self.qp` is destroyed (field order), so it stays
        // alive until the completion or the QP's end; no `&`/`&mut` is made of its bytes.
        unsafe { self.qp.post_send(&wr, local)? };
        self.posted = wr_id;
        Ok(wr_id)
    }

    /// Polls send completions once, without waiting. Returns how many were seen.
    pub fn poll_send(&mut self) -> Result<usize> {
        let mut first_err = None;
        let mut completed = self.completed;
        let n = self.send_cq.poll(|c| {
            if !c.is_ok() && first_err.is_none() {
                first_err = Some(c);
            }
            completed = completed.max(c.wr_id);
        })?;
        self.completed = completed;
        if let Some(c) = first_err {
            self.broken = true;
            return Err(completion_error("send", &c));
        }
        Ok(n)
    }

    /// Waits (bounded) until request `wr_id` and all before it are complete.
    pub fn wait_send(&mut self, op: &'static str, wr_id: u64) -> Result<()> {
        let deadline = Instant::now() + self.options.op_timeout;
        while self.completed < wr_id {
            let mut first_err: Option<Completion> = None;
            let mut completed = self.completed;
            let stream = &self.stream;
            let n = self.send_cq.wait(
                deadline,
                &mut |c| {
                    if !c.is_ok() && first_err.is_none() {
                        first_err = Some(c);
                    }
                    completed = completed.max(c.wr_id);
                },
                &mut || socket_alive(stream, op),
            );
            self.completed = completed;
            if let Some(c) = first_err {
                self.broken = true;
                return Err(completion_error(op, &c));
            }
            match n {
                Err(e) => return Err(self.fail(e)),
                Ok(0) => {
                    let after = self.options.op_timeout;
                    return Err(self.fail(RdmaError::Timeout { op, after }));
                }
                Ok(_) => {}
            }
        }
        Ok(())
    }

    fn fail(&mut self, e: RdmaError) -> RdmaError {
        self.broken = true;
        // Flush whatever is still posted; the buffer stays owned by us either way.
        let _ = self.qp.set_error();
        e
    }

    fn run(&mut self, op: &'static str, sop: SendOp, local_off: usize, len: usize) -> Result<()> {
        let wr_id = self.post(sop, local_off, len, true)?;
        self.wait_send(op, wr_id)
    }

    /// RDMA WRITE `len` bytes from our buffer at `local_off` to the peer's exposed region at
    /// `remote_off`; returns when the peer acknowledged it.
    pub fn write(&mut self, local_off: usize, remote_off: u64, len: usize) -> Result<()> {
        let r = self.remote;
        self.write_to(&r, local_off, remote_off, len, None)
    }

    /// RDMA WRITE with immediate data (consumes one receive at the peer, which sees `imm`).
    pub fn write_imm(
        &mut self,
        local_off: usize,
        remote_off: u64,
        len: usize,
        imm: u32,
    ) -> Result<()> {
        let r = self.remote;
        self.write_to(&r, local_off, remote_off, len, Some(imm))
    }

    /// RDMA READ `len` bytes of the peer's exposed region at `remote_off` into our buffer.
    pub fn read(&mut self, local_off: usize, remote_off: u64, len: usize) -> Result<()> {
        let r = self.remote;
        self.read_from(&r, local_off, remote_off, len)
    }

    /// RDMA WRITE into `region` (e.g. a pool grant), bounds checked against it first.
    pub fn write_to(
        &mut self,
        region: &RemoteRegion,
        local_off: usize,
        remote_off: u64,
        len: usize,
        imm: Option<u32>,
    ) -> Result<()> {
        let remote_addr = region.checked_addr("rdma write", remote_off, len as u64)?;
        let op = SendOp::Write { remote_addr, rkey: region.rkey, imm };
        self.run("rdma write", op, local_off, len)
            .map_err(|e| with_range(e, remote_off, len, region))
    }

    /// RDMA READ from `region`, bounds checked against it first.
    pub fn read_from(
        &mut self,
        region: &RemoteRegion,
        local_off: usize,
        remote_off: u64,
        len: usize,
    ) -> Result<()> {
        let remote_addr = region.checked_addr("rdma read", remote_off, len as u64)?;
        let op = SendOp::Read { remote_addr, rkey: region.rkey };
        self.run("rdma read", op, local_off, len)
            .map_err(|e| with_range(e, remote_off, len, region))
    }

    /// RDMA WRITE to a raw remote address and key, with no local bounds check: the peer's
    /// device is the only judge (a refusal is [`RdmaError::RemoteAccess`] with `remote: true`
    /// and breaks the connection). Safe, because it can only touch our own buffer locally.
    pub fn write_unchecked(
        &mut self,
        remote_addr: u64,
        rkey: u32,
        local_off: usize,
        len: usize,
    ) -> Result<()> {
        let op = SendOp::Write { remote_addr, rkey, imm: None };
        self.run("rdma write", op, local_off, len)
    }

    /// SEND `len` bytes of our buffer at `local_off` (0 bytes is fine), with optional
    /// immediate data; the peer must have a receive posted.
    pub fn send(&mut self, local_off: usize, len: usize, imm: Option<u32>) -> Result<()> {
        self.run("send", SendOp::Send { imm }, local_off, len)
    }

    /// Posts a receive into our buffer at `local_off..local_off + len` (len 0: for
    /// immediate-only messages). Returns its wr_id.
    pub fn post_recv(&mut self, local_off: usize, len: usize) -> Result<u64> {
        if self.broken {
            return Err(RdmaError::Broken);
        }
        let local = if len == 0 { None } else { Some(self.buf.sge(local_off, len)?) };
        let wr_id = self.recv_posted + 1;
        // SAFETY: the target lies inside `self.buf` (checked by `sge`), owned by this
        // connection and freed only after the QP is destroyed (field order).
        unsafe { self.qp.post_recv(wr_id, local)? };
        self.recv_posted = wr_id;
        Ok(wr_id)
    }

    /// Waits (bounded by `timeout`) for the next receive completion: a SEND or a WRITE with
    /// immediate from the peer. A closed peer socket ends the wait with `PeerGone`; running
    /// out of time gives `Timeout` and leaves the connection usable.
    pub fn wait_recv(&mut self, timeout: Duration) -> Result<Completion> {
        if self.broken {
            return Err(RdmaError::Broken);
        }
        let deadline = Instant::now() + timeout;
        let mut got: Option<Completion> = None;
        let stream = &self.stream;
        let n = self.recv_cq.wait(
            deadline,
            // The receive CQ polls one completion at a time (batch 1), so none is lost.
            &mut |c| got = Some(c),
            &mut || socket_alive(stream, "wait_recv"),
        );
        match n {
            Err(e) => Err(self.fail(e)),
            // A receive that did not come leaves nothing of ours in flight: not broken.
            Ok(0) => Err(RdmaError::Timeout { op: "wait_recv", after: timeout }),
            Ok(_) => {
                let c = got.ok_or(RdmaError::Broken)?;
                if !c.is_ok() {
                    self.broken = true;
                    return Err(completion_error("recv", &c));
                }
                Ok(c)
            }
        }
    }

    /// Checks, without blocking, that the peer's socket is still open.
    pub fn check_peer(&self) -> Result<()> {
        socket_alive(&self.stream, "check_peer")
    }
}

fn with_range(e: RdmaError, offset: u64, len: usize, region: &RemoteRegion) -> RdmaError {
    match e {
        RdmaError::RemoteAccess { op, remote, .. } => {
            RdmaError::RemoteAccess { op, offset, len: len as u64, granted: region.len, remote }
        }
        other => other,
    }
}

/// A read on the side channel failed: EOF or reset means the peer is gone.
pub(crate) fn peer_io(op: &'static str, e: std::io::Error) -> RdmaError {
    use std::io::ErrorKind as K;
    match e.kind() {
        K::UnexpectedEof | K::ConnectionReset | K::BrokenPipe | K::ConnectionAborted => {
            RdmaError::PeerGone { op, detail: e.to_string() }
        }
        K::WouldBlock | K::TimedOut => RdmaError::Timeout { op, after: Duration::ZERO },
        _ => RdmaError::Io { op, source: e },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_round_trips() {
        let ep = QpEndpoint { qpn: 0x11, psn: 0xabcdef, lid: 0, gid: [7; 16] };
        let r = RemoteRegion { addr: 0x7000_0000, len: 4096, rkey: 99 };
        let (ep2, r2) = decode_hello(&encode_hello(&ep, &r)).unwrap();
        assert_eq!(ep, ep2);
        assert_eq!(r, r2);
    }

    #[test]
    fn hostile_hello_is_refused() {
        let ep = QpEndpoint { qpn: 0x11, psn: 1, lid: 0, gid: [0; 16] };
        let r = RemoteRegion { addr: u64::MAX - 10, len: 100, rkey: 1 };
        assert!(matches!(decode_hello(&encode_hello(&ep, &r)), Err(RdmaError::Protocol { .. })));
        let mut b = encode_hello(&ep, &RemoteRegion::default());
        b[0] ^= 1;
        assert!(matches!(decode_hello(&b), Err(RdmaError::Protocol { .. })));
        let bad = QpEndpoint { qpn: 1 << 24, ..ep };
        let b = encode_hello(&bad, &RemoteRegion::default());
        assert!(matches!(decode_hello(&b), Err(RdmaError::Protocol { .. })));
    }

    #[test]
    fn remote_region_bounds() {
        let r = RemoteRegion { addr: 1000, len: 100, rkey: 1 };
        assert_eq!(r.checked_addr("t", 0, 100).unwrap(), 1000);
        assert_eq!(r.checked_addr("t", 99, 1).unwrap(), 1099);
        assert!(matches!(
            r.checked_addr("t", 99, 2),
            Err(RdmaError::RemoteAccess { offset: 99, len: 2, granted: 100, remote: false, .. })
        ));
        assert!(r.checked_addr("t", u64::MAX, 2).is_err());
    }
}
