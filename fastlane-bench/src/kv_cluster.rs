//! `fastlane kv bench-cluster`: batch put and batch get throughput of kvswap's Redis Cluster
//! tier (`fastlane_kvswap::cluster::ClusterTier`) against `redis-benchmark` on the same cluster, with
//! values of the same size, interleaved round by round.
//!
//! Ours: passes over `--batches` pipelined batches of `--blocks` distinct blocks of
//! `--block-bytes` each (`ClusterTier::put`, then `ClusterTier::get` of the same keys: value
//! header, CRC32C and key checks and the copy into the caller's buffer included), from the
//! tier's one worker thread. The peer: `redis-benchmark --cluster --threads 1 -t set,get -d
//! BLOCK_BYTES` with one client per primary (`-c PRIMARIES`) and a pipeline of
//! `ceil(blocks / primaries)` (`-P`): one thread and about `--blocks` commands in flight
//! spread over the primaries, as ours. Both move the same number of values per op and round
//! (`-n`; enough passes that the faster op lasts about `--seconds`). The ratio per op is
//! ours/peer in values per second (the same as in bytes: the values are the same size, ours
//! carries 48 bytes of header more), the median over rounds of each round's ratio.
//!
//! redis-benchmark without `-r` uses one key per client (hash-tagged to its primary); ours
//! uses `blocks × batches` distinct keys. With more than one thread (`--peer-threads`; the
//! `--cluster` default is one per primary) redis-benchmark rounds each test's time up to
//! its 250 ms progress tick, so short peer runs under-report it.
//!
//! Without `--kv-cluster` a private six-node cluster is started on loopback
//! (`fastlane_kvswap::testing::RedisCluster`) and each node's `maxmemory` raised so that the working
//! set (`blocks × batches × block bytes`, and the peer's keys) fits without eviction; every
//! get must hit, or the run fails (a miss means the cluster evicted blocks).

use std::io::Write as _;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use fastlane_kvswap::cluster::{ClusterTier, ClusterTierConfig};
use fastlane_kvswap::testing::RedisCluster;
use fastlane_kvswap::{BlockKey, KvGeometry, ModelDigest};
use fastlane_util::parse_size;
use serde::Serialize;

/// Arguments of `fastlane kv bench-cluster`.
#[derive(Debug, Args)]
pub struct BenchClusterArgs {
    /// A running Redis Cluster: redis://HOST:PORT[,HOST:PORT...] (redis-benchmark talks to
    /// the first node). Without it a private six-node cluster is started on loopback, with
    /// maxmemory raised to hold the working set.
    #[arg(long)]
    kv_cluster: Option<String>,
    /// Bytes of one block (one value; K/M/G suffixes).
    #[arg(long, default_value = "2M", value_parser = parse_size)]
    block_bytes: u64,
    /// Blocks per batch (one pipelined put or get).
    #[arg(long, default_value_t = 16)]
    blocks: usize,
    /// Batches per round; distinct keys, so the working set is blocks × batches × block bytes.
    #[arg(long, default_value_t = 8)]
    batches: usize,
    /// Rounds, ours and redis-benchmark alternating which goes first; ratios are medians.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Seconds the faster op should last per round (sets the passes over the working set,
    /// from a warm-up pass; at least one pass).
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// redis-benchmark's --threads (1: one event loop for all primaries, as ours).
    #[arg(long, default_value_t = 1)]
    peer_threads: usize,
    /// Bound on one tier call (one batch), milliseconds.
    #[arg(long, default_value_t = 30_000)]
    timeout_ms: u64,
    /// The redis-benchmark binary.
    #[arg(long, default_value = "redis-benchmark")]
    redis_benchmark: String,
    /// Print the results as one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Also write the JSON results to this file.
    #[arg(long)]
    out: Option<std::path::PathBuf>,
}

/// A cluster for a benchmark: the one named by `--kv-cluster`, or a private one (stopped on
/// drop).
#[derive(Debug)]
pub(crate) struct BenchCluster {
    /// `redis://host:port` of its nodes.
    pub urls: Vec<String>,
    private: Option<RedisCluster>,
}

