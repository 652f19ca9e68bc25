#!/usr/bin/env python3
"""Write one benchmark run as benches/results/<component>/<date>-<commit>.json.

The benchmark scripts call this at the end of a run (format: benches/results/README.md):

  python3 scripts/bench_results.py blk DIR COMMAND...          # scripts/bench-blk.sh's --out DIR
  python3 scripts/bench_results.py vfio-nvme CONSOLE_LOG COMMAND...
  python3 scripts/bench_results.py rdma GUEST_LOG COMMAND...         # prints the table too
  python3 scripts/bench_results.py journal RUNS_TSV COMMAND...     # prints the table too
  python3 scripts/bench_results.py kv-remote GUEST_LOG COMMAND...   # prints the table too
  python3 scripts/bench_results.py cluster TIER_JSON PREFIX_JSON MISS_JSON COMMAND...  # scripts/bench-cluster.sh
  python3 scripts/bench_results.py kv-tiers DIR LOAD_BEFORE LOAD_AFTER COMMAND...  # scripts/bench-kv.sh
  python3 scripts/bench_results.py journal-replicated GUEST_LOG COMMAND...  # prints the table too

and scripts/bench-report.py imports `write`. Date: `date +%F`; commit: `git rev-parse --short
HEAD`; a label, when given, is appended (`<date>-<commit>-<label>.json`); BENCH_RESULTS_DIR
overrides the folder. Prints the path written to stderr.
"""
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _out(cmd):
    try:
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def write(component, command, rows, raw=None, load=None, notes=None, label=None):
    """Write the run; return the path. `rows`: [{case, value, unit, peer, ratio, target, ...}]."""
    date = _out(["date", "+%F"]) or "unknown-date"
    commit = _out(["git", "rev-parse", "--short", "HEAD"]) or "unknown"
    dirty = bool(_out(["git", "status", "--porcelain", "--untracked-files=no"]))
    base = os.environ.get("BENCH_RESULTS_DIR") or os.path.join(ROOT, "benches", "results")
    folder = os.path.join(base, component)
    os.makedirs(folder, exist_ok=True)
    stem = f"{date}-{commit}" + (f"-{label}" if label else "")
    path = os.path.join(folder, f"{stem}.json")
    n = 2
    while os.path.exists(path):
        path = os.path.join(folder, f"{stem}-{n}.json")
        n += 1
    with open("/proc/loadavg") as f:
        load_now = " ".join(f.read().split()[:3])
    doc = {
        "schema": 1,
        "component": component,
        "date": date,
        "commit": commit,
        "commit_dirty": dirty,
        "command": command,
        "machine": f"{os.uname().sysname} {os.uname().release}, {os.cpu_count()} CPUs",
        "load": load if load is not None else {"when_written": load_now},
        "notes": notes,
        "rows": rows,
        "raw": raw,
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, ensure_ascii=False)
        f.write("\n")
    print(f"results: {os.path.relpath(path, ROOT)}", file=sys.stderr)
    return path


def row(case, value, unit, peer=None, peer_value=None, ratio=None, target=None, **extra):
    r = {"case": case, "value": value, "unit": unit, "peer": peer, "peer_value": peer_value,
         "ratio": ratio, "target": target}
    r.update(extra)
    return r


def _env_load(env_txt):
    load = {}
    try:
        for line in open(env_txt):
            for key in ("before", "after"):
                if line.startswith(f"load {key}: "):
                    load[key] = line.split(": ", 1)[1].strip()
    except FileNotFoundError:
        pass
    return load or None


