//! The Redis Cluster tier against real six-node clusters that ask for a password
//! (`requirepass`/`masterauth`) or serve TLS only (`--port 0 --tls-port P --tls-cluster yes`,
//! certificates made by `openssl`): `testing::RedisCluster::start_with`. Needs `redis-server`
//! and `redis-cli` built with TLS (Debian's are) and `openssl`; fails without them.

use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use fastlane_kvswap::cas::{prefix_keys, BlockKey, ModelDigest};
use fastlane_kvswap::cluster::{ClusterTier, ClusterTierConfig, ClusterTierError};
use fastlane_kvswap::testing::{RedisCluster, RedisClusterOptions};
use fastlane_kvswap::{ClusterAccess, KvGeometry};

const BLOCK: usize = 16 * 1024;
const PASSWORD: &str = "kv-test-pass-7f3a";
/// A start that fails must fail within the connect timeouts, not hang; slack for two busy
/// shared cores and six nodes tried one after another.
const FAIL_WITHIN: Duration = Duration::from_secs(8);

fn start(opts: RedisClusterOptions) -> RedisCluster {
    RedisCluster::start_with(opts).unwrap_or_else(|e| panic!("{e}"))
}

fn keys(seed: u32, n: usize) -> Vec<BlockKey> {
    let digest = ModelDigest::new("test/auth@rev1", &KvGeometry::LLAMA31_8B);
    let tokens: Vec<u32> =
        (0..(n * 16) as u32).map(|i| i.wrapping_mul(2_654_435_761) ^ seed).collect();
    prefix_keys(&digest, &tokens, 16)
}

fn block(key: &BlockKey) -> Vec<u8> {
    (0..BLOCK).map(|i| key.0[i % 32] ^ (i / 32) as u8).collect()
}

fn cfg(namespace: &str, access: ClusterAccess) -> ClusterTierConfig {
    ClusterTierConfig {
        namespace: namespace.to_string(),
        timeout: Duration::from_millis(3000),
        connect_timeout: Duration::from_millis(1000),
        response_timeout: Duration::from_millis(1500),
        access,
        ..Default::default()
    }
}

/// Connecting fails within [`FAIL_WITHIN`]; the error.
fn refused(urls: &[String], cfg: ClusterTierConfig) -> ClusterTierError {
    let t0 = Instant::now();
    let r = ClusterTier::connect(urls, cfg);
    let took = t0.elapsed();
    assert!(took < FAIL_WITHIN, "a refused connect took {took:?}");
    match r {
        Ok(_) => panic!("connected to {urls:?}"),
        Err(e) => {
            eprintln!("refused after {took:?}: {e}");
            e
        }
    }
}

/// Stores 12 blocks and reads them back byte for byte; a block never stored misses.
fn round_trip(tier: &ClusterTier, seed: u32) {
    let ks = keys(seed, 12);
    let data: Vec<Vec<u8>> = ks.iter().map(block).collect();
    let items: Vec<(BlockKey, &[u8])> =
        ks.iter().copied().zip(data.iter().map(|d| d.as_slice())).collect();
    tier.put(&items).unwrap();
    let mut bufs = vec![vec![0u8; BLOCK]; ks.len() + 1];
    let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
    let mut asked = ks.clone();
    asked.push(keys(seed ^ 0xdead, 1)[0]);
    let got = tier.get(&asked, &mut outs);
    assert!(got[..ks.len()].iter().all(|g| g.is_hit()), "{got:?}");
    assert!(!got[ks.len()].is_hit(), "a block never stored was found");
    for (i, d) in data.iter().enumerate() {
        assert_eq!(&bufs[i], d, "block {i} read back differs");
    }
}

#[test]
fn password_cluster_refuses_without_the_password_and_serves_with_it() {
    let cluster =
        start(RedisClusterOptions { password: Some(PASSWORD.into()), ..Default::default() });
    let urls = cluster.urls();

    let e = refused(&urls, cfg("auth", ClusterAccess::default()));
    assert!(matches!(e, ClusterTierError::Auth { .. }), "{e:?}");
    let text = e.to_string();
    assert!(text.contains(&urls.join(",")), "the error names the URLs: {text}");
    assert!(text.contains("FASTLANE_REDIS_PASSWORD"), "{text}");

    let wrong = ClusterAccess { password: Some("not-it".into()), ..Default::default() };
    let e = refused(&urls, cfg("auth", wrong));
    assert!(matches!(e, ClusterTierError::Auth { .. }), "{e:?}");
    assert!(!e.to_string().contains("not-it"), "the error shows the password: {e}");

    // The password as `fastlane kv serve` / `llm serve` load it: from the environment.
    let env_access = ClusterAccess::load_with(
        |name| (name == "FASTLANE_REDIS_PASSWORD").then(|| PASSWORD.into()),
        None,
        None,
    )
    .unwrap();
    let tier = ClusterTier::connect(&urls, cfg("auth", env_access)).unwrap();
    round_trip(&tier, 1);

    // And from a file only its owner may read, with the ACL user `default` named.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("redis-password");
    std::fs::write(&file, format!("{PASSWORD}\n")).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let file_access = ClusterAccess::load_with(
        |name| (name == "FASTLANE_REDIS_USERNAME").then(|| "default".into()),
        Some(&file),
        None,
    )
    .unwrap();
    let tier2 = ClusterTier::connect(&urls, cfg("auth", file_access)).unwrap();
    round_trip(&tier2, 2);
    // Each sees the other's blocks: one cluster, one namespace.
    let k = keys(1, 1);
    let mut buf = vec![0u8; BLOCK];
    assert!(tier2.get(&k, &mut [buf.as_mut_slice()])[0].is_hit());
    assert_eq!(buf, block(&k[0]));
    assert_eq!(tier.stats().errors + tier2.stats().errors, 0);
}

