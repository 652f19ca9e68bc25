//! FastLane's disk daemon: export a block backend as a vhost-user-blk device on a Unix socket.
//! It runs as the `fastlane-disk` binary of this crate and as `fastlane serve` (the same
//! [`ServeArgs`] and [`run`]), and links none of the LLM crates.
//!
//! Serves one frontend (QEMU, qemu-storage-daemon's clients, virtio-driver) at a time and the
//! next one after it disconnects. Runs the way QEMU's vhost-user "backend program conventions"
//! and systemd expect: `--socket-path`, `--fd`, or the socket systemd passes (`LISTEN_FDS`);
//! `--print-capabilities`; READY/STATUS/STOPPING through `NOTIFY_SOCKET`; no daemonizing.
//! SIGINT/SIGTERM: drop the frontend, flush the backend, remove the socket it created, and
//! write per-queue latency histograms when `--hlog` is given. SIGUSR1 logs the totals.
//! `--metrics ADDR` serves the per-queue counters and latency histograms to Prometheus (read
//! at each scrape; docs/vhost-blk.md).
//!
//! The device itself (virtqueues, requests, the in-flight region) is `fastlane-vhost-blk`;
//! the backends are `fastlane-block`'s. This crate only parses the options, finds the socket,
//! and runs the server with its signals, notifications, stats and metrics.

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use fastlane_block::{BlockDevice, BlockOp, BlockRequest, Completion};
use fastlane_daemon::notify::{notify, NotifyState};
use fastlane_vhost_blk::spec::{BackendSpec, IoEngine, SpecOptions};
use fastlane_vhost_blk::{ServerEvent, VhostBlkOptions};

use fastlane_daemon::signals::StopSignals;

mod listen;
mod metrics;
mod stats;

use metrics::BlkMetrics;
use stats::{log_totals, StatsTicker};

/// `fastlane serve` options. The names QEMU's vhost-user "backend program conventions" give
/// (`--socket-path`, `--fd`, `--print-capabilities`, `--blk-file`, `--read-only`) are the
/// primary ones; `--socket` and `--readonly` are kept as aliases.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Unix socket to create and listen on (an existing file there is replaced; removed at
    /// exit). Without it and without --fd, the socket systemd passes (LISTEN_FDS, fd 3) is
    /// served.
    #[arg(long = "socket-path", visible_alias = "socket", value_name = "PATH")]
    pub socket_path: Option<PathBuf>,
    /// Serve this inherited file descriptor, a listening Unix stream socket (libvirt and
    /// other managers that create the socket themselves).
    #[arg(long, value_name = "FD", conflicts_with = "socket_path")]
    pub fd: Option<i32>,
    /// Print the backend's capabilities as JSON (QEMU's vhost-user.json: type "block",
    /// features "read-only" and "blk-file") and exit.
    #[arg(long)]
    pub print_capabilities: bool,
    /// What to export: `mem:SIZE` (RAM disk, e.g. mem:256M) or `file:PATH` (see --io).
    #[arg(long, default_value = "mem:256M")]
    pub backend: String,
    /// Export this file or block device: the same as `--backend file:PATH`.
    #[arg(long, value_name = "PATH", conflicts_with = "backend")]
    pub blk_file: Option<PathBuf>,
    /// Virtqueues, one worker thread each (QEMU's num-queues must not exceed it).
    #[arg(long, default_value_t = 1)]
    pub queues: u16,
    /// Export read-only (VIRTIO_BLK_F_RO).
    #[arg(long = "read-only", visible_alias = "readonly")]
    pub read_only: bool,
    /// `file:` backends: open with O_DIRECT.
    #[arg(long)]
    pub direct: bool,
    /// `file:` backends: how reads and writes reach the file. `auto` probes the file once
    /// with a non-blocking read (preadv2 RWF_NOWAIT): where that is unsupported (tmpfs such as
    /// /dev/shm, ramfs) io_uring would hand every request to a kernel worker thread that
    /// competes for the backend's CPU, so `sync` is used; otherwise (and always with
    /// --direct) `uring`. The choice and the reason are logged at start.
    #[arg(long, value_enum, default_value_t = IoArg::Auto)]
    pub io: IoArg,
    /// Busy-poll window after activity, in µs (0: sleep on the eventfds at once).
    #[arg(long, default_value_t = 50)]
    pub poll_us: u32,
    /// At exit, write per-queue request latency histograms (ns) to this .hlog file.
    #[arg(long)]
    pub hlog: Option<PathBuf>,
    /// GET_ID serial (at most 20 bytes).
    #[arg(long, default_value = "fastlane")]
    pub serial: String,
    /// Serve Prometheus metrics at http://ADDR/metrics (e.g. 127.0.0.1:9100; port 0 picks a
    /// free port, logged as "metrics on http://…/metrics"): per-queue requests, bytes,
    /// rejections, request latency histograms, in-flight requests, connections
    /// (docs/vhost-blk.md lists them). Read at each scrape from what the queues already
    /// count and record, so the data path does no extra work. Off by default.
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<SocketAddr>,
    /// Track in-flight requests in a region of the backend's own when the frontend sends none
    /// (virtio-driver clients such as `fastlane bench blk` do not ask for one; QEMU does). It
    /// dies with the backend, so it recovers nothing: it exists to measure what tracking costs
    /// on the data path.
    #[arg(long)]
    pub own_inflight_region: bool,
    /// Log one line every S seconds: requests, throughput, in-flight requests and latency
    /// percentiles of that interval, summed over the queues (0: off). SIGUSR1 logs the totals
    /// since start at any time.
    #[arg(long, value_name = "S", default_value_t = 0.0)]
    pub stats_interval: f64,
}

