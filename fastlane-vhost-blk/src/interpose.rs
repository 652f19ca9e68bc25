//! The vhost-user control connection of one frontend, with `GET_INFLIGHT_FD` and
//! `SET_INFLIGHT_FD` answered here and every other message relayed, unchanged, to
//! vhost-user-backend's daemon.
//!
//! Why: vhost-user-backend 0.24 answers the two in-flight messages with "not supported", and
//! its request handler is private, so it cannot be extended in place. Rather than replace a
//! handler that is tested against QEMU and virtio-driver (memory tables, vring setup, epoll
//! threads), this module sits between the frontend's socket and the daemon: two threads copy
//! whole messages (header, payload, passed descriptors) each way, and the in-flight messages
//! never reach the library. Only control messages pass here; the data path (virtqueues in guest
//! memory, eventfds) never does. When the library supports in-flight tracking this module goes.
//!
//! The frontend is hostile like any other input: a header that is not vhost-user's, a payload
//! larger than the protocol's 4 KiB, more than 32 descriptors, or a read or write error closes
//! that one connection (logged); an in-flight message with a bad payload gets an error answer
//! and a logged reason.

use std::fs::File;
use std::io::{Read as _, Write as _};
use std::net::Shutdown;
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd, RawFd};
use std::os::unix::fs::DirBuilderExt as _;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use log::{debug, error, info, warn};
use vhost::vhost_user::Listener;

use super::device::BlkBackend;
use super::inflight::InflightRegion;

/// `VHOST_USER_SET_VRING_KICK`.
pub const SET_VRING_KICK: u32 = 12;
/// `VHOST_USER_SET_VRING_CALL`.
pub const SET_VRING_CALL: u32 = 13;
/// `VHOST_USER_GET_INFLIGHT_FD`.
pub const GET_INFLIGHT_FD: u32 = 31;
/// `VHOST_USER_SET_INFLIGHT_FD`.
pub const SET_INFLIGHT_FD: u32 = 32;
/// Header: request u32, flags u32, size u32.
pub const HEADER_BYTES: usize = 12;
/// Largest payload the protocol allows.
pub const PAYLOAD_MAX: usize = 0x1000;
/// Most descriptors one message may carry.
pub const FDS_MAX: usize = 32;
/// Flags: version 1.
const FLAG_VERSION_1: u32 = 0x1;
const FLAG_VERSION_MASK: u32 = 0x3;
/// Flags: this is a reply.
const FLAG_REPLY: u32 = 0x4;
/// Flags: the sender wants a reply (REPLY_ACK).
const FLAG_NEED_REPLY: u32 = 0x8;
/// `struct VhostUserInflight` as QEMU sends it: mmap_size u64, mmap_offset u64, num_queues
/// u16, queue_size u16, 4 bytes of padding.
const INFLIGHT_PAYLOAD_BYTES: usize = 24;
const INFLIGHT_PAYLOAD_MIN: usize = 20;

/// One vhost-user message.
#[derive(Debug)]
pub struct Message {
    /// Request code.
    pub request: u32,
    /// Header flags.
    pub flags: u32,
    /// Payload (`size` bytes).
    pub payload: Vec<u8>,
    /// Descriptors passed with it.
    pub fds: Vec<OwnedFd>,
}

/// Why a connection is closed.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// The peer closed the connection (normal).
    #[error("closed")]
    Closed,
    /// A read or write failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The peer sent something that is not a vhost-user message.
    #[error("not a vhost-user message: {0}")]
    Malformed(&'static str),
}

/// A message header over one `iov` and the control buffer `control` (`controllen` bytes of it).
fn msghdr(iov: &mut libc::iovec, control: &mut [u64], controllen: usize) -> libc::msghdr {
    debug_assert!(controllen <= std::mem::size_of_val(control));
    // SAFETY: an all-zero msghdr is a valid empty one; the fields set below point at the
    // caller's live buffers.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = controllen;
    msg
}

