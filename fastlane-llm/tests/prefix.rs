//! Prefix reuse end to end on `random:tiny`: requests whose prompts share leading blocks load
//! them from the host cache or from a real Redis Cluster (six `redis-server`s, shared by two
//! engines) instead of prefilling them, and produce exactly the token ids and logits bits of
//! an engine without reuse; corrupted or absent cluster blocks, and a cluster that is down,
//! are misses and generation stays correct within a bounded time.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use fastlane_kvswap::testing::RedisCluster;
use fastlane_llm::engine::{prefix_keys, PrefixConfig};
use fastlane_llm::{Engine, EngineConfig, EngineCounters, FinishReason, GenRequest, Model};

const WAIT: Duration = Duration::from_secs(120);
const MAX_TOKENS: u32 = 12;
/// Full blocks every prompt of a family shares.
const SHARED_BLOCKS: usize = 3;

fn model() -> Arc<Model> {
    static M: OnceLock<Arc<Model>> = OnceLock::new();
    M.get_or_init(|| Arc::new(Model::load("random:tiny", 7).expect("random:tiny loads"))).clone()
}

/// A prompt of `SHARED_BLOCKS` × 16 tokens shared by its `family`, then `tail` distinct ones.
fn prompt(family: u32, tail: usize, variant: u32) -> Vec<u32> {
    let vocab = model().vocab() as u32;
    let mut p: Vec<u32> = (0..(SHARED_BLOCKS * 16) as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ family.wrapping_mul(40_503)) % vocab)
        .collect();
    p.extend((0..tail as u32).map(|i| (i * 31 + variant * 977 + 5) % vocab));
    p
}

fn request(p: Vec<u32>) -> GenRequest {
    let mut r = GenRequest::greedy(p, MAX_TOKENS);
    r.digest_logits = true;
    r
}

fn config(prefix: PrefixConfig) -> EngineConfig {
    EngineConfig { device_blocks: 256, prefix, ..EngineConfig::default() }
}

fn off() -> EngineConfig {
    config(PrefixConfig { enabled: false, ..PrefixConfig::default() })
}

fn with_cluster(c: &RedisCluster, namespace: &str) -> EngineConfig {
    config(PrefixConfig {
        cluster: c.urls(),
        cluster_namespace: namespace.into(),
        cluster_timeout: Duration::from_millis(500),
        ..PrefixConfig::default()
    })
}

/// Runs `p` alone on `e`: token ids, logits digest, and the prefill tokens it cost.
fn run(e: &Engine, p: &[u32]) -> (Vec<u32>, Option<u64>, u64) {
    // The previous request's last counters were waited for: this snapshot is current.
    let before = e.counters();
    let f = e.submit(request(p.to_vec())).expect("submit").wait(WAIT).expect("finishes");
    assert_eq!(f.reason, FinishReason::Length);
    assert_eq!(f.token_ids.len(), MAX_TOKENS as usize);
    // Counters are published at the end of the step whose events ended the stream.
    let after = wait_counters(e, |c| c.finished == before.finished + 1 && c.live == 0);
    assert_eq!(after.finished, before.finished + 1, "counters published");
    (f.token_ids, f.logits_digest, after.prefill_tokens - before.prefill_tokens)
}

