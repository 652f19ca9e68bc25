#!/usr/bin/env bash
# Scenario (a) over HTTP, scaled to the CPU engine: a quiet tenant at --rate requests/s beside a
# flood tenant at 30x that rate, as the client sees it (`fastlane llm bench --url`), against
# `fastlane llm serve --model random:small` started here eleven ways:
#   solo         the quiet tenant alone (the baseline), --policy fifo
#   fifo         both tenants, --policy fifo (no gate)
#   drr          both tenants, --policy drr (the gate in the engine: bucket + slots + DRR; the
#                defaults: preemptible steps, --tier-steps separate)
#   shared       as drr, with --tier-steps shared (batch work fills what the quiet prefill
#                leaves of its step, as it would on a GPU)
#   router       both tenants through `fastlane router` in front of an `llm serve --policy fifo`
#   router-paced as router, with --batch-prefills 1 (one batch prompt at a time awaiting its
#                first bytes at the upstream)
#   router-tiers the router in front of an `llm serve --policy drr` whose two tenants (one
#                interactive, one batch) are the router's tiers (--upstream-batch-key)
#   slow         as drr, with 1,000 streams of a third tenant held open by clients that never read
#   unprotected  as drr, with --protect off (latency protection is on by default)
#   drr-preempt  --policy drr+preempt (batch prefill sits out while an interactive prefill waits)
#   same-tier    as drr, with the flood tenant in the interactive tier too (one tier, no tier
#                rule to lean on: fairness between tenants of the same tier)
#   same-tier-unprotected  the same with --protect off
#   whole-steps  as drr, with --preemptible-steps off (every step runs to its end; before
#                the default became on, a step in flight was never given up for a quiet request)
# Results: benches/results/llm/<date>-<commit>-scenario-a-http.json (+ .hlog and SVG per run).
# --split: the solo and same-tier servers write their engine's trace events and
# scripts/engine-split.py prints where the quiet tenant's engine time went in each.
# KEEP_SPLIT_LOGS=DIR keeps each run's events there (split-LABEL.log).
# Every run sends its load for --warmup seconds first and counts none of it (`llm bench
# --warmup`): the flood tenant starts with a full rate bucket and, in same-tier, is protected
# like the quiet tenant until it has spent it (about a second); one quiet request there was
# the slowest of a run.
# Usage: scripts/bench-serve.sh [--model random:small] [--rate 1] [--seconds 60] [--warmup 5] [--arrivals poisson|bursty] [--split]
#          [--runs solo,fifo,drr,same-tier,same-tier-unprotected,shared,whole-steps,slow,unprotected,drr-preempt,router,router-paced,router-tiers]   (default: all; the P99/solo
#          ratios need solo among them)
set -euo pipefail
cd "$(dirname "$0")/.."
all_runs=solo,fifo,drr,same-tier,same-tier-unprotected,shared,whole-steps,slow,unprotected,drr-preempt,router,router-paced,router-tiers
model=random:small rate=1 seconds=60 warmup=5 arrivals=poisson runs=$all_runs split=
while [ $# -gt 0 ]; do
  case "$1" in
    --model) model=$2; shift ;;
    --rate) rate=$2; shift ;;
    --seconds) seconds=$2; shift ;;
    --warmup) warmup=$2; shift ;;
    --arrivals) arrivals=$2; shift ;;
    --runs) runs=$2; shift ;;
    --split) split=1 ;;
    -h|--help) sed -n '2,34p' "$0"; exit 0 ;;
    *) echo "bench-serve.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
for r in ${runs//,/ }; do
  case ",$all_runs," in
    *",$r,"*) ;;
    *) echo "bench-serve.sh: unknown run $r (runs: $all_runs)" >&2; exit 2 ;;
  esac
