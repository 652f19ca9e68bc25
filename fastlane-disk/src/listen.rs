//! Where `fastlane serve`'s listening socket comes from, as QEMU's vhost-user "backend program
//! conventions" and systemd's socket activation (`sd_listen_fds(3)`) say:
//!
//! - `--socket-path PATH`: we create the socket (replacing a stale file) and remove it at exit;
//! - `--fd FD`: a listening Unix stream socket the manager (libvirt) created and passed;
//! - neither, with `LISTEN_PID` = our pid and `LISTEN_FDS=1`: systemd's socket, fd 3.
//!
//! An inherited descriptor is checked to be a listening Unix stream socket before it is
//! served, so a wrong number fails at start with a message naming where it came from, not at
//! the first frontend.

use std::os::fd::{FromRawFd as _, RawFd};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context as _};
use fastlane_block::BlockDevice;
use fastlane_vhost_blk::{BlkServer, VhostBlkOptions};

/// The first descriptor systemd passes (`SD_LISTEN_FDS_START`).
const LISTEN_FDS_START: RawFd = 3;

/// Where the socket comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SocketSource {
    /// Create it here.
    Path(PathBuf),
    /// Inherited: the descriptor and the flag or variable that named it.
    Fd(RawFd, &'static str),
}

impl SocketSource {
    /// `--socket-path` wins, then `--fd` (clap refuses both), then `LISTEN_FDS`.
    pub(crate) fn from_args(path: Option<&Path>, fd: Option<RawFd>) -> anyhow::Result<Self> {
        if let Some(p) = path {
            return Ok(SocketSource::Path(p.to_path_buf()));
        }
        if let Some(fd) = fd {
            return Ok(SocketSource::Fd(fd, "--fd"));
        }
        let passed = fastlane_daemon::notify::listen_fds()
            .context("LISTEN_PID/LISTEN_FDS are set but malformed (systemd socket activation)")?;
        let n = passed.len();
        // Not for our children (none are started, but the variables describe our fds only).
        std::env::remove_var("LISTEN_PID");
        std::env::remove_var("LISTEN_FDS");
        std::env::remove_var("LISTEN_FDNAMES");
        match n {
            0 => bail!(
                "no socket to serve: give --socket-path PATH or --fd FD, or start it with a \
                 socket from systemd (LISTEN_FDS)"
            ),
            1 => Ok(SocketSource::Fd(LISTEN_FDS_START, "LISTEN_FDS")),
            n => bail!(
                "LISTEN_FDS={n}: fastlane serve takes exactly one socket (one export per \
                 process; use one socket unit per disk)"
            ),
        }
    }

    /// Bind or adopt the socket and make the server on it.
    pub(crate) fn serve(
        &self,
        device: Arc<dyn BlockDevice>,
        options: &VhostBlkOptions,
    ) -> anyhow::Result<BlkServer> {
        match self {
            SocketSource::Path(path) => BlkServer::bind(path, device, options)
                .with_context(|| format!("cannot serve on {}", path.display())),
            SocketSource::Fd(fd, from) => {
                let listener = adopt_listener(*fd, from)?;
                let label = match listener
                    .local_addr()
                    .ok()
                    .and_then(|a| a.as_pathname().map(|p| p.display().to_string()))
                {
                    Some(path) => format!("fd {fd} ({from}, {path})"),
                    None => format!("fd {fd} ({from})"),
                };
                BlkServer::from_listener(listener, label, device, options)
                    .with_context(|| format!("cannot serve on fd {fd} ({from})"))
            }
        }
    }
}

/// Checks that `fd` is an open, listening Unix stream socket, marks it close-on-exec and takes
/// ownership of it.
fn adopt_listener(fd: RawFd, from: &str) -> anyhow::Result<UnixListener> {
    if fd < 0 {
        bail!("{from}: fd {fd} is not a file descriptor");
    }
    let sockopt = |opt: libc::c_int| -> std::io::Result<libc::c_int> {
        let mut v: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY:
        // - `v` and `len` are valid, writable locals sized for an int option; the kernel
        //   writes at most `len` bytes into `v` and does not keep the pointers;
        // - `fd` is only read; an fd that is not open or not a socket gives an error.
        let rc =
            unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, opt, (&raw mut v).cast(), &mut len) };
        if rc == 0 {
            Ok(v)
        } else {
            Err(std::io::Error::last_os_error())
        }
    };
    let domain = sockopt(libc::SO_DOMAIN)
        .with_context(|| format!("{from}: fd {fd} is not an open socket"))?;
    if domain != libc::AF_UNIX {
        bail!("{from}: fd {fd} is not a Unix socket (address family {domain})");
    }
    if sockopt(libc::SO_TYPE)? != libc::SOCK_STREAM {
        bail!("{from}: fd {fd} is not a stream socket");
    }
    if sockopt(libc::SO_ACCEPTCONN)? == 0 {
        bail!("{from}: fd {fd} is a Unix socket that is not listening");
    }
    // SAFETY:
    // - F_SETFD on an fd we just checked is open; it only changes its close-on-exec flag.
    if unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("{from}: fd {fd}: cannot set close-on-exec"));
    }
    // SAFETY:
    // - `fd` is an open, listening Unix stream socket (checked above);
    // - the convention hands it to us: nothing else in this process owns or closes it, and
    //   it is wrapped exactly once (this function is called once per start).
    Ok(unsafe { UnixListener::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::IntoRawFd as _;

    #[test]
    fn a_listening_unix_socket_is_adopted_and_anything_else_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let fd = UnixListener::bind(&path).unwrap().into_raw_fd();
        let l = adopt_listener(fd, "--fd").unwrap();
        assert_eq!(l.local_addr().unwrap().as_pathname(), Some(path.as_path()));

        let file = std::fs::File::open("/dev/null").unwrap();
        let e = adopt_listener(std::os::fd::AsRawFd::as_raw_fd(&file), "--fd").unwrap_err();
        assert!(format!("{e:#}").contains("is not an open socket"), "{e:#}");

        let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let e = adopt_listener(std::os::fd::AsRawFd::as_raw_fd(&tcp), "--fd").unwrap_err();
        assert!(format!("{e:#}").contains("not a Unix socket"), "{e:#}");

        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let e = adopt_listener(std::os::fd::AsRawFd::as_raw_fd(&a), "LISTEN_FDS").unwrap_err();
        assert!(format!("{e:#}").contains("LISTEN_FDS: fd"), "{e:#}");
        assert!(format!("{e:#}").contains("not listening"), "{e:#}");

        let e = adopt_listener(-1, "--fd").unwrap_err();
        assert!(format!("{e:#}").contains("not a file descriptor"), "{e:#}");
    }

    #[test]
    fn the_path_wins_then_the_fd() {
        let p = Path::new("/tmp/x.sock");
        assert_eq!(
            SocketSource::from_args(Some(p), None).unwrap(),
            SocketSource::Path(p.to_path_buf())
        );
        assert_eq!(SocketSource::from_args(None, Some(7)).unwrap(), SocketSource::Fd(7, "--fd"));
    }
}
