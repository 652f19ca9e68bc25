#!/usr/bin/env bash
# vhost-user-blk side by side: qemu-storage-daemon and `fastlane serve` export the same
# RAM-backed file (/dev/shm), and the same client, `fastlane bench blk`, measures each in turn
# (QD1 latency and QD32 IOPS of 4 KiB random reads and writes). Then `fastlane serve` with its
# `mem:` RAM backend as an extra row. Backend pinned to one CPU, client to another.
#
# Usage: scripts/bench-blk.sh [--seconds S] [--out DIR] [--disk-mib N] [--inflight on|off]
#   --seconds S    measured seconds per case (default 5; 4 cases per backend)
#   --inflight on  fastlane serve tracks every request in an in-flight region (default: on;
#                  `--own-inflight-region`, since the client does not send one as QEMU does)
#   --out DIR      where the JSON reports, .hlog files and logs go
#                  (default target/bench-blk/YYYYmmdd-HHMMSS)
#   --disk-mib N   size of the /dev/shm file and of the mem: disk (default 256)
# Environment: CARGO_TARGET_DIR (where to build), FASTLANE_BIN (use this binary, no build),
#   BACKEND_CPU / CLIENT_CPU (default 0 / 1), EXTRA_SERVE_ARGS (e.g. "--poll-us 200").
# Also writes the run as benches/results/vhost-blk/<date>-<commit>.json (scripts/bench_results.py).
set -euo pipefail

secs=5
out=""
disk_mib=256
inflight=on
while [ $# -gt 0 ]; do
    case "$1" in
        --inflight) inflight="$2"; shift 2 ;;
        --seconds) secs="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        --disk-mib) disk_mib="$2"; shift 2 ;;
        -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
        *) echo "bench-blk.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done

root=$(cd "$(dirname "$0")/.." && pwd)
target=${CARGO_TARGET_DIR:-$root/target}
out=${out:-$root/target/bench-blk/$(date +%Y%m%d-%H%M%S)}
backend_cpu=${BACKEND_CPU:-0}
client_cpu=${CLIENT_CPU:-1}
mkdir -p "$out"
case "$inflight" in
    on) inflight_args=(--own-inflight-region) ;;
    off) inflight_args=() ;;
    *) echo "bench-blk.sh: --inflight takes on or off, not $inflight" >&2; exit 2 ;;
esac

command -v qemu-storage-daemon >/dev/null || {
    echo "bench-blk.sh: qemu-storage-daemon not found (Debian: qemu-system-common)" >&2
    exit 1
}
if [ -n "${FASTLANE_BIN:-}" ]; then
    bin=$FASTLANE_BIN
else
    (cd "$root" && cargo build --release -p fastlane-cli)
    bin=$target/release/fastlane
fi

img=/dev/shm/fastlane-bench-blk-$$.img
sockdir=$(mktemp -d /tmp/fastlane-bench-blk.XXXXXX)
pid=""
cleanup() {
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then kill -TERM "$pid"; wait "$pid" || true; fi
    rm -f "$img"
    rm -rf "$sockdir"
}
trap cleanup EXIT

# A fully allocated file: both backends read real pages, not holes.
dd if=/dev/zero of="$img" bs=1M count="$disk_mib" status=none

# start_backend NAME CMD...: run CMD pinned to the backend CPU, wait (≤ 10 s) for its socket.
start_backend() {
    local name=$1; shift
    sock=$sockdir/$name.sock
    taskset -c "$backend_cpu" "$@" >"$out/$name.backend.log" 2>&1 &
    pid=$!
    for _ in $(seq 100); do
        [ -S "$sock" ] && return 0
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    echo "bench-blk.sh: $name did not create $sock; its log:" >&2
    cat "$out/$name.backend.log" >&2
    exit 1
}

# stop_backend: SIGTERM, then wait (≤ 10 s) before SIGKILL.
stop_backend() {
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 100); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    pid=""
}

# client NAME: the benchmark against $sock, pinned to the client CPU.
client() {
    local name=$1
    echo "== $name" >&2
    taskset -c "$client_cpu" "$bin" bench blk --socket "$sock" --seconds "$secs" \
        --pin-core "$client_cpu" --hlog "$out/$name.hlog" --json >"$out/$name.json"
}

{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "host: $(uname -r), $(nproc) CPUs, backend on CPU $backend_cpu, client on CPU $client_cpu"
    echo "qemu-storage-daemon: $(qemu-storage-daemon --version | head -1)"
    echo "fastlane: $("$bin" --version)"
    echo "command: scripts/bench-blk.sh --seconds $secs --disk-mib $disk_mib --inflight $inflight"
    echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
} | tee "$out/env.txt"

start_backend qsd qemu-storage-daemon \
    --blockdev "driver=file,node-name=disk0,filename=$img,cache.direct=off" \
    --export "type=vhost-user-blk,id=exp0,node-name=disk0,addr.type=unix,addr.path=$sockdir/qsd.sock,writable=on,num-queues=1"
client qsd
stop_backend

# shellcheck disable=SC2086 # EXTRA_SERVE_ARGS is a list of words
start_backend fastlane-file "$bin" serve --socket-path "$sockdir/fastlane-file.sock" \
    --blk-file "$img" --queues 1 "${inflight_args[@]}" ${EXTRA_SERVE_ARGS:-}
client fastlane-file
stop_backend

# shellcheck disable=SC2086
start_backend fastlane-mem "$bin" serve --socket-path "$sockdir/fastlane-mem.sock" \
    --backend "mem:${disk_mib}M" --queues 1 "${inflight_args[@]}" ${EXTRA_SERVE_ARGS:-}
client fastlane-mem
stop_backend

echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/env.txt"
{
    echo
    for n in qsd fastlane-file fastlane-mem; do
        echo "## $n"
        "$bin" bench blk --show "$out/$n.json"
        echo
    done
    echo "## FastLane (file:) / qemu-storage-daemon"
    "$bin" bench blk --compare "$out/qsd.json" "$out/fastlane-file.json" \
        --labels qsd,fastlane-file --p50-target 0.12
    echo
    echo "## FastLane (mem:) / qemu-storage-daemon"
    "$bin" bench blk --compare "$out/qsd.json" "$out/fastlane-mem.json" \
        --labels qsd,fastlane-mem --p50-target 0.07
} | tee "$out/summary.txt"
python3 "$root/scripts/bench_results.py" blk "$out" \
    "scripts/bench-blk.sh --seconds $secs --disk-mib $disk_mib --inflight $inflight${EXTRA_SERVE_ARGS:+ (EXTRA_SERVE_ARGS=$EXTRA_SERVE_ARGS)}"
echo "results in $out" >&2
