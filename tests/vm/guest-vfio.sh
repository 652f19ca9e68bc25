#!/bin/sh
# Guest side of the VFIO NVMe driver's test and benchmark (tests/guest/tests/vfio_guest.rs,
# scripts/bench-vfio-nvme.sh). Runs as root in a tests/vm/run-guest.sh guest booted with
# intel-iommu (intel_iommu=on) and one emulated `-device nvme`. The mode comes from the kernel
# command line, fl_vfio_mode=MODE (run-guest.sh --append):
#
#   check   bind the controller to vfio-pci and run `vfio_guest check BDF` (the driver's
#           checks; its VFIO-* lines are the results); then, on the same controller,
#           `fastlane serve --backend nvme:BDF` with `fastlane bench blk --verify` as its
#           vhost-user frontend (writes a pattern over 64..68 MiB through guest memory, reads
#           it back and compares, then 1 s of reads at QD 1 and 8), and print the driver's
#           zero-copy/bounced totals from serve's log as `VFIO-ZEROCOPY direct=N bounced=M`
#   bench   bind to vfio-pci, `fastlane bench nvme --backend nvme:BDF`; then rebind to the
#           kernel's nvme driver and run the same benchmark on /dev/nvme0n1 with io_uring and
#           O_DIRECT (`--backend file:/dev/nvme0n1 --direct`); the .hlog files are printed as
#           "HLOG NAME LINE" lines for the host to collect. Needs the nvme modules loaded;
#           fl_vfio_seconds=N sets the seconds per case (default 3).
#
# Exits non-zero when a step failed.
set -eu

MODE=$(sed -n 's/.*fl_vfio_mode=\([a-z]*\).*/\1/p' /proc/cmdline)
MODE=${MODE:-check}
SECS=$(sed -n 's/.*fl_vfio_seconds=\([0-9.]*\).*/\1/p' /proc/cmdline)
BENCH_ARGS="--seconds ${SECS:-3}"

BDF=""
for d in /sys/bus/pci/devices/*; do
    if [ "$(cat "$d/class")" = "0x010802" ]; then
        BDF=${d##*/}
        break
    fi
done
if [ -z "$BDF" ]; then
    echo "VFIO-FAILED no NVMe controller (class 0x010802) in the guest"
    exit 3
fi
DEV=/sys/bus/pci/devices/$BDF
GROUP=$(readlink "$DEV/iommu_group" || true)
echo "VFIO-INFO bdf=$BDF iommu_group=${GROUP##*/} mode=$MODE"

unbind() {
    if [ -e "$DEV/driver" ]; then
        echo "$BDF" >"$DEV/driver/unbind"
    fi
}

# wait_for PATH SECONDS: bounded wait for a device node to appear.
wait_for() {
    i=0
    while [ ! -e "$1" ]; do
        i=$((i + 1))
        if [ "$i" -gt $(($2 * 10)) ]; then
            echo "VFIO-FAILED $1 did not appear within $2 s"
            exit 4
        fi
        sleep 0.1
    done
}

bind_vfio() {
    unbind
    echo vfio-pci >"$DEV/driver_override"
    echo "$BDF" >/sys/bus/pci/drivers_probe
    wait_for "/dev/vfio/${GROUP##*/}" 10
    echo "VFIO-INFO bound=vfio-pci dev=/dev/vfio/${GROUP##*/}"
}

bind_nvme() {
    unbind
    echo nvme >"$DEV/driver_override"
    echo "$BDF" >/sys/bus/pci/drivers_probe
    wait_for /dev/nvme0n1 20
    echo "VFIO-INFO bound=nvme dev=/dev/nvme0n1"
}

# The vhost-user zero-copy path: guest memory registered with the driver (ExternalMemory), so
# requests from the frontend's memory go to the controller without a copy.
vhost_zero_copy() {
    fastlane serve --backend "nvme:$BDF" --socket /tmp/blk.sock >/tmp/serve.log 2>&1 &
    serve_pid=$!
    wait_for /tmp/blk.sock 20
    rc=0
    fastlane bench blk --socket /tmp/blk.sock --seconds 1 --qd 1,8 --pattern randread \
        --verify 64M:4M --verify-seed 7 --json >/tmp/blk.json || rc=$?
    kill -TERM "$serve_pid" 2>/dev/null || true
    wait "$serve_pid" || rc=$?
    sed 's/^/VFIO-SERVE /' /tmp/serve.log
    grep -E '"(name|requests|iops|p50_ns|write_seconds|read_seconds)"' /tmp/blk.json |
        tr -d ' ,"' | sed 's/^/VFIO-BLK /' || true
    if [ "$rc" -ne 0 ]; then
        echo "VFIO-FAILED vhost zero-copy phase (status $rc)"
        exit 5
    fi
    echo "VFIO-EXPECT pattern 67108864 4194304 7"
    totals=$(sed -n 's/.*reads and writes: \([0-9]*\) zero copy, \([0-9]*\) bounced.*/direct=\1 bounced=\2/p' /tmp/serve.log)
    echo "VFIO-ZEROCOPY ${totals:-missing}"
}

print_hlog() { # NAME FILE
    while IFS= read -r line; do
        echo "HLOG $1 $line"
    done <"$2"
}

case "$MODE" in
check)
    bind_vfio
    vfio_guest check "$BDF"
    vhost_zero_copy
    echo "VFIO-OK"
    ;;
bench)
    bind_vfio
    # shellcheck disable=SC2086 # BENCH_ARGS is a word list on purpose
    # Each report on one line (BENCHJSON LABEL {...}): scripts/bench_results.py reads them.
    fastlane bench nvme --backend "nvme:$BDF" --label vfio --hlog /tmp/vfio.hlog --json $BENCH_ARGS >/tmp/vfio.json
    echo "BENCHJSON vfio $(tr -d '\n' </tmp/vfio.json)"
    bind_nvme
    # shellcheck disable=SC2086
    fastlane bench nvme --backend file:/dev/nvme0n1 --direct --label kernel --hlog /tmp/kernel.hlog --json $BENCH_ARGS >/tmp/kernel.json
    echo "BENCHJSON kernel $(tr -d '\n' </tmp/kernel.json)"
    print_hlog vfio /tmp/vfio.hlog
    print_hlog kernel /tmp/kernel.hlog
    echo "VFIO-OK"
    ;;
*)
    echo "VFIO-FAILED unknown mode $MODE"
    exit 2
    ;;
esac
