"""Optimizer of the core cell: global-norm clipping, AdamW, warmup then constant or cosine.

Only the core cell holds optimizer state (DESIGN.md, "Cells and programs"); a role switch moves
weights only. :func:`state_shardings` gives the optimizer state the parameters' layout (first
and second moments sharded like their parameters, scalars replicated) so the state can be built
or restored directly on any core cell.
"""

from __future__ import annotations

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec

SCHEDULES = ("constant", "cosine")


def make_schedule(cfg_train, schedule: str = "constant", decay_steps: int = 0):
    """Learning rate per optimizer step: linear warmup over warmup_steps, then constant or
    cosine decay to zero over ``decay_steps`` further steps."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    lr, warmup = float(cfg_train.lr), int(cfg_train.warmup_steps)
    if warmup < 0:
        raise ValueError(f"train.warmup_steps must be >= 0, got {warmup}")
    if schedule == "cosine":
        if decay_steps < 1:
            raise ValueError(f"a cosine schedule needs decay_steps >= 1, got {decay_steps}")
        return optax.warmup_cosine_decay_schedule(0.0, lr, max(warmup, 1), warmup + decay_steps)
    if warmup == 0:
        return optax.constant_schedule(lr)
    return optax.linear_schedule(0.0, lr, warmup)


def make_optimizer(cfg_train, schedule: str = "constant", decay_steps: int = 0):
    """optax chain: clip_by_global_norm(grad_clip) then AdamW with the schedule."""
    if cfg_train.grad_clip < 0:
        raise ValueError(f"train.grad_clip must be >= 0, got {cfg_train.grad_clip}")
    parts = []
    if cfg_train.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(float(cfg_train.grad_clip)))
    parts.append(
        optax.adamw(
            make_schedule(cfg_train, schedule, decay_steps),
            b1=float(cfg_train.b1),
            b2=float(cfg_train.b2),
            weight_decay=float(cfg_train.weight_decay),
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
