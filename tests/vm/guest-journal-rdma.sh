#!/bin/sh
# Guest side of fastlane-cli/tests/journal_rdma_guest.rs: the record journal replicated over RDMA
# (soft-RoCE, rxe0 on dummy0, both ends on 127.0.0.1). Runs as root in a
# tests/vm/run-guest.sh guest (busybox sh) with the rxe modules loaded.
#
#   replicated  `fastlane journal replica` stores what the mirror writes; a `replicated`
#               journal appends N records, printing ACK lines as seqs become durable; the
#               replica's file must verify, end at seq N and carry the primary's chain head.
#   resync      the primary appends 500 records without its replica, then reopens with it:
#               the replica reports where it stands, gets only what it lacks, and both
#               files verify with the same head; a replica holding another journal is
#               refused untouched, and rewritten with --rebuild-replica.
#   kill        the replica is killed with -9 while the primary appends: the primary must
#               exit with the writer's replica error within the RDMA timeout (no hang), and
#               every seq it acknowledged must be in both files, which still verify.
#
#   bench       (fl_journal_phase=bench) local against replicated durable acks and the
#               device's round trip: see below and scripts/bench-journal-replicated.sh.
#
# Output: "CHECK name ok|FAIL detail" and "RESULT ..." lines. Exits non-zero on any failure;
# every process is bounded by `timeout` or killed by this script.
set -u

ip link set dummy0 up
ip addr add 10.11.12.1/24 dev dummy0
rdma link add rxe0 type rxe netdev dummy0
ulimit -l unlimited 2>/dev/null || true

F=/bin/fastlane
SIZE=16M
N=${N:-3000}
failures=0
T=/tmp/jr
mkdir -p $T

ok() { echo "CHECK $1 ok${2:+ $2}"; }
fail() { echo "CHECK $1 FAIL${2:+ $2}"; failures=$((failures + 1)); }

# wait_for FILE TEXT SECONDS: until FILE contains TEXT (polling every 0.1 s)
wait_for() {
    n=0
    while ! grep -q "$2" "$1" 2>/dev/null; do
        n=$((n + 1))
        [ "$n" -ge $(($3 * 10)) ] && return 1
        sleep 0.1
    done
}

# field NAME FILE: the value after "NAME " in a `journal verify` line
field() { sed -n "s/.*$1 \([0-9a-f]*\).*/\1/p" "$2" | head -1; }

