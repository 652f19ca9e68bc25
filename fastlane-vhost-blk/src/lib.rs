//! FastLane's vhost-user-blk device: QEMU (or any vhost-user frontend) attaches to a Unix
//! socket and sees a virtio-blk disk whose I/O goes straight to a [`BlockDevice`].
//!
//! Built on rust-vmm: vhost (protocol), vhost-user-backend (daemon, epoll threads, vrings),
//! virtio-queue (chain walking), vm-memory (guest memory). What is ours:
//! - [`request`]: the virtio-blk request parser (hostile input; zero-copy segments);
//! - [`worker`]: one worker per virtqueue with its own block queue and adaptive polling;
//! - [`device`]: the `VhostUserBackend` implementation (features, config space, events);
//! - [`config`]: the virtio-blk config space;
//! - [`stats`]: per-queue counters (rejections per reason) and latency histograms;
//! - [`BlkServer`]: one socket, one frontend at a time, the next one after a disconnect;
//! - [`spec`]: the backend factory of `fastlane serve --backend`: `mem:`, `file:` and `nvme:`
//!   specs opened as a [`BlockDevice`] (it sits here, above the backends, because it names
//!   the VFIO driver).
//!
//! Not here: the backends themselves (io_uring, inline file and RAM in `fastlane_block`, the
//! VFIO NVMe driver in `fastlane_nvme`), the `fastlane serve` command (`fastlane-cli/`) and the QEMU
//! guest test (`fastlane-cli/tests/vm_blk.rs`, `tests/vm/`).
// Guest input: a panic here is a guest taking the device down; errors instead.
#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

pub mod chain;
pub mod clock;
pub mod config;
pub mod device;
pub mod inflight;
pub mod interpose;
pub mod request;
pub mod spec;
pub mod stats;
pub mod worker;

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use log::{info, warn};
use vhost::vhost_user::Listener;
use vhost_user_backend::{ShutdownHandle, VhostUserDaemon};
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};

pub use config::BlkGeometry;
pub use device::{BlkBackend, DeviceSettings};
pub use request::{RejectReason, ID_LEN};
pub use stats::{BlkStats, QueueStats, MERGE_INTERVAL};

use fastlane_block::BlockDevice;

