//! `fastlane bench blk`: a userspace vhost-user-blk client that measures any backend on a Unix
//! socket (FastLane's `fastlane serve` or qemu-storage-daemon's `vhost-user-blk` export).
//!
//! One connection, one virtqueue, driven with the `virtio-driver` crate. Per case (pattern ×
//! queue depth) it runs a short warm-up, drains, then keeps `qd` requests in flight for
//! `--seconds`, busy-polling the used ring (no completion interrupts: used-buffer notifications
//! are off) and kicking only when the device asks for it (`EVENT_IDX`). Every request is timed
//! from just before it is queued to the moment its completion is seen, on the TSC (calibrated
//! against `Instant`) or on `Instant`, and recorded in a [`LatencyRecorder`].
//!
//! `--compare A.json B.json` reads two `--json` reports and prints B / A for QD1 P50 and P99
//! and for the IOPS of the deeper queues, against the targets of the vhost-user-blk issue.
//!
//! `--verify OFFSET:LEN` first writes a seeded pattern over that range, reads it back and
//! compares (the cases themselves do not check what they read), so one run shows the data path
//! is right as well as fast; a host can check the backing store against the same pattern.
//!
//! Not here: multiple queues, coordinated-omission correction (each request starts when the previous one of its
//! slot completed, which is what a closed-loop client measures).

use std::fmt;
use std::io::Write as _;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use fastlane_hist::{format_ns, HlogWriter, LatencyRecorder, Summary};
use fastlane_util::parse_size;
use fastlane_util::tsc::{self, read_tsc};
use memmap2::{MmapOptions, MmapRaw};
use serde::{Deserialize, Serialize};
use virtio_driver::{
    QueueNotifier, VhostUser, VirtioBlkConfig, VirtioBlkFeatureFlags, VirtioBlkQueue,
    VirtioBlkTransport, VirtioFeatureFlags,
};

/// Largest queue depth: a request takes three descriptors (header, data, status) and the
/// virtqueue is at most 1024 entries.
const QD_MAX: u16 = 256;
/// Largest request: 1 MiB.
const SIZE_MAX_BYTES: u32 = 1 << 20;
/// A request that has not completed after this long means a dead or wedged backend.
const STALL_TIMEOUT: Duration = Duration::from_secs(5);
/// Interval length of the `--hlog` histograms.
const HLOG_INTERVAL: Duration = Duration::from_secs(1);
/// Latencies above this are recorded as this (and counted as overflow by the recorder).
const LATENCY_NS_MAX: u64 = 10_000_000_000;
/// Upper bound on the requests of one case, whatever the clock says (40 M/s for an hour).
const REQUESTS_PER_SECOND_MAX: f64 = 40e6;

/// Arguments of `fastlane bench blk`.
#[derive(Debug, Args)]
pub struct BlkArgs {
    /// vhost-user-blk socket of the backend under test (`fastlane serve`, qemu-storage-daemon).
    #[arg(long, required_unless_present_any = ["compare", "show"])]
    socket: Option<PathBuf>,
    /// Measured seconds per case (after a warm-up of a fifth of it, at most 0.5 s).
    #[arg(long, default_value_t = 5.0, value_parser = parse_seconds)]
    seconds: f64,
    /// Request size: bytes, or with a K/M suffix (multiple of 512, at most 1M).
    #[arg(long, default_value = "4K", value_parser = parse_request_size)]
    size: u32,
    /// Queue depths to run, comma-separated (1..=256).
    #[arg(long, value_delimiter = ',', default_value = "1,32", value_parser = clap::value_parser!(u16).range(1..=QD_MAX as i64))]
    qd: Vec<u16>,
    /// Access patterns to run, comma-separated.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "randread,randwrite")]
    pattern: Vec<Pattern>,
    /// Pin the client thread to this CPU (the backend belongs on another one).
    #[arg(long)]
    pin_core: Option<usize>,
    /// Timestamp source: the TSC (needs an invariant TSC), `Instant`, or auto (TSC if
    /// invariant).
    #[arg(long, value_enum, default_value_t = ClockChoice::Auto)]
    clock: ClockChoice,
    /// Write each case's latency histogram (one interval per second, tag = case name, e.g.
    /// `qd1_randread`) to this HdrHistogram interval log; read it with `fastlane hist`.
    #[arg(long)]
    hlog: Option<PathBuf>,
    /// Print the results as JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Before the cases, write a pattern over OFFSET:LEN of the disk (bytes, K/M/G suffixes,
    /// multiples of --size) in --size requests with the deepest --qd in flight, read it all
    /// back and compare; fail on the first difference. 8-byte word `w` of the disk holds
    /// splitmix64(seed * 0x100000001b3 ^ w), little-endian.
    #[arg(long, value_name = "OFFSET:LEN", value_parser = parse_range)]
    verify: Option<(u64, u64)>,
    /// Seed of the --verify pattern.
    #[arg(long, default_value_t = 1, requires = "verify")]
    verify_seed: u64,
    /// Instead of measuring, print B / A from two `--json` reports (A: the baseline, e.g.
    /// qemu-storage-daemon; B: the candidate) against the targets.
    #[arg(long, num_args = 2, value_names = ["A_JSON", "B_JSON"], conflicts_with = "socket")]
    compare: Option<Vec<PathBuf>>,
    /// Instead of measuring, print the table of a `--json` report.
    #[arg(long, value_name = "JSON", conflicts_with_all = ["socket", "compare"])]
    show: Option<PathBuf>,
    /// Names for A and B in the `--compare` table, comma-separated.
    #[arg(long, value_delimiter = ',', num_args = 1, requires = "compare")]
    labels: Option<Vec<String>>,
}

/// What a case does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Pattern {
    /// Uniformly random, size-aligned reads over the whole disk.
    Randread,
    /// Uniformly random, size-aligned writes over the whole disk.
    Randwrite,
}

