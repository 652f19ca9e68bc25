#!/usr/bin/env bash
# The attack measurement (docs/serving.md, "Threat model and limits"): the quiet tenant's
# open-loop load against `fastlane llm serve`, alone and then while `fastlane llm bench
# --attack N` holds N connections of every hostile kind (no key with a trickled body, slow
# headers, a valid key that never reads, maximal prompts and stop lists, 429'd bursts), then
# the same through `fastlane router` before the server. Prints the quiet tenant's TTFT P99
# with the attack over without it (target <= 1.15), the server's RSS and threads, the answers
# per kind, and whether the logs hold a panic; writes benches/results/serving/<date>-<commit>-attack.json.
#
#   scripts/bench-attack.sh [--attack N] [--seconds S] [--rate R] [--policy P] [--fronts serve,router]
#                           [--kinds K,K...]
#   defaults 1000, 60, 4, llm serve's default policy, both fronts, every kind
set -euo pipefail
cd "$(dirname "$0")/.."
attack=1000 seconds=60 rate=4 policy=() fronts=serve,router kinds=()
while [ $# -gt 0 ]; do
  case "$1" in
    --attack) attack=${2:?}; shift 2 ;;
    --seconds) seconds=${2:?}; shift 2 ;;
    --rate) rate=${2:?}; shift 2 ;;
    --policy) policy=(--policy "${2:?}"); shift 2 ;;
    --fronts) fronts=${2:?}; shift 2 ;;
    --kinds) kinds=(--attack-kinds "${2:?}"); shift 2 ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "bench-attack.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
cargo build --release --locked -q -p fastlane-cli
bin=$PWD/target/release/fastlane
tmp=$(mktemp -d)
. scripts/serve-common.sh
cat > "$tmp/tenants.toml" <<'TOML'
[[tenant]]
name = "quiet"
keys = ["key-quiet"]
rpm = 600
burst = 10
max_concurrent = 8
tier = "interactive"

[[tenant]]
name = "attack"
keys = ["key-attack"]
rpm = 600000
burst = 100000
max_concurrent = 2000
queue = 4000
tier = "batch"
max_stream_seconds = 600

[[tenant]]
name = "burst"
keys = ["key-burst"]
rpm = 60
burst = 5
max_concurrent = 2
tier = "interactive"
TOML
write_upstream_tenants
ulimit -n "$(ulimit -Hn)"
# Client and server on different cores: the server (engine, HTTP workers, tokenizer) on core 0,
# the quiet load and the attackers on core 1.
server_cpus=0
bench() { # label url pid extra...: one run, JSON into $tmp/label.json (none: the run failed)
  # The same arrivals in both runs (one seed), prompts tagged by run: the attack run finds
  # none of the solo run's prompts in the prefix cache.
  local label=$1 u=$2 pid=$3; shift 3
  taskset -c 1 "$bin" llm bench --prompt-tag "$label." --url "$u" --solo --rate "$rate" --seconds "$seconds" \
    --server-pid "$pid" --json "$@" >"$tmp/$label.json" || {
    echo "bench-attack.sh: the $label run failed (above); recorded as failed" >&2
    rm -f "$tmp/$label.json"
  }
}
for front in ${fronts//,/ }; do
  if [ "$front" = serve ]; then
    start serve llm serve --model random:tiny --tenants "$tmp/tenants.toml" --device-blocks 8192 "${policy[@]}"
  else
    # The router is the gate; it passes each request's tier upstream (--upstream-batch-key),
    # the deployment docs/serving.md recommends: an upstream without tiers (fifo) serves the
    # attack tenant's maximal prompts ahead of the quiet tenant, which no router can undo
    # ("The router's floor").
    start serve llm serve --model random:tiny --tenants "$tmp/upstream-tenants.toml" --device-blocks 8192 "${policy[@]}"
  fi
  serve_url=$url target=$url pid=$(cat "$tmp/serve.pid")
  if [ "$front" = router ]; then
    start router router --upstream "$serve_url" --tenants "$tmp/tenants.toml" \
      --upstream-key up-interactive --upstream-batch-key up-batch
    target=$url pid=$(cat "$tmp/router.pid")
  fi
  echo "== $front: solo" >&2
  bench "$front-solo" "$target" "$pid"
  echo "== $front: under attack ($attack connections of each kind)" >&2
  bench "$front-attack" "$target" "$pid" --attack "$attack" "${kinds[@]}"
  [ "$front" = router ] && stop router
  stop serve
  cat "$tmp"/*.log >"$tmp/$front-logs.txt"
done
FRONTS=$fronts python3 - "$tmp" "$attack" "$seconds" "$rate" "$*" <<'PY'
import json, os, sys
sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
from bench_results import write
tmp, attack, seconds, rate, args = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
rows, raw, failed = [], {}, False
print(f"quiet tenant at {rate}/s for {seconds} s; {attack} hostile connections of each kind")
print(f"{'front':<7} {'solo P99':>10} {'attack P99':>11} {'ratio':>6} {'ok/sent':>9} {'RSS end':>10} {'threads':>8} {'panics':>6}")
for front in [f for f in ["serve", "router"] if f in os.environ["FRONTS"].split(",")]:
    if not all(os.path.exists(f"{tmp}/{front}-{k}.json") for k in ("solo", "attack")):
        print(f"{front:<7} FAILED: no request of the quiet tenant succeeded in a run (log above)")
        rows.append({"case": f"{front}: quiet TTFT P99 under attack / solo", "failed": True})
        failed = True
        continue
    solo = json.load(open(f"{tmp}/{front}-solo.json"))
    att = json.load(open(f"{tmp}/{front}-attack.json"))
    raw[front] = {"solo": solo, "attack": att}
    s, a = solo["tenants"][0], att["tenants"][0]
    ratio = a["ttft_p99_ms"] / s["ttft_p99_ms"]
    panics = open(f"{tmp}/{front}-logs.txt").read().count("panicked")
    end = att["server_at_end"] or {}
    print(f"{front:<7} {s['ttft_p99_ms']:>8.1f}ms {a['ttft_p99_ms']:>9.1f}ms {ratio:>6.2f} "
          f"{a['ok']:>4}/{a['sent']:<4} {end.get('rss_kb', 0) / 1024:>7.0f} MB {end.get('threads', 0):>8} {panics:>6}")
    for kind, k in (att.get("attack") or {}).items():
        print(f"    {kind:<16} opened {k['opened']:>7}  answered {k['statuses']}")
    rows.append({"case": f"{front}: quiet TTFT P99 under attack / solo", "value": a["ttft_p99_ms"],
                 "unit": "ms", "peer": s["ttft_p99_ms"], "ratio": ratio, "target": 1.15,
                 "ok": a["ok"], "sent": a["sent"], "server_rss_kb": end.get("rss_kb"),
                 "server_threads": end.get("threads"), "panics": panics})
    failed |= panics > 0 or a["ok"] != a["sent"]
load = raw.get("serve", {}).get("attack", {}).get("load")
print(f"load {load}")
write("serving", "scripts/bench-attack.sh " + args, rows, raw=raw, load=load, label="attack")
sys.exit(1 if failed else 0)
PY