def blk(out_dir, command):
    """scripts/bench-blk.sh: the three `fastlane bench blk --json` reports; ratios B / qsd."""
    reports = {}
    for name in ("qsd", "fastlane-file", "fastlane-mem"):
        p = os.path.join(out_dir, f"{name}.json")
        if os.path.exists(p):
            with open(p) as f:
                reports[name] = json.load(f)
    qsd = {c["name"]: c for c in reports.get("qsd", {}).get("cases", [])}
    rows = []
    for name in ("fastlane-file", "fastlane-mem"):
        for c in reports.get(name, {}).get("cases", []):
            q = qsd.get(c["name"])
            if c["qd"] == 1:
                # QD1 P50: the in-flight issue's targets (file: 0.12, mem: 0.07 of the peer's);
                # P99: at most half.
                p50_target = {"fastlane-file": "<= 0.12", "fastlane-mem": "<= 0.07"}[name]
                for key, target in (("p50_ns", p50_target), ("p99_ns", "<= 0.50")):
                    v, pv = c["latency"][key], q["latency"][key] if q else None
                    rows.append(row(f"{name} {c['name']} {key[:-3].upper()}", v, "ns", "qemu-storage-daemon",
                                    pv and {"value": pv, "unit": "ns"}, v / pv if pv else None, target))
            else:
                v, pv = c["iops"], q["iops"] if q else None
                rows.append(row(f"{name} {c['name']} IOPS", v, "IOPS", "qemu-storage-daemon",
                                pv and {"value": pv, "unit": "IOPS"}, v / pv if pv else None, ">= 2.00"))
    write("vhost-blk", command, rows, raw=reports, load=_env_load(os.path.join(out_dir, "env.txt")))


def vfio_nvme(console_log, command):
    """scripts/bench-vfio-nvme.sh: the guest's two `fastlane bench nvme --json` reports
    (BENCHJSON vfio / kernel lines), VFIO against the kernel's driver case by case. Prints the
    table; fails when a report is missing."""
    reports = {}
    for line in open(console_log, errors="replace"):
        if line.startswith("BENCHJSON "):
            _, label, body = line.split(" ", 2)
            reports[label] = {c["case"].split("_", 1)[1]: c for c in json.loads(body)["cases"]}
    missing = {"vfio", "kernel"} - set(reports)
    if missing:
        sys.exit(f"bench_results.py: no `bench nvme --json` report for {sorted(missing)} in {console_log}")
    rows = []
    print(f"{'case':<16} {'VFIO P50':>10} {'kernel P50':>11} {'kernel/VFIO':>12} {'VFIO IOPS':>10} {'kernel IOPS':>12} {'VFIO/kernel':>12}")
    for case, v in sorted(reports["vfio"].items()):
        k = reports["kernel"].get(case)
        p50, iops = float(v["latency"]["p50_ns"]), float(v["iops"])
        kp50, kiops = (float(k["latency"]["p50_ns"]), float(k["iops"])) if k else (None, None)
        r50 = kp50 / p50 if kp50 else None
        riops = iops / kiops if kiops else None
        print(f"{case:<16} {p50:>8.0f}ns {kp50 or float('nan'):>9.0f}ns {r50 or float('nan'):>12.2f} "
              f"{iops:>10.0f} {kiops or float('nan'):>12.0f} {riops or float('nan'):>12.2f}")
        rows.append(row(case + " P50", p50, "ns", "kernel nvme + io_uring", kp50 and {"value": kp50, "unit": "ns"},
                        r50, None, ratio_is="kernel P50 / VFIO P50"))
        rows.append(row(case + " IOPS", iops, "IOPS", "kernel nvme + io_uring", kiops and {"value": kiops, "unit": "IOPS"},
                        riops, None, ratio_is="VFIO IOPS / kernel IOPS"))
    write("vfio-nvme", command, rows, raw={"reports": reports})


def _median(v):
    """The median (the mean of the two middle values for an even count); NaN when empty."""
    return statistics.median(v) if v else float("nan")


