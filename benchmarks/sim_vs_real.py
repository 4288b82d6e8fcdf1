"""The simulator's prediction of a real controller run on this CPU vs its measured wall time.

    python benchmarks/sim_vs_real.py                       # 16 steps x 4 tasks x 2 samples
    python benchmarks/sim_vs_real.py --calibration isolated   # or cpu_measured (a file)
    python benchmarks/sim_vs_real.py --kv-limited          # a KV pool that evicts (see 5.)
    python benchmarks/sim_vs_real.py --kv-limited --admission resident   # (see 6.)
    python benchmarks/sim_vs_real.py --replay /tmp/gyre_sim_vs_real_XXXX  # (see 7.)

1. Calibrates (default ``in-situ``): a first controller run with another seed (other tasks)
   is timed program by program where the programs really run, beside the other cell, the
   harness and the checkpoint writer, and the cost model is fitted from those timings
   (:func:`gyre.elastic.calibration.fit_run`). ``isolated`` times each program alone
   (benchmarks/calibrate_cpu.py); a name loads a calibration file.
2. Runs the real controller (experiments/quickstart.py:tiny, cells of ``--cell_size`` fake
   CPU devices) and notes the wall time at which every optimizer step (checkpoint included)
   ends.
3. Reads that run's own ``trace.jsonl`` and simulates the same executions, with the same
   policy function and parameters, in shared-cores mode: every cell runs on the same cores.
4. Compares step durations from step 1 on: step 0 includes tracing and loading the compiled
   programs, which the simulator does not model (it is printed, not compared). Also prints
   the prediction of the model fitted on the measured run itself: the model's structural
   error, apart from the drift of program speed between two runs on a shared machine.

5. ``--kv-limited``: both runs set ``rollout.kv_tokens`` (``--kv_tokens``, default 96 per
   cell: three reservations of the tiny task's calls, prompt 21 + 12 new - 1 = 32 tokens, so
   the step's 8 executions (256 tokens reserved at once) do not fit the two cells' 192 and
   idle contexts are evicted). The replay runs the simulator's memory model with the engine's
   pool rule (``sim.simulate(..., engine_pool=(max_new_tokens, max_len))``, pool =
   ``kv_tokens``, slots = ``rollout.slots``) and also compares the run's total evictions
   (``Proxy.kv_stats()['kv_evictions']``, every step) with the simulated ones.

6. ``--admission resident``: both runs set ``rollout.admission`` (gyre/rollout/proxy.py:
   an execution's calls stay on the cell that admitted it, with a KV reservation that grows
   with its context). The replay sets ``CostModel.resident_admission``: with the engine's
   pool rule that is ``memory.EngineResidentPools`` (the proxy's ``ResidentAdmission``
   ledger). Where a simulator does not model it, the prediction is made without it and the
   output says so (``sim_admission``: false), beside the token-pool model with admission.

7. Each run writes ``replay.json`` beside its ``trace.jsonl`` (the fitted cost models and the
   measured figures); ``--replay WORKDIR`` predicts that run again without running anything
   (after a change to the simulator).

Prints a per-step table; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.calibrate_cpu import setup, tiny_config  # noqa: E402


class Probe:
    """Times the programs the controllers of this process run, per engine step and RL step.

    Rows feed :func:`gyre.elastic.calibration.fit_run` (an in-situ calibration) and the
    "time inside the modelled programs" figure. Installed once per process (it wraps the
    classes); ``reset`` starts a new run's rows.
    """

    def __init__(self):
        from gyre.rl.controller import Controller
        from gyre.rollout.engine import Engine
        from gyre.train.step import Trainer

        self.reset()
        probe, engine_step, engine_decode = self, Engine.step, Engine._decode

        def step(eng, *a, **k):
            probe.decode, chunks0, t = (0, 0.0), eng.stats["prefill_chunks"], time.perf_counter()
            try:
                return engine_step(eng, *a, **k)
            finally:
                dt = time.perf_counter() - t
                batch, ctx = probe.decode
                probe.engine_steps.append({
                    "step": len(probe.steps), "chunks": eng.stats["prefill_chunks"] - chunks0,
                    "batch": batch, "context_tokens": ctx, "seconds": dt,
                })  # fmt: skip
                probe.cur["engine_s"] += dt

        def decode(eng, active, done):
            probe.decode = (len(active), float(sum(eng.slots[i].length for i in active)))
            return engine_decode(eng, active, done)

        Engine.step, Engine._decode = step, decode
        # Gradients dispatch asynchronously; finish_step waits for them, so train_s is whole.
        for cls, name, key in ((Trainer, "compute_grads", "train_s"),
                               (Controller, "finish_step", "train_s"),
                               (Trainer, "save", "checkpoint_s")):  # fmt: skip
            self._wrap(cls, name, key)

    def _wrap(self, cls, name: str, key: str) -> None:
        fn, probe = getattr(cls, name), self

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                probe.cur[key] += time.perf_counter() - t
                if name == "compute_grads":
                    probe.cur["microbatches"] += 1

        setattr(cls, name, wrapper)

    def reset(self) -> None:
        self.engine_steps: list[dict] = []
        self.steps: list[dict] = []
        self.cur = collections.Counter()
        self.decode = (0, 0.0)

    def end_step(self, wall_s: float) -> None:
        keys = ("engine_s", "train_s", "checkpoint_s", "microbatches")
        self.steps.append({"wall_s": wall_s, **{k: self.cur[k] for k in keys}})
        self.cur = collections.Counter()


def run_real(cfg, workdir: str, probe: Probe) -> tuple[list[float], object]:
    """Runs the controller, checkpointing every step as the rl experiment does;
    -> (wall seconds at each step's end since the run began, ctrl)."""
    from gyre.rl.builder import build_runtime, build_specs
    from gyre.rl.controller import Controller

    probe.reset()
    rt = build_runtime(build_specs(cfg), workdir)
    if rt.proxy.admission != cfg.rollout.admission:
        raise SystemExit(f"the proxy admits by {rt.proxy.admission!r}, not "
                         f"{cfg.rollout.admission!r}: gyre/rl/builder.py must pass it")  # fmt: skip
    ctrl = Controller(rt)
    ends: list[float] = []
    t0 = time.perf_counter()

    async def on_step(record):
        rt.trainer.save(rt.checkpointer, {"next_step": record.version}, wait=True)
        ends.append(time.perf_counter() - t0)
        probe.end_step(ends[-1] - (ends[-2] if len(ends) > 1 else 0.0))

    try:
        asyncio.run(ctrl.run(on_step))
    finally:
        rt.checkpointer.close()
    return ends, ctrl


def fit_probe(probe: Probe, trace: list, base, source: str):
    """A cost model fitted from the probe's timings of the run that wrote ``trace``.

    Step 0 loads the compiled programs: left out, as in the comparison.
    """
    from gyre.elastic import calibration

    steps = [dict(row, calls=sum(len(ex.calls) for ex in batch))
             for row, batch in zip(probe.steps, trace)]  # fmt: skip
    engine_steps = [r for r in probe.engine_steps if r["step"] > 0]
    return calibration.fit_run(engine_steps, steps[1:], base, source)


def calibrate_in_situ(cfg, args, probe: Probe, base):
    """A calibration run (another seed: other tasks) -> (a cost model fitted from its timings,
    that run's wall seconds over steps 1..N)."""
    from gyre.elastic import workload

    cal_cfg = cfg.copy_and_resolve_references()
    cal_cfg.seed = cfg.seed + 1
    workdir = tempfile.mkdtemp(prefix="gyre_sim_vs_real_cal_")
    ends, _ = run_real(cal_cfg, workdir, probe)
    trace = workload.read_trace(os.path.join(workdir, "trace.jsonl"))
    source = (f"in situ: timings of a real controller run (seed {cal_cfg.seed}, "
              f"{args.steps} steps x {args.tasks} tasks) by benchmarks/sim_vs_real.py")  # fmt: skip
    return fit_probe(probe, trace, base, source), float(ends[-1] - ends[0])


def predict(cfg, steps: list, num_cells: int, cost, engine_pool: bool = True):
    """Simulates the recorded executions under the run's own policy and parameters (with the
    engine's KV pool rule when ``cost`` has a memory model, unless ``engine_pool`` is False)."""
    from gyre.elastic import sim
    from gyre.rl.builder import build_specs

    pool = (cfg.rollout.max_new_tokens, cfg.rollout.max_len) if cost.memory else None
    return sim.simulate(
        steps, num_cells, cfg.scheduler.policy, cost, build_specs(cfg).scheduler,
        engine_pool=pool if engine_pool else None,
    )  # fmt: skip


def predict_admission(cfg, steps: list, num_cells: int, cost):
    """The prediction with the run's admission -> (result, whether the simulator modelled the
    admission, the simulator's reason where it did not)."""
    if cfg.rollout.admission != "resident":
        return predict(cfg, steps, num_cells, cost), True, ""
    try:
        with_adm = dataclasses.replace(cost, resident_admission=True)
        return predict(cfg, steps, num_cells, with_adm), True, ""
    except ValueError as exc:  # not modelled with the engine's pool rule
        return predict(cfg, steps, num_cells, cost), False, str(exc)


def within(err: float) -> bool:
    return abs(err) <= 0.15


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--cell_size", type=int, default=4)
    ap.add_argument("--calibration", default="in-situ",
                    help="'in-situ' (fit from a calibration run in this process), 'isolated' "
                    "(time the programs alone in this process) or a calibration file")  # fmt: skip
    ap.add_argument("--cache_dir", default="/tmp/xcache")
    ap.add_argument("--kv-limited", dest="kv_limited", action="store_true",
                    help="a KV pool of --kv_tokens per cell (evictions); compares them too")  # fmt: skip
    ap.add_argument("--kv_tokens", type=int, default=96, help="rollout.kv_tokens with --kv-limited")
    ap.add_argument("--admission", default="none", choices=("none", "resident"),
                    help="rollout.admission of both runs (and of the replay where modelled)")  # fmt: skip
    ap.add_argument("--replay", default="",
                    help="a workdir of an earlier run (its replay.json and trace.jsonl): predict "
                    "again from its recorded timings, without running the controller")  # fmt: skip
    args = ap.parse_args()
    if args.replay:  # the recorded run's own settings
        with open(os.path.join(args.replay, "replay.json")) as f:
            rec = json.load(f)
        for k in ("steps", "tasks", "cell_size", "kv_limited", "kv_tokens", "admission",
                  "calibration"):  # fmt: skip
            setattr(args, k, rec["args"][k])
    cfg = tiny_config(args.cell_size, args.cache_dir)
    cfg.run.steps, cfg.run.tasks_per_step = args.steps, args.tasks
    # The simulator's engine decodes one token per step: the real one does the same here, so
    # an engine step is what the cost model prices (the default runs loops of 16 tokens).
    cfg.rollout.decode_steps = 1
    if args.kv_limited:
        cfg.rollout.kv_tokens = args.kv_tokens
    cfg.rollout.admission = args.admission
    from gyre.elastic import workload
    from gyre.elastic.costs import CostModel

    if args.replay:
        workdir = args.replay
        cost, own = CostModel(**rec["cost"]), CostModel(**rec["own"])
        cal_s, ends, num_cells = rec["calibration_run_s"], rec["ends"], rec["cells"]
        kv_real, adm_real, spent = rec["kv_real"], rec["adm_real"], rec["spent"]
        steps = workload.read_trace(os.path.join(workdir, "trace.jsonl"))
    else:
        workdir = tempfile.mkdtemp(prefix="gyre_sim_vs_real_")
        setup(cfg, workdir)
        cost, cal_s, ends, num_cells, kv_real, adm_real, spent, steps, own = run_both(
            cfg, args, workdir
        )
        with open(os.path.join(workdir, "replay.json"), "w") as f:
            json.dump({"args": vars(args), "cost": dataclasses.asdict(cost),
                       "own": dataclasses.asdict(own), "calibration_run_s": cal_s,
                       "ends": ends, "cells": num_cells, "kv_real": kv_real,
                       "adm_real": adm_real, "spent": spent}, f)  # fmt: skip
    report(cfg, args, workdir, cost, cal_s, ends, num_cells, kv_real, adm_real, spent, steps, own)


def run_both(cfg, args, workdir: str):
    """The calibration run (in situ) and the measured run -> what the comparison reads."""
    from gyre.elastic import calibration, workload

    probe = Probe()
    cal_s = None  # the in-situ calibration run's wall time over steps 1..N
    # Slots, chunk, switch costs and the shared-cores setting of the committed CPU file.
    base = dataclasses.replace(calibration.load("cpu_measured"), shared_cores=True)
    if args.calibration == "in-situ":
        cost, cal_s = calibrate_in_situ(cfg, args, probe, base)
    elif args.calibration == "isolated":
        from benchmarks.calibrate_cpu import calibrate

        cost = calibration.from_dict(calibrate(args.cell_size, 3, args.cache_dir))
    else:
        cost = calibration.load(args.calibration)
    cost = dataclasses.replace(cost, shared_cores=True, pack_by_group=True)  # as the controller
    if args.kv_limited:  # the engine's pool: kv_tokens per cell, its slot count
        cost = dataclasses.replace(
            cost, kv_capacity_tokens=float(args.kv_tokens), slots=cfg.rollout.slots,
            cell_capacity=0.0,
        )  # fmt: skip

    ends, ctrl = run_real(cfg, workdir, probe)
    kv_real = {k: float(v) for k, v in ctrl.proxy.kv_stats().items()}
    adm_real = {k: float(v) for k, v in ctrl.proxy.admission_stats().items()}
    steps = workload.read_trace(os.path.join(workdir, "trace.jsonl"))
    spent = [r["engine_s"] + r["train_s"] + r["checkpoint_s"] for r in probe.steps]
    # The model fitted on this run's own timings: its error is the model's structure alone,
    # without the drift of the programs' speed between two runs.
    own = fit_probe(probe, steps, cost, "this run")
    return cost, cal_s, ends, len(ctrl.rt.cells), kv_real, adm_real, spent, steps, own


def report(cfg, args, workdir, cost, cal_s, ends, num_cells, kv_real, adm_real, spent, steps, own):
    """Predicts the recorded run and prints the comparison (the last line: one JSON object)."""
    res, sim_adm, why = predict_admission(cfg, steps, num_cells, cost)
    measured, predicted = np.diff(ends), np.diff(res.step_end_s)
    calls = [sum(len(ex.calls) for ex in b) for b in steps]
    tokens = [sum(ex.train_tokens for ex in b) for b in steps]
    own_res = predict_admission(cfg, steps, num_cells, own)[0]
    own_p = float(np.diff(own_res.step_end_s).sum())
    print(f"workdir {workdir} (replay: --replay {workdir})")
    print(f"real run: {num_cells} cells, policy {cfg.scheduler.policy}, calibration "
          f"{args.calibration!r} ({cost.source})")  # fmt: skip
    print("cost model (ms): " + ", ".join(
        f"{k} {getattr(cost, k) * 1e3:.3f}" for k in (
            "decode_base_s", "decode_per_seq_s", "prefill_per_token_s", "prefill_call_s",
            "microbatch_s", "optimizer_s", "publish_s", "checkpoint_s")))  # fmt: skip
    if args.admission != "none":
        sc = res.counters
        print(f"admission {args.admission!r}: real run preempted {int(adm_real['preemptions'])}, "
              f"expired {int(adm_real['expired'])}; simulated preempted {int(sc['preemptions'])}, "
              f"expired {int(sc['expired'])}, pinned contexts evicted "
              f"{int(sc['pinned_evictions'])}; the replay "
              + ("models it" if sim_adm else f"does NOT model it ({why}): predicted without it"))  # fmt: skip
    print(f"simulated schedule: {res.switches} role switches")
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
    if cal_s is not None:
        print(
            f"the calibration run (other tasks) took {cal_s:.3f} s over the same steps "
            f"({(cal_s - total_m) / total_m:+.1%} vs this run): drift between the two runs"
        )
    print(f"time inside the modelled programs: {in_programs:.3f} s ({in_programs / total_m:.0%} of"
          f" measured); host time outside them: {total_m - in_programs:.3f} s")  # fmt: skip
    print(
        f"fitted on this run's own timings the model predicts {own_p:.3f} s "
        f"({(own_p - total_m) / total_m:+.1%}): the model's own error, without drift between runs"
    )
    kv = {}
    if args.kv_limited:
        ev_real, ev_sim = int(kv_real["kv_evictions"]), int(res.counters["evictions"])
        ev_err = (ev_sim - ev_real) / ev_real if ev_real else float(ev_sim > 0)
        ev_own = int(own_res.counters["evictions"])
        print(f"KV pool {args.kv_tokens} tokens per cell: evictions (all steps) measured {ev_real}"
              f", predicted {ev_sim}, error {ev_err:+.1%}; re-prefilled tokens measured "
              f"{int(kv_real['kv_reprefilled_tokens'])}, predicted "
              f"{int(res.counters['reprefill_tokens'])}; check |error| <= 15% on wall time and "
              f"evictions: {'pass' if within(err) and within(ev_err) else 'FAIL'}")  # fmt: skip
        kv = {"kv_tokens": args.kv_tokens, "wall_error": round(err, 4),
              "evictions_real": ev_real, "evictions_sim": ev_sim,
              "evictions_error": round(ev_err, 4), "evictions_own_fit": ev_own,
              "reprefilled_real": int(kv_real["kv_reprefilled_tokens"]),
              "reprefilled_sim": int(res.counters["reprefill_tokens"]),
              "kv_within_15pct": bool(within(err) and within(ev_err))}  # fmt: skip
    if args.admission != "none":
        kv |= {"admission": args.admission, "sim_admission": sim_adm,
               "preemptions_real": int(adm_real["preemptions"]), "expired_real": int(adm_real["expired"]),
               "preemptions_sim": int(res.counters["preemptions"]),
               "expired_sim": int(res.counters["expired"]),
               "pinned_evictions_sim": int(res.counters["pinned_evictions"])}  # fmt: skip
        if args.kv_limited and not sim_adm:  # the token-pool model, which does model it
            tp = predict(cfg, steps, num_cells,
                         dataclasses.replace(cost, resident_admission=True), engine_pool=False)  # fmt: skip
            tp_s = float(np.diff(tp.step_end_s).sum())
            print(f"token-pool model with admission (no engine pool rule): predicted {tp_s:.3f} s "
                  f"({(tp_s - total_m) / total_m:+.1%}), evictions {int(tp.counters['evictions'])}")  # fmt: skip
            kv |= {"predicted_token_pools_s": round(tp_s, 4),
                   "token_pools_rel_error": round((tp_s - total_m) / total_m, 4),
                   "evictions_token_pools": int(tp.counters["evictions"])}  # fmt: skip
    print(json.dumps({
        "steps_compared": len(measured), "cells": num_cells,
        "measured_s": round(total_m, 4), "predicted_s": round(total_p, 4),
        "rel_error": round(err, 4), "per_step_abs_error_median": round(float(np.median(per_step)), 4),
        "per_step_abs_error_max": round(float(per_step.max()), 4),
        "measured_step_s": [round(float(x), 4) for x in measured],
        "predicted_step_s": [round(float(x), 4) for x in predicted],
        "first_step_measured_s": round(ends[0], 4), "within_15pct": bool(abs(err) <= 0.15),
        "in_programs_s": round(in_programs, 4), "calibration": args.calibration,
        "calibration_run_s": None if cal_s is None else round(cal_s, 4),
        "predicted_own_fit_s": round(own_p, 4), "sim_switches": res.switches, "own_fit_rel_error": round((own_p - total_m) / total_m, 4),
        **kv,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
