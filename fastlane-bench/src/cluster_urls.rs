//! `--kv-cluster redis://HOST:PORT[,HOST:PORT...]`, as `fastlane llm` and `fastlane kv serve`
//! both take it: the Redis Cluster nodes `fastlane_kvswap::cluster::ClusterTier::connect` starts from.

use anyhow::{bail, Context, Result};

/// `redis://HOST:PORT[,HOST:PORT...]` → one URL per node.
pub fn parse_cluster_urls(text: &str) -> Result<Vec<String>> {
    let rest = text
        .strip_prefix("redis://")
        .with_context(|| format!("--kv-cluster {text:?}: redis://HOST:PORT[,HOST:PORT...]"))?;
    let mut urls = Vec::new();
    for node in rest.split(',').map(str::trim) {
        let node = node.strip_prefix("redis://").unwrap_or(node);
        let ok = node
            .rsplit_once(':')
            .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
        if !ok {
            bail!("--kv-cluster: {node:?} is not HOST:PORT");
        }
        urls.push(format!("redis://{node}"));
    }
    Ok(urls)
}

#[cfg(test)]
mod tests {
    use super::parse_cluster_urls;

    #[test]
    fn cluster_urls() {
        assert_eq!(parse_cluster_urls("redis://a:1").unwrap(), vec!["redis://a:1"]);
        assert_eq!(
            parse_cluster_urls("redis://10.0.0.1:7000,10.0.0.2:7001, redis://h:7002").unwrap(),
            vec!["redis://10.0.0.1:7000", "redis://10.0.0.2:7001", "redis://h:7002"]
        );
        for bad in ["a:1", "redis://", "redis://a", "redis://a:0", "redis://a:1,b", "redis://:1"] {
            assert!(parse_cluster_urls(bad).is_err(), "{bad}");
        }
    }
}
