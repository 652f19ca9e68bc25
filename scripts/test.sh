#!/usr/bin/env bash
# The full FastLane test suite: what CI runs (.ci/run calls this) and what the README's
# "test" command is. Installs the system packages it needs (idempotent), then:
#   1. cargo fmt --check
#   2. cargo clippy --workspace --all-targets -- -D warnings
#   3. cargo test --workspace --all-targets  (unit, integration, QEMU-guest tests; criterion
#      benches run once in test mode so they keep compiling)
#   4. cargo check -p fastlane-kvswap --features cuda, doc tests, rustdoc with -D warnings (no broken
#      or private intra-doc links)
#   5. the loom models of fastlane-ring (RUSTFLAGS="--cfg loom", own target dir)
#   6. every fuzz target builds (each */fuzz crate, plain `cargo build` on stable, own target
#      dir target/fuzz; running them is scripts/fuzz-campaign.sh)
#   7. cargo deny check licenses bans sources (deny.toml); cargo-deny is built once with
#      `cargo install` when missing (about 7 minutes on 2 cores, 12 with other builds running)
# Options: --skip-install  do not touch system packages or install cargo-deny (a machine
#                          already set up; without cargo-deny step 7 is skipped, saying so).
# The advisories check needs the advisory database from the network and is not run here.
set -euo pipefail
cd "$(dirname "$0")/.."

skip_install=0
for arg in "$@"; do
  case "$arg" in
    --skip-install) skip_install=1 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "test.sh: unknown option $arg" >&2; exit 2 ;;
  esac
done

if [ "$skip_install" = 0 ]; then
  bash .ci/install-deps.sh
fi
deny_version=0.20.2
if ! command -v cargo >/dev/null; then
  echo "test.sh: cargo not found; FastLane needs a Rust toolchain (1.89 or newer) on PATH" >&2
  exit 1
fi

step() { printf '\n=== %s ===\n' "$*"; }
start=$(date +%s)
# A fresh build of everything below leaves 3.6 GB in target/ (2.7 GB of it target/debug: line
# tables only, no debug info in dependencies; with full debug info everywhere a CI run ran
# out of disk in the fuzz step). Say the room there was at the start and at the end.
disk() { df -h --output=avail,used,target . | tail -1 | awk '{print "disk: " $1 " free (target/: " d ")"}' d="$(du -sh target 2>/dev/null | cut -f1)"; }
disk

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy (-D warnings)"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "cargo test"
cargo test --workspace --all-targets --locked

step "kvswap cuda feature compiles (no GPU here; it is exercised only where one exists)"
cargo check -p fastlane-kvswap --features cuda --locked

step "doc tests"
cargo test --workspace --doc --locked

step "rustdoc (-D warnings)"
# Two invocations: the `fastlane` binary (fastlane-cli) and the `fastlane` library write the
# same target/doc/fastlane, and documenting both in one invocation races on removing it (a
# known cargo bug, issue 6313: it failed a run here). One after the other, both are checked.
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --exclude fastlane-cli --no-deps --locked
RUSTDOCFLAGS="-D warnings" cargo doc -p fastlane-cli --no-deps --locked

step "loom models of fastlane-ring"
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom \
  cargo test -p fastlane-ring --test loom --release --locked

step "fuzz targets build"
# Plain `cargo build` of each fuzz crate: libfuzzer-sys builds on stable (it compiles libFuzzer
# with the C++ compiler), so this needs neither nightly nor cargo-fuzz, and a target that no
# longer compiles or links fails here. The crates are outside the workspace (their own
# [workspace], lock files ignored), hence no --locked; target/fuzz keeps the main cache intact.
# No debug info there: only whether they build is checked (it halves that directory).
for manifest in */fuzz/Cargo.toml; do
  CARGO_PROFILE_DEV_DEBUG=false CARGO_TARGET_DIR=target/fuzz cargo build --manifest-path "$manifest" --bins
done

step "cargo deny check licenses bans sources"
if ! command -v cargo-deny >/dev/null && [ "$skip_install" = 0 ]; then
  cargo install --locked "cargo-deny@$deny_version"
fi
if command -v cargo-deny >/dev/null; then
  cargo deny --workspace --log-level error check licenses bans sources
else
  echo "SKIPPED: cargo-deny is not installed (--skip-install); cargo install --locked cargo-deny@$deny_version"
fi

disk
printf '\nall checks passed in %ss\n' "$(( $(date +%s) - start ))"
