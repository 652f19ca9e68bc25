#!/usr/bin/env bash
# Boot one throwaway QEMU (TCG) guest with a busybox initramfs, run a script in it as root,
# and exit with that script's exit status. See tests/vm/README.md and --help.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$SCRIPT_DIR/../.." && pwd)
PROG=run-guest

usage() {
    cat <<'USAGE'
Usage: tests/vm/run-guest.sh --script FILE [options] [-- extra qemu-system-x86_64 args]

Boots a Debian 12 kernel under qemu-system-x86_64 -accel tcg with a busybox initramfs, runs
FILE with busybox sh as root in the guest, powers off, and exits with FILE's exit status.

Options:
  --script FILE      shell script run by busybox sh inside the guest (required)
  --bin PATH         host binary copied to the guest's /bin, with the shared libraries
                     ldd lists (at their host paths). Repeatable.
  --lib PATH         host shared library copied to the same path in the guest, with its ldd
                     libraries (for dlopen'ed plugins, e.g. libibverbs providers). Repeatable.
  --file SRC:DST     extra file or directory copied (symlinks followed) to DST in the guest;
                     a DST ending in / is a directory to copy into. Repeatable.
  --modules "m1 m2"  kernel modules insmod'ed before the script, dependencies first (resolved
                     from modules.dep on the host; built-in ones are skipped). Repeatable.
  --mem SIZE         guest memory (-m), default 512M. Must equal the size of a
                     memory-backend given with -machine memory-backend=...
  --smp N            vCPUs, default 1
  --append ARGS      extra kernel command-line arguments
  --timeout SECONDS  hard bound on the whole QEMU run, default 120: QEMU is killed and the
                     run fails with status 124
  --log FILE         write the full console (boot messages included) to FILE
  --dmesg            print the guest's dmesg after the script (before the exit marker)
  --show-boot        also print the kernel boot messages to stdout (default: from init on)
  --cache DIR        guest cache (default $FASTLANE_VM_CACHE, else <repo>/target/vm); built
                     on demand by tests/vm/build-guest.sh
  -h, --help         this text
  --                 everything after it is passed to qemu-system-x86_64, e.g.
                     -object memory-backend-memfd,id=mem,size=512M,share=on
                     -machine memory-backend=mem -chardev socket,id=c0,path=SOCK
                     -device vhost-user-blk-pci,chardev=c0,num-queues=1

QEMU always runs with: -accel tcg -machine q35 -cpu max -nodefaults -nic none
-display none -monitor none -serial stdio -no-reboot (later -machine options merge, a later
-cpu wins). Guest console output goes to stdout (CRs stripped), from the line
FASTLANE-GUEST-INIT on. Results can be passed back as console lines (e.g. "RESULT key=val").
The guest's init prints FASTLANE-GUEST-EXIT=<status> run=<nonce> before powering off.

Exit status: the script's status; 124 if --timeout expired; 125 if the guest produced no
exit marker (QEMU error, kernel panic, ...) or a module failed to load; 2 on usage errors.
USAGE
}

die_usage() { echo "$PROG: $*" >&2; echo "Try --help." >&2; exit 2; }
log() { echo "$PROG: $*" >&2; }

script=""
bins=()
libs=()
files=()
modules=()
mem=512M
smp=1
append=""
timeout_s=120
logfile=""
dmesg=0
show_boot=0
cache=${FASTLANE_VM_CACHE:-$REPO_ROOT/target/vm}
qemu_extra=()

need_arg() { [ $# -ge 2 ] || die_usage "$1 needs an argument"; }
while [ $# -gt 0 ]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --script) need_arg "$@"; script=$2; shift ;;
        --bin) need_arg "$@"; bins+=("$2"); shift ;;
        --lib) need_arg "$@"; libs+=("$2"); shift ;;
        --file) need_arg "$@"; files+=("$2"); shift ;;
        --modules) need_arg "$@"; read -r -a _m <<<"$2"; modules+=("${_m[@]}"); shift ;;
        --mem) need_arg "$@"; mem=$2; shift ;;
        --smp) need_arg "$@"; smp=$2; shift ;;
        --append) need_arg "$@"; append="$append $2"; shift ;;
        --timeout) need_arg "$@"; timeout_s=$2; shift ;;
        --log) need_arg "$@"; logfile=$2; shift ;;
        --dmesg) dmesg=1 ;;
        --show-boot) show_boot=1 ;;
        --cache) need_arg "$@"; cache=$2; shift ;;
        --) shift; qemu_extra=("$@"); break ;;
        *) die_usage "unknown argument $1" ;;
    esac
    shift
done

