//! `fastlane journal append|bench|verify|dump|replica`: the record journal from the command
//! line. `--replica rdma://HOST:PORT --device rxe0` mirrors the journal over RDMA to a
//! `fastlane journal replica` process, which keeps the image in a file.

use std::fs::OpenOptions;
use std::io::{BufRead, Write};
use std::net::SocketAddr;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use fastlane_block::sync::{SyncFileDevice, SyncFileOptions};
use fastlane_block::uring::{UringDevice, UringOptions};
use fastlane_block::BlockDevice;
use fastlane_hist::{HlogWriter, LatencyRecorder};
use fastlane_journal::format::{chain_next, encode_frame, frame_len};
use fastlane_journal::rdma::{RdmaReplica, RdmaReplicaServer};
use fastlane_journal::verify::hex;
use fastlane_journal::{
    scan, verify, Anchor, CardPreprocess, Durability, FileReplica, FrameSlot, Journal,
    JournalConfig, JournalError, Preprocess, Replica, SoftPreprocess, WriterIo,
};
use fastlane_rdma::Device;
use fastlane_ring::WaitStrategy;
use fastlane_util::parse_size;
use fastlane_util::tsc::{ns_per_tick, read_tsc as tsc};
use fastlane_vhost_blk::spec::IoEngine;
use serde::Serialize;

/// `fastlane journal`.
#[derive(Debug, Args)]
pub struct JournalArgs {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Append records (arguments, or one per stdin line) and wait until they are durable.
    Append(AppendArgs),
    /// Walk the hash chain; name the first record changed, removed or reordered.
    Verify(VerifyArgs),
    /// Print the records.
    Dump(DumpArgs),
    /// Append hot path, durable-ack latency against pwrite+fdatasync, and throughput.
    Bench(BenchArgs),
    /// The far end of `--replica rdma://...`: store what the primary mirrors into FILE.
    Replica(ReplicaArgs),
}

/// Where the replica of a journal lives.
#[derive(Debug, Clone, Args)]
struct ReplicaOpts {
    /// A second file to mirror every write into, or rdma://HOST:PORT of a
    /// `fastlane journal replica` (the replica of `replicated`).
    #[arg(long)]
    replica: Option<String>,
    /// RDMA device for an rdma:// replica.
    #[arg(long, default_value = "rxe0")]
    device: String,
    /// How an rdma:// replica's sync is confirmed: ack (the replica process fdatasyncs its
    /// file, then answers) or read (an RDMA READ behind the writes: in its memory).
    #[arg(long, default_value = "ack")]
    replica_sync: String,
    /// Bound on every RDMA wait, milliseconds (a dead replica is reported within it).
    #[arg(long, default_value_t = 5000)]
    replica_timeout_ms: u64,
    /// Rewrite the replica from this journal even if it holds another journal or a chain
    /// that diverged (otherwise refused).
    #[arg(long)]
    rebuild_replica: bool,
}

#[derive(Debug, Args)]
struct ReplicaArgs {
    /// Listen here for the primary.
    #[arg(long)]
    listen: SocketAddr,
    /// RDMA device.
    #[arg(long, default_value = "rxe0")]
    device: String,
    /// The replica's copy of the journal (created or resized to --size).
    #[arg(long)]
    file: PathBuf,
    /// Size of the primary's journal device.
    #[arg(long, default_value = "64M", value_parser = parse_size)]
    size: u64,
    /// Serve this many primaries, one after the other, then exit (0: forever).
    #[arg(long, default_value_t = 0)]
    sessions: u64,
}

#[derive(Debug, Args)]
struct Common {
    /// The journal file (created with --size if missing).
    file: PathBuf,
    /// Size of a new journal file.
    #[arg(long, default_value = "64M", value_parser = parse_size)]
    size: u64,
    /// memory, local or replicated.
    #[arg(long, default_value = "local")]
    durability: Durability,
    #[command(flatten)]
    replica: ReplicaOpts,
    /// Open the file with O_DIRECT.
    #[arg(long)]
    direct: bool,
    #[command(flatten)]
    io: IoOpts,
    /// Who timestamps and checksums the frames: direct (fastlane-fpga's functions on the
    /// writer's core) or card (the software card's descriptor rings).
    #[arg(long, default_value = "direct", value_parser = parse_preprocess)]
    preprocess: PreprocessKind,
}

/// `--preprocess direct|card`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PreprocessKind {
    Direct,
    Card,
}