impl Pattern {
    fn name(self) -> &'static str {
        match self {
            Pattern::Randread => "randread",
            Pattern::Randwrite => "randwrite",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ClockChoice {
    Auto,
    Tsc,
    Instant,
}

/// Errors a user of `fastlane bench blk` can act on.
#[derive(Debug, thiserror::Error)]
pub enum BlkBenchError {
    /// No file at the socket path.
    #[error("no vhost-user socket at {path} (is the backend running?)")]
    SocketMissing {
        /// The path given with `--socket`.
        path: PathBuf,
    },
    /// Something is at the path, but not a socket.
    #[error("{path} is not a Unix socket")]
    NotASocket {
        /// The path given with `--socket`.
        path: PathBuf,
    },
    /// The vhost-user handshake failed (refused connection, missing protocol features, …).
    #[error("cannot connect to the vhost-user-blk backend at {path}: {source}")]
    Connect {
        /// Socket path.
        path: PathBuf,
        /// What virtio-driver reported.
        #[source]
        source: std::io::Error,
    },
    /// The backend does not offer a feature this client needs.
    #[error("the backend at {path} refused feature {feature}")]
    FeatureRefused {
        /// Socket path.
        path: PathBuf,
        /// Which feature.
        feature: &'static str,
    },
    /// A setup step after the handshake failed.
    #[error("vhost-user setup failed at {step}: {source}")]
    Setup {
        /// The step (memory table, queue setup, config read).
        step: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The disk cannot run the requested cases.
    #[error("unsuitable disk: {reason}")]
    Disk {
        /// What is wrong.
        reason: String,
    },
    /// The device completed a request with an error status.
    #[error("the device failed {op} of {len} bytes at offset {offset} ({case}): status {status}")]
    IoStatus {
        /// Case name.
        case: String,
        /// `read` or `write`.
        op: &'static str,
        /// Byte offset on the disk.
        offset: u64,
        /// Request length.
        len: u32,
        /// virtio-driver's errno for the status byte (EIO, ENOTSUP, EPROTO).
        status: String,
    },
    /// Requests are in flight and nothing completed for [`STALL_TIMEOUT`].
    #[error("the backend stopped completing requests ({case}: {in_flight} in flight, none done for {} s)", STALL_TIMEOUT.as_secs())]
    Stalled {
        /// Case name.
        case: String,
        /// Requests outstanding.
        in_flight: u16,
    },
    /// Queuing a request or kicking the device failed.
    #[error("submitting to the virtqueue failed ({case}): {source}")]
    Submit {
        /// Case name.
        case: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

fn parse_seconds(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|_| format!("not a number: {s}"))?;
    if !(0.01..=3600.0).contains(&v) {
        return Err("must be between 0.01 and 3600 seconds".into());
    }
    Ok(v)
}

fn parse_range(s: &str) -> Result<(u64, u64), String> {
    let (off, len) = s.split_once(':').ok_or_else(|| format!("{s}: expected OFFSET:LEN"))?;
    let size = |t: &str| parse_size(t).map_err(|e| e.to_string());
    let (off, len) = (size(off)?, size(len)?);
    if len == 0 || off.checked_add(len).is_none() {
        return Err(format!("{s}: empty or overflowing range"));
    }
    Ok((off, len))
}

/// A request size: a byte size (`4096`, `4K`, `1M`) that is a multiple of 512, at most 1M.
fn parse_request_size(s: &str) -> Result<u32, String> {
    let bytes = parse_size(s).map_err(|e| e.to_string())?;
    if bytes == 0 || bytes % 512 != 0 || bytes > u64::from(SIZE_MAX_BYTES) {
        return Err(format!("{s}: must be a multiple of 512 bytes, at most 1M"));
    }
    Ok(bytes as u32)
}

/// Runs `fastlane bench blk …`.
pub fn run(args: &BlkArgs) -> Result<()> {
    if let Some(files) = &args.compare {
        return compare(&files[0], &files[1], args.labels.as_deref());
    }
    if let Some(path) = &args.show {
        return print_table(&mut std::io::stdout().lock(), &read_report(path)?);
    }
    let socket = args.socket.as_deref().context("--socket is required")?;
    anyhow::ensure!(!args.qd.is_empty(), "--qd needs at least one queue depth");
    anyhow::ensure!(!args.pattern.is_empty(), "--pattern needs at least one pattern");
    if let Some(core) = args.pin_core {
        let ids = core_affinity::get_core_ids().unwrap_or_default();
        let id = ids.iter().find(|c| c.id == core).copied();
        let id = id.with_context(|| {
            format!("--pin-core {core}: not a CPU this process may run on ({} CPUs)", ids.len())
        })?;
        anyhow::ensure!(core_affinity::set_for_current(id), "pinning to CPU {core} failed");
    }
    let clock = Clock::new(args.clock)?;
    let qd_max = *args.qd.iter().max().unwrap_or(&1);
    let mut conn = Conn::connect(socket, qd_max, args.size)?;
    let writes = args.pattern.contains(&Pattern::Randwrite);
    if writes && conn.read_only {
        return Err(BlkBenchError::Disk {
            reason: "the device is read-only (VIRTIO_BLK_F_RO); run --pattern randread".into(),
        }
        .into());
    }
    let verified = match args.verify {
        Some((offset, len)) => Some(verify(&mut conn, offset, len, args.verify_seed, qd_max)?),
        None => None,
    };
    let warmup = (args.seconds / 5.0).min(0.5);
    let mut log = match &args.hlog {
        Some(p) => {
            Some(HlogWriter::create(p).with_context(|| format!("creating hlog {}", p.display()))?)
        }
        None => None,
    };
    if let Some(l) = log.as_mut() {
        l.write_comment(&format!(
            "fastlane bench blk --socket {} --size {}: tag = case, values = request latency in ns",
            socket.display(),
            args.size
        ))?;
    }

    let mut cases = Vec::new();
    let mut rng = XorShift::new(0x9e37_79b9_7f4a_7c15 ^ u64::from(args.size));
    for &qd in &args.qd {
        for &pattern in &args.pattern {
            let name = format!("qd{qd}_{}", pattern.name());
            eprintln!("bench blk: {name}: {warmup:.2} s warm-up, {:.1} s measured", args.seconds);
            let case = Case { name: &name, pattern, qd, size: args.size };
            drive(&mut conn, &clock, &case, Duration::from_secs_f64(warmup), None, &mut rng)?;
            let mut rec = LatencyRecorder::with_max(LATENCY_NS_MAX)?;
            let mut client = LatencyRecorder::with_max(LATENCY_NS_MAX)?;
            let run = drive(
                &mut conn,
                &clock,
                &case,
                Duration::from_secs_f64(args.seconds),
                Some(Recording {
                    rec: &mut rec,
                    client: &mut client,
                    log: log.as_mut(),
                    progress: args.seconds >= 3.0,
                }),
                &mut rng,
            )?;
            let latency = Latency::from(Summary::from_histogram(rec.total()));
            cases.push(CaseReport {
                name,
                pattern,
                qd,
                requests: run.requests,
                seconds: run.seconds,
                iops: run.requests as f64 / run.seconds,
                mib_per_s: run.requests as f64 * f64::from(args.size) / run.seconds / 1048576.0,
                latency_overflow: rec.overflow_count_total(),
                kicks_per_request: run.kicks as f64 / run.requests.max(1) as f64,
                client_ns_per_request_p50: client.total().value_at_quantile(0.5),
                latency,
            });
        }
    }
    if let Some(mut l) = log {
        l.flush()?;
    }

    let report = BlkReport {
        socket: socket.display().to_string(),
        capacity_bytes: conn.capacity_bytes,
        event_idx: conn.event_idx,
        virtio_features: format!("{:#x}", conn.features),
        size_bytes: args.size,
        seconds_per_case: args.seconds,
        warmup_seconds: warmup,
        pin_core: args.pin_core,
        clock: clock.report(),
        verified,
        cases,
    };
    drop(conn);
    let mut out = std::io::stdout().lock();
    if args.json {
        serde_json::to_writer_pretty(&mut out, &report)?;
        writeln!(out)?;
    } else {
        print_table(&mut out, &report)?;
        if let Some(p) = &args.hlog {
            writeln!(out, "\nlatency histograms: {} (read with `fastlane hist`)", p.display())?;
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Clock

/// Timestamps in ticks: TSC cycles or nanoseconds since `base`.
#[derive(Debug)]
struct Clock {
    tsc: bool,
    base: Instant,
    ns_per_tick: f64,
    tsc_call_ns: f64,
    instant_call_ns: f64,
}

impl Clock {
    fn new(choice: ClockChoice) -> Result<Clock> {
        let invariant = invariant_tsc();
        let tsc = match choice {
            ClockChoice::Tsc => {
                anyhow::ensure!(
                    invariant,
                    "--clock tsc: this CPU does not report an invariant TSC (constant_tsc, \
                     nonstop_tsc)"
                );
                true
            }
            ClockChoice::Instant => false,
            // Measured on the 2-core dev hosts: rdtsc ≈ 7 ns, Instant::now ≈ 20 ns (vDSO);
            // under TCG guests Instant costs ≈ 1 µs. The TSC is never worse.
            ClockChoice::Auto => invariant,
        };
        let base = Instant::now();
        let ns_per_tick = if tsc { tsc::ns_per_tick() } else { 1.0 };
        let mut c = Clock { tsc, base, ns_per_tick, tsc_call_ns: f64::NAN, instant_call_ns: 0.0 };
        c.instant_call_ns = cost_per_call(|| Instant::now().elapsed().as_nanos() as u64 / 2);
        if invariant {
            c.tsc_call_ns = cost_per_call(read_tsc);
        }
        Ok(c)
    }

    #[inline(always)]
    fn now(&self) -> u64 {
        if self.tsc {
            read_tsc()
        } else {
            self.base.elapsed().as_nanos() as u64
        }
    }

    #[inline(always)]
    fn ns(&self, ticks: u64) -> u64 {
        if self.tsc {
            (ticks as f64 * self.ns_per_tick) as u64
        } else {
            ticks
        }
    }

    fn ticks(&self, d: Duration) -> u64 {
        (d.as_nanos() as f64 / self.ns_per_tick) as u64
    }

    fn report(&self) -> ClockReport {
        ClockReport {
            source: if self.tsc { "tsc" } else { "instant" }.into(),
            ns_per_tick: self.ns_per_tick,
            tsc_call_ns: if self.tsc_call_ns.is_nan() { None } else { Some(self.tsc_call_ns) },
            instant_call_ns: self.instant_call_ns,
        }
    }
}

/// Average cost of one call of `f` over 200 000 calls, in ns.
fn cost_per_call(f: impl Fn() -> u64) -> f64 {
    const N: u32 = 200_000;
    let t = Instant::now();
    let mut acc = 0u64;
    for _ in 0..N {
        acc = acc.wrapping_add(f());
    }
    std::hint::black_box(acc);
    t.elapsed().as_nanos() as f64 / f64::from(N)
}

/// Whether /proc/cpuinfo lists `constant_tsc` and `nonstop_tsc` (a TSC that ticks at one rate
/// in every P- and C-state, the same on all cores).
fn invariant_tsc() -> bool {
    if !cfg!(target_arch = "x86_64") {
        return false;
    }
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let flags = info.lines().find(|l| l.starts_with("flags")).unwrap_or("");
    let has = |f: &str| flags.split_whitespace().any(|w| w == f);
    has("constant_tsc") && has("nonstop_tsc")
}

// ---------------------------------------------------------------------------------------------
// Connection

/// Memory shared with the backend: one memfd mapping (MAP_SHARED, prefaulted), unmapped on
/// drop. The backend has its own mapping of the memfd, so a request still in flight (after an
/// error) writes there, never into our unmapped range.
struct SharedBuf {
    fd: OwnedFd,
    map: MmapRaw,
}

impl SharedBuf {
    fn new(len: usize) -> std::io::Result<SharedBuf> {
        // SAFETY:
        // - the name is a NUL-terminated C string literal; memfd_create only reads it.
        let raw = unsafe { libc::memfd_create(c"fastlane-bench-blk".as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY:
        // - `raw` is a fresh file descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY:
        // - `fd` is a valid memfd; ftruncate only changes its size.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let map = MmapOptions::new().len(len).populate().map_raw(&fd)?;
        Ok(SharedBuf { fd, map })
    }
}

/// One vhost-user-blk connection with one queue and `qd_max` data buffers of `size` bytes.
struct Conn {
    // Field order is drop order: the queue points into the transport's ring memory and goes
    // first.
    queue: VirtioBlkQueue<'static, u16>,
    kick: Box<dyn QueueNotifier>,
    /// Owns the connection, the eventfds and the ring memory `queue` points into.
    _transport: Box<VirtioBlkTransport>,
    buf: SharedBuf,
    size: u32,
    capacity_bytes: u64,
    features: u64,
    event_idx: bool,
    read_only: bool,
    /// Per slot: TSC/ns tick when its request was queued, and its offset (for error messages).
    start: Vec<u64>,
    offset: Vec<u64>,
    /// Scratch list of completed slots, `qd_max` long (no allocation while measuring).
    done: Vec<u16>,
}

impl fmt::Debug for Conn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Conn")
            .field("capacity_bytes", &self.capacity_bytes)
            .field("features", &format_args!("{:#x}", self.features))
            .finish_non_exhaustive()
    }
}

impl Conn {
    fn connect(socket: &Path, qd_max: u16, size: u32) -> Result<Conn, BlkBenchError> {
        use std::os::unix::fs::FileTypeExt as _;
        let path = socket.to_path_buf();
        match std::fs::metadata(socket) {
            Err(_) => return Err(BlkBenchError::SocketMissing { path }),
            Ok(m) if !m.file_type().is_socket() => return Err(BlkBenchError::NotASocket { path }),
            Ok(_) => {}
        }
        let wanted = VirtioFeatureFlags::VERSION_1.bits()
            | VirtioFeatureFlags::RING_EVENT_IDX.bits()
            | VirtioBlkFeatureFlags::RO.bits()
            | VirtioBlkFeatureFlags::BLK_SIZE.bits()
            | VirtioBlkFeatureFlags::FLUSH.bits();
        let path_str = socket.to_str().ok_or_else(|| BlkBenchError::Connect {
            path: path.clone(),
            source: std::io::Error::other("socket path is not UTF-8"),
        })?;
        let vu = VhostUser::<VirtioBlkConfig, _>::new(path_str, wanted)
            .map_err(|source| BlkBenchError::Connect { path: path.clone(), source })?;
        let mut transport: Box<VirtioBlkTransport> = Box::new(vu);
        let features = transport.get_features();
        if features & VirtioFeatureFlags::VERSION_1.bits() == 0 {
            return Err(BlkBenchError::FeatureRefused { path, feature: "VIRTIO_F_VERSION_1" });
        }
        let event_idx = features & VirtioFeatureFlags::RING_EVENT_IDX.bits() != 0;
        let read_only = features & VirtioBlkFeatureFlags::RO.bits() != 0;
        let cfg = transport
            .get_config()
            .map_err(|source| BlkBenchError::Setup { step: "GET_CONFIG", source })?;
        let capacity_bytes = u64::from(cfg.capacity).saturating_mul(512);
        if capacity_bytes < u64::from(size) {
            return Err(BlkBenchError::Disk {
                reason: format!("{capacity_bytes} bytes, smaller than one {size}-byte request"),
            });
        }

        let page = 4096usize;
        let len = (usize::from(qd_max) * size as usize).div_ceil(page) * page;
        let buf = SharedBuf::new(len)
            .map_err(|source| BlkBenchError::Setup { step: "memfd for data buffers", source })?;
        // Written requests carry a non-zero pattern; the memory is ours until it is shared.
        // SAFETY:
        // - `buf.map` is a fresh `len`-byte mapping nothing else references yet.
        unsafe { std::ptr::write_bytes(buf.map.as_mut_ptr(), 0xa5, len) };
        transport
            .map_mem_region(buf.map.as_mut_ptr() as usize, buf.map.len(), buf.fd.as_raw_fd(), 0)
            .map_err(|source| BlkBenchError::Setup {
                step: "ADD_MEM_REG (data buffers)",
                source,
            })?;
        // Three descriptors per request; the ring is a power of two.
        let queue_size = (u32::from(qd_max) * 3).next_power_of_two().clamp(16, 1024) as u16;
        let mut queues = VirtioBlkQueue::setup_queues(&mut *transport, 1, queue_size)
            .map_err(|source| BlkBenchError::Setup { step: "virtqueue setup", source })?;
        let mut queue = queues.pop().ok_or_else(|| BlkBenchError::Setup {
            step: "virtqueue setup",
            source: std::io::Error::other("no queue returned"),
        })?;
        // Busy polling: ask for no used-buffer notifications (with EVENT_IDX the used_event
        // index stays behind; without it VIRTQ_AVAIL_F_NO_INTERRUPT is set).
        queue.set_used_notif_enabled(false);
        let kick = transport.get_submission_notifier(0);
        let n = usize::from(qd_max);
        Ok(Conn {
            queue,
            kick,
            _transport: transport,
            buf,
            size,
            capacity_bytes,
            features,
            event_idx,
            read_only,
            start: vec![0; n],
            offset: vec![0; n],
            done: Vec::with_capacity(n),
        })
    }

    /// Queue one request for `slot` at `offset` (not yet kicked).
    #[inline]
    fn queue(&mut self, pattern: Pattern, slot: u16, offset: u64) -> std::io::Result<()> {
        let data = self.slot_ptr(slot);
        let len = self.size as usize;
        match pattern {
            // SAFETY:
            // - `data..data + len` is slot `slot`'s range of `self.buf`, which lives as long as
            //   `self` (and the backend maps the memfd itself, see `SharedBuf::drop`);
            // - one request per slot at a time: a slot is reused only after its completion was
            //   seen, and this client never reads or writes a buffer while it is in flight.
            Pattern::Randread => unsafe { self.queue.read_raw(offset, data, len, slot) },
            // SAFETY: as for the read: the slot's range, alive and untouched until completion.
            Pattern::Randwrite => unsafe { self.queue.write_raw(offset, data, len, slot) },
        }
    }

    fn slot_ptr(&self, slot: u16) -> *mut u8 {
        let off = usize::from(slot) * self.size as usize;
        assert!(off + self.size as usize <= self.buf.map.len(), "slot {slot} beyond the buffers");
        // SAFETY:
        // - `off + size <= len` (asserted above): inside the mapping.
        unsafe { self.buf.map.as_mut_ptr().add(off) }
    }

    /// Kick the device if it asked to be notified (always without EVENT_IDX, unless it set
    /// VIRTQ_USED_F_NO_NOTIFY).
    #[inline]
    fn kick_if_needed(&mut self) -> std::io::Result<bool> {
        if self.queue.avail_notif_needed() {
            self.kick.notify()?;
            return Ok(true);
        }
        Ok(false)
    }
}

// ---------------------------------------------------------------------------------------------
// Load loop

struct Case<'a> {
    name: &'a str,
    pattern: Pattern,
    qd: u16,
    size: u32,
}

struct Recording<'a> {
    rec: &'a mut LatencyRecorder,
    /// Client time per request of each completion batch (see `client_ns_per_request_p50`).
    client: &'a mut LatencyRecorder,
    log: Option<&'a mut HlogWriter<std::io::BufWriter<std::fs::File>>>,
    progress: bool,
}

struct RunResult {
    requests: u64,
    seconds: f64,
    /// Kicks (eventfd writes) the device asked for.
    kicks: u64,
}

/// xorshift64*: cheap, good enough for offsets.
#[derive(Debug)]
struct XorShift(u64);

impl XorShift {
    fn new(seed: u64) -> XorShift {
        XorShift(seed | 1)
    }

    #[inline]
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `0..n` (n > 0), by multiply-shift.
    #[inline]
    fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next()) * u128::from(n)) >> 64) as u64
    }
}

/// Keeps `case.qd` requests in flight for `budget`, then drains. With `recording`, every
/// completion's latency is recorded (and logged per second); without, it is a warm-up.
fn drive(
    conn: &mut Conn,
    clock: &Clock,
    case: &Case<'_>,
    budget: Duration,
    mut recording: Option<Recording<'_>>,
    rng: &mut XorShift,
) -> Result<RunResult> {
    let blocks = conn.capacity_bytes / u64::from(case.size);
    let size = u64::from(case.size);
    let stall_ticks = clock.ticks(STALL_TIMEOUT);
    let interval_ticks = clock.ticks(HLOG_INTERVAL);
    let requests_max = (budget.as_secs_f64() * REQUESTS_PER_SECOND_MAX) as u64 + 1024;
    let submit_err = |source| BlkBenchError::Submit { case: case.name.to_string(), source };

    let wall_start = Instant::now();
    if let Some(r) = recording.as_mut() {
        // Start the first interval now (drops nothing: the recorder is fresh).
        let _ = r.rec.take_interval_at(wall_start);
    }
    let start = clock.now();
    let end = start + clock.ticks(budget);
    for slot in 0..case.qd {
        let offset = rng.below(blocks) * size;
        conn.offset[usize::from(slot)] = offset;
        conn.start[usize::from(slot)] = clock.now();
        conn.queue(case.pattern, slot, offset).map_err(submit_err)?;
    }
    let mut kicks = u64::from(conn.kick_if_needed().map_err(submit_err)?);

    let mut in_flight = case.qd;
    let mut stopping = false;
    let mut requests = 0u64;
    let mut last_done = start;
    let mut next_interval = start + interval_ticks;
    let mut last_progress = (start, 0u64);
    let mut idle_polls = 0u32;
    let mut stop_at = end;
    // Bounded: stops submitting at `end` or after `requests_max`; the drain ends when nothing
    // is in flight; a backend that stops answering ends it with `Stalled` after STALL_TIMEOUT.
    while in_flight > 0 {
        conn.done.clear();
        {
            let Conn { queue, done, offset, .. } = &mut *conn;
            for c in queue.completions() {
                done.push(c.context);
                if c.ret != 0 {
                    let slot = usize::from(c.context);
                    return Err(BlkBenchError::IoStatus {
                        case: case.name.to_string(),
                        op: if case.pattern == Pattern::Randread { "read" } else { "write" },
                        offset: offset[slot],
                        len: case.size,
                        status: std::io::Error::from_raw_os_error(-c.ret).to_string(),
                    }
                    .into());
                }
                // virtio-driver drops ids it did not hand out (or already completed), so
                // this never exceeds the requests in flight; stop there all the same.
                if done.len() >= usize::from(in_flight) {
                    break;
                }
            }
        }
        if conn.done.is_empty() {
            idle_polls = idle_polls.wrapping_add(1);
            if idle_polls % 1024 == 0 && clock.now().wrapping_sub(last_done) > stall_ticks {
                return Err(
                    BlkBenchError::Stalled { case: case.name.to_string(), in_flight }.into()
                );
            }
            std::hint::spin_loop();
            continue;
        }
        let now = clock.now();
        last_done = now;
        in_flight -= conn.done.len() as u16;
        requests += conn.done.len() as u64;
        if let Some(r) = recording.as_mut() {
            for &slot in &conn.done {
                r.rec.record(clock.ns(now.wrapping_sub(conn.start[usize::from(slot)])));
            }
        }
        if !stopping && (now >= stop_at || requests >= requests_max) {
            stopping = true;
            stop_at = now;
        }
        if !stopping {
            for i in 0..conn.done.len() {
                let slot = conn.done[i];
                let offset = rng.below(blocks) * size;
                conn.offset[usize::from(slot)] = offset;
                conn.start[usize::from(slot)] = clock.now();
                conn.queue(case.pattern, slot, offset).map_err(submit_err)?;
            }
            in_flight += conn.done.len() as u16;
            kicks += u64::from(conn.kick_if_needed().map_err(submit_err)?);
        }
        if let Some(r) = recording.as_mut() {
            let spent = clock.ns(clock.now().wrapping_sub(now));
            r.client.record(spent / conn.done.len() as u64);
        }
        if now >= next_interval {
            next_interval = now + interval_ticks;
            if let Some(r) = recording.as_mut() {
                let iv = r.rec.take_interval();
                if let Some(l) = r.log.as_deref_mut() {
                    l.write_interval(Some(case.name), &iv)?;
                }
                if r.progress {
                    let secs = clock.ns(now - last_progress.0) as f64 / 1e9;
                    eprintln!(
                        "bench blk: {}: {:.0} s, {:.0} IOPS",
                        case.name,
                        clock.ns(now - start) as f64 / 1e9,
                        (requests - last_progress.1) as f64 / secs
                    );
                    last_progress = (now, requests);
                }
            }
        }
    }
    if let Some(r) = recording.as_mut() {
        let iv = r.rec.take_interval();
        if let Some(l) = r.log.as_deref_mut() {
            l.write_interval(Some(case.name), &iv)?;
        }
    }
    // IOPS over the submitting window; requests drained after it are few (< qd) and counted,
    // so measure up to the last completion.
    let seconds = clock.ns(last_done.wrapping_sub(start)) as f64 / 1e9;
    if let Some(r) = recording.as_mut() {
        let _ = r.client.take_interval();
    }
    Ok(RunResult { requests, seconds: seconds.max(1e-9), kicks })
}

// ---------------------------------------------------------------------------------------------
// Verification

/// The `--verify` pattern of `buf`, which lies at byte `disk_offset` (a multiple of 8) of the
/// disk. The same formula as `fastlane-nvme`'s `vfio_guest` pattern (its guest test checks
/// the backing file with it).
fn fill_pattern(seed: u64, disk_offset: u64, buf: &mut [u8]) {
    debug_assert_eq!(disk_offset % 8, 0);
    for (i, chunk) in buf.chunks_mut(8).enumerate() {
        let word = fastlane_util::splitmix64(
            seed.wrapping_mul(0x1000_0000_01b3) ^ (disk_offset / 8 + i as u64),
        );
        chunk.copy_from_slice(&word.to_le_bytes()[..chunk.len()]);
    }
}

/// `--verify`: write the pattern over `[offset, offset + len)`, read it back, compare.
fn verify(conn: &mut Conn, offset: u64, len: u64, seed: u64, qd: u16) -> Result<VerifyReport> {
    let size = u64::from(conn.size);
    anyhow::ensure!(
        offset % size == 0 && len % size == 0,
        "--verify {offset}:{len}: offset and length must be multiples of --size ({size})"
    );
    anyhow::ensure!(
        offset.checked_add(len).is_some_and(|end| end <= conn.capacity_bytes),
        "--verify {offset}:{len}: beyond the disk ({} bytes)",
        conn.capacity_bytes
    );
    anyhow::ensure!(!conn.read_only, "--verify needs a writable disk");
    let t = Instant::now();
    verify_pass(conn, Pattern::Randwrite, offset, len, seed, qd)?;
    let write_seconds = t.elapsed().as_secs_f64();
    let t = Instant::now();
    verify_pass(conn, Pattern::Randread, offset, len, seed, qd)?;
    let read_seconds = t.elapsed().as_secs_f64();
    eprintln!(
        "bench blk: verified {len} bytes at {offset} (seed {seed}): written in {write_seconds:.2} s, \
         read back equal in {read_seconds:.2} s"
    );
    Ok(VerifyReport { offset, len, seed, write_seconds, read_seconds })
}

/// One pass of `--verify`: `op` (Randwrite: write the pattern; Randread: read and compare)
/// over the range in `--size` requests, sequentially, `qd` in flight.
fn verify_pass(
    conn: &mut Conn,
    op: Pattern,
    start: u64,
    len: u64,
    seed: u64,
    qd: u16,
) -> Result<()> {
    let case = "verify";
    let size = conn.size as usize;
    let chunks = len / size as u64;
    let mut expect = vec![0u8; size];
    let mut got = vec![0u8; size];
    let mut free: Vec<u16> = (0..qd).rev().collect();
    let (mut next, mut in_flight) = (0u64, 0u16);
    let mut last_done = Instant::now();
    let submit_err = |source| BlkBenchError::Submit { case: case.to_string(), source };
    // Bounded: `chunks` requests, each waited for at most STALL_TIMEOUT.
    while next < chunks || in_flight > 0 {
        let mut queued = false;
        while next < chunks {
            let Some(slot) = free.pop() else { break };
            let off = start + next * size as u64;
            conn.offset[usize::from(slot)] = off;
            let data = conn.slot_ptr(slot);
            if op == Pattern::Randwrite {
                fill_pattern(seed, off, &mut expect);
                // SAFETY:
                // - `data..data + size` is the slot's range of the shared buffer (alive as
                //   long as `conn`); the slot is free, so no request is reading or writing it;
                // - a raw copy: no reference into memory the backend accesses.
                unsafe { std::ptr::copy_nonoverlapping(expect.as_ptr(), data, size) };
            } else {
                // SAFETY: as above (a free slot of the shared buffer); raw write.
                unsafe { std::ptr::write_bytes(data, 0, size) };
            }
            conn.queue(op, slot, off).map_err(submit_err)?;
            (next, in_flight, queued) = (next + 1, in_flight + 1, true);
        }
        if queued {
            conn.kick_if_needed().map_err(submit_err)?;
        }
        conn.done.clear();
        {
            let Conn { queue, done, offset, .. } = &mut *conn;
            for c in queue.completions() {
                if c.ret != 0 {
                    return Err(BlkBenchError::IoStatus {
                        case: case.to_string(),
                        op: if op == Pattern::Randread { "read" } else { "write" },
                        offset: offset[usize::from(c.context)],
                        len: size as u32,
                        status: std::io::Error::from_raw_os_error(-c.ret).to_string(),
                    }
                    .into());
                }
                done.push(c.context);
                if done.len() >= usize::from(in_flight) {
                    break;
                }
            }
        }
        if conn.done.is_empty() {
            if last_done.elapsed() > STALL_TIMEOUT {
                return Err(BlkBenchError::Stalled { case: case.to_string(), in_flight }.into());
            }
            std::hint::spin_loop();
            continue;
        }
        last_done = Instant::now();
        in_flight -= conn.done.len() as u16;
        for i in 0..conn.done.len() {
            let slot = conn.done[i];
            if op == Pattern::Randread {
                let off = conn.offset[usize::from(slot)];
                // SAFETY: the slot's read has completed, so nothing writes its range any more;
                // a raw copy out of the shared buffer.
                unsafe {
                    std::ptr::copy_nonoverlapping(conn.slot_ptr(slot), got.as_mut_ptr(), size)
                };
                fill_pattern(seed, off, &mut expect);
                if let Some(i) = got.iter().zip(&expect).position(|(a, b)| a != b) {
                    anyhow::bail!(
                        "--verify: byte {} of the disk reads back {:#04x}, {:#04x} was written",
                        off + i as u64,
                        got[i],
                        expect[i]
                    );
                }
            }
            free.push(slot);
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Report

#[derive(Debug, Serialize, Deserialize)]
struct ClockReport {
    /// `tsc` or `instant`.
    source: String,
    ns_per_tick: f64,
    /// Cost of one RDTSC, ns (absent without an invariant TSC).
    tsc_call_ns: Option<f64>,
    /// Cost of one `Instant::now()` + `elapsed()`, halved: one clock read, ns.
    instant_call_ns: f64,
}

/// Latency figures of one case, ns (a [`Summary`] that can be read back).
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct Latency {
    count: u64,
    min_ns: u64,
    mean_ns: f64,
    p50_ns: u64,
    p90_ns: u64,
    p99_ns: u64,
    p99_9_ns: u64,
    max_ns: u64,
}

impl From<Summary> for Latency {
    fn from(s: Summary) -> Latency {
        Latency {
            count: s.count,
            min_ns: s.min_ns,
            mean_ns: s.mean_ns,
            p50_ns: s.p50_ns,
            p90_ns: s.p90_ns,
            p99_ns: s.p99_ns,
            p99_9_ns: s.p99_9_ns,
            max_ns: s.max_ns,
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct CaseReport {
    /// `qd{N}_{pattern}`, also the `--hlog` tag.
    name: String,
    pattern: Pattern,
    qd: u16,
    requests: u64,
    seconds: f64,
    iops: f64,
    mib_per_s: f64,
    /// Request latency, from queuing to the completion being seen.
    latency: Latency,
    /// Latencies above 10 s (recorded as 10 s).
    latency_overflow: u64,
    /// Kicks per request: 1 when the device wants a notification for every request (it
    /// sleeps between them), near 0 when it polls and suppresses them (EVENT_IDX).
    #[serde(default)]
    kicks_per_request: f64,
    /// Median over completion batches of the client's time per request between seeing the
    /// batch and having resubmitted it (recording, queuing, kicking), ns: the client's own
    /// share of each round trip. A median, so that preemptions of the client do not count.
    #[serde(default)]
    client_ns_per_request_p50: u64,
}

#[derive(Debug, Serialize, Deserialize)]
struct BlkReport {
    socket: String,
    capacity_bytes: u64,
    virtio_features: String,
    event_idx: bool,
    size_bytes: u32,
    seconds_per_case: f64,
    warmup_seconds: f64,
    pin_core: Option<usize>,
    clock: ClockReport,
    /// The `--verify` pass, if one ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    verified: Option<VerifyReport>,
    cases: Vec<CaseReport>,
}

/// What `--verify` wrote, read back and found equal.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct VerifyReport {
    offset: u64,
    len: u64,
    seed: u64,
    /// Wall time of the write pass and of the read-and-compare pass.
    write_seconds: f64,
    read_seconds: f64,
}

fn print_table(out: &mut impl std::io::Write, r: &BlkReport) -> Result<()> {
    let c = &r.clock;
    if let Some(v) = &r.verified {
        writeln!(
            out,
            "verified: {} bytes at {} (seed {}) written, read back equal",
            v.len, v.offset, v.seed
        )?;
    }
    writeln!(
        out,
        "vhost-user-blk {} ({} MiB, EVENT_IDX {}), {} B requests, one queue, busy-polled, \
         client {}",
        r.socket,
        r.capacity_bytes >> 20,
        if r.event_idx { "on" } else { "off" },
        r.size_bytes,
        r.pin_core.map_or("unpinned".to_string(), |c| format!("on CPU {c}")),
    )?;
    writeln!(
        out,
        "clock: {} (RDTSC {}, Instant {:.1} ns per read)\n",
        c.source,
        c.tsc_call_ns.map_or("n/a".into(), |v| format!("{v:.1} ns")),
        c.instant_call_ns,
    )?;
    writeln!(
        out,
        "{:<16} {:>10} {:>11} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>10}",
        "case",
        "requests",
        "IOPS",
        "MiB/s",
        "P50",
        "P90",
        "P99",
        "P99.9",
        "max",
        "client/req",
        "kicks/req"
    )?;
    for k in &r.cases {
        let l = &k.latency;
        writeln!(
            out,
            "{:<16} {:>10} {:>11.0} {:>9.1} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>10.3}",
            k.name,
            k.requests,
            k.iops,
            k.mib_per_s,
            format_ns(l.p50_ns as f64),
            format_ns(l.p90_ns as f64),
            format_ns(l.p99_ns as f64),
            format_ns(l.p99_9_ns as f64),
            format_ns(l.max_ns as f64),
            format_ns(k.client_ns_per_request_p50 as f64),
            k.kicks_per_request,
        )?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// --compare

fn read_report(path: &Path) -> Result<BlkReport> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text)
        .with_context(|| format!("{} is not a `fastlane bench blk --json` report", path.display()))
}

/// One row of the ratio table.
struct Row {
    case: String,
    metric: &'static str,
    a: f64,
    b: f64,
    /// Latency: lower is better, target is a maximum of B/A; IOPS: a minimum.
    lower_is_better: bool,
    target: Option<f64>,
}

fn compare(a_path: &Path, b_path: &Path, labels: Option<&[String]>) -> Result<()> {
    let (a, b) = (read_report(a_path)?, read_report(b_path)?);
    let name = |p: &Path| p.file_stem().map_or("?".into(), |s| s.to_string_lossy().into_owned());
    let (la, lb) = match labels {
        Some([x, y]) => (x.clone(), y.clone()),
        Some(_) => anyhow::bail!("--labels takes two names: A,B"),
        None => (name(a_path), name(b_path)),
    };
    let mut rows = Vec::new();
    for ca in &a.cases {
        let Some(cb) = b.cases.iter().find(|c| c.name == ca.name) else { continue };
        let lat = |metric, x: u64, y: u64, target| Row {
            case: ca.name.clone(),
            metric,
            a: x as f64,
            b: y as f64,
            lower_is_better: true,
            target,
        };
        // The targets: QD1 P50 and P99 at most half of the baseline's; deeper queues
        // at least twice its IOPS.
        let qd1 = ca.qd == 1;
        rows.push(lat("P50", ca.latency.p50_ns, cb.latency.p50_ns, qd1.then_some(0.5)));
        rows.push(lat("P99", ca.latency.p99_ns, cb.latency.p99_ns, qd1.then_some(0.5)));
        if !qd1 {
            rows.push(Row {
                case: ca.name.clone(),
                metric: "IOPS",
                a: ca.iops,
                b: cb.iops,
                lower_is_better: false,
                target: Some(2.0),
            });
        }
    }
    anyhow::ensure!(!rows.is_empty(), "the two reports have no case in common");
    let mut out = std::io::stdout().lock();
    writeln!(out, "B / A with A = {la} ({}), B = {lb} ({})\n", a.socket, b.socket)?;
    writeln!(
        out,
        "{:<16} {:<6} {:>12} {:>12} {:>7} {:>8} {:>5}",
        "case", "metric", la, lb, "B/A", "target", "met"
    )?;
    let fmt_v = |r: &Row, v: f64| {
        if r.lower_is_better {
            format_ns(v)
        } else {
            format!("{v:.0}")
        }
    };
    for r in &rows {
        let ratio = if r.a > 0.0 { r.b / r.a } else { f64::NAN };
        let (target, met) = match r.target {
            None => (String::new(), ""),
            Some(t) if r.lower_is_better => {
                (format!("<= {t:.2}"), if ratio <= t { "yes" } else { "no" })
            }
            Some(t) => (format!(">= {t:.2}"), if ratio >= t { "yes" } else { "no" }),
        };
        writeln!(
            out,
            "{:<16} {:<6} {:>12} {:>12} {:>7.2} {:>8} {:>5}",
            r.case,
            r.metric,
            fmt_v(r, r.a),
            fmt_v(r, r.b),
            ratio,
            target,
            met
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_and_are_checked() {
        assert_eq!(parse_request_size("4K"), Ok(4096));
        assert_eq!(parse_request_size("512"), Ok(512));
        assert_eq!(parse_request_size("1M"), Ok(1 << 20));
        assert!(parse_request_size("100").is_err());
        assert!(parse_request_size("2M").is_err());
        assert!(parse_request_size("0").is_err());
        assert!(parse_request_size("x").is_err());
    }

    #[test]
    fn offsets_stay_in_range() {
        let mut r = XorShift::new(1);
        let mut seen_top = false;
        for _ in 0..100_000 {
            let v = r.below(10);
            assert!(v < 10);
            seen_top |= v == 9;
        }
        assert!(seen_top);
    }

    #[test]
    fn tsc_calibration_matches_instant() {
        if !invariant_tsc() {
            return;
        }
        let clock = Clock::new(ClockChoice::Tsc).unwrap();
        // A preemption between the two clock reads skews one try; the best of five must agree.
        let best = (0..5)
            .map(|_| {
                let (t0, c0) = (Instant::now(), clock.now());
                std::thread::sleep(Duration::from_millis(20));
                let (c1, wall) = (clock.now(), t0.elapsed().as_nanos() as f64);
                (clock.ns(c1 - c0) as f64 / wall - 1.0).abs()
            })
            .fold(f64::INFINITY, f64::min);
        assert!(best < 0.02, "TSC and Instant disagree by {:.1} %", best * 100.0);
    }
}
