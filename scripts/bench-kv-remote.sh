#!/usr/bin/env bash
# Swap-in latency and swap-out/in bandwidth of kvswap's remote tier (a `fastlane rdma serve`
# pool on soft-RoCE, rxe0 on dummy0) next to the host tier, with `fastlane kv bench --tiers
# host,remote` in one QEMU TCG guest boot (tests/vm/guest-kv-bench.sh). Prints the bench's table
# (from its --json report) and the guest's RESULT lines.
#
#   scripts/bench-kv-remote.sh [--bytes SIZE] [--samples N] [--rounds N] [--tiers LIST]
#                              [--checksum fast|crc32c|off] [--smp VCPUS] [--mem SIZE]
#                              [--out DIR] [--bin PATH-TO-RELEASE-fastlane (skips the build)]
#
# Defaults: 256M, 5 samples, 1 round, host,remote, 2 vCPUs, 3G guest memory (the device pool,
# the host tier and the RDMA pool each hold --bytes; give --mem about 4x --bytes + 1G).
# Writes DIR/kv-remote.hlog (tags swapin-<tier>; read with `fastlane hist`) and
# DIR/kv-remote.log (the whole guest output), and the run as
# benches/results/kvswap/<date>-<commit>.json (scripts/bench_results.py). Needs .ci/install-deps.sh's packages.
set -euo pipefail
cd "$(dirname "$0")/.."

bytes=256M samples=5 rounds=1 tiers=host,remote checksum=fast smp=2 mem=3G
out=target/bench-kv-remote bin=
while [ $# -gt 0 ]; do
    case "$1" in
        --bytes) bytes=$2; shift ;;
        --samples) samples=$2; shift ;;
        --rounds) rounds=$2; shift ;;
        --tiers) tiers=$2; shift ;;
        --checksum) checksum=$2; shift ;;
        --smp) smp=$2; shift ;;
        --mem) mem=$2; shift ;;
        --bin) bin=$2; shift ;;
        --out) out=$2; shift ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        *) echo "bench-kv-remote.sh: unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
mkdir -p "$out"

if [ -z "$bin" ]; then
    cargo build --release -p fastlane-cli >&2
    bin="${CARGO_TARGET_DIR:-target}/release/fastlane"
fi
provider=/usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so

status=0
tests/vm/run-guest.sh --script tests/vm/guest-kv-bench.sh \
    --append "fl_tiers=$tiers fl_bytes=$bytes fl_samples=$samples fl_rounds=$rounds fl_checksum=$checksum" \
    --bin "$bin" --bin /usr/bin/rdma \
    --lib "$provider" --file /etc/libibverbs.d/rxe.driver:/etc/libibverbs.d/rxe.driver \
    --modules "crc32_generic ib_core ib_uverbs udp_tunnel ip6_udp_tunnel rdma_rxe dummy" \
    --smp "$smp" --mem "$mem" --timeout 1500 >"$out/kv-remote.log" || status=$?
sed -n 's/^HLOG //p' "$out/kv-remote.log" >"$out/kv-remote.hlog"
sed -n '/^RESULT /p' "$out/kv-remote.log"
python3 scripts/bench_results.py kv-remote "$out/kv-remote.log" \
    "scripts/bench-kv-remote.sh --bytes $bytes --samples $samples --rounds $rounds --tiers $tiers --checksum $checksum --smp $smp --mem $mem" || true
echo "guest log: $out/kv-remote.log; histograms: $out/kv-remote.hlog" >&2
exit "$status"
