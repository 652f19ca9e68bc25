//! The Redis Cluster tier against a real six-node cluster (`testing::RedisCluster`: three
//! primaries, three replicas, `redis-server` processes on free loopback ports). Needs
//! `redis-server` and `redis-cli` (Debian `redis-server`, `redis-tools`); fails without them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use fastlane_kvswap::cas::{prefix_keys, BlockKey, ModelDigest};
use fastlane_kvswap::cluster::{
    encode_value, BlockGet, ClusterTier, ClusterTierConfig, ClusterTierError, MissReason,
};
use fastlane_kvswap::testing::RedisCluster;
use fastlane_kvswap::KvGeometry;

const BLOCK: usize = 64 * 1024;
/// Scheduling noise allowed over the configured timeout (two shared cores).
const MARGIN: Duration = Duration::from_millis(700);

fn start() -> RedisCluster {
    RedisCluster::start().unwrap_or_else(|e| panic!("{e}"))
}

fn digest() -> ModelDigest {
    ModelDigest::new("test/llama-like@rev1", &KvGeometry::LLAMA31_8B)
}

/// `n` full 16-token blocks' keys of a sequence named by `seed`.
fn keys(seed: u32, n: usize) -> Vec<BlockKey> {
    let tokens: Vec<u32> =
        (0..(n * 16) as u32).map(|i| i.wrapping_mul(2_654_435_761) ^ seed).collect();
    prefix_keys(&digest(), &tokens, 16)
}

