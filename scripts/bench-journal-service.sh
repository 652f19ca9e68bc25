#!/usr/bin/env bash
# The journal service's durable-ack latency (`fastlane journal bench-service`) for several
# writer configurations, run interleaved round after round (config A, B, C, A, B, C, ...) so
# that each sees the same minutes of a disk whose flush time drifts. Every case of every run
# measures its own floor (pwrite+fdatasync and an O_DIRECT RWF_DSYNC write) right before and
# after it, and the same schedule written straight to the file with no journal (its P99 is the
# device's tail under that load). Prints per config and case the median over the rounds of ack
# P99 / floor P99 and of ack P99 / no-journal P99, and
# writes the run as benches/results/journal/<date>-<commit>-service.json.
#
#   scripts/bench-journal-service.sh [--rounds N] [--bin PATH] [--dir DIR] [--seconds S]
#                                    [--config "ARGS"]...
#
# Defaults: 3 rounds, 3 s per case, cases 2000x1,20000x1,200000x1,20000x3 (rate x producers),
# DIR target/bench-journal-service (the repository's file system), configs
#   "--writer-io dsync --direct true --writer-wait park"      (journal serve's default)
#   "--writer-io dsync --direct true --writer-wait poll"
#   "--writer-io pipelined --direct false --writer-wait park" (the writer before dsync)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=3 bin= dir=target/bench-journal-service seconds=3 configs=()
while [ $# -gt 0 ]; do
    case "$1" in
        --rounds) rounds=$2; shift ;;
        --bin) bin=$2; shift ;;
        --dir) dir=$2; shift ;;
        --seconds) seconds=$2; shift ;;
        --config) configs+=("$2"); shift ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
if [ ${#configs[@]} -eq 0 ]; then
    configs=("--writer-io dsync --direct true --writer-wait park"
             "--writer-io dsync --direct true --writer-wait poll"
             "--writer-io pipelined --direct false --writer-wait park")
fi
if [ -z "$bin" ]; then
    cargo build --release --locked -p fastlane-cli
    bin=target/release/fastlane
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
echo "uptime before: $(uptime)"
for r in $(seq 1 "$rounds"); do
    for i in "${!configs[@]}"; do
        # shellcheck disable=SC2086
        "$bin" journal bench-service --dir "$dir" ${configs[$i]} --seconds "$seconds" --json \
            > "$out/r$r-c$i.json"
        echo "round $r config $i done ($(cut -d' ' -f1-3 /proc/loadavg))"
    done
done
echo "uptime after: $(uptime)"
python3 - "$out" "$rounds" "$0 $*" "${configs[@]}" <<'PY'
import json, os, statistics, sys
sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
import bench_results
out, rounds, command, configs = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
rows, raw = [], {}
print(f"{'config':<52} {'case':>10} {'ack p50':>9} {'ack p99':>9} {'floor p99':>10} {'x floor (median, worst)':>24}"
      f" {'no-journal p99':>15} {'x no-journal':>13} {'rolls':>6} {'p99 while spare':>16}")
for i, c in enumerate(configs):
    runs = [json.load(open(f"{out}/r{r}-c{i}.json")) for r in range(1, rounds + 1)]
    raw[c] = runs
    for k, case in enumerate(runs[0]):
        name = f"{case['rate_per_s']}x{case['producers']}"
        ratios = [run[k]["ack_p99_over_floor_p99"] for run in runs]
        p50 = statistics.median(run[k]["ack"]["p50_ns"] for run in runs) / 1e3
        p99 = statistics.median(run[k]["ack"]["p99_ns"] for run in runs) / 1e3
        floor = statistics.median(min(run[k]["floor_pwrite_fdatasync"]["p99_ns"],
                                      run[k]["floor_dsync_direct"]["p99_ns"]) for run in runs) / 1e3
        med, worst = statistics.median(ratios), max(ratios)
        sust = statistics.median(run[k]["floor_sustained"]["p99_ns"] for run in runs) / 1e3
        smed = statistics.median(run[k]["ack_p99_over_sustained_p99"] for run in runs)
        # Rounds that rolled wrote the next segment's file beside the journal: their acks
        # seen meanwhile, by themselves ("-": no round rolled).
        rolls = [run[k]["rolls"] for run in runs]
        spare = [run[k]["ack_while_spare"]["p99_ns"] / 1e3 for run in runs
                 if run[k]["ack_while_spare"]["count"] > 0]
        spare_p99 = round(statistics.median(spare), 1) if spare else None
        # The writer's time per roll (every ack waits meanwhile), median over rounds that rolled.
        per_roll = [run[k]["roll_us"] / run[k]["rolls"] for run in runs if run[k]["rolls"] > 0]
        roll_us = round(statistics.median(per_roll)) if per_roll else None
        print(f"{c:<52} {name:>10} {p50:>9.1f} {p99:>9.1f} {floor:>10.1f} {med:>14.2f} {worst:>9.2f}"
              f" {sust:>15.1f} {smed:>13.2f} {max(rolls):>6} {spare_p99 if spare else '-':>16}")
        rows.append({"case": f"{c} {name}", "value": round(p99, 1), "unit": "us ack p99 (median)",
                     "peer": "min(pwrite+fdatasync, O_DIRECT RWF_DSYNC) p99", "peer_value": round(floor, 1),
                     "ratio": round(med, 2), "worst_ratio": round(worst, 2), "target": "<= 1.2",
                     "no_journal_p99": round(sust, 1), "ratio_to_no_journal": round(smed, 2),
                     "rolls_max": max(rolls), "ack_p99_while_spare": spare_p99,
                     "roll_us_per_roll": roll_us})
bench_results.write("journal", command, rows, raw=raw, label="service")
PY