/// Run a system call that returns a byte count or -1, again while it is interrupted.
fn retry_eintr(mut call: impl FnMut() -> isize) -> std::io::Result<usize> {
    loop {
        if let Ok(n) = usize::try_from(call()) {
            return Ok(n);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

fn recv_with_fds(s: &UnixStream, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> std::io::Result<usize> {
    const SPACE: usize = FDS_MAX * std::mem::size_of::<RawFd>();
    // Room for one SCM_RIGHTS header and 32 descriptors (CMSG_SPACE, computed by libc).
    let mut cbuf = [0u64; (SPACE + 64) / 8];
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: CMSG_SPACE only computes a size.
    let controllen = unsafe { libc::CMSG_SPACE(SPACE as u32) } as usize;
    let mut msg = msghdr(&mut iov, &mut cbuf, controllen);
    let n = retry_eintr(|| {
        // SAFETY:
        // - `msg` points at `iov` (into `buf`, writable for its length) and `cbuf` (writable
        //   for msg_controllen bytes); the kernel writes at most those and keeps no pointer.
        unsafe { libc::recvmsg(s.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) }
    })?;
    // SAFETY: `msg` was filled by recvmsg; CMSG_FIRSTHDR/NXTHDR walk its control buffer within
    // msg_controllen.
    let mut c = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    while !c.is_null() {
        // SAFETY: `c` is a control message header inside `cbuf` (from CMSG_FIRSTHDR/NXTHDR);
        // read as a copy, unaligned-safe.
        let h = unsafe { c.read_unaligned() };
        if h.cmsg_level == libc::SOL_SOCKET && h.cmsg_type == libc::SCM_RIGHTS {
            // SAFETY: CMSG_LEN only computes a size.
            let header = unsafe { libc::CMSG_LEN(0) } as usize;
            let count = h.cmsg_len.saturating_sub(header) / std::mem::size_of::<RawFd>();
            // SAFETY: CMSG_DATA points at the `count` descriptors the kernel wrote after
            // the header, inside `cbuf`.
            let data = unsafe { libc::CMSG_DATA(c) }.cast::<RawFd>();
            for i in 0..count {
                // SAFETY: `i` < count: the pointer stays inside this control message.
                let p = unsafe { data.add(i) };
                // SAFETY: `p` points at a descriptor the kernel wrote; read_unaligned because
                // the data is only 4-byte aligned by the ABI's rules.
                let fd = unsafe { p.read_unaligned() };
                if fd >= 0 {
                    // SAFETY: every descriptor received is a new one installed in our table
                    // for us (SCM_RIGHTS), owned by nothing else: wrapping it once is sound.
                    fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                }
            }
        }
        // SAFETY: as for CMSG_FIRSTHDR.
        c = unsafe { libc::CMSG_NXTHDR(&msg, c) };
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(std::io::Error::other("more descriptors than a vhost-user message may carry"));
    }
    Ok(n)
}

/// Read one whole message from `s`.
pub fn read_message(s: &UnixStream) -> Result<Message, RelayError> {
    let mut header = [0u8; HEADER_BYTES];
    let mut fds = Vec::new();
    let mut got = 0;
    while got < HEADER_BYTES {
        let n = if got == 0 {
            recv_with_fds(s, &mut header, &mut fds)?
        } else {
            (&*s).read(&mut header[got..])?
        };
        if n == 0 {
            return Err(if got == 0 {
                RelayError::Closed
            } else {
                RelayError::Malformed("short header")
            });
        }
        got += n;
    }
    let word =
        |i: usize| u32::from_le_bytes([header[i], header[i + 1], header[i + 2], header[i + 3]]);
    let (request, flags, size) = (word(0), word(4), word(8) as usize);
    if flags & FLAG_VERSION_MASK != FLAG_VERSION_1 {
        return Err(RelayError::Malformed("header version is not 1"));
    }
    if size > PAYLOAD_MAX {
        return Err(RelayError::Malformed("payload larger than 4 KiB"));
    }
    if fds.len() > FDS_MAX {
        return Err(RelayError::Malformed("more than 32 descriptors"));
    }
    let mut payload = vec![0u8; size];
    (&*s).read_exact(&mut payload).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => RelayError::Malformed("short payload"),
        _ => RelayError::Io(e),
    })?;
    Ok(Message { request, flags, payload, fds })
}

/// Write one whole message to `s`, with its descriptors on the first byte.
pub fn write_message(s: &UnixStream, m: &Message) -> std::io::Result<()> {
    let mut bytes = Vec::with_capacity(HEADER_BYTES + m.payload.len());
    bytes.extend_from_slice(&m.request.to_le_bytes());
    bytes.extend_from_slice(&m.flags.to_le_bytes());
    bytes.extend_from_slice(&(m.payload.len() as u32).to_le_bytes());
    bytes.extend_from_slice(&m.payload);
    let mut sent = 0;
    if !m.fds.is_empty() {
        let raw: Vec<RawFd> = m.fds.iter().map(|f| f.as_raw_fd()).collect();
        let fd_bytes = std::mem::size_of_val(raw.as_slice());
        let mut cbuf = [0u64; (FDS_MAX * 4 + 64) / 8];
        let mut iov = libc::iovec { iov_base: bytes.as_mut_ptr().cast(), iov_len: bytes.len() };
        // SAFETY: CMSG_SPACE only computes a size.
        let controllen = unsafe { libc::CMSG_SPACE(fd_bytes as u32) } as usize;
        let msg = msghdr(&mut iov, &mut cbuf, controllen);
        // SAFETY: msg_control points at `cbuf`, which holds CMSG_SPACE of up to 32 fds.
        let c = unsafe { libc::CMSG_FIRSTHDR(&msg) };
        // SAFETY: CMSG_LEN only computes a size.
        let cmsg_len = unsafe { libc::CMSG_LEN(fd_bytes as u32) } as usize;
        // SAFETY: an all-zero cmsghdr is valid; its fields are set below.
        let mut h: libc::cmsghdr = unsafe { std::mem::zeroed() };
        h.cmsg_level = libc::SOL_SOCKET;
        h.cmsg_type = libc::SCM_RIGHTS;
        h.cmsg_len = cmsg_len;
        // SAFETY: `c` is the first header slot inside `cbuf` (non-null: msg_controllen is at
        // least one header); written as a copy.
        unsafe { c.write_unaligned(h) };
        // SAFETY: CMSG_DATA of that header is inside `cbuf`, with room for `fd_bytes` (the
        // space computed by CMSG_SPACE above).
        let data = unsafe { libc::CMSG_DATA(c) };
        // SAFETY: `raw` holds `fd_bytes` bytes; `data` has room for them; no overlap.
        unsafe { std::ptr::copy_nonoverlapping(raw.as_ptr().cast::<u8>(), data, fd_bytes) };
        let n = retry_eintr(|| {
            // SAFETY: `msg` points at live locals (`iov` into `bytes`, `cbuf`); sendmsg only
            // reads them and keeps no pointer.
            unsafe { libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) }
        })?;
        sent = n;
    }
    (&*s).write_all(&bytes[sent..])
}

/// A private listener the library's daemon accepts our end of the relay on: a socket in a
/// directory only this user can enter, removed once accepted.
#[allow(missing_debug_implementations)] // vhost's Listener has no Debug
pub struct PrivateSocket {
    /// The listener to hand to `VhostUserDaemon::start`.
    pub listener: Listener,
    /// Our end, already connected (the daemon accepts it).
    pub ours: UnixStream,
}

impl PrivateSocket {
    /// Make one, for connection `n`.
    pub fn new(n: u64) -> std::io::Result<PrivateSocket> {
        let dir = std::env::temp_dir().join(format!(
            "fastlane-vhost-blk-{}-{n}-{:x}",
            std::process::id(),
            fastlane_util::mix64(n ^ u64::from(std::process::id()) ^ nanos())
        ));
        std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
        let path = dir.join("relay.sock");
        let made = UnixListener::bind(&path).and_then(|l| {
            let ours = UnixStream::connect(&path)?;
            Ok((l, ours))
        });
        let (l, ours) = match made {
            Ok(v) => v,
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                let _ = std::fs::remove_dir(&dir);
                return Err(e);
            }
        };
        // The pending connection stays queued after the file and its directory are gone.
        let _ = std::fs::remove_file(&path);
        let _ = std::fs::remove_dir(&dir);
        Ok(PrivateSocket { listener: Listener::from(l), ours })
    }
}

