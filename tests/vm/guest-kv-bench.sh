#!/bin/sh
# Guest side of scripts/bench-kv-remote.sh, run as root by tests/vm/run-guest.sh with the rxe
# modules loaded: soft-RoCE on dummy0, a `fastlane rdma serve` pool on it, and
# `fastlane kv bench --tiers $fl_tiers --pool ...` against that pool. Kernel command line:
# fl_tiers, fl_bytes, fl_samples, fl_rounds, fl_checksum. Prints the bench's output as
# its `--json` report on one "BENCHJSON {...}" line, its .hlog as "HLOG ..." lines and "RESULT failures=N".
set -eu
tiers=host,remote bytes=256M samples=5 rounds=1 checksum=fast
for a in $(cat /proc/cmdline); do
    case "$a" in
        fl_tiers=*) tiers=${a#fl_tiers=} ;;
        fl_bytes=*) bytes=${a#fl_bytes=} ;;
        fl_samples=*) samples=${a#fl_samples=} ;;
        fl_rounds=*) rounds=${a#fl_rounds=} ;;
        fl_checksum=*) checksum=${a#fl_checksum=} ;;
    esac
done
ip link set dummy0 up
ip addr add 10.11.12.1/24 dev dummy0
rdma link add rxe0 type rxe netdev dummy0
ulimit -l unlimited 2>/dev/null || true
LOG=/tmp/kvb
mkdir -p $LOG
failures=0

wait_for() {
    n=0
    while ! grep -q "$2" "$1" 2>/dev/null; do
        n=$((n + 1))
        [ "$n" -ge $(($3 * 10)) ] && return 1
        sleep 0.1
    done
}

# The pool: exactly the sequence's bytes.
fastlane rdma serve --device rxe0 --size "$bytes" --listen 127.0.0.1:7490 >$LOG/pool 2>&1 &
spid=$!
if ! wait_for $LOG/pool listening 60; then
    echo "RESULT pool-start FAIL"
    cat $LOG/pool
    failures=$((failures + 1))
fi
echo "RESULT tiers=$tiers bytes=$bytes samples=$samples rounds=$rounds checksum=$checksum"
t0=$(date +%s)
if fastlane kv bench --tiers "$tiers" --pool 127.0.0.1:7490 --device rxe0 --bytes "$bytes" \
    --samples "$samples" --rounds "$rounds" --checksum "$checksum" --file /tmp/kvbench.dat \
    --hlog /tmp/kvswap-swapin.hlog --json >$LOG/bench 2>$LOG/bench.err; then
    echo "BENCHJSON $(tr -d '\n' <$LOG/bench)"
    sed 's/^/HLOG /' /tmp/kvswap-swapin.hlog
else
    cat $LOG/bench $LOG/bench.err
    cat $LOG/pool
    failures=$((failures + 1))
fi
echo "RESULT time $(($(date +%s) - t0))s"
kill "$spid" 2>/dev/null || true
wait "$spid" 2>/dev/null || true
echo "RESULT failures=$failures"
[ "$failures" = 0 ]