#[test]
fn tls_cluster_serves_a_client_trusting_its_ca_and_refuses_others() {
    let cluster = start(RedisClusterOptions { tls: true, ..Default::default() });
    let urls = cluster.urls();
    assert!(urls[0].starts_with("rediss://127.0.0.1:"), "{urls:?}");
    let ca = cluster.ca_file().expect("a TLS cluster has a CA");
    let access = ClusterAccess::load_with(|_| None, None, Some(&ca)).unwrap();

    let tier = ClusterTier::connect(&urls, cfg("tls", access.clone())).unwrap();
    round_trip(&tier, 3);
    assert_eq!(tier.stats().errors, 0);

    // Without the CA: the system's roots do not know the test CA.
    let e = refused(&urls, cfg("tls", ClusterAccess::default()));
    assert!(matches!(e, ClusterTierError::Tls { .. }), "{e:?}");
    let text = e.to_string();
    assert!(text.contains("certificate") && text.contains("UnknownIssuer"), "{text}");
    assert!(text.contains(&urls.join(",")), "the error names the URLs: {text}");

    // Trusting another CA is no better.
    let other = tempfile::tempdir().unwrap();
    fastlane_kvswap::testing::redis_cluster::make_tls_files(other.path()).unwrap();
    let wrong_ca = ClusterAccess::load_with(
        |_| None,
        None,
        Some(&other.path().join(fastlane_kvswap::testing::redis_cluster::TLS_CA_FILE)),
    )
    .unwrap();
    let e = refused(&urls, cfg("tls", wrong_ca));
    assert!(matches!(e, ClusterTierError::Tls { .. }), "{e:?}");

    // A plain client on the TLS ports: refused at once, with a hint at rediss://.
    let plain: Vec<String> = urls.iter().map(|u| u.replacen("rediss://", "redis://", 1)).collect();
    let e = refused(&plain, cfg("tls", ClusterAccess::default()));
    assert!(matches!(e, ClusterTierError::Connect { .. }), "{e:?}");
    let text = e.to_string();
    assert!(text.contains("rediss://") && text.contains(&plain[0]), "{text}");

    // The CA with redis:// URLs is a mistake, said before any connection.
    let e = refused(&plain, cfg("tls", access));
    assert!(matches!(e, ClusterTierError::BadConfig { .. }), "{e:?}");
}

#[test]
fn tls_client_on_a_plain_port_fails_within_the_connect_timeout() {
    let cluster = start(RedisClusterOptions::default());
    let tls: Vec<String> =
        cluster.urls().iter().map(|u| u.replacen("redis://", "rediss://", 1)).collect();
    // Six nodes tried one after another, each for the connect timeout.
    let quick = ClusterTierConfig {
        connect_timeout: Duration::from_millis(400),
        ..cfg("plain", ClusterAccess::default())
    };
    let e = refused(&tls, quick);
    let text = e.to_string();
    assert!(matches!(e, ClusterTierError::Tls { .. } | ClusterTierError::Connect { .. }), "{e:?}");
    assert!(text.contains(&tls[0]), "the error names the URLs: {text}");
    assert!(text.contains("TLS"), "{text}");
}

#[test]
fn credentials_in_a_url_are_refused() {
    let e = refused(
        &["redis://user:hunter2@127.0.0.1:1".to_string()],
        cfg("x", ClusterAccess::default()),
    );
    assert!(matches!(e, ClusterTierError::BadConfig { .. }), "{e:?}");
    assert!(!e.to_string().contains("hunter2"), "{e}");
    let e = refused(
        &["redis://127.0.0.1:1".to_string(), "rediss://127.0.0.1:2".to_string()],
        cfg("x", ClusterAccess::default()),
    );
    assert!(e.to_string().contains("mix"), "{e}");
}
