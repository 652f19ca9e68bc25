//! The flags `fastlane llm` and `fastlane router` share, with their conversion into the
//! configuration they describe: the HTTP listener's ([`HttpArgs`]) and the model's and
//! engine's ([`EngineArgs`]). They are clap `Args`, flattened by the CLI into its
//! subcommands (as `fastlane-bench`'s are); errors name the flag.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use fastlane_kvswap::{NvmeTierConfig, RemoteTierConfig};
use fastlane_sched::Policy;

use crate::{EngineConfig, Model, PreemptChoice};

/// `llm serve`'s `--mixed-batch-tokens`: a step with the interactive tier's decodes carries
/// at most this much batch work, in linear-token equivalents (on this project's CPUs about
/// the cost of eight prompt tokens beside the decodes, where an unbounded step at a long
/// batch context took up to a second: docs/serving.md, "Hostile clients").
pub const SERVE_MIXED_BATCH_TOKENS: u32 = 8;

/// `--protect on`: [`fastlane_sched::ProtectConfig`]'s defaults (half the bucket, no other
/// prefill beside a protected one, 1 s bound), and no other tenant's decodes in that step
/// either: on a CPU each row lengthens the step (docs/serving.md).
pub const SERVE_PROTECT: fastlane_sched::ProtectConfig = fastlane_sched::ProtectConfig {
    bucket_frac_min: 0.5,
    others_prefill_tokens_max: 0,
    hold_ns_max: 1_000_000_000,
    others_decodes: false,
};

pub use fastlane_openai::api::SECONDS_MAX;
pub use fastlane_openai::listen::{seconds, HttpArgs};