fn parse_preprocess(s: &str) -> Result<PreprocessKind, String> {
    match s {
        "direct" => Ok(PreprocessKind::Direct),
        "card" => Ok(PreprocessKind::Card),
        other => Err(format!("{other}: want direct or card")),
    }
}

fn make_preprocess(kind: PreprocessKind) -> Result<Box<dyn Preprocess>> {
    Ok(match kind {
        PreprocessKind::Direct => Box::new(SoftPreprocess::default()),
        PreprocessKind::Card => {
            Box::new(CardPreprocess::soft().context("start the software card")?)
        }
    })
}

#[derive(Debug, Args)]
struct AppendArgs {
    #[command(flatten)]
    common: Common,
    /// Records to append; none: read one record per line from stdin.
    records: Vec<String>,
    /// Append this many generated records ("record SEQ" padded to --record-bytes) instead.
    #[arg(long)]
    generate: Option<u64>,
    /// Payload bytes of a generated record.
    #[arg(long, default_value_t = 64)]
    record_bytes: usize,
    /// With --generate: wait until every N-th record is durable and print "ACK SEQ".
    #[arg(long)]
    ack_every: Option<u64>,
}

#[derive(Debug, Args)]
struct VerifyArgs {
    /// The journal file.
    file: PathBuf,
    /// Fail unless the journal ends at this seq (an anchor kept elsewhere).
    #[arg(long)]
    expect_last_seq: Option<u64>,
    /// Fail unless the chain ends with this head (32 hex digits, from an earlier verify).
    #[arg(long)]
    expect_head: Option<String>,
}

#[derive(Debug, Args)]
struct DumpArgs {
    /// The journal file.
    file: PathBuf,
    /// First seq to print.
    #[arg(long, default_value_t = 0)]
    from: u64,
    /// Most records to print.
    #[arg(long, default_value_t = u64::MAX)]
    limit: u64,
}

#[derive(Debug, Args)]
struct BenchArgs {
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

/// How the journal's file is prepared and driven.
#[derive(Debug, Clone, Args)]
struct IoOpts {
    /// I/O engine of the journal file: uring (io_uring; its fdatasync runs on an io-wq
    /// kernel worker) or sync (pwritev on the writer's thread, fdatasync on the flusher's).
    /// --direct needs uring.
    #[arg(long, default_value = "uring")]
    io: IoEngine,
    /// How the writer drives the device: pipelined (one queue, a write and two flushes in
    /// flight together) or flusher (the writer writes; two flusher threads flush and
    /// acknowledge; `local` only, others run pipelined).
    #[arg(long, default_value = "pipelined", value_parser = parse_writer_io)]
    writer_io: WriterIo,
    /// A new journal file is filled with written zeroes (true) instead of
    /// fallocate(ZERO_RANGE), which leaves unwritten extents that every fdatasync converts
    /// (bench: the baseline file is prepared the same way).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    prefill: bool,
}

fn writer_io_name(w: WriterIo) -> &'static str {
    match w {
        WriterIo::Flusher => "flusher",
        _ => "pipelined",
    }
}

fn parse_writer_io(s: &str) -> Result<WriterIo, String> {
    match s {
        "pipelined" => Ok(WriterIo::Pipelined),
        "flusher" => Ok(WriterIo::Flusher),
        other => Err(format!("{other}: want pipelined or flusher")),
    }
}

/// The journal file's block device, with the engine `--io` names (`--direct` implies uring).
fn open_device(path: &std::path::Path, io: IoEngine, direct: bool) -> Result<Arc<dyn BlockDevice>> {
    Ok(match io {
        IoEngine::Sync if !direct => {
            Arc::new(SyncFileDevice::open(path, SyncFileOptions::default())?)
        }
        IoEngine::Sync | IoEngine::Uring | IoEngine::Auto => {
            Arc::new(UringDevice::open(path, UringOptions { direct, ..UringOptions::default() })?)
        }
    })
}

/// Runs `fastlane journal`.
pub fn run(args: &JournalArgs) -> Result<()> {
    crate::logging::init();
    match &args.cmd {
        Cmd::Append(a) => append(a),
        Cmd::Verify(a) => verify_cmd(a),
        Cmd::Dump(a) => dump(a),
        Cmd::Bench(a) => bench(a),
        Cmd::Replica(a) => replica_cmd(a),
    }
}

