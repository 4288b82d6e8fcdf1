"""The simulator's prediction of a real controller run on this CPU vs its measured wall time.

    python benchmarks/sim_vs_real.py                       # 8 steps x 4 tasks x 2 samples
    python benchmarks/sim_vs_real.py --steps 6 --tasks 4 --calibration cpu_measured

1. Runs the real controller in this process (experiments/quickstart.py:tiny, cells of
   ``--cell_size`` fake CPU devices, the persistent compile cache) and notes the wall time at
   which every optimizer step (checkpoint included) ends.
2. Reads the run's own ``trace.jsonl`` and simulates the same executions, with the same
   policy function and parameters, on the CPU calibration (``benchmarks/calibrate_cpu.py``)
   in shared-cores mode: every cell runs on the same two cores.
3. Compares step durations from step 1 on: step 0 includes tracing and loading the compiled
   programs, which the simulator does not model (it is printed, not compared).

Prints a per-step table; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.calibrate_cpu import setup, tiny_config  # noqa: E402


def _timed(cls, name: str, spent: list) -> None:
    """Wraps cls.name to add its seconds to spent[-1] (the current step's program time)."""
    fn = getattr(cls, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[-1] += time.perf_counter() - t

    setattr(cls, name, wrapper)


def run_real(cfg, workdir: str) -> tuple[list[float], list[float], object]:
    """Runs the controller; -> (wall seconds at each step's end since the run began, seconds
    spent inside the programs the simulator models per step, ctrl)."""
    from gyre.elastic.controller import Controller
    from gyre.rollout.engine import Engine
    from gyre.train.step import Trainer

    spent = [0.0]
    # Engine steps, gradients, optimizer + publication, checkpoint: the rest is host overhead.
    for cls, name in ((Engine, "step"), (Trainer, "compute_grads"),
                      (Controller, "finish_step"), (Controller, "save")):  # fmt: skip
        _timed(cls, name, spent)
    ctrl = Controller(cfg, workdir)
    ends: list[float] = []
    t0 = time.perf_counter()

    def on_step(_):
        ends.append(time.perf_counter() - t0)
        spent.append(0.0)

    try:
        asyncio.run(ctrl.run(on_step))
    finally:
        ctrl.ckpt.close()
    return ends, spent[: len(ends)], ctrl


def predict(cfg, trace_path: str, num_cells: int, cost):
    """Simulates the recorded trace under the run's own policy and parameters."""
    from gyre.elastic import policy, sim, workload

    params = policy.PolicyParams.from_run(cfg.run)
    steps = workload.read_trace(trace_path)
    return sim.simulate(steps, num_cells, cfg.run.scheduler, cost, params), steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--cell_size", type=int, default=4)
    ap.add_argument("--calibration", default="cpu_measured")
    ap.add_argument("--cache_dir", default="/tmp/xcache")
    ap.add_argument("--calibrate", action="store_true",
                    help="re-time the programs in this process first (same machine load)")  # fmt: skip
    args = ap.parse_args()
    cfg = tiny_config(args.cell_size, args.cache_dir)
    cfg.run.steps, cfg.run.tasks_per_step = args.steps, args.tasks
    workdir = tempfile.mkdtemp(prefix="gyre_sim_vs_real_")
    setup(cfg, workdir)
    from gyre.elastic import calibration

    if args.calibrate:
        from benchmarks.calibrate_cpu import calibrate

        cost = calibration.from_dict(calibrate(args.cell_size, 3, args.cache_dir))
        args.calibration = "fresh, in-process"
    else:
        cost = calibration.load(args.calibration)
    if not cost.shared_cores:
        cost = dataclasses.replace(cost, shared_cores=True)
    cost = dataclasses.replace(cost, pack_by_group=True)  # the controller packs per task group

    ends, spent, ctrl = run_real(cfg, workdir)
    res, steps = predict(cfg, os.path.join(workdir, "trace.jsonl"), len(ctrl.cells), cost)
    measured, predicted = np.diff(ends), np.diff(res.step_end_s)
    calls = [sum(len(ex.calls) for ex in b) for b in steps]
    tokens = [sum(ex.train_tokens for ex in b) for b in steps]
    print(f"real run: {len(ctrl.cells)} cells, policy {cfg.run.scheduler}, calibration "
          f"{args.calibration!r} ({cost.source})")  # fmt: skip
    print(f"step 0 (not compared: includes program load): measured {ends[0]:.3f} s, "
          f"simulated {res.step_end_s[0]:.3f} s")  # fmt: skip
    print(f"{'step':>4} {'execs':>5} {'calls':>5} {'tokens':>6} {'measured s':>10} "
          f"{'in programs':>11} {'predicted s':>11} {'error':>7}")  # fmt: skip
    for s, (m, p) in enumerate(zip(measured, predicted), start=1):
        print(f"{s:>4} {len(steps[s]):>5} {calls[s]:>5} {tokens[s]:>6} {m:>10.3f} "
              f"{spent[s]:>11.3f} {p:>11.3f} {(p - m) / m:>+7.1%}")  # fmt: skip
    in_programs = float(np.sum(spent[1:]))
    total_m, total_p = float(measured.sum()), float(predicted.sum())
    err = (total_p - total_m) / total_m
    per_step = np.abs(predicted - measured) / measured
    print(f"total (steps 1..{len(measured)}): measured {total_m:.3f} s, predicted "
          f"{total_p:.3f} s, error {err:+.1%}; per-step |error| median {np.median(per_step):.1%}"
          f", max {per_step.max():.1%}; check |error| <= 15%: "
          f"{'pass' if abs(err) <= 0.15 else 'FAIL'}")  # fmt: skip
    print(f"time inside the modelled programs: {in_programs:.3f} s ({in_programs / total_m:.0%} of"
          f" measured); host overhead not in the cost model: {total_m - in_programs:.3f} s; "
          f"prediction vs in-program time {(total_p - in_programs) / in_programs:+.1%}")  # fmt: skip
    print(json.dumps({
        "steps_compared": len(measured), "cells": len(ctrl.cells),
        "measured_s": round(total_m, 4), "predicted_s": round(total_p, 4),
        "rel_error": round(err, 4), "per_step_abs_error_median": round(float(np.median(per_step)), 4),
        "per_step_abs_error_max": round(float(per_step.max()), 4),
        "measured_step_s": [round(float(x), 4) for x in measured],
        "predicted_step_s": [round(float(x), 4) for x in predicted],
        "first_step_measured_s": round(ends[0], 4), "within_15pct": bool(abs(err) <= 0.15),
        "in_programs_s": round(in_programs, 4), "calibration": args.calibration,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
