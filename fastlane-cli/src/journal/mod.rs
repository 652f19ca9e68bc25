//! `fastlane journal append|bench|verify|dump|replica`: the record journal from the command
//! line. `--replica rdma://HOST:PORT --device rxe0` mirrors the journal over RDMA to a
//! `fastlane journal replica` process, which keeps the image in a file.
//!
//! This file holds the command line (arguments, `run`, opening the journal's device);
//! `records` appends, verifies and dumps; `replica` opens `--replica` and serves
//! `fastlane journal replica`; `bench` is `fastlane journal bench`, with `framing` (what
//! framing costs) and `report` (its `--json` report).

mod bench;
mod framing;
mod records;
mod replica;
mod report;

use std::fs::OpenOptions;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use fastlane_block::sync::{SyncFileDevice, SyncFileOptions};
use fastlane_block::uring::{UringDevice, UringOptions};
use fastlane_block::BlockDevice;
use fastlane_journal::{
    CardPreprocess, Durability, JournalConfig, Preprocess, SoftPreprocess, WriterIo,
};
use fastlane_ring::WaitStrategy;
use fastlane_util::parse_size;
use fastlane_vhost_blk::spec::IoEngine;

use bench::bench;
use records::{append, dump, verify_cmd};
use replica::{open_replica, replica_cmd};

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