def rdma(guest_log, command):
    """scripts/bench-rdma.sh: per round, perftest's numbers (RESULT perftest_lat / perftest_bw
    records, which the guest script takes from perftest's own output) and `fastlane rdma bench
    --json`'s report (its BENCHJSON line); the median over the rounds of each, and fastlane /
    perftest. Prints the table."""
    lat = {}  # size -> {"perftest": [...], "fastlane": [...]}
    bw = {"perftest": [], "fastlane": []}
    results = []
    for line in open(guest_log, errors="replace"):
        if not line.startswith("RESULT "):
            continue
        results.append(line.rstrip("\n"))
        f = line.split()
        if f[1].startswith("fastlane_"):
            continue
        kv = dict(x.split("=", 1) for x in f[2:] if "=" in x)
        who, _, what = f[1].partition("_")
        try:
            if what == "lat" and who in ("perftest", "fastlane"):
                lat.setdefault(int(kv["size"]), {"perftest": [], "fastlane": []})[who].append(float(kv["p50_ns"]))
            elif what == "bw" and who in ("perftest", "fastlane"):
                bw[who].append(float(kv["bytes_per_s"]))
        except (KeyError, ValueError):
            sys.exit(f"bench_results.py: malformed line in {guest_log}: {line.strip()}")
    for line in open(guest_log, errors="replace"):
        if line.startswith("BENCHJSON fastlane "):
            rep = json.loads(line.split(" ", 3)[3])
            for x in rep["latency"]:
                lat.setdefault(x["size_bytes"], {"perftest": [], "fastlane": []})["fastlane"].append(
                    float(x["one_way"]["p50_ns"]))
            bw["fastlane"].append(float(rep["bandwidth"]["bytes_per_s"]))
    if not lat or not bw["fastlane"]:
        sys.exit(f"bench_results.py: no `fastlane rdma bench` report (BENCHJSON) in {guest_log}")
    rows = []
    print(f"{'RDMA WRITE (rxe, TCG)':<22} {'perftest':>14} {'fastlane':>14} {'ratio':>8} {'target':>8}")
    for size in sorted(lat):
        p, f = _median(lat[size]["perftest"]), _median(lat[size]["fastlane"])
        r = f / p if p and p == p else None
        case = f"latency p50 {size} B"
        print(f"{case:<22} {p / 1e3:>11.2f} us {f / 1e3:>11.2f} us "
              f"{'n/a' if r is None else f'{r:.3f}':>8} {'<=1.05':>8} "
              f"{'perftest gave no number' if r is None else 'ok' if r <= 1.05 else 'MISSED'}")
        rows.append(row(case, f / 1e3, "µs", "perftest",
                        None if r is None else {"value": p / 1e3, "unit": "µs"}, r, "<= 1.05"))
    p, f = _median(bw["perftest"]), _median(bw["fastlane"])
    r = f / p if p and p == p else None
    print(f"{'bandwidth 64 KiB':<22} {p / 2**20:>10.1f} MiB/s {f / 2**20:>8.1f} MiB/s "
          f"{'n/a' if r is None else f'{r:.3f}':>8} {'>=0.95':>8} "
          f"{'' if r is None else 'ok' if r >= 0.95 else 'MISSED'}")
    rows.append(row("bandwidth 64 KiB", f / 2**20, "MiB/s", "perftest",
                    None if r is None else {"value": p / 2**20, "unit": "MiB/s"}, r, ">= 0.95"))
    write("rdma", command, rows, raw={"result_lines": results})


