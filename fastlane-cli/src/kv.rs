//! `fastlane kv`: the KV-cache swap tier.
//!
//! - `fastlane kv serve --socket PATH`: the swap engine behind the versioned Unix-socket
//!   protocol of `fastlane_kvswap::proto` (docs/kvswap.md), until SIGINT/SIGTERM. Each connection gets
//!   its own slab of the device pool (its own memfd); peers are checked against
//!   `--allow-uid`/`--allow-gid` (default: the server's own uid). Content-addressed ops
//!   (`PUT`/`GET`/`EXISTS`/`PIN`/`UNPIN`/`EVICT`) go to one `PrefixStore` of `--cas-bytes`,
//!   optionally backed by a Redis Cluster (`--kv-cluster`). `--metrics ADDR` serves the
//!   connection, engine and store counters to Prometheus (read at each scrape; docs/kvswap.md).
//!   The flags become a `fastlane_kvswap::daemon::ServeConfig`, which `daemon::serve` runs.
//! - `fastlane kv bench`, `kv bench-cluster`, `kv sim`: benchmarks and the simulator, in the
//!   `fastlane-bench` crate (`kv_tiers`, `kv_cluster`, `kv_sim`).

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, Subcommand};
use fastlane_bench::kv_tiers::ModelArgs;
use fastlane_kvswap::daemon::{self, ServeConfig};
use fastlane_util::parse_size;

/// `fastlane kv`.
#[derive(Debug, Args)]
pub struct KvArgs {
    #[command(subcommand)]
    command: KvCommand,
}

#[derive(Debug, Subcommand)]
enum KvCommand {
    /// Serve the swap engine on a Unix socket (protocol: docs/kvswap.md).
    Serve(Box<ServeArgs>),
    /// Tier bandwidth against memcpy / O_DIRECT, and swap-in latency histograms.
    Bench(fastlane_bench::kv_tiers::BenchArgs),
    /// Simulate the multi-tenant scheduler (docs/scheduler.md): per-tenant TTFT table, .hlog, SVG.
    Sim(fastlane_bench::kv_sim::SimArgs),
    /// Redis Cluster tier batch put/get throughput against redis-benchmark on the same
    /// cluster (a private loopback cluster unless --kv-cluster names one).
    BenchCluster(fastlane_bench::kv_cluster::BenchClusterArgs),
}