fn nanos() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// The two relay threads of one connection.
pub struct Relay {
    frontend: UnixStream,
    library: UnixStream,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay").finish_non_exhaustive()
    }
}

impl Relay {
    /// Relay between the frontend and `library` (our end of the daemon's connection),
    /// answering the in-flight messages for `backend`, which has `num_queues` queues.
    pub fn start(
        frontend: UnixStream,
        library: UnixStream,
        backend: Arc<BlkBackend>,
        num_queues: u16,
    ) -> std::io::Result<Relay> {
        let to_frontend = Arc::new(Mutex::new(frontend.try_clone()?));
        let (f_in, l_out) = (frontend.try_clone()?, library.try_clone()?);
        let (l_in, f_close, l_close) =
            (library.try_clone()?, frontend.try_clone()?, library.try_clone()?);
        let down = Arc::new((f_close, l_close));
        let mut threads = Vec::new();
        let (tf, d) = (to_frontend.clone(), down.clone());
        threads.push(std::thread::Builder::new().name("vhost-relay-in".into()).spawn(
            move || {
                let end = frontend_to_library(&f_in, &l_out, &tf, &backend, num_queues);
                close_both(&d, "frontend", end);
            },
        )?);
        let d = down;
        threads.push(std::thread::Builder::new().name("vhost-relay-out".into()).spawn(
            move || {
                let end = loop {
                    match read_message(&l_in) {
                        Ok(m) => {
                            let w = to_frontend.lock().unwrap_or_else(|p| p.into_inner());
                            if let Err(e) = write_message(&w, &m) {
                                break RelayError::Io(e);
                            }
                        }
                        Err(e) => break e,
                    }
                };
                close_both(&d, "backend library", end);
            },
        )?);
        Ok(Relay { frontend, library, threads })
    }

