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
# Writes DIR/journal-<round>-<n>.{log,hlog} under target/bench-journal, and the rows as
# benches/results/journal/<date>-<commit>.json (scripts/bench_results.py).
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
rows=$out/rows.txt
: >"$rows"
rm -f "$out"/rows-*.txt
printf '%-5s %-34s %9s %9s %9s %9s %9s %7s %7s %9s %8s\n' round config \
    'ack p50' 'ack p99' 'p99.9' 'floor50' 'floor99' 'x p50' 'x p99' 'nojrn99' 'x nojrn'
for r in $(seq 1 "$rounds"); do
    n=0
    for c in "${configs[@]}"; do
        n=$((n + 1))
        log=$out/journal-$r-$n.log
        # shellcheck disable=SC2086 # $c holds several arguments on purpose
        "$bin" journal bench "$file" $c "${extra[@]}" --hlog "$out/journal-$r-$n.hlog" >"$log" 2>&1 \
            || { echo "run $r/$n ($c) failed, see $log" >&2; continue; }
        awk -v r="$r" -v c="$c" '
            /^append->durable ack/ { a50 = $(NF-4); a99 = $(NF-3); a999 = $(NF-2) }
            /^pwrite\+fdatasync/   { f50 = $(NF-4); f99 = $(NF-3) }
            /^same load, no journal/ { n99 = $(NF-3) }
            END {
                if (f50 == 0 || f99 == 0 || n99 == 0) exit 1
                printf "%-5s %-34s %9.0f %9.0f %9.0f %9.0f %9.0f %7.2f %7.2f %9.0f %8.2g\n", r, c,
                    a50 / 1e3, a99 / 1e3, a999 / 1e3, f50 / 1e3, f99 / 1e3, a50 / f50, a99 / f99,
                    n99 / 1e3, a99 / n99
            }' "$log" | tee -a "$rows" "$out/rows-$n.txt"
    done
done
echo "(latencies in µs; x = ack / floor of the same run; nojrn99 = P99 of the same load with one"
echo " pwrite+fdatasync per record and no journal; x nojrn = ack P99 / nojrn99)"
echo "uptime after: $(uptime)"
echo
# summary TITLE FIELD FORMAT: per config, the median and worst of one column of its rows.
summary() {
    echo "$1"
    local n=0 c
    for c in "${configs[@]}"; do
        n=$((n + 1))
        [ -f "$out/rows-$n.txt" ] || continue
        awk "{ print \$($2) }" "$out/rows-$n.txt" | sort -g | awk -v c="$c" -v f="$3" '
            { v[NR] = $1 }
            END { if (NR) printf "  %-34s median " f "x  worst " f "x  (n=%d)\n", c, (v[int((NR + 1) / 2)] + v[int(NR / 2) + 1]) / 2, v[NR], NR }'
    done
}
summary "per config: ack P99 / floor P99, median and worst over $rounds rounds" NF-2 "%6.2f"
summary "per config: ack P99 / P99 of the same load without a journal, median and worst" NF "%8.2g"
python3 scripts/bench_results.py journal "$rows" "$command"