/// The model and engine flags shared by `generate` and `bench`.
#[derive(Debug, Args, Clone)]
pub struct EngineArgs {
    /// Model: a Hugging Face directory (config.json, *.safetensors) or random:tiny (3.4 M
    /// parameters) / random:small (125 M), seeded random weights that are not a language model.
    #[arg(long, default_value = "random:tiny")]
    pub model: String,
    /// Seed of a random: model's weights.
    #[arg(long, default_value_t = 1)]
    pub model_seed: u64,
    /// KV blocks in the device pool (16 tokens each); small values force preemption.
    #[arg(long, default_value_t = 1024)]
    pub device_blocks: u32,
    /// Scheduling policy: fifo (no gate), drr (token bucket + slots + DRR), drr+preempt
    /// (and batch sequences preempted for interactive ones). Default: fifo for generate,
    /// drr for serve.
    #[arg(long)]
    pub policy: Option<String>,
    /// How preempted sequences give up their blocks: auto (measured costs), swap, recompute.
    #[arg(long, default_value = "auto")]
    pub preempt: String,
    /// Latency protection, on or off (policies drr, drr+preempt): fairness between tenants
    /// of one tier. An interactive tenant sending under its rate (its bucket at least half
    /// full) is protected: while it has prefill work, a step carrying its prefill carries no
    /// other tenant's work (no prefill, no decodes; at most 1 s in a row), and with
    /// --preemptible-steps on its arrival gives up a step that carries none of its prefill,
    /// whatever the tier of the step's work. A tenant at its rate (a flooder held to its
    /// bucket) pays with its inter-token latency. Default: on for serve, off for generate
    /// (docs/serving.md, docs/scheduler.md). `--protect` alone means on.
    #[arg(long, value_name = "on|off", num_args = 0..=1, default_missing_value = "on")]
    pub protect: Option<String>,
    /// How the interactive and batch tiers share a step (policies drr, drr+preempt):
    /// separate (a step with an interactive prefill carries no batch-tier work, decodes
    /// included, for at most 500 ms in a row; the batch work runs in the next step) or shared
    /// (batch work fills whatever budget the interactive tier leaves, as on a GPU where rows
    /// are nearly free). On a CPU every row lengthens the step (docs/serving.md).
    #[arg(long, default_value = "separate", value_name = "separate|shared")]
    pub tier_steps: String,
    /// With --tier-steps separate: the most batch-tier work a step that carries interactive
    /// work (its decodes) may also carry, in tokens through the linear layers (a batch token
    /// at context c counts 1 + c / the model's attention context). At least one batch token
    /// goes into every such step. 0: no bound but the step's token budget. Default 8 for
    /// serve, 0 otherwise (docs/serving.md, "Hostile clients").
    #[arg(long, value_name = "TOKENS")]
    pub mixed_batch_tokens: Option<u32>,
    /// Prefill chunk in tokens (0: whole prompts in one step). Default 256; 64 for serve.
    #[arg(long)]
    pub chunk: Option<u32>,
    /// Token budget of one step. Default 512; 128 for serve (unless --preemptible-steps is
    /// on, a step runs to its end, so its length bounds how long a new request waits for the
    /// one in flight).
    #[arg(long)]
    pub batch_tokens: Option<u32>,
    /// Preemptible steps: on or off. On: when a request of an interactive-tier tenant
    /// arrives while a step's forward pass runs and that step holds no interactive prefill,
    /// the pass is given up between two layers or halfway through one (the work done on it is discarded and redone)
    /// and the next step is planned with the new request in it; the step after one given up
    /// always runs to its end. Trades batch-tier throughput for interactive TTFT; with
    /// --tier-steps separate the step that follows holds no batch row (docs/serving.md). On
    /// by default: output is the same either way.
    #[arg(long, default_value = "on")]
    pub preemptible_steps: String,
    /// Host swap tier size (bytes, K/M/G suffixes; 0: none, swap goes to --nvme/--remote).
    #[arg(long, default_value = "256M")]
    pub host_bytes: String,
    /// NVMe swap tier: a file or block device, used with O_DIRECT through io_uring.
    #[arg(long)]
    pub nvme: Option<PathBuf>,
    /// Bytes of --nvme to use.
    #[arg(long, default_value = "1G")]
    pub nvme_bytes: String,
    /// Remote swap tier: address of a `fastlane rdma serve` pool.
    #[arg(long)]
    pub remote: Option<std::net::SocketAddr>,
    /// RDMA device for --remote.
    #[arg(long, default_value = "rxe0")]
    pub rdma_device: String,
    /// Bytes to take from the remote pool.
    #[arg(long, default_value = "256M")]
    pub remote_bytes: String,
    /// Prefix reuse: prompts' full 16-token blocks are cached by content (model digest +
    /// token ids) and a new prompt's leading hits are loaded instead of prefilled: on or off.
    #[arg(long, default_value = "on")]
    pub prefix_cache: String,
    /// Bytes of KV blocks the in-process prefix cache holds (K/M/G suffixes).
    #[arg(long, default_value = "256M")]
    pub prefix_cache_bytes: String,
    /// NVMe tier of the prefix cache, under its host memory: a file (created, preallocated
    /// to --prefix-cache-nvme-bytes; O_DIRECT where the filesystem allows) or a block device.
    /// Blocks the host cache evicts are written there in the background and read back,
    /// checked by CRC32C, on a later hit. Its contents do not survive a restart.
    #[arg(long, value_name = "PATH")]
    pub prefix_cache_nvme: Option<PathBuf>,
    /// Bytes of --prefix-cache-nvme to use (K/M/G suffixes): one slot per KV block, the least
    /// recently used slot reused when full.
    #[arg(long, value_name = "SIZE", default_value = "1G", requires = "prefix_cache_nvme")]
    pub prefix_cache_nvme_bytes: String,
    /// Redis Cluster behind the prefix cache, shared by every engine that names it:
    /// redis://HOST:PORT[,HOST:PORT...] (any nodes of the cluster), or rediss://… for TLS.
    /// No user or password in the URL (refused: `ps` would show it): a cluster with
    /// `requirepass` or ACL users gets them from FASTLANE_REDIS_PASSWORD (and
    /// FASTLANE_REDIS_USERNAME) or --kv-cluster-password-file. A refused password or a failed
    /// TLS handshake stops the start; an unreachable cluster leaves the local tiers alone.
    #[arg(long, value_name = "redis[s]://HOST:PORT[,HOST:PORT...]")]
    pub kv_cluster: Option<String>,
    /// File holding the --kv-cluster password (one line), instead of FASTLANE_REDIS_PASSWORD.
    /// Refused when its group or others may read it (chmod 600). The user, if not `default`,
    /// comes from FASTLANE_REDIS_USERNAME.
    #[arg(long, value_name = "PATH", requires = "kv_cluster")]
    pub kv_cluster_password_file: Option<PathBuf>,
    /// PEM file of the CA that signed the cluster nodes' certificates, trusted for
    /// --kv-cluster rediss://… instead of the system's roots (which are used without it).
    #[arg(long, value_name = "PATH", requires = "kv_cluster")]
    pub kv_cluster_ca: Option<PathBuf>,
}

