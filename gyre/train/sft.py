"""Supervised fine-tuning through the RL path: same packing, same per-cell programs.

The SFT loss is the cross-entropy ``-sum_j w_j logp_j`` on trainable tokens (``w > 0``;
context and masked tokens have ``w = 0``), gathered at ``pred`` like the policy loss, so a
tree-packed batch trains every selected path once per shared token. Use
``Trainer(..., objective="sft")`` (or :func:`sft_trainer`) with batches from
:func:`records_batch`; gyre.train.warmstart builds the ledger warm start on top of this.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gyre.train.step import Trainer
from gyre.trajectory.advantages import path_coefficients
from gyre.trajectory.pack import PackedBatch, pack
from gyre.trajectory.records import CallRecord, validate_execution
from gyre.trajectory.select import select_paths
from gyre.trajectory.tree import build_tree


def sft_trainer(cfg, cells, graphdef, params, **kw) -> Trainer:
    """A Trainer whose gradient program uses the cross-entropy objective."""
    return Trainer(cfg, cells, graphdef, params, objective="sft", **kw)


def records_batch(
    executions: Sequence[list[CallRecord]],
    cfg,
    max_paths: int = 0,
    loss_mode: str = "token-mean",
    buckets: Sequence[int] | None = None,
) -> PackedBatch:
    """Packs demonstrations (lists of call records) as tree rows for SFT.

    Every generated token of a selected path is a target; ``w`` carries the loss-mode
    coefficients (token-mean: each target token of the step weighs 1 / their number) and
    ``adv_pos = w`` so the batch also reads as a positive-advantage policy batch.
    """
    if not executions:
        raise ValueError("records_batch got no executions")
    trees = []
    for records in executions:
        validate_execution(records, cfg.model.vocab_size)
        trees.append(build_tree(records))
    kept = [list(select_paths(t, max_paths).kept) for t in trees]
    lens = [np.asarray([t.path_trainable(c) for c in cs]) for t, cs in zip(trees, kept)]
    coefs = path_coefficients(lens, loss_mode)
    buckets = buckets or (cfg.train.rows_per_microbatch,)
    batch = pack(trees, kept, coefs, np.ones(len(trees)), cfg.trajectory.row_len, buckets)
    return batch._replace(adv_pos=batch.w.copy(), adv_neg=np.zeros_like(batch.w))