def journal(runs_tsv, command):
    """scripts/bench-journal.sh: RUNS_TSV lists its runs (round, config, path of the run's
    `fastlane journal bench --json`). Prints one row per run and, per config, the median and
    worst ratios over the rounds; fails on a run without its JSON."""
    runs = []
    for line in open(runs_tsv):
        r, cfg, path = line.rstrip("\n").split("\t")
        with open(path) as f:
            runs.append((int(r), cfg, json.load(f)))
    if not runs:
        sys.exit(f"bench_results.py: no runs listed in {runs_tsv}")
    us = lambda v: v / 1e3  # noqa: E731
    print(f"{'round':<5} {'config':<48} {'ack p50':>8} {'ack p99':>8} {'p99.9':>8} {'floor50':>8} "
          f"{'floor99':>8} {'x p50':>6} {'x p99':>6} {'nojrn99':>9} {'x nojrn':>8}")
    rows, by_cfg = [], {}
    for r, cfg, d in runs:
        a, fl, nj = d["ack"], d["pwrite_fdatasync"], d["same_load_no_journal"]
        x50, x99 = d["ack_over_floor_p50"], d["ack_over_floor_p99"]
        xn = d["ack_over_no_journal_p99"]
        print(f"{r:<5} {cfg:<48} {us(a['p50_ns']):>8.0f} {us(a['p99_ns']):>8.0f} {us(a['p999_ns']):>8.0f} "
              f"{us(fl['p50_ns']):>8.0f} {us(fl['p99_ns']):>8.0f} {x50:>6.2f} {x99:>6.2f} "
              f"{us(nj['p99_ns']):>9.0f} {xn:>8.2g}")
        by_cfg.setdefault(cfg, []).append((x99, xn))
        rows.append(row(f"round {r}, {cfg}: ack P99", us(a["p99_ns"]), "µs", "pwrite + fdatasync, idle (floor) P99",
                        {"value": us(fl["p99_ns"]), "unit": "µs"}, x99, "<= 1.2"))
        rows.append(row(f"round {r}, {cfg}: ack P50", us(a["p50_ns"]), "µs", "pwrite + fdatasync, idle (floor) P50",
                        {"value": us(fl["p50_ns"]), "unit": "µs"}, x50, None))
        rows.append(row(f"round {r}, {cfg}: ack P99 vs no journal", us(a["p99_ns"]), "µs",
                        "pwrite + fdatasync per record, same load, no journal: P99",
                        {"value": us(nj["p99_ns"]), "unit": "µs"}, xn, None, ack_p99_9_us=us(a["p999_ns"])))
    print("(latencies in µs; x = ack / floor of the same run; nojrn99 = P99 of the same load with one")
    print(" pwrite+fdatasync per record and no journal; x nojrn = ack P99 / nojrn99)")

    for title, k, fmt in (("ack P99 / floor P99", 0, "6.2f"), ("ack P99 / P99 of the same load without a journal", 1, "8.2g")):
        print(f"per config: {title}, median and worst")
        for cfg, v in by_cfg.items():
            xs = [x[k] for x in v]
            print(f"  {cfg:<48} median {_median(xs):{fmt}}x  worst {max(xs):{fmt}}x  (n={len(xs)})")
    write("journal", command, rows, raw={"runs": [{"round": r, "config": c, "bench": d} for r, c, d in runs]})


def _kv_bandwidth_rows(report, suffix=""):
    """The rows of one `fastlane kv bench --json` report's bandwidth cases (GiB/s)."""
    rows = []
    for b in report["bandwidth"]:
        peer = b.get("peer_bytes_per_s")
        rows.append({"case": b["case"] + suffix, "value": b["ours_bytes_per_s"] / 2**30, "unit": "GiB/s",
                     "peer": peer and peer / 2**30, "ratio": b.get("ours_vs_peer"),
                     "target": ">= 0.8" if peer else None})
    return rows


def kv_remote(guest_log, command):
    """scripts/bench-kv-remote.sh: the guest's `fastlane kv bench --json` report (its BENCHJSON
    line) and RESULT lines. Prints the bandwidth cases; fails when the report is missing."""
    reports = [json.loads(l.split(" ", 1)[1]) for l in open(guest_log, errors="replace")
               if l.startswith("BENCHJSON ")]
    results = [l.rstrip("\n") for l in open(guest_log, errors="replace") if l.startswith("RESULT ")]
    if not reports:
        sys.exit(f"bench_results.py: no BENCHJSON report in {guest_log}")
    rows = _kv_bandwidth_rows(reports[-1])
    print(f"{'case':<40} {'GiB/s':>8} {'peer GiB/s':>11} {'ratio':>7}")
    for r in rows:
        peer = "-" if r["peer"] is None else f"{r['peer']:.2f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        print(f"{r['case']:<40} {r['value']:>8.2f} {peer:>11} {ratio:>7}")
    write("kvswap", command, rows, raw={"report": reports[-1], "result_lines": results})


