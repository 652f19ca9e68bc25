#!/usr/bin/env bash
# Scenario (a) over HTTP, scaled to the CPU engine: a quiet tenant at --rate requests/s beside a
# flood tenant at 30x that rate, as the client sees it (`fastlane llm bench --url`), against
# `fastlane llm serve --model random:small` started here three ways: the quiet tenant alone
# (solo baseline), the same load with --policy fifo (no gate), and with --policy drr (the gate:
# token bucket + slots + DRR). Results: benches/results/llm/<date>-<commit>-scenario-a-http.json.
# Usage: scripts/bench-serve.sh [--model random:small] [--rate 1] [--seconds 20]
set -euo pipefail
cd "$(dirname "$0")/.."
model=random:small rate=1 seconds=20
while [ $# -gt 0 ]; do
  case "$1" in
    --model) model=$2; shift ;;
    --rate) rate=$2; shift ;;
    --seconds) seconds=$2; shift ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    *) echo "bench-serve.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
cargo build --release --locked -p fastlane-tools
bin=target/release/fastlane
tmp=$(mktemp -d)
trap 'kill $(cat "$tmp/pid" 2>/dev/null) 2>/dev/null || true; rm -rf "$tmp"' EXIT
cat > "$tmp/tenants.toml" <<'TOML'
[[tenant]]
name = "quiet"
keys = ["key-quiet"]
rpm = 600
burst = 10
max_concurrent = 8
tier = "interactive"

[[tenant]]
name = "flood"
keys = ["key-flood"]
rpm = 600
burst = 10
max_concurrent = 8
tier = "batch"
queue = 16
TOML
run() { # policy label solo?
  "$bin" llm serve --model "$model" --tenants "$tmp/tenants.toml" --listen 127.0.0.1:0 --policy "$1" \
    >"$tmp/out" 2>"$tmp/log" &
  echo $! >"$tmp/pid"
  for _ in $(seq 150); do grep -q listening "$tmp/out" 2>/dev/null && break; sleep 0.2; done
  url=$(sed -n 's/^listening on //p' "$tmp/out")
  "$bin" llm bench --url "$url" --rate "$rate" --seconds "$seconds" $3 --out "$tmp/$2.json"
  kill -TERM "$(cat "$tmp/pid")"; wait "$(cat "$tmp/pid")" || true
}
echo "load before: $(cat /proc/loadavg)"
run fifo solo --solo
run fifo fifo ""
run drr drr ""
dir=${BENCH_RESULTS_DIR:-benches/results}/llm
mkdir -p "$dir"
out="$dir/$(date +%F)-$(git rev-parse --short HEAD)-scenario-a-http.json"
python3 - "$tmp" "$out" <<'PY'
import json, sys
tmp, out = sys.argv[1:3]
runs = {k: json.load(open(f"{tmp}/{k}.json")) for k in ("solo", "fifo", "drr")}
q = lambda k: next(t for t in runs[k]["tenants"] if t["tenant"] == "quiet")
f = lambda k: next(t for t in runs[k]["tenants"] if t["tenant"] == "flood")
summary = {
    "quiet_p99_ttft_ms": {k: q(k)["ttft_p99_ms"] for k in runs},
    "fifo_over_solo": q("fifo")["ttft_p99_ms"] / q("solo")["ttft_p99_ms"],
    "drr_over_solo": q("drr")["ttft_p99_ms"] / q("solo")["ttft_p99_ms"],
    "flood_completed_per_s_drr": f("drr")["completed_per_s"],
    "flood_bucket_per_s": 600 / 60,
}
json.dump({"component": "llm", "case": "scenario-a-http", "summary": summary, "runs": runs}, open(out, "w"), indent=2)
print(json.dumps(summary, indent=2))
print("wrote", out)
PY
