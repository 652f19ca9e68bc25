//! `fastlane bench`: measurements of FastLane's own paths, with the physical floor or the
//! named peer measured in the same run.
//!
//! `bench ring` moves items between two pinned threads through `fastlane_ring::spsc`:
//! throughput one item at a time and in chunks, and one-way latency from a ping-pong, each
//! round trip timed and recorded in an HdrHistogram, next to a bare atomic ping-pong between the
//! same two threads (the floor no ring can beat). Channels are `WaitStrategy::BusySpin` (what a
//! pinned latency-critical pair uses); the ping-pong is measured once more with the default,
//! parking strategy, whose every publish pays a fence to check for a sleeper. The criterion suite in `benches/ring.rs`
//! compares against the other rings (rtrb, crossbeam, std).

use std::io::Write as _;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use fastlane_hist::{format_ns, HlogWriter, LatencyRecorder, Summary};
use fastlane_ring::{spsc, WaitStrategy};
use serde::Serialize;

/// Arguments of `fastlane bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    what: BenchWhat,
}

#[derive(Debug, Subcommand)]
enum BenchWhat {
    /// The SPSC ring: throughput (single and batched) and ping-pong latency against a bare
    /// atomic ping-pong between the same two threads.
    Ring(RingArgs),
    /// A vhost-user-blk backend on a Unix socket (ours or qemu-storage-daemon's): QD1
    /// latency and QD32 IOPS of 4 KiB random reads and writes, busy-polled.
    Blk(crate::blk::BlkArgs),
    /// An NVMe block backend through the block seam: the userspace VFIO driver
    /// (`nvme:BDF`) or the kernel's (`file:/dev/nvme0n1 --direct`); QD1 latency and QD32 IOPS.
    Nvme(crate::nvme::NvmeArgs),
}

/// Arguments of `fastlane bench ring`.
#[derive(Debug, Args)]
pub struct RingArgs {
    /// Seconds per case (throughput and latency cases alike).
    #[arg(long, default_value_t = 2.0, value_parser = parse_seconds)]
    seconds: f64,
    /// Ring capacity for the throughput cases (rounded up to a power of two).
    #[arg(long, default_value_t = 4096)]
    capacity: usize,
    /// Items per chunk in the batched throughput case.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Write the latency histograms (one interval per second, tags `fastlane_ring`,
    /// `fastlane_ring_parking` and `atomic_floor`) to this HdrHistogram interval log; read it with `fastlane hist`.
    #[arg(long)]
    hlog: Option<PathBuf>,
    /// Print the results as JSON instead of tables.
    #[arg(long)]
    json: bool,
}

fn parse_seconds(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|_| format!("not a number: {s}"))?;
    if !(0.01..=3600.0).contains(&v) {
        return Err("must be between 0.01 and 3600 seconds".into());
    }
    Ok(v)
}

/// Runs `fastlane bench …`.
pub fn run(args: &BenchArgs) -> Result<()> {
    match &args.what {
        BenchWhat::Ring(a) => ring(a),
        BenchWhat::Nvme(a) => crate::nvme::run(a),
        BenchWhat::Blk(a) => crate::blk::run(a),
    }
}

#[derive(Debug, Serialize)]
struct ThroughputResult {
    case: &'static str,
    items: u64,
    seconds: f64,
    mitems_per_s: f64,
}

#[derive(Debug, Serialize)]
struct LatencyResult {
    case: &'static str,
    /// One-way latency (half of each timed round trip), nanoseconds.
    one_way: Summary,
    /// P50 relative to the atomic floor's P50.
    p50_vs_floor: f64,
    /// P99 relative to the atomic floor's P99.
    p99_vs_floor: f64,
}

#[derive(Debug, Serialize)]
struct RingReport {
    cores: usize,
    pinned: bool,
    seconds_per_case: f64,
    throughput: Vec<ThroughputResult>,
    latency: Vec<LatencyResult>,
}

