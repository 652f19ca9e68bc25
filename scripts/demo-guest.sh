#!/bin/sh
# Guest side of scripts/run.sh: a short workload on the vhost-user-blk disk FastLane serves.
# Writes 8 MiB of random data with O_DIRECT, reads it back with O_DIRECT after dropping caches,
# compares checksums, then issues 2000 4 KiB O_DIRECT reads at random offsets so the daemon's
# latency histogram has something to show. Prints RESULT lines; exits non-zero on a mismatch.
set -eu
DEV=/dev/vda
sectors=$(cat /sys/block/vda/size)
echo "RESULT disk_bytes=$((sectors * 512))"
dd if=/dev/urandom of=/tmp/data bs=1M count=8 2>/dev/null
want=$(sha256sum /tmp/data | cut -d' ' -f1)
dd if=/tmp/data of=$DEV bs=1M count=8 oflag=direct 2>/dev/null
echo 3 > /proc/sys/vm/drop_caches
got=$(dd if=$DEV bs=1M count=8 iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1)
echo "RESULT wrote=$want"
echo "RESULT read=$got"
[ "$want" = "$got" ] || { echo "RESULT check=FAIL"; exit 1; }
blocks=$((sectors / 8))
i=0
seed=12345
while [ $i -lt 2000 ]; do
  seed=$(( (seed * 1103515245 + 12345) % 2147483648 ))
  dd if=$DEV of=/dev/null bs=4096 count=1 skip=$((seed % blocks)) iflag=direct 2>/dev/null
  i=$((i + 1))
done
sync
echo "RESULT check=ok random_reads=$i"
