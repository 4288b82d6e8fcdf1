"""Optimizer of the core cell: global-norm clipping, AdamW, warmup then constant or cosine.

Only the core cell holds optimizer state (docs/sharding.md); a role switch moves
weights only. :func:`state_shardings` gives the optimizer state the parameters' layout (first
and second moments sharded like their parameters, scalars replicated) so the state can be built
or restored directly on any core cell.
"""

from __future__ import annotations

import dataclasses

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec

from gyre import bounds

SCHEDULES = ("constant", "cosine")


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """Optimizer of the core cell (frozen: it keys the compiled update program).

    Learning rate per step: linear warmup over ``warmup_steps``, then constant or cosine decay
    to zero over ``decay_steps`` further steps."""

    lr: float = 1e-4
    warmup_steps: int = 0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    grad_clip: float = 1.0  # global-norm clip; 0 = off
    schedule: str = "constant"
    decay_steps: int = 0

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        bounds.check(self, "train")
        if self.schedule == "cosine" and self.decay_steps < 1:
            raise ValueError(f"a cosine schedule needs decay_steps >= 1, got {self.decay_steps}")


def make_schedule(spec: OptimizerSpec):
    """The learning rate as an optax schedule of the optimizer step."""
    lr, warmup = float(spec.lr), int(spec.warmup_steps)
    if spec.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            0.0, lr, max(warmup, 1), warmup + spec.decay_steps
        )
    if warmup == 0:
        return optax.constant_schedule(lr)
    return optax.linear_schedule(0.0, lr, warmup)


def make_optimizer(spec: OptimizerSpec):
    """optax chain: clip_by_global_norm(grad_clip) then AdamW with the schedule."""
    parts = []
    if spec.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(float(spec.grad_clip)))
    parts.append(
        optax.adamw(
            make_schedule(spec),
            b1=float(spec.b1),
            b2=float(spec.b2),
            weight_decay=float(spec.weight_decay),
        )
    )
    return optax.chain(*parts)


def state_shardings(tx, abstract_params, param_shardings, mesh):
    """Shardings of tx's state: param-shaped leaves like their parameter, the rest replicated."""
    abstract_state = jax.eval_shape(tx.init, abstract_params)
    replicated = NamedSharding(mesh, PartitionSpec())
    return optax.tree_map_params(
        tx,
        lambda _, sharding: sharding,
        abstract_state,
        param_shardings,
        transform_non_params=lambda _: replicated,
    )


def abstract_state(tx, abstract_params, param_shardings, mesh):
    """ShapeDtypeStructs (with target shardings) of tx's state, for restore or sharded init."""
    shapes = jax.eval_shape(tx.init, abstract_params)
    shardings = state_shardings(tx, abstract_params, param_shardings, mesh)
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
    )
