//! What the engine sets up before its loop runs: the preemption cost model, the prefix store
//! and its lookup thread, and the start-up calibration of prefill and swap costs.

use super::*;

pub(super) fn costs_for(
    choice: PreemptChoice,
    prefill_ns: f64,
    swap_ns: f64,
    block_bytes: usize,
) -> PreemptCosts {
    let kv_bytes_per_token = (block_bytes / TOKENS_PER_BLOCK) as u64;
    let (prefill, swap) = match choice {
        PreemptChoice::Auto => (prefill_ns, swap_ns),
        // A recompute that costs "forever" / a swap that does.
        PreemptChoice::Swap => (1e15, swap_ns),
        PreemptChoice::Recompute => (0.0, 1e15),
    };
    PreemptCosts {
        prefill_ns_per_token: prefill,
        swap_ns_per_byte: swap,
        swap_fixed_ns: 20_000,
        kv_bytes_per_token,
    }
}

/// The digest every block key of `model` starts from: its id and KV geometry.
pub fn block_digest(model: &Model) -> ModelDigest {
    ModelDigest::new(&model.model_id(), &model.kv_geometry())
}

/// The keys of the full blocks of `prompt` for `model` in prefix `namespace` (a tenant's
/// prefix group; `default` without tenants), as the prefix cache names them.
pub fn prefix_keys(model: &Model, namespace: &str, prompt: &[u32]) -> Vec<BlockKey> {
    let digest = block_digest(model).in_namespace(namespace);
    fastlane_kvswap::prefix_keys(&digest, prompt, model.kv_geometry().tokens_per_block)
}

/// The digest of each tenant's namespace (`namespaces[i]`, or the tenant's name when
/// `namespaces` is empty), by tenant index.
pub(super) fn tenant_digests(
    model: &Model,
    tenants: &[TenantConfig],
    namespaces: &[String],
) -> Result<Vec<ModelDigest>, LlmError> {
    if !namespaces.is_empty() && namespaces.len() != tenants.len() {
        return Err(LlmError::BadRequest {
            reason: format!(
                "prefix: {} tenant namespaces for {} tenants",
                namespaces.len(),
                tenants.len()
            ),
        });
    }
    let base = block_digest(model);
    Ok(tenants
        .iter()
        .enumerate()
        .map(|(i, t)| base.in_namespace(namespaces.get(i).map_or(&t.name, |n| n)))
        .collect())
}

/// The engine's block store: a host cache, the NVMe tier when one is configured (an error
/// opening it fails the engine's start), and the cluster tier when one is configured and
/// reachable (when it is not, a warning, and the local tiers alone). A cluster that refuses
/// the credentials or fails the TLS handshake, or a configuration the tier refuses, fails the
/// start: that is a mistake to fix, not an outage to ride out.
pub(super) fn prefix_store(
    cfg: &EngineConfig,
    geom: &fastlane_kvswap::KvGeometry,
) -> Result<PrefixStore, LlmError> {
    let pc = &cfg.prefix;
    let scfg = fastlane_kvswap::PrefixStoreConfig {
        host_bytes: pc.host_bytes,
        block_bytes: crate::kv::block_bytes(geom),
        put_queue_max: fastlane_kvswap::prefix::PUT_QUEUE_MAX,
        nvme: pc.nvme.clone(),
    };
    let local = |scfg: fastlane_kvswap::PrefixStoreConfig| {
        PrefixStore::open(scfg).map_err(|e| LlmError::PrefixCache { reason: e.to_string() })
    };
    if pc.cluster.is_empty() {
        return local(scfg);
    }
    let t = pc.cluster_timeout.max(Duration::from_millis(4));
    let ccfg = fastlane_kvswap::cluster::ClusterTierConfig {
        namespace: pc.cluster_namespace.clone(),
        timeout: t,
        connect_timeout: t / 4,
        response_timeout: t / 2,
        access: pc.cluster_access.clone(),
        ..fastlane_kvswap::cluster::ClusterTierConfig::default()
    };
    use fastlane_kvswap::cluster::ClusterTierError as E;
    let tier = match fastlane_kvswap::cluster::ClusterTier::connect(&pc.cluster, ccfg) {
        Ok(t) => t,
        Err(e @ (E::Auth { .. } | E::Tls { .. } | E::BadConfig { .. })) => {
            return Err(LlmError::PrefixCache { reason: format!("--kv-cluster: {e}") });
        }
        Err(e) => {
            log::warn!(
                "prefix cache: cluster {:?} unreachable ({e}); local tiers only",
                pc.cluster
            );
            return local(scfg);
        }
    };
    match PrefixStore::with_cluster(scfg.clone(), tier) {
        Ok(s) => Ok(s),
        Err(e) => {
            // The NVMe tier failing again is the engine's error; else the cluster's writer
            // thread was the trouble.
            let s = local(scfg)?;
            log::warn!("prefix cache: cluster not used ({e}); local tiers only");
            Ok(s)
        }
    }
}

