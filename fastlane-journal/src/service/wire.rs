//! The attach protocol of the journal service, on the Unix socket `DIR/journal.sock`.
//!
//! A producer connects and sends one hello; the service checks who it is (`SO_PEERCRED`),
//! and answers with one reply that carries, when the attach is accepted, three file
//! descriptors (`SCM_RIGHTS`): the producer's ring, its control block and the service's
//! doorbell, each a sealed memfd. The connection then stays open and silent: its end (the
//! producer exited, was killed, or dropped its handle) is how the service learns that the
//! producer detached. Nothing else is ever sent.
//!
//! Both messages have a fixed size, little-endian integers:
//!
//! | hello | bytes | | reply | bytes |
//! |---|---:|---|---|---:|
//! | magic `FLJHELLO` | 8 | | magic `FLJREPLY` | 8 |
//! | version (1) | 4 | | version (1) | 4 |
//! | ring bytes (0: the service's default) | 4 | | status (0 ok, see [`Status`]) | 4 |
//! | name length | 4 | | producer id | 4 |
//! | zero | 4 | | max record bytes | 4 |
//! | name, UTF-8, zero-padded | 64 | | ring bytes | 8 |
//! | | | | journal id | 16 |
//! | | | | message, UTF-8, zero-padded | 48 |

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

use super::super::format::{u32_at, u64_at};

/// Bytes of a hello.
pub(crate) const HELLO_LEN: usize = 88;
/// Bytes of a reply.
pub(crate) const REPLY_LEN: usize = 96;
/// Longest producer name.
pub const NAME_MAX: usize = 64;
const HELLO_MAGIC: [u8; 8] = *b"FLJHELLO";
const REPLY_MAGIC: [u8; 8] = *b"FLJREPLY";
const VERSION: u32 = 1;
const MESSAGE_MAX: usize = 48;

/// What a producer asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Hello {
    pub(crate) ring_bytes: u32,
    pub(crate) name: String,
}

/// Why an attach was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Status {
    /// Accepted.
    Ok = 0,
    /// The peer's user and groups are not allowed.
    Denied = 1,
    /// The service has its limit of producers.
    TooMany = 2,
    /// The hello was malformed.
    BadHello = 3,
    /// The service is stopping.
    Stopping = 4,
    /// The service could not make the producer's ring.
    Failed = 5,
}

impl Status {
    fn from_code(c: u32) -> Status {
        match c {
            0 => Status::Ok,
            1 => Status::Denied,
            2 => Status::TooMany,
            3 => Status::BadHello,
            4 => Status::Stopping,
            _ => Status::Failed,
        }
    }
}

/// The service's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Reply {
    pub(crate) status: Status,
    pub(crate) producer_id: u32,
    pub(crate) max_record_bytes: u32,
    pub(crate) ring_bytes: u64,
    pub(crate) journal_id: [u8; 16],
    pub(crate) message: String,
}

impl Hello {
    pub(crate) fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        let name = truncate_utf8(&self.name, NAME_MAX);
        b[0..8].copy_from_slice(&HELLO_MAGIC);
        b[8..12].copy_from_slice(&VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&self.ring_bytes.to_le_bytes());
        b[16..20].copy_from_slice(&(name.len() as u32).to_le_bytes());
        b[24..24 + name.len()].copy_from_slice(name.as_bytes());
        b
    }

    /// Decodes a hello from an untrusted peer.
    pub(crate) fn decode(b: &[u8; HELLO_LEN]) -> Result<Hello, &'static str> {
        if b[0..8] != HELLO_MAGIC {
            return Err("bad magic");
        }
        if u32_at(b, 8) != VERSION {
            return Err("unsupported version");
        }
        let len = u32_at(b, 16) as usize;
        if len > NAME_MAX || u32_at(b, 20) != 0 {
            return Err("bad name length");
        }
        let name = std::str::from_utf8(&b[24..24 + len]).map_err(|_| "name is not UTF-8")?;
        if name.chars().any(char::is_control) {
            return Err("name has control characters");
        }
        Ok(Hello { ring_bytes: u32_at(b, 12), name: name.to_string() })
    }
}

impl Reply {
    pub(crate) fn refused(status: Status, message: &str) -> Reply {
        Reply {
            status,
            producer_id: 0,
            max_record_bytes: 0,
            ring_bytes: 0,
            journal_id: [0; 16],
            message: message.to_string(),
        }
    }

    pub(crate) fn encode(&self) -> [u8; REPLY_LEN] {
        let mut b = [0u8; REPLY_LEN];
        b[0..8].copy_from_slice(&REPLY_MAGIC);
        b[8..12].copy_from_slice(&VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&(self.status as u32).to_le_bytes());
        b[16..20].copy_from_slice(&self.producer_id.to_le_bytes());
        b[20..24].copy_from_slice(&self.max_record_bytes.to_le_bytes());
        b[24..32].copy_from_slice(&self.ring_bytes.to_le_bytes());
        b[32..48].copy_from_slice(&self.journal_id);
        let m = truncate_utf8(&self.message, MESSAGE_MAX);
        b[48..48 + m.len()].copy_from_slice(m.as_bytes());
        b
    }