/// Deterministic block bytes for `key`.
fn block(key: &BlockKey) -> Vec<u8> {
    let mut x = u64::from_le_bytes(key.0[..8].try_into().unwrap()) | 1;
    (0..BLOCK)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn cfg(namespace: &str, timeout_ms: u64) -> ClusterTierConfig {
    ClusterTierConfig {
        namespace: namespace.to_string(),
        timeout: Duration::from_millis(timeout_ms),
        connect_timeout: Duration::from_millis(timeout_ms / 4),
        response_timeout: Duration::from_millis(timeout_ms / 2),
        ..Default::default()
    }
}

fn put_all(tier: &ClusterTier, ks: &[BlockKey], data: &[Vec<u8>]) -> Result<(), ClusterTierError> {
    let items: Vec<(BlockKey, &[u8])> =
        ks.iter().copied().zip(data.iter().map(|d| d.as_slice())).collect();
    tier.put(&items)
}

/// Gets `ks` into buffers pre-filled with 0xA5; returns outcomes and buffers.
fn get_all(tier: &ClusterTier, ks: &[BlockKey]) -> (Vec<BlockGet>, Vec<Vec<u8>>) {
    let mut bufs = vec![vec![0xA5u8; BLOCK]; ks.len()];
    let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
    let r = tier.get(ks, &mut outs);
    (r, bufs)
}

fn raw_conn(c: &RedisCluster) -> redis::cluster::ClusterConnection {
    redis::cluster::ClusterClient::builder(c.urls())
        .connection_timeout(Duration::from_secs(2))
        .response_timeout(Duration::from_secs(2))
        .build()
        .unwrap()
        .get_connection()
        .unwrap()
}

#[test]
fn round_trip_exists_and_integrity_misses() {
    let cluster = start();
    let tier = ClusterTier::connect(&cluster.urls(), cfg("rt", 2000)).unwrap();
    let ks = keys(1, 48);
    assert_eq!(ks.len(), 48);
    let data: Vec<Vec<u8>> = ks.iter().map(block).collect();

    // The batch spans every primary (many slots).
    let mut owners = std::collections::BTreeSet::new();
    for k in ks.iter().take(16) {
        let slot = cluster.key_slot(&tier.redis_key(k)).unwrap();
        owners.insert(cluster.primary_for_slot(slot).unwrap());
    }
    assert_eq!(owners.len(), 3, "16 keys should land on all 3 primaries: {owners:?}");

    put_all(&tier, &ks, &data).unwrap();
    let s = tier.stats();
    assert_eq!(s.puts, 48);
    assert_eq!(s.bytes_out, 48 * (BLOCK as u64 + 48));
    assert_eq!(s.errors, 0);

    let absent = keys(2, 4);
    let mut probe = ks.clone();
    probe.extend(&absent);
    let ex = tier.exists(&probe);
    assert_eq!(&ex[..48], &[true; 48][..]);
    assert_eq!(&ex[48..], &[false; 4][..]);

    let (r, bufs) = get_all(&tier, &ks);
    for i in 0..48 {
        assert_eq!(r[i], BlockGet::Hit, "block {i}");
        assert!(bufs[i] == data[i], "block {i}: bytes differ");
    }
    let (r, bufs) = get_all(&tier, &absent);
    assert!(r.iter().all(|&x| x == BlockGet::Miss(MissReason::Absent)), "{r:?}");
    assert!(bufs.iter().all(|b| b.iter().all(|&x| x == 0xA5)), "a miss wrote the buffer");

    // Values tampered with behind the tier's back, through a plain cluster client.
    let mut raw = raw_conn(&cluster);
    let mut set = |k: &BlockKey, v: &[u8]| {
        redis::cmd("SET").arg(tier.redis_key(k)).arg(v).query::<()>(&mut raw).unwrap();
    };
    // 0: garbage.
    set(&ks[0], b"not a block at all");
    // 1: the well-formed value of block 2, stored under block 1's name.
    set(&ks[1], &encode_value(&ks[2], &data[2]).unwrap());
    // 3: one payload byte flipped, header intact.
    let mut v = encode_value(&ks[3], &data[3]).unwrap();
    v[48 + 1000] ^= 0x01;
    set(&ks[3], &v);
    // 4: truncated by one byte.
    let v = encode_value(&ks[4], &data[4]).unwrap();
    set(&ks[4], &v[..v.len() - 1]);
    // 5: a valid value of block 5 but half the size the caller expects.
    set(&ks[5], &encode_value(&ks[5], &data[5][..BLOCK / 2]).unwrap());

    let before = tier.stats();
    let (r, bufs) = get_all(&tier, &ks[..7]);
    for i in 0..6 {
        if i == 2 {
            continue;
        }
        assert_eq!(r[i], BlockGet::Miss(MissReason::Integrity), "block {i}");
        assert!(bufs[i].iter().all(|&x| x == 0xA5), "block {i}: a refused value was copied");
    }
    assert_eq!(r[2], BlockGet::Hit);
    assert!(bufs[2] == data[2]);
    assert_eq!(r[6], BlockGet::Hit);
    assert!(bufs[6] == data[6]);
    let after = tier.stats();
    assert_eq!(after.integrity_misses - before.integrity_misses, 5);
    assert_eq!(after.hits - before.hits, 2);
    assert_eq!(after.gets - before.gets, 7);

    // A key of another type (a list) under a block's name: a miss of that block only.
    let listed = keys(3, 1)[0];
    redis::cmd("RPUSH").arg(tier.redis_key(&listed)).arg("x").query::<()>(&mut raw).unwrap();
    let (r, bufs) = get_all(&tier, &[listed, ks[8]]);
    assert_eq!(r[0], BlockGet::Miss(MissReason::Integrity));
    assert!(bufs[0].iter().all(|&x| x == 0xA5));
    assert_eq!(r[1], BlockGet::Hit, "one refused key must not fail the batch");
    assert!(bufs[1] == data[8]);
    assert_eq!(tier.exists(&[listed, ks[8], absent[0]]), vec![true, true, false]);

    // Another namespace does not see these blocks; with a ttl, blocks expire.
    let ttl = Duration::from_secs(30);
    let other = ClusterTier::connect(
        &cluster.urls(),
        ClusterTierConfig { ttl: Some(ttl), ..cfg("rt2", 2000) },
    )
    .unwrap();
    assert!(other.exists(&ks[10..12]).iter().all(|&e| !e));
    put_all(&other, &ks[10..11], &data[10..11]).unwrap();
    let pttl: i64 = redis::cmd("PTTL").arg(other.redis_key(&ks[10])).query(&mut raw).unwrap();
    assert!(pttl > 0 && pttl <= 30_000, "PTTL {pttl}");
    let no_ttl: i64 = redis::cmd("PTTL").arg(tier.redis_key(&ks[10])).query(&mut raw).unwrap();
    assert_eq!(no_ttl, -1, "no ttl configured: no expiry");
}

#[test]
fn failover_while_getting_and_putting() {
    let mut cluster = start();
    let timeout_ms = 600;
    let timeout = Duration::from_millis(timeout_ms);
    let tier = ClusterTier::connect(&cluster.urls(), cfg("fo", timeout_ms)).unwrap();
    let base = keys(10, 24);
    let mut expect: HashMap<BlockKey, Vec<u8>> = HashMap::new();
    for k in &base {
        expect.insert(*k, block(k));
    }
    let data: Vec<Vec<u8>> = base.iter().map(|k| expect[k].clone()).collect();
    put_all(&tier, &base, &data).unwrap();
    // Kill the primary of the first block's slot.
    let victim =
        cluster.primary_for_slot(cluster.key_slot(&tier.redis_key(&base[0])).unwrap()).unwrap();

    let stop = AtomicBool::new(false);
    let (wrong, slowest, calls, misses) = std::thread::scope(|s| {
        let looper = s.spawn(|| {
            let mut expect = expect.clone();
            let (mut wrong, mut slowest, mut calls, mut misses) =
                (0u64, Duration::ZERO, 0u64, 0u64);
            let start = Instant::now();
            let mut i = 0u32;
            // Bounded in count and time; ends earlier when the main thread says so.
            while i < 5000
                && start.elapsed() < Duration::from_secs(25)
                && !stop.load(Ordering::Relaxed)
            {
                i += 1;
                // A get of 8 of the first blocks (block 0's slot is on the victim).
                let ks: Vec<BlockKey> =
                    (0..8).map(|j| base[(i as usize * 3 + j) % base.len()]).collect();
                let mut ks = ks;
                ks[0] = base[0];
                let t = Instant::now();
                let (r, bufs) = get_all(&tier, &ks);
                slowest = slowest.max(t.elapsed());
                calls += 1;
                for (j, out) in r.iter().enumerate() {
                    match out {
                        BlockGet::Hit => {
                            if bufs[j] != expect[&ks[j]] {
                                wrong += 1;
                            }
                        }
                        BlockGet::Miss(_) => misses += 1,
                    }
                }
                // A put of two new blocks.
                let fresh = keys(1000 + i, 2);
                let fd: Vec<Vec<u8>> = fresh.iter().map(block).collect();
                let t = Instant::now();
                let ok = put_all(&tier, &fresh, &fd).is_ok();
                slowest = slowest.max(t.elapsed());
                calls += 1;
                if ok {
                    for (k, d) in fresh.iter().zip(fd) {
                        expect.insert(*k, d);
                    }
                }
            }
            (wrong, slowest, calls, misses)
        });
        std::thread::sleep(Duration::from_millis(500));
        cluster.kill(victim);
        let took = cluster.wait_failover(victim, Duration::from_secs(15));
        // Let the loop run on the new topology for a while before stopping it.
        std::thread::sleep(Duration::from_millis(1500));
        stop.store(true, Ordering::Relaxed);
        let r = looper.join().unwrap();
        took.unwrap_or_else(|e| panic!("{e}"));
        r
    });
    let s = tier.stats();
    eprintln!("failover loop: {calls} calls, slowest {slowest:?}, {misses} block misses, {s:?}");
    assert_eq!(wrong, 0, "a hit returned wrong bytes");
    assert!(slowest <= timeout + MARGIN, "a call took {slowest:?} (timeout {timeout:?})");
    assert!(calls > 10, "the loop barely ran");
    assert!(misses > 0 || s.errors > 0, "the outage went unnoticed: did the kill happen?");

    // After the failover: every slot is served again; a new batch round-trips (the worker
    // may need a call or two to rebuild its slot map, so allow a few bounded tries).
    let fresh = keys(99, 24);
    let fd: Vec<Vec<u8>> = fresh.iter().map(block).collect();
    let mut stored = false;
    for _ in 0..20 {
        if put_all(&tier, &fresh, &fd).is_ok() {
            stored = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(stored, "puts do not work after the failover: {:?}", tier.stats());
    let (r, bufs) = get_all(&tier, &fresh);
    for i in 0..fresh.len() {
        assert_eq!(r[i], BlockGet::Hit, "block {i} after failover");
        assert!(bufs[i] == fd[i]);
    }
    // Blocks written before the kill: the promoted replica may or may not have them, but
    // whatever comes back is right.
    let (r, bufs) = get_all(&tier, &base);
    for i in 0..base.len() {
        assert!(r[i] != BlockGet::Hit || bufs[i] == data[i], "block {i}");
    }
}

#[test]
fn whole_cluster_down_means_misses_and_errors_within_the_timeout() {
    let mut cluster = start();
    let timeout = Duration::from_millis(400);
    let tier = ClusterTier::connect(&cluster.urls(), cfg("down", 400)).unwrap();
    let ks = keys(5, 6);
    let data: Vec<Vec<u8>> = ks.iter().map(block).collect();
    put_all(&tier, &ks, &data).unwrap();
    let (r, _) = get_all(&tier, &ks);
    assert!(r.iter().all(|x| x.is_hit()));

    cluster.stop_all();
    let before = tier.stats();
    for round in 0..5 {
        let t = Instant::now();
        let (r, bufs) = get_all(&tier, &ks);
        let took = t.elapsed();
        assert!(took <= timeout + MARGIN, "get {round} took {took:?}");
        assert!(r.iter().all(|&x| x == BlockGet::Miss(MissReason::Error)), "{r:?}");
        assert!(bufs.iter().all(|b| b.iter().all(|&x| x == 0xA5)));

        let t = Instant::now();
        assert!(put_all(&tier, &ks, &data).is_err());
        assert!(t.elapsed() <= timeout + MARGIN, "put {round} took {:?}", t.elapsed());

        let t = Instant::now();
        assert!(tier.exists(&ks).iter().all(|&e| !e));
        assert!(t.elapsed() <= timeout + MARGIN);
    }
    let after = tier.stats();
    assert_eq!(after.errors - before.errors, 15, "{after:?}");
    assert_eq!(after.misses - before.misses, 30);
    assert_eq!(after.puts, before.puts);

    // A new tier cannot connect, and says so quickly.
    let t = Instant::now();
    match ClusterTier::connect(&cluster.urls(), cfg("down", 400)) {
        Err(ClusterTierError::Connect { .. }) => {}
        other => panic!("connect to a stopped cluster: {other:?}"),
    }
    assert!(t.elapsed() < Duration::from_secs(5), "connect took {:?}", t.elapsed());
}

#[test]
fn hung_primary_costs_at_most_the_timeout() {
    let cluster = start();
    let timeout = Duration::from_millis(300);
    let tier = ClusterTier::connect(&cluster.urls(), cfg("hang", 300)).unwrap();
    let ks = keys(7, 12);
    let data: Vec<Vec<u8>> = ks.iter().map(block).collect();
    put_all(&tier, &ks, &data).unwrap();
    let victim =
        cluster.primary_for_slot(cluster.key_slot(&tier.redis_key(&ks[0])).unwrap()).unwrap();

    // SIGSTOP: the node's socket stays open and says nothing; only timeouts end a call.
    assert!(cluster.pause(victim));
    let mut timed_out = 0;
    for round in 0..4 {
        let t = Instant::now();
        let (r, bufs) = get_all(&tier, &ks);
        let took = t.elapsed();
        assert!(took <= timeout + MARGIN, "get {round} took {took:?}");
        for i in 0..ks.len() {
            assert!(r[i] != BlockGet::Hit || bufs[i] == data[i], "block {i}");
        }
        if r[0] == BlockGet::Miss(MissReason::Error) {
            timed_out += 1;
        }
        let t = Instant::now();
        let _ = put_all(&tier, &ks[..2], &data[..2]);
        assert!(t.elapsed() <= timeout + MARGIN, "put {round} took {:?}", t.elapsed());
    }
    assert!(cluster.resume(victim));
    assert!(timed_out > 0, "a hung primary never made a get miss");
    assert!(tier.stats().errors > 0);

    // Back to normal (the node may have been failed over meanwhile and rejoined as a
    // replica): within a bounded number of tries every block reads back.
    cluster.wait_healthy(Duration::from_secs(20)).unwrap_or_else(|e| panic!("{e}"));
    let mut all = false;
    for _ in 0..30 {
        let (r, bufs) = get_all(&tier, &ks[1..]);
        if r.iter().all(|x| x.is_hit()) {
            assert!(bufs.iter().zip(&data[1..]).all(|(b, d)| b == d));
            all = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(all, "reads did not recover after the node came back: {:?}", tier.stats());
}