/// Errors of the vhost-user-blk device and server.
#[derive(Debug, thiserror::Error)]
pub enum VhostBlkError {
    /// The socket could not be created.
    #[error("cannot listen on {path}")]
    Listen {
        /// Socket path.
        path: PathBuf,
        /// Why.
        #[source]
        source: vhost::vhost_user::Error,
    },
    /// The vhost-user daemon could not be created or started.
    #[error("vhost-user daemon failed: {detail}")]
    Daemon {
        /// What the library said.
        detail: String,
    },
    /// Waiting for a frontend failed.
    #[error("cannot wait for a frontend on {socket}")]
    Accept {
        /// The socket's path, or where its descriptor came from.
        socket: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// An option is out of range.
    #[error("invalid option {name}: {reason}")]
    InvalidOption {
        /// Which.
        name: &'static str,
        /// What is wrong.
        reason: &'static str,
    },
}

/// How to export a device.
#[derive(Debug, Clone)]
pub struct VhostBlkOptions {
    /// Virtqueues (and worker threads), 1..=64.
    pub num_queues: u16,
    /// Largest virtqueue the frontend may set up (power of two, 2..=32768).
    pub queue_size_max: u16,
    /// Busy-poll window after activity, in µs (0: sleep at once).
    pub poll_us: u32,
    /// GET_ID answer: up to 20 bytes.
    pub serial: String,
    /// Export read-only (`VIRTIO_BLK_F_RO`) even if the device is writable.
    pub read_only: bool,
    /// Track in-flight requests in a region of the backend's own when the frontend sends
    /// none (a frontend without `INFLIGHT_SHMFD`, such as virtio-driver): no crash recovery,
    /// the same data-path work; for measuring that work.
    pub own_inflight: bool,
}

impl Default for VhostBlkOptions {
    fn default() -> Self {
        VhostBlkOptions {
            num_queues: 1,
            queue_size_max: 1024,
            poll_us: 50,
            serial: "fastlane".to_string(),
            read_only: false,
            own_inflight: false,
        }
    }
}

impl VhostBlkOptions {
    /// Check the options and derive the device settings for `device`.
    pub fn settings(&self, device: &dyn BlockDevice) -> Result<DeviceSettings, VhostBlkError> {
        if self.num_queues == 0 || self.num_queues > 64 {
            return Err(VhostBlkError::InvalidOption { name: "queues", reason: "must be 1..=64" });
        }
        if !self.queue_size_max.is_power_of_two() || self.queue_size_max < 2 {
            return Err(VhostBlkError::InvalidOption {
                name: "queue_size_max",
                reason: "must be a power of two >= 2",
            });
        }
        if self.serial.len() > ID_LEN {
            return Err(VhostBlkError::InvalidOption {
                name: "serial",
                reason: "at most 20 bytes",
            });
        }
        let mut serial = [0u8; ID_LEN];
        serial[..self.serial.len()].copy_from_slice(self.serial.as_bytes());
        Ok(DeviceSettings {
            geometry: BlkGeometry::new(
                &device.info(),
                self.read_only,
                self.num_queues,
                self.queue_size_max,
            ),
            queue_size_max: self.queue_size_max,
            poll: Duration::from_micros(u64::from(self.poll_us)),
            serial,
            own_inflight: self.own_inflight,
            clock: clock::Clock::detect(),
        })
    }
}

/// Stops a [`BlkServer`] from another thread (a signal handler thread, a test).
#[derive(Default)]
pub struct StopHandle {
    stop: AtomicBool,
    current: Mutex<Option<ShutdownHandle>>,
}

impl std::fmt::Debug for StopHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StopHandle").field("stopped", &self.stopped()).finish_non_exhaustive()
    }
}

impl StopHandle {
    /// Ask the server to stop: drop the current frontend and accept no other.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        if let Some(h) = self.current.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            h.shutdown();
        }
    }

    /// Whether [`StopHandle::stop`] was called.
    pub fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// Drop the current frontend only (tests: a frontend that vanishes).
    pub fn disconnect_current(&self) {
        if let Some(h) = self.current.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            h.shutdown();
        }
    }

    fn set_current(&self, h: Option<ShutdownHandle>) {
        *self.current.lock().unwrap_or_else(|e| e.into_inner()) = h;
    }
}

/// What happened to the server, for an observer (`fastlane serve` reports it to systemd).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerEvent {
    /// A frontend connected; its number, from 1.
    Connected(u64),
    /// That frontend went away (or was disconnected by the server).
    Disconnected(u64),
    /// That frontend's connection ended with an error; the server keeps listening.
    Failed(u64, String),
}

/// How a connection ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnectionEnd {
    /// The server was stopped before a frontend connected.
    Stopped,
    /// The frontend disconnected (or was disconnected by [`StopHandle::stop`]).
    Disconnected,
    /// The connection failed; the server keeps listening.
    Failed(String),
}

/// A vhost-user-blk export on one socket. Serves one frontend at a time; after a disconnect it
/// accepts the next one (a fresh daemon per connection, one listener for all).
pub struct BlkServer {
    listener: Listener,
    /// The socket file we created (`bind`); `None` for a socket handed to us
    /// ([`BlkServer::from_listener`]), which is not ours to remove.
    socket: Option<PathBuf>,
    /// What the logs call the socket: its path, or where the descriptor came from.
    label: String,
    device: Arc<dyn BlockDevice>,
    settings: DeviceSettings,
    stats: Arc<BlkStats>,
    stop: Arc<StopHandle>,
    connections: u64,
    observer: Option<Observer>,
}

/// What [`BlkServer::set_observer`] installs.
type Observer = Box<dyn FnMut(&ServerEvent) + Send>;

