//! `fastlane journal bench`: the journal's ack latency under load, against a file given one
//! `pwrite` + `fdatasync` per record, and what framing costs.
//!
//! This file holds the command line and `run`; `framing` measures what framing costs,
//! `report` is the `--json` report, and [`opts`] the journal flags `fastlane journal append`
//! shares (replica, I/O, preprocessing) and what they open.

mod framing;
pub mod opts;
mod report;
pub mod service;

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt as _;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use fastlane_hist::{HlogWriter, LatencyRecorder};
use fastlane_journal::format::frame_len;
use fastlane_journal::{
    CardPreprocess, Durability, Journal, JournalConfig, JournalError, SoftPreprocess,
};
use fastlane_ring::WaitStrategy;
use fastlane_util::parse_size;
use fastlane_util::tsc::{ns_per_tick, read_tsc as tsc};

use framing::{framing_cost, framing_via};
use opts::{
    make_preprocess, open_device, open_replica, parse_preprocess, writer_io_name, IoOpts,
    PreprocessKind, ReplicaOpts,
};
use report::{pcts, BenchReport, Pcts};

use crate::pin::unpin;

/// Arguments of `fastlane journal bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// The journal file (recreated); the pwrite+fdatasync baseline uses FILE.baseline.
    file: PathBuf,
    /// Size of the journal file.
    #[arg(long, default_value = "512M", value_parser = parse_size)]
    size: u64,
    /// Payload bytes per record.
    #[arg(long, default_value_t = 64)]
    record_bytes: usize,
    /// Records in the throughput run (their appends give the hot-path histogram).
    #[arg(long, default_value_t = 2_000_000)]
    records: u64,
    /// Append rate of the durable-ack run, records per second.
    #[arg(long, default_value_t = 20_000)]
    rate: u64,
    /// Length of the durable-ack run, seconds.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// pwrite+fdatasync calls in the baseline.
    #[arg(long, default_value_t = 1000)]
    baseline_ops: u64,
    /// Pin the writer thread to this core.
    #[arg(long)]
    writer_core: Option<usize>,
    /// Pin the producer thread to this core.
    #[arg(long)]
    producer_core: Option<usize>,
    /// Pin the ack run's waiter thread to this core (default: any core, even when the
    /// producer is pinned; a waiter sharing the producer's core waits for its yields).
    #[arg(long)]
    waiter_core: Option<usize>,
    /// Durability level of the journal runs.
    #[arg(long, default_value = "local")]
    durability: Durability,
    #[command(flatten)]
    replica: ReplicaOpts,
    /// Write the histograms here (tags: append, ack, pwrite_fdatasync, naive_under_load).
    #[arg(long, default_value = "journal-bench.hlog")]
    hlog: PathBuf,
    /// Who timestamps and checksums the frames of the journal runs: direct or card.
    #[arg(long, default_value = "direct", value_parser = parse_preprocess)]
    preprocess: PreprocessKind,
    #[command(flatten)]
    io: IoOpts,
    /// How the ack run's writer and waiter wait: park (spin, then sleep on a futex: at a light
    /// load every record pays two wake-ups, the writer's and the waiter's) or poll
    /// (`WaitStrategy::SpinYield`: spin, then sched_yield, never sleeping in the kernel, like
    /// the no-journal baseline's thread: no wake-up, but both threads keep their cores busy).
    #[arg(long, default_value = "park", value_parser = parse_ack_wait)]
    ack_wait: AckWait,
    /// Print the results as one JSON object (the same numbers as the table) instead.
    #[arg(long)]
    json: bool,
}

/// How the ack run's writer and waiter wait ([`BenchArgs::ack_wait`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AckWait {
    Park,
    Poll,
}

impl AckWait {
    fn name(self) -> &'static str {
        match self {
            AckWait::Park => "park",
            AckWait::Poll => "poll",
        }
    }

    /// The writer's idle wait, and the waiter's (`None`: `wait_durable`'s own).
    fn strategies(self) -> (WaitStrategy, Option<WaitStrategy>) {
        match self {
            AckWait::Park => (WaitStrategy::default(), None),
            AckWait::Poll => {
                let poll = WaitStrategy::SpinYield { spins: 128 };
                (poll, Some(poll))
            }
        }
    }
}

fn parse_ack_wait(s: &str) -> Result<AckWait, String> {
    [AckWait::Park, AckWait::Poll]
        .into_iter()
        .find(|w| w.name() == s)
        .ok_or_else(|| format!("{s}: want park or poll"))
}

