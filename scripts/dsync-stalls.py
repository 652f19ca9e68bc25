#!/usr/bin/env python3
"""How a file system's durable writes stall under a steady load, with no journal in the way.

Writes one 4 KiB block with O_DIRECT and RWF_DSYNC (durable when the call returns) RATE times a
second for SECONDS into a 64 MiB file of written zeroes at PATH (created if missing; blocks
overwritten in turn, so no allocation), and prints the write latency's P50/P99/P99.9/max and
every write over 1 ms with its time into the run. On the dev VM the slow writes came in clusters
every ~5.15 s, which a `perf record -e sched:sched_switch` trace puts beside the VM's DAMON
reclaim (`kdamond.0`, 5 s aggregation) and balloon page reporting; with `relatime` every 4 ms tick
also adds an inode write to one durable write (docs/journal.md).

    scripts/dsync-stalls.py PATH [SECONDS 20] [RATE 2000]      # e.g. target/stalls.bin; pin it: taskset -c 1
"""
import mmap
import os
import sys
import time


def main():
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        return 2
    path = sys.argv[1]
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 20.0
    rate = float(sys.argv[3]) if len(sys.argv) > 3 else 2000.0
    if not (0 < seconds <= 3600 and 0 < rate <= 100_000):
        print("SECONDS must be in (0, 3600] and RATE in (0, 100000]", file=sys.stderr)
        return 2
    size = 64 << 20
    if not os.path.exists(path) or os.path.getsize(path) != size:
        with open(path, "wb") as f:
            for _ in range(64):
                f.write(b"\0" * (1 << 20))
            f.flush()
            os.fsync(f.fileno())
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    buf = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT needs
    buf.write(b"\x5a" * 4096)
    period = 1.0 / rate
    lat = []
    t0 = time.monotonic()
    i = 0
    while True:
        now = time.monotonic()
        if now - t0 > seconds:
            break
        due = t0 + i * period
        if now < due:
            time.sleep(max(0.0, due - now - 50e-6))
            continue
        s = time.monotonic()
        os.pwritev(fd, [buf], (i * 4096) % size, os.RWF_DSYNC)
        lat.append((s - t0, time.monotonic() - s))
        i += 1
    os.close(fd)
    ls = sorted(v for _, v in lat)
    pct = lambda q: ls[int(q * (len(ls) - 1))] * 1e6
    slow = [(round(t, 2), round(v * 1e3, 1)) for t, v in lat if v > 1e-3]
    print(f"{path}: {len(ls)} writes at {rate:g}/s for {seconds:g} s (load {os.getloadavg()[0]:.2f})")
    print(f"write latency µs: p50 {pct(.5):.0f}  p99 {pct(.99):.0f}  p99.9 {pct(.999):.0f}  max {ls[-1] * 1e6:.0f}")
    print(f"writes over 1 ms: {len(slow)}" + (f"  (time s, ms): {slow[:40]}" if slow else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
