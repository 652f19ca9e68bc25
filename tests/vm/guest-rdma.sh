#!/bin/sh
# Guest side of the fastlane-rdma tests (tests/guest/tests/rdma.rs) and of the RDMA
# benchmark (scripts/bench-rdma.sh). Runs as root in a tests/vm/run-guest.sh guest (busybox
# sh) with the rxe modules loaded. It brings soft-RoCE up on dummy0 and then runs, by phase
# (kernel command line fl_rdma_phase=test|bench|probe, default test):
#
#   test    each scenario of /bin/fastlane-rdma-check as two processes on 127.0.0.1:
#           basic (connect, 1 MiB write/read with checksums, immediate data, SEND, out-of-range
#           refused locally and by the peer's device), peer-gone (the peer killed with -9 while
#           we write, and while we wait for a receive), pool (serve + two clients), mirror
#           (ordered writes, replica acks, read-after-write; checksums on both sides)
#   bench   perftest ib_write_lat / ib_write_bw (-F) and `fastlane rdma bench` on the same
#           device; prints BENCH lines (see scripts/bench-rdma.sh)
#   probe   only the device setup and its GID table
#
# Output: "CHECK name ok|FAIL detail" lines from the driver, "RESULT ..." lines from here.
# Exits non-zero when any check failed; every scenario is bounded by `timeout`.
set -eu

