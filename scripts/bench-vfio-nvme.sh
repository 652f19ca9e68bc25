#!/usr/bin/env bash
# The VFIO NVMe driver vs the guest kernel's nvme driver, on the same emulated controller in one
# QEMU TCG guest (q35 + intel-iommu): `fastlane bench nvme` 4 KiB random read/write at QD1 and
# QD32, first through the userspace driver (vfio-pci), then through /dev/nvme0n1 with io_uring
# and O_DIRECT after rebinding to nvme. Under TCG the emulated controller dominates: read the
# result as a sanity ratio, not a headline.
#
#   scripts/bench-vfio-nvme.sh [OUT_DIR] (default target/bench-vfio; SECONDS_PER_CASE=3)
#
# Prints the table (from the guest's two `bench nvme --json` reports). Writes OUT_DIR/console.log and
# OUT_DIR/{vfio,kernel}.hlog (read them with `fastlane hist`), and the run as
# benches/results/vfio-nvme/<date>-<commit>.json (scripts/bench_results.py).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$ROOT/target/bench-vfio}
SECS=${SECONDS_PER_CASE:-3}
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
BIN=${FASTLANE_BIN:-$TARGET/release/fastlane}
if [ -z "${FASTLANE_BIN:-}" ]; then
    (cd "$ROOT" && cargo build --release -p fastlane-cli)
fi
mkdir -p "$OUT"
DISK=$(mktemp "${TMPDIR:-/tmp}/fl-vfio-bench.XXXXXX")
trap 'rm -f "$DISK"' EXIT
truncate -s 256M "$DISK"

"$ROOT/tests/vm/run-guest.sh" --script "$ROOT/tests/vm/guest-vfio.sh" --bin "$BIN" \
    --modules "vfio vfio_iommu_type1 vfio_virqfd irqbypass vfio-pci-core vfio-pci nvme" \
    --append "intel_iommu=on fl_vfio_mode=bench fl_vfio_seconds=$SECS" \
    --smp 2 --mem 1G --timeout 400 -- \
    -machine q35,kernel-irqchip=split -device intel-iommu,intremap=on,caching-mode=on \
    -drive "file=$DISK,if=none,id=nv0,format=raw,discard=unmap,cache=writeback" \
    -device nvme,serial=fl0bench,drive=nv0 >"$OUT/console.log"

sed -n 's/^HLOG vfio //p' "$OUT/console.log" >"$OUT/vfio.hlog"
sed -n 's/^HLOG kernel //p' "$OUT/console.log" >"$OUT/kernel.hlog"
grep -E '^VFIO-' "$OUT/console.log"
python3 "$ROOT/scripts/bench_results.py" vfio-nvme "$OUT/console.log" \
    "SECONDS_PER_CASE=$SECS scripts/bench-vfio-nvme.sh $OUT"