def cluster(tier_json, prefix_json, miss_json, command):
    """scripts/bench-cluster.sh: `fastlane kv bench-cluster --out` and `fastlane llm bench
    --scenario prefix-cluster|prefix-miss --out`, one file each (labels cluster-tier,
    cluster-prefix, cluster-miss)."""
    with open(tier_json) as f:
        tier = json.load(f)
    rows = []
    for o in tier["ops"]:
        case = f"{o['op']} {tier['block_bytes']} B blocks, batches of {tier['blocks_per_batch']}"
        rows.append(row(case, o["ours_gb_per_s"], "GB/s", f"redis-benchmark {o['peer_op']} ({tier['peer']['command']})",
                        {"value": o["peer_gb_per_s"], "unit": "GB/s"}, o["ratio"], o["target"],
                        ours_blocks_per_s=o["ours_blocks_per_s"], peer_blocks_per_s=o["peer_blocks_per_s"],
                        ratio_min=o["ratio_min"], ratio_max=o["ratio_max"]))
    write("kvswap", command, rows, raw=tier, load={"before": tier["load_before"], "after": tier["load_after"]},
          notes="ratio: ours/peer values per second, median over rounds of each round's ratio", label="cluster-tier")
    with open(prefix_json) as f:
        pc = json.load(f)
    r = pc["result"]
    shape = f"{r['shared_tokens']}+{r['suffix_tokens']} tokens, {pc['model']}"
    rows = [
        row(f"TTFT, prefix from the cluster tier ({shape})", r["cluster_ttft_ms"], "ms", "prefix computed (on no tier)",
            {"value": r["computed_ttft_ms"], "unit": "ms"}, r["ratio"], None,
            cluster_blocks_min=r["cluster_blocks_min"], prefix_blocks=r["prefix_blocks"]),
        row(f"cluster tier delivery (bytes in / lookup time, {r['block_bytes']} B blocks)", r["tier_bytes_per_s"] / 1e9, "GB/s",
            None, None, None, None, lookup_ms=r["lookup_ms"]),
    ]
    write("kvswap", command, rows, raw=pc, load={"before": pc["load"], "after": pc.get("load_after")}, label="cluster-prefix")
    with open(miss_json) as f:
        pm = json.load(f)
    r = pm["result"]
    rows = [row(f"TTFT on a miss, prefix cache + cluster on ({r['shared_tokens']}+{r['suffix_tokens']} tokens, {pm['model']})",
                r["on_ttft_ms"], "ms", "prefix cache off", {"value": r["off_ttft_ms"], "unit": "ms"}, r["ratio"], "<= 1.01",
                ratio_median_of_rounds=r["ratio_median_of_rounds"], lookup_ms=r["lookup_ms"], hits=r["hits"])]
    write("kvswap", command, rows, raw=pm, load={"before": pm["load"], "after": pm.get("load_after")}, label="cluster-miss")


def kv_tiers(folder, load_before, load_after, command):
    """scripts/bench-kv.sh: one `fastlane kv bench --json` per checksum mode in FOLDER."""
    rows, raw = [], {}
    for mode in ("fast", "off", "crc32c"):
        path = os.path.join(folder, f"{mode}.json")
        r = json.load(open(path))
        raw[mode] = r
        for x in _kv_bandwidth_rows(r, f", checksum {mode}"):
            x["target"] = x["target"] if mode != "crc32c" else None
            rows.append(x)
    return write("kvswap", command, rows, raw=raw, load={"before": load_before, "after": load_after},
                 label="tiers")


