#!/usr/bin/env bash
# kvswap's host and NVMe tiers against their peers in one run per checksum mode (BENCHMARKS.md,
# "kvswap tiers"): `fastlane kv bench --json` with --checksum fast, off and crc32c on the same
# sequence, written as benches/results/kvswap/<date>-<commit>-tiers.json
# (scripts/bench_results.py).
#
#   scripts/bench-kv.sh [--bytes 1G] [--rounds 3] [--samples 10] [--tiers host,nvme]
#                       [--file /tmp/kvbench.dat] [--bin PATH]
#
# Builds the release binary unless --bin is given. Run it with nothing else running.
set -euo pipefail
cd "$(dirname "$0")/.."
bytes=1G rounds=3 samples=10 tiers=host,nvme file=/tmp/kvbench.dat bin=
while [ $# -gt 0 ]; do
  case "$1" in
    --bytes) bytes=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --samples) samples=$2; shift 2 ;;
    --tiers) tiers=$2; shift 2 ;;
    --file) file=$2; shift 2 ;;
    --bin) bin=$2; shift 2 ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "bench-kv.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
if [ -z "$bin" ]; then
  cargo build --release --locked -p fastlane-cli
  bin=target/release/fastlane
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
echo "load before: $load_before"
for mode in fast off crc32c; do
  echo "== checksum $mode"
  "$bin" kv bench --bytes "$bytes" --rounds "$rounds" --samples "$samples" --tiers "$tiers" \
    --checksum "$mode" --file "$file" --hlog "$tmp/swapin-$mode.hlog" --json >"$tmp/$mode.json"
  python3 - "$tmp/$mode.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for b in r["bandwidth"]:
    peer = b["peer_bytes_per_s"] / 2**30 if b.get("peer_bytes_per_s") else float("nan")
    print(f'{b["case"]:<40} peer {peer:6.2f} GiB/s  ours {b["ours_bytes_per_s"] / 2**30:6.2f} GiB/s  '
          f'ratio {b.get("ours_vs_peer") or float("nan"):.2f}')
PY
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
echo "load after: $load_after"
python3 scripts/bench_results.py kv-tiers "$tmp" "$load_before" "$load_after" \
  "scripts/bench-kv.sh --bytes $bytes --rounds $rounds --samples $samples --tiers $tiers"
