//! `fastlane journal replica`: the far end of `--replica rdma://...`, which keeps the
//! primary's journal in a file (`--replica` itself is opened by
//! `fastlane_bench::journal::opts::open_replica`).

use std::fs::OpenOptions;
use std::io::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use fastlane_daemon::signals::StopSignals;
use fastlane_journal::rdma::RdmaReplicaServer;
use fastlane_rdma::{Device, PollMode};

use super::ReplicaArgs;

pub(super) fn replica_cmd(a: &ReplicaArgs) -> Result<()> {
    // Before any thread starts: they all inherit the blocked mask.
    let signals = StopSignals::block()?;
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&a.file)
        .with_context(|| format!("open {}", a.file.display()))?;
    let dev = Device::open(&a.device).with_context(|| format!("open {}", a.device))?;
    let poll = if a.poll == "event" { PollMode::Event } else { PollMode::Busy };
    let server = RdmaReplicaServer::bind(&dev, a.listen, f, a.size)?.with_poll(poll);
    let stop = Arc::new(AtomicBool::new(false));
    signals.on_stop_set(&stop)?;
    let addr = server.local_addr()?;
    println!("READY {addr}");
    std::io::stdout().flush()?;
    fastlane_daemon::notify::ready(&format!("journal replica on {addr}"));
    let mut served = 0u64;
    // SIGTERM/SIGINT end the session in progress at its next check (within a second) and the
    // loop; what was stored is in the file (each session ends with the primary's sync).
    while (a.sessions == 0 || served < a.sessions) && !stop.load(Ordering::Relaxed) {
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
    if stop.load(Ordering::Relaxed) {
        fastlane_daemon::notify::stopping("stopped by signal");
        log::info!("journal replica: stopped by signal after {served} sessions");
    }
    Ok(())
}
