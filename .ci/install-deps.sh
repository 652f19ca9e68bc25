#!/usr/bin/env bash
# Idempotent install of the system packages FastLane's tests need (Debian 12 "bookworm").
# Used by CI and by the commands in tests/vm/README.md. Run as root (or with sudo).
# Network: only through apt and its configured sources.
set -euo pipefail

# The package list lives here, in one place, one package per line with the reason.
PKGS=(
    qemu-system-x86     # qemu-system-x86_64: the TCG guests of tests/vm (vhost-user-blk, rxe, VFIO)
    qemu-system-common  # qemu-storage-daemon (Debian 12 ships it here): reference vhost-user-blk backend
    qemu-utils          # qemu-img; kept at the same version as qemu-system-common (see below)
    busybox-static      # /bin/busybox: the whole userland of the guest initramfs
    cpio                # packs the guest initramfs (newc format)
    kmod                # depmod (modules.dep for the unpacked guest kernel), modinfo
    libibverbs-dev      # fastlane-rdma: rdma-sys links libibverbs (pkg-config file, headers)
    librdmacm-dev       # fastlane-rdma: rdma-sys's build script also requires librdmacm
    libclang-dev        # fastlane-rdma: bindgen (in rdma-sys's build script) needs libclang
    pkg-config          # fastlane-rdma: rdma-sys finds the two libraries with it
    g++                 # the fuzz crates: libfuzzer-sys compiles libFuzzer (C++) (scripts/test.sh);
                        # fastlane-journal-c/tests/c_producer.rs compiles the header as C++
    gcc                 # /usr/bin/cc: fastlane-journal-c/tests/c_producer.rs compiles and links a C producer
    ibverbs-providers   # the rxe provider (librxe-rdmav34.so + rxe.driver) copied into the guest
    iproute2            # /usr/bin/rdma: creates rxe0 inside the guest
    perftest            # ib_write_lat / ib_write_bw: the peer of `fastlane rdma bench`
    python3             # /usr/bin/python3: the fastlane_kv client's tests (fastlane-cli/tests/kv_python.rs)
    python3-numpy       # fastlane-llm: the independent reference forward pass (/usr/bin/python3)
    python3-venv        # fastlane-cli/tests/llm_openai_sdk.rs: a venv for the official openai SDK
    python3-pip         # ... and pip, which installs the SDK into it
    libopenblas0-pthread # numpy's BLAS: the GEMM peer of `fastlane llm bench` (not reference BLAS)
    binutils            # strip: guest binaries go into the initramfs without debug info
    curl                # the real HTTP client of the `fastlane llm serve` tests and of run.sh
    prometheus          # a real scrape of `fastlane llm serve` checks every dashboard query
    redis-server        # kvswap's cluster tier tests: six redis-server processes form a real Redis Cluster
    redis-tools         # redis-cli --cluster create forms that cluster (the packaged service on 6379 is unused)
    openssl             # kvswap's TLS cluster tests: the openssl command makes the test CA and node certificate
    systemd             # systemd-socket-activate: fastlane-cli/tests/serve_systemd.rs and vm_blk.rs start
                        # `fastlane serve` with a socket passed as systemd passes it (LISTEN_FDS)
    fio                 # the guest-side load generator and verifier of the vhost-user-blk guest tests
    nats-server         # fastlane-journal-export tests: three nats-server processes form a real JetStream
                        # cluster on loopback (Debian 12 ships 2.9.10; the packaged service is unused)
)

SUDO=()
if [ "$(id -u)" -ne 0 ]; then
    SUDO=(sudo)
fi

export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update

# qemu-system-x86 needs qemu-system-common of its own version, and qemu-system-common 7.2 is
# broken by a newer qemu-utils (>= 8.0 took qemu-storage-daemon over). Some images carry a
# qemu-utils from backports whose source is gone; pin qemu-utils to the qemu-system-common
# candidate so apt can resolve (a no-op on a plain Debian 12 machine).
qemu_ver=$(apt-cache policy qemu-system-common | awk '/Candidate:/ {print $2; exit}')
if [ -z "$qemu_ver" ] || [ "$qemu_ver" = "(none)" ]; then
    echo "install-deps: no installable qemu-system-common in the configured apt sources" >&2
    exit 1
fi
args=()
for p in "${PKGS[@]}"; do
    if [ "$p" = qemu-utils ]; then
        args+=("qemu-utils=$qemu_ver")
    else
        args+=("$p")
    fi
done

"${SUDO[@]}" apt-get install -y --no-install-recommends --allow-downgrades "${args[@]}"