/// `--io`: the I/O engine of `file:` backends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum IoArg {
    /// `sync` on files without non-blocking buffered I/O (tmpfs, ramfs), else `uring`.
    Auto,
    /// io_uring, one ring per queue (needed for --direct; keeps queue depth on real devices).
    Uring,
    /// preadv/pwritev on the queue's own thread, inline (page-cache copies; no O_DIRECT).
    Sync,
}

impl From<IoArg> for IoEngine {
    fn from(a: IoArg) -> IoEngine {
        match a {
            IoArg::Auto => IoEngine::Auto,
            IoArg::Uring => IoEngine::Uring,
            IoArg::Sync => IoEngine::Sync,
        }
    }
}

/// The program name under which the `fastlane` binary is `fastlane serve` (a link of that
/// name; see fastlane-cli's `main.rs`), the name QEMU's and libvirt's vhost-user JSON
/// descriptor points at.
pub const BACKEND_PROGRAM: &str = "fastlane-vhost-user-blk";

/// What `--print-capabilities` prints: QEMU's `vhost-user.json` schema, a block backend
/// with the options of that convention it takes.
pub const CAPABILITIES: &str = r#"{"type":"block","features":["read-only","blk-file"]}"#;

/// How long a metrics scrape or a stats line waits for the queues to merge their latency.
pub(crate) const REFRESH_WAIT: Duration = Duration::from_millis(50);

