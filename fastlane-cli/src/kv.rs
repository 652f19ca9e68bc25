//! `fastlane kv`: the KV-cache swap tier.
//!
//! - `fastlane kv serve --socket PATH`: the swap engine behind the versioned Unix-socket
//!   protocol of `fastlane_kvswap::proto` (docs/kvswap.md), until SIGINT/SIGTERM. Each connection gets
//!   its own slab of the device pool (its own memfd); peers are checked against
//!   `--allow-uid`/`--allow-gid` (default: the server's own uid). Content-addressed ops
//!   (`PUT`/`GET`/`EXISTS`/`PIN`/`UNPIN`/`EVICT`) go to one `PrefixStore` of `--cas-bytes`,
//!   optionally backed by a Redis Cluster (`--kv-cluster`). `--metrics ADDR` serves the
//!   connection, engine and store counters to Prometheus (read at each scrape; docs/kvswap.md).
//! - `fastlane kv bench`, `kv bench-cluster`, `kv sim`: benchmarks and the simulator, in the
//!   `fastlane-bench` crate (`kv_tiers`, `kv_cluster`, `kv_sim`).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use fastlane_bench::kv_tiers::ModelArgs;
use fastlane_kvswap::server::{Server, ServerConfig, ServerCounters};
use fastlane_kvswap::{
    EngineConfig, NvmeTierConfig, PrefixStats, PrefixStore, PrefixStoreConfig, RemoteTierConfig,
    SlabDeviceMemory, SpillPolicy, SwapEngine,
};
use fastlane_util::parse_size;

use fastlane_daemon::metrics::{counter, gauge, set_gauge, set_total, Families, Field, FieldSet};
use fastlane_daemon::signals::StopSignals;

/// `fastlane kv`.
#[derive(Debug, Args)]
pub struct KvArgs {
    #[command(subcommand)]
    command: KvCommand,
}

