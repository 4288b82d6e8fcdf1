"""The experiments launch.py runs (``run.entry``): each reads the config once, through the
builder, and hands specs to the library.

- ``rl``: supervised warm start, RL under the elastic scheduler, evaluation, plots;
- ``harness``: the agent harness with scripted policies on the ledger task (no model);
- ``smoke``: cells, a tiny model, one train step, a role move.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

from gyre import plots, smoke
from gyre.agent.driver import run_scripted_harness
from gyre.envs.registry import make_env
from gyre.metrics import MetricsWriter, progress_line, read_metrics
from gyre.rl.builder import build_runtime, build_specs
from gyre.rl.controller import Controller
from gyre.rl.progress import RunLedger
from gyre.rl.warmstart import warm_start
from gyre.rl.work import StepRecord, step_metrics

PROGRESS_KEYS = ("reward", "success", "partial", "loss", "eval_success", "role_train_frac",
                 "step_seconds")  # fmt: skip


class StepRecorder:
    """What happens after each optimizer step, in an order that makes resume exact: the
    ledger line, the evaluation, the checkpoint, then the metrics row."""

    def __init__(self, rt, ctrl: Controller, ledger: RunLedger, writer: MetricsWriter):
        self.rt, self.ctrl, self.ledger, self.writer = rt, ctrl, ledger, writer

    async def __call__(self, record: StepRecord) -> None:
        specs = self.rt.specs
        metrics = step_metrics(record, specs.trajectory.reward)
        self.ledger.record_step(record.step, record.execution_ids)
        last = record.version == specs.run.steps
        if specs.eval.due(record.version, last):
            metrics.update(await self.ctrl.evaluate(specs.eval.tasks, specs.eval.seed))
        if last or record.version % specs.run.checkpoint_every == 0:
            t0 = time.time()
            self.rt.trainer.save(self.rt.checkpointer, {"next_step": record.version}, wait=True)
            metrics["checkpoint_seconds"] = round(time.time() - t0, 4)
        step = metrics.pop("step")
        self.writer.write(step, metrics)
        print(progress_line(step + 1, specs.run.steps, metrics, PROGRESS_KEYS), flush=True)


def rl(cfg, workdir: str, after_microbatch=None) -> dict:
    """Runs (or resumes) one RL experiment in ``workdir`` and returns its summary.

    after_microbatch: a hook called with the micro-batch count (tests kill the run with it).
    """
    t0 = time.time()
    specs = build_specs(cfg)
    rt = build_runtime(specs, workdir)
    ledger = RunLedger(workdir)
    if rt.resumed:
        ledger.truncate(rt.trainer.version)
    fresh = rt.trainer.version == 0
    summary: dict = {"name": specs.name, "scheduler": specs.run.policy, "cells": len(rt.cells)}
    sft = specs.sft
    if fresh and sft.steps:
        seed = sft.recipe.seed
        init = rt.trainer.params if seed == specs.seed else rt.init_params(seed)
        params, info = warm_start(
            sft, rt.cells, rt.graphdef, init, sft.dir or rt.path("warmstart"),
            # keyed by the warm start's seed: its stopping rule may read this evaluation
            lambda p: rt.evaluate_now(p, sft.eval_tasks, seed + 1),
        )  # fmt: skip
        rt.install(params)
        summary["warm_start"] = {k: v for k, v in info.items() if k != "history"}
    if fresh and specs.eval.tasks:
        summary["eval_start"] = rt.evaluate_now(rt.trainer.params, specs.eval.tasks, specs.seed)
        print(f"before RL: {summary['eval_start']}", flush=True)

    ctrl = Controller(rt, after_microbatch=after_microbatch)
    writer = MetricsWriter(workdir)
    try:
        asyncio.run(ctrl.run(StepRecorder(rt, ctrl, ledger, writer)))
    finally:
        writer.close()
        rt.checkpointer.close()
    rows = read_metrics(workdir)
    summary.update(
        steps=len(rows),
        final_version=rt.trainer.version,
        wall_seconds=round(time.time() - t0, 1),
        reward_first=rows[0]["reward"] if rows else None,
        reward_last=rows[-1]["reward"] if rows else None,
        eval_end={
            k: rows[-1][k] for k in ("eval_success", "eval_milestones") if rows and k in rows[-1]
        },
        handovers=dict(ctrl.handovers),
        prefix_hit_rate=round(rt.proxy.prefix_hit_rate(), 4),
    )
    plots.learning_curves(rows, rt.path("learning_curves.png"),
                          ("reward", "success", "partial", "eval_success", "loss"))  # fmt: skip
    plots.role_timeline(ctrl.timeline.all_spans(), rt.path("roles.png"))
    with open(rt.path("timeline.json"), "w") as f:
        json.dump(ctrl.timeline.to_json(), f)
    print("summary: " + json.dumps(summary, default=str), flush=True)
    return summary


def harness(cfg, workdir: str) -> dict:
    """The scripted harness on the ledger task; figures to <workdir>/harness.json."""
    specs = build_specs(cfg)
    run = specs.run
    summary = run_scripted_harness(make_env(specs.env), specs.agent, specs.seed,
                                   run.tasks_per_step, run.samples_per_task)  # fmt: skip
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "harness.json"), "w") as f:
        json.dump(summary, f, indent=2, default=str)
    return summary


def smoke_test(cfg, workdir: str) -> dict:
    """Cells, a tiny model, one forward/backward, a role move (gyre/smoke.py)."""
    specs = build_specs(cfg)
    return smoke.run(specs.mesh, specs.model, specs.seed, workdir)