impl EngineArgs {
    /// The model, loaded (and a warning when it is a random one).
    pub fn load_model(&self) -> Result<Arc<Model>> {
        let t0 = Instant::now();
        let m = Model::load(&self.model, self.model_seed)
            .with_context(|| format!("loading {}", self.model))?;
        log::info!(
            "model {}: {} parameters, {} layers, {:.0} MB of f32 weights, loaded in {:.2}s, kernels {}",
            m.name(),
            m.config().parameters(),
            m.config().num_hidden_layers,
            m.weight_bytes() as f64 / 1e6,
            t0.elapsed().as_secs_f64(),
            crate::kernels::isa()
        );
        if m.is_random() {
            eprintln!(
                "note: {} has random weights: it is not a language model, its text means nothing",
                m.name()
            );
        }
        Ok(Arc::new(m))
    }

    /// The engine configuration these flags describe (`generate`'s defaults: policy fifo).
    pub fn engine_config(&self) -> Result<EngineConfig> {
        self.config_with(Policy::Fifo)
    }

    /// [`EngineArgs::engine_config`] with `default_policy` where `--policy` is not given.
    fn config_with(&self, default_policy: Policy) -> Result<EngineConfig> {
        let policy: Policy = match &self.policy {
            Some(p) => p.parse().map_err(|e| anyhow::anyhow!("--policy: {e}"))?,
            None => default_policy,
        };
        let preempt: PreemptChoice =
            self.preempt.parse().map_err(|e| anyhow::anyhow!("--preempt: {e}"))?;
        let size = |s: &str, flag: &str| {
            fastlane_util::parse_size(s).map_err(|e| anyhow::anyhow!("{flag}: {e}"))
        };
        if self.device_blocks == 0 {
            bail!("--device-blocks must be at least 1");
        }
        let mut cfg = EngineConfig {
            policy,
            preempt,
            device_blocks: self.device_blocks,
            chunk_tokens: Some(self.chunk.unwrap_or(256)).filter(|&c| c > 0),
            batch_tokens_max: self.batch_tokens.unwrap_or(512).max(1),
            protect: match self.protect.as_deref() {
                None | Some("off") => None,
                Some("on") if policy == Policy::Fifo => {
                    bail!("--protect on needs --policy drr or drr+preempt (fifo has no buckets)")
                }
                Some("on") => Some(SERVE_PROTECT),
                Some(o) => bail!("--protect {o:?}: on or off"),
            },
            tier_steps: self.tier_steps.parse().map_err(|e| anyhow::anyhow!("--tier-steps {e}"))?,
            mixed_batch_tokens: self.mixed_batch_tokens.filter(|&t| t > 0),
            ..EngineConfig::default()
        };
        cfg.swap.host_bytes = size(&self.host_bytes, "--host-bytes")?;
        cfg.swap.nvme = self
            .nvme
            .as_ref()
            .map(|p| {
                Ok::<_, anyhow::Error>(NvmeTierConfig {
                    path: p.clone(),
                    bytes: size(&self.nvme_bytes, "--nvme-bytes")?,
                    depth: 32,
                })
            })
            .transpose()?;
        cfg.swap.remote = self
            .remote
            .map(|addr| {
                Ok::<_, anyhow::Error>(RemoteTierConfig {
                    device: self.rdma_device.clone(),
                    addr,
                    bytes: size(&self.remote_bytes, "--remote-bytes")?,
                })
            })
            .transpose()?;
        cfg.preemptible_steps = match self.preemptible_steps.as_str() {
            "on" => true,
            "off" => false,
            o => bail!("--preemptible-steps {o:?}: on or off"),
        };
        cfg.prefix.enabled = match self.prefix_cache.as_str() {
            "on" => true,
            "off" => false,
            o => bail!("--prefix-cache {o:?}: on or off"),
        };
        cfg.prefix.host_bytes =
            usize::try_from(size(&self.prefix_cache_bytes, "--prefix-cache-bytes")?)
                .context("--prefix-cache-bytes: too large")?;
        if let Some(path) = &self.prefix_cache_nvme {
            if !cfg.prefix.enabled {
                bail!("--prefix-cache-nvme needs --prefix-cache on");
            }
            let bytes = size(&self.prefix_cache_nvme_bytes, "--prefix-cache-nvme-bytes")?;
            if bytes == 0 {
                bail!("--prefix-cache-nvme-bytes must be more than 0");
            }
            cfg.prefix.nvme = Some(fastlane_kvswap::PrefixNvmeConfig::new(path.clone(), bytes));
        }
        if let Some(urls) = &self.kv_cluster {
            cfg.prefix.cluster = fastlane_kvswap::daemon::parse_cluster_urls(urls)?;
            if !cfg.prefix.enabled {
                bail!("--kv-cluster needs --prefix-cache on");
            }
            cfg.prefix.cluster_access = fastlane_kvswap::ClusterAccess::load(
                self.kv_cluster_password_file.as_deref(),
                self.kv_cluster_ca.as_deref(),
            )?;
        }
        Ok(cfg)
    }

