//! `fastlane journal replica`: the far end of `--replica rdma://...`, which keeps the
//! primary's journal in a file (`--replica` itself is opened by
//! `fastlane_bench::journal::opts::open_replica`).

use std::fs::OpenOptions;
use std::io::Write as _;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use anyhow::{Context, Result};
use fastlane_journal::rdma::RdmaReplicaServer;
use fastlane_rdma::Device;

use super::ReplicaArgs;

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
