#!/usr/bin/env python3
"""Where a tenant's time to first token goes inside `llm serve`'s engine thread, read from the
JSON events it writes at `RUST_LOG=info,fastlane_llm::engine=trace --log-format json`
(`scripts/bench-attack.sh --split` runs it so). For every request of the tenant (index in the
tenants file, 0 by default) it splits the engine's TTFT (submission to first token) into

  lookup    submission to the prefix lookup thread forwarding it
  abort     forwarded to taken in by the engine thread: the rest of the step in flight (given
            up for a protected arrival, or not), then planning
  between   whole steps after that one, before its own
  own       its own step (the forward pass that computed its prompt's last chunk)
  rest      sampling, delivery and the hand-offs

and prints percentiles of each (and of the own step's run-queue wait: time the engine's threads
were runnable but off the core), the slowest requests with the step each arrived in (given up
or not, its rank and what it carried), and the own step against the same step alone.

--skip S leaves out the requests submitted in the first S seconds after the first request of
any tenant (a bench's warm-up, `llm bench --warmup`).
For every other tenant it also says how many of its requests were taken in as protected, and
when the last was (over the whole log): such a tenant shares steps with this one.

  scripts/engine-split.py SERVE_LOG [--tenant N] [--top K] [--skip S] [--json]
"""
import argparse
import bisect
import datetime
import json
import sys


def ts_us(s):
    return datetime.datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp() * 1e6


def pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(len(v) * q))] if v else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log")
    ap.add_argument("--tenant", type=int, default=0)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--skip", type=float, default=0.0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    steps, taken, first, fwd = [], {}, {}, {}
    t_first = None
    others = {}  # every other tenant: (requests taken in, of them protected, the last protected's submission)
    with open(a.log) as f:
        for line in f:
            if not line.startswith("{"):
                continue
            v = json.loads(line)
            fl = v.get("fields", {})
            e = fl.get("event")
            if e == "step":
                t = ts_us(v["timestamp"])
                steps.append((t - fl["step_us"], t, fl["given_up"], fl["rank"], fl["aborts_in_row"],
                              fl["prefill_items"], fl["prefill_tokens"], fl["decodes"],
                              fl.get("runq_us", 0), fl.get("oncpu_us", 0)))
            elif e == "request_taken":
                sub = ts_us(v["timestamp"]) - fl["waited_us"]
                t_first = sub if t_first is None else min(t_first, sub)
                if fl.get("tenant") == a.tenant:
                    taken[fl["id"]] = (sub, fl["waited_us"], fl["protected"])
                else:
                    n, p, last = others.get(fl.get("tenant"), (0, 0, None))
                    others[fl.get("tenant")] = (n + 1, p + fl["protected"], sub if fl["protected"] else last)
            elif e == "first_token":
                first[fl["id"]] = fl["ttft_us"]
            elif e == "lookup_forwarded":
                fwd[fl["id"]] = fl["waited_us"]
    if not steps or not taken:
        sys.exit(f"engine-split.py: no step or request_taken events of tenant {a.tenant} in {a.log} "
                 "(was it run at RUST_LOG=info,fastlane_llm::engine=trace --log-format json?)")
    steps.sort()
    starts = [s[0] for s in steps]
    rows = []
    for rid, (sub, waited, prot) in taken.items():
        if rid not in first or sub < t_first + a.skip * 1e6:
            continue
        ttft = first[rid]
        end = sub + ttft
        k = bisect.bisect_right(starts, sub) - 1
        inflight = steps[k] if k >= 0 and steps[k][1] > sub else None
        after = [s for s in steps[k + 1:] if s[1] <= end + 50]
        own = after[-1] if after else None
        lookup = fwd.get(rid, 0)
        between = sum(s[1] - s[0] for s in after[:-1])
        own_us = own[1] - own[0] if own else 0
        rows.append({
            "ttft": ttft, "lookup": lookup, "abort": waited - lookup, "between": between, "own": own_us,
            "rest": ttft - waited - between - own_us, "own_runq": own[8] if own else 0,
            "protected": prot, "inflight": inflight, "after": after,
        })
    if not rows:
        sys.exit(f"engine-split.py: no request of tenant {a.tenant} got a first token")
    parts = ["ttft", "lookup", "abort", "between", "own", "rest", "own_runq"]
    given_up = [r for r in rows if r["inflight"] and r["inflight"][2]]
    summary = {
        "requests": len(rows),
        "steps": len(steps),
        "steps_given_up": sum(1 for s in steps if s[2]),
        "arrived_in_a_step_given_up": len(given_up),
        # Another tenant taken in as protected shares steps with this one (under its rate, e.g.
        # while it spends the burst it started with).
        "other_tenants_protected": {str(t): {"requests": n, "protected": p,
                                             "last_protected_s": round((last - t_first) / 1e6, 2) if last else None}
                                    for t, (n, p, last) in sorted(others.items())},
        "ms": {p: {q: round(pct([r[p] for r in rows], x) / 1e3, 2) for q, x in (("p50", .5), ("p90", .9), ("p99", .99))}
               for p in parts},
    }
    if a.json:
        print(json.dumps(summary))
        return
    print(f"tenant {a.tenant}: {len(rows)} requests, {len(steps)} steps ({summary['steps_given_up']} given up); "
          f"{len(given_up)} arrived in a step that was then given up")
    for t, o in summary["other_tenants_protected"].items():
        if o["protected"]:
            print(f"tenant {t}: {o['protected']} of {o['requests']} requests taken in as protected, the last "
                  f"{o['last_protected_s']} s after the first request")
    print(f"{'ms':<8}" + "".join(f"{p:>9}" for p in parts))
    for q in ("p50", "p90", "p99"):
        print(f"{q:<8}" + "".join(f"{summary['ms'][p][q]:>9.2f}" for p in parts))
    print(f"slowest {a.top} (in flight: ms left of ms, given up, rank -1 none/0 protected/1 unprotected/2 batch, "
          "prefill items/tokens, decodes; then each step after)")
    for r in sorted(rows, key=lambda r: -r["ttft"])[:a.top]:
        s = f"  {r['ttft'] / 1e3:6.1f} ms  "
        i = r["inflight"]
        if i:
            s += (f"in flight {r['abort'] / 1e3:5.1f} of {(i[1] - i[0]) / 1e3:5.1f} {'given up' if i[2] else 'ran':8} "
                  f"r{i[3]} pf{i[5]}/{i[6]} d{i[7]} runq {i[8] / 1e3:.1f}")
        else:
            s += "arrived between steps"
        s += "  then " + " ".join(f"[{(b[1] - b[0]) / 1e3:.1f}{' given up' if b[2] else ''} r{b[3]} pf{b[5]}/{b[6]} d{b[7]}"
                                  f" runq {b[8] / 1e3:.1f}]" for b in r["after"])
        print(s)


if __name__ == "__main__":
    main()