fn open_config(c: &Common) -> Result<JournalConfig> {
    if !c.file.exists() {
        let f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&c.file)
            .with_context(|| format!("create {}", c.file.display()))?;
        f.set_len(c.size)?;
    }
    let dev = open_device(&c.file, c.io.io, c.direct)?;
    let size = std::fs::metadata(&c.file)?.len();
    let mut config = JournalConfig::new(dev, c.durability);
    config.prefill = c.io.prefill;
    config.writer_io = c.io.writer_io;
    config.replica = open_replica(&c.replica, size, false)?;
    config.replica_rebuild = c.replica.rebuild_replica;
    config.preprocess = Some(make_preprocess(c.preprocess)?);
    Ok(config)
}

/// The replica named by `--replica` (None if none), for a journal device of `size` bytes.
fn open_replica(o: &ReplicaOpts, size: u64, truncate: bool) -> Result<Option<Box<dyn Replica>>> {
    let Some(r) = &o.replica else { return Ok(None) };
    if let Some(addr) = r.strip_prefix("rdma://") {
        let addr: SocketAddr =
            addr.parse().with_context(|| format!("--replica {r}: want rdma://IP:PORT"))?;
        let mode = match o.replica_sync.as_str() {
            "ack" => fastlane_rdma::Durability::ReplicaAck,
            "read" => fastlane_rdma::Durability::ReadAfterWrite,
            other => bail!("--replica-sync {other}: want ack or read"),
        };
        let dev = Device::open(&o.device).with_context(|| format!("open {}", o.device))?;
        let timeout = Duration::from_millis(o.replica_timeout_ms);
        let rep = RdmaReplica::connect(&dev, addr, size, mode, timeout)
            .with_context(|| format!("connect to the replica at {addr}"))?;
        return Ok(Some(Box::new(rep)));
    }
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(truncate)
        .open(r)
        .with_context(|| format!("open replica {r}"))?;
    if truncate {
        f.set_len(size)?;
    }
    Ok(Some(Box::new(FileReplica::new(f))))
}

fn replica_cmd(a: &ReplicaArgs) -> Result<()> {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&a.file)
        .with_context(|| format!("open {}", a.file.display()))?;
    let dev = Device::open(&a.device).with_context(|| format!("open {}", a.device))?;
    let server = RdmaReplicaServer::bind(&dev, a.listen, f, a.size)?;
    println!("READY {}", server.local_addr()?);
    std::io::stdout().flush()?;
    let stop = AtomicBool::new(false);
    let mut served = 0u64;
    while a.sessions == 0 || served < a.sessions {
        match server.serve_one(Duration::from_secs(1), &stop)? {
            Some(r) => {
                served += 1;
                println!(
                    "SESSION {served} syncs {} positions {} bytes {}",
                    r.syncs, r.positions, r.bytes_stored
                );
                std::io::stdout().flush()?;
            }
            None => continue,
        }
    }
    Ok(())
}

fn append(a: &AppendArgs) -> Result<()> {
    let j = Journal::open_or_create(open_config(&a.common)?)?;
    if let Some(r) = j.recovery().replica {
        eprintln!("replica resync: {:?}, {} bytes sent", r.action, r.bytes_sent);
    }
    if let Some(n) = a.generate {
        return append_generated(j, n, a.record_bytes, a.ack_every);
    }
    let mut tx = j.producer()?;
    let mut last = 0;
    let mut push = |rec: &[u8]| -> Result<()> {
        last = tx.append_blocking(rec, Duration::from_secs(10))?;
        println!("{last}");
        Ok(())
    };
    if a.records.is_empty() {
        for line in std::io::stdin().lock().lines() {
            push(line?.as_bytes())?;
        }
    } else {
        for r in &a.records {
            push(r.as_bytes())?;
        }
    }
    if last > 0 {
        tx.wait_durable(last, Duration::from_secs(30))?;
    }
    drop(tx);
    j.close()?;
    Ok(())
}

/// `append --generate N`: payload "record SEQ" padded with '.' to `record_bytes`; with
/// `ack_every`, waits for every N-th seq (and the last) to be durable and prints "ACK SEQ".
/// A writer failure (a dead replica) ends it with the writer's error, after the last ACK.
fn append_generated(j: Journal, n: u64, record_bytes: usize, ack_every: Option<u64>) -> Result<()> {
    let mut tx = j.producer()?;
    let mut payload = vec![b'.'; record_bytes.max(1)];
    let out = std::io::stdout();
    let mut last = 0;
    let run = (|| -> Result<(), JournalError> {
        for i in 1..=n {
            let seq = tx.next_seq();
            let text = format!("record {seq}");
            let k = text.len().min(payload.len());
            payload.fill(b'.');
            payload[..k].copy_from_slice(&text.as_bytes()[..k]);
            last = tx.append_blocking(&payload, Duration::from_secs(10))?;
            if ack_every.is_some_and(|e| i % e.max(1) == 0 || i == n) {
                tx.wait_durable(last, Duration::from_secs(30))?;
                let mut o = out.lock();
                let _ = writeln!(o, "ACK {last}");
                let _ = o.flush();
            }
        }
        if last > 0 {
            tx.wait_durable(last, Duration::from_secs(30))?;
        }
        Ok(())
    })();
    drop(tx);
    let closed = j.close();
    match (run, closed) {
        (Ok(()), Ok(_)) => {
            println!("DONE {last}");
            Ok(())
        }
        (_, Err(e)) => Err(anyhow::Error::new(e).context("journal writer failed")),
        (Err(e), Ok(_)) => Err(e.into()),
    }
}

