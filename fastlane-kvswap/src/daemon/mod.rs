//! The daemon of `fastlane kv serve`: the swap engine behind the versioned Unix-socket
//! protocol of [`crate::proto`] (docs/kvswap.md) until SIGINT/SIGTERM.
//!
//! Each connection gets its own slab of the device pool (its own memfd); peers are checked
//! against the allowed uids and gids (default: the server's own uid). Content-addressed ops
//! (`PUT`/`GET`/`EXISTS`/`PIN`/`UNPIN`/`EVICT`) go to one [`PrefixStore`], optionally with an
//! NVMe tier and a Redis Cluster under it. With a metrics address, the connection, engine and
//! store counters are served to Prometheus, read at each scrape (the families are listed in
//! docs/kvswap.md).
//!
//! [`ServeConfig`] has one field per flag of `fastlane kv serve`, named as the flag, and the
//! errors of [`serve`] name those flags. The flags that are not plain numbers parse with
//! [`parse_spill_policy`], [`parse_namespace`] and [`parse_cluster_urls`] (which `fastlane
//! llm --kv-cluster` uses too).

mod metrics;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use fastlane_daemon::signals::StopSignals;

use crate::cluster_access::{ClusterAccess, PASSWORD_ENV, USERNAME_ENV};
use crate::prefix::{PrefixNvmeConfig, PUT_QUEUE_MAX};
use crate::server::{Server, ServerConfig};
use crate::{
    ChecksumMode, EngineConfig, KvGeometry, NvmeTierConfig, PrefixStore, PrefixStoreConfig,
    RemoteTierConfig, SlabDeviceMemory, SpillPolicy, SwapEngine,
};
use metrics::KvMetrics;

/// Redis key prefix of the blocks `fastlane kv serve` stores in a cluster (their names are
/// namespace-qualified hashes, so they cannot meet other users' blocks anyway).
pub const CLUSTER_KEY_PREFIX: &str = "fastlane-kv-serve";

/// io_uring queue depth of the swap engine's NVMe tier.
const NVME_DEPTH: u32 = 16;

/// Settings of [`serve`]: each field is the `fastlane kv serve` flag of the same name (its
/// `--help` says more).
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Unix socket path (replaced if it exists, removed on exit).
    pub socket: PathBuf,
    /// The model's KV cache shape: one device block is `geometry.block_bytes()`.
    pub geometry: KvGeometry,
    /// Device pool size in blocks (host memory standing in for GPU memory).
    pub device_blocks: u32,
    /// Host tier bytes.
    pub host_bytes: u64,
    /// NVMe tier: a file or block device (O_DIRECT).
    pub nvme: Option<PathBuf>,
    /// NVMe tier bytes.
    pub nvme_bytes: u64,
    /// Remote tier: address of `fastlane rdma serve`.
    pub remote: Option<SocketAddr>,
    /// RDMA device for the remote tier.
    pub rdma_dev: String,
    /// Remote tier bytes.
    pub remote_bytes: u64,
    /// Where cold sequences go when the host tier is full.
    pub spill: SpillPolicy,
    /// Per-block checksum.
    pub checksum: ChecksumMode,
    /// Peer uids allowed to connect; with `allow_gid` also empty: the server's own uid only.
    pub allow_uid: Vec<u32>,
    /// Peer gids (primary group) allowed to connect.
    pub allow_gid: Vec<u32>,
    /// Most device blocks one connection's slab may have (`None`: the whole pool).
    pub conn_blocks_max: Option<u32>,
    /// Slab size for a client whose HELLO asks for 0 blocks (`None`: a quarter of the pool).
    pub conn_blocks_default: Option<u32>,
    /// Namespaces peers may share, with the uids that may join each.
    pub namespace: Vec<(String, Vec<u32>)>,
    /// Host memory of the content-addressed block store; 0 turns the store off.
    pub cas_bytes: u64,
    /// Redis Cluster nodes (`redis://HOST:PORT` or `rediss://HOST:PORT` each) behind the
    /// store.
    pub kv_cluster: Option<Vec<String>>,
    /// The cluster's password, in a file only its owner may read (else from the environment,
    /// `FASTLANE_REDIS_PASSWORD`; see [`crate::cluster_access`]).
    pub kv_cluster_password_file: Option<PathBuf>,
    /// PEM CA to trust for `rediss://` instead of the system roots.
    pub kv_cluster_ca: Option<PathBuf>,
    /// NVMe tier of the store: a file.
    pub cas_nvme: Option<PathBuf>,
    /// Bytes of `cas_nvme`.
    pub cas_nvme_bytes: u64,
    /// Serve Prometheus metrics at `http://ADDR/metrics`.
    pub metrics: Option<SocketAddr>,
}

