#!/usr/bin/env bash
# FastLane's main job on embedded defaults, for a fresh Debian 12 machine as root.
# Installs the system packages it needs, builds the release binary, then:
#   1. `fastlane serve` exports a 256 MiB RAM disk as a vhost-user-blk device;
#   2. a QEMU guest (TCG, -nic none) attaches to it, writes 8 MiB with O_DIRECT, reads it back,
#      compares checksums and does 2000 random 4 KiB reads;
#   3. the daemon stops (SIGTERM: flush, socket removed, per-queue latency .hlog written) and
#      `fastlane hist` prints the guest's request latencies as the daemon saw them;
#   4. a generated ITCH 5.0 feed (1M messages) is replayed through the software FPGA card into
#      order books, with the per-message latency histogram.
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
cargo build --release --locked -p fastlane-tools
target_dir=${CARGO_TARGET_DIR:-$PWD/target}
bin=$target_dir/release/fastlane
out=$PWD/target/run
mkdir -p "$out"
sock=$out/fastlane.sock

if [ "$serve_only" = 1 ]; then
  exec "$bin" serve --socket "$sock" --hlog "$out/serve.hlog"
fi

echo "== 1. fastlane serve (RAM disk) =="
rm -f "$out/serve.hlog"
"$bin" serve --socket "$sock" --backend mem:256M --hlog "$out/serve.hlog" 2> "$out/serve.log" &
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
echo "outputs in $out: serve.hlog serve.svg serve.log guest.log feed.itch itch-card.hlog"
