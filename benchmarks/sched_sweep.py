"""Elastic's speedup over colocate and async across branching frequency and load variance.

    python benchmarks/sched_sweep.py [--out DIR] [--steps N]

Grid: branching scale b (retry and sub-agent rates = b x 0.1 per call) by load variance
(lognormal sigma of a query's length). Small cluster (4 cells, 64 executions per step,
h200_122b_a10b projection, staleness 1 for async/elastic). Saves heat maps to
DIR/sched_sweep.png, prints the tables; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gyre.elastic import calibration  # noqa: E402
from gyre.elastic.policy import PolicyParams  # noqa: E402
from gyre.elastic.sim import simulate  # noqa: E402
from gyre.elastic.workload import WorkloadSpec, generate  # noqa: E402

BRANCHING = (0.0, 0.5, 1.0, 2.0)
SIGMAS = (0.2, 0.6, 1.0, 1.4)


def cell(branch: float, sigma: float, steps: int) -> dict:
    spec = WorkloadSpec(
        steps=steps,
        queries_per_step=8,
        samples_per_query=4,
        mean_calls=30,
        calls_sigma=sigma,
        mean_completion_tokens=800,
        mean_observation_tokens=1200,
        mean_tool_latency_s=30.0,
        context_window=65536,
        summary_tokens=2000,
        timeout_s=4 * 3600.0,
        retry_rate=0.1 * branch,
        subagent_rate=0.1 * branch,
        subagent_calls=5,
        seed=7,
    )
    # 32 simulated executions x 16 replicas over 4 cells: one step fills the cluster.
    cost = dataclasses.replace(calibration.load("h200_122b_a10b"), cell_capacity=32 * 16 / 4)
    cost = cost.replicated(16)
    steps_ = generate(spec)
    # Steps wait for every execution (close_share 1.0): makespans of whole steps, as recorded
    # in BENCHMARKS.md before carry-over (regimes.py and paper_table.py measure it).
    p = PolicyParams(max_staleness=1, close_share=1.0)
    t = {
        name: simulate(steps_, 4, name, cost, p).makespan_s
        for name in ("colocate", "async", "elastic")
    }
    return {"vs_colocate": t["colocate"] / t["elastic"], "vs_async": t["async"] / t["elastic"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/sched_sweep")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    t0 = time.time()
    grid = {(b, s): cell(b, s, args.steps) for b in BRANCHING for s in SIGMAS}
    for key in ("vs_colocate", "vs_async"):
        print(
            f"\nelastic speedup {key.replace('_', ' ')} (rows: branching scale, cols: load sigma)"
        )
        print("branch \\ sigma " + "".join(f"{s:>8.1f}" for s in SIGMAS))
        for b in BRANCHING:
            print(f"{b:14.1f} " + "".join(f"{grid[b, s][key]:8.2f}" for s in SIGMAS))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(args.out, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key in zip(axes, ("vs_colocate", "vs_async")):
        data = [[grid[b, s][key] for s in SIGMAS] for b in BRANCHING]
        im = ax.imshow(data, origin="lower", cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(SIGMAS)), [f"{s}" for s in SIGMAS])
        ax.set_yticks(range(len(BRANCHING)), [f"{b}" for b in BRANCHING])
        ax.set_xlabel("load variance (lognormal sigma)")
        ax.set_ylabel("branching scale")
        ax.set_title(f"elastic speedup {key.replace('_', ' ')}")
        for i, row in enumerate(data):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", color="w", fontsize=8)
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    path = os.path.join(args.out, "sched_sweep.png")
    fig.savefig(path, dpi=100)
    print(f"\nheat map: {path} ({time.time() - t0:.1f} s)")
    print(
        json.dumps(
            {
                "png": path,
                "grid": [{"branching": b, "sigma": s, **v} for (b, s), v in grid.items()],
                "seconds": round(time.time() - t0, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
