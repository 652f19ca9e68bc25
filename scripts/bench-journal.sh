#!/usr/bin/env bash
# Durable-ack latency of the record journal against pwrite+fdatasync of the same bytes, for
# several writer configurations run interleaved (config A, B, C, A, B, C, ...) so that every
# configuration sees the same minutes of a shared disk whose flush time drifts. Each run is one
# `fastlane journal bench` (its floor is measured half right before and half right after its
# own ack run), and the same load without a journal (one pwrite+fdatasync per record, in
# arrival order, by one thread). Prints one row per run and, per configuration, the median and
# worst ratios to both.
#
#   scripts/bench-journal.sh [--rounds N] [--file PATH] [--bin PATH-TO-RELEASE-fastlane]
#                            [--config "ARGS"]... [-- EXTRA BENCH ARGS]
#
# Defaults: 3 rounds; file OUT/bench.journal (OUT = --out, default target/bench-journal: the
#   repository's file system; on the dev VM ext4 on its virtio disk); configs
#   "--writer-io pipelined --io uring"   (the default: one queue, a write and two flushes in
#                                         flight; io_uring runs fdatasync on an io-wq worker)
#   "--writer-io pipelined --io sync"    (the writer thread runs pwrite and fdatasync itself)
#   "--writer-io pipelined --io sync --ack-wait poll"
#                                        (the same, the idle writer and the waiter polling
#                                         instead of sleeping on futexes)
#   "--writer-io flusher --io sync --ack-wait poll"
#                                        (the writer pwrites; two flusher threads fdatasync and
#                                         acknowledge; writer and waiter polling)
# and extra args "--writer-core 1 --producer-core 0 --waiter-core 0 --records 200000 --size 256M"
# (the waiter shares the producer's core, as before #6: measured a little better than letting it
# float onto the writer's core).
# All with the bench's default --prefill true (journal and floor files both filled with written
# zeroes). "-- ARGS" replaces the extra args, e.g. "-- --writer-core 1 --producer-core 0
# --waiter-core 0 --records 200000 --size 256M --prefill false" for fallocate'd files
# (unwritten extents) on both sides.
# Writes DIR/journal-<round>-<n>.{json,log,hlog} under target/bench-journal, and the rows as
# benches/results/journal/<date>-<commit>.json (scripts/bench_results.py reads the JSON).
set -euo pipefail
cd "$(dirname "$0")/.."
command="scripts/bench-journal.sh$(printf ' %q' "$@")"

rounds=3 file= bin= out=target/bench-journal
configs=()
extra=(--writer-core 1 --producer-core 0 --waiter-core 0 --records 200000 --size 256M)
while [ $# -gt 0 ]; do
    case "$1" in
        --rounds) rounds=$2; shift ;;
        --file) file=$2; shift ;;
        --bin) bin=$2; shift ;;
        --config) configs+=("$2"); shift ;;
        --out) out=$2; shift ;;
        --) shift; extra=("$@"); break ;;
        -h|--help) sed -n '2,32p' "$0"; exit 0 ;;
        *) echo "bench-journal.sh: unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
if [ ${#configs[@]} -eq 0 ]; then
    configs=("--writer-io pipelined --io uring" "--writer-io pipelined --io sync"
             "--writer-io pipelined --io sync --ack-wait poll"
             "--writer-io flusher --io sync --ack-wait poll")
fi
file=${file:-$out/bench.journal}
mkdir -p "$out" "$(dirname "$file")"
if [ -z "$bin" ]; then
    cargo build --release --locked -p fastlane-cli >&2
    bin="${CARGO_TARGET_DIR:-target}/release/fastlane"
fi

echo "uptime before: $(uptime)"
echo "bench args: ${extra[*]}"
runs=$out/runs.tsv
: >"$runs"
for r in $(seq 1 "$rounds"); do
    n=0
    for c in "${configs[@]}"; do
        n=$((n + 1))
        log=$out/journal-$r-$n.log json=$out/journal-$r-$n.json
        echo "round $r/$rounds: $c" >&2
        # shellcheck disable=SC2086 # $c holds several arguments on purpose
        "$bin" journal bench "$file" $c "${extra[@]}" --hlog "$out/journal-$r-$n.hlog" --json \
            >"$json" 2>"$log" || { echo "run $r/$n ($c) failed, see $log" >&2; continue; }
        printf '%s\t%s\t%s\n' "$r" "$c" "$json" >>"$runs"
    done
done
echo "uptime after: $(uptime)"
# The table, per-config medians and the results file, from the runs' JSON.
python3 scripts/bench_results.py journal "$runs" "$command"