def journal_replicated(guest_log, command):
    """scripts/bench-journal-replicated.sh: the guest's BENCHJSON lines (`journal bench --json`
    at local and replicated durability, ib_write_lat's one-way times), per round; the
    replicated ack P99 against the local one plus one round trip (2 x perftest's one-way P99)
    of the same round, median over the rounds. Prints the table; fails when a round is
    missing any of its three parts."""
    runs = {}
    for line in open(guest_log, errors="replace"):
        parts = line.strip().split(" ", 3)
        if len(parts) == 4 and parts[0] == "BENCHJSON":
            runs.setdefault(int(parts[2]), {})[parts[1]] = json.loads(parts[3])
    rounds = []
    for r in sorted(runs):
        got = runs[r]
        missing = {"local", "replicated", "rtt"} - set(got)
        if missing:
            sys.exit(f"bench_results.py: round {r} lacks {sorted(missing)} in {guest_log}")
        loc, rep, rtt = got["local"]["ack"], got["replicated"]["ack"], got["rtt"]
        rtt_p99_us = 2 * rtt["one_way_p99_us"]
        rounds.append({
            "round": r,
            "local_p50_us": loc["p50_ns"] / 1e3, "local_p99_us": loc["p99_ns"] / 1e3,
            "replicated_p50_us": rep["p50_ns"] / 1e3, "replicated_p99_us": rep["p99_ns"] / 1e3,
            "rtt_p50_us": 2 * rtt["one_way_p50_us"], "rtt_p99_us": rtt_p99_us,
            "ratio": rep["p99_ns"] / 1e3 / (loc["p99_ns"] / 1e3 + rtt_p99_us),
        })
    if not rounds:
        sys.exit(f"bench_results.py: no BENCHJSON rounds in {guest_log}")

    def med(key):
        return _median([x[key] for x in rounds])

    print(f"{'round':>5} {'local p50':>10} {'local p99':>10} {'repl p50':>10} {'repl p99':>10} "
          f"{'rtt p50':>9} {'rtt p99':>9} {'repl99/(local99+rtt99)':>23}")
    for x in rounds:
        print(f"{x['round']:>5} {x['local_p50_us']:>10.0f} {x['local_p99_us']:>10.0f} "
              f"{x['replicated_p50_us']:>10.0f} {x['replicated_p99_us']:>10.0f} "
              f"{x['rtt_p50_us']:>9.0f} {x['rtt_p99_us']:>9.0f} {x['ratio']:>23.2f}")
    print(f"(µs; rtt = 2 x ib_write_lat's one-way time, 64 B, same rxe device, same boot; "
          f"median ratio {med('ratio'):.2f})")
    rows = [
        row("local durable ack p99", med("local_p99_us"), "µs"),
        row("replicated durable ack p99", med("replicated_p99_us"), "µs",
            peer="local ack p99 + one RDMA round trip p99 (perftest)",
            peer_value=med("local_p99_us") + med("rtt_p99_us"), ratio=med("ratio")),
        row("RDMA round trip p99 (2 x ib_write_lat one-way)", med("rtt_p99_us"), "µs"),
    ]
    write("journal", command, rows, raw={"rounds": rounds}, label="replicated")


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    kind, args = sys.argv[1], sys.argv[2:]
    if kind == "blk":
        blk(args[0], " ".join(args[1:]))
    elif kind == "vfio-nvme":
        vfio_nvme(args[0], " ".join(args[1:]))
    elif kind == "rdma":
        rdma(args[0], " ".join(args[1:]))
    elif kind == "journal":
        journal(args[0], " ".join(args[1:]))
    elif kind == "kv-remote":
        kv_remote(args[0], " ".join(args[1:]))
    elif kind == "cluster":
        cluster(args[0], args[1], args[2], " ".join(args[3:]))
    elif kind == "journal-replicated":
        journal_replicated(args[0], " ".join(args[1:]))
    elif kind == "kv-tiers":
        kv_tiers(args[0], args[1], args[2], " ".join(args[3:]))
    else:
        sys.exit(f"bench_results.py: unknown kind {kind}\n{__doc__}")


if __name__ == "__main__":
    main()
