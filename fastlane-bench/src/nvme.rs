//! `fastlane bench nvme`: QD1 latency and deep-queue IOPS of a block backend, driven through
//! the `BlockQueue` seam itself: the userspace VFIO NVMe driver (`--backend nvme:BDF`) or,
//! for comparison on the same device, the kernel's nvme driver through io_uring
//! (`--backend file:/dev/nvme0n1 --direct`).
//!
//! One queue, one thread, closed loop: per case (pattern × queue depth) a warm-up, then `qd`
//! requests kept in flight for `--seconds`, busy-polling completions. Each request is timed
//! from just before `submit` to the moment `complete` returns it (`Instant`; under TCG a clock
//! read costs about 1 µs, small next to the emulated device's tens of µs) and recorded in a
//! [`LatencyRecorder`]. Offsets are uniformly random, aligned to the request size, inside
//! the first `--span` bytes. Buffers are DMA-mapped for `nvme:` (zero copy) and page-aligned
//! anonymous memory otherwise (fit for `O_DIRECT`).
//!
//! `--json` prints the same results as one JSON object (the `BENCH` lines then go to stderr).
//!
//! Writes overwrite the span: never point this at a disk whose contents matter.

use std::io::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use fastlane_block::{BlockDevice, BlockOp, BlockRequest, Completion, Segment};
use fastlane_hist::{format_ns, HlogWriter, LatencyRecorder, Summary};
use fastlane_nvme::{DmaBuffer, NvmeDevice, NvmeOptions};
use fastlane_util::parse_size;
use fastlane_vhost_blk::spec::{BackendSpec, SpecOptions};
use serde::Serialize;

use crate::blk::Pattern;

/// Largest queue depth.
const QD_MAX: u32 = 256;
/// A request outstanding this long means a wedged backend.
const STALL_TIMEOUT: Duration = Duration::from_secs(10);
/// Interval length of the `--hlog` histograms.
const HLOG_INTERVAL: Duration = Duration::from_secs(1);

/// Arguments of `fastlane bench nvme`.
#[derive(Debug, Args)]
pub struct NvmeArgs {
    /// The backend: `nvme:BDF` (the VFIO driver) or `file:/dev/nvme0n1` (kernel, io_uring).
    #[arg(long)]
    backend: String,
    /// Open `file:` backends with O_DIRECT.
    #[arg(long)]
    direct: bool,
    /// Name for this backend in the output and the hlog tags (default: the backend kind).
    #[arg(long)]
    label: Option<String>,
    /// Measured seconds per case (after a warm-up of a fifth of it, at most 0.5 s).
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Request size: bytes or with a K/M suffix (a multiple of 4 KiB, at most 1 MiB).
    #[arg(long, default_value = "4K")]
    size: String,
    /// Queue depths, comma-separated (1..=256).
    #[arg(long, value_delimiter = ',', default_value = "1,32")]
    qd: Vec<u32>,
    /// Patterns, comma-separated.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "randread,randwrite")]
    pattern: Vec<Pattern>,
    /// Offsets fall in the first SPAN bytes of the device.
    #[arg(long, default_value = "64M")]
    span: String,
    /// Write each case's latency histogram (tag `LABEL_qdN_PATTERN`) to this HdrHistogram
    /// interval log; read it with `fastlane hist`.
    #[arg(long)]
    hlog: Option<PathBuf>,
    /// Print the results as one JSON object on stdout instead of the table (the `BENCH`
    /// lines go to stderr).
    #[arg(long)]
    json: bool,
}

/// Buffer memory for all slots: DMA-mapped (VFIO) or anonymous.
enum Buffers {
    Dma(DmaBuffer),
    /// Unmapped on drop, after the queue that used it (it waits for in-flight requests).
    Anon(memmap2::MmapRaw),
}

impl Buffers {
    fn base(&self) -> *mut u8 {
        match self {
            Buffers::Dma(b) => b.as_ptr(),
            Buffers::Anon(map) => map.as_mut_ptr(),
        }
    }
}

fn anon(len: usize) -> Result<Buffers> {
    Ok(Buffers::Anon(crate::mem::mmap_populated(len)?))
}

/// One case's result (a row of the table).
#[derive(Debug, Serialize)]
struct CaseResult {
    /// `LABEL_qdN_PATTERN`, also the `--hlog` tag.
    case: String,
    pattern: Pattern,
    qd: u32,
    /// Requests completed in the measured time.
    ops: u64,
    /// Measured time (after the warm-up), ns.
    elapsed_ns: u64,
    /// Requests per second.
    iops: f64,
    /// Request latency, from just before `submit` to its completion, ns.
    latency: Summary,
}