fn ring(args: &RingArgs) -> Result<()> {
    anyhow::ensure!(args.batch >= 1, "--batch must be at least 1");
    anyhow::ensure!(
        args.capacity >= args.batch && args.capacity <= 1 << 24,
        "--capacity must be between --batch and 16777216"
    );
    let budget = Duration::from_secs_f64(args.seconds);
    let cores = process_cores().len().max(1);
    let progress = |msg: &str| {
        if !args.json {
            eprintln!("bench ring: {msg}");
        }
    };

    progress(&format!("throughput, one item at a time ({:.1} s)", args.seconds));
    let single = throughput(args.capacity, 1, budget);
    progress(&format!("throughput, chunks of {} ({:.1} s)", args.batch, args.seconds));
    let batched = throughput(args.capacity, args.batch, budget);
    progress(&format!("ping-pong latency through two busy-spin rings ({:.1} s)", args.seconds));
    let mut ring_rec = LatencyRecorder::with_max(10_000_000)?;
    let mut park_rec = LatencyRecorder::with_max(10_000_000)?;
    let mut floor_rec = LatencyRecorder::with_max(10_000_000)?;
    let mut log = match &args.hlog {
        Some(p) => {
            Some(HlogWriter::create(p).with_context(|| format!("creating hlog {}", p.display()))?)
        }
        None => None,
    };
    pingpong_ring(budget, WaitStrategy::BusySpin, "fastlane_ring", &mut ring_rec, log.as_mut())?;
    progress(&format!(
        "ping-pong latency through two rings, default (parking) strategy ({:.1} s)",
        args.seconds
    ));
    let park = WaitStrategy::default();
    pingpong_ring(budget, park, "fastlane_ring_parking", &mut park_rec, log.as_mut())?;
    progress(&format!("ping-pong latency, bare atomic floor ({:.1} s)", args.seconds));
    pingpong_atomic(budget, &mut floor_rec, log.as_mut())?;
    if let Some(mut l) = log {
        l.flush()?;
    }

    let floor = Summary::from_histogram(floor_rec.total());
    let ring_s = Summary::from_histogram(ring_rec.total());
    let park_s = Summary::from_histogram(park_rec.total());
    let ratio = |a: u64, b: u64| if b == 0 { f64::NAN } else { a as f64 / b as f64 };
    let report = RingReport {
        cores,
        pinned: cores >= 2,
        seconds_per_case: args.seconds,
        throughput: vec![
            ThroughputResult {
                case: "single",
                items: single.0,
                seconds: single.1.as_secs_f64(),
                mitems_per_s: single.0 as f64 / single.1.as_secs_f64() / 1e6,
            },
            ThroughputResult {
                case: "batched",
                items: batched.0,
                seconds: batched.1.as_secs_f64(),
                mitems_per_s: batched.0 as f64 / batched.1.as_secs_f64() / 1e6,
            },
        ],
        latency: vec![
            LatencyResult {
                case: "fastlane_ring",
                one_way: ring_s,
                p50_vs_floor: ratio(ring_s.p50_ns, floor.p50_ns),
                p99_vs_floor: ratio(ring_s.p99_ns, floor.p99_ns),
            },
            LatencyResult {
                case: "fastlane_ring_parking",
                one_way: park_s,
                p50_vs_floor: ratio(park_s.p50_ns, floor.p50_ns),
                p99_vs_floor: ratio(park_s.p99_ns, floor.p99_ns),
            },
            LatencyResult {
                case: "atomic_floor",
                one_way: floor,
                p50_vs_floor: 1.0,
                p99_vs_floor: 1.0,
            },
        ],
    };

    let mut out = std::io::stdout().lock();
    if args.json {
        serde_json::to_writer_pretty(&mut out, &report)?;
        writeln!(out)?;
        return Ok(());
    }
    writeln!(
        out,
        "fastlane-ring, u64 items, producer and consumer {} ({} cores)\n",
        if report.pinned { "pinned to cores 0 and 1" } else { "unpinned" },
        cores
    )?;
    writeln!(out, "{:<10} {:>14} {:>9} {:>12}", "throughput", "items", "seconds", "Mitems/s")?;
    for t in &report.throughput {
        writeln!(
            out,
            "{:<10} {:>14} {:>9.2} {:>12.1}",
            t.case, t.items, t.seconds, t.mitems_per_s
        )?;
    }
    writeln!(out)?;
    writeln!(
        out,
        "{:<22} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8}",
        "one-way", "samples", "P50", "P90", "P99", "P99.9", "max", "P50/flr", "P99/flr"
    )?;
    for l in &report.latency {
        let s = &l.one_way;
        writeln!(
            out,
            "{:<22} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8.2} {:>8.2}",
            l.case,
            s.count,
            format_ns(s.p50_ns as f64),
            format_ns(s.p90_ns as f64),
            format_ns(s.p99_ns as f64),
            format_ns(s.p99_9_ns as f64),
            format_ns(s.max_ns as f64),
            l.p50_vs_floor,
            l.p99_vs_floor
        )?;
    }
    if let Some(p) = &args.hlog {
        writeln!(out, "\nlatency histograms: {} (read with `fastlane hist`)", p.display())?;
    }
    Ok(())
}