#[derive(Debug, Subcommand)]
enum KvCommand {
    /// Serve the swap engine on a Unix socket (protocol: docs/kvswap.md).
    Serve(ServeArgs),
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
    #[arg(long, value_parser = parse_namespace)]
    namespace: Vec<(String, Vec<u32>)>,
    /// Host memory of the content-addressed block store (K/M/G suffixes) behind the ops
    /// PUT, GET, EXISTS, PIN, UNPIN and EVICT: one store for all connections, least recently
    /// used blocks evicted first (pinned ones never). Keys are qualified by the connection's
    /// namespace, so connections of one namespace share blocks and others cannot see them.
    /// 0 turns the store off: those ops are then refused with status 22 (store disabled).
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    cas_bytes: u64,
    /// Back the content-addressed store with a Redis Cluster, shared by every `fastlane kv
    /// serve` that names it: redis://HOST:PORT[,HOST:PORT...], any nodes of the cluster. Puts reach it asynchronously; host misses are looked up in it; every
    /// value is verified (key, length, CRC32C). Needs --cas-bytes above 0; refuses to start
    /// when no node answers.
    #[arg(long, value_name = "redis://HOST:PORT[,HOST:PORT...]")]
    kv_cluster: Option<String>,
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

/// Redis key prefix of the blocks `fastlane kv serve` stores in a cluster (their names are
/// namespace-qualified hashes, so they cannot meet other users' blocks anyway).
const CLUSTER_KEY_PREFIX: &str = "fastlane-kv-serve";

/// The content-addressed store `--cas-bytes` and `--kv-cluster` describe (`None`: off).
fn cas_store(a: &ServeArgs, block_bytes: usize) -> Result<Option<Arc<PrefixStore>>> {
    let urls = a
        .kv_cluster
        .as_deref()
        .map(fastlane_bench::cluster_urls::parse_cluster_urls)
        .transpose()?;
    if a.cas_bytes == 0 {
        if urls.is_some() {
            bail!("--kv-cluster backs the content-addressed store: it needs --cas-bytes above 0");
        }
        if a.cas_nvme.is_some() {
            bail!(
                "--cas-nvme is a tier of the content-addressed store: it needs --cas-bytes above 0"
            );
        }
        return Ok(None);
    }
    if a.cas_nvme.is_some() && a.cas_nvme_bytes == 0 {
        bail!("--cas-nvme-bytes must be more than 0");
    }
    let cfg = PrefixStoreConfig {
        host_bytes: usize::try_from(a.cas_bytes).context("--cas-bytes: too large")?,
        block_bytes,
        put_queue_max: fastlane_kvswap::prefix::PUT_QUEUE_MAX,
        nvme: a
            .cas_nvme
            .as_ref()
            .map(|p| fastlane_kvswap::prefix::PrefixNvmeConfig::new(p.clone(), a.cas_nvme_bytes)),
    };
    let Some(urls) = urls else {
        let store = PrefixStore::open(cfg).context("--cas-nvme: opening the NVMe tier")?;
        if let Some(direct) = store.nvme_direct_io() {
            log::info!(
                "content-addressed store: NVMe tier {} ({}), {} bytes",
                a.cas_nvme.as_deref().map(|p| p.display().to_string()).unwrap_or_default(),
                if direct { "O_DIRECT" } else { "buffered" },
                a.cas_nvme_bytes
            );
        }
        return Ok(Some(Arc::new(store)));
    };
    let ccfg = fastlane_kvswap::cluster::ClusterTierConfig {
        namespace: CLUSTER_KEY_PREFIX.into(),
        ..fastlane_kvswap::cluster::ClusterTierConfig::default()
    };
    let tier = fastlane_kvswap::cluster::ClusterTier::connect(&urls, ccfg)
        .with_context(|| format!("--kv-cluster: connecting to {urls:?}"))?;
    let store = PrefixStore::with_cluster(cfg, tier)
        .context("--kv-cluster / --cas-nvme: starting the store")?;
    Ok(Some(Arc::new(store)))
}

/// `NAME=UID[:UID...]`.
fn parse_namespace(s: &str) -> Result<(String, Vec<u32>)> {
    let (name, uids) = s.split_once('=').context("--namespace wants NAME=UID[:UID...]")?;
    if name.is_empty()
        || name.len() > fastlane_kvswap::proto::NAMESPACE_MAX
        || name.starts_with("uid:")
        || !name.bytes().all(fastlane_kvswap::proto::namespace_byte)
    {
        bail!(
            "namespace name {name:?}: 1 to {} bytes of [A-Za-z0-9._:-], not starting with uid:",
            fastlane_kvswap::proto::NAMESPACE_MAX
        );
    }
    let uids = uids
        .split(':')
        .map(|u| u.parse::<u32>().with_context(|| format!("uid {u:?} in --namespace {s}")))
        .collect::<Result<Vec<_>>>()?;
    Ok((name.to_string(), uids))
}

/// Runs `fastlane kv`.
pub fn run(args: &KvArgs) -> Result<()> {
    crate::logging::init();
    match &args.command {
        KvCommand::Serve(a) => serve(a),
        KvCommand::Bench(a) => fastlane_bench::kv_tiers::run(a),
        KvCommand::Sim(a) => fastlane_bench::kv_sim::run(a),
        KvCommand::BenchCluster(a) => fastlane_bench::kv_cluster::run(a),
    }
}

fn spill_policy(s: &str) -> Result<SpillPolicy> {
    Ok(match s {
        "nvme-first" => SpillPolicy::NvmeFirst,
        "remote-first" => SpillPolicy::RemoteFirst,
        "nvme" => SpillPolicy::NvmeOnly,
        "remote" => SpillPolicy::RemoteOnly,
        "never" => SpillPolicy::Never,
        _ => bail!("spill {s:?}: nvme-first, remote-first, nvme, remote or never"),
    })
}

fn serve(a: &ServeArgs) -> Result<()> {
    // Before the engine or the pool starts a thread: they all inherit the blocked mask.
    let signals = StopSignals::block()?;
    let stop = Arc::new(AtomicBool::new(false));
    let g = a.model.geometry()?;
    let dev = Arc::new(SlabDeviceMemory::new(g.block_bytes() as usize, a.device_blocks)?);
    let mut access = ServerConfig::for_pool(a.device_blocks);
    if !a.allow_uid.is_empty() || !a.allow_gid.is_empty() {
        access.allow_uids = a.allow_uid.clone();
        access.allow_gids = a.allow_gid.clone();
    }
    if let Some(m) = a.conn_blocks_max {
        access.conn_blocks_max = m.min(a.device_blocks);
        access.conn_blocks_default = access.conn_blocks_default.min(access.conn_blocks_max);
    }
    if let Some(d) = a.conn_blocks_default {
        access.conn_blocks_default = d;
    }
    access.namespaces = a.namespace.clone();
    let allowed = format!("uids {:?}, gids {:?}", access.allow_uids, access.allow_gids);
    let config = EngineConfig {
        host_bytes: a.host_bytes,
        nvme: a.nvme.as_ref().map(|p| NvmeTierConfig {
            path: p.clone(),
            bytes: a.nvme_bytes,
            depth: 16,
        }),
        remote: a.remote.map(|addr| RemoteTierConfig {
            device: a.rdma_dev.clone(),
            addr,
            bytes: a.remote_bytes,
        }),
        spill: spill_policy(&a.spill)?,
        checksum: fastlane_bench::kv_tiers::checksum_mode(&a.checksum)?,
        ..EngineConfig::default()
    };
    let store = cas_store(a, g.block_bytes() as usize)?;
    let engine = SwapEngine::new(config, dev.clone())?;
    let locked = engine.stats().tiers[0].locked;
    let mut server = Server::bind(&a.socket, engine, dev.clone(), access)?;
    let cas = match &store {
        None => "off (--cas-bytes 0)".to_string(),
        Some(_) => format!(
            "{} bytes{}",
            a.cas_bytes,
            match &a.kv_cluster {
                Some(u) => format!(", backed by the cluster at {u}"),
                None => String::new(),
            }
        ),
    };
    if let Some(s) = store.clone() {
        server = server.with_store(s)?;
    }
    let exporter = fastlane_daemon::metrics::start_if(a.metrics, |f| {
        let m = KvMetrics::new(f, store.as_ref().map(|s| s.config().host_bytes as u64));
        let (counters, engine, store) = (server.counters(), server.engine(), server.store());
        move || m.update(&counters, &engine, store.as_deref())
    })
    .inspect_err(|_| {
        let _ = std::fs::remove_file(&a.socket);
    })?;
    signals.on_stop({
        let stop = stop.clone();
        move || stop.store(true, Ordering::Relaxed)
    })?;
    eprintln!(
        "fastlane kv serve: {} blocks of {} bytes, host tier {} bytes{}, content-addressed \
         store {cas}, listening on {:?} (protocol v{}), peers allowed: {allowed}",
        a.device_blocks,
        g.block_bytes(),
        a.host_bytes,
        if locked { " (mlocked)" } else { " (NOT mlocked: raise RLIMIT_MEMLOCK)" },
        a.socket,
        fastlane_kvswap::proto::VERSION
    );
    server.serve(&stop)?;
    drop(exporter);
    let c = server.counters();
    eprintln!(
        "fastlane kv serve: stopped after {} connections ({} refused), {} requests, {} \
         protocol errors",
        c.accepted.load(Ordering::Relaxed),
        c.refused.load(Ordering::Relaxed),
        c.requests.load(Ordering::Relaxed),
        c.protocol_errors.load(Ordering::Relaxed)
    );
    if let Some(s) = &store {
        let st = s.stats();
        eprintln!(
            "fastlane kv serve: content-addressed store: {} requests, {} keys got ({} hits: {} \
             cluster), {} blocks inserted, {} evicted for room, {} by EVICT, {} refused; {} \
             blocks ({} bytes) held, {} pins released on close; cluster: {} puts, {} dropped, \
             {} put errors, {} call errors, {} integrity misses",
            c.cas_requests.load(Ordering::Relaxed),
            st.gets,
            st.get_hits,
            st.cluster_hits,
            st.host_inserts,
            st.evictions,
            st.evicted_by_request,
            st.host_refused,
            st.host_blocks,
            st.host_bytes,
            c.pins_released_on_close.load(Ordering::Relaxed),
            st.cluster_puts,
            st.puts_dropped,
            st.put_errors,
            st.cluster_errors,
            st.integrity_misses
        );
    }
    let _ = std::fs::remove_file(&a.socket);
    drop(server);
    drop(dev);
    Ok(())
}

/// The server's counters (`ServerCounters`) as metrics: one line per field.
static SERVER_FIELDS: &[Field<ServerCounters>] = &[
    counter("fastlane_kv_requests_total", "Requests served (all ops)", |c| {
        c.requests.load(Ordering::Relaxed)
    }),
    counter(
        "fastlane_kv_cas_requests_total",
        "Content-addressed requests (PUT, GET, EXISTS, PIN, UNPIN, EVICT) served",
        |c| c.cas_requests.load(Ordering::Relaxed),
    ),
    counter("fastlane_kv_protocol_errors_total", "Connections closed for a malformed frame", |c| {
        c.protocol_errors.load(Ordering::Relaxed)
    }),
    counter(
        "fastlane_kv_cas_pins_released_on_close_total",
        "Pins released because their connection closed without UNPIN",
        |c| c.pins_released_on_close.load(Ordering::Relaxed),
    ),
    gauge("fastlane_kv_connections_open", "Connections open now (served or being refused)", |c| {
        c.open.load(Ordering::Relaxed)
    }),
];

/// The content-addressed store's counters (`PrefixStats`) as metrics: one line per field.
static CAS_FIELDS: &[Field<PrefixStats>] = &[
    counter("fastlane_kv_cas_get_keys_total", "Keys asked for by GET", |s| s.gets),
    counter("fastlane_kv_cas_get_hits_total", "Keys GET served (any tier)", |s| s.get_hits),
    counter("fastlane_kv_cas_lookups_total", "Leading-run lookups", |s| s.lookups),
    counter("fastlane_kv_cas_lookup_keys_total", "Keys asked for by lookups", |s| {
        s.blocks_looked_up
    }),
    counter("fastlane_kv_cas_host_hits_total", "Lookup keys served from host memory", |s| {
        s.host_hits
    }),
    counter("fastlane_kv_cas_cluster_hits_total", "Keys served from the cluster", |s| {
        s.cluster_hits
    }),
    counter("fastlane_kv_cas_misses_total", "Lookup keys not served", |s| s.misses),
    counter(
        "fastlane_kv_cas_integrity_misses_total",
        "Cluster values that failed verification (key, length, CRC32C), served as misses",
        |s| s.integrity_misses,
    ),
    counter("fastlane_kv_cas_inserts_total", "Blocks inserted into host memory", |s| {
        s.host_inserts
    }),
    counter(
        "fastlane_kv_cas_inserts_refused_total",
        "Blocks host memory could not take (larger than it, or the rest pinned)",
        |s| s.host_refused,
    ),
    counter(
        "fastlane_kv_cas_evictions_total",
        "Blocks evicted from host memory for room (least recently used first)",
        |s| s.evictions,
    ),
    counter("fastlane_kv_cas_evicted_by_request_total", "Blocks removed by EVICT", |s| {
        s.evicted_by_request
    }),
    counter("fastlane_kv_cas_cluster_puts_total", "Blocks the cluster acknowledged", |s| {
        s.cluster_puts
    }),
    counter(
        "fastlane_kv_cas_cluster_puts_dropped_total",
        "Puts dropped because the queue to the cluster was full",
        |s| s.puts_dropped,
    ),
    counter("fastlane_kv_cas_cluster_put_errors_total", "Puts the cluster failed", |s| {
        s.put_errors
    }),
    counter(
        "fastlane_kv_cas_cluster_errors_total",
        "Cluster calls that failed (timeout, connection); their keys were misses",
        |s| s.cluster_errors,
    ),
    counter("fastlane_kv_cas_cluster_read_bytes_total", "Bytes of cluster hits", |s| s.bytes_in),
    counter("fastlane_kv_cas_cluster_written_bytes_total", "Bytes the cluster stored", |s| {
        s.bytes_out
    }),
    gauge("fastlane_kv_cas_blocks", "Blocks in host memory now", |s| s.host_blocks),
    gauge("fastlane_kv_cas_bytes", "Bytes in host memory now", |s| s.host_bytes),
    gauge("fastlane_kv_cas_pins", "Pins held now (a key pinned twice counts twice)", |s| s.pins),
    gauge("fastlane_kv_cas_pinned_blocks", "Blocks pinned in host memory now", |s| s.pinned_blocks),
    counter("fastlane_kv_cas_nvme_hits_total", "Keys served from the NVMe tier", |s| s.nvme_hits),
    gauge("fastlane_kv_cas_nvme_blocks", "Blocks on the NVMe tier now", |s| s.nvme_blocks),
    gauge("fastlane_kv_cas_nvme_bytes", "Bytes on the NVMe tier now", |s| s.nvme_bytes),
    gauge("fastlane_kv_cas_nvme_capacity_blocks", "Slots of the NVMe tier", |s| {
        s.nvme_capacity_blocks
    }),
    counter("fastlane_kv_cas_nvme_spills_total", "Blocks written to the NVMe tier", |s| {
        s.nvme_spills
    }),
    counter(
        "fastlane_kv_cas_nvme_spills_dropped_total",
        "Spills dropped because the queue to the NVMe tier was full",
        |s| s.nvme_spills_dropped,
    ),
    counter(
        "fastlane_kv_cas_nvme_evictions_total",
        "Blocks dropped from the NVMe tier for room (least recently used first)",
        |s| s.nvme_evictions,
    ),
    counter(
        "fastlane_kv_cas_nvme_errors_total",
        "NVMe tier reads or writes that failed; their keys were misses",
        |s| s.nvme_errors,
    ),
];

/// Tier names by `TierKind::index`.
const TIERS: [&str; 3] = ["host", "nvme", "remote"];

/// The Prometheus families of `fastlane kv serve --metrics`.
struct KvMetrics {
    server: FieldSet<ServerCounters>,
    connections: fastlane_daemon::metrics::IntCounterVec,
    device_blocks: fastlane_daemon::metrics::IntGaugeVec,
    device_pinned: fastlane_daemon::metrics::IntGaugeVec,
    tier_blocks: fastlane_daemon::metrics::IntGaugeVec,
    swap_bytes: fastlane_daemon::metrics::IntCounterVec,
    checksum_failures: fastlane_daemon::metrics::IntCounterVec,
    spills: fastlane_daemon::metrics::IntCounterVec,
    tickets: fastlane_daemon::metrics::IntGaugeVec,
    /// The store's families, with its capacity; `None` without a store (`--cas-bytes 0`).
    cas: Option<(FieldSet<PrefixStats>, fastlane_daemon::metrics::IntGaugeVec, u64)>,
}

impl KvMetrics {
    /// `cas_bytes`: the store's capacity, `None` without one.
    fn new(f: &Families, cas_bytes: Option<u64>) -> KvMetrics {
        KvMetrics {
            server: f.fields(SERVER_FIELDS),
            connections: f.counter(
                "fastlane_kv_connections_total",
                "Connections by result: accepted, refused_peer (credentials not allowed), \
                 refused_full (the connection limit was reached)",
                &["result"],
            ),
            device_blocks: f.gauge(
                "fastlane_kv_device_blocks",
                "Device pool blocks, by state (used, free)",
                &["state"],
            ),
            device_pinned: f.gauge(
                "fastlane_kv_device_pinned_blocks",
                "Device pool blocks pinned by transfers in flight (part of used)",
                &[],
            ),
            tier_blocks: f.gauge(
                "fastlane_kv_tier_blocks",
                "Swap tier slots (one block each), by configured tier (host, nvme, remote) and \
                 state (used, free)",
                &["tier", "state"],
            ),
            swap_bytes: f.counter(
                "fastlane_kv_swap_bytes_total",
                "Bytes moved by finished transfers, by direction (out: device to tier, in: tier \
                 to device, spill: host tier to a lower one)",
                &["direction"],
            ),
            checksum_failures: f.counter(
                "fastlane_kv_checksum_failures_total",
                "Block checksum mismatches seen",
                &[],
            ),
            spills: f.counter("fastlane_kv_spills_total", "Spills started", &[]),
            tickets: f.gauge(
                "fastlane_kv_tickets_in_flight",
                "Transfers (tickets) started and not yet finished",
                &[],
            ),
            cas: cas_bytes.map(|bytes| {
                let capacity = f.gauge(
                    "fastlane_kv_cas_capacity_bytes",
                    "Host memory of the content-addressed store (--cas-bytes)",
                    &[],
                );
                (f.fields(CAS_FIELDS), capacity, bytes)
            }),
        }
    }

