#!/usr/bin/env bash
# The attack measurement (docs/serving.md, "Threat model and limits"): the quiet tenant's
# open-loop load against `fastlane llm serve`, alone and then while `fastlane llm bench
# --attack N` holds N connections of every hostile kind (no key with a trickled body, slow
# headers, a valid key that never reads, maximal prompts and stop lists, 429'd bursts), then
# the same through `fastlane router` before the server. Prints the quiet tenant's TTFT P99
# with the attack over without it (target <= 1.15), the server's RSS and threads, the answers
# per kind, and whether the logs hold a panic. Beside the quiet load a keyless probe (--probe-rate
# a second, a fresh connection each, timed to its 401) measures the HTTP layer alone, and the same
# probe and the refused-at-once kinds (burst_429, no_key_trickle, those of --kinds) against a bare
# accept/read/401/close server (`llm bench --attack-floor`, one
# thread on the server's core) give the floor: what the attack costs a new client on this machine
# with no server work in the way. Writes benches/results/serving/<date>-<commit>-attack.json.
#
# With --split, `llm serve` writes its engine's trace events (one a step and a request) and
# scripts/engine-split.py prints where the quiet tenant's engine time went in each run.
# --serve-flag F (repeatable) passes F to `llm serve` (e.g. --serve-flag=--hold-accepts=off).
# --keep-alive: the quiet tenant reuses its connections (as the OpenAI SDKs do) in both runs.
#
#   scripts/bench-attack.sh [--attack N] [--seconds S] [--rate R] [--policy P] [--fronts serve,router]
#                           [--kinds K,K...] [--probe-rate P] [--split] [--serve-flag F]... [--keep-alive]
#   defaults 1000, 60, 4, llm serve's default policy, both fronts, every kind, 20
set -euo pipefail
cd "$(dirname "$0")/.."
attack=1000 seconds=60 rate=4 policy=() fronts=serve,router kinds=() probe=20 split= serve_flags=() client=()
while [ $# -gt 0 ]; do
  case "$1" in
    --attack) attack=${2:?}; shift 2 ;;
    --seconds) seconds=${2:?}; shift 2 ;;
    --rate) rate=${2:?}; shift 2 ;;
    --policy) policy=(--policy "${2:?}"); shift 2 ;;
    --fronts) fronts=${2:?}; shift 2 ;;
    --kinds) kinds=(--attack-kinds "${2:?}"); shift 2 ;;
    --probe-rate) probe=${2:?}; shift 2 ;;
    --split) split=1; shift ;;
    --keep-alive) client=(--keep-alive); shift ;;
    --serve-flag) serve_flags+=("${2:?}"); shift 2 ;;
    --serve-flag=*) serve_flags+=("${1#--serve-flag=}"); shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
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
    --server-pid "$pid" --probe-rate "$probe" --engine-metrics "$serve_url" --json "${client[@]}" "$@" >"$tmp/$label.json" || {
    echo "bench-attack.sh: the $label run failed (above); recorded as failed" >&2
    rm -f "$tmp/$label.json"
  }
}
for front in ${fronts//,/ }; do
  if [ "$front" = serve ]; then
    args=(llm serve --model random:tiny --tenants "$tmp/tenants.toml" --device-blocks 8192 "${policy[@]}" "${serve_flags[@]}")
    if [ -n "$split" ]; then
      RUST_LOG=info,fastlane_llm::engine=trace start serve "${args[@]}" --log-format json
    else
      start serve "${args[@]}"
    fi
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
  [ -n "$split" ] && [ "$front" = serve ] && cp "$tmp/serve.log" "$tmp/split-solo.log"
  echo "== $front: under attack ($attack connections of each kind)" >&2
  bench "$front-attack" "$target" "$pid" --attack "$attack" "${kinds[@]}"
  if [ -n "$split" ] && [ "$front" = serve ]; then
    # The attack run's events: the log's lines after the solo run's.
    tail -n +"$(($(wc -l <"$tmp/split-solo.log") + 1))" "$tmp/serve.log" >"$tmp/split-attack.log"
    for run in solo attack; do
      echo "== engine split, $run" >&2
      python3 scripts/engine-split.py "$tmp/split-$run.log" --top 5 >&2 || true
    done
  fi
  [ "$front" = router ] && stop router
  stop serve
  cat "$tmp"/*.log >"$tmp/$front-logs.txt"
done
# The floor: the kinds any server refuses at once (one that a server holds reconnects at once
# when refused, and would be another attack).
floor_kinds=$(python3 -c 'import sys; k = sys.argv[1].split(",") if sys.argv[1] else ["burst_429", "no_key_trickle"]
print(",".join(x for x in k if x in ("burst_429", "no_key_trickle")))' "${kinds[1]:-}")
if [ -n "$floor_kinds" ]; then
  echo "== floor: a bare server under $floor_kinds" >&2
  taskset -c 1 "$bin" llm bench --attack-floor --floor-core "$server_cpus" --attack "$attack" \
    --attack-kinds "$floor_kinds" --probe-rate "$probe" --seconds "$seconds" --json >"$tmp/floor.json" || {
    echo "bench-attack.sh: the floor run failed (above)" >&2
    rm -f "$tmp/floor.json"
  }
fi
export FLOOR_KINDS=$floor_kinds
FRONTS=$fronts python3 - "$tmp" "$attack" "$seconds" "$rate" "$*" <<'PY'
import json, os, sys
sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
from bench_results import write
tmp, attack, seconds, rate, args = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
rows, raw, failed, probes = [], {}, False, {}
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
    # The engine's own view (llm serve's TTFT and its stages, P99 as the bound of the bucket
    # holding it, ms): where the quiet tenant's added time is spent inside the server.
    stages = lambda r: ((r.get("engine") or {}).get("ttft_stages") or {}).get("quiet" if front == "serve" else "router", {})
    ss, sa = stages(solo), stages(att)
    if ss and sa:
        cells = [f"{k} {ss.get(k, {}).get('p99_le_ms')} -> {sa.get(k, {}).get('p99_le_ms')}" for k in ("total", "admit", "engine", "engine_thread", "respond")]
        print("    server P99 bucket, ms (solo -> attack): " + ", ".join(cells))
        rows_stages = {"solo": ss, "attack": sa}
    else:
        rows_stages = None
    rows.append({"case": f"{front}: quiet TTFT P99 under attack / solo", "value": a["ttft_p99_ms"],
                 "unit": "ms", "peer": s["ttft_p99_ms"], "ratio": ratio, "target": 1.15,
                 "ok": a["ok"], "sent": a["sent"], "server_rss_kb": end.get("rss_kb"),
                 "server_threads": end.get("threads"), "panics": panics, "server_ttft_stages": rows_stages})
    failed |= panics > 0 or a["ok"] != a["sent"]
    # The attack's CPU on the server: the attack run's CPU less the solo run's (same load and
    # length), over the attacking connections opened.
    cpu = lambda r: (r["server_at_end"] or {}).get("cpu_s", 0) - (r["server_at_start"] or {}).get("cpu_s", 0)
    opened = sum(k["opened"] for k in (att.get("attack") or {}).values())
    per_conn = (cpu(att) - cpu(solo)) * 1e6 / opened if opened else None
    probes[front] = (solo.get("probe"), att.get("probe"), per_conn)
    rows[-1]["ttft_p99_added_ms"] = a["ttft_p99_ms"] - s["ttft_p99_ms"]
if os.path.exists(f"{tmp}/floor.json"):
    fl = json.load(open(f"{tmp}/floor.json"))
    raw["floor"] = fl
    f = fl["floor"]
    probes["floor"] = (f["probe_solo"], f["probe_attack"], f["cpu_us_per_connection"])
elif os.environ["FLOOR_KINDS"]:
    print("floor   FAILED: the bare server's run failed (log above)")
    failed = True
if os.environ["FLOOR_KINDS"]:
    print(f"(the floor: a bare accept/read/401/close server under {os.environ['FLOOR_KINDS']} only)")
print(f"keyless probe (a fresh connection, timed to its 401) at the same time, and the server CPU per attacking connection")
print(f"{'server':<7} {'solo P99':>10} {'attack P99':>11} {'added':>9} {'failed':>7} {'CPU/conn':>9}")
for name, (ps, pa, per_conn) in probes.items():
    if not ps or not pa:
        print(f"{name:<7} no probe")
        continue
    added = pa["p99_ms"] - ps["p99_ms"]
    pc = f"{per_conn:>7.1f}us" if per_conn is not None else f"{'?':>9}"
    print(f"{name:<7} {ps['p99_ms']:>8.2f}ms {pa['p99_ms']:>9.2f}ms {added:>7.2f}ms {pa['failed']:>7} {pc}")
    case = f"floor ({os.environ['FLOOR_KINDS']}): keyless probe P99 under attack / solo" if name == "floor" else f"{name}: keyless probe P99 under attack / solo"
    rows.append({"case": case, "value": pa["p99_ms"], "unit": "ms", "peer": ps["p99_ms"],
                 "ratio": pa["p99_ms"] / ps["p99_ms"], "added_ms": added, "probes_failed": pa["failed"],
                 "cpu_us_per_attack_connection": per_conn})
    failed |= pa["failed"] > 0
load = raw.get("serve", {}).get("attack", {}).get("load")
print(f"load {load}")
write("serving", "scripts/bench-attack.sh " + args, rows, raw=raw, load=load, label="attack")
sys.exit(1 if failed else 0)
PY
