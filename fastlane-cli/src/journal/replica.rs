//! `--replica` and `fastlane journal replica`: the journal's mirror, in a file or over RDMA.

use std::fs::OpenOptions;
use std::io::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use fastlane_journal::rdma::{RdmaReplica, RdmaReplicaServer};
use fastlane_journal::{FileReplica, Replica};
use fastlane_rdma::Device;

use super::{ReplicaArgs, ReplicaOpts};

/// The replica named by `--replica` (None if none), for a journal device of `size` bytes.
pub(super) fn open_replica(
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

pub(super) fn replica_cmd(a: &ReplicaArgs) -> Result<()> {
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
