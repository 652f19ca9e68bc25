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
//!
//! This file holds the command line and `run`; `client` is the vhost-user-blk connection,
//! `clock` the TSC or `Instant` clock, `load` the load loop of a case, `verify` the
//! `--verify` pass, and `report` the `--json` report, the table and `--compare`.

mod client;
mod clock;
mod load;
mod report;
mod verify;

use std::io::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use fastlane_hist::{HlogWriter, LatencyRecorder, Summary};
use fastlane_util::parse_size;
use serde::{Deserialize, Serialize};

use client::Conn;
use clock::Clock;
use load::{drive, Case, Recording, XorShift};
use report::{compare, print_table, read_report, BlkReport, CaseReport, Latency};
use verify::verify;

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
    /// `--compare`: the largest B/A of QD1 P50 that meets the target (P99 keeps 0.5).
    #[arg(long, default_value_t = 0.5, requires = "compare")]
    p50_target: f64,
}

/// What a case does (also `fastlane bench nvme`'s `--pattern`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Pattern {
    /// Uniformly random, size-aligned reads over the whole disk.
    Randread,
    /// Uniformly random, size-aligned writes over the whole disk.
    Randwrite,
}

impl Pattern {
    pub(crate) fn name(self) -> &'static str {
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
    /// Requests are in flight and nothing completed for five seconds.
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
        return compare(&files[0], &files[1], args.labels.as_deref(), args.p50_target);
    }
    if let Some(path) = &args.show {
        return print_table(&mut std::io::stdout().lock(), &read_report(path)?);
    }
    let socket = args.socket.as_deref().context("--socket is required")?;
    anyhow::ensure!(!args.qd.is_empty(), "--qd needs at least one queue depth");
    anyhow::ensure!(!args.pattern.is_empty(), "--pattern needs at least one pattern");
    if let Some(core) = args.pin_core {
        crate::pin::pin_to(core, "--pin-core")?;
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

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::clock::invariant_tsc;
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