impl BenchCluster {
    /// The cluster `--kv-cluster` names, or a private six-node one whose nodes may each hold
    /// `maxmemory_bytes` (raised with `CONFIG SET` from the harness's 64 MB).
    pub(crate) fn open(kv_cluster: Option<&str>, maxmemory_bytes: u64) -> Result<BenchCluster> {
        if let Some(text) = kv_cluster {
            return Ok(BenchCluster {
                urls: fastlane_kvswap::daemon::parse_cluster_urls(text)?,
                private: None,
            });
        }
        eprintln!("starting a private 6-node Redis Cluster on loopback (redis-server)");
        let c = RedisCluster::start().map_err(|e| anyhow::anyhow!("{e}"))?;
        let max = maxmemory_bytes.max(64 << 20).to_string();
        for i in c.running() {
            let out = c
                .cli(i, &["CONFIG", "SET", "maxmemory", &max])
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            if !out.contains("OK") {
                bail!("CONFIG SET maxmemory {max} on node {i}: {}", out.trim());
            }
        }
        Ok(BenchCluster { urls: c.urls(), private: Some(c) })
    }

    /// Whether it was started here.
    pub(crate) fn is_private(&self) -> bool {
        self.private.is_some()
    }

    /// `host:port` of the first node.
    pub(crate) fn first_node(&self) -> Result<(String, u16)> {
        let u = self.urls.first().context("no cluster node")?;
        let hp = u.strip_prefix("redis://").unwrap_or(u);
        let (h, p) = hp.rsplit_once(':').with_context(|| format!("{u}: no port"))?;
        Ok((h.to_string(), p.parse().with_context(|| format!("{u}: bad port"))?))
    }

    /// `--kv-cluster`'s form of it: `redis://h:p,h:p,...`.
    pub(crate) fn flag(&self) -> String {
        let nodes: Vec<&str> =
            self.urls.iter().map(|u| u.strip_prefix("redis://").unwrap_or(u)).collect();
        format!("redis://{}", nodes.join(","))
    }
}

/// Primaries serving slots in `CLUSTER NODES` output.
fn count_primaries(nodes: &str) -> usize {
    nodes
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|f| f.len() > 8)
        .filter(|f| f[2].split(',').any(|x| x == "master"))
        .filter(|f| !f[2].split(',').any(|x| x == "fail" || x == "fail?"))
        .count()
}

fn primaries(host: &str, port: u16) -> Result<usize> {
    let out = Command::new("redis-cli")
        .args(["-h", host, "-p", &port.to_string(), "CLUSTER", "NODES"])
        .stdin(Stdio::null())
        .output()
        .context("running redis-cli (Debian package redis-tools)")?;
    let n = count_primaries(&String::from_utf8_lossy(&out.stdout));
    if n == 0 {
        bail!(
            "redis-cli -h {host} -p {port} CLUSTER NODES shows no primary serving slots: {}{}",
            String::from_utf8_lossy(&out.stdout).trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(n)
}

/// Requests per second of each test in redis-benchmark's `--csv` output
/// (`"SET","12345.68",...`); other lines (the cluster banner) are skipped.
fn parse_csv(text: &str) -> Vec<(String, f64)> {
    let mut out = Vec::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split(',').map(|x| x.trim().trim_matches('"')).collect();
        if f.len() < 2 || f[0] == "test" {
            continue;
        }
        if let Ok(rps) = f[1].parse::<f64>() {
            out.push((f[0].to_string(), rps));
        }
    }
    out
}

/// The peer's settings.
#[derive(Debug, Clone, Serialize)]
struct PeerSettings {
    clients: usize,
    pipeline: usize,
    threads: usize,
    requests: usize,
    command: String,
}

fn run_peer(bin: &str, host: &str, port: u16, s: &PeerSettings, bytes: u64) -> Result<(f64, f64)> {
    let out = Command::new(bin)
        .args(["--cluster", "--threads", &s.threads.to_string()])
        .args(["-h", host, "-p", &port.to_string(), "-t", "set,get"])
        .args(["-d", &bytes.to_string(), "-n", &s.requests.to_string()])
        .args(["-c", &s.clients.to_string(), "-P", &s.pipeline.to_string(), "--csv"])
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {bin} (Debian package redis-tools)"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!("{}: {}{}", s.command, text.trim(), String::from_utf8_lossy(&out.stderr).trim());
    }
    let rows = parse_csv(&text);
    let get = |name: &str| {
        rows.iter()
            .find(|(t, _)| t == name)
            .map(|r| r.1)
            .with_context(|| format!("{}: no {name} row in {text:?}", s.command))
    };
    Ok((get("SET")?, get("GET")?))
}