    /// Close both sides and wait for the threads.
    pub fn finish(mut self) {
        let _ = self.frontend.shutdown(Shutdown::Both);
        let _ = self.library.shutdown(Shutdown::Both);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn close_both(down: &(UnixStream, UnixStream), from: &str, end: RelayError) {
    match end {
        RelayError::Closed => debug!("vhost-user: {from} closed the connection"),
        RelayError::Malformed(why) => {
            warn!("vhost-user: {from} sent a message that is {why}; closing the connection")
        }
        RelayError::Io(e) => debug!("vhost-user: connection to the {from} ended: {e}"),
    }
    let _ = down.0.shutdown(Shutdown::Both);
    let _ = down.1.shutdown(Shutdown::Both);
}

fn frontend_to_library(
    from: &UnixStream,
    to: &UnixStream,
    to_frontend: &Mutex<UnixStream>,
    backend: &BlkBackend,
    num_queues: u16,
) -> RelayError {
    loop {
        let m = match read_message(from) {
            Ok(m) => m,
            Err(e) => return e,
        };
        let reply = match m.request {
            GET_INFLIGHT_FD => Some(get_inflight_fd(&m, num_queues)),
            SET_INFLIGHT_FD => {
                let ok = set_inflight_fd(&m, backend);
                (m.flags & FLAG_NEED_REPLY != 0).then(|| ack(SET_INFLIGHT_FD, ok))
            }
            _ => {
                if let Err(e) = write_message(to, &m) {
                    return RelayError::Io(e);
                }
                if matches!(m.request, SET_VRING_KICK | SET_VRING_CALL)
                    && backend.inflight().is_some_and(|r| r.reused())
                {
                    nudge(&m);
                }
                None
            }
        };
        if let Some(r) = reply {
            let w = to_frontend.lock().unwrap_or_else(|p| p.into_inner());
            if let Err(e) = write_message(&w, &r) {
                return RelayError::Io(e);
            }
        }
    }
}

/// After a backend restart (the frontend handed over a region in use), write once to each
/// queue's kick and call eventfd as they are set up. The kick makes the queue's worker start
/// (and recover) even if the guest, waiting for requests the dead backend had, sends no new
/// one; the call makes the guest look at its used ring, where the dead backend may have
/// published completions without the interrupt that announces them (it was killed between
/// the two). Both are harmless when there was nothing to do. `m`'s descriptor is ours until `m`
/// is dropped; the library has its own copy.
fn nudge(m: &Message) {
    let Some(fd) = m.fds.first() else { return };
    let one = 1u64.to_ne_bytes();
    // SAFETY: `fd` is an open eventfd the frontend passed with this message (owned by `m`);
    // an eventfd write of 8 bytes from a live local only adds to its counter.
    let n = unsafe { libc::write(fd.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    if n != 8 {
        debug!(
            "vhost-user: nudging an eventfd after a restart failed: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// The fields of a `VhostUserInflight` payload.
fn inflight_fields(p: &[u8]) -> Option<(u64, u64, u16, u16)> {
    if p.len() < INFLIGHT_PAYLOAD_MIN {
        return None;
    }
    let u64_at = |i: usize| u64::from_le_bytes(p[i..i + 8].try_into().unwrap_or_default());
    let u16_at = |i: usize| u16::from_le_bytes([p[i], p[i + 1]]);
    Some((u64_at(0), u64_at(8), u16_at(16), u16_at(18)))
}

fn inflight_payload(mmap_size: u64, mmap_offset: u64, num_queues: u16, queue_size: u16) -> Vec<u8> {
    let mut p = Vec::with_capacity(INFLIGHT_PAYLOAD_BYTES);
    p.extend_from_slice(&mmap_size.to_le_bytes());
    p.extend_from_slice(&mmap_offset.to_le_bytes());
    p.extend_from_slice(&num_queues.to_le_bytes());
    p.extend_from_slice(&queue_size.to_le_bytes());
    p.resize(INFLIGHT_PAYLOAD_BYTES, 0);
    p
}

/// `GET_INFLIGHT_FD`: a new region for the queues asked for, or `mmap_size` 0 (the frontend
/// then goes on without tracking) with the reason logged.
fn get_inflight_fd(m: &Message, our_queues: u16) -> Message {
    let reply = |payload, fds| Message {
        request: GET_INFLIGHT_FD,
        flags: FLAG_VERSION_1 | FLAG_REPLY,
        payload,
        fds,
    };
    let Some((_, _, num_queues, queue_size)) = inflight_fields(&m.payload) else {
        error!(
            "vhost-user: GET_INFLIGHT_FD with a {}-byte payload; no in-flight tracking",
            m.payload.len()
        );
        return reply(inflight_payload(0, 0, 0, 0), Vec::new());
    };
    if num_queues > our_queues {
        error!("vhost-user: GET_INFLIGHT_FD for {num_queues} queues, the device has {our_queues}; no in-flight tracking");
        return reply(inflight_payload(0, 0, num_queues, queue_size), Vec::new());
    }
    match InflightRegion::create(num_queues, queue_size) {
        Ok(r) => {
            info!(
                "vhost-user: in-flight region created: {num_queues} queue(s) of {queue_size}, {} bytes",
                r.mmap_size
            );
            let fd: OwnedFd = r.file.into();
            reply(inflight_payload(r.mmap_size, r.mmap_offset, num_queues, queue_size), vec![fd])
        }
        Err(e) => {
            error!("vhost-user: GET_INFLIGHT_FD: {e}; no in-flight tracking");
            reply(inflight_payload(0, 0, num_queues, queue_size), Vec::new())
        }
    }
}

/// `SET_INFLIGHT_FD`: map and check the region and hand it to the backend. Whether it was
/// taken.
fn set_inflight_fd(m: &Message, backend: &BlkBackend) -> bool {
    let Some((mmap_size, mmap_offset, num_queues, queue_size)) = inflight_fields(&m.payload) else {
        error!("vhost-user: SET_INFLIGHT_FD with a {}-byte payload; refused", m.payload.len());
        return false;
    };
    let [fd] = m.fds.as_slice() else {
        error!(
            "vhost-user: SET_INFLIGHT_FD with {} descriptors (1 expected); refused",
            m.fds.len()
        );
        return false;
    };
    let file = match fd.try_clone() {
        Ok(f) => File::from(f),
        Err(e) => {
            error!("vhost-user: SET_INFLIGHT_FD: cannot take the descriptor: {e}; refused");
            return false;
        }
    };
    match InflightRegion::adopt(&file, mmap_size, mmap_offset, num_queues, queue_size) {
        Ok(region) => {
            info!(
                "vhost-user: in-flight region set: {num_queues} queue(s) of {queue_size} ({mmap_size} bytes at offset {mmap_offset})"
            );
            backend.set_inflight(region);
            true
        }
        Err(e) => {
            error!("vhost-user: SET_INFLIGHT_FD refused: {e}; requests are not tracked on this connection");
            false
        }
    }
}

/// A REPLY_ACK answer: 0 for success.
fn ack(request: u32, ok: bool) -> Message {
    Message {
        request,
        flags: FLAG_VERSION_1 | FLAG_REPLY,
        payload: u64::from(!ok).to_le_bytes().to_vec(),
        fds: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(request: u32, flags: u32, payload: Vec<u8>, fds: Vec<OwnedFd>) -> Message {
        Message { request, flags, payload, fds }
    }

    #[test]
    fn messages_round_trip_with_descriptors() {
        let (a, b) = UnixStream::pair().unwrap();
        let f1: OwnedFd = File::open("/dev/null").unwrap().into();
        let f2: OwnedFd = File::open("/dev/zero").unwrap().into();
        write_message(&a, &msg(5, 1, vec![1, 2, 3, 4, 5, 6, 7, 8], vec![f1, f2])).unwrap();
        write_message(&a, &msg(1, 1 | 8, Vec::new(), Vec::new())).unwrap();
        let m = read_message(&b).unwrap();
        assert_eq!(
            (m.request, m.flags, m.payload.as_slice()),
            (5, 1, &[1, 2, 3, 4, 5, 6, 7, 8][..])
        );
        assert_eq!(m.fds.len(), 2);
        let mut zero = File::from(m.fds.into_iter().nth(1).unwrap());
        let mut buf = [1u8; 4];
        zero.read_exact(&mut buf).unwrap();
        assert_eq!(buf, [0; 4], "the second descriptor is /dev/zero");
        let m = read_message(&b).unwrap();
        assert_eq!((m.request, m.flags, m.payload.len(), m.fds.len()), (1, 9, 0, 0));
        drop(a);
        assert!(matches!(read_message(&b), Err(RelayError::Closed)));
    }

    #[test]
    fn malformed_messages_are_refused() {
        let raw = |bytes: &[u8]| {
            let (a, b) = UnixStream::pair().unwrap();
            (&a).write_all(bytes).unwrap();
            drop(a);
            read_message(&b)
        };
        let mut h = Vec::new();
        h.extend_from_slice(&1u32.to_le_bytes());
        h.extend_from_slice(&2u32.to_le_bytes()); // version 2
        h.extend_from_slice(&0u32.to_le_bytes());
        assert!(matches!(raw(&h), Err(RelayError::Malformed("header version is not 1"))));
        let mut h = Vec::new();
        h.extend_from_slice(&1u32.to_le_bytes());
        h.extend_from_slice(&1u32.to_le_bytes());
        h.extend_from_slice(&0x2000u32.to_le_bytes());
        assert!(matches!(raw(&h), Err(RelayError::Malformed("payload larger than 4 KiB"))));
        let mut h = Vec::new();
        h.extend_from_slice(&1u32.to_le_bytes());
        h.extend_from_slice(&1u32.to_le_bytes());
        h.extend_from_slice(&8u32.to_le_bytes());
        h.extend_from_slice(&[0; 3]);
        assert!(matches!(raw(&h), Err(RelayError::Malformed("short payload"))));
        assert!(matches!(raw(&[1, 0, 0]), Err(RelayError::Malformed("short header"))));
    }

    #[test]
    fn get_inflight_fd_answers_a_region_or_size_0() {
        let ask = |queues: u16, size: u16| {
            msg(GET_INFLIGHT_FD, 1, inflight_payload(0, 0, queues, size), Vec::new())
        };
        let r = get_inflight_fd(&ask(2, 128), 2);
        assert_eq!(r.flags, FLAG_VERSION_1 | FLAG_REPLY);
        let (size, off, q, qs) = inflight_fields(&r.payload).unwrap();
        assert_eq!((size, off, q, qs), (2 * crate::inflight::queue_region_bytes(128), 0, 2, 128));
        assert_eq!(r.fds.len(), 1);
        assert_eq!(r.payload.len(), INFLIGHT_PAYLOAD_BYTES);
        // More queues than the device has, a size that is not a power of two, a short
        // payload: size 0 and no descriptor.
        for bad in [get_inflight_fd(&ask(4, 128), 2), get_inflight_fd(&ask(1, 100), 2)] {
            assert_eq!(inflight_fields(&bad.payload).unwrap().0, 0);
            assert!(bad.fds.is_empty());
        }
        let short = get_inflight_fd(&msg(GET_INFLIGHT_FD, 1, vec![0; 8], Vec::new()), 2);
        assert_eq!(inflight_fields(&short.payload).unwrap().0, 0);
    }
}