impl std::fmt::Debug for BlkServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlkServer")
            .field("socket", &self.label)
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl BlkServer {
    /// Listen on `socket` (an existing socket file there is replaced; the file is removed
    /// when the server is dropped).
    pub fn bind(
        socket: impl AsRef<Path>,
        device: Arc<dyn BlockDevice>,
        options: &VhostBlkOptions,
    ) -> Result<Self, VhostBlkError> {
        let socket = socket.as_ref().to_path_buf();
        let settings = options.settings(&*device)?;
        let listener = Listener::new(&socket, true)
            .map_err(|source| VhostBlkError::Listen { path: socket.clone(), source })?;
        let label = socket.display().to_string();
        Ok(Self::with_listener(listener, Some(socket), label, device, settings))
    }

    /// Serve on a socket that is already listening: one handed over by systemd or libvirt
    /// (`LISTEN_FDS`, `--fd`). `label` names it in the logs. The socket file, if any, is not
    /// ours: it is left in place when the server is dropped.
    pub fn from_listener(
        listener: UnixListener,
        label: impl Into<String>,
        device: Arc<dyn BlockDevice>,
        options: &VhostBlkOptions,
    ) -> Result<Self, VhostBlkError> {
        let settings = options.settings(&*device)?;
        Ok(Self::with_listener(Listener::from(listener), None, label.into(), device, settings))
    }

    fn with_listener(
        listener: Listener,
        socket: Option<PathBuf>,
        label: String,
        device: Arc<dyn BlockDevice>,
        settings: DeviceSettings,
    ) -> Self {
        info!(
            "listening on {label} ({} bytes, block size {}, {} queue(s){})",
            settings.geometry.capacity_bytes,
            settings.geometry.block_size,
            settings.geometry.num_queues,
            if settings.geometry.read_only { ", read-only" } else { "" }
        );
        BlkServer {
            listener,
            socket,
            label,
            stats: Arc::new(BlkStats::new(settings.geometry.num_queues as usize)),
            device,
            settings,
            stop: Arc::new(StopHandle::default()),
            connections: 0,
            observer: None,
        }
    }

    /// The socket file this server created and removes on drop (`None`: handed to us).
    pub fn socket(&self) -> Option<&Path> {
        self.socket.as_deref()
    }

    /// What the logs call the socket.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Call `f` on every connect and disconnect (from the thread running the server).
    pub fn set_observer(&mut self, f: impl FnMut(&ServerEvent) + Send + 'static) {
        self.observer = Some(Box::new(f));
    }

    fn observe(&mut self, event: ServerEvent) {
        if let Some(f) = self.observer.as_mut() {
            f(&event);
        }
    }

    /// What is exported.
    pub fn settings(&self) -> &DeviceSettings {
        &self.settings
    }

    /// Counters and histograms, across connections.
    pub fn stats(&self) -> Arc<BlkStats> {
        self.stats.clone()
    }

    /// A handle to stop the server from another thread.
    pub fn stop_handle(&self) -> Arc<StopHandle> {
        self.stop.clone()
    }

    /// Serve frontends one after another until stopped.
    pub fn run(&mut self) -> Result<(), VhostBlkError> {
        loop {
            match self.serve_one()? {
                ConnectionEnd::Stopped => return Ok(()),
                ConnectionEnd::Disconnected => {}
                ConnectionEnd::Failed(e) => warn!("frontend connection failed: {e}"),
            }
            if self.stop.stopped() {
                return Ok(());
            }
        }
    }

    /// Wait for one frontend and serve it until it goes away.
    pub fn serve_one(&mut self) -> Result<ConnectionEnd, VhostBlkError> {
        let frontend = loop {
            if !self.wait_for_frontend()? {
                return Ok(ConnectionEnd::Stopped);
            }
            match self.listener.accept() {
                Ok(Some(s)) => break s,
                // Gone before we took it: wait for the next one.
                Ok(None) => continue,
                Err(e) => return Ok(ConnectionEnd::Failed(format!("accept: {e}"))),
            }
        };
        let mem = GuestMemoryAtomic::new(GuestMemoryMmap::new());
        let backend = Arc::new(BlkBackend::new(
            self.settings.clone(),
            self.device.clone(),
            self.stats.clone(),
            mem.clone(),
        ));
        let mut daemon =
            VhostUserDaemon::new("fastlane-vhost-blk".to_string(), backend.clone(), mem)
                .map_err(|e| VhostBlkError::Daemon { detail: e.to_string() })?;
        backend.set_epoll_handlers(&daemon.get_epoll_handlers());
        // The daemon serves our end of a private socket; the relay copies messages between it
        // and the frontend and answers the in-flight messages itself (interpose.rs).
        let private = match interpose::PrivateSocket::new(self.connections + 1) {
            Ok(p) => p,
            Err(e) => return Ok(ConnectionEnd::Failed(format!("relay socket: {e}"))),
        };
        let interpose::PrivateSocket { mut listener, ours } = private;
        if let Err(e) = daemon.start(&mut listener) {
            return Ok(ConnectionEnd::Failed(e.to_string()));
        }
        drop(listener);
        let relay = match interpose::Relay::start(
            frontend,
            ours,
            backend.clone(),
            self.settings.geometry.num_queues,
        ) {
            Ok(r) => r,
            Err(e) => {
                daemon.request_shutdown();
                return Ok(ConnectionEnd::Failed(format!("relay threads: {e}")));
            }
        };
        self.connections += 1;
        self.stats.connections.fetch_add(1, Ordering::Relaxed);
        info!("frontend connected (connection {})", self.connections);
        self.observe(ServerEvent::Connected(self.connections));
        self.stop.set_current(daemon.shutdown_handle());
        if self.stop.stopped() {
            daemon.request_shutdown();
        }
        let result = daemon.wait();
        self.stop.set_current(None);
        relay.finish();
        // Dropping the daemon stops and joins the worker threads; `disconnect` then finishes
        // the workers (in-flight requests, histograms) and unregisters the guest memory from
        // the device before the regions are unmapped.
        drop(daemon);
        backend.disconnect();
        let end = match result {
            Ok(()) => ConnectionEnd::Disconnected,
            Err(vhost_user_backend::Error::HandleRequest(
                vhost::vhost_user::Error::Disconnected | vhost::vhost_user::Error::PartialMessage,
            )) => ConnectionEnd::Disconnected,
            Err(e) => ConnectionEnd::Failed(e.to_string()),
        };
        match &end {
            ConnectionEnd::Disconnected => {
                info!("frontend disconnected (connection {})", self.connections);
                self.observe(ServerEvent::Disconnected(self.connections));
            }
            ConnectionEnd::Failed(e) => {
                warn!("frontend connection {} ended with an error: {e}", self.connections);
                self.stats.connections_failed.fetch_add(1, Ordering::Relaxed);
                self.observe(ServerEvent::Failed(self.connections, e.clone()));
            }
            ConnectionEnd::Stopped => {}
        }
        let summary = self.stats.summary();
        if !summary.is_empty() {
            info!("totals so far:\n{}", summary.trim_end());
        }
        Ok(end)
    }

    /// Block until a frontend is waiting to be accepted (true) or the server is stopped
    /// (false). Polls so that a stop is seen within 100 ms.
    fn wait_for_frontend(&self) -> Result<bool, VhostBlkError> {
        loop {
            if self.stop.stopped() {
                return Ok(false);
            }
            let mut pfd =
                libc::pollfd { fd: self.listener.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY:
            // - `pfd` is one valid, initialized pollfd on our stack, and we pass a count of 1;
            // - poll does not keep the pointer after it returns.
            let rc = unsafe { libc::poll(&mut pfd, 1, 100) };
            if rc < 0 {
                let err = std::io::Error::last_os_error();
                if err.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(VhostBlkError::Accept { socket: self.label.clone(), source: err });
            }
            if rc > 0 && pfd.revents & libc::POLLIN != 0 {
                return Ok(true);
            }
        }
    }
}