/// What `fastlane bench nvme --json` prints.
#[derive(Debug, Serialize)]
struct NvmeReport {
    label: String,
    /// `--backend` as given.
    backend: String,
    /// `file:` backends opened with O_DIRECT.
    direct: bool,
    device_bytes: u64,
    device_block_bytes: u32,
    /// Bytes per request.
    request_bytes: usize,
    /// Offsets fall in the first `span_bytes` of the device.
    span_bytes: u64,
    /// Measured seconds per case, from `--seconds`.
    seconds_per_case: f64,
    /// The latency histograms, if `--hlog` was given.
    hlog: Option<String>,
    cases: Vec<CaseResult>,
}

/// Run `fastlane bench nvme`.
pub fn run(args: &NvmeArgs) -> Result<()> {
    let size = parse_size(&args.size).context("--size")?;
    if size == 0 || size % 4096 != 0 || size > 1 << 20 {
        bail!("--size must be a multiple of 4 KiB up to 1 MiB");
    }
    let size = size as usize;
    let span = parse_size(&args.span).context("--span")?;
    for &qd in &args.qd {
        if !(1..=QD_MAX).contains(&qd) {
            bail!("--qd {qd} not in 1..={QD_MAX}");
        }
    }
    let qd_max = *args.qd.iter().max().context("--qd is empty")? as usize;
    let spec: BackendSpec = args.backend.parse().context("--backend")?;
    let (dev, bufs): (Arc<dyn BlockDevice>, Buffers) = match &spec {
        BackendSpec::Nvme { bdf } => {
            let d = NvmeDevice::open(*bdf, NvmeOptions::default())
                .with_context(|| format!("opening {bdf} with the VFIO driver"))?;
            let b = d.alloc_dma(size * qd_max)?;
            (Arc::new(d), Buffers::Dma(b))
        }
        other => {
            let opts = SpecOptions { direct: args.direct, ..SpecOptions::default() };
            (other.open(&opts)?, anon(size * qd_max)?)
        }
    };
    let info = dev.info();
    let span = span.min(info.size_bytes) / size as u64 * size as u64;
    if span == 0 {
        bail!("device smaller than one request");
    }
    let label = args
        .label
        .clone()
        .unwrap_or_else(|| args.backend.split(':').next().unwrap_or("backend").to_string());
    // Fill the write buffers with something other than zeroes.
    for i in 0..size * qd_max {
        // SAFETY: inside our buffer; no request is in flight yet; a raw store.
        unsafe { bufs.base().wrapping_add(i).write((i as u8) ^ 0x5a) };
    }
    let mut hlog = match &args.hlog {
        Some(p) => {
            Some(HlogWriter::create(p).with_context(|| format!("creating hlog {}", p.display()))?)
        }
        None => None,
    };
    if !args.json {
        println!(
            "# {label}: {} ({} bytes, {}-byte blocks), {} B requests over the first {} bytes",
            args.backend, info.size_bytes, info.block_size, size, span
        );
    }
    let mut results = Vec::new();
    for &pattern in &args.pattern {
        for &qd in &args.qd {
            let case = format!("{label}_qd{qd}_{}", pattern.name());
            let r = run_case(
                &*dev,
                &bufs,
                pattern,
                qd,
                size,
                span,
                args.seconds,
                &case,
                hlog.as_mut(),
            )?;
            let line = format!(
                "BENCH {} ops={} iops={:.0} p50_ns={} p90_ns={} p99_ns={} p99_9_ns={} max_ns={}",
                r.case,
                r.ops,
                r.iops,
                r.latency.p50_ns,
                r.latency.p90_ns,
                r.latency.p99_ns,
                r.latency.p99_9_ns,
                r.latency.max_ns
            );
            if args.json {
                eprintln!("{line}");
            } else {
                println!("{line}");
            }
            results.push(r);
        }
    }
    if let Some(h) = hlog.as_mut() {
        h.flush()?;
    }
    let mut out = std::io::stdout().lock();
    if args.json {
        let report = NvmeReport {
            label,
            backend: args.backend.clone(),
            direct: args.direct,
            device_bytes: info.size_bytes,
            device_block_bytes: info.block_size,
            request_bytes: size,
            span_bytes: span,
            seconds_per_case: args.seconds,
            hlog: args.hlog.as_ref().map(|p| p.display().to_string()),
            cases: results,
        };
        serde_json::to_writer_pretty(&mut out, &report)?;
        writeln!(out)?;
        return Ok(());
    }
    writeln!(
        out,
        "{:<28} {:>9} {:>10} {:>10} {:>10} {:>10}",
        "case", "IOPS", "P50", "P90", "P99", "max"
    )?;
    for r in &results {
        writeln!(
            out,
            "{:<28} {:>9.0} {:>10} {:>10} {:>10} {:>10}",
            r.case,
            r.iops,
            format_ns(r.latency.p50_ns as f64),
            format_ns(r.latency.p90_ns as f64),
            format_ns(r.latency.p99_ns as f64),
            format_ns(r.latency.max_ns as f64)
        )?;
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn run_case(
    dev: &dyn BlockDevice,
    bufs: &Buffers,
    pattern: Pattern,
    qd: u32,
    size: usize,
    span: u64,
    seconds: f64,
    case: &str,
    mut hlog: Option<&mut HlogWriter<std::io::BufWriter<std::fs::File>>>,
) -> Result<CaseResult> {
    let mut q = dev.open_queue(qd).with_context(|| format!("opening a queue of depth {qd}"))?;
    let mut rec = LatencyRecorder::with_max(10_000_000_000)?;
    let op = match pattern {
        Pattern::Randread => BlockOp::Read,
        Pattern::Randwrite => BlockOp::Write,
    };
    let blocks = span / size as u64;
    let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ u64::from(qd);
    let mut started = vec![Instant::now(); qd as usize];
    let mut out = vec![Completion::EMPTY; qd as usize];
    let warm = Duration::from_secs_f64((seconds / 5.0).min(0.5));
    let measure = Duration::from_secs_f64(seconds);
    let t0 = Instant::now();
    let mut measuring_since: Option<Instant> = None;
    let mut last_log = t0;
    let mut ops = 0u64;
    let mut free: Vec<u32> = (0..qd).collect();
    let mut submit = |slot: u32,
                      q: &mut dyn fastlane_block::BlockQueue,
                      started: &mut [Instant]|
     -> Result<()> {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let offset = (rng % blocks) * size as u64;
        let segs =
            [Segment { addr: bufs.base().wrapping_add(slot as usize * size), len: size as u32 }];
        started[slot as usize] = Instant::now();
        let req = BlockRequest { op, offset, len: 0, segments: &segs, tag: u64::from(slot) };
        // SAFETY: slot `slot` of the buffer belongs to this request until its completion
        // comes back (the slot is only reused after that); `bufs` outlives the queue.
        if unsafe { q.submit(req) }.is_err() {
            bail!("queue full below its depth");
        }
        Ok(())
    };
    loop {
        while let Some(slot) = free.pop() {
            submit(slot, q.as_mut(), &mut started)?;
        }
        q.kick()?;
        let n = q.complete(&mut out);
        let now = Instant::now();
        for c in &out[..n] {
            let slot = c.tag as u32;
            if let Err(e) = c.result {
                bail!("{case}: request failed: {e}");
            }
            if measuring_since.is_some() {
                rec.record(now.duration_since(started[slot as usize]).as_nanos() as u64);
                ops += 1;
            }
            free.push(slot);
        }
        if n == 0 {
            if let Some(oldest) = started.iter().min() {
                if now.duration_since(*oldest) > STALL_TIMEOUT && free.len() < qd as usize {
                    bail!("{case}: a request took over {STALL_TIMEOUT:?}");
                }
            }
        }
        match measuring_since {
            None if now.duration_since(t0) >= warm => {
                measuring_since = Some(now);
                last_log = now;
            }
            Some(since) => {
                if now.duration_since(last_log) >= HLOG_INTERVAL {
                    last_log = now;
                    let iv = rec.take_interval();
                    if let Some(h) = hlog.as_deref_mut() {
                        h.write_interval(Some(case), &iv)?;
                    }
                }
                if now.duration_since(since) >= measure {
                    break;
                }
            }
            None => {}
        }
    }
    let elapsed = measuring_since.map_or(Duration::ZERO, |s| s.elapsed());
    let iv = rec.take_interval();
    if let Some(h) = hlog {
        h.write_interval(Some(case), &iv)?;
    }
    // Drain before the queue (and with it the buffers' users) goes.
    while q.in_flight() > 0 {
        if q.complete(&mut out) == 0 {
            q.wait(Some(Duration::from_millis(10)))?;
        }
    }
    Ok(CaseResult {
        case: case.to_string(),
        pattern,
        qd,
        ops,
        elapsed_ns: u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX),
        iops: ops as f64 / elapsed.as_secs_f64().max(1e-9),
        latency: Summary::from_histogram(rec.total()),
    })
}