    /// The engine configuration of `llm serve`: [`EngineArgs::engine_config`] with the
    /// serving defaults where the flags are not given: policy drr, 64-token prefill chunks and
    /// 128-token steps (BENCHMARKS.md, serving: the quiet tenant's P99 TTFT is its solo TTFT
    /// plus the step in flight), latency protection on unless the policy is fifo.
    pub fn serve_config(&self) -> Result<EngineConfig> {
        let mut cfg = self.config_with(Policy::Drr)?;
        if self.chunk.is_none() {
            cfg.chunk_tokens = Some(64);
        }
        if self.batch_tokens.is_none() {
            cfg.batch_tokens_max = 128;
        }
        if self.mixed_batch_tokens.is_none() {
            cfg.mixed_batch_tokens = Some(SERVE_MIXED_BATCH_TOKENS);
        }
        if self.protect.is_none() && cfg.policy != Policy::Fifo {
            cfg.protect = Some(SERVE_PROTECT);
        }
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::{EngineArgs, EngineConfig, Policy};

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        engine: EngineArgs,
    }

    fn engine(args: &[&str]) -> Result<EngineConfig, String> {
        let cli = Cli::try_parse_from(std::iter::once("t").chain(args.iter().copied()))
            .map_err(|e| e.to_string())?;
        cli.engine.engine_config().map_err(|e| e.to_string())
    }

