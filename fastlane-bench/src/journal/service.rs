//! `fastlane journal bench-service`: the journal service's durable-ack latency, with producers
//! attached as a real client does (`JournalProducer::connect`), at steady rates, against the
//! device's floor measured on the same file system in the same run.
//!
//! Per case (a rate and a number of producers) a fresh service directory; each producer thread
//! appends its share of the rate on a schedule and, between appends, polls its own durable seq
//! (one load), stamping each record's ack when it sees it: ack latency = from just before
//! `append` to the producer seeing the record durable. The floor is measured half right before
//! and half right after each case, both ways a record can be made durable on its own: `pwrite`
//! of one frame's bytes + `fdatasync` (on a file of written zeroes), and one `O_DIRECT` 4 KiB
//! `pwritev2(RWF_DSYNC)` (the same file). The report gives ack P99 over the faster floor's P99.
//!
//! A third peer, also half before and half after, is the device under the same load with no
//! journal (`Floor::sustained`: the case's schedule written by one thread straight to the
//! file, one `RWF_DSYNC` write in flight): the idle floor misses the stalls a disk shows
//! under sustained writes, this one does not, and ack P99 minus its P99 is what the journal
//! itself spends at the tail.

use std::fs::OpenOptions;
use std::os::fd::AsRawFd as _;
use std::os::unix::fs::{FileExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use fastlane_hist::LatencyRecorder;
use fastlane_journal::format::frame_len;
use fastlane_journal::service::{Service, ServiceConfig};
use fastlane_journal::{JournalError, JournalProducer, WriterIo};
use fastlane_util::parse_size;
use fastlane_util::tsc::{ns_per_tick, read_tsc as tsc};
use serde::Serialize;

use super::opts::{open_device, parse_writer_io, writer_io_name};
use super::report::{pcts, Pcts};

/// Arguments of `fastlane journal bench-service`.
#[derive(Debug, Args)]
pub struct ServiceBenchArgs {
    /// A directory on the file system to measure (created; each case uses a fresh
    /// subdirectory, removed afterwards).
    #[arg(long)]
    dir: PathBuf,
    /// Cases: total rate x producers, comma-separated (e.g. 2000x1,20000x1,200000x1,20000x3).
    #[arg(long, default_value = "2000x1,20000x1,200000x1,20000x3", value_delimiter = ',')]
    cases: Vec<String>,
    /// Seconds per case.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Payload bytes per record.
    #[arg(long, default_value_t = 64)]
    record_bytes: usize,
    /// How the service's writer does its I/O: dsync or pipelined.
    #[arg(long, default_value = "dsync", value_parser = parse_writer_io)]
    writer_io: WriterIo,
    /// Open the segments with O_DIRECT.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    direct: bool,
    /// Segment size.
    #[arg(long, default_value = "256M", value_parser = parse_size)]
    segment_bytes: u64,
    /// The least pace of the next segment's file, written in the background (journal serve's
    /// --spare-rate).
    #[arg(long, default_value = "128M", value_parser = parse_size)]
    spare_rate: u64,
    /// Raise the spare's pace with the fill (journal serve's --spare-adapt).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    spare_adapt: bool,
    /// Keep this many segments (journal serve's --retain segments=N): each roll then removes
    /// one, as a service that runs all day does (0: keep every segment).
    #[arg(long, default_value_t = 0)]
    retain_segments: usize,
    /// Floor calls per kind per case (half before, half after).
    #[arg(long, default_value_t = 400)]
    floor_ops: u64,
    /// Pin the service's writer thread to this core.
    #[arg(long)]
    writer_core: Option<usize>,
    /// How the idle writer waits for records: park (spin, yield, then sleep on the doorbell;
    /// the default) or poll (spin and yield, never sleep: no wake-up, a core kept busy).
    #[arg(long, default_value = "park")]
    writer_wait: String,
    /// Print one JSON object with every case instead of the table.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Case {
    rate_per_s: u64,
    producers: usize,
    writer_io: &'static str,
    direct: bool,
    ack: Pcts,
    floor_pwrite_fdatasync: Pcts,
    floor_dsync_direct: Pcts,
    /// The same schedule written straight to the file, no journal (see the module's doc).
    floor_sustained: Pcts,
    /// Acks seen while the next segment's file was being written (or a roll was under
    /// way), and the rest: a case long enough to roll writes a spare beside the journal.
    ack_while_spare: Pcts,
    ack_spare_ready: Pcts,
    /// Segment rolls during the case, and the writer's time in them (µs, all rolls).
    rolls: u64,
    /// Segments retention removed (`--retain-segments`), off the writer.
    segments_removed: u64,
    roll_us: u64,
    /// Ack P99 over the faster floor's P99.
    ack_p99_over_floor_p99: f64,
    /// Ack P99 over the sustained floor's P99.
    ack_p99_over_sustained_p99: f64,
    records: u64,
    batches: u64,
    load_before: String,
    load_after: String,
}

/// Runs `fastlane journal bench-service`.
pub fn run(a: &ServiceBenchArgs) -> Result<()> {
    if a.record_bytes == 0 || a.record_bytes > 4096 {
        bail!("--record-bytes must be 1..=4096");
    }
    std::fs::create_dir_all(&a.dir).with_context(|| format!("create {}", a.dir.display()))?;
    let npt = ns_per_tick();
    let floor_path = a.dir.join("floor.bin");
    let mut floor = Floor::create(&floor_path, a.record_bytes)?;
    let mut out = Vec::new();
    for (k, spec) in a.cases.iter().enumerate() {
        let (rate, producers) = parse_case(spec)?;
        let load_before = crate::load::loadavg();
        eprintln!(
            "journal bench-service: case {spec}: {rate} rec/s from {producers} producer(s), \
             {} s, --writer-io {} --direct {} (load {load_before})",
            a.seconds,
            writer_io_name(a.writer_io),
            a.direct
        );
        let mut f_sync = LatencyRecorder::with_max(10_000_000_000)?;
        let mut f_dsync = LatencyRecorder::with_max(10_000_000_000)?;
        let mut f_sust = LatencyRecorder::with_max(10_000_000_000)?;
        let fb = frame_len(a.record_bytes);
        floor.run(a.floor_ops / 2, &mut f_sync, &mut f_dsync, npt)?;
        floor.sustained(rate, a.seconds / 2.0, fb, &mut f_sust, npt)?;
        let dir = a.dir.join(format!("case-{k}"));
        let _ = std::fs::remove_dir_all(&dir);
        let run = run_case(a, &dir, rate, producers, npt)?;
        let _ = std::fs::remove_dir_all(&dir);
        floor.sustained(rate, a.seconds / 2.0, fb, &mut f_sust, npt)?;
        floor.run(a.floor_ops - a.floor_ops / 2, &mut f_sync, &mut f_dsync, npt)?;
        let (ack, fs, fd, fu) = (pcts(&run.ack), pcts(&f_sync), pcts(&f_dsync), pcts(&f_sust));
        let best = fs.p99.min(fd.p99).max(1);
        out.push(Case {
            rate_per_s: rate,
            producers,
            writer_io: writer_io_name(a.writer_io),
            direct: a.direct,
            ack_p99_over_floor_p99: ack.p99 as f64 / best as f64,
            ack_p99_over_sustained_p99: ack.p99 as f64 / fu.p99.max(1) as f64,
            ack,
            ack_while_spare: pcts(&run.while_spare),
            ack_spare_ready: pcts(&run.spare_ready),
            rolls: run.rolls,
            segments_removed: run.segments_removed,
            roll_us: run.roll_us,
            floor_sustained: fu,
            floor_pwrite_fdatasync: fs,
            floor_dsync_direct: fd,
            records: run.records,
            batches: run.batches,
            load_before,
            load_after: crate::load::loadavg(),
        });
    }
    drop(floor);
    let _ = std::fs::remove_file(&floor_path);
    if a.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "fastlane journal bench-service: {} B records, --writer-io {} --direct {}, {} s per case, \
         µs",
        a.record_bytes,
        writer_io_name(a.writer_io),
        a.direct,
        a.seconds
    );
    println!(
        "{:>8} {:>4} {:>9} {:>9} {:>9} {:>12} {:>12} {:>9} {:>11} {:>9} {:>9} {:>14} {:>5} {:>9}",
        "rate",
        "prod",
        "ack p50",
        "ack p99",
        "p99.9",
        "fdatasync99",
        "dsync99",
        "x floor",
        "no-jrnl99",
        "x no-jrnl",
        "records",
        "rec/batch",
        "rolls",
        "spare99"
    );
    let us = |ns: u64| ns as f64 / 1e3;
    for c in &out {
        println!(
            "{:>8} {:>4} {:>9.1} {:>9.1} {:>9.1} {:>12.1} {:>12.1} {:>9.2} {:>11.1} {:>9.2} {:>9} \
             {:>14.1} {:>5} {:>9}",
            c.rate_per_s,
            c.producers,
            us(c.ack.p50),
            us(c.ack.p99),
            us(c.ack.p999),
            us(c.floor_pwrite_fdatasync.p99),
            us(c.floor_dsync_direct.p99),
            c.ack_p99_over_floor_p99,
            us(c.floor_sustained.p99),
            c.ack_p99_over_sustained_p99,
            c.records,
            c.records as f64 / c.batches.max(1) as f64,
            c.rolls,
            // Acks seen while a spare was being written: none when the case never rolled.
            if c.ack_while_spare.n == 0 {
                "-".to_string()
            } else {
                format!("{:.1}", us(c.ack_while_spare.p99))
            }
        );
    }
    for c in &out {
        println!("load {} -> {}", c.load_before, c.load_after);
    }
    Ok(())
}