fn verify_cmd(a: &VerifyArgs) -> Result<()> {
    let mut f =
        std::fs::File::open(&a.file).with_context(|| format!("open {}", a.file.display()))?;
    let head = match &a.expect_head {
        Some(h) => Some(parse_head(h)?),
        None => None,
    };
    let anchor = Anchor { last_seq: a.expect_last_seq, head };
    let r = verify(&mut f, anchor)?;
    println!(
        "records {}  last seq {}  head {}  end {}",
        r.records,
        r.last_seq,
        hex(&r.head),
        r.end
    );
    match r.problem {
        None => {
            println!("OK");
            Ok(())
        }
        Some(p) => bail!("{p}"),
    }
}

fn parse_head(h: &str) -> Result<[u8; 16]> {
    let h = h.trim();
    if h.len() != 32 || !h.is_ascii() {
        bail!("--expect-head wants 32 hex digits");
    }
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&h[2 * i..2 * i + 2], 16).context("--expect-head: not hex")?;
    }
    Ok(out)
}

fn dump(a: &DumpArgs) -> Result<()> {
    let mut f =
        std::fs::File::open(&a.file).with_context(|| format!("open {}", a.file.display()))?;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut printed = 0u64;
    let mut err = None;
    let s = scan(&mut f, &mut |v| {
        if v.header.seq < a.from {
            return true;
        }
        if printed >= a.limit {
            return false;
        }
        printed += 1;
        let text: String = v
            .payload
            .iter()
            .take(64)
            .map(|&b| if b.is_ascii_graphic() || b == b' ' { b as char } else { '.' })
            .collect();
        let r = writeln!(
            out,
            "{:>10} @{:<10} len {:<5} ts {} chain {} {:?}",
            v.header.seq,
            v.offset,
            v.header.len,
            v.header.timestamp_ns,
            hex(&v.header.chain),
            text
        );
        if let Err(e) = r {
            err = Some(e);
            return false;
        }
        true
    })?;
    if let Some(e) = err {
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            return Err(e.into());
        }
    }
    eprintln!("{} records, last seq {}, stopped: {:?}", s.records, s.last_seq, s.stop);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// bench

fn pin(core: Option<usize>) {
    if let Some(id) = core {
        let _ = core_affinity::set_for_current(core_affinity::CoreId { id });
    }
}

/// Lets the calling thread run on every CPU again (a thread inherits its creator's mask).
fn unpin() {
    // SAFETY: `cpu_set_t` is a plain bit array; all zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for cpu in 0..libc::CPU_SETSIZE as usize {
        // SAFETY: `cpu < CPU_SETSIZE`, so the bit lies inside `set`.
        unsafe { libc::CPU_SET(cpu, &mut set) };
    }
    // Best effort: CPUs that do not exist are ignored by the kernel.
    // SAFETY: sched_setaffinity reads `size_of::<cpu_set_t>()` bytes of `set`, which lives on
    // our stack across the call, and touches nothing else.
    unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
}

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

#[derive(Serialize)]
struct Pcts {
    #[serde(rename = "p50_ns")]
    p50: u64,
    #[serde(rename = "p99_ns")]
    p99: u64,
    #[serde(rename = "p999_ns")]
    p999: u64,
    #[serde(rename = "max_ns")]
    max: u64,
    #[serde(rename = "count")]
    n: u64,
}

