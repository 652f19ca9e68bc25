#!/usr/bin/env bash
# A fuzzing campaign: every cargo-fuzz target of every */fuzz crate runs for N seconds, one
# after the other, then a table (crate, target, inputs executed, seconds, crashes) is printed
# and written as benches/results/fuzz/<date>-<commit>.json (scripts/bench_results.py).
#
#   scripts/fuzz-campaign.sh [--seconds N]      # N per target, default 60
#
# Needs cargo-fuzz (installed with `cargo install cargo-fuzz --locked` when `cargo fuzz
# --version` fails) and runs it on stable Rust with RUSTC_BOOTSTRAP=1 (its AddressSanitizer
# build uses nightly flags). Each target starts from its committed seed corpus
# (<crate>/fuzz/corpus/<target>, read only); new inputs go to target/fuzz-campaign/corpus/,
# crash inputs to target/fuzz-campaign/artifacts/<crate>/<target>/. libFuzzer stops a target
# at its first crash, so "crashes" is 0 or 1; the script exits 1 if any target crashed.
# Not part of scripts/test.sh (which only builds the targets).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
args="$*"

seconds=60
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds=${2:?--seconds needs a value}; shift 2 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "fuzz-campaign.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
case "$seconds" in ''|*[!0-9]*|0) echo "fuzz-campaign.sh: --seconds wants a positive integer" >&2; exit 2 ;; esac

if ! cargo fuzz --version >/dev/null 2>&1; then
  cargo install cargo-fuzz --locked
fi
export RUSTC_BOOTSTRAP=1

work="$root/target/fuzz-campaign"
mkdir -p "$work"
rows="$work/rows.tsv"
: >"$rows"

for manifest in */fuzz/Cargo.toml; do
  crate=${manifest%%/fuzz/Cargo.toml}
  (cd "$crate" && cargo fuzz build -O --target-dir "$work/build")
  for target in $(cd "$crate" && cargo fuzz list); do
    corpus="$work/corpus/$crate/$target"
    artifacts="$work/artifacts/$crate/$target"
    log="$work/$crate-$target.log"
    mkdir -p "$corpus" "$artifacts"
    seeds=()
    [ -d "$crate/fuzz/corpus/$target" ] && seeds=("$root/$crate/fuzz/corpus/$target")
    echo "fuzz-campaign: $crate/$target for ${seconds}s (log $log)" >&2
    t0=$(date +%s)
    rc=0
    (cd "$crate" && cargo fuzz run -O --target-dir "$work/build" "$target" "$corpus" "${seeds[@]}" -- \
      -max_total_time="$seconds" -artifact_prefix="$artifacts/") >"$log" 2>&1 || rc=$?
    wall=$(( $(date +%s) - t0 ))
    # libFuzzer's last words: "Done N runs in S second(s)"; after a crash, the last "#N" line.
    runs=$(sed -n 's/^Done \([0-9]*\) runs in \([0-9]*\) second.*/\1/p' "$log" | tail -1)
    secs=$(sed -n 's/^Done \([0-9]*\) runs in \([0-9]*\) second.*/\2/p' "$log" | tail -1)
    [ -n "$runs" ] || runs=$(sed -n 's/^#\([0-9]*\)[[:space:]].*/\1/p' "$log" | tail -1)
    [ -n "$secs" ] || secs=$wall
    crashes=$(find "$artifacts" -type f \( -name 'crash-*' -o -name 'oom-*' -o -name 'timeout-*' -o -name 'leak-*' \) | wc -l)
    if [ "$rc" != 0 ] && [ "$crashes" = 0 ]; then
      echo "fuzz-campaign: $crate/$target exited $rc without a crash input; see $log" >&2
      crashes=1
    fi
    printf '%s\t%s\t%s\t%s\t%s\n' "$crate" "$target" "${runs:-0}" "$secs" "$crashes" >>"$rows"
  done
done

python3 - "$rows" "$seconds" "$args" <<'EOF'
import sys
sys.path.insert(0, "scripts")
from bench_results import write, row

rows_tsv, seconds, args = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rows = []
print("| crate | target | inputs executed | seconds | crashes |")
print("|---|---|---|---|---|")
for line in open(rows_tsv):
    crate, target, runs, secs, crashes = line.rstrip("\n").split("\t")
    inputs = f"{int(runs):,}".replace(",", " ")
    print(f"| {crate} | {target} | {inputs} | {secs} | {crashes} |")
    rows.append(row(f"{crate}/{target}", int(runs), "inputs", crate=crate, target=target,
                    seconds=int(secs), crashes=int(crashes)))
command = "scripts/fuzz-campaign.sh" + (f" {args}" if args else "")
write("fuzz", command, rows,
      notes=f"cargo fuzz run -O (AddressSanitizer, RUSTC_BOOTSTRAP=1), -max_total_time={seconds} "
            "per target, one target at a time, from the committed seed corpus")
sys.exit(1 if any(r["crashes"] for r in rows) else 0)
EOF