/// Run the disk daemon (`fastlane serve`, `fastlane-disk`) until SIGINT/SIGTERM.
///
/// Logs through `fastlane_daemon::logging`: a caller that wants another `--log-format`
/// installs the logger before; otherwise text lines are installed here.
pub fn run(args: &ServeArgs) -> anyhow::Result<()> {
    if args.print_capabilities {
        println!("{CAPABILITIES}");
        return Ok(());
    }
    fastlane_daemon::logging::init(fastlane_daemon::LogFormat::default());
    // Block the stop signals (and SIGUSR1) before any thread exists, so every thread inherits
    // the mask and only the signal thread below receives them (with sigwait).
    let signals = StopSignals::block_with_report()?;
    if !(args.stats_interval >= 0.0 && args.stats_interval <= 86_400.0) {
        bail!("--stats-interval {}: must be 0 (off) to 86400 seconds", args.stats_interval);
    }
    // Decide where the socket comes from before opening anything: a wrong invocation
    // fails at once, naming the flag.
    let source = listen::SocketSource::from_args(args.socket_path.as_deref(), args.fd)?;

    let spec: BackendSpec = match &args.blk_file {
        Some(path) => BackendSpec::File { path: path.clone() },
        None => args.backend.parse().context("bad --backend")?,
    };
    let (device, engine) = spec
        .open_explained(&SpecOptions {
            read_only: args.read_only,
            direct: args.direct,
            io: args.io.into(),
            ..SpecOptions::default()
        })
        .with_context(|| format!("cannot open backend {spec}"))?;
    if let Some(choice) = engine {
        log::info!("backend {spec}: I/O engine {}: {}", choice.engine, choice.reason);
    }
    let options = VhostBlkOptions {
        num_queues: args.queues,
        poll_us: args.poll_us,
        serial: args.serial.clone(),
        read_only: args.read_only,
        own_inflight: args.own_inflight_region,
        ..VhostBlkOptions::default()
    };
    let mut server = source.serve(device.clone(), &options)?;
    let capacity_bytes = server.settings().geometry.capacity_bytes;
    let exporter = fastlane_daemon::metrics::start_if(args.metrics, |f| {
        let m = BlkMetrics::new(f);
        let stats = server.stats();
        move || m.update(&stats, capacity_bytes)
    })?;
    if let Some(path) = server.socket() {
        print_qemu_command(path, args.queues);
    }

    let stop = server.stop_handle();
    let stats = server.stats();
    signals.on_stop_or_report(
        {
            let stop = stop.clone();
            move || {
                notify(&[NotifyState::Stopping, NotifyState::Status("stopping")]);
                stop.stop()
            }
        },
        {
            let stats = stats.clone();
            move || log_totals(&stats)
        },
    )?;
    let ticker = (args.stats_interval > 0.0)
        .then(|| StatsTicker::start(stats.clone(), Duration::from_secs_f64(args.stats_interval)))
        .transpose()?;
    let waiting = format!("listening on {}, waiting for a frontend", server.label());
    server.set_observer(|event| {
        let status = match event {
            ServerEvent::Connected(n) => format!("frontend connected (connection {n})"),
            ServerEvent::Disconnected(n) => {
                format!("waiting for a frontend ({n} connection(s) served)")
            }
            ServerEvent::Failed(n, e) => format!("connection {n} failed ({e}); waiting"),
        };
        notify(&[NotifyState::Status(&status)]);
    });
    notify(&[NotifyState::Ready, NotifyState::Status(&waiting)]);

    let started = Instant::now();
    let result = server.run();
    drop(ticker);
    drop(exporter);
    let socket = server.socket().map(Path::to_path_buf);
    let label = server.label().to_string();
    // Dropping the server drops its listener, which removes a socket file it created (never
    // one that was handed to it).
    drop(server);
    match socket {
        Some(path) => {
            if path.exists() {
                let _ = std::fs::remove_file(&path);
            }
            log::info!("stopped; socket {} removed", path.display());
        }
        None => log::info!("stopped; {label} closed"),
    }

    if let Err(e) = flush(&*device) {
        log::error!("final flush failed: {e}");
    }
    let summary = stats.summary();
    if !summary.is_empty() {
        log::info!("totals:\n{}", summary.trim_end());
    }
    if let Some(path) = &args.hlog {
        let mut file = std::fs::File::create(path)
            .with_context(|| format!("cannot create {}", path.display()))?;
        stats
            .write_hlog(&mut file, started.elapsed().as_secs_f64())
            .with_context(|| format!("cannot write {}", path.display()))?;
        log::info!("latency histograms written to {}", path.display());
    }
    result.context("vhost-user-blk server failed")
}

fn print_qemu_command(socket: &std::path::Path, queues: u16) {
    println!("# Attach a QEMU guest (guest RAM must be a shared memfd; match size= to -m):");
    println!(
        "qemu-system-x86_64 -m 1G \\\n  -object memory-backend-memfd,id=mem,size=1G,share=on \\\n  -machine memory-backend=mem \\\n  -chardev socket,id=char0,path={} \\\n  -device vhost-user-blk-pci,chardev=char0,num-queues={queues}",
        socket.display()
    );
    let _ = std::io::stdout().flush();
}

/// Flush the backend once on shutdown.
fn flush(device: &dyn BlockDevice) -> anyhow::Result<()> {
    let mut queue = device.open_queue(1).context("cannot open a queue to flush")?;
    let req = BlockRequest { op: BlockOp::Flush, offset: 0, len: 0, segments: &[], tag: 0 };
    // SAFETY:
    // - a flush names no memory: there are no segments to keep alive.
    if unsafe { queue.submit(req) }.is_err() {
        bail!("flush: queue full");
    }
    let mut out = [Completion::EMPTY; 1];
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if queue.complete(&mut out) == 1 {
            return out[0].result.map(|_| ()).map_err(|e| anyhow::anyhow!("flush: {e}"));
        }
        if Instant::now() > deadline {
            bail!("flush did not complete within 30 s");
        }
        queue.wait(Some(Duration::from_millis(100)))?;
    }
}