/// `fastlane journal bench --json`: what the table prints.
#[derive(Serialize)]
struct BenchReport<'a> {
    record_bytes: usize,
    durability: String,
    io: String,
    writer_io: &'static str,
    prefill: bool,
    ack_wait: &'static str,
    preprocess: &'static str,
    rate_per_s: u64,
    seconds: f64,
    append: &'a Pcts,
    ack: &'a Pcts,
    pwrite_fdatasync: &'a Pcts,
    same_load_no_journal: &'a Pcts,
    ack_over_floor_p50: f64,
    ack_over_floor_p99: f64,
    ack_over_no_journal_p50: f64,
    ack_over_no_journal_p99: f64,
    ack_run_batches: u64,
    ack_run_flushes: u64,
    no_journal_drain_s: f64,
    throughput_records_per_s: f64,
    throughput_records: u64,
    throughput_s: f64,
    throughput_batches: u64,
    throughput_full_retries: u64,
    framing_ns_per_record: f64,
    framing_chain_ns: f64,
    framing_crc32c_ns: f64,
    framing_timestamp_ns: f64,
    framing_batch_hash_ns: f64,
    framing_direct_ns_per_record: f64,
    framing_card_ns_per_record: f64,
    hlog: String,
}

fn pcts(r: &LatencyRecorder) -> Pcts {
    let h = r.current();
    Pcts {
        p50: h.value_at_quantile(0.5),
        p99: h.value_at_quantile(0.99),
        p999: h.value_at_quantile(0.999),
        max: h.max(),
        n: h.len(),
    }
}

/// What framing costs the writer per record, measured alone on this thread (ns/record):
/// the whole frame, then its parts, then BLAKE3 over a 1024-record batch as one input (what
/// a per-batch chain would cost).
struct FramingCost {
    frame: f64,
    chain: f64,
    crc: f64,
    timestamp: f64,
    batch_hash: f64,
}

fn framing_cost(record_bytes: usize) -> FramingCost {
    const N: usize = 1024;
    const ROUNDS: usize = 200;
    let fl = frame_len(record_bytes);
    let mut buf = vec![0xA5u8; fl * N];
    let key = [7u8; 32];
    let mut prev = [0u8; 16];
    let pre = SoftPreprocess::default();
    let per = |t: Instant| t.elapsed().as_nanos() as f64 / (N * ROUNDS) as f64;
    let t = Instant::now();
    for r in 0..ROUNDS {
        for i in 0..N {
            let seq = (r * N + i) as u64 + 1;
            let ts = pre.timestamp_ns();
            prev = encode_frame(
                &mut buf[i * fl..],
                &key,
                &prev,
                seq,
                ts,
                record_bytes,
                &mut |c, d| pre.crc32c_append(c, d),
            );
        }
    }
    let frame = per(t);
    let payload = vec![0x5Au8; record_bytes];
    let t = Instant::now();
    for i in 0..N * ROUNDS {
        prev = chain_next(&key, &prev, i as u64, record_bytes as u32, 0, 0, &payload);
    }
    let chain = per(t);
    let t = Instant::now();
    let mut crc = 0u32;
    for i in 0..N * ROUNDS {
        crc = pre.crc32c_append(crc, &buf[(i % N) * fl..(i % N) * fl + fl]);
    }
    let crc_ns = per(t);
    let t = Instant::now();
    let mut acc = 0u64;
    for _ in 0..N * ROUNDS {
        acc = acc.wrapping_add(pre.timestamp_ns());
    }
    let timestamp = per(t);
    let t = Instant::now();
    for r in 0..ROUNDS {
        prev = chain_next(&key, &prev, r as u64, buf.len() as u32, 0, 0, &buf);
    }
    let batch_hash = per(t);
    std::hint::black_box((prev, crc, acc));
    FramingCost { frame, chain, crc: crc_ns, timestamp, batch_hash }
}

/// ns/record of framing 1024-record batches through `pre`'s stage/finish seam (what the
/// writer calls), measured alone on this thread.
fn framing_via(pre: &mut dyn Preprocess, record_bytes: usize) -> Result<f64> {
    const N: usize = 1024;
    const ROUNDS: usize = 100;
    let fl = frame_len(record_bytes);
    let mut buf = vec![0xA5u8; fl * N];
    let key = [7u8; 32];
    let mut head = [0u8; 16];
    let t = Instant::now();
    for r in 0..ROUNDS {
        for i in 0..N {
            let seq = (r * N + i) as u64 + 1;
            let slot = FrameSlot { pos: i * fl, seq, len: record_bytes as u32 };
            pre.stage(&mut buf, slot, &key, &mut head);
        }
        pre.finish(&mut buf, &key, &mut head)?;
    }
    std::hint::black_box(head);
    Ok(t.elapsed().as_nanos() as f64 / (N * ROUNDS) as f64)
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

fn bench(a: &BenchArgs) -> Result<()> {
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
