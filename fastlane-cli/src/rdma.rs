//! `fastlane rdma`: the remote memory pool server and the RDMA benchmark.
//!
//! * `fastlane rdma serve --device rxe0 --size 1G --listen 127.0.0.1:7470` maps `--size`
//!   bytes and grants ranges of it to `fastlane_rdma::RemotePool` clients until SIGINT/SIGTERM;
//!   `--metrics ADDR` serves the pool's counters to Prometheus (docs/rdma.md).
//! * `fastlane rdma bench --device rxe0 --listen ADDR` (one process) and
//!   `fastlane rdma bench --device rxe0 --connect ADDR` (the other) measure RDMA WRITE
//!   latency and bandwidth: `fastlane_bench::rdma` holds its flags and its `run`.
//!
//! It lives under `fastlane rdma` (not `fastlane bench rdma`) so that the bench module stays
//! another engineer's file; docs/rdma.md says so.

use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use anyhow::Result;
use clap::{Args, Subcommand};
use fastlane_bench::rdma::BenchArgs;
use fastlane_rdma::{Device, PoolServer, PoolStats};
use fastlane_util::parse_size;

use fastlane_daemon::metrics::{counter, gauge, Field};
use fastlane_daemon::signals::StopSignals;

/// Arguments of `fastlane rdma`.
#[derive(Debug, Args)]
pub struct RdmaArgs {
    #[command(subcommand)]
    what: RdmaWhat,
}

#[derive(Debug, Subcommand)]
enum RdmaWhat {
    /// Serve a remote memory pool: clients connect, get ranges granted and WRITE/READ them.
    Serve(ServeArgs),
    /// RDMA WRITE latency (ping-pong, per size) and bandwidth between two processes.
    Bench(BenchArgs),
    /// List the RDMA devices libibverbs sees.
    Devices,
}

/// Arguments of `fastlane rdma serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// RDMA device name.
    #[arg(long, default_value = "rxe0")]
    device: String,
    /// GID index (default: the first IPv4-mapped GID).
    #[arg(long)]
    gid_index: Option<u8>,
    /// Pool size: bytes, or with a K/M/G suffix (powers of 1024).
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    size: u64,
    /// TCP address clients connect to.
    #[arg(long, default_value = "127.0.0.1:7470")]
    listen: SocketAddr,
    /// Serve Prometheus metrics at http://ADDR/metrics (e.g. 127.0.0.1:9100; port 0 picks a
    /// free port, logged as "metrics on http://…/metrics"): clients, pool bytes free, regions
    /// granted (docs/rdma.md lists them). Read from the pool's counters at each scrape.
    /// Off by default.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<SocketAddr>,
}

/// Run `fastlane rdma`.
pub fn run(args: &RdmaArgs) -> Result<()> {
    crate::logging::init();
    match &args.what {
        RdmaWhat::Serve(a) => serve(a),
        RdmaWhat::Bench(a) => fastlane_bench::rdma::run(a),
        RdmaWhat::Devices => {
            for d in fastlane_rdma::device_names() {
                println!("{d}");
            }
            Ok(())
        }
    }
}

fn serve(a: &ServeArgs) -> Result<()> {
    // Before the engine or the pool starts a thread: they all inherit the blocked mask.
    let signals = StopSignals::block()?;
    let stop = Arc::new(AtomicBool::new(false));
    let dev = Device::open_with_gid(&a.device, a.gid_index)?;
    let pool = PoolServer::bind(&dev, a.listen, a.size)?;
    let exporter = fastlane_daemon::metrics::start_if(a.metrics, |f| {
        let fields = f.fields(POOL_FIELDS);
        let monitor = pool.monitor();
        move || fields.update(&monitor.stats())
    })?;
    signals.on_stop_set(&stop)?;
    log::info!(
        "fastlane rdma serve: {} bytes on {} (GID index {}, MTU {}), listening on {}",
        pool.size(),
        dev.name(),
        dev.gid_index(),
        dev.active_mtu_bytes(),
        pool.local_addr()?
    );
    fastlane_daemon::notify::ready(&format!("rdma serve on {}", pool.local_addr()?));
    let served = pool.serve(&stop);
    fastlane_daemon::notify::stopping("stopped serving");
    served?;
    drop(exporter);
    log::info!("fastlane rdma serve: stopped");
    Ok(())
}

/// The pool's counters (`PoolStats`) as metrics: one line per field.
static POOL_FIELDS: &[Field<PoolStats>] = &[
    gauge("fastlane_rdma_pool_bytes", "Bytes mapped for the pool (--size)", |s| s.size_bytes),
    gauge("fastlane_rdma_pool_free_bytes", "Pool bytes not granted", |s| s.free_bytes),
    gauge("fastlane_rdma_pool_clients", "Clients connected now", |s| s.clients),
    counter("fastlane_rdma_pool_clients_total", "Clients whose connection was set up", |s| {
        s.clients_total
    }),
    counter(
        "fastlane_rdma_pool_setup_failures_total",
        "Connections whose setup (queue pair exchange) failed",
        |s| s.setup_failures,
    ),
    gauge("fastlane_rdma_pool_grants", "Regions granted to clients and held now", |s| s.grants),
    counter("fastlane_rdma_pool_grants_total", "Regions granted since start", |s| s.grants_total),
    counter(
        "fastlane_rdma_pool_grants_refused_total",
        "Grant requests refused (pool full, bad length, too many grants for one client)",
        |s| s.grants_refused,
    ),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_metrics_show_every_field() {
        let f = fastlane_daemon::metrics::Families::new();
        let fields = f.fields(POOL_FIELDS);
        let s = PoolStats {
            size_bytes: 1 << 30,
            free_bytes: (1 << 30) - 8192,
            clients: 2,
            clients_total: 3,
            setup_failures: 1,
            grants: 2,
            grants_total: 5,
            grants_refused: 4,
        };
        fields.update(&s);
        let text = f.render();
        for line in [
            "fastlane_rdma_pool_bytes 1073741824",
            "fastlane_rdma_pool_free_bytes 1073733632",
            "fastlane_rdma_pool_clients 2",
            "fastlane_rdma_pool_clients_total 3",
            "fastlane_rdma_pool_setup_failures_total 1",
            "fastlane_rdma_pool_grants 2",
            "fastlane_rdma_pool_grants_total 5",
            "fastlane_rdma_pool_grants_refused_total 4",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
        }
        // A client leaves: the gauges fall, the counters stay.
        fields.update(&PoolStats { clients: 1, grants: 0, free_bytes: 1 << 30, ..s });
        let text = f.render();
        assert!(text.lines().any(|l| l == "fastlane_rdma_pool_clients 1"), "{text}");
        assert!(text.lines().any(|l| l == "fastlane_rdma_pool_grants 0"), "{text}");
        assert!(text.lines().any(|l| l == "fastlane_rdma_pool_grants_total 5"), "{text}");
    }
}
