"""Where elastic wins: a map over KV capacity per cell and the training share of a step.

    python benchmarks/regimes.py [--out PATH] [--steps N] [--seeds S] [--quick]
                                 [--admission resident|fifo]

Base: the SWE / terminal scenario of benchmarks/paper_table.py as it is there (122B-class
model, its memory model and costs, 8 cells, 1024 executions per step), fewer steps. Grid:

- x, KV capacity: contexts of the mean peak size a cell's KV pool holds, divided by the
  executions per cell of one step (1.0 = the cluster holds exactly one step's batch at peak);
  set through the pool size.
- y, training share: the fraction of cell-time colocate spends training at ample memory;
  set by scaling every training cost (per token, per context token, per micro-batch).

Per grid point and seed: colocate, async at every split, elastic at staleness 1 and 0; the
figures are speedups in steady-state equal-work hours (= the steady rate: tokens over time in
windows of an even number of step intervals inside the ends of steps 1..N-2, so that the
short runs' pipeline fill and drain do not count and a cycle of two steps is cut at one phase;
paper_table.steady_hours),
mean over seeds: best async /
elastic, colocate / elastic, and colocate / elastic at staleness 0 (equal staleness). > 1
means elastic is faster. The paper table's three scenarios are marked at their own (x, y).
Saves the heat maps to --out (PNG) and prints the grids; the last line is one JSON object.
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

from gyre.elastic.sim import simulate  # noqa: E402
from gyre.elastic.workload import generate  # noqa: E402

# Coarse, so that runs can be long enough for a steady rate (short ones are noisy: with 6
# steps the window is 2 step intervals and the map moved by up to 0.3x).
KV_RATIOS = (0.4, 0.7, 1.0, 2.0)
TRAIN_SHARES = (0.05, 0.2, 0.45)
# Steady-state equal-work hours (even windows inside the ends of steps 1..N-2): short runs'
# pipeline fill and drain would otherwise favour elastic over a fixed split.
METRIC = "steady_equal_work_h"
QUICK = dict(kv=(0.5, 2.0), shares=(0.2, 0.5), steps=2, seeds=1)


def peak_context(steps) -> float:
    return float(np.mean([max(c.prompt_tokens + c.completion_tokens for c in ex.calls)
                          for batch in steps for ex in batch]))  # fmt: skip


def biggest_call(steps) -> float:
    return max(c.prompt_tokens + c.completion_tokens for b in steps for ex in b for c in ex.calls)


def train_share(result) -> float:
    return result.busy_fraction().get("train-busy", 0.0)


def scale_training(cost, f: float):
    return dataclasses.replace(cost, train_per_token_s=cost.train_per_token_s * f,
                               train_per_ctx_token_s=cost.train_per_ctx_token_s * f,
                               microbatch_s=cost.microbatch_s * f)  # fmt: skip


def with_kv(cost, kv_ratio: float, per_cell: float, peak: float, floor: float):
    """The cost model with a pool of kv_ratio x per_cell contexts of ``peak`` (simulated units)."""
    return dataclasses.replace(cost, kv_capacity_tokens=max(kv_ratio * per_cell * peak, floor))


def base_setup(steps_n: int, admission: str = "resident"):
    sc = next(s for s in paper_table.load_scenarios(steps_n) if "SWE" in s.name)
    cost, _, _ = paper_table.memory_cost(sc.calibration, sc.replication, admission=admission)
    return sc, cost


def scenario_marks(steps_n: int, admission: str = "resident") -> list[dict]:
    """Each paper scenario's own (x, y): its KV ratio and colocate's training share."""
    marks = []
    for sc in paper_table.load_scenarios(steps_n):
        cost, mem, _ = paper_table.memory_cost(sc.calibration, sc.replication, admission=admission)
        steps = generate(sc.workload)
        per_cell = sc.workload.executions_per_step / sc.num_cells
        ratio = cost.kv_capacity_tokens / peak_context(steps) / per_cell
        ample = dataclasses.replace(cost, kv_capacity_tokens=100 * biggest_call(steps))
        share = train_share(simulate(steps, sc.num_cells, "colocate", ample, sc.params))
        marks.append({"name": sc.name, "kv_ratio": ratio, "train_share": share})
    return marks


def grid_point(sc, cost, seeds_steps, kv_ratio: float) -> dict:
    per_cell = sc.workload.executions_per_step / sc.num_cells
    p = sc.params
    stats: dict = {}
    out = {"async": {r: [] for r in range(1, sc.num_cells)}, "colocate": [], "elastic": [],
           "elastic_s0": [], "elastic_throughput": []}  # fmt: skip
    for steps, full, peak, floor in seeds_steps:
        step_of = {ex.execution_id: ex.step for batch in steps for ex in batch}
        c = with_kv(cost, kv_ratio, per_cell, peak, floor)

        def h(policy, params, key, steps=steps, c=c, full=full, step_of=step_of):
            r = simulate(steps, sc.num_cells, policy, c, params)
            st = paper_table.run_stats(r, full, sc.replication, step_of)
            stats.setdefault(key, []).append(st)
            return st[METRIC]

        out["colocate"].append(h("colocate", p, "colocate"))
        out["elastic"].append(h("elastic", p, "elastic"))
        out["elastic_throughput"].append(h("elastic_throughput", p, "elastic_throughput"))
        out["elastic_s0"].append(
            h("elastic", dataclasses.replace(p, max_staleness=0), "elastic_s0")
        )
        for r in out["async"]:
            out["async"][r].append(
                h("async", dataclasses.replace(p, async_rollout_cells=r), f"async_{r}")
            )
    best = min(out["async"], key=lambda r: (np.mean(out["async"][r]), r))
    e = np.array(out["elastic"])
    # What was done, beside the equal-work hours: per policy, mean over seeds.
    done = {name: {k: float(np.mean([x[k] for x in stats[key]]))
                   for k in ("timeout_share", "completed_per_h", "tokens_per_exec_k")}
            for name, key in (("colocate", "colocate"), ("elastic", "elastic"),
                              ("elastic_s0", "elastic_s0"), ("async_best", f"async_{best}"))}  # fmt: skip

    def speedup(other, mine=e):
        x = np.array(other) / mine
        return float(x.mean()), float(x.std(ddof=1) / np.sqrt(len(x))) if len(x) > 1 else 0.0

    vs_best, vs_best_se = speedup(out["async"][best])
    # The previous steady figure (a window cut at step ends), for comparison, and how much the
    # even windows moved the best split's own figure (1.0 = unchanged).
    win = {key: np.array([x["window_equal_work_h"] for x in stats[key]])
           for key in ("elastic", f"async_{best}")}  # fmt: skip
    vs_best_window = float(np.mean(win[f"async_{best}"] / win["elastic"]))
    split_steady_over_window = float(np.mean(np.array(out["async"][best]) / win[f"async_{best}"]))
    vs_col, vs_col_se = speedup(out["colocate"])
    # The throughput rule (issue 33's first pass) against the same best split.
    tr, _ = speedup(out["async"][best], np.array(out["elastic_throughput"]))
    vs_eq, vs_eq_se = speedup(out["colocate"], np.array(out["elastic_s0"]))
    return {"vs_async_best": vs_best, "vs_async_best_se": vs_best_se, "best_split": best,
            "vs_async_best_window": vs_best_window, "throughput_rule_vs_async_best": tr,
            "async_best_steady_over_window": split_steady_over_window,
            "vs_colocate": vs_col, "vs_colocate_se": vs_col_se,
            "vs_colocate_equal_staleness": vs_eq, "vs_colocate_equal_staleness_se": vs_eq_se,
            "elastic_equal_work_h": float(e.mean()), "done": done,
            **paper_table.timeout_flag(done)}  # fmt: skip


def plot(path: str, res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    xs, ys = res["kv_ratios"], res["train_shares"]
    grid = {(g["kv_ratio"], g["train_share_target"]): g for g in res["grid"]}
    keys = (("vs_async_best", "best async / elastic"), ("vs_colocate", "colocate / elastic"),
            ("vs_colocate_equal_staleness", "colocate / elastic, both staleness 0"))  # fmt: skip
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    lx = np.log(xs)
    for ax, (key, title) in zip(axes, keys):
        data = np.array([[grid[x, y][key] for x in xs] for y in ys])
        lo, hi = min(data.min(), 0.99), max(data.max(), 1.01)
        im = ax.imshow(data, origin="lower", cmap="RdBu", aspect="auto",
                       norm=TwoSlopeNorm(1.0, lo, hi))  # fmt: skip
        ax.set_xticks(range(len(xs)), [f"{x:g}" for x in xs])
        ax.set_yticks(range(len(ys)), [f"{y:g}" for y in ys])
        ax.set_xlabel("KV capacity: contexts per cell / executions per cell")
        ax.set_ylabel("training share of colocate's cell-time")
        ax.set_title(f"speedup of elastic, equal work: {title}", fontsize=9)
        for i, row in enumerate(data):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
        for n, m in enumerate(res["scenarios"]):  # interpolated between ticks, clamped
            mx = np.interp(np.log(m["kv_ratio"]), lx, range(len(xs)))
            my = np.interp(m["train_share"], ys, range(len(ys)))
            ax.plot(mx, my, "k*", markersize=11)
            ax.annotate(m["name"].split()[0].rstrip(","), (mx, my), textcoords="offset points",
                        xytext=(6, 6 - 12 * (n % 2)), fontsize=8)  # fmt: skip
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="workdirs/regimes.png", help="PNG path for the heat maps")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a 2 x 2 grid, 2 steps, 1 seed")
    ap.add_argument("--admission", choices=("resident", "fifo"), default="resident",
                    help="the memory model's admission (paper_table.py --admission)")  # fmt: skip
    paper_table.add_carry_flags(ap)
    args = ap.parse_args()
    kv, shares, steps_n, seeds = KV_RATIOS, TRAIN_SHARES, args.steps, args.seeds
    if args.quick:
        kv, shares, steps_n, seeds = QUICK["kv"], QUICK["shares"], QUICK["steps"], QUICK["seeds"]
    t0 = time.time()
    sc, cost = base_setup(steps_n, args.admission)
    sc = paper_table.with_carry(sc, args)
    seeds_steps = []
    for i in range(seeds):
        steps = generate(dataclasses.replace(sc.workload, seed=sc.workload.seed + 1000 * i))
        full = sum(ex.train_tokens for batch in steps for ex in batch)
        seeds_steps.append((steps, full, peak_context(steps), biggest_call(steps)))
    # Training share: scale the training costs so that colocate at ample memory spends the
    # target share of its cell-time training (its rollout does not depend on training cost).
    steps0 = seeds_steps[0][0]
    ample = dataclasses.replace(cost, kv_capacity_tokens=100 * seeds_steps[0][3])
    share1 = train_share(simulate(steps0, sc.num_cells, "colocate", ample, sc.params))
    rows = []
    for y in shares:
        f = y / (1 - y) * (1 - share1) / share1
        c = scale_training(cost, f)
        ample_c = dataclasses.replace(c, kv_capacity_tokens=ample.kv_capacity_tokens)
        got = train_share(simulate(steps0, sc.num_cells, "colocate", ample_c, sc.params))
        for x in kv:
            g = grid_point(sc, c, seeds_steps, x)
            rows.append({"kv_ratio": x, "train_share_target": y, "train_share": got,
                         "train_cost_scale": f, **g})  # fmt: skip
            d = g["done"]
            flag = "  ! timeouts differ" if g["timeouts_differ"] else ""
            print(f"  kv {x:4.2f} share {y:4.2f} (measured {got:.2f}): vs best async "
                  f"{g['vs_async_best']:.2f} (R={g['best_split']}), vs colocate "
                  f"{g['vs_colocate']:.2f}, equal staleness {g['vs_colocate_equal_staleness']:.2f}"
                  f"; timeouts elastic {d['elastic']['timeout_share']:.0%} / best async "
                  f"{d['async_best']['timeout_share']:.0%}, done/h "
                  f"{d['elastic']['completed_per_h']:.0f} / {d['async_best']['completed_per_h']:.0f}"
                  f"{flag}  [{time.time() - t0:.0f} s]", flush=True)  # fmt: skip
    marks = scenario_marks(2 if args.quick else 3, args.admission)
    res = {"kv_ratios": list(kv), "train_shares": list(shares), "grid": rows, "scenarios": marks,
           "cells": sc.num_cells, "executions_per_step": sc.real_executions_per_step,
           "steps": steps_n, "seeds": seeds, "png": args.out, "admission": args.admission,
           "close_share": args.close_share, "max_carry": args.max_carry,
           "close_on": args.close_on}  # fmt: skip
    grid = {(g["kv_ratio"], g["train_share_target"]): g for g in rows}
    for key, title in (("vs_async_best", "best async / elastic"),
                       ("vs_async_best_window", "best async / elastic, the previous steady "
                        "window (tokens of steps 2..N-2 / time between step ends 1 and N-2)"),
                       ("throughput_rule_vs_async_best", "best async / elastic_throughput "
                        "(the first pass's rule, same metric)"),
                       ("async_best_steady_over_window", "the best split's own steady figure / "
                        "its previous window figure"),
                       ("vs_colocate", "colocate / elastic (staleness 0 vs 1)"),
                       ("vs_colocate_equal_staleness", "colocate / elastic at staleness 0")):  # fmt: skip
        print(f"\nelastic speedup, equal work: {title} (rows: training share, cols: KV ratio)")
        print("share \\ kv " + "".join(f"{x:>8.2f}" for x in kv))
        for y in shares:
            print(f"{y:10.2f} " + "".join(f"{grid[x, y][key]:8.2f}" for x in kv))
    print("\ntimeout share, elastic / best async split (! = policies differ by > 10 points):")
    print("share \\ kv " + "".join(f"{x:>12.2f}" for x in kv))
    for y in shares:
        cells = [grid[x, y] for x in kv]
        print(f"{y:10.2f} " + "".join(
            f"{g['done']['elastic']['timeout_share']:6.0%}/{g['done']['async_best']['timeout_share']:4.0%}"
            + ("!" if g["timeouts_differ"] else " ") for g in cells))  # fmt: skip
    print(f"\nbest async split (rollout cells of {sc.num_cells}):")
    for y in shares:
        print(f"{y:10.2f} " + "".join(f"{grid[x, y]['best_split']:8d}" for x in kv))
    print("\npaper scenarios (x = KV ratio, y = colocate's training share at ample memory):")
    for m in marks:
        print(f"  {m['name']:28s} x {m['kv_ratio']:.2f}  y {m['train_share']:.2f}")
    plot(args.out, res)
    res["seconds"] = round(time.time() - t0, 1)
    print(f"\nheat maps: {args.out} ({res['seconds']} s)")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