use fastlane_util::cpu::{pin_nth as pin, process_cpus as process_cores};

/// Moves u64 sequence numbers from a pinned producer to a pinned consumer for `budget`;
/// returns (items moved, elapsed). The consumer checks every item's sequence number.
fn throughput(capacity: usize, batch: usize, budget: Duration) -> (u64, Duration) {
    let (mut tx, mut rx) = spsc::channel_with::<u64>(capacity, WaitStrategy::BusySpin);
    let stop = Arc::new(AtomicU64::new(0));
    let barrier = Arc::new(Barrier::new(2));
    let (stop2, barrier2) = (stop.clone(), barrier.clone());
    let producer = thread::spawn(move || {
        pin(0);
        barrier2.wait();
        let mut i = 0u64;
        // Bounded by `stop`, which the consumer sets after `budget`; the check costs one
        // relaxed load per chunk.
        while stop2.load(Ordering::Relaxed) == 0 {
            if batch == 1 {
                if tx.push(i).is_ok() {
                    i += 1;
                }
            } else if let Ok(chunk) = tx.write_chunk_uninit(batch) {
                chunk.fill_from_iter(i..i + batch as u64);
                i += batch as u64;
            }
        }
        i
    });
    pin(1);
    barrier.wait();
    let start = Instant::now();
    let mut next = 0u64;
    let mut checks = 0u32;
    loop {
        if batch == 1 {
            if let Ok(v) = rx.pop() {
                assert_eq!(v, next, "ring delivered out of order");
                next += 1;
            }
        } else if let Ok(chunk) = rx.read_chunk(batch) {
            let (a, b) = chunk.as_slices();
            assert_eq!(a[0], next, "ring delivered out of order");
            next += (a.len() + b.len()) as u64;
            chunk.commit_all();
        }
        checks = checks.wrapping_add(1);
        if checks.is_multiple_of(1024) && start.elapsed() >= budget {
            break;
        }
    }
    let elapsed = start.elapsed();
    stop.store(1, Ordering::Relaxed);
    let produced = producer.join().expect("producer thread panicked");
    assert!(produced >= next);
    (next, elapsed)
}

const INTERVAL: Duration = Duration::from_secs(1);

