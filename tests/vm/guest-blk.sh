#!/bin/sh
# Guest side of the vhost-user-blk integration test (fastlane-cli/tests/vm_blk.rs); runs as root in a
# tests/vm/run-guest.sh guest (busybox sh) with the disk at /dev/vda. The phase comes from the
# kernel command line, fl_blk_phase=PHASE (run-guest.sh --append):
#
#   write     geometry and queue checks, O_DIRECT writes of random data at a few offsets, each
#             pinned to one CPU (taskset) so that both virtqueues carry requests, read back with
#             O_DIRECT after dropping caches, a flush (fsync of the device), a discard that must
#             read back as zeroes
#   verify    (a later guest on the same daemon) reads the same ranges back
#   readonly  (a read-only export) the disk is read-only, reads work, an O_DIRECT write fails
#
# Everything the host checks is printed as "RESULT ..." lines:
#   RESULT key=value                      a scalar (sectors, ro, write_cache, counters, ...)
#   RESULT wrote NAME OFFSET LEN SHA256   what the guest wrote to a range (bytes)
#   RESULT read NAME OFFSET LEN SHA256    what the guest read back from a range
#   RESULT check NAME ok|FAIL DETAIL      a check made in the guest
# The script exits non-zero when a guest-side check failed; it runs every check regardless.
set -eu
# shellcheck disable=SC3040 # busybox ash has pipefail
set -o pipefail

DEV=/dev/vda
SYS=/sys/block/vda
# Ranges (byte offset, length): 512-byte aligned, some not 4 KiB aligned; the last one ends at
# the end of a 64 MiB disk. Each is written as several requests on one CPU.
#        name  offset    length  bs    cpu
RANGES="head   0         65536   4096  0
mid    16384000  262144  4096  1
odd    10240512  12288   512   0
tail   66977792  131072  4096  1"
DISCARD_OFF=33554432 # 32 MiB
DISCARD_LEN=1048576

printf '%s\n' "$RANGES" >/tmp/ranges
failures=0
check() { # NAME CONDITION-STATUS DETAIL
    if [ "$2" = 0 ]; then
        echo "RESULT check $1 ok $3"
    else
        echo "RESULT check $1 FAIL $3"
        failures=$((failures + 1))
    fi
}
sha_of() { sha256sum | cut -d' ' -f1; }
# read_range NAME OFFSET LEN BS: O_DIRECT read, prints RESULT read and leaves the bytes in /tmp/NAME.rd
read_range() {
    if dd if=$DEV of="/tmp/$1.rd" bs="$4" skip=$(($2 / $4)) count=$(($3 / $4)) iflag=direct 2>/tmp/dd.err; then
        echo "RESULT read $1 $2 $3 $(sha_of <"/tmp/$1.rd")"
    else
        echo "RESULT read $1 $2 $3 ERROR"
        check "read_$1" 1 "dd: $(tr '\n' ' ' </tmp/dd.err)"
    fi
}
# stat field N (1-based) of /sys/block/vda/stat: 5 writes, 12 discards, 16 flushes completed
stat_field() { awk -v n="$1" '{ print $n }' $SYS/stat; }
hctx_runs() { # times hardware queue N was run (debugfs; 6.1 has no per-hctx request counts)
    cat "/sys/kernel/debug/block/vda/hctx$1/run" 2>/dev/null || echo 0
}

# A failure that `set -e` turns into an exit names the step it happened in.
step="start"
trap 'st=$?; [ "$st" = 0 ] || echo "RESULT check script FAIL exit $st in step $step"' EXIT

phase=$(sed -n 's/.*fl_blk_phase=\([a-z]*\).*/\1/p' /proc/cmdline)
echo "RESULT phase=$phase"
[ -b $DEV ] || { echo "RESULT check device FAIL no $DEV"; exit 1; }

