#!/usr/bin/env bash
# Where the quiet tenant's TTFT goes when `fastlane router` is in front of an upstream without
# tiers (`llm serve --policy fifo`), and the floor a router cannot go below there.
#
# Starts `llm serve --model random:small --policy fifo` and the router in front of it, both with
# RUST_LOG=trace --log-format json (one JSON event per engine step and per request arrival at
# the engine; one per dispatch and per first bytes at the router), then runs scenario (a) twice through the router:
# the quiet tenant alone (solo) and beside the flood. For every quiet request of the loaded run
# it splits the router's TTFT into
#   in flight  the rest of the upstream's step that was running when the request arrived there
#              (a router cannot give that step up; `llm serve --policy drr` does, between layers)
#   between    whole steps that ran after that one and before the request's own step
#   own step   the step that computed the prompt and its first token (with the flood's decode
#              rows, which an upstream without tiers puts beside it)
#   rest       everything else: the router, HTTP, sampling, the first token's bytes
# and reports P50/P99 of each, the share of the upstream's time spent in steps that carry a
# prefill, and the floor: P99 over the quiet requests of (in flight + own step), against the
# solo P99 of the same invocation.
# Results: benches/results/llm/<date>-<commit>-router-floor-<N>.json (N: --batch-prefills).
# Usage: scripts/router-floor.sh [--seconds 120] [--rate 1] [--batch-prefills N (the router's; 0)]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=120 rate=1 batch_prefills=0
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds=$2; shift ;;
    --rate) rate=$2; shift ;;
    --batch-prefills) batch_prefills=$2; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "router-floor.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
cargo build --release --locked -p fastlane-cli
bin=target/release/fastlane
tmp=$(mktemp -d)
dir=${BENCH_RESULTS_DIR:-benches/results}/llm
mkdir -p "$dir"
out="$dir/$(date +%F)-$(git rev-parse --short HEAD)-router-floor-$batch_prefills.json"
n=2
while [ -e "$out" ]; do  # a second run on the same day and commit: -2, -3, ...
  out="$dir/$(date +%F)-$(git rev-parse --short HEAD)-router-floor-$batch_prefills-$n.json"
  n=$((n + 1))
done
. scripts/serve-common.sh
write_tenants
command="scripts/router-floor.sh --seconds $seconds --rate $rate --batch-prefills $batch_prefills"
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
echo "load before: $load_before"
for run in solo loaded; do
  # A fresh upstream for each run: the quiet prompts repeat, and a prefix cache warmed by
  # the solo run would shorten the loaded run's prefills.
  RUST_LOG=trace start up-$run llm serve --log-format json --model random:small --device-blocks 4096 --policy fifo
  RUST_LOG=trace start router-$run router --log-format json --upstream "$url" --tenants "$tmp/tenants.toml" \
    --batch-prefills "$batch_prefills"
  echo "== $run"
  date +%s.%N >"$tmp/$run.from"
  "$bin" llm bench --url "$url" --rate "$rate" --seconds "$seconds" --out "$tmp/$run.json" \
    $([ "$run" = solo ] && echo --solo)
  date +%s.%N >"$tmp/$run.to"
  stop router-$run
  stop up-$run
done
# The split, from the JSON events (fastlane_bench::router_floor); then the run's metadata.
"$bin" llm bench --router-floor "$tmp" --out "$tmp/floor.json"
python3 - "$tmp/floor.json" "$out" "$seconds" "$command" "$load_before" "$(cut -d' ' -f1-3 /proc/loadavg)" \
  "$(date +%F)" "$(git rev-parse --short HEAD)" <<'PY'
import json, sys
floor, out, seconds, command, load_before, load_after, date, commit = sys.argv[1:9]
r = json.load(open(floor))
r["summary"]["seconds"] = int(seconds)
json.dump({"schema": 1, "component": "llm", "case": "router-floor", "date": date, "commit": commit,
           "command": command, "load": {"before": load_before, "after": load_after}, **r},
          open(out, "w"), indent=2)
print("wrote", out)
PY
