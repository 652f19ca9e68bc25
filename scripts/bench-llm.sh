#!/usr/bin/env bash
# The inference engine's benchmarks, each against its floor or peer measured in the same run,
# written to benches/results/llm/<date>-<commit>-<part>.json (BENCH_RESULTS_DIR overrides):
#   kernels     decode vs the weight-streaming floor, prefill vs OpenBLAS on the same shapes,
#               batch 16 vs batch 1, a step with a 2,048-token swap-out vs without
#   scenario-d  chunked vs whole-prompt prefill: the decoders' stall (real engine)
#   scenario-b  chat TTFT beside batch jobs: solo, fifo, drr+preempt (real engine)
# Usage: scripts/bench-llm.sh [--model random:small] [--rounds 5] [--seconds 10]
# Run it with nothing else on the machine; it prints each table and the load average.
set -euo pipefail
cd "$(dirname "$0")/.."
model=random:small rounds=5 seconds=10
while [ $# -gt 0 ]; do
  case "$1" in
    --model) model=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    --seconds) seconds=$2; shift ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "bench-llm.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
cargo build --release --locked -p fastlane-cli
bin=target/release/fastlane
dir=${BENCH_RESULTS_DIR:-benches/results}/llm
mkdir -p "$dir"
stamp="$(date +%F)-$(git rev-parse --short HEAD)"
echo "load before: $(cat /proc/loadavg)"
"$bin" llm bench --model "$model" --rounds "$rounds" --out "$dir/$stamp-kernels.json"
"$bin" llm bench --model "$model" --scenario d --out "$dir/$stamp-scenario-d.json"
"$bin" llm bench --model "$model" --scenario b --seconds "$seconds" --out "$dir/$stamp-scenario-b.json"
echo "wrote $dir/$stamp-{kernels,scenario-d,scenario-b}.json"
