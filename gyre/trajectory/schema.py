"""The packed batch's contract, stated once: per-token fields, metric kinds, objectives.

The packer (:mod:`gyre.trajectory.pack`), the token mask (:mod:`gyre.trajectory.batch`), the
micro-batch padder and the gradient program (:mod:`gyre.train.step`) and the loss
(:mod:`gyre.train.loss`) all read these tables, so a new per-token loss input is one
:class:`Field` here and its use in the loss; a new loss term's metric is one line of
``METRICS``; a new objective is one line of ``OBJECTIVES`` and its loss in ``LOSSES`` of
gyre/train/loss.py (worked example: docs/data_flow.md).

Pure numpy, like the rest of the package: the jax side reads these tables, never the reverse.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import NamedTuple

import numpy as np

from gyre.trajectory.tree import Tree

# ------------------------------------------------------------------ per-token fields


class Segment(NamedTuple):
    """n consecutive tokens of one execution that the packer writes into one row."""

    tree: Tree  # the execution's token tree
    nodes: np.ndarray  # int32[n] tree node ids, in row order
    execution: int  # index of the execution in the batch
    w: np.ndarray  # float64[n] loss weight sum_p c_p (0 for context and repeated ancestors)
    adv: float  # the execution's advantage A_e


@dataclasses.dataclass(frozen=True)
class Field:
    """One [R, T] field of a packed batch.

    pad: the value of padding positions, or ``t -> [t]`` array for a value per position.
    device: read by the gradient program (shipped as a micro-batch); else it stays on the host.
    value: ``Segment -> [n]`` values of the segment's tokens; None for the row layout the packer
    computes itself (``leave``, ``pred``).
    weighted: proportional to the token's loss weight: written on trained tokens only (repeated
    ancestors keep the padding value, which must be 0) and scaled by a token mask with ``w``.
    """

    name: str
    dtype: type
    pad: float | Callable[[int], np.ndarray]
    device: bool
    value: Callable[[Segment], np.ndarray] | None = None
    weighted: bool = False

    def padding(self, rows: int, t: int) -> np.ndarray:
        """[rows, t] padding of this field."""
        if callable(self.pad):
            return np.broadcast_to(np.asarray(self.pad(t), self.dtype), (rows, t)).copy()
        return np.full((rows, t), self.pad, self.dtype)


def _own_end(t: int) -> np.ndarray:
    # A padding token is a one-token subtree: seen by itself only (k <= q < leave[k] = k + 1).
    return np.arange(1, t + 1, dtype=np.int32)


def _adv_pos(s: Segment) -> np.ndarray:
    return s.w * s.adv if s.adv > 0 else np.zeros_like(s.w)


def _adv_neg(s: Segment) -> np.ndarray:
    return s.w * s.adv if s.adv < 0 else np.zeros_like(s.w)


def _exec_index(s: Segment) -> np.ndarray:
    return np.full(s.nodes.size, s.execution, np.int32)


# Field name -> Field, in batch order. Padding rows are isolated one-token roots of zero weight.
# Meaning of each field: docs/data_flow.md, "Packed batch".
FIELDS: dict[str, Field] = {
    f.name: f
    for f in (
        Field("tokens", np.int32, 0, True, lambda s: s.tree.tokens[s.nodes]),
        Field("pos", np.int32, 0, True, lambda s: s.tree.depth[s.nodes]),
        Field("leave", np.int32, _own_end, True),
        Field("pred", np.int32, -1, True),
        Field("old_logp", np.float32, 0.0, True, lambda s: s.tree.logp[s.nodes]),
        Field("adv_pos", np.float32, 0.0, True, _adv_pos, weighted=True),
        Field("adv_neg", np.float32, 0.0, True, _adv_neg, weighted=True),
        Field("w", np.float32, 0.0, True, lambda s: s.w, weighted=True),
        Field("versions", np.int32, -1, True, lambda s: s.tree.version[s.nodes]),
        Field("exec_index", np.int32, -1, False, _exec_index),
        Field("node_index", np.int32, -1, False, lambda s: s.nodes),
    )
}


def fields() -> tuple[Field, ...]:
    return tuple(FIELDS.values())


def device_names() -> tuple[str, ...]:
    """Names of the fields the gradient program reads, in batch order."""
    return tuple(f.name for f in FIELDS.values() if f.device)


def empty(rows: int, t: int, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """[rows, t] padding of every field (or of ``names``), by name."""
    names = FIELDS if names is None else names
    return {name: FIELDS[name].padding(rows, t) for name in names}


class PackedBatch(dict):
    """A packed batch: field name -> [R, T] array for every field of ``FIELDS``.

    A dict, so a field added to ``FIELDS`` needs no change here; fields read as attributes
    too (``batch.w``). A token is loss-bearing iff w > 0.
    """

    __slots__ = ()

    def __getattr__(self, name: str) -> np.ndarray:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"packed batch has no field {name!r}") from None

    def replace(self, **arrays) -> PackedBatch:
        return PackedBatch({**self, **arrays})


# ------------------------------------------------------------------ metric kinds

# How a metric of the loss combines. Every loss metric is a sum over one micro-batch's tokens.
SUM = "sum"  # linear in the loss coefficients: adds up; a streamed part's sum is rescaled
MEAN = "mean"  # as SUM, then reported divided by the step's w_sum (a w-weighted mean)
COUNT = "count"  # adds up, but counts tokens, not coefficients: never rescaled
MAX = "max"  # the largest over micro-batches: never rescaled

METRICS: dict[str, str] = {
    "loss": SUM,
    "pg_loss": SUM,
    "kl_ref": SUM,
    "nll": SUM,
    "w_sum": SUM,
    "entropy": MEAN,
    "approx_kl": MEAN,
    "clip_low_frac": MEAN,
    "clip_high_frac": MEAN,
    "version_lag": MEAN,
    "stale_frac": MEAN,
    "tokens": COUNT,
    "version_lag_max": MAX,
}


def metric_kind(name: str) -> str:
    if name not in METRICS:
        raise KeyError(f"loss metric {name!r} has no kind: declare it in METRICS of {__name__}")
    return METRICS[name]


def rescaled(name: str) -> bool:
    """Whether a part's metric scales with its gradient when parts of a step are combined."""
    return metric_kind(name) in (SUM, MEAN)


# ------------------------------------------------------------------ objectives

# Which executions become targets, and with which advantage.
JUDGED = "judged"  # the judge's scores, group-relative advantages; infra errors excluded
DEMONSTRATED = "demonstrated"  # every execution is a target with advantage 1


@dataclasses.dataclass(frozen=True)
class Objective:
    """The batch side of a training objective (its loss: ``LOSSES`` in gyre/train/loss.py)."""

    name: str
    targets: str = JUDGED

    def __post_init__(self):
        if self.targets not in (JUDGED, DEMONSTRATED):
            raise ValueError(f"objective {self.name!r}: unknown targets {self.targets!r}")


OBJECTIVES: dict[str, Objective] = {
    o.name: o for o in (Objective("ppo", JUDGED), Objective("sft", DEMONSTRATED))
}


def objective(name: str) -> Objective:
    if name not in OBJECTIVES:
        raise ValueError(f"objective must be one of {tuple(OBJECTIVES)}, got {name!r}")
    return OBJECTIVES[name]
