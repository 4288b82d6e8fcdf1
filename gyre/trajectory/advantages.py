"""Scores, group-relative advantages and the per-path loss coefficients of one optimizer step.

The step loss is ``L = sum_p c_p A_p sum_{t in p, trainable} l_t`` over every selected path p
(A_p: its execution's advantage). The coefficient c_p carries the loss mode's normaliser, and
is computed here over the whole step, before anything is split into rows or micro-batches.
With n_p the trainable tokens of path p (counted along the whole root-to-leaf path, shared
prefix included, as if the path were trained flat):

- ``token-mean``:    c_p = 1 / sum_q n_q               (mean over every flattened trainable token)
- ``sequence-mean``: c_p = 1 / (P * n_p)                (mean over paths of each path's mean; P paths)
- ``two-level``:     c_p = 1 / (E * sum_{q in e(p)} n_q)  (token mean within an execution, then
  the mean over the E executions: each execution weighs the same, whatever its paths' lengths)

Paths with no trainable token get c_p = 0 and are not counted in P or E.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

LOSS_MODES = ("token-mean", "sequence-mean", "two-level")
REWARDS = ("partial", "binary")


def execution_score(
    end_reason: str, judge_score: float, *, reward: str = "partial", success_score: float = 1.0
) -> float | None:
    """Scalar reward of one execution; None for an infrastructure error (never trained on).

    success -> success_score (1.0 for binary); any other ending -> the judge's partial score
    (0.0 for binary), which must be finite and strictly below success_score.
    """
    if reward not in REWARDS:
        raise ValueError(f"reward must be one of {REWARDS}, got {reward!r}")
    if end_reason == "infra_error":
        return None
    if end_reason == "success":
        return 1.0 if reward == "binary" else float(success_score)
    if reward == "binary":
        return 0.0
    if not np.isfinite(judge_score) or judge_score >= success_score:
        raise ValueError(
            f"judge score {judge_score!r} of a '{end_reason}' ending must be finite and below "
            f"the success score {success_score}"
        )
    return float(judge_score)


def group_advantages(
    scores: Sequence[float],
    groups: Sequence[Hashable],
    std_normalize: bool = False,
    eps: float = 1e-6,
) -> np.ndarray:
    """float64[E]: score minus its group's mean (optionally / (group std + eps)).

    Groups are the executions of one task; a group of one gets advantage 0.
    """
    scores_E = np.asarray(scores, np.float64)
    if scores_E.size != len(groups):
        raise ValueError(f"{scores_E.size} scores but {len(groups)} group ids")
    if scores_E.size == 0:
        return scores_E
    _, inv = np.unique(np.asarray([str(g) for g in groups]), return_inverse=True)
    count = np.bincount(inv)
    mean = np.bincount(inv, scores_E) / count
    adv_E = scores_E - mean[inv]
    if std_normalize:
        var = np.bincount(inv, adv_E**2) / count
        adv_E = adv_E / (np.sqrt(var)[inv] + eps)
    return adv_E


def normaliser_count(trainable_lens: Sequence[np.ndarray], mode: str) -> float:
    """The count the loss mode divides by: trainable tokens (token-mean), paths with trainable
    tokens (sequence-mean) or executions with trainable tokens (two-level).

    Coefficients of a part of a step scale by part_count / step_count to become the step's,
    which is how the controller trains groups as they finish yet normalises over the step.
    """
    if mode not in LOSS_MODES:
        raise ValueError(f"loss mode must be one of {LOSS_MODES}, got {mode!r}")
    lens = [np.asarray(n, np.float64) for n in trainable_lens]
    if mode == "token-mean":
        return float(sum(n.sum() for n in lens))
    if mode == "sequence-mean":
        return float(sum((n > 0).sum() for n in lens))
    return float(sum(n.sum() > 0 for n in lens))


def path_coefficients(trainable_lens: Sequence[np.ndarray], mode: str) -> list[np.ndarray]:
    """Per execution e, float64[P_e]: c_p of each selected path (see the module docstring).

    trainable_lens[e][p] = trainable tokens on selected path p of execution e.
    """
    if mode not in LOSS_MODES:
        raise ValueError(f"loss mode must be one of {LOSS_MODES}, got {mode!r}")
    lens = [np.asarray(n, np.float64) for n in trainable_lens]
    flat = np.concatenate(lens) if lens else np.zeros(0)
    if np.any(flat < 0):
        raise ValueError("trainable path lengths must be >= 0")
    safe = [np.where(n > 0, n, np.inf) for n in lens]  # 1 / inf = 0 for empty paths
    if mode == "token-mean":
        total = flat.sum()
        return [np.where(n > 0, 1.0 / total, 0.0) if total else np.zeros_like(n) for n in lens]
    if mode == "sequence-mean":
        n_paths = int((flat > 0).sum())
        return [1.0 / (n_paths * s) if n_paths else np.zeros_like(s) for s in safe]
    totals = [n.sum() for n in lens]
    n_exec = sum(t > 0 for t in totals)
    return [
        np.where(n > 0, 1.0 / (n_exec * t), 0.0) if t > 0 else np.zeros_like(n)
        for n, t in zip(lens, totals)
    ]