/// The lookup thread: a new request's full prompt blocks are keyed in its tenant's namespace
/// (`digests[tenant]`; a tenant without one gets no keys: nothing looked up or stored) and the
/// longest run of leading cached blocks found (never the block of the last prompt token: it is
/// always computed, so its logits exist); every command goes on to the engine in order. With
/// preemptible steps it counts the interactive submissions it forwards (`arrivals`).
pub(super) fn lookup_loop(
    rx: &Receiver<Command>,
    tx: &Sender<Command>,
    store: &PrefixStore,
    digests: &[ModelDigest],
    seconds: &prometheus::Histogram,
    arrivals: Option<&Arrivals>,
) {
    // Ends when the engine handle is gone or after forwarding a shutdown.
    while let Ok(mut c) = rx.recv() {
        let shutdown = matches!(c, Command::Shutdown);
        let mut submitted = None;
        if let Command::Submit { req, prefix, protected, .. } = &mut c {
            *protected = arrivals.is_some_and(|a| a.is_protected(req.tenant));
            submitted = Some((req.tenant, *protected));
            if let Some(digest) = digests.get(req.tenant) {
                prefix.keys =
                    fastlane_kvswap::prefix_keys(digest, &req.prompt, TOKENS_PER_BLOCK as u32);
            }
            let usable =
                (req.prompt.len().saturating_sub(1) / TOKENS_PER_BLOCK).min(prefix.keys.len());
            if usable > 0 {
                let t0 = Instant::now();
                prefix.blocks = store.lookup(&prefix.keys[..usable]);
                seconds.observe(t0.elapsed().as_secs_f64());
            }
        }
        let traced = match &c {
            Command::Submit { id, at, .. } => Some((*id, *at)),
            _ => None,
        };
        if tx.send(c).is_err() || shutdown {
            return;
        }
        if let Some((id, at)) = traced {
            tracing::trace!(
                event = "lookup_forwarded",
                id,
                waited_us = at.elapsed().as_micros() as u64,
                "engine: forwarded after the prefix lookup"
            );
        }
        if let (Some(a), Some((tenant, protected))) = (arrivals, submitted) {
            a.sent(tenant, protected);
        }
    }
}

/// One 64-token prefill (after a warm-up) into scratch blocks of the pool, timed.
pub(super) fn measure_prefill_ns_per_token(
    model: &Model,
    pool: &KvPool,
    s: &mut Scratch,
) -> Result<f64, LlmError> {
    let n = 64usize.min(model.max_positions());
    let blocks: Vec<BlockId> =
        (0..n.div_ceil(TOKENS_PER_BLOCK).min(pool.blocks() as usize) as u32).map(BlockId).collect();
    let n = n.min(blocks.len() * TOKENS_PER_BLOCK);
    let tokens: Vec<u32> = (0..n as u32).map(|i| i % model.vocab() as u32).collect();
    let item = [BatchItem { tokens: &tokens, start_pos: 0, blocks: &blocks, want_logits: true }];
    model.forward(&item, pool, s)?;
    let t0 = Instant::now();
    model.forward(&item, pool, s)?;
    Ok(t0.elapsed().as_nanos() as f64 / n as f64)
}

/// The context at which one token's attention costs what the rest of its pass does, measured
/// (what the scheduler prices a batch token at a long context by,
/// [`SchedConfig::attention_context`](fastlane_sched::SchedConfig::attention_context)): the
/// same 16-token prefill at position 0 and at a long position `L`, each the faster of two,
/// into scratch blocks of the pool. `None` when the model or the pool is too short for `L` of
/// at least 256, or the two do not differ measurably.
pub(super) fn measure_attention_context(
    model: &Model,
    pool: &KvPool,
    s: &mut Scratch,
) -> Result<Option<u32>, LlmError> {
    const N: usize = 16;
    let capacity = (pool.blocks() as usize * TOKENS_PER_BLOCK).min(model.max_positions());
    let long = capacity.saturating_sub(N).min(2048) / TOKENS_PER_BLOCK * TOKENS_PER_BLOCK;
    if long < 256 {
        return Ok(None);
    }
    let blocks: Vec<BlockId> =
        (0..(long + N).div_ceil(TOKENS_PER_BLOCK) as u32).map(BlockId).collect();
    let tokens: Vec<u32> = (0..N as u32).map(|i| (i * 7 + 3) % model.vocab() as u32).collect();
    let mut time_at = |start_pos: usize| -> Result<u64, LlmError> {
        let item = [BatchItem { tokens: &tokens, start_pos, blocks: &blocks, want_logits: true }];
        let mut best = u64::MAX;
        for _ in 0..2 {
            let t0 = Instant::now();
            model.forward(&item, pool, s)?;
            best = best.min(t0.elapsed().as_nanos() as u64);
        }
        Ok(best)
    };
    time_at(0)?; // warm-up
    let (short_ns, long_ns) = (time_at(0)?, time_at(long)?);
    Ok(attention_context_from(short_ns, long_ns, long))
}