done
want() { case ",$runs," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
cargo build --release --locked -p fastlane-cli
bin=target/release/fastlane
tmp=$(mktemp -d)
dir=${BENCH_RESULTS_DIR:-benches/results}/llm
stem="$(date +%F)-$(git rev-parse --short HEAD)-scenario-a-http"
# A second run on the same day and commit gets -2, -3, ... (never overwrites one).
if [ -e "$dir/$stem.json" ] || [ -e "$dir/$stem" ]; then
  n=2
  while [ -e "$dir/$stem-$n.json" ] || [ -e "$dir/$stem-$n" ]; do n=$((n + 1)); done
  stem="$stem-$n"
fi
mkdir -p "$dir/$stem"
. scripts/serve-common.sh
write_tenants
cat >> "$tmp/tenants.toml" <<'TOML'

[[tenant]]
name = "slow"
keys = ["key-slow"]
rpm = 600000
burst = 2000
max_concurrent = 2000
tier = "batch"
queue = 2000
TOML
write_upstream_tenants
engine_url=""
bench() { # label url extra...: the load, and the engine's steps over it (--engine-metrics)
  local label=$1 u=$2; shift 2
  echo "== $label"
  "$bin" llm bench --url "$u" --rate "$rate" --seconds "$seconds" --warmup "$warmup" --arrivals "$arrivals" \
    --engine-metrics "$engine_url" --hlog-dir "$dir/$stem/$label" --out "$tmp/$label.json" "$@"
}
# With --split: `start_up ARGS...` starts `up` writing the engine's trace events, and
# `split LABEL` prints the quiet tenant's engine split over the events since the last call.
start_up() {
  if [ -n "$split" ]; then
    RUST_LOG=info,fastlane_llm::engine=trace start up "$@" --log-format json
  else
    start up "$@"
  fi
  split_from=1
}
split() {
  [ -n "$split" ] || return 0
  tail -n +"$split_from" "$tmp/up.log" >"$tmp/split-$1.log"
  split_from=$(($(wc -l <"$tmp/up.log") + 1))
  echo "== engine split, $1"
  python3 scripts/engine-split.py "$tmp/split-$1.log" --top 5 --skip "$warmup" || true
  [ -z "${KEEP_SPLIT_LOGS:-}" ] || cp "$tmp/split-$1.log" "$KEEP_SPLIT_LOGS/"
}
echo "load before: $(cat /proc/loadavg)"
engine=(llm serve --model "$model" --tenants "$tmp/tenants.toml" --device-blocks 4096)
if want solo || want fifo; then
  start_up "${engine[@]}" --policy fifo
  engine_url=$url
  if want solo; then bench solo "$url" --solo; split solo; fi
  if want fifo; then bench fifo "$url"; fi
  stop up
fi
if want drr || want slow; then
  start up "${engine[@]}" --policy drr
  engine_url=$url
  if want drr; then bench drr "$url"; fi
  if want slow; then bench slow "$url" --slow-streams 1000 --slow-tokens 64; fi
  stop up
fi
sed 's/^tier = "batch"$/tier = "interactive"/' "$tmp/tenants.toml" >"$tmp/same-tier.toml"
for r in same-tier same-tier-unprotected; do
  want $r || continue
  start_up llm serve --model "$model" --tenants "$tmp/same-tier.toml" --device-blocks 4096 \
    --policy drr --protect "$([ $r = same-tier ] && echo on || echo off)"
  engine_url=$url
  bench $r "$url"
  split $r
  stop up
done
if want shared; then
  start up "${engine[@]}" --policy drr --tier-steps shared
  engine_url=$url
  bench shared "$url"
  stop up
fi
if want unprotected; then
  start up "${engine[@]}" --policy drr --protect off
  engine_url=$url
  bench unprotected "$url"
  stop up
fi
if want drr-preempt; then
  start up "${engine[@]}" --policy drr+preempt
  engine_url=$url
  bench drr-preempt "$url"
  stop up
fi
if want whole-steps; then
  start up "${engine[@]}" --policy drr --preemptible-steps off
  engine_url=$url
  bench whole-steps "$url"
  stop up
fi
for r in router router-paced; do
  want $r || continue
  start up llm serve --model "$model" --device-blocks 4096 --policy fifo
  engine_url=$url
  start router router --upstream "$url" --tenants "$tmp/tenants.toml" \
    --batch-prefills "$([ $r = router-paced ] && echo 1 || echo 0)"
  bench $r "$url"
  stop router
  stop up
done
if want router-tiers; then
  start up llm serve --model "$model" --device-blocks 4096 --policy drr --tenants "$tmp/upstream-tenants.toml"
  engine_url=$url
  start router router --upstream "$url" --tenants "$tmp/tenants.toml" \
    --upstream-key up-interactive --upstream-batch-key up-batch
  bench router-tiers "$url"
  stop router
  stop up
fi
out="$dir/$stem.json"
python3 - "$tmp" "$out" "$rate" "$runs" <<'PY'
import json, sys
tmp, out, rate = sys.argv[1], sys.argv[2], float(sys.argv[3])
order = ("solo", "fifo", "drr", "same-tier", "same-tier-unprotected", "shared", "whole-steps",
         "router", "router-paced", "router-tiers", "slow", "unprotected", "drr-preempt")
chosen = sys.argv[4].split(",")
runs = {k: json.load(open(f"{tmp}/{k}.json")) for k in order if k in chosen}
t = lambda k, n: next(x for x in runs[k]["tenants"] if x["tenant"] == n)

solo = t("solo", "quiet")["ttft_p99_ms"] if "solo" in runs else None
summary = {
    "quiet_p99_ttft_ms": {k: t(k, "quiet")["ttft_p99_ms"] for k in runs},
    "quiet_p50_ttft_ms": {k: t(k, "quiet")["ttft_p50_ms"] for k in runs},
    "quiet_samples": {k: t(k, "quiet")["ok"] for k in runs},
    "over_solo_p99": {k: t(k, "quiet")["ttft_p99_ms"] / solo for k in runs if k != "solo" and solo},
    "flood_completed_per_s": {k: t(k, "flood")["completed_per_s"] for k in runs if k != "solo"},
    # The flood's streams pay for the quiet tenant's steps: inter-token latency as it sees it.
    "flood_itl_p99_ms": {k: t(k, "flood")["itl_p99_ms"] for k in runs if k != "solo"},
    "flood_bucket_per_s": 600 / 60,
    "flood_offered_per_s": 30 * rate,
    "slow_streams_held": runs["slow"]["slow_streams_held"] if "slow" in runs else None,
    # `llm bench --engine-metrics`: bucket upper bounds of the steps that ran to their end (a
    # step given up is not in the histogram; without --preemptible-steps a request waits for
    # the step in flight) and the steps given up.
    "engine_step_ms": {k: runs[k]["engine"] for k in runs},
    "engine_steps_aborted": {k: runs[k]["engine"]["aborted"] for k in runs if not k.startswith("router")},
}
json.dump({"component": "llm", "case": "scenario-a-http", "summary": summary, "runs": runs},
          open(out, "w"), indent=2)
print(json.dumps(summary, indent=2))
print("wrote", out)
PY
