"""The QwenGyre end-to-end table, reproduced with the cluster simulator.

    python benchmarks/paper_table.py [--steps N] [--scenario SUBSTRING]

For each scenario (experiments/paper_table.py, every assumption stated there) it runs the same
workload under colocate, async and elastic and prints end-to-end hours, elastic's speedups
next to the reported ranges, the lower bound max(work / cells, longest execution), each
policy's utilisation (least work / (cells x time)), and the workload statistics the scenario
was shaped to. The last line is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gyre.elastic import calibration  # noqa: E402
from gyre.elastic.sim import simulate  # noqa: E402
from gyre.elastic.workload import generate  # noqa: E402

POLICIES = ("colocate", "async", "elastic")


def load_scenarios(steps):
    spec = importlib.util.spec_from_file_location(
        "paper_table_cfg", os.path.join(ROOT, "experiments", "paper_table.py")
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while it loads
    spec.loader.exec_module(mod)
    return mod.scenarios(steps)


def workload_stats(result) -> dict:
    """Mean execution and query (slowest sample of a group) hours, timeout share, tokens."""
    durations, queries, tokens, timeouts = [], {}, [], 0
    for ex_id, (reason, start, end, toks) in result.outcomes.items():
        durations.append(end - start)
        tokens.append(toks)
        timeouts += reason == "timeout"
        q = ex_id.rsplit("-", 1)[0]
        queries[q] = max(queries.get(q, 0.0), end - start)
    return {
        "mean_exec_h": float(np.mean(durations)) / 3600,
        "mean_query_h": float(np.mean(list(queries.values()))) / 3600,
        "timeout_share": timeouts / len(durations),
        "tokens_per_exec_k": float(np.mean(tokens)) / 1e3,
    }


def run_scenario(sc) -> dict:
    cost = calibration.load(sc.calibration)
    cap = sc.real_executions_per_step / sc.num_cells
    cost = dataclasses.replace(cost, cell_capacity=cap).replicated(sc.replication)
    steps = generate(sc.workload)
    out = {"name": sc.name, "policies": {}}
    results = {}
    for name in POLICIES:
        results[name] = r = simulate(steps, sc.num_cells, name, cost, sc.params)
        out["policies"][name] = {
            "hours": r.makespan_s / 3600,
            "utilisation": r.utilisation,
            "switches": r.switches,
            "lower_bound_h": r.lower_bound_s / 3600,
            # With wall-clock timeouts a slower rollout also does less work: report it.
            "tokens_per_exec_k": workload_stats(r)["tokens_per_exec_k"],
            "timeout_share": workload_stats(r)["timeout_share"],
        }
    p = out["policies"]
    out["lower_bound_h"] = min(v["lower_bound_h"] for v in p.values())
    out["vs_colocate"] = p["colocate"]["hours"] / p["elastic"]["hours"]
    out["vs_async"] = p["async"]["hours"] / p["elastic"]["hours"]
    # With wall-clock timeouts a saturated policy finishes sooner by doing less: trained
    # tokens per hour compares the work done (every policy runs the same executions).
    rate = {k: v["tokens_per_exec_k"] / v["hours"] for k, v in p.items()}
    out["throughput_vs_colocate"] = rate["elastic"] / rate["colocate"]
    out["throughput_vs_async"] = rate["elastic"] / rate["async"]
    out["workload"] = workload_stats(results["colocate"])
    out["reported"] = sc.reported
    return out


def fmt_range(r) -> str:
    lo, hi = r
    return f"{lo:.2f}x" if lo == hi else f"{lo:.2f}-{hi:.2f}x"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="override every scenario's step count")
    ap.add_argument("--scenario", default="", help="run only scenarios whose name contains this")
    ap.add_argument("--load", type=int, default=1,
                    help="multiply every scenario's executions per step (its replication; "
                    "the cluster stays the same): how the speedups move with load")  # fmt: skip
    args = ap.parse_args()
    rows, t0 = [], time.time()
    for sc in load_scenarios(args.steps):
        if args.scenario.lower() not in sc.name.lower():
            continue
        sc = dataclasses.replace(sc, replication=sc.replication * args.load)
        res = run_scenario(sc)
        rows.append(res)
        w, p = res["workload"], res["policies"]
        print(
            f"\n== {sc.name}: {sc.workload.steps} steps, {sc.num_cells} cells, "
            f"{sc.real_executions_per_step} executions/step ({sc.calibration})"
        )
        print(
            f"   workload: mean execution {w['mean_exec_h']:.2f} h, mean query {w['mean_query_h']:.2f} h, "
            f"timeouts {100 * w['timeout_share']:.0f}%, {w['tokens_per_exec_k']:.0f}K tokens/execution"
        )
        print(
            f"   {'policy':9s} {'hours':>8s} {'util':>6s} {'switches':>8s} {'own LB h':>9s} "
            f"{'K tok/exec':>10s} {'timeouts':>8s}"
        )
        for name in POLICIES:
            v = p[name]
            rep = sc.reported.get("hours", {}).get(name)
            extra = f"   (reported {rep:.1f} h)" if rep else ""
            print(
                f"   {name:9s} {v['hours']:8.1f} {v['utilisation']:6.3f} {v['switches']:8d} "
                f"{v['lower_bound_h']:9.1f} {v['tokens_per_exec_k']:10.0f} "
                f"{100 * v['timeout_share']:7.0f}%{extra}"
            )
        print(f"   lower bound (any policy): {res['lower_bound_h']:.1f} h")
        print(
            f"   elastic vs colocate {res['vs_colocate']:.2f}x (reported {fmt_range(sc.reported['vs_colocate'])}); "
            f"vs async {res['vs_async']:.2f}x (reported {fmt_range(sc.reported['vs_async'])})"
        )
        print(
            f"   trained tokens per hour: elastic vs colocate {res['throughput_vs_colocate']:.2f}x, "
            f"vs async {res['throughput_vs_async']:.2f}x"
        )
        for a in sc.assumptions:
            print(f"   - {a}")
    print(f"\n({time.time() - t0:.1f} s)")
    print(json.dumps({"scenarios": rows, "seconds": round(time.time() - t0, 1)}))


if __name__ == "__main__":
    main()