/// `A` in the scheduler's price `1 + c / A` of a token at context `c`, from one pass's time at
/// context about 0 and at context `long`: `long / (long_ns / short_ns - 1)`. `None` when the
/// long pass is not measurably (2 %) slower.
pub(super) fn attention_context_from(short_ns: u64, long_ns: u64, long: usize) -> Option<u32> {
    let ratio = long_ns as f64 / short_ns.max(1) as f64;
    (ratio > 1.02)
        .then(|| (long as f64 / (ratio - 1.0)).round().clamp(1.0, f64::from(u32::MAX)) as u32)
}

/// The host tier's copy cost on this machine (kvswap's calibration, 8 blocks, 3 rounds).
pub(super) fn measure_swap_ns_per_byte(block_bytes: usize) -> f64 {
    match fastlane_sched::sim::calibrate_host_tier(block_bytes, 8, 3) {
        Ok(c) => c.ns_per_byte(),
        Err(e) => {
            log::warn!("engine: host tier calibration failed ({e}); assuming 0.1 ns/byte");
            0.1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenant(name: &str) -> TenantConfig {
        TenantConfig {
            name: name.into(),
            tier: Tier::Interactive,
            bucket_capacity: 1.0,
            rpm: 1.0,
            concurrency_max: 1,
            weight: 1,
            overflow: Overflow::Queue { depth_max: 1 },
        }
    }

    #[test]
    fn tenants_key_the_same_tokens_apart_unless_they_share_a_group() {
        let model = Model::load("random:tiny", 7).expect("random:tiny loads");
        let tenants = [tenant("alpha"), tenant("beta"), tenant("gamma")];
        let groups: Vec<String> = ["shared", "beta", "shared"].map(String::from).to_vec();
        let d = tenant_digests(&model, &tenants, &groups).expect("one namespace per tenant");
        let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % model.vocab() as u32).collect();
        let keys: Vec<Vec<BlockKey>> = d
            .iter()
            .map(|d| fastlane_kvswap::prefix_keys(d, &prompt, TOKENS_PER_BLOCK as u32))
            .collect();
        assert_eq!(keys[0].len(), 2, "two full blocks");
        assert_ne!(keys[0][0], keys[1][0], "alpha and beta: the first block apart");
        assert_ne!(keys[0][1], keys[1][1]);
        assert_eq!(keys[0], keys[2], "alpha and gamma share the group");
        // The public helper names the engine's keys.
        assert_eq!(prefix_keys(&model, "shared", &prompt), keys[0]);
        assert_eq!(prefix_keys(&model, "beta", &prompt), keys[1]);
        // No namespaces given: each tenant's name.
        let by_name = tenant_digests(&model, &tenants, &[]).expect("names");
        assert_eq!(by_name[1], d[1], "beta's group is its name");
        assert_ne!(by_name[0], by_name[2]);
        // One namespace per tenant or none.
        let e = tenant_digests(&model, &tenants, &groups[..2]).unwrap_err();
        assert!(e.to_string().contains("2 tenant namespaces for 3 tenants"), "{e}");
    }

    #[test]
    fn attention_context_is_the_context_that_doubles_a_token() {
        // Twice as long at 1,024: a token there costs 1 + 1,024 / A = 2, so A = 1,024.
        assert_eq!(attention_context_from(1_000, 2_000, 1_024), Some(1_024));
        assert_eq!(attention_context_from(1_000, 5_000, 2_048), Some(512));
        // 10 % slower at 2,048 is measurable: attention is cheap, A is long.
        assert_eq!(attention_context_from(1_000, 1_100, 2_048), Some(20_480));
        // Not measurably slower (or faster): no estimate.
        assert_eq!(attention_context_from(1_000, 1_010, 2_048), None);
        assert_eq!(attention_context_from(1_000, 900, 2_048), None);
        assert_eq!(attention_context_from(0, 0, 2_048), None);
    }

    #[test]
    fn attention_context_is_measured_on_a_long_enough_pool() {
        let model = Model::load("random:tiny", 7).expect("random:tiny loads");
        let geom = model.kv_geometry();
        let mut s = Scratch::default();
        let short = KvPool::new(&geom, 8).expect("pool");
        let got = measure_attention_context(&model, &short, &mut s).expect("forward");
        assert_eq!(got, None, "8 blocks hold 128 tokens: too short to measure");
        let pool = KvPool::new(&geom, 160).expect("pool");
        let a = measure_attention_context(&model, &pool, &mut s).expect("forward");
        let a = a.expect("a 2,048-token context is measurably slower than position 0");
        assert!((1..=1 << 20).contains(&a), "attention context {a}");
    }
}
