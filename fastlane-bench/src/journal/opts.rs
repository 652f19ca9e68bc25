//! The journal flags that `fastlane journal bench` shares with `fastlane journal append`
//! (where the replica lives, how the file is driven, who frames the records) and what they
//! open: the journal's block device, its replica, its preprocessor.

use std::fs::OpenOptions;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use fastlane_block::sync::{SyncFileDevice, SyncFileOptions};
use fastlane_block::uring::{UringDevice, UringOptions};
use fastlane_block::BlockDevice;
use fastlane_journal::rdma::RdmaReplica;
use fastlane_journal::{
    CardPreprocess, FileReplica, Preprocess, Replica, SoftPreprocess, WriterIo,
};
use fastlane_rdma::Device;
use fastlane_vhost_blk::spec::IoEngine;

/// Where the replica of a journal lives.
#[derive(Debug, Clone, Args)]
pub struct ReplicaOpts {
    /// A second file to mirror every write into, or rdma://HOST:PORT of a
    /// `fastlane journal replica` (the replica of `replicated`).
    #[arg(long)]
    pub replica: Option<String>,
    /// RDMA device for an rdma:// replica.
    #[arg(long, default_value = "rxe0")]
    pub device: String,
    /// How an rdma:// replica's sync is confirmed: ack (the replica process fdatasyncs its
    /// file, then answers) or read (an RDMA READ behind the writes: in its memory).
    #[arg(long, default_value = "ack")]
    pub replica_sync: String,
    /// Bound on every RDMA wait, milliseconds (a dead replica is reported within it).
    #[arg(long, default_value_t = 5000)]
    pub replica_timeout_ms: u64,
    /// How the writer waits for an rdma:// replica's completions: busy (spin: the lowest
    /// latency, the writer's core kept busy while it waits) or event (sleep on the completion
    /// channel: a wake-up each; better where the writer shares its cores, as in the
    /// soft-RoCE guest bench).
    #[arg(long, default_value = "busy", value_parser = ["busy", "event"])]
    pub replica_poll: String,
    /// Rewrite the replica from this journal even if it holds another journal or a chain
    /// that diverged (otherwise refused).
    #[arg(long)]
    pub rebuild_replica: bool,
}

/// How the journal's file is prepared and driven.
#[derive(Debug, Clone, Args)]
pub struct IoOpts {
    /// I/O engine of the journal file: uring (io_uring; its fdatasync runs on an io-wq
    /// kernel worker) or sync (pwritev on the writer's thread, fdatasync on the flusher's).
    /// --direct needs uring.
    #[arg(long, default_value = "uring")]
    pub io: IoEngine,
    /// How the writer drives the device: pipelined (one queue, a write and two flushes in
    /// flight together) or flusher (the writer writes; two flusher threads flush and
    /// acknowledge; `local` only, others run pipelined).
    #[arg(long, default_value = "pipelined", value_parser = parse_writer_io)]
    pub writer_io: WriterIo,
    /// A new journal file is filled with written zeroes (true) instead of
    /// fallocate(ZERO_RANGE), which leaves unwritten extents that every fdatasync converts
    /// (bench: the baseline file is prepared the same way).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub prefill: bool,
}

/// `--preprocess direct|card`: who timestamps and checksums the frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreprocessKind {
    /// fastlane-fpga's functions on the writer's core ([`SoftPreprocess`]).
    Direct,
    /// The software card's descriptor rings ([`CardPreprocess::soft`]).
    Card,
}

/// Parses `--preprocess`.
pub fn parse_preprocess(s: &str) -> Result<PreprocessKind, String> {
    match s {
        "direct" => Ok(PreprocessKind::Direct),
        "card" => Ok(PreprocessKind::Card),
        other => Err(format!("{other}: want direct or card")),
    }
}

/// The preprocessor `--preprocess` names (the card's is started here).
pub fn make_preprocess(kind: PreprocessKind) -> Result<Box<dyn Preprocess>> {
    Ok(match kind {
        PreprocessKind::Direct => Box::new(SoftPreprocess::default()),
        PreprocessKind::Card => {
            Box::new(CardPreprocess::soft().context("start the software card")?)
        }
    })
}

/// `--writer-io`'s name for `w`.
pub fn writer_io_name(w: WriterIo) -> &'static str {
    match w {
        WriterIo::Flusher => "flusher",
        WriterIo::Dsync => "dsync",
        _ => "pipelined",
    }
}

/// Parses `--writer-io`.
pub fn parse_writer_io(s: &str) -> Result<WriterIo, String> {
    match s {
        "pipelined" => Ok(WriterIo::Pipelined),
        "flusher" => Ok(WriterIo::Flusher),
        "dsync" => Ok(WriterIo::Dsync),
        other => Err(format!("{other}: want pipelined, flusher or dsync")),
    }
}

/// The journal file's block device, with the engine `--io` names (`--direct` implies uring).
pub fn open_device(
    path: &std::path::Path,
    io: IoEngine,
    direct: bool,
) -> Result<Arc<dyn BlockDevice>> {
    Ok(match io {
        IoEngine::Sync if !direct => {
            Arc::new(SyncFileDevice::open(path, SyncFileOptions::default())?)
        }
        IoEngine::Sync | IoEngine::Uring | IoEngine::Auto => {
            Arc::new(UringDevice::open(path, UringOptions { direct, ..UringOptions::default() })?)
        }
    })
}

/// The replica named by `--replica` (None if none), for a journal device of `size` bytes; a
/// file replica is cut to `size` when `truncate`.
pub fn open_replica(
    o: &ReplicaOpts,
    size: u64,
    truncate: bool,
) -> Result<Option<Box<dyn Replica>>> {
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
        let poll = match o.replica_poll.as_str() {
            "event" => fastlane_rdma::PollMode::Event,
            _ => fastlane_rdma::PollMode::Busy,
        };
        let rep = RdmaReplica::connect(&dev, addr, size, mode, timeout, poll)
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
