#!/usr/bin/env bash
# Self-test of the QEMU guest harness (tests/vm/run-guest.sh); exits non-zero on failure.
#   (a) a guest that echoes (and runs a copied host binary and file) exits 0; one exiting 3
#       makes run-guest return 3
#   (b) vhost-user-blk against qemu-storage-daemon: the guest writes 1 MiB of random data to
#       /dev/vda with O_DIRECT, reads it back with O_DIRECT, and the host finds the same bytes
#       at the same offset of the backing file
#   (c) the rxe and VFIO module sets load in a guest (skip with --no-modules)
# Bounded: every guest has a timeout, the whole run is well under 2 minutes on an idle host.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
RUN="$SCRIPT_DIR/run-guest.sh"
GUEST_TIMEOUT=${FASTLANE_VM_TIMEOUT:-120}

check_modules=1
for a in "$@"; do
    case "$a" in
        --no-modules) check_modules=0 ;;
        -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "selftest: unknown argument $a" >&2; exit 2 ;;
    esac
done

command -v qemu-storage-daemon >/dev/null || { echo "selftest: qemu-storage-daemon missing (.ci/install-deps.sh)" >&2; exit 1; }

tmp=$(mktemp -d "${TMPDIR:-/tmp}/fastlane-selftest.XXXXXX")
img=$(mktemp /dev/shm/fastlane-selftest.XXXXXX.img)
qsd_pid=""
cleanup() {
    if [ -n "$qsd_pid" ]; then
        kill "$qsd_pid" 2>/dev/null || true
        wait "$qsd_pid" 2>/dev/null || true
    fi
    rm -rf "$tmp"
    rm -f "$img"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

failures=0
pass() { echo "selftest: PASS $*"; }
fail() { echo "selftest: FAIL $*" >&2; failures=$((failures + 1)); }
now() { date +%s%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", (b - a) / 1e9 }'; }

t_all=$(now)

# Build the cache first so that boot timings do not include it.
"$SCRIPT_DIR/build-guest.sh"

# --- (a) exit statuses, --bin, --file ------------------------------------------------------
echo "hello-from-host-file" >"$tmp/hello.txt"
cat >"$tmp/ok.sh" <<'GUEST'
echo "guest says hello"
cat /etc/hello.txt
/bin/sha256sum --version | head -n 1
echo "RESULT ok=1"
exit 0
GUEST
t0=$(now)
set +e
"$RUN" --script "$tmp/ok.sh" --bin /usr/bin/sha256sum --file "$tmp/hello.txt:/etc/hello.txt" \
    --timeout "$GUEST_TIMEOUT" --log "$tmp/ok.log" | tee "$tmp/ok.out"
rc=${PIPESTATUS[0]}
set -e
t1=$(now)
boot_s=$(secs "$t0" "$t1")
if [ "$rc" = 0 ] && grep -qx "RESULT ok=1" "$tmp/ok.out" && grep -qx "hello-from-host-file" "$tmp/ok.out" &&
    grep -q "GNU coreutils" "$tmp/ok.out"; then
    pass "(a) exit 0, --bin (dynamic host binary) and --file work; boot->poweroff ${boot_s}s (run-guest wall time)"
else
    fail "(a) exit-0 guest: status $rc, output above"
fi

printf 'echo "about to exit 3"\nexit 3\n' >"$tmp/three.sh"
set +e
"$RUN" --script "$tmp/three.sh" --timeout "$GUEST_TIMEOUT"
rc=$?
set -e
if [ "$rc" = 3 ]; then pass "(a) guest exit 3 -> run-guest returned 3"; else fail "(a) exit-3 guest: run-guest returned $rc"; fi

# --- (b) vhost-user-blk against qemu-storage-daemon -----------------------------------------
sock="$tmp/vhost-blk.sock"
truncate -s 64M "$img"
timeout 300 qemu-storage-daemon \
    --blockdev "driver=file,node-name=disk0,filename=$img" \
    --export "type=vhost-user-blk,id=exp0,node-name=disk0,addr.type=unix,addr.path=$sock,writable=on" \
    >"$tmp/qsd.log" 2>&1 &
qsd_pid=$!
for _ in $(seq 100); do
    [ -S "$sock" ] && break
    kill -0 "$qsd_pid" 2>/dev/null || break
    sleep 0.1
done
if [ ! -S "$sock" ]; then
    cat "$tmp/qsd.log" >&2
    fail "(b) qemu-storage-daemon did not create $sock within 10 s"
else
    offset_blocks=5000 # 4 KiB blocks: byte offset 20480000 (19.5 MiB)
    cat >"$tmp/blk.sh" <<GUEST
set -e
echo "RESULT vda_sectors=\$(cat /sys/block/vda/size)"
head -c 1048576 /dev/urandom >/tmp/pattern
echo "RESULT written_sha256=\$(sha256sum </tmp/pattern | cut -d' ' -f1)"
dd if=/tmp/pattern of=/dev/vda bs=4096 seek=$offset_blocks oflag=direct conv=notrunc,fsync
echo 3 >/proc/sys/vm/drop_caches
dd if=/dev/vda of=/tmp/readback bs=4096 skip=$offset_blocks count=256 iflag=direct
echo "RESULT read_sha256=\$(sha256sum </tmp/readback | cut -d' ' -f1)"
GUEST
    t0=$(now)
    set +e
    "$RUN" --script "$tmp/blk.sh" --modules "virtio_pci virtio_blk" --timeout "$GUEST_TIMEOUT" \
        --log "$tmp/blk.log" -- \
        -object memory-backend-memfd,id=mem,size=512M,share=on -machine memory-backend=mem \
        -chardev "socket,id=c0,path=$sock" -device vhost-user-blk-pci,chardev=c0,num-queues=1 |
        tee "$tmp/blk.out"
    rc=${PIPESTATUS[0]}
    set -e
    t1=$(now)
    result() { sed -n "s/^RESULT $1=//p" "$tmp/blk.out" | tail -n 1; }
    sectors=$(result vda_sectors)
    written=$(result written_sha256)
    readback=$(result read_sha256)
    host=$(dd if="$img" bs=4096 skip="$offset_blocks" count=256 status=none | sha256sum | cut -d' ' -f1)
    before=$(dd if="$img" bs=4096 count="$offset_blocks" status=none | tr -d '\0' | wc -c)
    after=$(dd if="$img" bs=4096 skip=$((offset_blocks + 256)) status=none | tr -d '\0' | wc -c)
    echo "selftest: (b) guest status $rc, vda sectors $sectors, written $written, read back $readback"
    echo "selftest: (b) host backing file at byte $((offset_blocks * 4096)): $host; non-zero bytes elsewhere: $((before + after))"
    if [ "$rc" = 0 ] && [ "$sectors" = 131072 ] && [ -n "$written" ] && [ "$written" = "$readback" ] &&
        [ "$written" = "$host" ] && [ "$((before + after))" = 0 ]; then
        pass "(b) vhost-user-blk via qemu-storage-daemon: 1 MiB O_DIRECT write/read verified in guest and host backing file; $(secs "$t0" "$t1")s"
    else
        fail "(b) vhost-user-blk check (guest log: $tmp/blk.log is removed on exit; output above)"
        tail -n 30 "$tmp/blk.log" >&2 || true
    fi
    kill "$qsd_pid" 2>/dev/null || true
    wait "$qsd_pid" 2>/dev/null || true
    qsd_pid=""
    if [ -e "$sock" ]; then rm -f "$sock"; fi
fi

# --- (c) module sets for the rxe and VFIO tests ---------------------------------------------
if [ "$check_modules" = 1 ]; then
    cat >"$tmp/mods.sh" <<'GUEST'
st=0
for m in crc32_generic ib_core ib_uverbs udp_tunnel ip6_udp_tunnel rdma_rxe dummy \
         vfio vfio_iommu_type1 vfio_virqfd irqbypass vfio_pci_core vfio_pci; do
    if [ -d /sys/module/$m ]; then echo "RESULT module $m loaded"; else echo "RESULT module $m MISSING"; st=1; fi
done
if ip link show dummy0 >/dev/null 2>&1; then echo "RESULT dummy0 present"; else echo "RESULT dummy0 MISSING"; st=1; fi
if [ -c /dev/vfio/vfio ]; then echo "RESULT /dev/vfio/vfio present"; else echo "RESULT /dev/vfio/vfio MISSING"; st=1; fi
exit $st
GUEST
    t0=$(now)
    set +e
    "$RUN" --script "$tmp/mods.sh" --timeout "$GUEST_TIMEOUT" \
        --modules "crc32_generic ib_core ib_uverbs udp_tunnel ip6_udp_tunnel rdma_rxe dummy" \
        --modules "vfio vfio_iommu_type1 vfio_virqfd irqbypass vfio-pci-core vfio-pci"
    rc=$?
    set -e
    t1=$(now)
    if [ "$rc" = 0 ]; then
        pass "(c) rxe and VFIO module sets load (dummy0 and /dev/vfio/vfio exist); $(secs "$t0" "$t1")s"
    else
        fail "(c) module sets: run-guest returned $rc"
    fi
fi

t_end=$(now)
echo "selftest: total $(secs "$t_all" "$t_end")s"
if [ "$failures" -gt 0 ]; then
    echo "selftest: $failures check(s) FAILED" >&2
    exit 1
fi
echo "selftest: all checks passed"
