#!/bin/sh
# Guest side of the vhost-user-blk crash test (fastlane-cli/tests/vm_blk_crash.rs): Debian's fio writes
# and verifies /dev/vda for fl_fio_seconds seconds (kernel command line) while the host
# SIGKILLs and restarts the backend. Two jobs, one per vCPU (so both virtqueues carry
# requests), each on its own half of the disk, O_DIRECT through libaio at QD32, random writes
# of 4-64 KiB with a CRC32C in every block, each block read back and checked soon after it is
# written (verify_backlog) and any mismatch fatal.
#
# Prints for the host:
#   RESULT fio_start              the jobs are about to start
#   RESULT fio_exit=N             fio's exit status (0: every verify passed, no I/O error)
#   RESULT fio_errors=N           the jobs' summed error counts (from the terse output)
#   RESULT fio_kib=N              KiB read + written
set -u
secs=$(sed -n 's/.*fl_fio_seconds=\([0-9]*\).*/\1/p' /proc/cmdline)
[ -n "$secs" ] || secs=30
echo "RESULT fio_start"
fio --name=crash --filename=/dev/vda --direct=1 --ioengine=libaio --iodepth=32 \
    --rw=randwrite --bsrange=4k-64k --verify=crc32c --verify_backlog=16 --verify_fatal=1 \
    --numjobs=2 --size=24M --offset_increment=24M \
    --cpus_allowed=0,1 --cpus_allowed_policy=split \
    --time_based --runtime="$secs" --output-format=terse --terse-version=3 \
    --output=/tmp/fio.terse >/tmp/fio.log 2>&1
rc=$?
echo "RESULT fio_exit=$rc"
# Terse v3, one line per job: field 5 is its error count, field 6 the KiB it read, field 47
# the KiB it wrote.
awk -F';' '/^3;/ { e += $5; rk += $6; wk += $47 } END { printf "RESULT fio_errors=%d\nRESULT fio_kib=%d\n", e, rk + wk }' /tmp/fio.terse
tail -n 20 /tmp/fio.log
exit "$rc"