echo "RESULT sectors=$(cat $SYS/size)"
echo "RESULT ro=$(cat $SYS/ro)"
echo "RESULT write_cache=$(cat $SYS/queue/write_cache)"
echo "RESULT discard_max_bytes=$(cat $SYS/queue/discard_max_bytes)"
echo "RESULT logical_block_size=$(cat $SYS/queue/logical_block_size)"
echo "RESULT cpus=$(nproc)"
nq=$(find $SYS/mq/ -mindepth 1 -maxdepth 1 | wc -l)
echo "RESULT mq_queues=$nq"
for q in "$SYS"/mq/*; do
    echo "RESULT mq_cpu_list_$(basename "$q")=$(cat "$q/cpu_list")"
done

case "$phase" in
write)
    step="write"
    # Writes: random data, each range from one CPU (taskset), O_DIRECT.
    while read -r name off len bs cpu; do
        head -c "$len" /dev/urandom >"/tmp/$name.wr"
        echo "RESULT wrote $name $off $len $(sha_of <"/tmp/$name.wr")"
    done </tmp/ranges
    q0_before=$(hctx_runs 0)
    q1_before=$(hctx_runs 1)
    flushes_before=$(stat_field 16)
    while read -r name off len bs cpu; do
        if taskset -c "$cpu" dd if="/tmp/$name.wr" of=$DEV bs="$bs" seek=$((off / bs)) \
            oflag=direct conv=notrunc 2>/tmp/dd.err; then
            check "write_$name" 0 "cpu=$cpu"
        else
            check "write_$name" 1 "dd: $(tr '\n' ' ' </tmp/dd.err)"
        fi
    done </tmp/ranges
    echo "RESULT hctx0_runs_delta=$(($(hctx_runs 0) - q0_before))"
    echo "RESULT hctx1_runs_delta=$(($(hctx_runs 1) - q1_before))"
    step="flush"
    # Flush: fsync of the block device issues a cache flush (when the device has a write cache).
    set +e
    dd if=/dev/null of=$DEV conv=notrunc,fsync 2>/tmp/dd.err
    st=$?
    set -e
    check fsync "$st" "dd conv=fsync exit $st $(tr '\n' ' ' </tmp/dd.err)"
    sync
    blockdev --flushbufs $DEV
    echo "RESULT flushes_delta=$(($(stat_field 16) - flushes_before))"

    step="readback"
    # Read back what was written.
    echo 3 >/proc/sys/vm/drop_caches
    while read -r name off len bs cpu; do
        read_range "$name" "$off" "$len" "$bs"
    done </tmp/ranges

    step="discard"
    # Discard: fill a range with random data, discard it, read back zeroes.
    head -c $DISCARD_LEN /dev/urandom >/tmp/discard.wr
    dd if=/tmp/discard.wr of=$DEV bs=65536 seek=$((DISCARD_OFF / 65536)) oflag=direct conv=notrunc,fsync 2>/dev/null
    read_range discard_before $DISCARD_OFF $DISCARD_LEN 65536
    discards_before=$(stat_field 12)
    set +e
    blkdiscard -o $DISCARD_OFF -l $DISCARD_LEN $DEV 2>/tmp/bd.err
    st=$?
    set -e
    check blkdiscard "$st" "exit $st $(tr '\n' ' ' </tmp/bd.err)"
    echo "RESULT discards_delta=$(($(stat_field 12) - discards_before))"
    echo 3 >/proc/sys/vm/drop_caches
    read_range discard $DISCARD_OFF $DISCARD_LEN 65536
    echo "RESULT zero_sha256=$(head -c $DISCARD_LEN /dev/zero | sha_of)"
    ;;
verify)
    step="verify"
    while read -r name off len bs cpu; do
        read_range "$name" "$off" "$len" "$bs"
    done </tmp/ranges
    read_range discard $DISCARD_OFF $DISCARD_LEN 65536
    ;;
readonly)
    step="readonly"
    while read -r name off len bs cpu; do
        read_range "$name" "$off" "$len" "$bs"
    done </tmp/ranges
    head -c 4096 /dev/urandom >/tmp/ro.wr
    set +e
    dd if=/tmp/ro.wr of=$DEV bs=4096 seek=100 oflag=direct conv=notrunc,fsync 2>/tmp/dd.err
    st=$?
    set -e
    echo "RESULT ro_write_exit=$st"
    echo "RESULT ro_write_error=$(tr '\n' ' ' </tmp/dd.err)"
    ;;
*)
    echo "RESULT check phase FAIL unknown phase '$phase' (kernel command line: $(cat /proc/cmdline))"
    exit 2
    ;;
esac

step="end"
echo "RESULT writes_completed=$(stat_field 5)"
echo "RESULT discards_completed=$(stat_field 12)"
echo "RESULT flushes_completed=$(stat_field 16)"
echo "RESULT guest_failures=$failures"
exit "$failures"
