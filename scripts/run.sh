#!/usr/bin/env bash
# FastLane's main job on an embedded default, for a fresh Debian 12 machine as root:
# installs the system packages it needs, builds the release binary, and runs
#   fastlane bench ring --hlog target/run/ring.hlog   (the SPSC ring against the atomic floor)
#   fastlane hist target/run/ring.hlog --plot target/run/ring.svg
# Extra arguments are passed to `fastlane bench ring` (try --help).
set -euo pipefail
cd "$(dirname "$0")/.."

bash .ci/install-deps.sh
if ! command -v cargo >/dev/null; then
  echo "run.sh: cargo not found; FastLane needs a Rust toolchain (1.85 or newer) on PATH" >&2
  exit 1
fi
cargo build --release --locked -p fastlane-tools
bin=target/release/fastlane
mkdir -p target/run
"$bin" bench ring --hlog target/run/ring.hlog "$@"
echo
"$bin" hist target/run/ring.hlog --plot target/run/ring.svg
echo "percentile plot: target/run/ring.svg"
