"""Rematerialisation in training (train.remat): every policy gives the gradient of no remat,
and 'full' keeps less for the backward pass (XLA's memory analysis)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from worlds import small_config

from gyre.config import ConfigError, validate
from gyre.mesh import make_cells
from gyre.model import decoder
from gyre.rl.builder import build_specs
from gyre.train import step as tstep

# The parametrized policies share the module's fixtures on one worker.
pytestmark = pytest.mark.xdist_group("remat")


def _batch(r, t, vocab, seed=0):
    rng = np.random.default_rng(seed)
    pos = np.broadcast_to(np.arange(t, dtype=np.int32), (r, t))
    pred = np.where(pos > 0, pos - 1, -1).astype(np.int32)
    pred[:, t // 2 + 1] = t // 4  # a branch: a second child of position t/4
    leave = np.full((r, t), t, np.int32)
    leave[:, t // 4 + 1 : t // 2 + 1] = t // 2 + 1  # the first branch ends before the second
    return {
        "tokens": jnp.asarray(rng.integers(0, vocab, (r, t)), jnp.int32),
        "pos": jnp.asarray(pos), "pred": jnp.asarray(pred), "leave": jnp.asarray(leave),
        "old_logp": jnp.asarray(np.log(1 / vocab) + 0.1 * rng.standard_normal((r, t)), jnp.float32),
        "adv_pos": jnp.asarray(np.abs(rng.standard_normal((r, t))), jnp.float32),
        "adv_neg": jnp.asarray(-np.abs(rng.standard_normal((r, t))) * (pos % 3 == 0), jnp.float32),
        "w": jnp.ones((r, t), jnp.float32), "versions": jnp.zeros((r, t), jnp.int32),
    }  # fmt: skip


@pytest.fixture(scope="module")
def tiny():
    cfg = small_config()
    cfg.model.num_layers, cfg.model.attention = 2, "dense"
    specs = build_specs(cfg)
    graphdef, params = decoder.init_sharded(specs.model, 0, make_cells(1)[0], "train")
    return specs, graphdef, params


def _grads(specs, graphdef, params, batch, remat):
    fn = jax.jit(lambda p: tstep._objective(graphdef, "ppo", specs.trainer.loss, False, p, None,
                                            batch, 0, remat, 0))  # fmt: skip
    return fn(params)


@pytest.fixture(scope="module")
def reference(tiny):
    """The batch and the gradient without remat, computed once for every policy."""
    specs, graphdef, params = tiny
    batch = _batch(2, 32, specs.model.vocab_size)
    return batch, _grads(specs, graphdef, params, batch, "none")


@pytest.mark.parametrize("policy", [
    pytest.param(p, marks=() if p == "full" else pytest.mark.slow)
    for p in decoder.REMAT_POLICIES if p != "none"
])  # fmt: skip
def test_every_policy_gives_the_gradient_of_no_remat(tiny, reference, policy):
    specs, graphdef, params = tiny
    batch, (g0, m0) = reference
    g1, m1 = _grads(specs, graphdef, params, batch, policy)
    np.testing.assert_allclose(float(m1["loss"]), float(m0["loss"]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6 * float(np.abs(a).max() + 1))


def test_full_remat_keeps_less_for_the_backward_pass(tiny):
    specs, graphdef, _ = tiny
    spec = dataclasses.replace(specs.model, num_layers=4)
    graphdef, state = decoder.abstract_model(spec)
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _batch(2, 128, 16))

    def temp(remat):
        fn = jax.jit(lambda p, b: tstep._objective(graphdef, "ppo", specs.trainer.loss, False, p,
                                                   None, b, 0, remat, 0))  # fmt: skip
        return fn.lower(state, batch).compile().memory_analysis().temp_size_in_bytes

    none, full = temp("none"), temp("full")
    assert full < none, (none, full)


def test_remat_is_a_config_choice():
    cfg = small_config()
    cfg.train.remat = "everything"
    with pytest.raises(ConfigError, match="train.remat"):
        validate(cfg)
    cfg.train.remat = "full"
    assert build_specs(cfg).trainer.remat == "full"
    with pytest.raises(ValueError, match="train.remat"):
        dataclasses.replace(build_specs(small_config()).trainer, remat="all")
    x = jnp.ones((2,))
    assert decoder.remat_block(lambda y: y, False)(x) is x  # no wrapper at 'none'
