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
python3 - "$tmp" "$out" "$seconds" "$command" "$load_before" "$(cut -d' ' -f1-3 /proc/loadavg)" \
  "$(date +%F)" "$(git rev-parse --short HEAD)" <<'PY'
import bisect, datetime, json, sys
tmp, out, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3])
command, load_before, load_after, date, commit = sys.argv[4:9]
epoch = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
def events(name, event):
    # (wall-clock µs of the record, its fields) for every JSON log line with fields.event == event
    for l in open(f"{tmp}/{name}.log"):
        if not l.startswith("{"):
            continue
        r = json.loads(l)
        f = r.get("fields", {})
        if f.get("event") == event:
            t = datetime.datetime.fromisoformat(r["timestamp"].replace("Z", "+00:00"))
            yield (t - epoch) // datetime.timedelta(microseconds=1), f
steps = sorted((t - f["step_us"], t, f["prefill_items"] > 0) for t, f in events("up-loaded", "step"))
starts = [s[0] for s in steps]
# Submission to the engine (the event is written when the engine thread takes it, between
# steps; it says how long before that the request was submitted).
arrived = sorted(t - f["waited_us"] for t, f in events("up-loaded", "request_taken"))
window = lambda run: tuple(int(float(open(f"{tmp}/{run}.{e}").read()) * 1e6) for e in ("from", "to"))
lo, hi = window("loaded")
# Both router events say how long after the request's arrival at the router they were written:
# a dispatch and a first bytes with the same arrival (within 1 ms) are the same request.
dispatched = {t - f["after_us"]: t for t, f in events("router-loaded", "dispatched")
              if f["tenant"] == "quiet" and lo <= t <= hi}
firsts = [(t - f["after_us"], t, f["after_us"]) for t, f in events("router-loaded", "first_bytes")
          if f["tenant"] == "quiet" and lo <= t <= hi]
by_arrival = sorted(dispatched)
pairs = []
for arrival, f, ttft in firsts:
    k = bisect.bisect_left(by_arrival, arrival - 1000)
    if k < len(by_arrival) and abs(by_arrival[k] - arrival) <= 1000:
        pairs.append((dispatched[by_arrival[k]], f, ttft))
parts = []
for d, f, ttft in pairs:
    # Its arrival at the upstream: the first engine arrival after the dispatch.
    k = bisect.bisect_left(arrived, d)
    a = arrived[k] if k < len(arrived) else d
    i = bisect.bisect_right(starts, a) - 1
    flight = max(0, steps[i][1] - a) if i >= 0 else 0
    j = bisect.bisect_right(starts, f) - 1
    while j >= 0 and steps[j][1] > f:
        j -= 1
    own = steps[j][1] - steps[j][0] if j > i else 0
    between = sum(s[1] - s[0] for s in steps[i + 1:j]) if j > i + 1 else 0
    parts.append({"ttft": ttft, "in_flight": flight, "between": between, "own_step": own,
                  "rest": ttft - flight - between - own, "floor": flight + own})
def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] / 1e3 if xs else float("nan")
busy = [s for s in steps if lo <= s[0] <= hi]
span = (busy[-1][1] - busy[0][0]) if busy else 1
quiet = lambda run: next(x for x in json.load(open(f"{tmp}/{run}.json"))["tenants"]
                         if x["tenant"] == "quiet")
flood = next(x for x in json.load(open(f"{tmp}/loaded.json"))["tenants"] if x["tenant"] == "flood")
solo_p99 = quiet("solo")["ttft_p99_ms"]
summary = {
    "seconds": seconds,
    "quiet_samples": len(parts),
    "solo_p99_ms": solo_p99,
    "loaded_p99_ms": quiet("loaded")["ttft_p99_ms"],
    "loaded_over_solo_p99": quiet("loaded")["ttft_p99_ms"] / solo_p99,
    "flood_completed_per_s": flood["completed_per_s"],
    "upstream_busy_share": sum(s[1] - s[0] for s in busy) / span,
    "upstream_prefill_step_share": sum(s[1] - s[0] for s in busy if s[2]) / span,
    "router_ttft_ms": {k: {"p50": pct([p[k] for p in parts], 0.5), "p99": pct([p[k] for p in parts], 0.99)}
                       for k in ("ttft", "in_flight", "between", "own_step", "rest", "floor")},
}
summary["floor_over_solo_p99"] = summary["router_ttft_ms"]["floor"]["p99"] / solo_p99
json.dump({"schema": 1, "component": "llm", "case": "router-floor", "date": date, "commit": commit,
           "command": command, "load": {"before": load_before, "after": load_after},
           "summary": summary, "requests": parts}, open(out, "w"), indent=2)
r = summary["router_ttft_ms"]
print(f"quiet tenant through the router before `llm serve --policy fifo`, {seconds} s each, "
      f"{len(parts)} quiet requests; solo P99 {solo_p99:.1f} ms, loaded P99 "
      f"{summary['loaded_p99_ms']:.1f} ms ({summary['loaded_over_solo_p99']:.2f}x), flood "
      f"{flood['completed_per_s']:.2f}/s")
print(f"upstream busy {summary['upstream_busy_share']:.0%} of the loaded run, in steps with a "
      f"prefill {summary['upstream_prefill_step_share']:.0%}")
print(f"{'part of the TTFT (router-measured)':<36} {'P50 ms':>8} {'P99 ms':>8}")
for k, name in (("in_flight", "upstream step in flight at arrival"), ("between", "steps between"),
                ("own_step", "its own step"), ("rest", "rest (router, HTTP, sampling)"),
                ("ttft", "TTFT at the router"), ("floor", "floor: in flight + own step")):
    print(f"{name:<36} {r[k]['p50']:>8.1f} {r[k]['p99']:>8.1f}")
print(f"floor P99 / solo P99: {summary['floor_over_solo_p99']:.2f}x")
print("wrote", out)
PY
