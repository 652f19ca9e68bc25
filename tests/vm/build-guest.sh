#!/usr/bin/env bash
# Build (or reuse) the guest cache for tests/vm/run-guest.sh:
#   CACHE/vmlinuz          the Debian 12 kernel that linux-image-amd64 depends on
#   CACHE/kernel.release   its release string (uname -r in the guest)
#   CACHE/modules/lib/modules/RELEASE/   its modules tree, with modules.dep (depmod -b)
#   CACHE/config           its .config (to tell built-in (=y) from modules (=m))
#   CACHE/busybox          a static busybox, the guest userland
#   CACHE/READY            written last; its presence makes later calls a no-op
# Network: only through apt (apt-get download). Safe to call concurrently (flock).
set -euo pipefail

usage() {
    cat <<'USAGE'
Usage: tests/vm/build-guest.sh [--refresh] [CACHE_DIR]

Downloads (apt-get download) the linux-image-6.1.0-*-amd64 package that linux-image-amd64
depends on, unpacks it with dpkg -x, runs depmod -b on its modules, and places vmlinuz, the
modules tree and a static busybox in CACHE_DIR (default: $FASTLANE_VM_CACHE, else
<repo>/target/vm). Does nothing when the cache is already complete, unless --refresh
(which re-resolves the kernel package, e.g. after a Debian point release).
USAGE
}

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$SCRIPT_DIR/../.." && pwd)

refresh=0
cache=""
while [ $# -gt 0 ]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --refresh) refresh=1 ;;
        -*) echo "build-guest: unknown option $1" >&2; usage >&2; exit 2 ;;
        *) cache=$1 ;;
    esac
    shift
done
cache=${cache:-${FASTLANE_VM_CACHE:-$REPO_ROOT/target/vm}}
mkdir -p "$cache"
cache=$(cd "$cache" && pwd)

log() { echo "build-guest: $*" >&2; }

complete() {
    [ -f "$cache/READY" ] && [ -f "$cache/vmlinuz" ] && [ -x "$cache/busybox" ] &&
        [ -f "$cache/kernel.release" ] &&
        [ -f "$cache/modules/lib/modules/$(cat "$cache/kernel.release")/modules.dep" ]
}

if [ "$refresh" = 0 ] && complete; then
    exit 0
fi

# One builder at a time; others wait (bounded) and then find the cache complete.
exec 9>"$cache/.lock"
if ! flock -w 900 9; then
    log "timed out waiting for the lock on $cache"
    exit 1
fi
if [ "$refresh" = 0 ] && complete; then
    exit 0
fi

for tool in apt-get apt-cache dpkg dpkg-deb depmod; do
    command -v "$tool" >/dev/null || { log "missing $tool (run .ci/install-deps.sh)"; exit 1; }
done

resolve_kernel_pkg() {
    apt-cache depends linux-image-amd64 2>/dev/null |
        awk '$1 == "Depends:" && $2 ~ /^linux-image-[0-9].*-amd64$/ {print $2; exit}'
}

kpkg=$(resolve_kernel_pkg || true)
if [ -z "$kpkg" ] && [ "$(id -u)" -eq 0 ]; then
    log "apt does not know linux-image-amd64 yet: apt-get update"
    timeout 600 apt-get update -qq >&2
    kpkg=$(resolve_kernel_pkg || true)
fi
if [ -z "$kpkg" ]; then
    log "cannot resolve the kernel package linux-image-amd64 depends on (apt-get update?)"
    exit 1
fi

stage=$(mktemp -d "$cache/.build.XXXXXX")
trap 'rm -rf "$stage"' EXIT
# apt-get download fetches as the unprivileged _apt user when it can write the directory.
if [ "$(id -u)" -eq 0 ] && id _apt >/dev/null 2>&1; then
    chown _apt "$stage"
fi

log "downloading $kpkg"
(cd "$stage" && timeout 900 apt-get download -q "$kpkg" >&2)
deb=$(ls "$stage"/"$kpkg"_*.deb)

log "unpacking $(basename "$deb")"
mkdir -p "$stage/root"
dpkg -x "$deb" "$stage/root"
rm -f "$deb"
release=$(ls "$stage/root/lib/modules")
if [ "$(printf '%s\n' "$release" | wc -l)" -ne 1 ] || [ ! -f "$stage/root/boot/vmlinuz-$release" ]; then
    log "unexpected layout in $kpkg (releases: $release)"
    exit 1
fi
depmod -b "$stage/root" "$release"

# Busybox: the installed static one if there is one, else the busybox-static package.
bb=""
if [ -x /bin/busybox ] && ! ldd /bin/busybox >/dev/null 2>&1; then
    bb=/bin/busybox
else
    log "no static /bin/busybox: downloading busybox-static"
    (cd "$stage" && timeout 600 apt-get download -q busybox-static >&2)
    mkdir -p "$stage/bb"
    dpkg -x "$(ls "$stage"/busybox-static_*.deb)" "$stage/bb"
    bb="$stage/bb/bin/busybox"
fi
if ldd "$bb" >/dev/null 2>&1; then
    log "$bb is not statically linked"
    exit 1
fi

# Move into place (under the lock), READY last.
rm -f "$cache/READY"
rm -rf "$cache/modules" "$cache/vmlinuz" "$cache/config" "$cache/busybox" "$cache/kernel.release"
mkdir -p "$cache/modules/lib"
mv "$stage/root/lib/modules" "$cache/modules/lib/modules"
mv "$stage/root/boot/vmlinuz-$release" "$cache/vmlinuz"
if [ -f "$stage/root/boot/config-$release" ]; then
    mv "$stage/root/boot/config-$release" "$cache/config"
fi
cp "$bb" "$cache/busybox"
chmod 755 "$cache/busybox"
echo "$release" >"$cache/kernel.release"
echo "$kpkg" >"$cache/kernel.package"
echo "$kpkg $release" >"$cache/READY"
log "ready: $cache (kernel $release)"