phase=test
for a in $(cat /proc/cmdline); do
    case "$a" in fl_rdma_phase=*) phase=${a#fl_rdma_phase=} ;; esac
done

# soft-RoCE on the dummy netdev. The netdev needs an IPv4 address (rxe's GID table then has an
# IPv4-mapped entry, which Device::open picks) and must be up. Nothing leaves the guest: it has
# no NIC, and rxe loops traffic to its own address back internally.
RXE_ADDR=${RXE_ADDR:-10.11.12.1/24}
ip link set dummy0 up
ip addr add "$RXE_ADDR" dev dummy0
rdma link add rxe0 type rxe netdev dummy0
rdma link show
echo "RESULT mtu=$(cat /sys/class/net/dummy0/mtu)"
for i in 0 1 2 3; do
    g=/sys/class/infiniband/rxe0/ports/1/gids/$i
    [ -r "$g" ] && echo "RESULT gid$i=$(cat "$g" 2>/dev/null || echo none) type=$(cat /sys/class/infiniband/rxe0/ports/1/gid_attrs/types/$i 2>/dev/null || echo -)"
done
ulimit -l unlimited 2>/dev/null || true

failures=0
CHECK=/bin/fastlane-rdma-check
LOG=/tmp/rdma
mkdir -p $LOG

# wait_for FILE TEXT SECONDS: until FILE contains TEXT (polling every 0.1 s)
wait_for() {
    n=0
    while ! grep -q "$2" "$1" 2>/dev/null; do
        n=$((n + 1))
        [ "$n" -ge $(($3 * 10)) ] && return 1
        sleep 0.1
    done
}

# pair NAME PORT SERVER-ROLE-ARGS CLIENT-ROLE-ARGS: run a server and a client, both bounded
pair() {
    name=$1 port=$2 srole=$3 crole=$4
    t0=$(date +%s)
    # shellcheck disable=SC2086
    timeout 60 $CHECK $srole 127.0.0.1:$port >$LOG/$name.server 2>&1 &
    spid=$!
    if ! wait_for $LOG/$name.server READY 20; then
        echo "RESULT check $name-server-start FAIL"
        cat $LOG/$name.server
        failures=$((failures + 1))
    fi
    # shellcheck disable=SC2086
    if ! timeout 60 $CHECK $crole 127.0.0.1:$port >$LOG/$name.client 2>&1; then
        failures=$((failures + 1))
    fi
    cat $LOG/$name.client
    echo "RESULT time $name $(($(date +%s) - t0))s"
}

run_tests() {
    $CHECK devices

    pair basic 7471 basic-server basic-client
    if ! wait $spid; then failures=$((failures + 1)); fi
    cat $LOG/basic.server

    # Pool: one server, a client session that also opens a second client.
    pair pool 7472 pool-server pool-client
    kill "$spid" 2>/dev/null || true
    wait "$spid" 2>/dev/null || true
    cat $LOG/pool.server

    # Mirror: 2 MiB of ordered records; the replica prints its checksum after the primary left.
    timeout 60 $CHECK replica 127.0.0.1:7473 2097152 >$LOG/mirror.replica 2>&1 &
    rpid=$!
    wait_for $LOG/mirror.replica READY 20 || true
    timeout 60 $CHECK primary 127.0.0.1:7473 2097152 >$LOG/mirror.primary 2>&1 || failures=$((failures + 1))
    wait "$rpid" || failures=$((failures + 1))
    cat $LOG/mirror.primary $LOG/mirror.replica
    p=$(sed -n 's/^PRIMARY fnv=//p' $LOG/mirror.primary)
    r=$(sed -n 's/^REPLICA .*fnv=//p' $LOG/mirror.replica)
    if [ -n "$p" ] && [ "$p" = "$r" ]; then
        echo "CHECK mirror-replica-memory ok fnv=$p"
    else
        echo "CHECK mirror-replica-memory FAIL primary=$p replica=$r"
        failures=$((failures + 1))
    fi

    # Peer gone: kill -9 the server once the client is connected, in both wait modes.
    for mode in write recv; do
        port=7474
        [ "$mode" = recv ] && port=7475
        # No timeout(1) wrapper: $! must be the driver itself (it exits after 60 s anyway).
        $CHECK gone-server 127.0.0.1:$port >$LOG/gone-$mode.server 2>&1 &
        spid=$!
        wait_for $LOG/gone-$mode.server READY 20 || true
        timeout 60 $CHECK gone-client 127.0.0.1:$port $mode >$LOG/gone-$mode.client 2>&1 &
        cpid=$!
        wait_for $LOG/gone-$mode.client CONNECTED 20 || true
        sleep 0.5
        kill -9 "$spid"
        wait "$cpid" || failures=$((failures + 1))
        wait "$spid" 2>/dev/null || true
        cat $LOG/gone-$mode.client
    done
}

# perftest's result line for SIZE from FILE (first field = bytes)
perf_line() { awk -v s="$1" '$1 == s { print; exit }' "$2"; }

run_bench() {
    iters=1000 bw_iters=5000 rounds=1
    for a in $(cat /proc/cmdline); do
        case "$a" in
            fl_iters=*) iters=${a#fl_iters=} ;;
            fl_bw_iters=*) bw_iters=${a#fl_bw_iters=} ;;
            fl_rounds=*) rounds=${a#fl_rounds=} ;;
        esac
    done
    sizes="8 64 512 4096 65536"
    r=1
    while [ "$r" -le "$rounds" ]; do
        # perftest, one size per server/client pair (GID index 1: the IPv4-mapped one).
        for s in $sizes; do
            timeout 120 ib_write_lat -F -d rxe0 -x 1 -s "$s" -n "$iters" -p 18515 >$LOG/pl.server 2>&1 &
            sleep 0.3
            timeout 120 ib_write_lat -F -d rxe0 -x 1 -s "$s" -n "$iters" -p 18515 127.0.0.1 >$LOG/pl.client 2>&1 || true
            wait || true
            # #bytes #iterations t_min t_max t_typical t_avg t_stdev 99% 99.9%
            line=$(perf_line "$s" $LOG/pl.client)
            echo "PERFTEST ib_write_lat $line"
            [ -n "$line" ] || { cat $LOG/pl.client $LOG/pl.server; failures=$((failures + 1)); }
            echo "$line" | awk -v r="$r" '{ printf "RESULT perftest_lat round=%s size=%s p50_ns=%.0f avg_ns=%.0f p99_ns=%.0f\n", r, $1, $5 * 1000, $6 * 1000, $8 * 1000 }'
        done
        timeout 300 ib_write_bw -F -d rxe0 -x 1 -s 65536 -n "$bw_iters" -p 18516 >$LOG/pb.server 2>&1 &
        sleep 0.3
        timeout 300 ib_write_bw -F -d rxe0 -x 1 -s 65536 -n "$bw_iters" -p 18516 127.0.0.1 >$LOG/pb.client 2>&1 || true
        wait || true
        # #bytes #iterations BW_peak BW_average MsgRate[Mpps]: bytes/s from the message rate
        line=$(perf_line 65536 $LOG/pb.client)
        echo "PERFTEST ib_write_bw $line"
        [ -n "$line" ] || { cat $LOG/pb.client $LOG/pb.server; failures=$((failures + 1)); }
        echo "$line" | awk -v r="$r" '{ printf "RESULT perftest_bw round=%s size=%s bytes_per_s=%.0f mpps=%s\n", r, $1, $5 * 1e6 * $1, $5 }'

        # fastlane rdma bench: same device, sizes, iterations, depth.
        timeout 300 fastlane rdma bench --device rxe0 --listen 127.0.0.1:7480 >$LOG/fb.server 2>&1 &
        sleep 0.3
        if timeout 300 fastlane rdma bench --device rxe0 --connect 127.0.0.1:7480 \
            --sizes 8,64,512,4096,65536 --iters "$iters" --bw-size 65536 --bw-iters "$bw_iters" \
            --bw-depth 128 --hlog /tmp/rdma-bench-$r.hlog --json >$LOG/fb.client 2>$LOG/fb.err; then
            # Its report, on one line: scripts/bench_results.py reads it.
            echo "BENCHJSON fastlane $r $(tr -d '\n' <$LOG/fb.client)"
            sed 's/^/HLOG /' /tmp/rdma-bench-$r.hlog
        else
            cat $LOG/fb.client $LOG/fb.err $LOG/fb.server
            failures=$((failures + 1))
        fi
        wait || true
        r=$((r + 1))
    done
}

case "$phase" in
    probe) ;;
    test) run_tests ;;
    bench) run_bench ;;
    *) echo "unknown phase $phase"; exit 2 ;;
esac
echo "RESULT failures=$failures"
[ "$failures" = 0 ]
