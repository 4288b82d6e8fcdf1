"""How long a colocated step lasts with carry-over, against the scenario's query timeout.

    python benchmarks/colocate_step.py [--scenario 2.4T] [--steps 24]
                                       [--carry 0.9:1,0.5:2,0.25:4,0.1:8,0.05:16,0.02:24]
                                       [--close-on own|owned]

Colocate (all cells roll out a step, then all train it) on one of benchmarks/paper_table.py's
scenarios, one seed, resident admission, at each ``close_share:max_carry`` pair. Per pair: the
mean step (between step ends), the mean without the run's last step (which waits for every
execution still running), the median, the shortest, the cell-time per step in each role, and
the timeout share. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import paper_table  # noqa: E402

from gyre.elastic.policy import CLOSE_ON  # noqa: E402
from gyre.elastic.sim import simulate  # noqa: E402
from gyre.elastic.workload import generate  # noqa: E402


def step_figures(result) -> dict:
    """Step lengths and the cell-time per step in each role, in hours."""
    ends = np.diff([0.0, *result.step_end_s]) / 3600
    busy, hours = result.busy_fraction(), result.makespan_s / 3600
    per_step = lambda role: (
        sum(v for k, v in busy.items() if k.startswith(role)) * hours / len(ends)
    )
    timeouts = sum(o[0] == "timeout" for o in result.outcomes.values()) / len(result.outcomes)
    return {"mean_step_h": float(ends.mean()), "mean_without_last_h": float(ends[:-1].mean()),
            "median_step_h": float(np.median(ends)), "min_step_h": float(ends.min()),
            "train_role_per_step_h": per_step("train"),
            "rollout_role_per_step_h": per_step("rollout"), "timeout_share": timeouts}  # fmt: skip


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="2.4T", help="a substring of the scenario's name")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--carry", default="0.9:1,0.5:2,0.25:4,0.1:8,0.05:16,0.02:24",
                    help="close_share:max_carry pairs")  # fmt: skip
    ap.add_argument(
        "--close-on",
        default="own",
        choices=CLOSE_ON,
        help="finished groups counted towards the share (PolicyParams.close_on)",
    )
    args = ap.parse_args(argv)
    sc = next(s for s in paper_table.load_scenarios(args.steps) if args.scenario in s.name)
    cost, _, _ = paper_table.memory_cost(sc.calibration, sc.replication, admission="resident")
    steps = generate(sc.workload)
    timeout_h = sc.workload.timeout_s / 3600
    print(
        f"{sc.name}: colocate, {args.steps} steps, query timeout {timeout_h:g} h, "
        f"close on {args.close_on}"
    )
    print(f"{'close/carry':>12s} {'mean':>6s} {'w/o last':>8s} {'median':>6s} {'min':>5s} "
          f"{'train':>6s} {'rollout':>7s} {'timeouts':>8s}")  # fmt: skip
    rows, t0 = [], time.time()
    for pair in args.carry.split(","):
        share, carry = pair.split(":")
        params = dataclasses.replace(sc.params, close_share=float(share), max_carry=int(carry),
                                     close_on=args.close_on)  # fmt: skip
        f = step_figures(simulate(steps, sc.num_cells, "colocate", cost, params))
        rows.append({"close_share": float(share), "max_carry": int(carry), **f})
        print(f"{pair:>12s} {f['mean_step_h']:5.2f}h {f['mean_without_last_h']:7.2f}h "
              f"{f['median_step_h']:5.2f}h {f['min_step_h']:4.2f}h "
              f"{f['train_role_per_step_h']:5.2f}h {f['rollout_role_per_step_h']:6.2f}h "
              f"{f['timeout_share']:8.0%}", flush=True)  # fmt: skip
    res = {"scenario": sc.name, "steps": args.steps, "timeout_h": timeout_h,
           "close_on": args.close_on, "rows": rows,
           "below_timeout": [r["close_share"] for r in rows if r["mean_step_h"] < timeout_h],
           "seconds": round(time.time() - t0, 1)}  # fmt: skip
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
