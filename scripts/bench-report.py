#!/usr/bin/env python3
"""Ratio tables from criterion's saved estimates, for BENCHMARKS.md.

usage: python3 scripts/bench-report.py ring [--target-dir DIR] [--json]

Reads <target>/criterion/<group>/<peer>/new/estimates.json (written by `cargo bench --bench
ring`) and prints, per group, each peer's median time per item and its ratio to the reference
peer of that group: rtrb for the throughput groups, the bare atomic ping-pong for latency.
Also writes the table as benches/results/ring/<date>-<commit>.json (scripts/bench_results.py;
--no-save skips that).
"""
import argparse
import json
import os
import sys

GROUPS = {
    "ring": [
        ("tput_u64_single", "rtrb", "throughput"),
        ("tput_rec64_single", "rtrb", "throughput"),
        ("tput_u64_batch", "rtrb", "throughput"),
        ("tput_rec64_batch", "rtrb", "throughput"),
        ("pingpong_u64", "atomic", "latency"),
    ],
}


def median_ns(base, group, peer):
    path = os.path.join(base, group, peer, "new", "estimates.json")
    try:
        with open(path) as f:
            est = json.load(f)
    except FileNotFoundError:
        return None
    return est["median"]["point_estimate"]


def save(suite, groups):
    """The same table as benches/results/<suite>/<date>-<commit>.json."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_results

    rows = []
    for g in groups:
        for r in g["rows"]:
            if g["kind"] == "throughput":
                rows.append(bench_results.row(f"{g['group']} {r['peer']}", r["ns_per_item"], "ns/item",
                                              g["reference"], None, r["throughput_vs_" + g["reference"]], None,
                                              ratio_is="throughput / reference's (criterion medians)"))
            else:
                rows.append(bench_results.row(f"{g['group']} {r['peer']}", r["round_trip_ns"], "ns round trip",
                                              g["reference"], None, r["latency_vs_" + g["reference"]], None,
                                              ratio_is="round trip / reference's (criterion medians)"))
    bench_results.write(suite, f"cargo bench --bench {suite} && python3 scripts/bench-report.py {suite}", rows,
                        raw=groups, notes="criterion, one peer after another (not interleaved)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("suite", choices=sorted(GROUPS))
    ap.add_argument("--target-dir", default=os.environ.get("CARGO_TARGET_DIR", "target"))
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    ap.add_argument("--no-save", action="store_true", help="do not write benches/results/")
    args = ap.parse_args()
    base = os.path.join(args.target_dir, "criterion")
    if not os.path.isdir(base):
        sys.exit(f"bench-report: no criterion results under {base}; run cargo bench first")

    out = []
    for group, ref, kind in GROUPS[args.suite]:
        gdir = os.path.join(base, group)
        if not os.path.isdir(gdir):
            continue
        peers = sorted(p for p in os.listdir(gdir) if os.path.isdir(os.path.join(gdir, p)) and p != "report")
        ref_ns = median_ns(base, group, ref)
        rows = []
        for peer in peers:
            ns = median_ns(base, group, peer)
            if ns is None:
                continue
            if kind == "throughput":
                # Time per item; the ratio is the peer's throughput relative to the reference.
                ratio = ref_ns / ns if ref_ns else None
                rows.append({"peer": peer, "ns_per_item": ns, "mitems_per_s": 1e3 / ns,
                             "throughput_vs_" + ref: ratio})
            else:
                # Round trip; one-way is half. The ratio is latency relative to the floor.
                ratio = ns / ref_ns if ref_ns else None
                rows.append({"peer": peer, "round_trip_ns": ns, "one_way_ns": ns / 2,
                             "latency_vs_" + ref: ratio})
        out.append({"group": group, "kind": kind, "reference": ref, "rows": rows})

    if not args.no_save:
        save(args.suite, out)
    if args.json:
        json.dump(out, sys.stdout, indent=2)
        print()
        return
    for g in out:
        print(f"\n{g['group']}  (reference: {g['reference']})")
        if g["kind"] == "throughput":
            print(f"  {'peer':<18} {'ns/item':>9} {'Mitems/s':>9} {'x ' + g['reference']:>10}")
            for r in sorted(g["rows"], key=lambda r: r["ns_per_item"]):
                ratio = r["throughput_vs_" + g["reference"]]
                print(f"  {r['peer']:<18} {r['ns_per_item']:>9.2f} {r['mitems_per_s']:>9.1f} {ratio:>10.2f}")
        else:
            print(f"  {'peer':<18} {'rtt ns':>9} {'1-way ns':>9} {'x ' + g['reference']:>10}")
            for r in sorted(g["rows"], key=lambda r: r["round_trip_ns"]):
                ratio = r["latency_vs_" + g["reference"]]
                print(f"  {r['peer']:<18} {r['round_trip_ns']:>9.1f} {r['one_way_ns']:>9.1f} {ratio:>10.2f}")


if __name__ == "__main__":
    main()