#[derive(Debug, Args)]
struct ServeArgs {
    /// Unix socket path (replaced if it exists).
    #[arg(long)]
    socket: PathBuf,
    #[command(flatten)]
    model: ModelArgs,
    /// Device pool size in blocks (host memory standing in for GPU memory).
    #[arg(long, default_value_t = 256)]
    device_blocks: u32,
    /// Host tier size (K/M/G suffixes).
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    host_bytes: u64,
    /// NVMe tier: a file or block device (O_DIRECT).
    #[arg(long)]
    nvme: Option<PathBuf>,
    /// NVMe tier size.
    #[arg(long, default_value = "4G", value_parser = parse_size)]
    nvme_bytes: u64,
    /// Remote tier: address of `fastlane rdma serve`.
    #[arg(long)]
    remote: Option<std::net::SocketAddr>,
    /// RDMA device for the remote tier.
    #[arg(long, default_value = "rxe0")]
    rdma_dev: String,
    /// Remote tier size.
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    remote_bytes: u64,
    /// Spill policy: nvme-first, remote-first, nvme, remote, never.
    #[arg(long, default_value = "nvme-first")]
    spill: String,
    /// Per-block checksum: fast, crc32c, off.
    #[arg(long, default_value = "fast")]
    checksum: String,
    /// Peer uids allowed to connect (SO_PEERCRED), comma separated; default: the server's
    /// own uid only (when neither --allow-uid nor --allow-gid is given).
    #[arg(long, value_delimiter = ',')]
    allow_uid: Vec<u32>,
    /// Peer gids (primary group) allowed to connect, comma separated.
    #[arg(long, value_delimiter = ',')]
    allow_gid: Vec<u32>,
    /// Most device blocks one connection's slab may have (default: the whole pool).
    #[arg(long)]
    conn_blocks_max: Option<u32>,
    /// Slab size for a client whose HELLO asks for 0 blocks (default: a quarter of the pool).
    #[arg(long)]
    conn_blocks_default: Option<u32>,
    /// A namespace peers may share: NAME=UID[:UID...] (repeatable). Every peer also has its
    /// own `uid:<uid>` namespace, the default.
    #[arg(long, value_parser = daemon::parse_namespace)]
    namespace: Vec<(String, Vec<u32>)>,
    /// Host memory of the content-addressed block store (K/M/G suffixes) behind the ops
    /// PUT, GET, EXISTS, PIN, UNPIN and EVICT: one store for all connections, least recently
    /// used blocks evicted first (pinned ones never). Keys are qualified by the connection's
    /// namespace, so connections of one namespace share blocks and others cannot see them.
    /// 0 turns the store off: those ops are then refused with status 22 (store disabled).
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    cas_bytes: u64,
    /// Back the content-addressed store with a Redis Cluster, shared by every `fastlane kv
    /// serve` that names it: redis://HOST:PORT[,HOST:PORT...], any nodes of the cluster, or
    /// rediss://… for TLS. Puts reach it asynchronously; host misses are looked up in it;
    /// every value is verified (key, length, CRC32C). Needs --cas-bytes above 0; refuses to
    /// start when no node answers, the password is refused or TLS fails. No user or password
    /// in the URL (refused: `ps` would show it): they come from FASTLANE_REDIS_PASSWORD (and
    /// FASTLANE_REDIS_USERNAME) or --kv-cluster-password-file.
    #[arg(long, value_name = "redis[s]://HOST:PORT[,HOST:PORT...]")]
    kv_cluster: Option<String>,
    /// File holding the --kv-cluster password (one line), instead of FASTLANE_REDIS_PASSWORD.
    /// Refused when its group or others may read it (chmod 600). The user, if not `default`,
    /// comes from FASTLANE_REDIS_USERNAME.
    #[arg(long, value_name = "PATH")]
    kv_cluster_password_file: Option<PathBuf>,
    /// PEM file of the CA that signed the cluster nodes' certificates, trusted for
    /// --kv-cluster rediss://… instead of the system's roots (which are used without it).
    #[arg(long, value_name = "PATH")]
    kv_cluster_ca: Option<PathBuf>,
    /// NVMe tier of the content-addressed store, between host memory and the cluster: a
    /// file (created 0600, preallocated, O_DIRECT where the filesystem allows) that blocks
    /// evicted from host memory spill to in the background and are read back from, verified
    /// by CRC32C. Its previous contents are ignored.
    #[arg(long, value_name = "PATH")]
    cas_nvme: Option<PathBuf>,
    /// Size of the --cas-nvme file (K/M/G suffixes).
    #[arg(long, default_value = "4G", value_parser = parse_size, requires = "cas_nvme")]
    cas_nvme_bytes: u64,
    /// Serve Prometheus metrics at http://ADDR/metrics (e.g. 127.0.0.1:9100; port 0 picks a
    /// free port, logged as "metrics on http://…/metrics"): connections, requests, device and
    /// tier blocks, bytes swapped, transfers in flight, the content-addressed store's hits,
    /// misses and evictions (docs/kvswap.md lists them). Read from the server's counters at
    /// each scrape, so requests do no extra work. Off by default.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<std::net::SocketAddr>,
}

impl ServeArgs {
    /// The daemon's settings these flags describe.
    fn config(&self) -> Result<ServeConfig> {
        Ok(ServeConfig {
            socket: self.socket.clone(),
            geometry: self.model.geometry()?,
            device_blocks: self.device_blocks,
            host_bytes: self.host_bytes,
            nvme: self.nvme.clone(),
            nvme_bytes: self.nvme_bytes,
            remote: self.remote,
            rdma_dev: self.rdma_dev.clone(),
            remote_bytes: self.remote_bytes,
            spill: daemon::parse_spill_policy(&self.spill)?,
            checksum: fastlane_bench::kv_tiers::checksum_mode(&self.checksum)?,
            allow_uid: self.allow_uid.clone(),
            allow_gid: self.allow_gid.clone(),
            conn_blocks_max: self.conn_blocks_max,
            conn_blocks_default: self.conn_blocks_default,
            namespace: self.namespace.clone(),
            cas_bytes: self.cas_bytes,
            kv_cluster: self.kv_cluster.as_deref().map(daemon::parse_cluster_urls).transpose()?,
            kv_cluster_password_file: self.kv_cluster_password_file.clone(),
            kv_cluster_ca: self.kv_cluster_ca.clone(),
            cas_nvme: self.cas_nvme.clone(),
            cas_nvme_bytes: self.cas_nvme_bytes,
            metrics: self.metrics,
        })
    }
}

/// Runs `fastlane kv`.
pub fn run(args: &KvArgs) -> Result<()> {
    crate::logging::init();
    match &args.command {
        KvCommand::Serve(a) => daemon::serve(&a.config()?),
        KvCommand::Bench(a) => fastlane_bench::kv_tiers::run(a),
        KvCommand::Sim(a) => fastlane_bench::kv_sim::run(a),
        KvCommand::BenchCluster(a) => fastlane_bench::kv_cluster::run(a),
    }
}
