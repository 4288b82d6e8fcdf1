"""Supervised warm start on expert demonstrations, through the same packing path as RL.

Demonstrations are real harness executions of a scripted expert (gyre/rl/demos.py): on the
ledger task with occasional near-miss mistakes that are then corrected; on the calculator chat
task ('calc', gyre/envs/calc_chat.py) in chat text through the run's tokenizer and chat
template, calling the calculator or (``sft.mistake_prob`` of the time) answering at once.
Tasks without a demonstrator refuse a warm start (:data:`DEMONSTRATED`). They go through the one packing
pipeline (``build_batch(..., "sft", token_masks)``): every selected path gets the token-mean
coefficient, and the value digits of wrong commits get zero weight (otherwise the model learns
to err on purpose).

Training stops when the greedy held-out milestone rate (the per-step accuracy) reaches
``target_accuracy`` or after ``steps``; the result is cached in a folder keyed by the hash of
the :class:`~gyre.rl.specs.SftRecipe`, so later runs (and ablations) start from the same
weights without paying for it again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time

from gyre.rl.demos import chat_demo_executions, demo_executions
from gyre.rl.specs import SftRecipe, SftSpec
from gyre.train.checkpoint import Checkpointer
from gyre.train.step import Trainer
from gyre.trajectory.batch import ExecutionResult, build_batch
from gyre.trajectory.pack import PackedBatch

# Tasks with a scripted demonstrator; 'calc' speaks chat text, so its warm start needs the env.
DEMONSTRATED = ("ledger", "calc")


def demo_batch(recipe: SftRecipe, seed: int, n: int, env=None) -> PackedBatch:
    """n demonstrations packed as tree rows; w = token-mean weight, 0 on mistaken digits.
    ``env``: the run's environment (required for a chat task: it holds the chat format)."""
    name = recipe.env.name
    if name not in DEMONSTRATED:
        raise ValueError(f"no demonstrations for the task {name!r} (a warm start needs one of "
                         f"{list(DEMONSTRATED)}): set sft.steps=0")  # fmt: skip
    if name == "calc":
        if env is None:
            raise ValueError("the calc warm start needs the run's chat environment (env=)")
        demos = chat_demo_executions(env, seed, n, direct_prob=recipe.mistake_prob,
                                     context_window=recipe.context_window)  # fmt: skip
    else:
        demos = demo_executions(
            seed,
            n,
            num_ops=recipe.env.num_ops,
            mistake_prob=recipe.mistake_prob,
            modulus=recipe.env.modulus,
            context_window=recipe.context_window,
        )
    results = [ExecutionResult(d.records, d.task.task_id) for d in demos]
    batch, report = build_batch(results, recipe.trajectory, "sft", [d.loss_masks for d in demos])
    if report.rejected:
        raise ValueError(f"demonstrations rejected by the packer: {report.rejected}")
    return batch


def fingerprint(recipe: SftRecipe, env=None) -> str:
    """16 hex digits of the recipe's hash: the warm-start cache key. A chat environment's
    tokenizer and chat template are part of it (they make the demonstrations' tokens)."""
    text = json.dumps(dataclasses.asdict(recipe), sort_keys=True)
    chat = getattr(env, "chat", None)
    if chat is not None:
        text += chat.tokenizer.to_str() + chat.template_text
        text += json.dumps([chat.enable_thinking, chat.keep_thinking, chat.stop_ids])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def warm_start(spec: SftSpec, cells, graphdef, params, folder: str, evaluate, log=print,
               on_step=None, env=None):  # fmt: skip
    """Returns (params, info). ``evaluate(params) -> dict`` with 'eval_milestones' in [0, 1];
    ``log(line)`` reports each evaluation; ``on_step(step, info)`` follows every step;
    ``env``: the run's environment (a chat task's demonstrations are spoken through it).

    ``params`` (the starting weights of a fresh warm start) must be initialised from
    ``spec.recipe.seed``: the cache is keyed by that seed.

    A cached warm start in ``folder`` with the same fingerprint is loaded, and continued if
    it stopped short of ``spec.steps`` without reaching the target accuracy. Progress is
    saved at every evaluation, so a killed warm start resumes too.
    """
    recipe = spec.recipe
    fp = fingerprint(recipe, env)
    info_path = os.path.join(folder, f"warmstart-{fp}.json")
    os.makedirs(folder, exist_ok=True)
    ckpt = Checkpointer(os.path.join(folder, f"checkpoints-{fp}"), keep=1)
    info = {"fingerprint": fp, "steps": 0, "accuracy": 0.0, "history": [], "seconds": 0.0}
    try:
        if os.path.exists(info_path) and ckpt.latest_step() is not None:
            trainer, _ = Trainer.restore(recipe.trainer, cells, graphdef, ckpt)
            with open(info_path) as f:
                info = json.load(f)
            if spec.done(trainer.step, info["accuracy"]):
                return trainer.params, dict(info, cached=True)
        else:
            trainer = Trainer(recipe.trainer, cells, graphdef, params)
        t0, spent = time.time(), info["seconds"]
        while not spec.done(trainer.step, info["accuracy"]):
            step = trainer.step
            batch = demo_batch(recipe, seed=recipe.seed * 1_000_003 + step, n=recipe.batch,
                               env=env)  # fmt: skip
            out = trainer.train_step(cells, batch)
            if on_step is not None:
                on_step(trainer.step, info)
            if trainer.step % spec.eval_every and trainer.step < spec.steps:
                continue
            acc = float(evaluate(trainer.params)["eval_milestones"])
            seconds = round(spent + time.time() - t0, 1)
            info["history"].append({"step": trainer.step, "nll": out.metrics["loss"],
                                    "accuracy": acc, "seconds": seconds})  # fmt: skip
            info.update(steps=trainer.step, accuracy=acc, seconds=seconds)
            log(f"warm start step {trainer.step}: nll {out.metrics['loss']:.4f} "
                f"per-step accuracy {acc:.3f}")  # fmt: skip
            trainer.save(ckpt, {"fingerprint": fp}, wait=True)
            with open(info_path, "w") as f:
                json.dump(info, f, indent=2)
        if spec.target_accuracy and info["accuracy"] < spec.target_accuracy:
            log(f"warm start: stopped at sft.steps={spec.steps} with per-step accuracy "
                f"{info['accuracy']:.3f}, below its target sft.target_accuracy="
                f"{spec.target_accuracy}")  # fmt: skip
        return trainer.params, dict(info, cached=False)
    finally:
        ckpt.close()