    fn update(&self, c: &ServerCounters, engine: &Mutex<SwapEngine>, store: Option<&PrefixStore>) {
        self.server.update(c);
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        set_total(&self.connections, &["accepted"], l(&c.accepted));
        set_total(&self.connections, &["refused_peer"], l(&c.refused));
        set_total(&self.connections, &["refused_full"], l(&c.refused_full));
        // One engine call under the lock every request takes for one call at a time.
        let (st, in_flight, bb) = {
            let e = engine.lock().unwrap_or_else(PoisonError::into_inner);
            (e.stats(), e.in_flight(), e.block_bytes() as u64)
        };
        set_gauge(
            &self.device_blocks,
            &["used"],
            u64::from(st.device_blocks.saturating_sub(st.device_free)),
        );
        set_gauge(&self.device_blocks, &["free"], u64::from(st.device_free));
        set_gauge(&self.device_pinned, &[], u64::from(st.device_pinned));
        for (t, name) in st.tiers.iter().zip(TIERS) {
            if t.present {
                let used = t.used_bytes / bb.max(1);
                set_gauge(&self.tier_blocks, &[name, "used"], used);
                set_gauge(
                    &self.tier_blocks,
                    &[name, "free"],
                    (t.capacity_bytes / bb.max(1)).saturating_sub(used),
                );
            }
        }
        set_total(&self.swap_bytes, &["out"], st.bytes_out);
        set_total(&self.swap_bytes, &["in"], st.bytes_in);
        set_total(&self.swap_bytes, &["spill"], st.bytes_spilled);
        set_total(&self.checksum_failures, &[], st.checksum_failures);
        set_total(&self.spills, &[], st.spills);
        set_gauge(&self.tickets, &[], in_flight as u64);
        if let (Some((fields, capacity, bytes)), Some(store)) = (&self.cas, store) {
            fields.update(&store.stats());
            set_gauge(capacity, &[], *bytes);
        }
    }
}
