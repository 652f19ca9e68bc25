#!/bin/sh
# PID 1 of the FastLane test guest (busybox sh). run-guest.sh copies this file to /init of the
# initramfs and writes /etc/fastlane/guest.env (NONCE, RELEASE, CONSOLE_LEVEL, DMESG) and
# /etc/fastlane/modules ("name relative/path.ko" lines, dependencies first).
# It mounts the pseudo filesystems, loads the modules, runs /etc/fastlane/script.sh as root,
# then prints FASTLANE-GUEST-EXIT=<status> run=<NONCE>, syncs and powers off.
export PATH=/bin:/sbin:/usr/bin:/usr/sbin HOME=/root TERM=dumb

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm /dev/hugepages
mount -t devpts devpts /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -t tmpfs -o mode=1777 tmpfs /tmp
mount -t tmpfs tmpfs /run
mount -t hugetlbfs hugetlbfs /dev/hugepages 2>/dev/null
[ -d /sys/kernel/config ] && mount -t configfs configfs /sys/kernel/config 2>/dev/null
[ -d /sys/kernel/debug ] && mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null
hostname fastlane-guest
ip link set lo up 2>/dev/null

# shellcheck source=/dev/null
. /etc/fastlane/guest.env

# The console carries the script's output: keep kernel chatter to warnings and worse
# (the boot messages before this point stay in the log).
echo "$CONSOLE_LEVEL" >/proc/sys/kernel/printk

finish() {
    sync
    # The marker goes through printk as well as the tty: printk writes the serial console
    # synchronously, so the marker survives the power-off even if the tty has not drained.
    echo "FASTLANE-GUEST-EXIT=$1 run=$NONCE"
    echo "<0>FASTLANE-GUEST-EXIT=$1 run=$NONCE" >/dev/kmsg
    sync
    poweroff -f
    sleep 5
    echo o >/proc/sysrq-trigger
}

read -r up _ </proc/uptime
echo "FASTLANE-GUEST-INIT uptime=${up}s kernel=$(uname -r) cpus=$(nproc)"

while read -r name path; do
    [ -n "$name" ] || continue
    if [ -d "/sys/module/$name" ]; then
        continue
    fi
    if ! out=$(insmod "/lib/modules/$RELEASE/$path" 2>&1); then
        echo "FASTLANE-GUEST-MODULE-FAILED=$name: $out"
        dmesg | tail -n 20
        finish 125
    fi
done </etc/fastlane/modules

read -r up _ </proc/uptime
echo "FASTLANE-GUEST-SCRIPT-START uptime=${up}s"
cd /root || cd /
sh /etc/fastlane/script.sh </dev/null
status=$?
read -r up _ </proc/uptime
echo "FASTLANE-GUEST-SCRIPT-END uptime=${up}s status=$status"
if [ "$DMESG" = 1 ]; then
    echo "FASTLANE-GUEST-DMESG-BEGIN"
    dmesg
    echo "FASTLANE-GUEST-DMESG-END"
fi
finish "$status"