[ -n "$script" ] || die_usage "--script is required"
[ -f "$script" ] || die_usage "no such script: $script"
if ! [[ "$timeout_s" =~ ^[0-9]+$ ]] || [ "$timeout_s" -eq 0 ]; then die_usage "bad --timeout $timeout_s"; fi
[[ "$smp" =~ ^[0-9]+$ ]] || die_usage "bad --smp $smp"
command -v qemu-system-x86_64 >/dev/null || { log "qemu-system-x86_64 missing (run .ci/install-deps.sh)"; exit 125; }
command -v cpio >/dev/null || { log "cpio missing (run .ci/install-deps.sh)"; exit 125; }

# The guest cache (kernel, modules, busybox), built on demand.
"$SCRIPT_DIR/build-guest.sh" "$cache" || { log "build-guest.sh failed"; exit 125; }
cache=$(cd "$cache" && pwd)
release=$(cat "$cache/kernel.release")
moddir="$cache/modules/lib/modules/$release"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/fastlane-guest.XXXXXX")
qemu_pidfile="$tmp/qemu.pid"
# shellcheck disable=SC2317 # invoked by the EXIT trap
cleanup() {
    if [ -s "$qemu_pidfile" ]; then
        kill "$(cat "$qemu_pidfile")" 2>/dev/null || true
    fi
    rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

root="$tmp/root"
# Merged /usr like the Debian 12 host (/bin, /sbin, /lib, /lib64 are links into /usr), so a
# library lands at one place whichever of its two paths ldd or a --lib/--file names.
mkdir -p "$root"/{usr/bin,usr/sbin,usr/lib64,usr/lib/modules/"$release",etc/fastlane,proc,sys,dev,tmp,run,root,mnt}
for d in bin sbin lib lib64; do ln -s "usr/$d" "$root/$d"; done

# Copy a file to the same absolute path under $root (symlinks followed).
copy_abs() {
    local src=$1 dst="$root$1"
    [ -e "$dst" ] && return 0
    mkdir -p "$(dirname "$dst")"
    cp -L "$src" "$dst"
}
# The shared libraries ldd lists for $1 (nothing for a static binary).
copy_ldd_libs() {
    local lib
    while read -r lib; do
        [ -n "$lib" ] && copy_abs "$lib"
    done < <(ldd "$1" 2>/dev/null | awk '/=> \// {print $3} /^[ \t]*\// {print $1}')
}

for b in "${bins[@]}"; do
    [ -f "$b" ] || { log "no such binary: $b"; exit 2; }
    # Without debug info: a debug build of `fastlane` is ~170 MB with it, which does not
    # unpack as an initramfs in a 512 MB guest.
    if command -v strip >/dev/null; then
        strip --strip-debug -o "$root/bin/$(basename "$b")" "$b"
    else
        cp -L "$b" "$root/bin/$(basename "$b")"
    fi
    chmod 755 "$root/bin/$(basename "$b")"
    copy_ldd_libs "$b"
done
for l in "${libs[@]}"; do
    [ -f "$l" ] || { log "no such library: $l"; exit 2; }
    l=$(realpath -s "$l")
    copy_abs "$l"
    copy_ldd_libs "$l"
done
for f in "${files[@]}"; do
    src=${f%%:*}
    dst=${f#*:}
    if [ "$src" = "$f" ] || [[ "$dst" != /* ]]; then
        die_usage "--file wants SRC:/ABS/DST, got $f"
    fi
    [ -e "$src" ] || { log "no such file: $src"; exit 2; }
    if [[ "$dst" == */ ]]; then
        mkdir -p "$root$dst"
    else
        mkdir -p "$(dirname "$root$dst")"
    fi
    cp -RL --preserve=mode "$src" "$root$dst"
done

# Busybox and its applet links (not over anything copied above).
cp "$cache/busybox" "$root/bin/busybox"
while read -r applet; do
    [ -e "$root/$applet" ] || [ -L "$root/$applet" ] || ln -s /bin/busybox "$root/$applet"
done < <("$cache/busybox" --list-full)

# Modules: resolve each name (dashes and underscores alike) through modules.dep, dependencies
# first (depth-first, post-order), skip built-ins, copy the .ko files and the index files.
: >"$root/etc/fastlane/modules"
if [ ${#modules[@]} -gt 0 ]; then
    if ! awk -v want="${modules[*]}" -v out="$root/etc/fastlane/modules" -v builtin="$moddir/modules.builtin" '
        function norm(s) { sub(/^.*\//, "", s); sub(/\.ko(\.[a-z]+)?$/, "", s); gsub(/-/, "_", s); return s }
        function visit(n,   i, k, d) {
            if (n in done) return
            if (n in visiting) return
            visiting[n] = 1
            k = split(deps[n], d, " ")
            for (i = 1; i <= k; i++) visit(norm(d[i]))
            done[n] = 1
            print n, path[n] > out
        }
        BEGIN { while ((getline line < builtin) > 0) isbuiltin[norm(line)] = 1 }
        {
            p = $1; sub(/:$/, "", p); n = norm(p); path[n] = p
            $1 = ""; deps[n] = $0
        }
        END {
            k = split(want, w, " ")
            for (i = 1; i <= k; i++) {
                n = norm(w[i])
                if (n in path) visit(n)
                else if (n in isbuiltin) printf "run-guest: module %s is built in\n", w[i] > "/dev/stderr"
                else { printf "run-guest: no module %s in kernel %s\n", w[i], rel > "/dev/stderr"; bad = 1 }
            }
            exit bad
        }' rel="$release" "$moddir/modules.dep"; then
        exit 2
    fi
    while read -r _name path; do
        mkdir -p "$(dirname "$root/lib/modules/$release/$path")"
        cp "$moddir/$path" "$root/lib/modules/$release/$path"
    done <"$root/etc/fastlane/modules"
fi
for idx in modules.dep modules.dep.bin modules.alias modules.alias.bin modules.builtin \
    modules.builtin.bin modules.builtin.modinfo modules.order modules.softdep \
    modules.symbols modules.symbols.bin modules.devname; do
    [ -f "$moddir/$idx" ] && cp "$moddir/$idx" "$root/lib/modules/$release/"
done

nonce="$(date +%s%N)-$$-$RANDOM"
console_level=4
cp "$SCRIPT_DIR/init.sh" "$root/init"
chmod 755 "$root/init"
cp "$script" "$root/etc/fastlane/script.sh"
cat >"$root/etc/fastlane/guest.env" <<ENV
NONCE=$nonce
RELEASE=$release
CONSOLE_LEVEL=$console_level
DMESG=$dmesg
ENV

initrd="$tmp/initrd.cpio"
(cd "$root" && find . | cpio -o -H newc -R 0:0 --quiet) >"$initrd"

console="$tmp/console.log"
: >"$console"
start_ns=$(date +%s%N)
set +e
timeout -k 10 "$timeout_s" qemu-system-x86_64 \
    -accel tcg -machine q35 -cpu max -m "$mem" -smp "$smp" \
    -nodefaults -nic none -display none -monitor none -serial stdio -no-reboot \
    -kernel "$cache/vmlinuz" -initrd "$initrd" \
    -append "console=ttyS0 panic=-1 $append" \
    -pidfile "$qemu_pidfile" \
    "${qemu_extra[@]}" </dev/null 2>"$tmp/qemu.stderr" |
    awk -v logf="$console" -v started="$show_boot" '
        { sub(/\r+$/, ""); print >> logf; fflush(logf) }
        !started && /^FASTLANE-GUEST-INIT / { started = 1 }
        started { print; fflush() }'
codes=("${PIPESTATUS[@]}")
set -e
end_ns=$(date +%s%N)
qemu_rc=${codes[0]}
elapsed=$(awk -v a="$start_ns" -v b="$end_ns" 'BEGIN { printf "%.2f", (b - a) / 1e9 }')

if [ -s "$tmp/qemu.stderr" ]; then
    sed 's/^/qemu: /' "$tmp/qemu.stderr" >&2
    sed 's/^/qemu: /' "$tmp/qemu.stderr" >>"$console"
fi
if [ -n "$logfile" ]; then
    cp "$console" "$logfile"
fi

status=$(sed -n "s/^.*FASTLANE-GUEST-EXIT=\([0-9]\{1,3\}\) run=$nonce\$/\1/p" "$console" | tail -n 1)
fail_tail() {
    log "$1; last 50 console lines:"
    tail -n 50 "$console" | sed 's/^/  | /' >&2
}
if [ "$qemu_rc" = 124 ] || [ "$qemu_rc" = 137 ]; then
    fail_tail "timed out after ${timeout_s}s (QEMU killed)"
    exit 124
fi
if [ -z "$status" ]; then
    fail_tail "no exit marker from the guest (QEMU exit status $qemu_rc, ${elapsed}s)"
    exit 125
fi
if [ "$qemu_rc" != 0 ]; then
    log "warning: QEMU exited with $qemu_rc after the marker"
fi
mod_fail=$(sed -n 's/^FASTLANE-GUEST-MODULE-FAILED=//p' "$console" | head -n 1)
if [ -n "$mod_fail" ]; then
    fail_tail "module failed to load: $mod_fail"
    exit 125
fi
log "guest exit status $status, boot-to-poweroff ${elapsed}s"
exit "$status"
