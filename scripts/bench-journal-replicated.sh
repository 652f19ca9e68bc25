#!/usr/bin/env bash
# The journal's replicated durable ack against its local one plus one RDMA round trip, in one
# QEMU TCG guest boot on soft-RoCE (tests/vm/guest-journal-rdma.sh, phase bench): per round,
# `fastlane journal bench --durability local`, the same with `--durability replicated` through a
# `fastlane journal replica` on the same rxe0, and perftest's ib_write_lat (64 B). Emulator
# numbers: they compare the paths, not hardware.
#
#   scripts/bench-journal-replicated.sh [--rounds N] [--rate R] [--seconds S] [--smp VCPUS]
#                                       [--replica-sync ack|read] [--replica-poll event|busy]
#                                       [--out DIR] [--bin PATH-TO-RELEASE-fastlane]
#
# Defaults: 3 rounds, 2,000 records/s for 3 s per run, 2 vCPUs, --replica-sync ack (the replica
# process fdatasyncs its file before it answers; read: an RDMA READ behind the writes, the
# replica's memory only), --replica-poll event (the primary's writer sleeps on the completion
# channel: in a 2-vCPU guest a spinning writer takes a vCPU from the rxe and replica work it
# waits for; the replica process always runs with --poll event here, standing for a machine
# of its own). Prints the table
# (scripts/bench_results.py journal-replicated) and writes the run as
# benches/results/journal/<date>-<commit>-replicated.json; the guest's output is in
# DIR/guest.log (default target/bench-journal-replicated). Needs .ci/install-deps.sh's packages.
set -euo pipefail
cd "$(dirname "$0")/.."
command="scripts/bench-journal-replicated.sh$(printf ' %q' "$@")"

rounds=3 rate=2000 seconds=3 smp=2 sync=ack poll=event out=target/bench-journal-replicated bin=
while [ $# -gt 0 ]; do
    case "$1" in
        --rounds) rounds=$2; shift ;;
        --rate) rate=$2; shift ;;
        --seconds) seconds=$2; shift ;;
        --smp) smp=$2; shift ;;
        --replica-sync) sync=$2; shift ;;
        --replica-poll) poll=$2; shift ;;
        --out) out=$2; shift ;;
        --bin) bin=$2; shift ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) echo "bench-journal-replicated.sh: unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
mkdir -p "$out"
if [ -z "$bin" ]; then
    cargo build --release --locked -p fastlane-cli >&2
    bin="${CARGO_TARGET_DIR:-target}/release/fastlane"
fi
provider=/usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so
echo "load before: $(cat /proc/loadavg)"
tests/vm/run-guest.sh --script tests/vm/guest-journal-rdma.sh \
    --append "fl_journal_phase=bench fl_rounds=$rounds fl_rate=$rate fl_seconds=$seconds fl_replica_sync=$sync fl_replica_poll=$poll" \
    --bin "$bin" --bin /usr/bin/rdma --bin /usr/bin/ib_write_lat \
    --lib "$provider" --file /etc/libibverbs.d/rxe.driver:/etc/libibverbs.d/rxe.driver \
    --modules "crc32_generic ib_core ib_uverbs udp_tunnel ip6_udp_tunnel rdma_rxe dummy" \
    --smp "$smp" --mem 1G --timeout $((300 + rounds * (4 * seconds + 120))) >"$out/guest.log" \
    || { tail -30 "$out/guest.log" >&2; echo "bench-journal-replicated.sh: the guest failed (log $out/guest.log)" >&2; exit 1; }
echo "load after: $(cat /proc/loadavg)"
python3 scripts/bench_results.py journal-replicated "$out/guest.log" "$command"
