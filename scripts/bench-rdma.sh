#!/usr/bin/env bash
# RDMA WRITE latency and bandwidth of `fastlane rdma bench` against perftest's ib_write_lat /
# ib_write_bw, on the same soft-RoCE device (rxe0 on dummy0) in the same QEMU TCG guest boot
# (tests/vm/guest-rdma.sh, phase bench). Prints the ratio table that BENCHMARKS.md quotes.
#
#   scripts/bench-rdma.sh [--iters N] [--bw-iters N] [--rounds N] [--smp VCPUS] [--out DIR]
#                         [--bin PATH-TO-RELEASE-fastlane (skips the cargo build)]
#
# Latency: median one-way latency (perftest's t_typical; ours: p50 of RTT/2 from the
# HdrHistogram), target fastlane/perftest <= 1.05. Bandwidth: bytes/s of 64 KiB WRITEs with
# 128 in flight (perftest's from its message rate), target fastlane/perftest >= 0.95.
# With --rounds N both run N times, interleaved, and the table uses the median of the rounds.
# Writes DIR/rdma-bench.hlog (fastlane's latency histograms; read with `fastlane hist`) and
# DIR/rdma-bench.log (the whole guest output), and the run as
# benches/results/rdma/<date>-<commit>.json (scripts/bench_results.py). Needs .ci/install-deps.sh's packages.
set -euo pipefail
cd "$(dirname "$0")/.."

iters=1000 bw_iters=5000 rounds=1 smp=2 out=target/bench-rdma bin=
while [ $# -gt 0 ]; do
    case "$1" in
        --iters) iters=$2; shift ;;
        --bw-iters) bw_iters=$2; shift ;;
        --rounds) rounds=$2; shift ;;
        --smp) smp=$2; shift ;;
        --bin) bin=$2; shift ;;
        --out) out=$2; shift ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        *) echo "bench-rdma.sh: unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
mkdir -p "$out"

if [ -z "$bin" ]; then
    cargo build --release -p fastlane-cli >&2
    bin="${CARGO_TARGET_DIR:-target}/release/fastlane"
fi
provider=/usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so

tests/vm/run-guest.sh --script tests/vm/guest-rdma.sh \
    --append "fl_rdma_phase=bench fl_iters=$iters fl_bw_iters=$bw_iters fl_rounds=$rounds" \
    --bin "$bin" --bin /usr/bin/rdma --bin /usr/bin/ib_write_lat --bin /usr/bin/ib_write_bw \
    --lib "$provider" --file /etc/libibverbs.d/rxe.driver:/etc/libibverbs.d/rxe.driver \
    --modules "crc32_generic ib_core ib_uverbs udp_tunnel ip6_udp_tunnel rdma_rxe dummy" \
    --smp "$smp" --mem 1G --timeout $((300 + rounds * (iters / 10 + bw_iters / 20))) >"$out/rdma-bench.log"
sed -n 's/^HLOG //p' "$out/rdma-bench.log" >"$out/rdma-bench.hlog"

python3 scripts/bench_results.py rdma "$out/rdma-bench.log" \
    "scripts/bench-rdma.sh --iters $iters --bw-iters $bw_iters --rounds $rounds --smp $smp"
echo "guest log: $out/rdma-bench.log; histograms: $out/rdma-bench.hlog" >&2