fn parse_case(s: &str) -> Result<(u64, usize)> {
    let (r, p) = s.split_once('x').with_context(|| format!("--cases {s}: want RATExPRODUCERS"))?;
    let rate: u64 = r.parse().with_context(|| format!("--cases {s}: rate"))?;
    let producers: usize = p.parse().with_context(|| format!("--cases {s}: producers"))?;
    if rate == 0 || producers == 0 || producers > 64 {
        bail!("--cases {s}: rate >= 1, producers 1..=64");
    }
    Ok((rate, producers))
}

/// What one case measured.
struct CaseRun {
    /// Every ack, and the same split by whether the spare was ready when it was seen.
    ack: LatencyRecorder,
    while_spare: LatencyRecorder,
    spare_ready: LatencyRecorder,
    records: u64,
    batches: u64,
    rolls: u64,
    segments_removed: u64,
    roll_us: u64,
}

/// One case: a service on `dir`, `producers` threads appending `rate` records/s in total.
fn run_case(
    a: &ServiceBenchArgs,
    dir: &Path,
    rate: u64,
    producers: usize,
    npt: f64,
) -> Result<CaseRun> {
    let mut c = ServiceConfig::new(dir);
    c.segment_bytes = a.segment_bytes;
    c.writer_io = a.writer_io;
    c.writer_core = a.writer_core;
    c.writer_wait = match a.writer_wait.as_str() {
        "park" => fastlane_journal::service::WRITER_WAIT,
        "poll" => fastlane_ring::WaitStrategy::SpinYield { spins: 1024 },
        other => bail!("--writer-wait {other}: want park or poll"),
    };
    c.ring_bytes = 16 << 20;
    // 4 MiB, or less for a segment too small for it (the torn window must fit twice).
    c.max_batch_bytes = (4u64 << 20).min(a.segment_bytes / 8) as u32;
    c.max_producers = producers.max(1);
    c.spare_bytes_per_s = a.spare_rate;
    c.spare_adaptive = a.spare_adapt;
    if a.retain_segments > 0 {
        c.retention.max_segments = Some(a.retain_segments);
    }
    let direct = a.direct;
    c.open = Arc::new(move |p: &Path| {
        open_device(p, fastlane_vhost_blk::spec::IoEngine::Uring, direct).map_err(|e| {
            JournalError::Io { op: "open segment", source: std::io::Error::other(format!("{e:#}")) }
        })
    });
    let svc = Arc::new(Service::start(c).context("start the journal service")?);
    // The next segment's file is prepared in the background at start (and after each roll);
    // the run starts once it is, so that what is measured is the steady state.
    let t0 = Instant::now();
    while !svc.stats().spare_ready {
        if t0.elapsed() > Duration::from_secs(120) {
            bail!("the spare segment was not ready within 120 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let per = rate as f64 / producers as f64;
    let total_each = (per * a.seconds).max(1.0) as u64;
    let payload = vec![0xA5u8; a.record_bytes];
    let threads: Vec<_> = (0..producers)
        .map(|k| {
            let dir = dir.to_path_buf();
            let payload = payload.clone();
            let svc = Arc::clone(&svc);
            std::thread::spawn(move || -> Result<[LatencyRecorder; 2]> {
                let mut tx = JournalProducer::connect(&dir, &format!("bench-{k}"))?;
                produce(&mut tx, &payload, per, total_each, npt, &|| svc.spare_ready())
            })
        })
        .collect();
    let mut run = CaseRun {
        ack: LatencyRecorder::with_max(10_000_000_000)?,
        while_spare: LatencyRecorder::with_max(10_000_000_000)?,
        spare_ready: LatencyRecorder::with_max(10_000_000_000)?,
        records: 0,
        batches: 0,
        rolls: 0,
        segments_removed: 0,
        roll_us: 0,
    };
    for t in threads {
        let [busy, ready] = t.join().map_err(|_| anyhow::anyhow!("producer panicked"))??;
        for (rec, into) in [(busy, &mut run.while_spare), (ready, &mut run.spare_ready)] {
            for v in rec.current().iter_recorded() {
                into.record_n(v.value_iterated_to(), v.count_at_value());
                run.ack.record_n(v.value_iterated_to(), v.count_at_value());
            }
        }
    }
    let svc = Arc::into_inner(svc).context("a producer thread still holds the service")?;
    let stats = svc.stop().context("stop the service")?;
    (run.records, run.batches, run.rolls) = (stats.records, stats.batches, stats.rolls);
    run.roll_us = stats.roll_time.as_micros() as u64;
    run.segments_removed = stats.segments_removed;
    Ok(run)
}

/// Appends `total` records at `per_s`; between appends polls the durable seq and records the
/// ack latency of every record it sees durable: `[while the spare was being written, while
/// it was ready]` as `spare_ready` says when the ack is seen.
fn produce(
    tx: &mut JournalProducer,
    payload: &[u8],
    per_s: f64,
    total: u64,
    npt: f64,
    spare_ready: &dyn Fn() -> bool,
) -> Result<[LatencyRecorder; 2]> {
    let mut rec =
        [LatencyRecorder::with_max(10_000_000_000)?, LatencyRecorder::with_max(10_000_000_000)?];
    let mut stamps = vec![0u64; total as usize + 1];
    let period = Duration::from_secs_f64(1.0 / per_s);
    let start = Instant::now();
    let mut next_ack = 1u64;
    for i in 1..=total {
        let due = start + period.mul_f64(i as f64);
        // Bounded by the schedule: yield (not spin) so that the writer gets the core.
        while Instant::now() < due {
            observe(tx, &stamps, i - 1, &mut next_ack, &mut rec, npt, spare_ready);
            std::thread::yield_now();
        }
        stamps[i as usize] = tsc();
        let s = tx.append_blocking(payload, Duration::from_secs(10))?;
        debug_assert_eq!(s, i);
        observe(tx, &stamps, i, &mut next_ack, &mut rec, npt, spare_ready);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    // Bounded by the deadline.
    while next_ack <= total {
        if Instant::now() > deadline {
            bail!("records not durable within 30 s of the last append");
        }
        observe(tx, &stamps, total, &mut next_ack, &mut rec, npt, spare_ready);
        std::thread::yield_now();
    }
    Ok(rec)
}

/// Records the ack latency of every record up to `upto` that `tx` sees durable, into
/// `rec[1]` if the spare is ready, else `rec[0]`.
fn observe(
    tx: &JournalProducer,
    stamps: &[u64],
    upto: u64,
    next_ack: &mut u64,
    rec: &mut [LatencyRecorder; 2],
    npt: f64,
    spare_ready: &dyn Fn() -> bool,
) {
    let d = tx.durable_seq().min(upto);
    if *next_ack <= d {
        let now = tsc();
        let rec = &mut rec[usize::from(spare_ready())];
        while *next_ack <= d {
            rec.record((now.wrapping_sub(stamps[*next_ack as usize]) as f64 * npt) as u64);
            *next_ack += 1;
        }
    }
}

/// The two floors on one prepared file: `pwrite` + `fdatasync` of a frame's bytes, and an
/// `O_DIRECT` `pwritev2(RWF_DSYNC)` of one 4 KiB block.
struct Floor {
    buffered: std::fs::File,
    direct: std::fs::File,
    frame: Vec<u8>,
    /// 8 KiB, of which the 4 KiB at `block_at` are page-aligned (O_DIRECT's memory).
    block: Vec<u8>,
    block_at: usize,
    /// `SUSTAINED_BLOCKS` 4 KiB blocks, page-aligned (from `wide_at`), for `sustained`.
    wide: Vec<u8>,
    wide_at: usize,
    calls: u64,
}

/// The most blocks one write of [`Floor::sustained`] covers (1 MiB).
const SUSTAINED_BLOCKS: u64 = 256;

/// Bytes of the floor file: room for every call of a run at its own offset.
const FLOOR_BYTES: u64 = 64 << 20;

impl Floor {
    fn create(path: &Path, record_bytes: usize) -> Result<Floor> {
        let _ = std::fs::remove_file(path);
        let f = OpenOptions::new().read(true).write(true).create_new(true).open(path)?;
        let zero = vec![0u8; 1 << 20];
        let mut off = 0;
        while off < FLOOR_BYTES {
            f.write_all_at(&zero, off)?;
            off += zero.len() as u64;
        }
        f.sync_all()?;
        let direct = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
            .with_context(|| format!("open {} with O_DIRECT", path.display()))?;
        let block = vec![0x5Au8; 8192];
        let block_at = block.as_ptr().align_offset(4096);
        let wide = vec![0x5Au8; (SUSTAINED_BLOCKS as usize + 1) * 4096];
        let wide_at = wide.as_ptr().align_offset(4096);
        Ok(Floor {
            buffered: f,
            direct,
            frame: vec![0x5A; frame_len(record_bytes)],
            block,
            block_at,
            wide,
            wide_at,
            calls: 0,
        })
    }

    /// `n` calls of each kind, interleaved.
    fn run(
        &mut self,
        n: u64,
        sync: &mut LatencyRecorder,
        dsync: &mut LatencyRecorder,
        npt: f64,
    ) -> Result<()> {
        for _ in 0..n {
            let off = (self.calls * 4096) % FLOOR_BYTES;
            self.calls += 1;
            let c0 = tsc();
            self.buffered.write_all_at(&self.frame, off)?;
            self.buffered.sync_data()?;
            sync.record((tsc().wrapping_sub(c0) as f64 * npt) as u64);
            let off = (self.calls * 4096) % FLOOR_BYTES;
            self.calls += 1;
            let aligned = &mut self.block[self.block_at..self.block_at + 4096];
            let iov = libc::iovec { iov_base: aligned.as_mut_ptr().cast(), iov_len: 4096 };
            let c0 = tsc();
            // SAFETY: one iovec over the 4 KiB aligned block this struct owns, live across
            // the call; the descriptor is open.
            let rc = unsafe {
                libc::pwritev2(self.direct.as_raw_fd(), &iov, 1, off as i64, libc::RWF_DSYNC)
            };
            if rc != 4096 {
                return Err(std::io::Error::last_os_error()).context("pwritev2(RWF_DSYNC)");
            }
            dsync.record((tsc().wrapping_sub(c0) as f64 * npt) as u64);
        }
        Ok(())
    }

    /// The device under the case's load with no journal: one thread, `rate` records/s on a
    /// schedule, each write an `O_DIRECT` `pwritev2(RWF_DSYNC)` of the blocks that hold every
    /// record due so far and not yet written (frames packed as the journal packs them), one
    /// write in flight. A record's latency runs from its due time to the end of the write
    /// that holds it: the simplest durable log this file system allows, with no ring, no
    /// wake-up and no framing work. Its P99 is the device's own tail at this load.
    fn sustained(
        &mut self,
        rate: u64,
        seconds: f64,
        frame_bytes: usize,
        rec: &mut LatencyRecorder,
        npt: f64,
    ) -> Result<()> {
        let total = ((rate as f64 * seconds) as u64).max(1);
        let period_ticks = 1e9 / rate as f64 / npt;
        let blocks = FLOOR_BYTES / 4096;
        let fb = frame_bytes as u64;
        // The log starts at a block of its own and wraps at the file's end.
        let mut base = (self.calls % blocks) * 4096;
        let start = tsc();
        let deadline = Instant::now() + Duration::from_secs_f64(seconds * 4.0 + 30.0);
        let mut written = 0u64;
        let mut pos = 0u64; // bytes of frames since `base`
        while written < total {
            let due = (((tsc().wrapping_sub(start)) as f64 / period_ticks) as u64).min(total);
            if due <= written {
                if Instant::now() > deadline {
                    bail!("sustained floor: over its deadline");
                }
                std::thread::yield_now();
                continue;
            }
            // Records written..due, cut to what the buffer holds and to the file's end.
            let room = FLOOR_BYTES - base;
            let first_block = pos / 4096;
            let max_end = room.min((first_block + SUSTAINED_BLOCKS) * 4096);
            let n = (due - written).min((max_end - pos) / fb);
            if n == 0 {
                // The file's end: start again at its beginning.
                base = 0;
                pos = 0;
                continue;
            }
            let end = pos + n * fb;
            let (b0, b1) = (first_block, end.div_ceil(4096));
            let len = ((b1 - b0) * 4096) as usize;
            let iov = libc::iovec {
                iov_base: self.wide[self.wide_at..].as_mut_ptr().cast(),
                iov_len: len,
            };
            // SAFETY: one iovec over the first `len` bytes of this struct's aligned buffer
            // (`len` <= SUSTAINED_BLOCKS * 4096, its size), live across the call.
            let rc = unsafe {
                libc::pwritev2(
                    self.direct.as_raw_fd(),
                    &iov,
                    1,
                    (base + b0 * 4096) as i64,
                    libc::RWF_DSYNC,
                )
            };
            if rc != len as isize {
                return Err(std::io::Error::last_os_error()).context("pwritev2(RWF_DSYNC)");
            }
            let done = tsc();
            for i in written + 1..=written + n {
                let due_at = start as f64 + i as f64 * period_ticks;
                rec.record(((done as f64 - due_at).max(0.0) * npt) as u64);
            }
            written += n;
            pos = end;
        }
        self.calls = (base + pos).div_ceil(4096);
        Ok(())
    }
}
