#!/usr/bin/env bash
# FastLane's main job on embedded defaults, for a fresh Debian 12 machine as root.
# Installs the system packages it needs, builds the release binary, then:
#   1. `fastlane serve` exports a 256 MiB RAM disk as a vhost-user-blk device;
#   2. a QEMU guest (TCG, -nic none) attaches to it, writes 8 MiB with O_DIRECT, reads it back,
#      compares checksums and does 2000 random 4 KiB reads;
#   3. the daemon stops (SIGTERM: flush, socket removed, per-queue latency .hlog written) and
#      `fastlane hist` prints the guest's request latencies as the daemon saw them;
#   4. a generated ITCH 5.0 feed (1M messages) is replayed through the software FPGA card into
#      order books, with the per-message latency histogram;
#   5. the serving path: `fastlane llm serve` on the random model (random weights: not a
#      language model), two tenants; a completion streamed with curl; the quiet tenant's TTFT
#      from /metrics; a request over the other tenant's rate refused with 429.
# Outputs land in target/run/.
#
# Options:
#   --serve   only run `fastlane serve` in the foreground (RAM disk; prints the QEMU command
#             line to attach a guest; Ctrl-C stops it and writes target/run/serve.hlog)
#   --skip-install   do not touch system packages
set -euo pipefail
cd "$(dirname "$0")/.."

serve_only=0
skip_install=0
for arg in "$@"; do
  case "$arg" in
    --serve) serve_only=1 ;;
    --skip-install) skip_install=1 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "run.sh: unknown option $arg (try --help)" >&2; exit 2 ;;
  esac
done

[ "$skip_install" = 1 ] || bash .ci/install-deps.sh
if ! command -v cargo >/dev/null; then
  echo "run.sh: cargo not found; FastLane needs a Rust toolchain (1.89 or newer) on PATH" >&2
  exit 1
fi
cargo build --release --locked -p fastlane-cli
target_dir=${CARGO_TARGET_DIR:-$PWD/target}
bin=$target_dir/release/fastlane
out=$PWD/target/run
mkdir -p "$out"
sock=$out/fastlane.sock

if [ "$serve_only" = 1 ]; then
  exec "$bin" serve --socket-path "$sock" --hlog "$out/serve.hlog"
fi

echo "== 1. fastlane serve (RAM disk) =="
rm -f "$out/serve.hlog"
"$bin" serve --socket-path "$sock" --backend mem:256M --hlog "$out/serve.hlog" 2> "$out/serve.log" &
serve_pid=$!
cleanup() { kill "$serve_pid" 2>/dev/null || true; }
trap cleanup EXIT
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
[ -S "$sock" ] || { cat "$out/serve.log" >&2; echo "run.sh: serve did not start" >&2; exit 1; }

echo "== 2. QEMU guest on the vhost-user-blk socket =="
bash tests/vm/run-guest.sh --script scripts/demo-guest.sh --modules "virtio_pci virtio_blk" \
  --mem 512M --timeout 180 --log "$out/guest.log" -- \
  -object memory-backend-memfd,id=mem,size=512M,share=on -machine memory-backend=mem \
  -chardev socket,id=c0,path="$sock" -device vhost-user-blk-pci,chardev=c0,num-queues=1 \
  | grep '^RESULT'

echo "== 3. daemon stopped; request latency as the daemon saw it =="
kill -TERM "$serve_pid"
wait "$serve_pid" || { cat "$out/serve.log" >&2; exit 1; }
trap - EXIT
grep -E "totals|queue 0:" "$out/serve.log" || true
"$bin" hist "$out/serve.hlog" --plot "$out/serve.svg"

echo "== 4. ITCH feed through the software FPGA card =="
"$bin" itch gen --messages 1000000 --symbols 16 --seed 1 --out "$out/feed.itch"
"$bin" itch replay "$out/feed.itch" --through-card --hlog "$out/itch-card.hlog"
"$bin" hist "$out/itch-card.hlog"
echo
echo "== 5. the serving path: fastlane llm serve (random:tiny) =="
cat > "$out/tenants.toml" <<'TOML'
[[tenant]]
name = "quiet"
keys = ["key-quiet"]
rpm = 600
burst = 10
max_concurrent = 4
tier = "interactive"
max_stream_seconds = 60

[[tenant]]
name = "flood"
keys = ["key-flood"]
rpm = 1
burst = 1
max_concurrent = 1
tier = "batch"
queue = 0
TOML
"$bin" llm serve --tenants "$out/tenants.toml" --listen 127.0.0.1:0 >"$out/llm.out" 2>"$out/llm.log" &
llm_pid=$!
trap 'kill "$llm_pid" 2>/dev/null || true' EXIT
for _ in $(seq 100); do grep -q listening "$out/llm.out" 2>/dev/null && break; sleep 0.1; done
url=$(sed -n 's/^listening on //p' "$out/llm.out")
echo "llm serve on $url (log: $out/llm.log)"
echo "-- a streamed completion (curl -N $url/v1/completions ...):"
curl -sN --max-time 60 -H "Authorization: Bearer key-quiet" "$url/v1/completions" \
  -d '{"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "stream": true}' >"$out/llm-stream.txt" || true
head -c 600 "$out/llm-stream.txt"; echo "... ($(grep -c '^data:' "$out/llm-stream.txt") events, ending in $(tail -n 2 "$out/llm-stream.txt" | head -n 1))"
for i in 1 2 3; do
  curl -s --max-time 60 -o /dev/null -H "Authorization: Bearer key-quiet" "$url/v1/completions" \
    -d '{"prompt": "hello", "max_tokens": 4}'
done
echo "-- the flood tenant's second request in its minute:"
curl -s --max-time 60 -o /dev/null -H "Authorization: Bearer key-flood" "$url/v1/completions" -d '{"prompt": "x", "max_tokens": 2}'
curl -s --max-time 60 -i -H "Authorization: Bearer key-flood" "$url/v1/completions" -d '{"prompt": "x", "max_tokens": 2}' \
  | grep -i -E "^HTTP|^retry-after|error" || true
echo "-- the quiet tenant's time to first token, from /metrics:"
curl -s "$url/metrics" | grep -E '^fastlane_llm_ttft_seconds_(sum|count)\{tenant="quiet"\}'
kill -TERM "$llm_pid"; wait "$llm_pid" || true
echo
echo "outputs in $out: serve.hlog serve.svg serve.log guest.log feed.itch itch-card.hlog llm.log"