# --- bench (kernel command line fl_journal_phase=bench; scripts/bench-journal-replicated.sh) --
# Per round, in one boot: `journal bench` at local durability, the same at replicated durability
# through a `journal replica` on this guest's rxe0, and ib_write_lat's round trip on the same
# device. Prints each bench's JSON on one "BENCHJSON <durability> <round> {...}" line and
# perftest's numbers as "BENCHJSON rtt <round> {...}"; the host side reads those.
phase=test rounds=3 rate=2000 seconds=3 replica_sync=ack replica_poll=event
for a in $(cat /proc/cmdline); do
    case "$a" in
        fl_journal_phase=*) phase=${a#fl_journal_phase=} ;;
        fl_rounds=*) rounds=${a#fl_rounds=} ;;
        fl_rate=*) rate=${a#fl_rate=} ;;
        fl_seconds=*) seconds=${a#fl_seconds=} ;;
        fl_replica_sync=*) replica_sync=${a#fl_replica_sync=} ;;
        fl_replica_poll=*) replica_poll=${a#fl_replica_poll=} ;;
    esac
done
if [ "$phase" = bench ]; then
    # --poll event: the replica stands for another machine, so it must not keep one of the
    # guest's two vCPUs spinning while the primary runs.
    timeout 3600 $F journal replica --listen 127.0.0.1:7495 --device rxe0 --file $T/rb.journal --poll event \
        --size 64M >$T/rb.log 2>&1 &
    rpid=$!
    wait_for $T/rb.log READY 20 || { cat $T/rb.log; echo "RESULT failures=1"; exit 1; }
    common="--size 64M --records 20000 --rate $rate --seconds $seconds --baseline-ops 200 --json"
    r=1
    while [ "$r" -le "$rounds" ]; do
        for d in local replicated; do
            extra=
            [ "$d" = replicated ] && extra="--replica rdma://127.0.0.1:7495 --device rxe0 --replica-sync $replica_sync --replica-poll $replica_poll"
            # shellcheck disable=SC2086 # $common and $extra hold several arguments on purpose
            if timeout 600 $F journal bench $T/b-$d.journal --durability $d $common $extra \
                --hlog $T/b.hlog >$T/b.json 2>$T/b.err; then
                echo "BENCHJSON $d $r $(tr -d '\n ' <$T/b.json)"
            else
                cat $T/b.err; failures=$((failures + 1))
            fi
        done
        timeout 120 ib_write_lat -F -d rxe0 -x 1 -s 64 -n 1000 -p 18515 >$T/pl.server 2>&1 &
        sleep 0.3
        timeout 120 ib_write_lat -F -d rxe0 -x 1 -s 64 -n 1000 -p 18515 127.0.0.1 >$T/pl.client 2>&1 || true
        wait $! 2>/dev/null || true
        # #bytes #iterations t_min t_max t_typical t_avg t_stdev 99% 99.9% (µs, one way)
        line=$(awk '$1 == 64 { print; exit }' $T/pl.client)
        if [ -n "$line" ]; then
            echo "$line" | awk -v r="$r" '{ printf "BENCHJSON rtt %s {\"one_way_p50_us\":%s,\"one_way_p99_us\":%s}\n", r, $5, $8 }'
        else
            cat $T/pl.client $T/pl.server; failures=$((failures + 1))
        fi
        r=$((r + 1))
    done
    kill $rpid 2>/dev/null; wait $rpid 2>/dev/null
    echo "RESULT failures=$failures"
    [ "$failures" = 0 ]
    exit
fi

# --- replicated: every acknowledged seq is in the replica's copy --------------------------
t0=$(date +%s)
timeout 60 $F journal replica --listen 127.0.0.1:7490 --device rxe0 --file $T/r1.journal \
    --size $SIZE --sessions 1 >$T/r1.log 2>&1 &
rpid=$!
wait_for $T/r1.log READY 20 || { cat $T/r1.log; fail replica-start; }
if timeout 60 $F journal append $T/p1.journal --size $SIZE --durability replicated \
    --replica rdma://127.0.0.1:7490 --device rxe0 --generate "$N" --ack-every 100 \
    >$T/p1.out 2>$T/p1.err; then
    ok replicated-append "acks=$(grep -c '^ACK' $T/p1.out)"
else
    fail replicated-append "$(cat $T/p1.err)"
fi
wait $rpid || fail replica-exit "$(cat $T/r1.log)"
cat $T/r1.log
last=$(sed -n 's/^ACK //p' $T/p1.out | tail -1)
$F journal verify $T/p1.journal >$T/v1p 2>&1 || true
$F journal verify $T/r1.journal --expect-last-seq "$N" >$T/v1r 2>&1 || true
cat $T/v1p $T/v1r
ph=$(field head $T/v1p)
rh=$(field head $T/v1r)
if [ "$last" = "$N" ] && grep -q '^OK' $T/v1p && grep -q '^OK' $T/v1r && [ -n "$ph" ] && [ "$ph" = "$rh" ]; then
    ok replica-has-every-acked-seq "last_ack=$last head=$rh"
else
    fail replica-has-every-acked-seq "last_ack=$last primary_head=$ph replica_head=$rh"
fi
echo "RESULT time replicated $(($(date +%s) - t0))s"

# --- resync: a replica that fell behind catches up; a diverged one is refused ----------------
t0=$(date +%s)
# serve PORT FILE LOG: a one-session replica in the background (pid in $rpid)
serve() {
    timeout 60 $F journal replica --listen 127.0.0.1:$1 --device rxe0 --file $2 --size $SIZE \
        --sessions 1 >$3 2>&1 &
    rpid=$!
    wait_for $3 READY 20 || { cat $3; fail replica-start "$3"; }
}
$F journal append $T/p1.journal --size $SIZE --generate 500 >$T/p3.out 2>$T/p3.err \
    || fail resync-offline-append "$(cat $T/p3.err)"
serve 7492 $T/r1.journal $T/r3.log
if timeout 60 $F journal append $T/p1.journal --size $SIZE --durability replicated \
    --replica rdma://127.0.0.1:7492 --device rxe0 --generate 200 --ack-every 50 \
    >$T/p4.out 2>$T/p4.err && grep -q "CaughtUp { from_seq: $N }" $T/p4.err; then
    ok resync-caught-up "$(cat $T/p4.err)"
else
    fail resync-caught-up "$(cat $T/p4.err)"
fi
wait $rpid || fail replica-exit "$(cat $T/r3.log)"
cat $T/r3.log
want=$((N + 700))
$F journal verify $T/p1.journal >$T/v3p 2>&1 || true
$F journal verify $T/r1.journal --expect-last-seq $want >$T/v3r 2>&1 || true
cat $T/v3p $T/v3r
ph=$(field head $T/v3p)
rh=$(field head $T/v3r)
if grep -q '^OK' $T/v3p && grep -q '^OK' $T/v3r && [ -n "$ph" ] && [ "$ph" = "$rh" ]; then
    ok resync-same-head "last=$want head=$rh"
else
    fail resync-same-head "primary_head=$ph replica_head=$rh"
fi
# Another journal's primary: refused, the replica's file untouched.
cp $T/r1.journal $T/r1.before
serve 7493 $T/r1.journal $T/r5.log
if timeout 60 $F journal append $T/p5.journal --size $SIZE --durability replicated \
    --replica rdma://127.0.0.1:7493 --device rxe0 --generate 10 >$T/p5.out 2>$T/p5.err; then
    fail diverged-refused "accepted: $(cat $T/p5.err)"
elif grep -qi 'diverged' $T/p5.err && cmp -s $T/r1.journal $T/r1.before; then
    ok diverged-refused "$(tail -1 $T/p5.err)"
else
    fail diverged-refused "$(cat $T/p5.err)"
fi
wait $rpid 2>/dev/null || true
serve 7494 $T/r1.journal $T/r6.log
timeout 60 $F journal append $T/p5.journal --size $SIZE --durability replicated \
    --replica rdma://127.0.0.1:7494 --device rxe0 --rebuild-replica --generate 10 \
    >$T/p6.out 2>$T/p6.err || true
wait $rpid 2>/dev/null || true
$F journal verify $T/p5.journal >$T/v6p 2>&1 || true
$F journal verify $T/r1.journal --expect-last-seq 10 >$T/v6r 2>&1 || true
ph=$(field head $T/v6p)
rh=$(field head $T/v6r)
if grep -q Rebuilt $T/p6.err && grep -q '^OK' $T/v6r && [ -n "$ph" ] && [ "$ph" = "$rh" ]; then
    ok rebuild-verifies "head=$rh"
else
    fail rebuild-verifies "$(cat $T/p6.err $T/v6p $T/v6r)"
fi
echo "RESULT time resync $(($(date +%s) - t0))s"

# --- kill: a dead replica is a typed error at the primary, acks stay acks -------------------
t0=$(date +%s)
# No timeout(1) wrapper: $! must be the replica itself (kill -9 below).
$F journal replica --listen 127.0.0.1:7491 --device rxe0 --file $T/r2.journal --size $SIZE \
    >$T/r2.log 2>&1 &
rpid=$!
wait_for $T/r2.log READY 20 || { cat $T/r2.log; fail replica2-start; }
timeout 90 $F journal append $T/p2.journal --size $SIZE --durability replicated \
    --replica rdma://127.0.0.1:7491 --device rxe0 --replica-timeout-ms 3000 \
    --generate 100000000 --ack-every 50 >$T/p2.out 2>$T/p2.err &
ppid=$!
# acks FILE: ACK lines so far (grep -c prints 0 and fails when there are none)
acks() { c=$(grep -c '^ACK' "$1" 2>/dev/null); echo "${c:-0}"; }
n=0
while [ "$(acks $T/p2.out)" -lt 5 ] && [ "$n" -lt 300 ]; do
    sleep 0.1
    n=$((n + 1))
done
acks_before=$(acks $T/p2.out)
[ "$acks_before" -ge 5 ] || { cat $T/r2.log $T/p2.err; fail primary-acked-before-kill "$acks_before"; }
k0=$(date +%s)
kill -9 $rpid
wait $ppid
prc=$?
k1=$(date +%s)
wait $rpid 2>/dev/null || true
last=$(sed -n 's/^ACK //p' $T/p2.out | tail -1)
echo "RESULT kill acks_before=$acks_before last_ack=$last primary_rc=$prc error_after=$((k1 - k0))s"
sed 's/^/RESULT primary stderr: /' $T/p2.err | tail -3
if [ "$prc" != 0 ] && [ "$prc" != 124 ] && grep -qi 'replica' $T/p2.err; then
    ok dead-replica-typed-error "rc=$prc"
else
    fail dead-replica-typed-error "rc=$prc $(tail -2 $T/p2.err)"
fi
if [ $((k1 - k0)) -le 20 ]; then
    ok dead-replica-no-hang "$((k1 - k0))s"
else
    fail dead-replica-no-hang "$((k1 - k0))s"
fi
$F journal verify $T/p2.journal >$T/v2p 2>&1 || true
$F journal verify $T/r2.journal >$T/v2r 2>&1 || true
cat $T/v2p $T/v2r
pl=$(sed -n 's/.*last seq \([0-9]*\).*/\1/p' $T/v2p | head -1)
rl=$(sed -n 's/.*last seq \([0-9]*\).*/\1/p' $T/v2r | head -1)
if [ -n "$last" ] && [ -n "$pl" ] && [ -n "$rl" ] && grep -q '^OK' $T/v2p && grep -q '^OK' $T/v2r \
    && [ "$pl" -ge "$last" ] && [ "$rl" -ge "$last" ]; then
    ok acked-survive-replica-kill "last_ack=$last primary_last=$pl replica_last=$rl"
else
    fail acked-survive-replica-kill "last_ack=$last primary_last=$pl replica_last=$rl"
fi
echo "RESULT time kill $(($(date +%s) - t0))s"

echo "RESULT failures=$failures"
[ "$failures" = 0 ]