/// One round's numbers, values per second.
#[derive(Debug, Clone, Serialize)]
struct Round {
    ours_first: bool,
    ours_put_per_s: f64,
    ours_get_per_s: f64,
    peer_set_per_s: f64,
    peer_get_per_s: f64,
}

/// One op over the rounds.
#[derive(Debug, Clone, Serialize)]
struct OpResult {
    op: &'static str,
    peer_op: &'static str,
    /// Median blocks per second.
    ours_blocks_per_s: f64,
    /// `ours_blocks_per_s` × block bytes / 1e9.
    ours_gb_per_s: f64,
    peer_blocks_per_s: f64,
    peer_gb_per_s: f64,
    /// Median over rounds of ours/peer.
    ratio: f64,
    ratio_min: f64,
    ratio_max: f64,
    target: &'static str,
    met: bool,
}

/// A payload of `len` bytes from a seed (xorshift: not compressible, distinct per block).
fn payload(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut v = Vec::with_capacity(len);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        v.extend_from_slice(&b[..b.len().min(len - v.len())]);
    }
    v
}

/// Deletes `keys` through `redis-cli -c` (best effort: a shared cluster is left as found).
fn delete_keys(host: &str, port: u16, keys: &[String]) {
    let Ok(mut child) = Command::new("redis-cli")
        .args(["-c", "-h", host, "-p", &port.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
    else {
        eprintln!("warning: could not run redis-cli to delete the bench keys");
        return;
    };
    if let Some(mut stdin) = child.stdin.take() {
        for k in keys {
            let _ = writeln!(stdin, "DEL {k}");
        }
    }
    let _ = child.wait();
}

/// Runs `fastlane kv bench-cluster`.
pub fn run(a: &BenchClusterArgs) -> Result<()> {
    if a.blocks == 0 || a.batches == 0 || a.rounds == 0 {
        bail!("--blocks, --batches and --rounds must be at least 1");
    }
    let block = usize::try_from(a.block_bytes).context("--block-bytes too large")?;
    if block == 0 || a.block_bytes > (512 << 20) - 64 {
        bail!("--block-bytes must be 1 byte to 512 MiB (Redis's largest value)");
    }
    let values = a.blocks * a.batches;
    let working = a.block_bytes * values as u64;
    // Each node may hold at most the whole working set, the peer's one key per primary, and
    // room for Redis itself; an upper bound, not a reservation.
    let cluster =
        BenchCluster::open(a.kv_cluster.as_deref(), working + 4 * a.block_bytes + (64 << 20))?;
    let (host, port) = cluster.first_node()?;
    let primaries = primaries(&host, port)?;
    let pipeline = a.blocks.div_ceil(primaries);
    let timeout = Duration::from_millis(a.timeout_ms.max(1));
    let tier = ClusterTier::connect(
        &cluster.urls,
        ClusterTierConfig {
            namespace: format!("kvbench-{}", std::process::id()),
            timeout,
            connect_timeout: Duration::from_secs(1).min(timeout),
            response_timeout: timeout,
            ..ClusterTierConfig::default()
        },
    )?;
    let digest = ModelDigest::new(
        &format!("kv bench-cluster {} {:?}", std::process::id(), Instant::now()),
        &KvGeometry::LLAMA31_8B,
    );
    let keys: Vec<BlockKey> =
        (0..values as u32).map(|i| BlockKey::chain(&digest, None, &[i])).collect();
    let payloads: Vec<Vec<u8>> = (0..a.blocks).map(|i| payload(block, i as u64 + 1)).collect();
    let mut outs: Vec<Vec<u8>> = (0..a.blocks).map(|_| vec![0u8; block]).collect();
    let load_before = crate::load::loadavg();
    // `passes` passes of put over every batch, then as many of get: values per second.
    let ours = |outs: &mut Vec<Vec<u8>>, passes: usize| -> Result<(f64, f64)> {
        let t0 = Instant::now();
        for _ in 0..passes {
            for b in 0..a.batches {
                let items: Vec<(BlockKey, &[u8])> = (0..a.blocks)
                    .map(|i| (keys[b * a.blocks + i], payloads[i].as_slice()))
                    .collect();
                tier.put(&items).with_context(|| format!("put of batch {b}"))?;
            }
        }
        let put = t0.elapsed().as_secs_f64();
        let t0 = Instant::now();
        let mut misses = 0;
        for _ in 0..passes {
            for b in 0..a.batches {
                let mut bufs: Vec<&mut [u8]> = outs.iter_mut().map(Vec::as_mut_slice).collect();
                let r = tier.get(&keys[b * a.blocks..(b + 1) * a.blocks], &mut bufs);
                misses += r.iter().filter(|g| !g.is_hit()).count();
            }
        }
        let get = t0.elapsed().as_secs_f64();
        if misses > 0 {
            bail!(
                "{misses} of {} gets missed (evicted by maxmemory, or errors: {:?}); \
                 a cluster for this bench must hold {:.1} MB",
                passes * values,
                tier.stats(),
                working as f64 / 1e6
            );
        }
        let n = (passes * values) as f64;
        Ok((n / put, n / get))
    };
    // Warm-up: one put and get of everything (allocations in Redis, connections), which
    // also sizes the rounds.
    let (put_rate, get_rate) = ours(&mut outs, 1)?;
    if outs[0] != payloads[0] {
        bail!("a block read back differs from the block written");
    }
    let passes = ((a.seconds.max(0.0) * put_rate.max(get_rate) / values as f64).ceil() as usize)
        .clamp(1, 1_000_000);
    let peer = {
        let per_round = primaries * pipeline;
        let requests = (passes * values).div_ceil(per_round) * per_round;
        let threads = a.peer_threads.max(1);
        PeerSettings {
            clients: primaries,
            pipeline,
            threads,
            requests,
            command: format!(
                "{} --cluster --threads {threads} -h {host} -p {port} -t set,get -d {} -n {requests} -c {primaries} -P {pipeline} --csv",
                a.redis_benchmark, a.block_bytes
            ),
        }
    };
    eprintln!(
        "bench-cluster: {} batches of {} blocks of {} bytes ({:.1} MB working set), {passes} passes per op and round, {} rounds, {primaries} primaries; peer: {}",
        a.batches,
        a.blocks,
        a.block_bytes,
        working as f64 / 1e6,
        a.rounds,
        peer.command
    );
    let mut rounds = Vec::with_capacity(a.rounds);
    for r in 0..a.rounds {
        let ours_first = r % 2 == 0;
        let (mut o, mut p) = ((0.0, 0.0), (0.0, 0.0));
        for step in 0..2 {
            if (step == 0) == ours_first {
                o = ours(&mut outs, passes)?;
            } else {
                p = run_peer(&a.redis_benchmark, &host, port, &peer, a.block_bytes)?;
            }
        }
        let round = Round {
            ours_first,
            ours_put_per_s: o.0,
            ours_get_per_s: o.1,
            peer_set_per_s: p.0,
            peer_get_per_s: p.1,
        };
        eprintln!(
            "round {}/{}: put {:.0}/s vs SET {:.0}/s ({:.2}x), get {:.0}/s vs GET {:.0}/s ({:.2}x); load {}",
            r + 1,
            a.rounds,
            round.ours_put_per_s,
            round.peer_set_per_s,
            round.ours_put_per_s / round.peer_set_per_s,
            round.ours_get_per_s,
            round.peer_get_per_s,
            round.ours_get_per_s / round.peer_get_per_s,
            crate::load::loadavg()
        );
        rounds.push(round);
    }
    let load_after = crate::load::loadavg();
    let stats = tier.stats();
    drop(tier);
    if !cluster.is_private() {
        let names: Vec<String> =
            keys.iter().map(|k| format!("kvbench-{}:{k}", std::process::id())).collect();
        delete_keys(&host, port, &names);
    }
    let gb = a.block_bytes as f64 / 1e9;
    let op = |op, peer_op, ours: &dyn Fn(&Round) -> f64, theirs: &dyn Fn(&Round) -> f64| {
        let ratios: Vec<f64> = rounds.iter().map(|r| ours(r) / theirs(r)).collect();
        let o = crate::stats::median(rounds.iter().map(ours).collect());
        let p = crate::stats::median(rounds.iter().map(theirs).collect());
        let ratio = crate::stats::median(ratios.clone());
        OpResult {
            op,
            peer_op,
            ours_blocks_per_s: o,
            ours_gb_per_s: o * gb,
            peer_blocks_per_s: p,
            peer_gb_per_s: p * gb,
            ratio,
            ratio_min: ratios.iter().copied().fold(f64::INFINITY, f64::min),
            ratio_max: ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            target: ">= 0.8",
            met: ratio >= 0.8,
        }
    };
    let ops = [
        op("put", "SET", &|r: &Round| r.ours_put_per_s, &|r: &Round| r.peer_set_per_s),
        op("get", "GET", &|r: &Round| r.ours_get_per_s, &|r: &Round| r.peer_get_per_s),
    ];
    {
        let v = serde_json::json!({
            "bench": "kv bench-cluster",
            "cluster": if cluster.is_private() { "private (fastlane_kvswap::testing::RedisCluster, 3 primaries + 3 replicas, loopback)".to_string() } else { cluster.flag() },
            "block_bytes": a.block_bytes,
            "blocks_per_batch": a.blocks,
            "batches": a.batches,
            "rounds": a.rounds,
            "primaries": primaries,
            "working_set_bytes": working,
            "passes_per_round": passes,
            "values_per_op_and_round": passes * values,
            "peer": &peer,
            "load_before": load_before,
            "load_after": load_after,
            "ops": &ops,
            "per_round": &rounds,
            "tier_stats": {
                "puts": stats.puts, "gets": stats.gets, "hits": stats.hits,
                "misses": stats.misses, "errors": stats.errors, "timeouts": stats.timeouts,
                "bytes_out": stats.bytes_out, "bytes_in": stats.bytes_in,
            },
        });
        let text = serde_json::to_string_pretty(&v)?;
        if let Some(p) = &a.out {
            if let Some(dir) = p.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir)?;
            }
            std::fs::write(p, &text).with_context(|| format!("writing {}", p.display()))?;
        }
        if a.json {
            println!("{text}");
            return Ok(());
        }
    }
    println!(
        "cluster tier vs redis-benchmark: {} blocks of {} bytes per batch, {} batches x {passes} passes per op, {} rounds (median), {primaries} primaries{}",
        a.blocks,
        a.block_bytes,
        a.batches,
        a.rounds,
        if cluster.is_private() { " (private loopback cluster)" } else { "" }
    );
    println!("peer: {}", peer.command);
    println!("load before {load_before}, after {load_after}");
    println!(
        "{:<4} {:>10} {:>12} {:>6} {:>10} {:>12} {:>8} {:>17} {:>7}",
        "op",
        "ours GB/s",
        "ours blk/s",
        "peer",
        "peer GB/s",
        "peer blk/s",
        "ratio",
        "min..max",
        "target"
    );
    for o in &ops {
        println!(
            "{:<4} {:>10.3} {:>12.1} {:>6} {:>10.3} {:>12.1} {:>7.2}x {:>8.2}..{:<8.2} {:>7}{}",
            o.op,
            o.ours_gb_per_s,
            o.ours_blocks_per_s,
            o.peer_op,
            o.peer_gb_per_s,
            o.peer_blocks_per_s,
            o.ratio,
            o.ratio_min,
            o.ratio_max,
            o.target,
            if o.met { "" } else { "  (not met)" }
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_redis_benchmark_csv_and_cluster_nodes() {
        let csv = "Cluster has 3 master nodes:\n\nMaster 0: 3d8f 127.0.0.1:27002\n\n\
\"test\",\"rps\",\"avg_latency_ms\",\"min_latency_ms\",\"p50_latency_ms\",\"p95_latency_ms\",\"p99_latency_ms\",\"max_latency_ms\"\n\
\"SET\",\"102.78\",\"94.957\",\"26.912\",\"49.407\",\"235.903\",\"235.903\",\"235.903\"\n\
\"GET\",\"184.62\",\"14.726\",\"1.688\",\"12.039\",\"29.135\",\"29.135\",\"29.135\"\n";
        assert_eq!(parse_csv(csv), vec![("SET".to_string(), 102.78), ("GET".to_string(), 184.62)]);
        let nodes = "\
3d8f 127.0.0.1:27002@37002 master - 0 1796173229414 2 connected 5461-10922
ce36 127.0.0.1:27003@37003 master - 0 1796173230420 3 connected 10923-16383
9db6 127.0.0.1:27001@37001 myself,master - 0 1796173228000 1 connected 0-5460
07c3 127.0.0.1:27004@37004 slave 9db6 0 1796173228000 1 connected
aaaa 127.0.0.1:27005@37005 master,fail - 0 1796173228000 1 connected
";
        assert_eq!(count_primaries(nodes), 3);
    }

    #[test]
    fn payloads_differ_and_have_the_length() {
        let (a, b) = (payload(1001, 1), payload(1001, 2));
        assert_eq!(a.len(), 1001);
        assert_ne!(a, b);
    }
}