    pub(crate) fn decode(b: &[u8; REPLY_LEN]) -> Result<Reply, &'static str> {
        if b[0..8] != REPLY_MAGIC {
            return Err("bad reply magic");
        }
        if u32_at(b, 8) != VERSION {
            return Err("unsupported reply version");
        }
        let mut journal_id = [0u8; 16];
        journal_id.copy_from_slice(&b[32..48]);
        let m = &b[48..48 + MESSAGE_MAX];
        let end = m.iter().position(|&c| c == 0).unwrap_or(MESSAGE_MAX);
        Ok(Reply {
            status: Status::from_code(u32_at(b, 12)),
            producer_id: u32_at(b, 16),
            max_record_bytes: u32_at(b, 20),
            ring_bytes: u64_at(b, 24),
            journal_id,
            message: String::from_utf8_lossy(&m[..end]).into_owned(),
        })
    }
}

/// The fuzz target `attach_hello` (`fastlane-journal/fuzz`): `data` (zero-padded or cut to
/// the fixed sizes) as a hello from an untrusted producer and as a reply from the service.
/// A hello either is refused or decodes to a name within [`NAME_MAX`] bytes without control
/// characters that encodes and decodes to itself; a reply decodes or is refused; neither
/// panics.
pub fn check_hello_model(data: &[u8]) {
    let mut b = [0u8; HELLO_LEN];
    let n = data.len().min(HELLO_LEN);
    b[..n].copy_from_slice(&data[..n]);
    if let Ok(h) = Hello::decode(&b) {
        assert!(h.name.len() <= NAME_MAX, "{h:?}");
        assert!(!h.name.chars().any(char::is_control), "{h:?}");
        assert_eq!(Hello::decode(&h.encode()), Ok(h.clone()), "hello round trip");
    }
    let mut r = [0u8; REPLY_LEN];
    let n = data.len().min(REPLY_LEN);
    r[..n].copy_from_slice(&data[..n]);
    if let Ok(reply) = Reply::decode(&r) {
        assert!(reply.message.len() <= MESSAGE_MAX * 3, "{reply:?}");
        match Reply::decode(&reply.encode()) {
            Ok(again) => assert_eq!(
                (again.status, again.producer_id, again.ring_bytes),
                (reply.status, reply.producer_id, reply.ring_bytes)
            ),
            Err(e) => panic!("an encoded reply is refused: {e}"),
        }
    }
}

fn truncate_utf8(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// The peer's process, user and group, from the kernel (`SO_PEERCRED`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCred {
    /// Process id at connect time.
    pub pid: i32,
    /// Effective user id.
    pub uid: u32,
    /// Effective group id.
    pub gid: u32,
}

pub(crate) fn peer_cred(s: &UnixStream) -> io::Result<PeerCred> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writes of the sizes given; the socket fd is open.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(PeerCred { pid: cred.pid, uid: cred.uid, gid: cred.gid })
}