/// Pins the calling thread to `core`, if given; a core it may not use is logged and skipped.
fn pin(core: Option<usize>) {
    if let Some(id) = core {
        if let Err(e) = crate::pin::pin_to(id, "core") {
            log::warn!("{e:#}; running unpinned");
        }
    }
}

/// A new journal in `a.file` (any old one removed) of `size` bytes, as `a` configures it,
/// whose writer idles with `wait`; `replicated` without `--replica` mirrors into FILE.replica.
fn fresh_journal(a: &BenchArgs, wait: WaitStrategy, size: u64) -> Result<Journal> {
    let _ = std::fs::remove_file(&a.file);
    let f = OpenOptions::new().write(true).create_new(true).open(&a.file)?;
    f.set_len(size)?;
    drop(f);
    let dev = open_device(&a.file, a.io.io, false)?;
    let mut c = JournalConfig::new(dev, a.durability);
    c.prefill = a.io.prefill;
    c.writer_io = a.io.writer_io;
    c.writer_core = a.writer_core;
    c.writer_wait = wait;
    c.ring_bytes = 16 << 20;
    c.max_batch_bytes = 4 << 20;
    if a.durability == Durability::Replicated {
        let mut opts = ReplicaOpts { ..a.replica.clone() };
        if opts.replica.is_none() {
            let mut rp = a.file.as_os_str().to_owned();
            rp.push(".replica");
            opts.replica = Some(rp.to_string_lossy().into_owned());
        }
        c.replica = open_replica(&opts, size, true)?;
        // Every run makes a new journal, so the replica holds the previous run's: a bench's
        // replica is scratch, rewritten each time (a run against a diverged one was refused).
        c.replica_rebuild = true;
    }
    c.preprocess = Some(make_preprocess(a.preprocess)?);
    Ok(Journal::create(c)?)
}

/// Sizes the baseline file as the journal's device is prepared at create: written zeroes
/// (`prefill`: every later `fdatasync` is data only) or allocated-but-unwritten extents (what
/// write-zeroes leaves: every `fdatasync` also converts the extents it wrote into).
fn prepare_like_journal(f: &std::fs::File, len: u64, prefill: bool) -> Result<()> {
    f.set_len(len)?;
    if prefill {
        let zero = vec![0u8; 1 << 20];
        let mut off = 0;
        while off < len {
            let n = (len - off).min(zero.len() as u64) as usize;
            f.write_all_at(&zero[..n], off)?;
            off += n as u64;
        }
    } else {
        use std::os::fd::AsRawFd;
        // SAFETY: fallocate on an open descriptor we own; it touches no memory of ours.
        let rc = unsafe {
            libc::fallocate(f.as_raw_fd(), libc::FALLOC_FL_ZERO_RANGE, 0, len as libc::off_t)
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error()).context("fallocate baseline");
        }
    }
    f.sync_all()?;
    Ok(())
}

/// Where [`naive_under_load`] writes in the baseline file (after the floor's frames).
const NAIVE_BASE: u64 = 1 << 20;

/// The load of the ack run without a journal: a generator stamps `total` arrivals at
/// `a.rate`; one thread takes them in order and gives each its own `pwrite` + `fdatasync` at
/// the next offset of `file`. Returns the arrival-to-fdatasync latencies and the time from the
/// first arrival to the last fdatasync. When one fdatasync takes longer than the arrival gap
/// the queue grows for the whole run, and the latencies with it: that is the point of group
/// commit. Bounded: an error after 120 s.
fn naive_under_load(
    file: &std::fs::File,
    a: &BenchArgs,
    total: u64,
    npt: f64,
) -> Result<(LatencyRecorder, Duration)> {
    let frame = vec![0x3Cu8; 48 + a.record_bytes.div_ceil(8) * 8];
    let (mut tx, mut rx) = fastlane_ring::spsc::channel::<u64>(total.max(1) as usize);
    let period = Duration::from_secs_f64(1.0 / a.rate as f64);
    let producer_core = a.producer_core;
    let start = Instant::now();
    let generator = std::thread::spawn(move || {
        pin(producer_core);
        for i in 1..=total {
            let due = start + period * (i as u32);
            while Instant::now() < due {
                std::thread::yield_now();
            }
            // The ring holds every arrival, so this never fails.
            let _ = tx.push(tsc());
        }
    });
    let mut rec = LatencyRecorder::with_max(200_000_000_000)?;
    let deadline = start + Duration::from_secs(120);
    let mut done = 0u64;
    while done < total {
        let stamp = match rx.pop() {
            Ok(t) => t,
            Err(_) if Instant::now() > deadline => bail!("no-journal baseline: over 120 s"),
            Err(_) => {
                std::thread::yield_now();
                continue;
            }
        };
        file.write_all_at(&frame, NAIVE_BASE + done * frame.len() as u64)?;
        file.sync_data()?;
        rec.record((tsc().wrapping_sub(stamp) as f64 * npt) as u64);
        done += 1;
    }
    let elapsed = start.elapsed();
    generator.join().map_err(|_| anyhow::anyhow!("arrival generator panicked"))?;
    Ok((rec, elapsed))
}