impl ServeConfig {
    /// The swap engine's configuration.
    pub fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            host_bytes: self.host_bytes,
            nvme: self.nvme.as_ref().map(|p| NvmeTierConfig {
                path: p.clone(),
                bytes: self.nvme_bytes,
                depth: NVME_DEPTH,
            }),
            remote: self.remote.map(|addr| RemoteTierConfig {
                device: self.rdma_dev.clone(),
                addr,
                bytes: self.remote_bytes,
            }),
            spill: self.spill,
            checksum: self.checksum,
            ..EngineConfig::default()
        }
    }

    /// Who may connect, and the slabs and namespaces they get.
    pub fn access(&self) -> ServerConfig {
        let mut access = ServerConfig::for_pool(self.device_blocks);
        if !self.allow_uid.is_empty() || !self.allow_gid.is_empty() {
            access.allow_uids = self.allow_uid.clone();
            access.allow_gids = self.allow_gid.clone();
        }
        if let Some(m) = self.conn_blocks_max {
            access.conn_blocks_max = m.min(self.device_blocks);
            access.conn_blocks_default = access.conn_blocks_default.min(access.conn_blocks_max);
        }
        if let Some(d) = self.conn_blocks_default {
            access.conn_blocks_default = d;
        }
        access.namespaces = self.namespace.clone();
        access
    }

    /// The content-addressed store's configuration (`None`: off), or why the flags that
    /// describe it do not fit together.
    pub fn store_config(&self) -> Result<Option<PrefixStoreConfig>> {
        if self.kv_cluster.is_none() {
            if self.kv_cluster_password_file.is_some() {
                bail!("--kv-cluster-password-file is the password of --kv-cluster: give both");
            }
            if self.kv_cluster_ca.is_some() {
                bail!("--kv-cluster-ca is the CA of --kv-cluster rediss://…: give both");
            }
        }
        if self.cas_bytes == 0 {
            if self.kv_cluster.is_some() {
                bail!(
                    "--kv-cluster backs the content-addressed store: it needs --cas-bytes above 0"
                );
            }
            if self.cas_nvme.is_some() {
                bail!(
                    "--cas-nvme is a tier of the content-addressed store: it needs --cas-bytes \
                     above 0"
                );
            }
            return Ok(None);
        }
        if self.cas_nvme.is_some() && self.cas_nvme_bytes == 0 {
            bail!("--cas-nvme-bytes must be more than 0");
        }
        Ok(Some(PrefixStoreConfig {
            host_bytes: usize::try_from(self.cas_bytes).context("--cas-bytes: too large")?,
            block_bytes: self.geometry.block_bytes() as usize,
            put_queue_max: PUT_QUEUE_MAX,
            nvme: self
                .cas_nvme
                .as_ref()
                .map(|p| PrefixNvmeConfig::new(p.clone(), self.cas_nvme_bytes)),
        }))
    }

    /// The content-addressed store, opened (and its cluster connected); `None`: off.
    fn open_store(&self) -> Result<Option<Arc<PrefixStore>>> {
        let Some(cfg) = self.store_config()? else { return Ok(None) };
        let Some(urls) = &self.kv_cluster else {
            let store = PrefixStore::open(cfg).context("--cas-nvme: opening the NVMe tier")?;
            if let Some(direct) = store.nvme_direct_io() {
                log::info!(
                    "content-addressed store: NVMe tier {} ({}), {} bytes",
                    self.cas_nvme.as_deref().map(|p| p.display().to_string()).unwrap_or_default(),
                    if direct { "O_DIRECT" } else { "buffered" },
                    self.cas_nvme_bytes
                );
            }
            return Ok(Some(Arc::new(store)));
        };
        let access = ClusterAccess::load(
            self.kv_cluster_password_file.as_deref(),
            self.kv_cluster_ca.as_deref(),
        )?;
        with_cluster(cfg, urls, access).map(|s| Some(Arc::new(s)))
    }
}

