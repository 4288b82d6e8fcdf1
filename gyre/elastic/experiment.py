"""The RL experiment behind launch.py's default entry: warm start, RL, evaluation, plots."""

from __future__ import annotations

import asyncio
import json
import os
import time

from gyre import plots
from gyre.elastic.controller import Controller
from gyre.metrics import MetricsWriter, progress_line, read_metrics
from gyre.model import decoder
from gyre.train.warmstart import sft_seed, warm_start


def train_and_evaluate(cfg, workdir: str) -> dict:
    """Runs (or resumes) one RL experiment in ``workdir`` and returns its summary."""
    t0 = time.time()
    ctrl = Controller(cfg, workdir)
    fresh = ctrl.trainer.version == 0
    summary: dict = {"name": cfg.name, "scheduler": cfg.run.scheduler, "cells": len(ctrl.cells)}
    eval_n = cfg.run.eval_tasks
    if fresh and cfg.run.sft_steps:
        folder = cfg.run.warmstart_dir or os.path.join(workdir, "warmstart")
        init = ctrl.trainer.params
        if sft_seed(cfg) != cfg.seed:  # the warm start begins from its own seed's weights
            init = decoder.init_sharded(cfg.model, sft_seed(cfg), ctrl.cells[0], "train")[1]
        params, info = warm_start(
            cfg, ctrl.cells, ctrl.graphdef, init, folder,
            # keyed by the warm start's seed: its stopping rule may read this evaluation
            lambda p: ctrl.evaluate_sync(p, max(eval_n, 16), sft_seed(cfg) + 1),
        )  # fmt: skip
        ctrl.install(params)
        summary["warm_start"] = {k: v for k, v in info.items() if k != "history"}
    if fresh and eval_n:
        summary["eval_start"] = ctrl.evaluate_sync(ctrl.trainer.params, eval_n, cfg.seed)
        print(f"before RL: {summary['eval_start']}", flush=True)

    writer = MetricsWriter(workdir)

    def on_step(metrics):
        step = metrics.pop("step")
        writer.write(step, metrics)
        print(progress_line(step + 1, cfg.run.steps, metrics,
                            ("reward", "success", "partial", "loss", "eval_success",
                             "role_train_frac", "step_seconds")), flush=True)  # fmt: skip

    try:
        asyncio.run(ctrl.run(on_step))
    finally:
        writer.close()
        ctrl.ckpt.close()
    rows = read_metrics(workdir)
    summary.update(
        steps=len(rows),
        final_version=ctrl.trainer.version,
        wall_seconds=round(time.time() - t0, 1),
        reward_first=rows[0]["reward"] if rows else None,
        reward_last=rows[-1]["reward"] if rows else None,
        eval_end={
            k: rows[-1][k] for k in ("eval_success", "eval_milestones") if rows and k in rows[-1]
        },
        handovers=dict(ctrl.handovers),
        prefix_hit_rate=round(ctrl.proxy.prefix_hit_rate(), 4),
    )
    plots.learning_curves(rows, os.path.join(workdir, "learning_curves.png"),
                          ("reward", "success", "partial", "eval_success", "loss"))  # fmt: skip
    plots.role_timeline(ctrl.timeline.all_spans(), os.path.join(workdir, "roles.png"))
    with open(os.path.join(workdir, "timeline.json"), "w") as f:
        json.dump(ctrl.timeline.to_json(), f)
    print("summary: " + json.dumps(summary, default=str), flush=True)
    return summary