    #[test]
    fn every_duration_and_size_flag_is_checked_not_panicked_on() {
        #[derive(Debug, Parser)]
        struct Http {
            #[command(flatten)]
            http: super::HttpArgs,
        }
        let check = |args: &[&str]| -> Result<(), String> {
            let h = Http::try_parse_from(std::iter::once("t").chain(args.iter().copied()))
                .map_err(|e| e.to_string())?
                .http;
            h.options().map_err(|e| e.to_string())?;
            h.body_limits().map(|_| ()).map_err(|e| e.to_string())
        };
        assert_eq!(check(&[]), Ok(()));
        for flag in
            ["--header-timeout-seconds", "--body-timeout-seconds", "--client-write-timeout-seconds"]
        {
            for bad in ["1e30", "0", "-1", "NaN", "inf", "604801"] {
                let e = check(&[&format!("{flag}={bad}")]).unwrap_err();
                assert!(e.contains(flag) && e.contains("at most"), "{flag} {bad}: {e}");
            }
            assert_eq!(check(&[flag, "604800"]), Ok(()));
        }
        let e = check(&["--drain-seconds", "18446744073709551615"]).unwrap_err();
        assert!(e.contains("--drain-seconds"), "{e}");
        for bad in ["0", "2G", "lots"] {
            let e = check(&["--max-body-bytes", bad]).unwrap_err();
            assert!(e.contains("--max-body-bytes"), "{bad}: {e}");
        }
        assert!(check(&["--max-connections", "0"]).unwrap_err().contains("--max-connections"));
    }

    #[test]
    fn preemptible_steps_flag() {
        let cfg = |args: &[&str]| {
            let cli = Cli::try_parse_from(std::iter::once("fastlane").chain(args.iter().copied()));
            cli.unwrap().engine.engine_config()
        };
        assert!(cfg(&[]).unwrap().preemptible_steps, "on by default");
        assert!(cfg(&["--preemptible-steps", "on"]).unwrap().preemptible_steps);
        assert!(!cfg(&["--preemptible-steps", "off"]).unwrap().preemptible_steps);
        let err = cfg(&["--preemptible-steps", "yes"]).unwrap_err().to_string();
        assert!(err.contains("on or off"), "{err}");
    }

    #[test]
    fn tier_steps_flag() {
        use fastlane_sched::TierSteps;
        let cfg = |args: &[&str]| {
            let cli = Cli::try_parse_from(std::iter::once("fastlane").chain(args.iter().copied()));
            cli.unwrap().engine.engine_config()
        };
        assert_eq!(cfg(&[]).unwrap().tier_steps, TierSteps::SEPARATE, "separate by default");
        assert_eq!(cfg(&["--tier-steps", "shared"]).unwrap().tier_steps, TierSteps::Shared);
        let err = cfg(&["--tier-steps", "mixed"]).unwrap_err().to_string();
        assert!(err.contains("--tier-steps") && err.contains("shared or separate"), "{err}");
    }

    #[test]
    fn serve_defaults_apply_only_where_no_flag_is_given() {
        let serve = |args: &[&str]| {
            let cli = Cli::try_parse_from(std::iter::once("t").chain(args.iter().copied()));
            cli.unwrap().engine.serve_config().unwrap()
        };
        let c = serve(&[]);
        assert_eq!((c.policy, c.chunk_tokens, c.batch_tokens_max), (Policy::Drr, Some(64), 128));
        let c = serve(&["--policy", "fifo", "--chunk", "0", "--batch-tokens", "512"]);
        assert_eq!((c.policy, c.chunk_tokens, c.batch_tokens_max), (Policy::Fifo, None, 512));
        let g = engine(&[]).unwrap();
        assert_eq!((g.policy, g.chunk_tokens, g.batch_tokens_max), (Policy::Fifo, Some(256), 512));
        // The mixed-step bound: 8 for serve, none for generate; 0 turns it off.
        assert_eq!(serve(&[]).mixed_batch_tokens, Some(super::SERVE_MIXED_BATCH_TOKENS));
        assert_eq!(serve(&["--mixed-batch-tokens", "32"]).mixed_batch_tokens, Some(32));
        assert_eq!(serve(&["--mixed-batch-tokens", "0"]).mixed_batch_tokens, None);
        assert_eq!(g.mixed_batch_tokens, None);
    }

