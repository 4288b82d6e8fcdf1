"""Supervised warm start on expert ledger demonstrations, through the same packing path as RL.

Demonstrations are real harness executions of the scripted expert (gyre/envs/demos.py) with
occasional near-miss mistakes that are then corrected. They are built into trees and packed
exactly like RL data; every selected path gets the token-mean coefficient, and the value
digits of wrong commits get zero weight (otherwise the model learns to err on purpose).

Training stops when the greedy held-out milestone rate (the per-step accuracy) reaches
``run.sft_target_accuracy`` or after ``run.sft_steps``; the result is cached in a folder
keyed by the model and task settings, so later runs (and ablations) start from the same
weights without paying for it again.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import numpy as np

from gyre.envs.demos import demo_executions
from gyre.train.checkpoint import Checkpointer
from gyre.train.step import Trainer
from gyre.trajectory.advantages import path_coefficients
from gyre.trajectory.pack import PackedBatch, pack
from gyre.trajectory.select import select_paths
from gyre.trajectory.tree import build_tree


def demo_batch(cfg, seed: int, n: int) -> PackedBatch:
    """n demonstrations packed as tree rows; w = token-mean weight, 0 on mistaken digits."""
    demos = demo_executions(
        seed,
        n,
        num_ops=cfg.env.num_ops,
        mistake_prob=cfg.run.sft_mistake_prob,
        modulus=cfg.env.modulus,
        context_window=cfg.agent.context_window,
    )
    trees = [build_tree(d.records) for d in demos]
    kept = [list(select_paths(t, 0).kept) for t in trees]
    node_masks = []
    for demo, tree in zip(demos, trees):
        mask = np.ones(tree.num_nodes, np.float32)
        for c, (rec, m) in enumerate(zip(demo.records, demo.loss_masks)):
            nodes = tree.path_nodes(c)[-rec.completion.size :]
            mask[nodes] = np.minimum(mask[nodes], m)
        node_masks.append(mask)
    lens = [np.asarray([t.path_trainable(c) for c in cs]) for t, cs in zip(trees, kept)]
    coefs = path_coefficients(lens, "token-mean")
    batch = pack(trees, kept, coefs, np.ones(len(trees)), cfg.trajectory.row_len,
                 (cfg.train.rows_per_microbatch,))  # fmt: skip
    e, node = batch.exec_index, batch.node_index
    keep = np.ones_like(batch.w)
    for i, mask in enumerate(node_masks):
        sel = e == i
        keep[sel] = mask[node[sel]]
    w = (batch.w * keep).astype(np.float32)
    return batch._replace(w=w, adv_pos=w, adv_neg=np.zeros_like(w))


def sft_seed(cfg) -> int:
    """The warm start's seed: ``run.sft_seed``, or ``seed`` when that is -1."""
    return cfg.seed if cfg.run.sft_seed < 0 else cfg.run.sft_seed


def fingerprint(cfg) -> str:
    """What the warm start's trajectory depends on: model, task, demonstrations, SFT settings.

    The stopping rule (sft_steps, sft_target_accuracy) is left out: demonstrations are keyed
    by step, so a longer warm start continues a cached shorter one exactly.
    """
    parts = {
        "model": cfg.model.to_dict(),
        "env": {k: cfg.env[k] for k in ("name", "num_ops", "modulus")},
        "sft": {k: cfg.run[k] for k in ("sft_batch", "sft_lr", "sft_mistake_prob")},
        "seed": sft_seed(cfg),
        "context_window": cfg.agent.context_window,
        "row_len": cfg.trajectory.row_len,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _done(cfg, steps: int, accuracy: float) -> bool:
    target = cfg.run.sft_target_accuracy
    return steps >= cfg.run.sft_steps or bool(target and accuracy >= target)


def warm_start(cfg, cells, graphdef, params, folder: str, evaluate) -> tuple[object, dict]:
    """Returns (params, info). ``evaluate(params) -> dict`` with 'eval_milestones' in [0, 1].

    ``params`` (the starting weights of a fresh warm start) must be initialised from
    ``sft_seed(cfg)``: the cache is keyed by that seed.

    A cached warm start in ``folder`` with the same fingerprint is loaded, and continued if
    it stopped short of ``run.sft_steps`` without reaching the target accuracy. Progress is
    saved at every evaluation, so a killed warm start resumes too.
    """
    fp = fingerprint(cfg)
    info_path = os.path.join(folder, f"warmstart-{fp}.json")
    sft_cfg = cfg.copy_and_resolve_references()
    sft_cfg.train.lr = cfg.run.sft_lr
    os.makedirs(folder, exist_ok=True)
    ckpt = Checkpointer(os.path.join(folder, f"checkpoints-{fp}"), keep=1)
    info = {"fingerprint": fp, "steps": 0, "accuracy": 0.0, "history": [], "seconds": 0.0}
    try:
        if os.path.exists(info_path) and ckpt.latest_step() is not None:
            trainer, _ = Trainer.restore(sft_cfg, cells, graphdef, ckpt)
            with open(info_path) as f:
                info = json.load(f)
            if _done(cfg, trainer.step, info["accuracy"]):
                return trainer.params, dict(info, cached=True)
        else:
            trainer = Trainer(sft_cfg, cells, graphdef, params, objective="sft")
        t0, spent = time.time(), info["seconds"]
        while not _done(cfg, trainer.step, info["accuracy"]):
            step = trainer.step
            batch = demo_batch(cfg, seed=sft_seed(cfg) * 1_000_003 + step, n=cfg.run.sft_batch)
            out = trainer.train_step(cells, batch)
            if trainer.step % cfg.run.sft_eval_every and trainer.step < cfg.run.sft_steps:
                continue
            acc = float(evaluate(trainer.params)["eval_milestones"])
            seconds = round(spent + time.time() - t0, 1)
            info["history"].append({"step": trainer.step, "nll": out.metrics["loss"],
                                    "accuracy": acc, "seconds": seconds})  # fmt: skip
            info.update(steps=trainer.step, accuracy=acc, seconds=seconds)
            print(f"warm start step {trainer.step}: nll {out.metrics['loss']:.4f} "
                  f"per-step accuracy {acc:.3f}", flush=True)  # fmt: skip
            trainer.save(ckpt, {"fingerprint": fp}, wait=True)
            with open(info_path, "w") as f:
                json.dump(info, f, indent=2)
        return trainer.params, dict(info, cached=False)
    finally:
        ckpt.close()
