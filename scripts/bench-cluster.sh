#!/usr/bin/env bash
# kvswap's Redis Cluster tier, each against its peer or baseline measured in the same run:
#   cluster-tier    `fastlane kv bench-cluster`: ClusterTier batch put/get throughput against
#                   redis-benchmark SET/GET on the same cluster, same value size, interleaved
#   cluster-prefix  `fastlane llm bench --scenario prefix-cluster`: TTFT of a 2,048-token prefix
#                   + 64-token suffix served from the cluster to an engine that never saw it, vs
#                   computed; the bytes/s the tier delivered
#   cluster-miss    `fastlane llm bench --scenario prefix-miss`: TTFT of prompts on no tier with
#                   the prefix cache + cluster on vs the prefix cache off, interleaved
# Without --kv-cluster each part starts its own private six-node cluster on loopback
# (redis-server, redis-cli and redis-benchmark on PATH: Debian redis-server + redis-tools).
# Results: benches/results/kvswap/<date>-<commit>-cluster-{tier,prefix,miss}.json
# (scripts/bench_results.py; BENCH_RESULTS_DIR overrides the folder).
# Usage: scripts/bench-cluster.sh [--kv-cluster redis://H:P[,H:P...]] [--model random:small]
#          [--rounds 5] [--miss-rounds 10] [--block-bytes 2M] [--blocks 16] [--batches 8]
#          [--seconds 5]
# Run it with nothing else on the machine; it prints each table and the load average.
set -euo pipefail
cd "$(dirname "$0")/.."
kv_cluster="" model=random:small rounds=5 miss_rounds=10 block_bytes=2M blocks=16 batches=8 seconds=5
while [ $# -gt 0 ]; do
  case "$1" in
    --kv-cluster) kv_cluster=$2; shift ;;
    --model) model=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    --miss-rounds) miss_rounds=$2; shift ;;
    --block-bytes) block_bytes=$2; shift ;;
    --blocks) blocks=$2; shift ;;
    --batches) batches=$2; shift ;;
    --seconds) seconds=$2; shift ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "bench-cluster.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
cargo build --release --locked -p fastlane-cli
bin=${CARGO_TARGET_DIR:-target}/release/fastlane
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cluster=()
[ -n "$kv_cluster" ] && cluster=(--kv-cluster "$kv_cluster")
echo "load before: $(cat /proc/loadavg)"
echo "== cluster-tier"
"$bin" kv bench-cluster "${cluster[@]}" --block-bytes "$block_bytes" --blocks "$blocks" \
  --batches "$batches" --rounds "$rounds" --seconds "$seconds" --out "$tmp/tier.json"
echo "== cluster-prefix"
"$bin" llm bench --model "$model" --scenario prefix-cluster --rounds "$rounds" "${cluster[@]}" \
  --out "$tmp/prefix.json"
echo "== cluster-miss"
"$bin" llm bench --model "$model" --scenario prefix-miss --rounds "$miss_rounds" "${cluster[@]}" \
  --out "$tmp/miss.json"
echo "load after: $(cat /proc/loadavg)"
python3 scripts/bench_results.py cluster "$tmp/tier.json" "$tmp/prefix.json" "$tmp/miss.json" \
  "scripts/bench-cluster.sh ${kv_cluster:+--kv-cluster $kv_cluster }--model $model --rounds $rounds --miss-rounds $miss_rounds --block-bytes $block_bytes --blocks $blocks --batches $batches --seconds $seconds"