/// One-way latency through two rings: we push a timestamp-free token, the echo thread pops it
/// and pushes it back; each round trip is timed here and half of it recorded.
fn pingpong_ring(
    budget: Duration,
    strategy: WaitStrategy,
    tag: &str,
    rec: &mut LatencyRecorder,
    mut log: Option<&mut HlogWriter<std::io::BufWriter<std::fs::File>>>,
) -> Result<()> {
    let (mut ping_tx, mut ping_rx) = spsc::channel_with::<u64>(64, strategy);
    let (mut pong_tx, mut pong_rx) = spsc::channel_with::<u64>(64, strategy);
    let barrier = Arc::new(Barrier::new(2));
    let barrier2 = barrier.clone();
    let echo = thread::spawn(move || {
        pin(0);
        barrier2.wait();
        // Ends when the pinger drops its producer (`Abandoned`) or after 10 s of silence.
        loop {
            match ping_rx.pop_blocking(Some(Instant::now() + Duration::from_secs(10))) {
                Ok(v) => {
                    if pong_tx.push(v).is_err() {
                        return;
                    }
                }
                Err(_) => return,
            }
        }
    });
    pin(1);
    barrier.wait();
    let start = Instant::now();
    let mut last_log = start;
    let mut i = 0u64;
    while start.elapsed() < budget {
        let t0 = Instant::now();
        while ping_tx.push(i).is_err() {
            std::hint::spin_loop();
        }
        let v = loop {
            if let Ok(v) = pong_rx.pop() {
                break v;
            }
            std::hint::spin_loop();
        };
        let rtt = t0.elapsed();
        anyhow::ensure!(v == i, "ping-pong token {v} came back for {i}");
        rec.record(rtt.as_nanos() as u64 / 2);
        i += 1;
        if t0.duration_since(last_log) >= INTERVAL {
            last_log = t0;
            let iv = rec.take_interval();
            if let Some(l) = log.as_deref_mut() {
                l.write_interval(Some(tag), &iv)?;
            }
        }
    }
    let iv = rec.take_interval();
    if let Some(l) = log {
        l.write_interval(Some(tag), &iv)?;
    }
    drop(ping_tx);
    echo.join().expect("echo thread panicked");
    Ok(())
}

/// The floor: the same timed round trip over one shared `AtomicU64`.
fn pingpong_atomic(
    budget: Duration,
    rec: &mut LatencyRecorder,
    mut log: Option<&mut HlogWriter<std::io::BufWriter<std::fs::File>>>,
) -> Result<()> {
    // Odd values: the ball is here; even: with the echo thread; u64::MAX: stop.
    let ball = Arc::new(AtomicU64::new(1));
    let barrier = Arc::new(Barrier::new(2));
    let (ball2, barrier2) = (ball.clone(), barrier.clone());
    let echo = thread::spawn(move || {
        pin(0);
        barrier2.wait();
        // No clock read per bounce (it would inflate the floor): after 2^16 idle spins note
        // the time, and give up when the ball has not moved for 10 s.
        let mut idle_spins = 0u32;
        let mut idle_since = Instant::now();
        loop {
            let v = ball2.load(Ordering::Acquire);
            if v == u64::MAX {
                return;
            }
            if v % 2 == 0 {
                ball2.store(v + 1, Ordering::Release);
                idle_spins = 0;
                continue;
            }
            idle_spins = idle_spins.wrapping_add(1);
            if idle_spins == 1 << 16 {
                idle_since = Instant::now();
            } else if idle_spins.is_multiple_of(1 << 16)
                && idle_since.elapsed() > Duration::from_secs(10)
            {
                return;
            }
            std::hint::spin_loop();
        }
    });
    pin(1);
    barrier.wait();
    let start = Instant::now();
    let mut last_log = start;
    let mut v = 1u64;
    while start.elapsed() < budget {
        let t0 = Instant::now();
        ball.store(v + 1, Ordering::Release);
        while ball.load(Ordering::Acquire) != v + 2 {
            std::hint::spin_loop();
        }
        let rtt = t0.elapsed();
        v += 2;
        rec.record(rtt.as_nanos() as u64 / 2);
        if t0.duration_since(last_log) >= INTERVAL {
            last_log = t0;
            let iv = rec.take_interval();
            if let Some(l) = log.as_deref_mut() {
                l.write_interval(Some("atomic_floor"), &iv)?;
            }
        }
    }
    let iv = rec.take_interval();
    if let Some(l) = log {
        l.write_interval(Some("atomic_floor"), &iv)?;
    }
    ball.store(u64::MAX, Ordering::Release);
    echo.join().expect("echo thread panicked");
    Ok(())
}