/// A store backed by the cluster at `urls`.
#[cfg(feature = "cluster")]
fn with_cluster(
    cfg: PrefixStoreConfig,
    urls: &[String],
    access: ClusterAccess,
) -> Result<PrefixStore> {
    use crate::cluster::{ClusterTier, ClusterTierConfig};
    let ccfg = ClusterTierConfig {
        namespace: CLUSTER_KEY_PREFIX.into(),
        access,
        ..ClusterTierConfig::default()
    };
    let tier = ClusterTier::connect(urls, ccfg)
        .with_context(|| format!("--kv-cluster: connecting to {}", urls.join(",")))?;
    PrefixStore::with_cluster(cfg, tier).context("--kv-cluster / --cas-nvme: starting the store")
}

/// Without the `cluster` feature there is no cluster tier to back the store.
#[cfg(not(feature = "cluster"))]
fn with_cluster(
    _cfg: PrefixStoreConfig,
    _urls: &[String],
    _access: ClusterAccess,
) -> Result<PrefixStore> {
    bail!(
        "--kv-cluster: this build has no cluster tier (cargo feature `cluster` of fastlane-kvswap)"
    )
}

/// Runs `fastlane kv serve` until SIGINT/SIGTERM: binds `cfg.socket`, prints a banner and,
/// at the end, a summary of what was served on stderr, and removes the socket.
pub fn serve(cfg: &ServeConfig) -> Result<()> {
    // Before the engine or the pool starts a thread: they all inherit the blocked mask.
    let signals = StopSignals::block()?;
    let stop = Arc::new(AtomicBool::new(false));
    let block_bytes = cfg.geometry.block_bytes();
    let dev = Arc::new(SlabDeviceMemory::new(block_bytes as usize, cfg.device_blocks)?);
    let access = cfg.access();
    let allowed = format!("uids {:?}, gids {:?}", access.allow_uids, access.allow_gids);
    let store = cfg.open_store()?;
    let engine = SwapEngine::new(cfg.engine_config(), dev.clone())?;
    let locked = engine.stats().tiers[0].locked;
    let mut server = Server::bind(&cfg.socket, engine, dev.clone(), access)?;
    let cas = match &store {
        None => "off (--cas-bytes 0)".to_string(),
        Some(_) => format!(
            "{} bytes{}",
            cfg.cas_bytes,
            match &cfg.kv_cluster {
                Some(u) => format!(", backed by the cluster at {}", u.join(",")),
                None => String::new(),
            }
        ),
    };
    if let Some(s) = store.clone() {
        server = server.with_store(s)?;
    }
    let exporter = fastlane_daemon::metrics::start_if(cfg.metrics, |f| {
        let m = KvMetrics::new(f, store.as_ref().map(|s| s.config().host_bytes as u64));
        let (counters, engine, store) = (server.counters(), server.engine(), server.store());
        move || m.update(&counters, &engine, store.as_deref())
    })
    .inspect_err(|_| {
        let _ = std::fs::remove_file(&cfg.socket);
    })?;
    signals.on_stop_set(&stop)?;
    log::info!(
        "fastlane kv serve: {} blocks of {} bytes, host tier {} bytes{}, content-addressed \
         store {cas}, listening on {:?} (protocol v{}), peers allowed: {allowed}",
        cfg.device_blocks,
        block_bytes,
        cfg.host_bytes,
        if locked { " (mlocked)" } else { " (NOT mlocked: raise RLIMIT_MEMLOCK)" },
        cfg.socket,
        crate::proto::VERSION
    );
    fastlane_daemon::notify::ready(&format!("kv serve on {:?}", cfg.socket));
    let served = server.serve(&stop);
    fastlane_daemon::notify::stopping("stopped serving");
    served?;
    drop(exporter);
    let c = server.counters();
    log::info!(
        "fastlane kv serve: stopped after {} connections ({} refused), {} requests, {} \
         protocol errors",
        c.accepted.load(Ordering::Relaxed),
        c.refused.load(Ordering::Relaxed),
        c.requests.load(Ordering::Relaxed),
        c.protocol_errors.load(Ordering::Relaxed)
    );
    if let Some(s) = &store {
        let st = s.stats();
        log::info!(
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
    let _ = std::fs::remove_file(&cfg.socket);
    drop(server);
    drop(dev);
    Ok(())
}

/// `--spill`: nvme-first, remote-first, nvme, remote or never.
pub fn parse_spill_policy(s: &str) -> Result<SpillPolicy> {
    Ok(match s {
        "nvme-first" => SpillPolicy::NvmeFirst,
        "remote-first" => SpillPolicy::RemoteFirst,
        "nvme" => SpillPolicy::NvmeOnly,
        "remote" => SpillPolicy::RemoteOnly,
        "never" => SpillPolicy::Never,
        _ => bail!("spill {s:?}: nvme-first, remote-first, nvme, remote or never"),
    })
}

/// `--namespace NAME=UID[:UID...]`.
pub fn parse_namespace(s: &str) -> Result<(String, Vec<u32>)> {
    let (name, uids) = s.split_once('=').context("--namespace wants NAME=UID[:UID...]")?;
    if name.is_empty()
        || name.len() > crate::proto::NAMESPACE_MAX
        || name.starts_with("uid:")
        || !name.bytes().all(crate::proto::namespace_byte)
    {
        bail!(
            "namespace name {name:?}: 1 to {} bytes of [A-Za-z0-9._:-], not starting with uid:",
            crate::proto::NAMESPACE_MAX
        );
    }
    let uids = uids
        .split(':')
        .map(|u| u.parse::<u32>().with_context(|| format!("uid {u:?} in --namespace {s}")))
        .collect::<Result<Vec<_>>>()?;
    Ok((name.to_string(), uids))
}

/// `--kv-cluster redis://HOST:PORT[,HOST:PORT...]` (or `rediss://…` for TLS), as `fastlane
/// kv serve` and `fastlane llm` both take it → one URL per node, the nodes
/// `cluster::ClusterTier::connect` starts from. A node may repeat the scheme, not change it.
/// A user or password in the URL is refused, without repeating it: it would show in `ps`
/// (see [`crate::cluster_access`] for where credentials come from).
pub fn parse_cluster_urls(text: &str) -> Result<Vec<String>> {
    const FORM: &str = "redis://HOST:PORT[,HOST:PORT...] or rediss://HOST:PORT[,…] (TLS)";
    let (scheme, rest) = if let Some(r) = text.strip_prefix("redis://") {
        ("redis://", r)
    } else if let Some(r) = text.strip_prefix("rediss://") {
        ("rediss://", r)
    } else {
        let shown = text.rsplit_once('@').map_or(text, |(_, h)| h);
        bail!("--kv-cluster {shown:?}: {FORM}");
    };
    let mut urls = Vec::new();
    for node in rest.split(',').map(str::trim) {
        let other = if scheme == "redis://" { "rediss://" } else { "redis://" };
        if node.starts_with(other) {
            bail!("--kv-cluster: the nodes mix redis:// and rediss://");
        }
        let node = node.strip_prefix(scheme).unwrap_or(node);
        if let Some((_, host)) = node.rsplit_once('@') {
            bail!(
                "--kv-cluster: the URL of {host:?} carries a user or password: credentials \
                 come from the environment ({USERNAME_ENV}, {PASSWORD_ENV}) or \
                 --kv-cluster-password-file, never the command line, where `ps` shows them \
                 to every user"
            );
        }
        let ok = node
            .rsplit_once(':')
            .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
        if !ok {
            bail!("--kv-cluster: {node:?} is not HOST:PORT");
        }
        urls.push(format!("{scheme}{node}"));
    }
    Ok(urls)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The flags' defaults, on a 64-block pool of one-token blocks.
    fn config() -> ServeConfig {
        ServeConfig {
            socket: "/nonexistent/kv.sock".into(),
            geometry: KvGeometry { tokens_per_block: 1, ..KvGeometry::LLAMA31_8B },
            device_blocks: 64,
            host_bytes: 1 << 30,
            nvme: None,
            nvme_bytes: 4 << 30,
            remote: None,
            rdma_dev: "rxe0".into(),
            remote_bytes: 1 << 30,
            spill: SpillPolicy::NvmeFirst,
            checksum: ChecksumMode::Fast,
            allow_uid: Vec::new(),
            allow_gid: Vec::new(),
            conn_blocks_max: None,
            conn_blocks_default: None,
            namespace: Vec::new(),
            cas_bytes: 1 << 30,
            kv_cluster: None,
            kv_cluster_password_file: None,
            kv_cluster_ca: None,
            cas_nvme: None,
            cas_nvme_bytes: 4 << 30,
            metrics: None,
        }
    }

    #[test]
    fn access_defaults_to_our_uid_and_caps_slabs_at_the_pool() {
        let a = config().access();
        // SAFETY: geteuid has no preconditions and cannot fail.
        assert_eq!(a.allow_uids, [unsafe { libc::geteuid() }]);
        assert!(a.allow_gids.is_empty());
        assert_eq!((a.conn_blocks_max, a.conn_blocks_default), (64, 16));
        let a =
            ServeConfig { allow_gid: vec![7], conn_blocks_max: Some(1000), ..config() }.access();
        assert!(a.allow_uids.is_empty(), "--allow-gid alone replaces the default uid");
        assert_eq!((a.conn_blocks_max, a.conn_blocks_default), (64, 16));
        let a = ServeConfig { conn_blocks_max: Some(8), ..config() }.access();
        assert_eq!((a.conn_blocks_max, a.conn_blocks_default), (8, 8));
        let a = ServeConfig { conn_blocks_default: Some(3), ..config() }.access();
        assert_eq!(a.conn_blocks_default, 3);
    }

    #[test]
    fn the_store_needs_cas_bytes_for_its_tiers() {
        let s = config().store_config().unwrap().expect("a store by default");
        assert_eq!((s.host_bytes, s.block_bytes, s.nvme), (1 << 30, 128 << 10, None));
        let off = ServeConfig { cas_bytes: 0, ..config() };
        assert_eq!(off.store_config().unwrap(), None);
        let e = ServeConfig { kv_cluster: Some(vec!["redis://h:1".into()]), ..off.clone() }
            .store_config()
            .unwrap_err();
        assert!(e.to_string().contains("needs --cas-bytes above 0"), "{e}");
        let e =
            ServeConfig { cas_nvme: Some("/x".into()), ..off.clone() }.store_config().unwrap_err();
        assert!(e.to_string().starts_with("--cas-nvme is a tier"), "{e}");
        let e = ServeConfig { kv_cluster_password_file: Some("/p".into()), ..config() }
            .store_config()
            .unwrap_err();
        assert!(e.to_string().contains("give both"), "{e}");
        let e =
            ServeConfig { kv_cluster_ca: Some("/ca".into()), ..off }.store_config().unwrap_err();
        assert!(e.to_string().contains("give both"), "{e}");
        let c = ServeConfig { cas_nvme: Some("/x".into()), cas_nvme_bytes: 0, ..config() };
        assert_eq!(
            c.store_config().unwrap_err().to_string(),
            "--cas-nvme-bytes must be more than 0"
        );
        let c = ServeConfig { cas_nvme: Some("/x".into()), ..config() };
        let n = c.store_config().unwrap().unwrap().nvme.expect("an NVMe tier");
        assert_eq!((n.path.to_str(), n.bytes), (Some("/x"), 4 << 30));
    }

    #[test]
    fn engine_config_takes_the_tiers() {
        let c = ServeConfig {
            nvme: Some("/x".into()),
            remote: Some("10.0.0.1:4791".parse().unwrap()),
            spill: SpillPolicy::RemoteOnly,
            checksum: ChecksumMode::Off,
            ..config()
        }
        .engine_config();
        let n = c.nvme.expect("an NVMe tier");
        assert_eq!((n.bytes, n.depth), (4 << 30, NVME_DEPTH));
        let r = c.remote.expect("a remote tier");
        assert_eq!((r.device.as_str(), r.bytes), ("rxe0", 1 << 30));
        assert_eq!(
            (c.spill, c.checksum, c.host_bytes),
            (SpillPolicy::RemoteOnly, ChecksumMode::Off, 1 << 30)
        );
    }

    #[test]
    fn flag_parsers() {
        assert_eq!(parse_spill_policy("remote-first").unwrap(), SpillPolicy::RemoteFirst);
        assert!(parse_spill_policy("sometimes").unwrap_err().to_string().contains("never"));
        assert_eq!(parse_namespace("team=1:2").unwrap(), ("team".to_string(), vec![1, 2]));
        for bad in ["team", "=1", "uid:5=1", "a b=1", "team=x"] {
            assert!(parse_namespace(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_cluster_urls("redis://a:1").unwrap(), vec!["redis://a:1"]);
        assert_eq!(
            parse_cluster_urls("redis://10.0.0.1:7000,10.0.0.2:7001, redis://h:7002").unwrap(),
            vec!["redis://10.0.0.1:7000", "redis://10.0.0.2:7001", "redis://h:7002"]
        );
        for bad in ["a:1", "redis://", "redis://a", "redis://a:0", "redis://a:1,b", "redis://:1"] {
            assert!(parse_cluster_urls(bad).is_err(), "{bad}");
        }
        assert_eq!(
            parse_cluster_urls("rediss://a:1,b:2,rediss://c:3").unwrap(),
            vec!["rediss://a:1", "rediss://b:2", "rediss://c:3"]
        );
        for mixed in ["redis://a:1,rediss://b:2", "rediss://a:1,redis://b:2"] {
            let e = parse_cluster_urls(mixed).unwrap_err().to_string();
            assert!(e.contains("mix"), "{mixed}: {e}");
        }
        for creds in [
            "redis://user:hunter2@h:1",
            "rediss://:hunter2@h:1",
            "redis://a:1,user:hunter2@h:2",
            "redis://a:1,redis://hunter2@h:2",
            "user:hunter2@h:1",
        ] {
            let e = parse_cluster_urls(creds).unwrap_err().to_string();
            assert!(!e.contains("hunter2"), "{creds}: the error repeats the secret: {e}");
            if creds.starts_with("redis") {
                assert!(e.contains("never the command line"), "{creds}: {e}");
                assert!(e.contains(PASSWORD_ENV), "{creds}: {e}");
            }
        }
    }
}