/// Sends `bytes` with `fds` attached (`SCM_RIGHTS`), all in one `sendmsg`.
pub(crate) fn send_with_fds(
    s: &UnixStream,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
) -> io::Result<()> {
    let raw: Vec<i32> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let payload = std::mem::size_of_val(raw.as_slice());
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(payload as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    let mut iov =
        libc::iovec { iov_base: bytes.as_ptr() as *mut libc::c_void, iov_len: bytes.len() };
    // SAFETY: an all-zero msghdr is valid.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !raw.is_empty() {
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: `msg_control` points at `space` bytes (`cbuf`), enough for one header:
        // the first header is inside it.
        let c = unsafe { libc::CMSG_FIRSTHDR(&msg) };
        // SAFETY: a pure size computation.
        let cmsg_len = unsafe { libc::CMSG_LEN(payload as u32) } as usize;
        let hdr = libc::cmsghdr {
            cmsg_len: cmsg_len as _,
            cmsg_level: libc::SOL_SOCKET,
            cmsg_type: libc::SCM_RIGHTS,
        };
        // SAFETY: `c` points at the start of `cbuf` (8-byte aligned, `space` bytes long).
        unsafe { c.write(hdr) };
        // SAFETY: CMSG_DATA of that header lies inside `cbuf` with `payload` bytes after it.
        let data = unsafe { libc::CMSG_DATA(c) }.cast::<i32>();
        for (i, fd) in raw.iter().enumerate() {
            // SAFETY: `i < raw.len()`, so the write stays inside the header's `payload` bytes.
            unsafe { data.wrapping_add(i).write_unaligned(*fd) };
        }
    }
    let n = loop {
        // SAFETY: `msg` names live buffers (`iov` over `bytes`, `cbuf`) for the duration of the call.
        let n = unsafe { libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n >= 0 {
            break n;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    if n as usize != bytes.len() {
        return Err(io::Error::new(io::ErrorKind::WriteZero, "short sendmsg"));
    }
    Ok(())
}

/// Receives exactly `buf.len()` bytes and up to `max_fds` descriptors sent with them.
pub(crate) fn recv_with_fds(
    s: &UnixStream,
    buf: &mut [u8],
    max_fds: usize,
) -> io::Result<Vec<OwnedFd>> {
    let payload = max_fds * std::mem::size_of::<i32>();
    // SAFETY: a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(payload as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: an all-zero msghdr is valid.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // A signal that arrives while waiting (a producer's own timers, a profiler) is not an
    // error: wait again (the test suite's EINTR on "read attach reply").
    let n = loop {
        // SAFETY: `msg` names live, writable buffers of the sizes given.
        let n = unsafe { libc::recvmsg(s.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    let mut fds = Vec::new();
    // SAFETY: the kernel filled `msg_controllen` bytes of `cbuf` with well-formed headers;
    // CMSG_FIRSTHDR returns the first or null.
    let mut c = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    while !c.is_null() {
        // SAFETY: `c` is a header the kernel wrote inside `cbuf`.
        let h = unsafe { c.read_unaligned() };
        if h.cmsg_level == libc::SOL_SOCKET && h.cmsg_type == libc::SCM_RIGHTS {
            // SAFETY: the header's data follows it inside `cbuf`.
            let data = unsafe { libc::CMSG_DATA(c) }.cast::<i32>();
            // SAFETY: a pure size computation.
            let head = unsafe { libc::CMSG_LEN(0) } as usize;
            let count = (h.cmsg_len as usize).saturating_sub(head) / 4;
            for i in 0..count {
                // SAFETY: `count` descriptors lie in the header's data, inside `cbuf`.
                let fd = unsafe { data.wrapping_add(i).read_unaligned() };
                // SAFETY: SCM_RIGHTS installed `fd` in this process for us; nobody else owns it.
                fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
            }
        }
        // SAFETY: `msg` and `c` are as above; CMSG_NXTHDR returns the next header or null.
        c = unsafe { libc::CMSG_NXTHDR(&msg, c) };
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "descriptors truncated"));
    }
    let mut got = n as usize;
    if got == 0 && !buf.is_empty() {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the service closed the socket"));
    }
    // The rest of a short read carries no descriptors (they came with the first byte).
    let mut s2 = s;
    while got < buf.len() {
        let k = match s2.read(&mut buf[got..]) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => r?,
        };
        if k == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "short reply"));
        }
        got += k;
    }
    Ok(fds)
}

/// Writes a hello (client side).
pub(crate) fn send_hello(s: &mut UnixStream, h: &Hello) -> io::Result<()> {
    s.write_all(&h.encode())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_and_reply_round_trip_and_garbage_is_refused() {
        let h = Hello { ring_bytes: 1 << 20, name: "feed-handler-7".into() };
        assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
        let r = Reply {
            status: Status::Ok,
            producer_id: 9,
            max_record_bytes: 4096,
            ring_bytes: 1 << 20,
            journal_id: [3; 16],
            message: "attached".into(),
        };
        assert_eq!(Reply::decode(&r.encode()).unwrap(), r);
        let mut bad = h.encode();
        bad[16] = 200;
        assert_eq!(Hello::decode(&bad), Err("bad name length"));
        let mut bad = h.encode();
        bad[24] = 0xff;
        assert_eq!(Hello::decode(&bad), Err("name is not UTF-8"));
        // Any bytes decode to a value or an error, never a panic.
        let mut x = 0x9e37_79b9_u32;
        for _ in 0..2000 {
            let mut b = h.encode();
            for byte in b.iter_mut().skip(8) {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                *byte = x as u8;
            }
            let _ = Hello::decode(&b);
        }
        // A long name is cut at a character boundary.
        let long = Hello { ring_bytes: 0, name: "é".repeat(40) };
        let d = Hello::decode(&long.encode()).unwrap();
        assert_eq!(d.name, "é".repeat(32));
    }

    #[test]
    fn descriptors_travel_with_the_reply() {
        let (a, b) = UnixStream::pair().unwrap();
        let f = tempfile::tempfile().unwrap();
        let r = Reply::refused(Status::Ok, "x").encode();
        use std::os::fd::AsFd;
        send_with_fds(&a, &r, &[f.as_fd(), f.as_fd()]).unwrap();
        let mut buf = [0u8; REPLY_LEN];
        let fds = recv_with_fds(&b, &mut buf, 3).unwrap();
        assert_eq!(fds.len(), 2);
        assert_eq!(buf, r);
        let cred = peer_cred(&b).unwrap();
        assert_eq!(cred.pid as u32, std::process::id());
    }
}
