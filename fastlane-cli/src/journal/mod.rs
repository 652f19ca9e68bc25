//! `fastlane journal append|bench|verify|dump|replica`: the record journal from the command
//! line. `--replica rdma://HOST:PORT --device rxe0` mirrors the journal over RDMA to a
//! `fastlane journal replica` process, which keeps the image in a file.
//!
//! This file holds the command line (arguments, `run`, opening the journal);
//! `records` appends, verifies and dumps; `replica` serves `fastlane journal replica`.
//! `fastlane journal bench` is `fastlane_bench::journal`, which also holds the flags `append`
//! shares with it (`fastlane_bench::journal::opts`: replica, I/O, preprocessing) and what
//! they open.

mod export;
mod records;
mod replica;
mod serve;

use std::fs::OpenOptions;
use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use fastlane_bench::journal::opts::{
    make_preprocess, open_device, open_replica, parse_preprocess, IoOpts, PreprocessKind,
    ReplicaOpts,
};
use fastlane_bench::journal::BenchArgs;
use fastlane_journal::{Durability, JournalConfig};
use fastlane_util::parse_size;

use records::{append, dump, verify_cmd};
use replica::replica_cmd;
use serve::{serve, ServeArgs};

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
    /// The journal service's durable-ack latency with attached producers at steady rates,
    /// against the device's floor (pwrite+fdatasync and an O_DIRECT RWF_DSYNC write).
    BenchService(fastlane_bench::journal::service::ServiceBenchArgs),
    /// The far end of `--replica rdma://...`: store what the primary mirrors into FILE.
    Replica(ReplicaArgs),
    /// The journal service: producers attach to DIR/journal.sock and append through rings of
    /// their own; records merge into one sequence in rolling segment files.
    Serve(ServeArgs),
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
    /// How to wait for the primary's requests: busy (spin on the completion queue: the
    /// lowest latency, one core kept busy) or event (sleep on the completion channel: a
    /// wake-up per request, no core spent; for a replica sharing its cores, as in the
    /// soft-RoCE guest bench).
    #[arg(long, default_value = "busy", value_parser = ["busy", "event"])]
    poll: String,
}

#[derive(Debug, Args)]
struct Common {
    /// The journal file (created with --size if missing); not with --service.
    #[arg(required_unless_present = "service")]
    file: Option<PathBuf>,
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

#[derive(Debug, Args)]
struct AppendArgs {
    #[command(flatten)]
    common: Common,
    /// Attach to the journal service of this directory (`fastlane journal serve --dir`)
    /// instead of opening a journal file; the seqs printed are this producer's own.
    #[arg(long, value_name = "DIR")]
    service: Option<PathBuf>,
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
    /// The journal file, or a segment directory.
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
    /// The journal file, or a segment directory.
    file: PathBuf,
    /// First seq to print.
    #[arg(long, visible_alias = "from-seq", default_value_t = 0)]
    from: u64,
    /// Most records to print.
    #[arg(long, default_value_t = u64::MAX)]
    limit: u64,
    /// Write the records to stdout in binary for export: per record a u64 LE seq, a u32 LE
    /// producer id, a u32 LE payload length, then the payload.
    #[arg(long)]
    raw: bool,
}

/// Runs `fastlane journal`.
pub fn run(args: &JournalArgs) -> Result<()> {
    crate::logging::init();
    match &args.cmd {
        Cmd::Append(a) => append(a),
        Cmd::Verify(a) => verify_cmd(a),
        Cmd::Dump(a) => dump(a),
        Cmd::Bench(a) => fastlane_bench::journal::run(a),
        Cmd::BenchService(a) => fastlane_bench::journal::service::run(a),
        Cmd::Replica(a) => replica_cmd(a),
        Cmd::Serve(a) => serve(a),
    }
}

fn open_config(c: &Common) -> Result<JournalConfig> {
    let Some(file) = &c.file else { anyhow::bail!("append: a journal FILE or --service DIR") };
    open_config_at(c, file)
}

fn open_config_at(c: &Common, file: &std::path::Path) -> Result<JournalConfig> {
    if !file.exists() {
        let f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(file)
            .with_context(|| format!("create {}", file.display()))?;
        f.set_len(c.size)?;
    }
    let dev = open_device(file, c.io.io, c.direct)?;
    let size = std::fs::metadata(file)?.len();
    let mut config = JournalConfig::new(dev, c.durability);
    config.prefill = c.io.prefill;
    config.writer_io = c.io.writer_io;
    config.replica = open_replica(&c.replica, size, false)?;
    config.replica_rebuild = c.replica.rebuild_replica;
    config.preprocess = Some(make_preprocess(c.preprocess)?);
    Ok(config)
}
