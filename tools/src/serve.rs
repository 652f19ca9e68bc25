//! `fastlane serve`: export a block backend as a vhost-user-blk device on a Unix socket.
//!
//! Serves one frontend (QEMU, qemu-storage-daemon's clients, virtio-driver) at a time and the
//! next one after it disconnects. SIGINT/SIGTERM: drop the frontend, flush the backend, remove
//! the socket, and write per-queue latency histograms when `--hlog` is given. `--metrics ADDR`
//! serves the per-queue counters to Prometheus (read at each scrape; docs/vhost-blk.md).

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use fastlane_block::{BlockDevice, BlockOp, BlockRequest, Completion};
use fastlane_vhost_blk::spec::{BackendSpec, IoEngine, SpecOptions};
use fastlane_vhost_blk::{BlkServer, BlkStats, RejectReason, VhostBlkOptions};

use crate::metrics_http::{self, set_gauge, set_total, Families};
use crate::signals::StopSignals;

/// `fastlane serve` options.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Unix socket the frontend connects to (replaced if it exists).
    #[arg(long)]
    pub socket: PathBuf,
    /// What to export: `mem:SIZE` (RAM disk, e.g. mem:256M) or `file:PATH` (see --io).
    #[arg(long, default_value = "mem:256M")]
    pub backend: String,
    /// Virtqueues, one worker thread each (QEMU's num-queues must not exceed it).
    #[arg(long, default_value_t = 1)]
    pub queues: u16,
    /// Export read-only (VIRTIO_BLK_F_RO).
    #[arg(long)]
    pub readonly: bool,
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
    /// rejections (docs/vhost-blk.md lists them). Read from the queues' counters at each
    /// scrape, so the data path does no extra work. Off by default.
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<SocketAddr>,
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

/// Run `fastlane serve` until SIGINT/SIGTERM.
pub fn run(args: &ServeArgs) -> anyhow::Result<()> {
    crate::logging::init();
    // Block the stop signals before any thread exists, so every thread inherits the mask and
    // only the signal thread below receives them (with sigwait).
    let signals = StopSignals::block()?;

    let spec: BackendSpec = args.backend.parse().context("bad --backend")?;
    let (device, engine) = spec
        .open_explained(&SpecOptions {
            read_only: args.readonly,
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
        read_only: args.readonly,
        ..VhostBlkOptions::default()
    };
    let mut server = BlkServer::bind(&args.socket, device.clone(), &options)
        .with_context(|| format!("cannot serve on {}", args.socket.display()))?;
    let capacity_bytes = server.settings().geometry.capacity_bytes;
    let exporter = metrics_http::start_if(args.metrics, |f| {
        let m = BlkMetrics::new(f);
        let stats = server.stats();
        move || m.update(&stats, capacity_bytes)
    })?;
    print_qemu_command(&args.socket, args.queues);

    let stop = server.stop_handle();
    signals.on_stop({
        let stop = stop.clone();
        move || stop.stop()
    })?;

    let started = Instant::now();
    let result = server.run();
    drop(exporter);
    let stats = server.stats();
    let socket = server.socket().to_path_buf();
    // Dropping the server drops its listener, which removes the socket file.
    drop(server);
    if socket.exists() {
        let _ = std::fs::remove_file(&socket);
    }
    log::info!("stopped; socket {} removed", socket.display());

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

/// The Prometheus families of `fastlane serve --metrics`, label `queue` = the virtqueue index.
struct BlkMetrics {
    requests: prometheus::IntCounterVec,
    rejected: prometheus::IntCounterVec,
    bytes: prometheus::IntCounterVec,
    flushes: prometheus::IntCounterVec,
    discards: prometheus::IntCounterVec,
    sleeps: prometheus::IntCounterVec,
    queues: prometheus::IntGaugeVec,
    capacity: prometheus::IntGaugeVec,
}

impl BlkMetrics {
    fn new(f: &Families) -> BlkMetrics {
        BlkMetrics {
            requests: f.counter(
                "fastlane_vhost_blk_requests_total",
                "Requests finished, by queue and result (ok, failed: the backend failed it, \
                 rejected: refused before the backend)",
                &["queue", "result"],
            ),
            rejected: f.counter(
                "fastlane_vhost_blk_rejected_total",
                "Requests refused before the backend, by queue and reason",
                &["queue", "reason"],
            ),
            bytes: f.counter(
                "fastlane_vhost_blk_bytes_total",
                "Bytes read and written by the guest, by queue and direction",
                &["queue", "direction"],
            ),
            flushes: f.counter(
                "fastlane_vhost_blk_flushes_total",
                "Flush requests completed, by queue (also in requests_total)",
                &["queue"],
            ),
            discards: f.counter(
                "fastlane_vhost_blk_discards_total",
                "Discard and write-zeroes requests completed, by queue (also in requests_total)",
                &["queue"],
            ),
            sleeps: f.counter(
                "fastlane_vhost_blk_sleeps_total",
                "Times a queue's worker slept on its eventfds after its poll window",
                &["queue"],
            ),
            queues: f.gauge("fastlane_vhost_blk_queues", "Virtqueues exported", &[]),
            capacity: f.gauge("fastlane_vhost_blk_capacity_bytes", "Disk capacity", &[]),
        }
    }

    fn update(&self, stats: &Arc<BlkStats>, capacity_bytes: u64) {
        let l = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        for (i, q) in stats.queues().iter().enumerate() {
            let queue = i.to_string();
            let queue = queue.as_str();
            set_total(&self.requests, &[queue, "ok"], l(&q.completed));
            set_total(&self.requests, &[queue, "failed"], l(&q.failed));
            set_total(&self.requests, &[queue, "rejected"], q.rejected_total());
            for r in RejectReason::ALL {
                set_total(&self.rejected, &[queue, r.name()], q.rejected(r));
            }
            set_total(&self.bytes, &[queue, "read"], l(&q.bytes_read));
            set_total(&self.bytes, &[queue, "write"], l(&q.bytes_written));
            set_total(&self.flushes, &[queue], l(&q.flushes));
            set_total(&self.discards, &[queue], l(&q.discards));
            set_total(&self.sleeps, &[queue], l(&q.sleeps));
        }
        set_gauge(&self.queues, &[], stats.queues().len() as u64);
        set_gauge(&self.capacity, &[], capacity_bytes);
    }
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
