"""One optimizer step's data: finished executions -> trees -> selection -> advantages -> rows.

A bad execution (malformed records, a path longer than a row) is rejected with its reason and
the rest of the step goes on; infrastructure errors are excluded (never trained on).
Advantages and loss coefficients are computed over the executions that survive.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from gyre.trajectory.advantages import (
    execution_score,
    group_advantages,
    normaliser_count,
    path_coefficients,
)
from gyre.trajectory.pack import PackedBatch, flatten, pack, union_size
from gyre.trajectory.records import CallRecord, RecordError, validate_execution
from gyre.trajectory.select import select_paths
from gyre.trajectory.tree import Tree, build_tree


@dataclasses.dataclass(frozen=True)
class ExecutionResult:
    """A finished execution: its call records, its task, and the judge's score of its ending."""

    records: list[CallRecord]
    task_id: str
    judge_score: float = 0.0


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


def _trees(results, vocab_size: int, max_paths: int, row_len: int, reward: str):
    kept, rejected, excluded = [], [], []
    for i, res in enumerate(results):
        try:
            validate_execution(res.records, vocab_size, check_prompt_ids=False)
            tree = build_tree(res.records)
            if tree.tokens.min() < 0 or tree.tokens.max() >= vocab_size:
                validate_execution(res.records, vocab_size)  # raises, naming the call
            score = execution_score(tree.end_reason, res.judge_score, reward=reward)
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


def build_batch(
    results: Sequence[ExecutionResult], cfg, buckets: Sequence[int] | None = None
) -> tuple[PackedBatch, BatchReport]:
    """Packs one step. cfg: the run config (trajectory.*, model.vocab_size, train.rows_per_microbatch).

    buckets: allowed row counts (default: multiples of train.rows_per_microbatch).
    """
    t = cfg.trajectory
    kept, rejected, excluded = _trees(
        results, cfg.model.vocab_size, t.max_paths, t.row_len, t.reward
    )
    trees: list[Tree] = [k[1] for k in kept]
    calls = [list(k[2].kept) for k in kept]
    scores = [k[3] for k in kept]
    adv = group_advantages(scores, [results[k[0]].task_id for k in kept], t.std_normalize)
    lens = [np.asarray([tr.path_trainable(c) for c in cs]) for tr, cs in zip(trees, calls)]
    coefs = path_coefficients(lens, t.loss_mode)
    buckets = buckets or (cfg.train.rows_per_microbatch,)
    packer = pack if t.packing == "tree" else flatten
    batch = packer(trees, calls, coefs, adv, t.row_len, buckets)
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
        normaliser=normaliser_count(lens, t.loss_mode),
    )
    return batch, report