/// The engine's counters once `ok` holds (bounded wait).
fn wait_counters(e: &Engine, ok: impl Fn(&EngineCounters) -> bool) -> EngineCounters {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let c = e.counters();
        if ok(&c) || Instant::now() > deadline {
            return c;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Outputs of prompts on an engine without prefix reuse (the reference).
fn reference(prompts: &[Vec<u32>]) -> Vec<(Vec<u32>, Option<u64>, u64)> {
    let e = Engine::start(model(), off()).expect("engine starts");
    let out = prompts.iter().map(|p| run(&e, p)).collect();
    let c = e.shutdown().expect("clean shutdown");
    assert!(c.prefix_cache.is_none());
    assert_eq!(c.prefix_reused_tokens, 0);
    out
}

fn start_cluster() -> RedisCluster {
    RedisCluster::start().unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn host_cache_reuse_gives_the_same_tokens_with_fewer_prefill_tokens() {
    // A computes the shared blocks; B and C share them with other tails (C's prompt is a
    // whole number of blocks: its last block is still computed); A again hits all 3 blocks.
    let a = prompt(1, 10, 0);
    let b = prompt(1, 13, 1);
    let c = prompt(1, 16, 2);
    let prompts = vec![a.clone(), b.clone(), c.clone(), a.clone()];
    let want = reference(&prompts);
    assert_eq!(want[0].0, want[3].0);
    let e = Engine::start(model(), config(PrefixConfig::default())).expect("engine starts");
    let got: Vec<_> = prompts.iter().map(|p| run(&e, p)).collect();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.0, w.0, "prompt {i}: token ids");
        assert_eq!(g.1, w.1, "prompt {i}: logits bits");
    }
    // Prefill cost: A all of it; B and C only their tails (C: its 4th block, 16 tokens); A
    // again its 10-token tail.
    assert_eq!(want.iter().map(|w| w.2).collect::<Vec<_>>(), vec![58, 61, 64, 58]);
    assert_eq!(got.iter().map(|g| g.2).collect::<Vec<_>>(), vec![58, 13, 16, 10]);
    let k = e.shutdown().expect("clean shutdown");
    assert_eq!(k.prefix_hit_requests, 3);
    assert_eq!(k.prefix_reused_tokens, 3 * 48);
    // Stored: A's 3 shared blocks, C's 4th block (B's and A's tails are partial blocks).
    assert_eq!(k.prefix_stored_blocks, 4);
    let s = k.prefix_cache.expect("prefix cache on");
    assert_eq!(s.lookups, 4);
    assert_eq!(s.blocks_looked_up, 12, "3 usable blocks each");
    assert_eq!(s.host_hits, 9);
    assert_eq!(s.misses, 3);
    assert_eq!(s.cluster_hits, 0);
    assert_eq!(s.host_blocks, 4);
    assert_eq!(s.host_bytes, 4 * k.block_bytes);
    assert_eq!(s.evictions, 0);
    assert_eq!(k.blocks_free, k.blocks_total);
}

#[test]
fn concurrent_requests_and_a_tiny_host_cache_stay_exact() {
    // A host cache of 3 blocks for two families of 3-block prefixes: each family's blocks
    // evict the other's; requests in flight together; chunked prefill of 16.
    let prompts: Vec<Vec<u32>> = (0..8).map(|i| prompt(2 + i % 2, 5 + i as usize * 3, i)).collect();
    let want = reference(&prompts);
    let cfg = EngineConfig {
        chunk_tokens: Some(16),
        ..config(PrefixConfig { host_bytes: 3 * 64 * 1024, ..PrefixConfig::default() })
    };
    let e = Engine::start(model(), cfg).expect("engine starts");
    let first = run(&e, &prompts[0]);
    assert_eq!((first.0.as_slice(), first.1), (want[0].0.as_slice(), want[0].1));
    let streams: Vec<_> =
        prompts[1..].iter().map(|p| e.submit(request(p.clone())).expect("submit")).collect();
    for (i, s) in streams.iter().enumerate() {
        let f = s.wait(WAIT).expect("finishes");
        assert_eq!(f.token_ids, want[i + 1].0, "prompt {}", i + 1);
        assert_eq!(f.logits_digest, want[i + 1].1, "prompt {}", i + 1);
    }
    let k = e.shutdown().expect("clean shutdown");
    let s = k.prefix_cache.expect("prefix cache on");
    assert!(s.evictions > 0, "{s:?}");
    assert!(s.host_blocks <= 3);
    assert!(s.host_hits > 0, "{s:?}");
    assert_eq!(k.blocks_free, k.blocks_total);
}

#[test]
fn blocks_evicted_to_the_nvme_tier_are_reused_bit_for_bit() {
    // A host cache of one block over an NVMe tier: A's 3 shared blocks are stored, two of
    // them spilled to the file; B finds all three there (read back, checked, promoted).
    let dir = tempfile::tempdir().expect("temporary directory");
    let a = prompt(7, 10, 0);
    let b = prompt(7, 13, 1);
    let want = reference(&[a.clone(), b.clone()]);
    let nvme = |path| Some(fastlane_kvswap::PrefixNvmeConfig::new(path, 1 << 20));
    let cfg = config(PrefixConfig {
        host_bytes: 64 * 1024,
        nvme: nvme(dir.path().join("prefix.nvme")),
        ..PrefixConfig::default()
    });
    let e = Engine::start(model(), cfg).expect("engine starts");
    assert_eq!(e.counters().block_bytes, 64 * 1024);
    let g1 = run(&e, &a);
    assert_eq!((g1.0.as_slice(), g1.1), (want[0].0.as_slice(), want[0].1));
    assert!(e.flush_prefix(Duration::from_secs(10)), "spills written");
    let s = e.prefix_stats().expect("on");
    assert_eq!((s.host_blocks, s.nvme_blocks, s.nvme_spills, s.evictions), (1, 2, 2, 2), "{s:?}");
    assert_eq!(s.nvme_capacity_blocks, 16);
    let g2 = run(&e, &b);
    assert_eq!(g2.0, want[1].0, "token ids");
    assert_eq!(g2.1, want[1].1, "logits bits");
    assert_eq!(g2.2, 13, "only the tail prefilled (reference: {})", want[1].2);
    let s = e.prefix_stats().expect("on");
    // The first NVMe hit's promotion evicts A's third block from the host (spilled, then
    // found on the NVMe side too).
    assert_eq!((s.host_hits, s.nvme_hits, s.misses), (0, 3, 3), "{s:?}");
    assert_eq!((s.integrity_misses, s.nvme_errors, s.nvme_spills_dropped), (0, 0, 0));
    let k = e.shutdown().expect("clean shutdown");
    assert_eq!(k.blocks_free, k.blocks_total);
    // An NVMe tier that cannot be opened fails the start, naming the file.
    let bad = dir.path().join("missing").join("prefix.nvme");
    let cfg = config(PrefixConfig { nvme: nvme(bad), ..PrefixConfig::default() });
    let Err(err) = Engine::start(model(), cfg) else { panic!("start succeeded") };
    assert!(err.to_string().contains("missing/prefix.nvme"), "{err}");
}

#[test]
fn two_engines_share_blocks_through_the_cluster() {
    let cluster = start_cluster();
    let a = prompt(4, 9, 0);
    let b = prompt(4, 20, 1);
    let want = reference(&[a.clone(), b.clone()]);
    let e1 = Engine::start(model(), with_cluster(&cluster, "share")).expect("engine 1 starts");
    assert!(e1.counters().prefix_cluster);
    let g1 = run(&e1, &a);
    assert_eq!((g1.0.as_slice(), g1.1), (want[0].0.as_slice(), want[0].1));
    assert!(e1.flush_prefix(Duration::from_secs(10)), "puts reach the cluster");
    let s1 = e1.prefix_stats().expect("on");
    assert_eq!(s1.cluster_puts, 3);
    assert_eq!(s1.bytes_out, 3 * e1.counters().block_bytes);
    assert_eq!(s1.puts_dropped + s1.put_errors, 0);
    // A second engine (its own, empty host cache) finds A's blocks in the cluster.
    let e2 = Engine::start(model(), with_cluster(&cluster, "share")).expect("engine 2 starts");
    let g2 = run(&e2, &b);
    assert_eq!(g2.0, want[1].0, "token ids");
    assert_eq!(g2.1, want[1].1, "logits bits");
    assert_eq!(g2.2, 20, "only the tail prefilled (reference: {})", want[1].2);
    let s2 = e2.prefix_stats().expect("on");
    // B has 4 usable blocks; A stored 3 of them.
    assert_eq!((s2.cluster_hits, s2.host_hits, s2.misses), (3, 0, 1), "{s2:?}");
    assert_eq!(s2.bytes_in, 3 * e2.counters().block_bytes);
    assert_eq!(s2.host_blocks, 4, "the 3 cluster hits land in the host cache, and B's 4th");
    // Again on engine 2: all 4 blocks from its host cache (B stored its 4th).
    let g3 = run(&e2, &b);
    assert_eq!(g3.0, want[1].0);
    assert_eq!(g3.2, 4);
    let s3 = e2.prefix_stats().expect("on");
    assert_eq!((s3.cluster_hits, s3.host_hits), (3, 4), "{s3:?}");
    // The other namespace sees nothing.
    let e3 = Engine::start(model(), with_cluster(&cluster, "other")).expect("engine 3 starts");
    let g4 = run(&e3, &b);
    assert_eq!(g4.0, want[1].0);
    assert_eq!(e3.prefix_stats().expect("on").cluster_hits, 0);
    for e in [e1, e2, e3] {
        let k = e.shutdown().expect("clean shutdown");
        assert_eq!(k.blocks_free, k.blocks_total);
    }
}

#[test]
fn corrupted_or_absent_cluster_blocks_are_misses() {
    let cluster = start_cluster();
    let a = prompt(5, 9, 0);
    let b = prompt(5, 11, 1);
    let want = reference(&[a.clone(), b.clone()]);
    let ns = "corrupt";
    let e1 = Engine::start(model(), with_cluster(&cluster, ns)).expect("engine 1 starts");
    run(&e1, &a);
    assert!(e1.flush_prefix(Duration::from_secs(10)));
    assert_eq!(e1.prefix_stats().expect("on").cluster_puts, 3);
    // No tenants: the engine's one tenant, `default`, is the namespace.
    let keys = prefix_keys(&model(), "default", &a);
    let rkey = |i: usize| format!("{ns}:{}", keys[i]);
    // Block 1 overwritten with something that is not a block: block 0 hits, the run stops.
    let out = cluster.cli(0, &["-c", "SET", &rkey(1), "not a kv block"]).expect("SET");
    assert!(out.contains("OK"), "{out}");
    let e2 = Engine::start(model(), with_cluster(&cluster, ns)).expect("engine 2 starts");
    let g = run(&e2, &b);
    assert_eq!((g.0.as_slice(), g.1), (want[1].0.as_slice(), want[1].1));
    assert_eq!(g.2, 11 + 32, "block 0 reused, blocks 1 and 2 recomputed");
    let s = e2.prefix_stats().expect("on");
    assert_eq!((s.cluster_hits, s.integrity_misses, s.misses), (1, 1, 2), "{s:?}");
    // Block 0 deleted: nothing is reused (a fresh engine, empty host cache).
    cluster.cli(0, &["-c", "DEL", &rkey(0)]).expect("DEL");
    let e3 = Engine::start(model(), with_cluster(&cluster, ns)).expect("engine 3 starts");
    let g = run(&e3, &b);
    assert_eq!((g.0.as_slice(), g.1), (want[1].0.as_slice(), want[1].1));
    assert_eq!(g.2, want[1].2, "all prefilled");
    let s = e3.prefix_stats().expect("on");
    assert_eq!((s.cluster_hits, s.host_hits, s.misses), (0, 0, 3), "{s:?}");
    for e in [e1, e2, e3] {
        let k = e.shutdown().expect("clean shutdown");
        assert_eq!(k.blocks_free, k.blocks_total);
    }
}

#[test]
fn cluster_down_means_misses_and_generation_goes_on() {
    let mut cluster = start_cluster();
    let a = prompt(6, 9, 0);
    let b = prompt(6, 12, 1);
    let want = reference(&[a.clone(), b.clone()]);
    // Host cache off so that every lookup goes to the cluster.
    let cfg = EngineConfig {
        prefix: PrefixConfig { host_bytes: 0, ..with_cluster(&cluster, "down").prefix },
        ..config(PrefixConfig::default())
    };
    let e = Engine::start(model(), cfg.clone()).expect("engine starts");
    assert!(e.counters().prefix_cluster);
    cluster.stop_all();
    let t0 = Instant::now();
    for (p, w) in [(&a, &want[0]), (&b, &want[1]), (&a, &want[0])] {
        let g = run(&e, p);
        assert_eq!((g.0.as_slice(), g.1, g.2), (w.0.as_slice(), w.1, w.2));
    }
    // Three lookups and a few puts, each bounded by the 500 ms timeout, plus the model.
    assert!(t0.elapsed() < Duration::from_secs(30), "took {:?}", t0.elapsed());
    e.flush_prefix(Duration::from_secs(10));
    let s = e.prefix_stats().expect("on");
    assert_eq!(s.lookups, 3);
    assert_eq!((s.host_hits, s.cluster_hits, s.misses), (0, 0, 9), "{s:?}");
    assert!(s.cluster_errors >= 1, "{s:?}");
    assert_eq!(s.cluster_puts, 0);
    assert!(s.put_errors + s.puts_dropped >= 3, "{s:?}");
    let k = e.shutdown().expect("clean shutdown");
    assert_eq!(k.blocks_free, k.blocks_total);
    // An engine started while the cluster is down runs with its host cache alone.
    let t0 = Instant::now();
    let e = Engine::start(model(), cfg).expect("engine starts without its cluster");
    assert!(t0.elapsed() < Duration::from_secs(10), "start took {:?}", t0.elapsed());
    assert!(!e.counters().prefix_cluster);
    let g = run(&e, &b);
    assert_eq!((g.0.as_slice(), g.1), (want[1].0.as_slice(), want[1].1));
    e.shutdown().expect("clean shutdown");
}

#[test]
fn a_primary_killed_under_load_costs_misses_never_a_wrong_token() {
    let mut cluster = start_cluster();
    // Four prefix families: their blocks spread over the three primaries' slots.
    let prompts: Vec<Vec<u32>> = (0..4).map(|f| prompt(20 + f, 7, f)).collect();
    let want = reference(&prompts);
    // Host cache off: every lookup and every put goes to the cluster.
    let cfg = EngineConfig {
        prefix: PrefixConfig { host_bytes: 0, ..with_cluster(&cluster, "failover").prefix },
        ..config(PrefixConfig::default())
    };
    let e = Engine::start(model(), cfg).expect("engine starts");
    assert!(e.counters().prefix_cluster);
    for (p, w) in prompts.iter().zip(&want) {
        let g = run(&e, p);
        assert_eq!((g.0.as_slice(), g.1), (w.0.as_slice(), w.1));
    }
    assert!(e.flush_prefix(Duration::from_secs(10)), "puts queued past 10 s");
    let primed = e.prefix_stats().expect("on");
    assert!(primed.cluster_puts >= 4 * SHARED_BLOCKS as u64, "{primed:?}");
    // Kill a primary while requests keep coming: every answer must equal the reference,
    // whether its blocks came from the cluster, were lost with the primary, or timed out.
    let victim = cluster.primaries().expect("primaries")[0];
    cluster.kill(victim);
    let t0 = Instant::now();
    let mut rounds = 0;
    // Bounded in count and time: at least through the failover (a few seconds here).
    while rounds < 40
        && (rounds < 8 || cluster.wait_failover(victim, Duration::from_millis(1)).is_err())
    {
        assert!(t0.elapsed() < Duration::from_secs(90), "failover + requests took too long");
        let i = rounds % prompts.len();
        let g = run(&e, &prompts[i]);
        assert_eq!((g.0.as_slice(), g.1), (want[i].0.as_slice(), want[i].1), "round {rounds}");
        rounds += 1;
    }
    cluster.wait_failover(victim, Duration::from_secs(30)).expect("the cluster fails over");
    // After the failover, blocks on the surviving primaries (and those the replica had)
    // are hits again; the lost ones are recomputed and stored anew: outputs stay exact.
    for (p, w) in prompts.iter().zip(&want) {
        let g = run(&e, p);
        assert_eq!((g.0.as_slice(), g.1), (w.0.as_slice(), w.1));
    }
    let s = e.prefix_stats().expect("on");
    assert!(s.cluster_hits > primed.cluster_hits, "no hits after the kill: {s:?}");
    assert_eq!(s.integrity_misses, 0, "{s:?}");
    // The kill was felt (calls to the dead primary failed until the slot map moved).
    assert!(s.cluster_errors + s.put_errors > 0, "{s:?}");
    e.shutdown().expect("clean shutdown");
}

#[test]
fn a_cluster_refusing_the_password_stops_the_start_and_the_password_opens_it() {
    use fastlane_kvswap::testing::RedisClusterOptions;
    use fastlane_kvswap::ClusterAccess;
    const PASSWORD: &str = "llm-test-pass-3e8d";
    let cluster = RedisCluster::start_with(RedisClusterOptions {
        password: Some(PASSWORD.into()),
        tls: false,
    })
    .unwrap_or_else(|e| panic!("{e}"));
    // No password: a mistake to fix, so the engine does not start (unlike a cluster down).
    let Err(err) = Engine::start(model(), with_cluster(&cluster, "auth")) else {
        panic!("started without the password")
    };
    let text = err.to_string();
    assert!(text.contains("authentication failed") && text.contains(&cluster.urls()[0]), "{text}");
    // With it: blocks go to the cluster and a second engine, its host cache cold, hits them.
    let access = ClusterAccess { password: Some(PASSWORD.into()), ..ClusterAccess::default() };
    let cfg = |ns: &str| {
        let mut c = with_cluster(&cluster, ns);
        c.prefix.cluster_access = access.clone();
        c
    };
    let a = prompt(9, 7, 0);
    let want = reference(std::slice::from_ref(&a));
    let e1 = Engine::start(model(), cfg("auth")).expect("engine starts with the password");
    assert!(e1.counters().prefix_cluster);
    let g = run(&e1, &a);
    assert_eq!((g.0.as_slice(), g.1), (want[0].0.as_slice(), want[0].1));
    assert!(e1.flush_prefix(Duration::from_secs(10)), "blocks reach the cluster");
    let e2 = Engine::start(model(), cfg("auth")).expect("engine starts with the password");
    let g = run(&e2, &a);
    assert_eq!((g.0.as_slice(), g.1), (want[0].0.as_slice(), want[0].1));
    let s = e2.prefix_stats().expect("on");
    assert_eq!(s.cluster_hits, SHARED_BLOCKS as u64, "{s:?}");
    for e in [e1, e2] {
        e.shutdown().expect("clean shutdown");
    }
}
