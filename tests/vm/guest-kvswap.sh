#!/bin/sh
# Guest side of kvswap's remote-tier test (tests/guest/tests/kvswap_remote.rs), run as root by
# tests/vm/run-guest.sh with the rxe modules loaded: soft-RoCE on dummy0, a remote memory pool
# server and a kvswap engine spilling into it (/bin/kvswap-remote-check), then the pool server
# killed with -9 under the engine. Prints the driver's CHECK lines; every step is bounded.
set -eu
ip link set dummy0 up
ip addr add 10.11.12.1/24 dev dummy0
rdma link add rxe0 type rxe netdev dummy0
ulimit -l unlimited 2>/dev/null || true
D=/bin/kvswap-remote-check
LOG=/tmp/kv
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

$D pool-server 127.0.0.1:7490 8388608 >$LOG/server 2>&1 &
spid=$!
wait_for $LOG/server READY 20 || { echo "RESULT pool-server-start FAIL"; cat $LOG/server; failures=$((failures + 1)); }
timeout 150 $D client 127.0.0.1:7490 >$LOG/client 2>&1 &
cpid=$!
if wait_for $LOG/client KILL-ME 100; then
    kill -9 "$spid"
else
    echo "RESULT client-never-asked-for-the-kill"
fi
wait "$cpid" || failures=$((failures + 1))
wait "$spid" 2>/dev/null || true
cat $LOG/client
echo "RESULT failures=$failures"
[ "$failures" = 0 ]
