"""Reference implementations the tests compare the production code against.

Each is the slow, obvious version of something the code does fast or implicitly: a dense
visibility mask for the tree layout, the numpy PPO objective, the root-to-leaf sequences of a
demonstration.
"""

from __future__ import annotations

import numpy as np

from gyre.trajectory.pack import PackedBatch


def ancestors_from_leave(leave_T: np.ndarray) -> np.ndarray:
    """bool[T, T]: sees[q, k] = k <= q < leave[k] (k is q or an ancestor of q)."""
    t = leave_T.shape[-1]
    q, k = np.arange(t)[:, None], np.arange(t)[None, :]
    return (k <= q) & (q < leave_T[None, :])


def clipped_objective(
    batch: PackedBatch, logp_RxT: np.ndarray, clip_low: float, clip_high: float
) -> float:
    """Numpy reference of the sign-split PPO loss -sum_j [min(r, clip r) adv_pos + max(r, clip r) adv_neg]."""
    r = np.exp(logp_RxT.astype(np.float64) - batch.old_logp)
    rc = np.clip(r, 1 - clip_low, 1 + clip_high)
    return float(-np.sum(np.minimum(r, rc) * batch.adv_pos + np.maximum(r, rc) * batch.adv_neg))


def demo_sequences(demo) -> list[tuple[np.ndarray, np.ndarray]]:
    """Root-to-leaf sequences: (tokens int32[T], loss mask float32[T]) per leaf record.

    A record is a leaf when no later record's prompt starts with its tokens. The mask is the
    record loss mask at the completion positions of every record on the leaf's path.
    """
    recs = demo.records
    full = [r.tokens for r in recs]

    def extends(long, short):
        return long.size >= short.size and np.array_equal(long[: short.size], short)

    out = []
    for j in range(len(recs)):
        if any(extends(recs[k].prompt, full[j]) for k in range(j + 1, len(recs))):
            continue
        mask = np.zeros(full[j].size, np.float32)
        for k in range(j + 1):
            if extends(full[j], full[k]):
                p = recs[k].prompt.size
                mask[p : p + recs[k].completion.size] = demo.loss_masks[k]
        out.append((full[j].astype(np.int32), mask))
    return out
