#!/bin/sh
# Guest side of the engine's remote-tier test (tests/guest/tests/llm_remote.rs), run as
# root by tests/vm/run-guest.sh with the rxe modules loaded: soft-RoCE on dummy0, a remote
# memory pool server, and the engine preempting by swap into it. Every step is bounded.
set -eu
ip link set dummy0 up
ip addr add 10.11.12.1/24 dev dummy0
rdma link add rxe0 type rxe netdev dummy0
ulimit -l unlimited 2>/dev/null || true
D=/bin/fastlane-llm-remote-check
LOG=/tmp/llm
mkdir -p $LOG
failures=0
n=0
$D pool-server 127.0.0.1:7491 16777216 >$LOG/server 2>&1 &
spid=$!
while ! grep -q READY $LOG/server 2>/dev/null; do
    n=$((n + 1))
    [ "$n" -ge 200 ] && { echo "RESULT pool-server-start FAIL"; cat $LOG/server; failures=$((failures + 1)); break; }
    sleep 0.1
done
timeout 400 $D client 127.0.0.1:7491 >$LOG/client 2>&1 || failures=$((failures + 1))
kill -9 "$spid" 2>/dev/null || true
cat $LOG/client
echo "RESULT failures=$failures"
[ "$failures" = 0 ]
