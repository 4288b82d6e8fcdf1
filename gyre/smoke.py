"""The smoke experiment: cells, a tiny model on the train layout, one forward/backward on
one cell, the weights moved to another cell's rollout layout and checked equal."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gyre import mesh
from gyre.metrics import MetricsWriter
from gyre.model import decoder


def run(mesh_spec: mesh.MeshSpec, model: decoder.ModelSpec, seed: int, workdir: str,
        phase=lambda name: None) -> dict:  # fmt: skip
    """The smoke experiment; ``phase(name)`` names each part as it starts (the status line)."""
    t0 = time.time()
    phase("making the cells")
    cells = mesh.cells_for(mesh_spec)
    train_cell, rollout_cell = cells[0], cells[-1]
    phase(f"initialising the model on cell 0 ({train_cell.size} devices)")
    graphdef, state = decoder.init_sharded(model, seed, train_cell, "train")

    batch, length = 2 * train_cell.mesh.shape["data"], 32
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, model.vocab_size, (batch, length), dtype=np.int32)
    pos = np.broadcast_to(np.arange(length, dtype=np.int32), (batch, length))
    leave = np.full((batch, length), length, np.int32)  # causal rows
    data = mesh.sharding_for(train_cell, "train", ("batch", None))
    tokens, pos, leave = (jax.device_put(x, data) for x in (tokens, pos, leave))

    def loss_fn(state, tokens, pos, leave):
        model = nnx.merge(graphdef, state)
        hidden = model(tokens, pos, leave)
        logits = model.logits(hidden[:, :-1]).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean()

    phase("compiling and running one forward/backward on cell 0")
    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(state, tokens, pos, leave)
    grad_norm = float(jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads))))

    phase(f"moving the weights to cell {rollout_cell.index}'s rollout layout")
    logical = decoder.param_logical_axes(nnx.merge(graphdef, state))
    target = mesh.tree_shardings(rollout_cell, "rollout", logical, state)
    moved = mesh.move(state, target)
    equal = all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(moved))
    )
    on_target = all(
        x.sharding.device_set == set(rollout_cell.devices) for x in jax.tree.leaves(moved)
    )
    if not (equal and on_target):
        raise RuntimeError("weights changed or landed on the wrong devices when moved")
    summary = {
        "cells": len(cells),
        "cell_size": train_cell.size,
        "loss": float(loss),
        "grad_norm": grad_norm,
        "moved_equal": equal,
        "seconds": round(time.time() - t0, 2),
    }
    writer = MetricsWriter(workdir, tensorboard=False)
    writer.write(0, summary)
    writer.close()
    print(f"smoke: {summary}")
    return summary
