"""One optimizer step's data: finished executions -> trees -> selection -> advantages -> rows.

The one packing pipeline of the project, for RL and for supervised steps alike:

    batch, report = build_batch(results, spec)                        # policy-gradient step
    batch, report = build_batch(demos, spec, "sft", token_masks)      # supervised step

A bad execution (malformed records, a path longer than a row) is rejected with its reason and
the rest of the step goes on; infrastructure errors are excluded (never trained on).
Advantages and loss coefficients are computed over the executions that survive. A supervised
step is the same batch with every advantage 1 (so ``adv_pos = w``), trained with the 'sft'
objective; ``token_masks`` zero the weight of chosen completion tokens (e.g. a demonstration's
deliberate mistakes). Objectives and the batch's fields: :mod:`gyre.trajectory.schema`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from gyre import bounds
from gyre.trajectory import schema
from gyre.trajectory.advantages import (
    LOSS_MODES,
    REWARDS,
    execution_score,
    group_advantages,
    normaliser_count,
    path_coefficients,
)
from gyre.trajectory.pack import flatten, pack, union_size
from gyre.trajectory.records import CallRecord, RecordError, validate_execution
from gyre.trajectory.schema import PackedBatch
from gyre.trajectory.select import select_paths
from gyre.trajectory.tree import Tree, build_tree

PACKINGS = ("tree", "flat")


@dataclasses.dataclass
class ExecutionResult:
    """A finished execution, as the harness returns it and the packer reads it.

    ``task_id`` groups executions for group-relative advantages (the samples of one task share
    it); ``score`` is the judge's score of the ending, None for an infrastructure error.
    ``end_reason`` defaults to the one the records carry.
    """

    records: list[CallRecord]
    task_id: str
    score: float | None = 0.0
    execution_id: str = ""
    end_reason: str = ""
    milestones: int = 0
    num_milestones: int = 0
    stats: dict = dataclasses.field(default_factory=dict)
    task: object = None  # the environment's task, opaque here (for the env's own use)

    def __post_init__(self):
        if self.records:
            self.execution_id = self.execution_id or self.records[0].execution_id
            self.end_reason = self.end_reason or self.records[-1].end_reason

    def __repr__(self) -> str:  # records are large: never print them
        return (
            f"ExecutionResult({self.execution_id!r}, {self.end_reason}, score={self.score}, "
            f"milestones={self.milestones}/{self.num_milestones}, calls={len(self.records)})"
        )


@dataclasses.dataclass(frozen=True)
class TrajectorySpec:
    """How executions become packed rows (frozen; see gyre/config.py for each setting)."""

    vocab_size: int
    max_paths: int = 5  # J; 0 = uncapped
    loss_mode: str = "two-level"
    std_normalize: bool = False
    row_len: int = 1024
    packing: str = "tree"
    reward: str = "partial"
    rows_per_microbatch: int = 4  # row counts are multiples of it (one compile per bucket)

    def __post_init__(self):
        bounds.check(self, "trajectory", rows_per_microbatch="train.rows_per_microbatch")
        if self.rows_per_microbatch < 1:  # the config's 0 (auto) is resolved by the builder
            raise ValueError(f"train.rows_per_microbatch must be >= 1 here (0, auto, is the "
                             f"config's), got {self.rows_per_microbatch}")  # fmt: skip
        if self.row_len % 128:
            raise ValueError(f"trajectory.row_len must be a multiple of 128, got {self.row_len}")
        for name, value, choices in (("loss_mode", self.loss_mode, LOSS_MODES),
                                     ("packing", self.packing, PACKINGS),
                                     ("reward", self.reward, REWARDS)):  # fmt: skip
            if value not in choices:
                raise ValueError(f"trajectory.{name} must be one of {choices}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class BatchReport:
    """What happened to each execution of the step. Indices refer to the input list."""

    used: tuple[int, ...]  # exec_index e of the batch is input used[e]
    rejected: tuple[tuple[int, str], ...]  # (input index, one-line reason)
    excluded: tuple[int, ...]  # infrastructure errors
    kept_paths: tuple[int, ...]  # per used execution
    dropped_paths: tuple[int, ...]  # per used execution
    scores: tuple[float, ...]
    advantages: tuple[float, ...]
    unique_tokens: int  # nodes of the selected paths' union, summed over executions
    flat_tokens: int  # tokens of the selected paths trained flat
    padding: float  # fraction of row positions that are padding
    normaliser: float = 0.0  # what the loss mode divided by (see normaliser_count)


def _trees(results, spec: TrajectorySpec, targets: str):
    kept, rejected, excluded = [], [], []
    vocab_size, max_paths, row_len = spec.vocab_size, spec.max_paths, spec.row_len
    for i, res in enumerate(results):
        try:
            validate_execution(
                res.records,
                vocab_size,
                check_prompt_ids=False,
                execution_id=res.execution_id,
                end_reason=res.end_reason,
            )
            tree = build_tree(res.records)
            if tree.tokens.min() < 0 or tree.tokens.max() >= vocab_size:
                validate_execution(res.records, vocab_size)  # raises, naming the call
            if targets == schema.DEMONSTRATED:
                score = 1.0  # every demonstration is a target
            else:
                judged = 0.0 if res.score is None else res.score
                score = execution_score(tree.end_reason, judged, reward=spec.reward)
            if score is None:
                excluded.append(i)
                continue
            sel = select_paths(tree, max_paths)
            longest = max(int(tree.depth[tree.call_end[c]]) + 1 for c in sel.kept)
            if longest > row_len:
                raise RecordError(
                    f"execution {tree.execution_id!r}: a path of {longest} tokens exceeds row_len {row_len}"
                )
        except (RecordError, ValueError) as err:
            rejected.append((i, str(err)))
            continue
        kept.append((i, tree, sel, score))
    return kept, rejected, excluded


def _mask_tokens(batch: PackedBatch, trees, masks) -> PackedBatch:
    """Scales the weighted fields (w, adv_pos, adv_neg) of masked completion tokens.
    masks[e][c]: float[C] for call c of packed execution e (1 keeps, 0 drops); a node shared
    by several calls keeps the smallest value."""
    keep = np.ones_like(batch.w)
    for e, (tree, calls) in enumerate(zip(trees, masks)):
        node_mask = np.ones(tree.num_nodes, np.float32)
        for c, mask in enumerate(calls):
            mask = np.asarray(mask, np.float32)
            nodes = tree.path_nodes(c)[-mask.size :] if mask.size else []
            node_mask[nodes] = np.minimum(node_mask[nodes], mask)
        sel = batch.exec_index == e
        keep[sel] = node_mask[batch.node_index[sel]]
    return batch.replace(**{f.name: (batch[f.name] * keep).astype(f.dtype)
                            for f in schema.fields() if f.weighted})  # fmt: skip


def build_batch(
    results: Sequence[ExecutionResult],
    spec: TrajectorySpec,
    objective: str = "ppo",
    token_masks: Sequence | None = None,
    buckets: Sequence[int] | None = None,
) -> tuple[PackedBatch, BatchReport]:
    """Packs one step's executions into rows.

    objective: a name in ``schema.OBJECTIVES``: 'ppo' (group-relative advantages of the
    judged scores) or 'sft' (every execution a target, advantage 1).
    token_masks: per input execution, per call, float[C] over the completion (1 keeps).
    buckets: allowed row counts (default: multiples of spec.rows_per_microbatch).
    """
    targets = schema.objective(objective).targets
    if token_masks is not None and len(token_masks) != len(results):
        raise ValueError(f"{len(token_masks)} token masks for {len(results)} executions")
    kept, rejected, excluded = _trees(results, spec, targets)
    trees: list[Tree] = [k[1] for k in kept]
    calls = [list(k[2].kept) for k in kept]
    scores = [k[3] for k in kept]
    if targets == schema.DEMONSTRATED:
        adv = np.ones(len(kept))
    else:
        groups = [results[k[0]].task_id for k in kept]
        adv = group_advantages(scores, groups, spec.std_normalize)
    lens = [np.asarray([tr.path_trainable(c) for c in cs]) for tr, cs in zip(trees, calls)]
    coefs = path_coefficients(lens, spec.loss_mode)
    buckets = buckets or (spec.rows_per_microbatch,)
    packer = pack if spec.packing == "tree" else flatten
    batch = packer(trees, calls, coefs, adv, spec.row_len, buckets)
    if token_masks is not None:
        batch = _mask_tokens(batch, trees, [token_masks[k[0]] for k in kept])
    report = BatchReport(
        used=tuple(k[0] for k in kept),
        rejected=tuple(rejected),
        excluded=tuple(excluded),
        kept_paths=tuple(len(k[2].kept) for k in kept),
        dropped_paths=tuple(len(k[2].dropped) for k in kept),
        scores=tuple(scores),
        advantages=tuple(float(a) for a in adv),
        unique_tokens=sum(union_size(tr, cs) for tr, cs in zip(trees, calls)),
        flat_tokens=sum(
            int(sum(tr.depth[tr.call_end[c]] + 1 for c in cs)) for tr, cs in zip(trees, calls)
        ),
        padding=float((batch.exec_index < 0).mean()),
        normaliser=normaliser_count(lens, spec.loss_mode),
    )
    return batch, report