    #[test]
    fn protect_flag_is_on_for_serve_unless_fifo_or_off() {
        let serve = |args: &[&str]| {
            let cli = Cli::try_parse_from(std::iter::once("t").chain(args.iter().copied()));
            cli.unwrap().engine.serve_config()
        };
        assert_eq!(serve(&[]).unwrap().protect, Some(super::SERVE_PROTECT));
        assert_eq!(serve(&["--protect"]).unwrap().protect, Some(super::SERVE_PROTECT));
        assert_eq!(serve(&["--protect", "off"]).unwrap().protect, None);
        assert_eq!(serve(&["--policy", "fifo"]).unwrap().protect, None);
        let e = serve(&["--policy", "fifo", "--protect", "on"]).unwrap_err().to_string();
        assert!(e.contains("--protect on needs --policy drr"), "{e}");
        let e = serve(&["--protect", "yes"]).unwrap_err().to_string();
        assert!(e.contains("on or off"), "{e}");
        assert_eq!(engine(&[]).unwrap().protect, None, "generate: off");
    }

    #[test]
    fn prefix_cache_nvme_flags() {
        assert_eq!(engine(&[]).unwrap().prefix.nvme, None);
        let c = engine(&["--prefix-cache-nvme", "/x/kv.cache"]).unwrap();
        let n = c.prefix.nvme.expect("an NVMe tier");
        assert_eq!((n.path.as_path(), n.bytes), (std::path::Path::new("/x/kv.cache"), 1 << 30));
        let c = engine(&["--prefix-cache-nvme", "/x", "--prefix-cache-nvme-bytes", "64M"]).unwrap();
        assert_eq!(c.prefix.nvme.expect("an NVMe tier").bytes, 64 << 20);
        let e = engine(&["--prefix-cache-nvme-bytes", "64M"]).unwrap_err();
        assert!(e.contains("--prefix-cache-nvme <PATH>"), "{e}");
        let e = engine(&["--prefix-cache-nvme", "/x", "--prefix-cache-nvme-bytes", "lots"]);
        assert!(e.unwrap_err().starts_with("--prefix-cache-nvme-bytes: "));
        let e = engine(&["--prefix-cache-nvme", "/x", "--prefix-cache-nvme-bytes", "0"]);
        assert!(e.unwrap_err().contains("more than 0"));
        let e = engine(&["--prefix-cache", "off", "--prefix-cache-nvme", "/x"]).unwrap_err();
        assert_eq!(e, "--prefix-cache-nvme needs --prefix-cache on");
    }

    #[test]
    fn kv_cluster_flags() {
        let c = engine(&["--kv-cluster", "rediss://a:1,b:2"]).unwrap();
        assert_eq!(c.prefix.cluster, ["rediss://a:1", "rediss://b:2"]);
        let e = engine(&["--kv-cluster", "redis://u:p4ss@a:1"]).unwrap_err();
        assert!(e.contains("never the command line") && !e.contains("p4ss"), "{e}");
        let e = engine(&["--kv-cluster-ca", "/ca.pem"]).unwrap_err();
        assert!(e.contains("--kv-cluster <redis[s]://"), "{e}");
        let e = engine(&["--kv-cluster", "rediss://a:1", "--kv-cluster-ca", "/nonexistent.pem"])
            .unwrap_err();
        assert!(e.starts_with("--kv-cluster-ca /nonexistent.pem"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        let pw = dir.path().join("pw");
        std::fs::write(&pw, "s3cret\n").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&pw, std::fs::Permissions::from_mode(0o644)).unwrap();
        let pw_flag = pw.to_str().unwrap();
        let args = ["--kv-cluster", "redis://a:1", "--kv-cluster-password-file", pw_flag];
        let e = engine(&args).unwrap_err();
        assert!(e.contains("readable by its group or others"), "{e}");
        std::fs::set_permissions(&pw, std::fs::Permissions::from_mode(0o600)).unwrap();
        let c = engine(&args).unwrap();
        assert_eq!(c.prefix.cluster_access.password.as_deref(), Some("s3cret"));
    }
}