/// Runs `fastlane journal bench`: the throughput run, the durable-ack run between the two
/// halves of the `pwrite` + `fdatasync` floor, the same load without a journal, and framing
/// alone; prints the table (or, with `--json`, the report) and writes the histograms.
pub fn run(a: &BenchArgs) -> Result<()> {
    if a.record_bytes == 0 || a.record_bytes > 4096 {
        bail!("--record-bytes must be 1..=4096");
    }
    let npt = ns_per_tick();
    let fc = framing_cost(a.record_bytes);
    let via_direct = framing_via(&mut SoftPreprocess::default(), a.record_bytes)?;
    let via_card = framing_via(&mut CardPreprocess::soft()?, a.record_bytes)?;
    let payload = vec![0xA5u8; a.record_bytes];
    let mut hlog = HlogWriter::create(&a.hlog)?;
    hlog.write_comment(&format!(
        "fastlane journal bench: {} B records, durability {}, file {}",
        a.record_bytes,
        a.durability,
        a.file.display()
    ))?;

    // 1. Throughput at full speed; every successful append is timed (the hot path).
    eprintln!("journal bench: throughput run, {} records of {} B", a.records, a.record_bytes);
    let j = fresh_journal(a, WaitStrategy::SpinYield { spins: 1024 }, a.size)?;
    let mut tx = j.producer()?;
    let mut append_rec = LatencyRecorder::with_max(10_000_000)?;
    pin(a.producer_core);
    let t0 = Instant::now();
    let mut full = 0u64;
    let mut last = 0;
    for _ in 0..a.records {
        loop {
            let c0 = tsc();
            let r = tx.append(&payload);
            let c1 = tsc();
            match r {
                Ok(s) => {
                    append_rec.record((c1.wrapping_sub(c0) as f64 * npt) as u64);
                    last = s;
                    break;
                }
                Err(JournalError::Full) => {
                    full += 1;
                    std::hint::spin_loop();
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
    tx.wait_durable(last, Duration::from_secs(60))?;
    let elapsed = t0.elapsed();
    let stats = j.stats();
    drop(tx);
    j.close()?;
    let rate = a.records as f64 / elapsed.as_secs_f64();
    let ap = pcts(&append_rec);
    hlog.write_histogram(Some("append"), Duration::ZERO, elapsed, append_rec.current())?;

    // 3. The floor: pwrite + fdatasync of one frame's bytes on the same file system, half of
    //    the calls right before the ack run and half right after it, so that the ratio
    //    compares the same minutes of a shared disk whose flush time drifts.
    let mut bp = a.file.as_os_str().to_owned();
    bp.push(".baseline");
    let bp = PathBuf::from(bp);
    let _ = std::fs::remove_file(&bp);
    let bf = OpenOptions::new().read(true).write(true).create_new(true).open(&bp)?;
    let total = (a.rate as f64 * a.seconds) as u64;
    let frame_bytes = 48 + a.record_bytes.div_ceil(8) as u64 * 8;
    prepare_like_journal(
        &bf,
        a.size.min(16 << 20).max(NAIVE_BASE + total * frame_bytes),
        a.io.prefill,
    )?;
    let mut base_rec = LatencyRecorder::with_max(10_000_000_000)?;
    let frame = vec![0x5Au8; 48 + a.record_bytes.div_ceil(8) * 8];
    let bstart = Instant::now();
    let mut base_done = 0u64;
    let mut floor = |n: u64, rec: &mut LatencyRecorder| -> Result<()> {
        for _ in 0..n {
            let c0 = tsc();
            bf.write_all_at(&frame, base_done * frame.len() as u64)?;
            bf.sync_data()?;
            rec.record((tsc().wrapping_sub(c0) as f64 * npt) as u64);
            base_done += 1;
        }
        Ok(())
    };
    // 2. Durable-ack latency under a steady load: append at `rate`, a waiter thread stamps
    //    each seq when it becomes durable. The journal is created (and, with --prefill, its
    //    zeroes written and flushed) before the floor's first half, so that neither side runs
    //    while a freshly written file is still being flushed below; it is sized for the run
    //    (at least 64 MiB), not --size, which only the throughput run needs.
    let ack_size =
        (total * frame_len(a.record_bytes) as u64 * 2 + (16 << 20)).max(64 << 20).min(a.size);
    let (writer_wait, waiter_wait) = a.ack_wait.strategies();
    eprintln!(
        "journal bench: ack run, {} rec/s for {} s (floor calls before and after it)",
        a.rate, a.seconds
    );
    let j = Arc::new(fresh_journal(a, writer_wait, ack_size)?);
    // Let the disk settle after writing both files.
    std::thread::sleep(Duration::from_secs(1));
    floor(a.baseline_ops / 2, &mut base_rec)?;
    let stamps: Arc<Vec<AtomicU64>> = Arc::new((0..=total).map(|_| AtomicU64::new(0)).collect());
    let done = Arc::new(AtomicBool::new(false));
    let waiter = {
        let (j, stamps, done) = (Arc::clone(&j), Arc::clone(&stamps), Arc::clone(&done));
        let waiter_core = a.waiter_core;
        std::thread::spawn(move || -> Result<LatencyRecorder> {
            match waiter_core {
                Some(c) => pin(Some(c)),
                None => unpin(),
            }
            let mut rec = LatencyRecorder::with_max(10_000_000_000)?;
            let mut next = 1u64;
            while next <= total {
                let waited = match waiter_wait {
                    Some(w) => j.wait_durable_with(next, Duration::from_millis(50), w),
                    None => j.wait_durable(next, Duration::from_millis(50)),
                };
                match waited {
                    Ok(()) => {}
                    Err(JournalError::Timeout { .. }) if !done.load(Ordering::Acquire) => continue,
                    Err(JournalError::Timeout { .. }) => break,
                    Err(e) => return Err(e.into()),
                }
                let now = tsc();
                let d = j.durable_seq().min(total);
                while next <= d {
                    let t = stamps[next as usize].load(Ordering::Acquire);
                    if t != 0 {
                        rec.record((now.wrapping_sub(t) as f64 * npt) as u64);
                    }
                    next += 1;
                }
            }
            Ok(rec)
        })
    };
    let mut tx = j.producer()?;
    let period = Duration::from_secs_f64(1.0 / a.rate as f64);
    let start = Instant::now();
    for i in 1..=total {
        let due = start + period * (i as u32);
        // Yield rather than spin: on a loaded 2-core machine a spinning load generator takes
        // the core the writer and the waiter need (the stamp below is taken after the wait,
        // so a late append does not shorten the latency it measures).
        while Instant::now() < due {
            std::thread::yield_now();
        }
        // Stamp first: the waiter may see the seq durable before `append` returns.
        stamps[i as usize].store(tsc(), Ordering::Release);
        let s = tx.append_blocking(&payload, Duration::from_secs(10))?;
        debug_assert_eq!(s, i);
    }
    done.store(true, Ordering::Release);
    tx.wait_durable(total, Duration::from_secs(30))?;
    let ack_rec = waiter.join().map_err(|_| anyhow::anyhow!("waiter panicked"))??;
    let ack_elapsed = start.elapsed();
    drop(tx);
    let load_stats = Arc::try_unwrap(j).map_err(|_| anyhow::anyhow!("journal still shared"))?;
    let load_stats2 = load_stats.stats();
    load_stats.close()?;
    hlog.write_histogram(Some("ack"), Duration::ZERO, ack_elapsed, ack_rec.current())?;

    // 4. The same load without a journal: every record, in arrival order, `pwrite` +
    //    `fdatasync` on its own by one thread (what a process does that has no group commit),
    //    at the same rate and for the same count; latency from arrival to its fdatasync.
    eprintln!("journal bench: the same load without a journal, {total} records");
    let naive = naive_under_load(&bf, a, total, npt)?;
    hlog.write_histogram(Some("naive_under_load"), Duration::ZERO, naive.1, naive.0.current())?;

    // 3. The floor, second half (after the ack run; the first half ran just before it).
    floor(a.baseline_ops - a.baseline_ops / 2, &mut base_rec)?;
    hlog.write_histogram(
        Some("pwrite_fdatasync"),
        Duration::ZERO,
        bstart.elapsed(),
        base_rec.current(),
    )?;
    hlog.flush()?;
    drop(bf);
    let _ = std::fs::remove_file(&bp);
    let _ = std::fs::remove_file(&a.file);

    let ack = pcts(&ack_rec);
    let base = pcts(&base_rec);
    let nv = pcts(&naive.0);
    let preprocess_name = if a.preprocess == PreprocessKind::Card { "card" } else { "direct" };
    let ratio = |x: u64, y: u64| x as f64 / y.max(1) as f64;
    if a.json {
        let report = BenchReport {
            record_bytes: a.record_bytes,
            durability: a.durability.to_string(),
            io: a.io.io.to_string(),
            writer_io: writer_io_name(a.io.writer_io),
            prefill: a.io.prefill,
            ack_wait: a.ack_wait.name(),
            preprocess: preprocess_name,
            rate_per_s: a.rate,
            seconds: a.seconds,
            append: &ap,
            ack: &ack,
            pwrite_fdatasync: &base,
            same_load_no_journal: &nv,
            ack_over_floor_p50: ratio(ack.p50, base.p50),
            ack_over_floor_p99: ratio(ack.p99, base.p99),
            ack_over_no_journal_p50: ratio(ack.p50, nv.p50),
            ack_over_no_journal_p99: ratio(ack.p99, nv.p99),
            ack_run_batches: load_stats2.batches,
            ack_run_flushes: load_stats2.flushes,
            no_journal_drain_s: naive.1.as_secs_f64(),
            throughput_records_per_s: rate,
            throughput_records: a.records,
            throughput_s: elapsed.as_secs_f64(),
            throughput_batches: stats.batches,
            throughput_full_retries: full,
            framing_ns_per_record: fc.frame,
            framing_chain_ns: fc.chain,
            framing_crc32c_ns: fc.crc,
            framing_timestamp_ns: fc.timestamp,
            framing_batch_hash_ns: fc.batch_hash,
            framing_direct_ns_per_record: via_direct,
            framing_card_ns_per_record: via_card,
            hlog: a.hlog.display().to_string(),
        };
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "fastlane journal bench: {} B records, durability {}, --io {} --writer-io {} --prefill {} \
         --ack-wait {}",
        a.record_bytes,
        a.durability,
        a.io.io,
        writer_io_name(a.io.writer_io),
        a.io.prefill,
        a.ack_wait.name()
    );
    println!("{:<28} {:>10} {:>10} {:>10} {:>12} {:>10}", "", "p50", "p99", "p99.9", "max", "n");
    let row = |name: &str, p: &Pcts| {
        println!(
            "{:<28} {:>10} {:>10} {:>10} {:>12} {:>10}",
            name, p.p50, p.p99, p.p999, p.max, p.n
        );
    };
    row("append hot path (ns)", &ap);
    row("append->durable ack (ns)", &ack);
    row("pwrite+fdatasync (ns)", &base);
    row("same load, no journal (ns)", &nv);
    println!(
        "ack/baseline: p50 {:.2}x  p99 {:.2}x   (load: {} rec/s, {} batches, {:.1} rec/batch, \
         {} flushes)",
        ratio(ack.p50, base.p50),
        ratio(ack.p99, base.p99),
        a.rate,
        load_stats2.batches,
        load_stats2.records as f64 / load_stats2.batches.max(1) as f64,
        load_stats2.flushes
    );
    println!(
        "ack/same-load-no-journal: p50 {:.2}x  p99 {:.2}x   (one pwrite+fdatasync per record \
         at {} rec/s: drained in {:.2} s for a {:.2} s arrival window)",
        ratio(ack.p50, nv.p50),
        ratio(ack.p99, nv.p99),
        a.rate,
        naive.1.as_secs_f64(),
        a.seconds
    );
    println!(
        "throughput: {:.0} records/s ({} records in {:.3} s, {} batches, {:.0} rec/batch, {} full retries)",
        rate,
        a.records,
        elapsed.as_secs_f64(),
        stats.batches,
        stats.records as f64 / stats.batches.max(1) as f64,
        full
    );
    println!(
        "framing alone: {:.0} ns/record (BLAKE3 chain {:.0}, CRC32C {:.0}, timestamp {:.0}; \
         BLAKE3 over a 1024-record batch {:.1} ns/record) = {:.2} M records/s on one core",
        fc.frame,
        fc.chain,
        fc.crc,
        fc.timestamp,
        fc.batch_hash,
        1e3 / fc.frame.max(1e-3)
    );
    println!(
        "framing by batch (stage/finish, 1024 records): direct {:.0} ns/record, card {:.0} \
         ns/record ({:.2}x; journal runs used --preprocess {})",
        via_direct,
        via_card,
        via_card / via_direct.max(1e-3),
        preprocess_name
    );
    println!("histograms: {}", a.hlog.display());
    Ok(())
}
