"""Log-probabilities over vocabulary chunks (loss.head_logprobs) equal the one-piece ones to
float32 round-off, values and gradients, at branch points too; ids past the tokenizer are
masked alike in sampling and training; the gradient program keeps no [R, T, V] logits."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from strategies import branchy_execution
from worlds import small_config

from gyre.model import decoder
from gyre.rl.builder import build_specs
from gyre.train import loss as tloss
from gyre.train import step as tstep
from gyre.trajectory.batch import ExecutionResult, build_batch

pytestmark = pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")

R, T, D, V = 2, 12, 8, 37
PRED = np.array([[-1, 0, 1, 1, 3, 3, 2, 6, 7, -1, 9, 10], [-1, 0, 1, 2, 2, 2, 5, 4, 7, 8, 8, 1]])


def _inputs(seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    hidden = jax.random.normal(k1, (R, T, D), jnp.float32)
    head = jax.random.normal(k2, (V, D), jnp.float32) * 0.7
    tokens = jax.random.randint(k3, (R, T), 0, V)
    return hidden, head, tokens, jnp.asarray(PRED)


def _reference(hidden, head, tokens, pred, sample_vocab=0):
    logits = jnp.einsum("rtd,vd->rtv", hidden, head)
    if sample_vocab:
        logits = jnp.where(jnp.arange(V) < sample_vocab, logits, decoder.MASKED)
    return tloss.token_logprobs(logits, tokens, pred)


def _objective(fn):
    """A scalar mixing logp and entropy with fixed weights (gradient of both paths)."""
    c = jax.random.normal(jax.random.key(7), (2, R, T))
    return lambda h, w: jnp.sum(c[0] * fn(h, w)[0]) + jnp.sum(c[1] * fn(h, w)[1])


@pytest.mark.parametrize("chunk", [1, 5, 37, 0])
def test_chunked_equals_one_piece_values_and_gradients(chunk):
    hidden, head, tokens, pred = _inputs()
    ref = jax.jit(lambda h, w: _reference(h, w, tokens, pred))
    got = jax.jit(lambda h, w: tloss.head_logprobs(h, w, tokens, pred, chunk=chunk,
                                                   dtype=jnp.float32))  # fmt: skip
    for a, b in zip(ref(hidden, head), got(hidden, head)):
        np.testing.assert_allclose(b, a, rtol=2e-6, atol=2e-6)
    g_ref = jax.jit(jax.grad(_objective(ref), argnums=(0, 1)))(hidden, head)
    g_got = jax.jit(jax.grad(_objective(got), argnums=(0, 1)))(hidden, head)
    for a, b in zip(g_ref, g_got):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    assert float(got(hidden, head)[0][0, 0]) == 0.0  # a root carries nothing


def test_bfloat16_head_matches_the_one_piece_bfloat16_head():
    hidden, head, tokens, pred = _inputs(1)
    hidden = hidden.astype(jnp.bfloat16)
    one = tloss.head_logprobs(hidden, head, tokens, pred, chunk=0, dtype=jnp.bfloat16)
    chunked = tloss.head_logprobs(hidden, head, tokens, pred, chunk=8, dtype=jnp.bfloat16)
    for a, b in zip(one, chunked):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [0, 6])
def test_ids_past_sample_vocab_are_masked_in_training_and_sampling(chunk):
    hidden, head, tokens, pred = _inputs(2)
    tokens = tokens % 30
    logp, ent = tloss.head_logprobs(hidden, head, tokens, pred, chunk=chunk, dtype=jnp.float32,
                                    sample_vocab=30)  # fmt: skip
    ls = jax.nn.log_softmax(jnp.einsum("rtd,vd->rtv", hidden, head)[..., :30], -1)
    parent = np.maximum(PRED, 0)
    want = np.take_along_axis(np.take_along_axis(np.asarray(ls), parent[..., None], 1),
                              np.asarray(tokens)[..., None], 2)[..., 0]  # fmt: skip
    np.testing.assert_allclose(logp, np.where(PRED >= 0, want, 0), rtol=2e-6, atol=2e-6)
    assert np.all(np.isfinite(ent))
    spec = decoder.ModelSpec(V, D, 1, 2, 1, 4, 8, 1e4, 1e-6, True, "float32", "dense", 128,
                             sample_vocab=30)  # fmt: skip
    logits = decoder.serving_logits(spec, {"embed": head}, hidden)
    assert np.all(np.asarray(logits[..., 30:]) == decoder.MASKED)
    np.testing.assert_allclose(logits[..., :30], jnp.einsum("rtd,vd->rtv", hidden, head)[..., :30],
                               rtol=1e-6, atol=1e-6)  # fmt: skip
    with pytest.raises(ValueError, match="sample_vocab"):
        dataclasses.replace(spec, sample_vocab=V + 1)


def _packed(specs):
    results = [ExecutionResult(branchy_execution(i, n_calls=6, vocab=16, execution_id=f"e{i}"),
                               f"t{i % 2}", i / 4) for i in range(4)]  # fmt: skip
    batch, _ = build_batch(results, specs.trajectory, buckets=(4,))
    (mb,) = tstep.split_microbatches(batch, 4)
    arrays = dict(mb.arrays)
    rng = np.random.default_rng(0)
    arrays["old_logp"] = (np.log(1 / 16) + 0.1 * rng.standard_normal(arrays["w"].shape)).astype(
        np.float32
    )
    return {k: jnp.asarray(v) for k, v in arrays.items()}


@pytest.mark.parametrize("chunk", [5])
def test_gradient_program_objective_equal_with_chunked_logits(chunk):
    """The trainer's objective (PPO on a packed tree batch): chunked == one piece."""
    specs = build_specs(small_config())
    graphdef, params = decoder.init_sharded(specs.model, 0, _one_cell(), "train")
    batch = _packed(specs)

    def run(c):
        return jax.jit(lambda p: tstep._objective(graphdef, "ppo", specs.trainer.loss, False, p,
                                                  None, batch, 0, "none", c))(params)  # fmt: skip

    g0, m0 = run(0)
    g1, m1 = run(chunk)
    for k in ("loss", "entropy", "approx_kl"):
        np.testing.assert_allclose(float(m1[k]), float(m0[k]), rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6 * float(np.abs(a).max() + 1))


def _one_cell():
    from gyre.mesh import make_cells

    return make_cells(1)[0]


def test_no_logits_sized_temporary_in_the_compiled_gradient():
    """XLA's memory analysis: one-piece logits need [R, T, V] float32 temporaries, chunks do
    not (the largest chunk array is [R*T, chunk])."""
    r, t, d, v = 2, 256, 32, 8192
    hidden = jax.ShapeDtypeStruct((r, t, d), jnp.float32)
    head = jax.ShapeDtypeStruct((v, d), jnp.float32)
    tokens = jax.ShapeDtypeStruct((r, t), jnp.int32)
    pred = jax.ShapeDtypeStruct((r, t), jnp.int32)

    def temp(chunk):
        def f(h, w, tok, p):
            return jnp.sum(tloss.head_logprobs(h, w, tok, p, chunk=chunk, dtype=jnp.float32)[0])

        grad = jax.jit(jax.grad(f, argnums=(0, 1)))
        return grad.lower(hidden, head, tokens, pred).compile().memory_analysis().temp_size_in_bytes

    logits_bytes = r * t * v * 4
    one, chunked = temp(0), temp(512)
    assert one >= logits_bytes
    assert chunked < logits_bytes / 2, (one, chunked, logits_bytes)
