"""Decoder: shapes, a plain causal reference, tree semantics, KV cache, logical axes, sharding."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from gyre.config import default_config
from gyre.mesh import make_cells, tree_shardings
from gyre.model import Decoder, ModelSpec, apply, decoder, init_sharded, param_logical_axes
from gyre.rl.builder import build_specs

T = 16


def model_cfg(**overrides) -> ModelSpec:
    # "dense" is the reference; block_sparse is compared against it explicitly
    settings = {"attn_block": 8, "attention": "dense", **overrides}
    return dataclasses.replace(build_specs(default_config()).model, **settings)


def random_tree(seed: int, t: int):
    """A random DFS-ordered token tree: (tokens, pos, leave, parent) as int32 numpy arrays."""
    rng = np.random.default_rng(seed)
    pos, leave, parent = np.zeros(t, np.int32), np.full(t, t, np.int32), np.full(t, -1, np.int32)
    stack: list[int] = []
    for i in range(t):
        # pop a few levels (a branch point), occasionally all of them (a new root)
        pops = rng.integers(0, len(stack) + 1) if rng.random() < 0.3 else 0
        for _ in range(pops):
            leave[stack.pop()] = i
        parent[i] = stack[-1] if stack else -1
        pos[i] = len(stack)
        stack.append(i)
    tokens = rng.integers(0, 64, t).astype(np.int32)
    return tokens, pos, leave, parent


def forward(model, tokens, pos, leave):
    """Jitted model forward (eager nnx dispatches op by op, which is slow)."""
    graphdef, state = nnx.split(model)
    return _apply(graphdef, state, tokens, pos, leave)


_apply = jax.jit(apply, static_argnums=0)


def causal_inputs(b: int, t: int, seed: int = 0):
    tokens = jax.random.randint(jax.random.key(seed), (b, t), 0, 64)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    return tokens, pos, jnp.full((b, t), t)


def reference_hidden(model: Decoder, tokens_T):
    """Plain, loop-based Qwen3 forward of one causal sequence (numpy float64)."""
    c = model.spec
    state = jax.tree.map(lambda x: np.asarray(x, np.float64), nnx.to_pure_dict(nnx.state(model)))

    def norm(x, w):
        return w * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + c.rms_eps)

    def rot(x, t_pos):  # x [T, Dh]
        half = c.head_dim // 2
        inv = 1.0 / c.rope_theta ** (np.arange(half) * 2 / c.head_dim)
        ang = np.asarray(t_pos)[:, None] * inv[None]
        x1, x2 = x[:, :half], x[:, half:]
        return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang),
                               x2 * np.cos(ang) + x1 * np.sin(ang)], -1)  # fmt: skip

    t = len(tokens_T)
    x = state["embed"][np.asarray(tokens_T)]
    group = c.num_heads // c.num_kv_heads
    causal = np.tril(np.ones((t, t), bool))
    for layer in range(c.num_layers):
        p = {k: v[layer] for k, v in state["layers"].items()}
        h = norm(x, p["attn_norm"])
        out = np.zeros((t, c.num_heads, c.head_dim))
        for head in range(c.num_heads):
            kvh = head // group
            q = rot(norm(h @ p["q"][:, head], p["q_norm"]), np.arange(t))
            k = rot(norm(h @ p["k"][:, kvh], p["k_norm"]), np.arange(t))
            s = np.where(causal, q @ k.T / np.sqrt(c.head_dim), -np.inf)
            w = np.exp(s - s.max(-1, keepdims=True))
            out[:, head] = (w / w.sum(-1, keepdims=True)) @ (h @ p["v"][:, kvh])
        x = x + np.einsum("thk,hkd->td", out, p["o"])
        h = norm(x, p["mlp_norm"])
        g = h @ p["gate"]
        x = x + (g / (1 + np.exp(-g)) * (h @ p["up"])) @ p["down"]
    return norm(x, state["final_norm"])


def test_shapes_and_dtypes():
    model = Decoder(model_cfg(), nnx.Rngs(0))
    tokens, pos, leave = causal_inputs(2, T)
    hidden = forward(model, tokens, pos, leave)
    assert hidden.shape == (2, T, 64) and hidden.dtype == jnp.float32
    logits = model.logits(hidden[:, :3])
    assert logits.shape == (2, 3, 64) and logits.dtype == jnp.float32
    bf16 = Decoder(model_cfg(dtype="bfloat16"), nnx.Rngs(0))
    assert bf16.embed[...].dtype == jnp.float32  # parameters stay fp32
    h16 = forward(bf16, tokens, pos, leave)
    assert h16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(h16, np.float32), hidden, atol=0.1)


def test_bad_heads_is_a_clear_error():
    with pytest.raises(ValueError, match="num_kv_heads"):  # the spec rejects it when built
        Decoder(model_cfg(num_heads=4, num_kv_heads=3), nnx.Rngs(0))


@pytest.mark.parametrize("attention", ["dense", "block_sparse"])
def test_causal_matches_plain_reference(attention):
    model = Decoder(model_cfg(attention=attention), nnx.Rngs(1))
    tokens, pos, leave = causal_inputs(2, T, seed=3)
    hidden = forward(model, tokens, pos, leave)
    for b in range(2):
        np.testing.assert_allclose(hidden[b], reference_hidden(model, tokens[b]), atol=1e-4)


def test_tree_forward_equals_every_root_to_node_path():
    model = Decoder(model_cfg(), nnx.Rngs(2))
    tokens, pos, leave, parent = random_tree(seed=5, t=T)
    hidden = forward(model, *(jnp.asarray(x)[None] for x in (tokens, pos, leave)))[0]
    assert (pos == 0).sum() >= 1 and len(set(parent.tolist())) < T  # really branchy
    for node in range(T):
        path = [node]
        while parent[path[-1]] >= 0:
            path.append(int(parent[path[-1]]))
        path = path[::-1]
        ref = reference_hidden(model, tokens[path])
        np.testing.assert_allclose(hidden[node], ref[-1], atol=1e-4)


def test_dense_and_block_sparse_agree_on_trees():
    dense = Decoder(model_cfg(attention="dense"), nnx.Rngs(3))
    sparse = Decoder(model_cfg(attention="block_sparse"), nnx.Rngs(3))
    rows = [random_tree(seed, 2 * T) for seed in (7, 8)]
    tokens, pos, leave = (jnp.asarray(np.stack([r[i] for r in rows])) for i in range(3))
    np.testing.assert_allclose(
        forward(dense, tokens, pos, leave),
        forward(sparse, tokens, pos, leave),
        atol=1e-5,
        rtol=1e-5,
    )


def apply_cached(graphdef, state, tokens_BxT, pos_BxT, cache, slot_B, start_B):
    """The rollout forward (serving weights, slot cache) of a split model, for plain jax.jit."""
    model = nnx.merge(graphdef, state)
    weights = model.serving_weights()
    return decoder.forward_serving(model.spec, weights, tokens_BxT, pos_BxT, cache, slot_B, start_B)


@pytest.mark.slow
def test_kv_cache_prefill_chunks_then_decode_matches_full_forward():
    model = Decoder(model_cfg(), nnx.Rngs(4))
    graphdef, state = nnx.split(model)
    tokens, pos, leave = causal_inputs(2, T, seed=6)
    full = forward(model, tokens, pos, leave)
    step = jax.jit(apply_cached, static_argnums=0, donate_argnums=4)
    cache = model.init_cache(num_slots=3, max_len=24)
    slot = jnp.array([2, 0])
    prompt_len = np.array([8, 6])
    chunk = 4
    out = {0: [], 1: []}
    for start in (0, 4):  # two prefill chunks; row 1's second chunk is padded past its prompt
        sl = slice(start, start + chunk)
        padding = pos[:, sl] >= jnp.asarray(prompt_len)[:, None]
        chunk_tokens = jnp.where(padding, (tokens[:, sl] + 1) % 64, tokens[:, sl])
        hidden, cache = step(graphdef, state, chunk_tokens, pos[:, sl], cache, slot,
                             jnp.array([start, start]))  # fmt: skip
        for b in range(2):
            out[b].extend(hidden[b, : max(0, min(chunk, prompt_len[b] - start))])
    length = prompt_len.copy()
    for _ in range(T - 8):  # decode one token at a time; row 1 overwrites its padded entries
        idx = jnp.asarray(length)[:, None]
        hidden, cache = step(graphdef, state, jnp.take_along_axis(tokens, idx, 1), idx, cache,
                             slot, jnp.asarray(length))  # fmt: skip
        for b in range(2):
            out[b].append(hidden[b, 0])
        length += 1
    for b in range(2):
        got = jnp.stack(out[b])
        np.testing.assert_allclose(got, full[b, : len(got)], atol=1e-5, rtol=1e-5)
    # the untouched slot stays empty
    assert not any(np.asarray(k[1]).any() for k in cache["k"])


def test_param_logical_axes():
    model = Decoder(model_cfg(tie_embeddings=False), nnx.Rngs(0))
    axes = nnx.to_pure_dict(param_logical_axes(model))
    state = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert axes["embed"] == ("vocab", "embed")
    assert axes["lm_head"] == ("embed", "vocab")
    assert axes["layers"]["q"] == ("layers", "embed", "heads", "head_dim")
    assert axes["layers"]["k"] == ("layers", "embed", "kv_heads", "head_dim")
    assert axes["layers"]["o"] == ("layers", "heads", "head_dim", "embed")
    assert axes["layers"]["down"] == ("layers", "mlp", "embed")
    leaves = jax.tree.leaves(state)
    names = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    assert len(leaves) == len(names) == 14
    assert all(len(n) == x.ndim for n, x in zip(names, leaves))


@pytest.mark.slow
@pytest.mark.parametrize("model_parallel", [1, 2])
@pytest.mark.parametrize("role", ["train", "rollout"])
def test_init_sharded_places_params_per_rules(model_parallel, role):
    cfg = model_cfg()
    cell = make_cells(2, model_parallel=model_parallel)[1]
    graphdef, state = init_sharded(cfg, seed=9, cell=cell, role=role)
    data = "data" if model_parallel == 1 else None  # a size-1 axis is still named in the spec
    embed_axis = "data" if role == "train" else None
    assert state["embed"].sharding.spec == P("model", embed_axis)
    assert state["layers"]["q"].sharding.spec == P(None, embed_axis, "model", None)
    assert set(state["embed"].sharding.device_set) == set(cell.devices)
    shard_shape = state["layers"]["gate"].sharding.shard_shape(state["layers"]["gate"].shape)
    want = [2, 64, 128]
    if role == "train" and data:
        want[1] //= 2
    if model_parallel == 2:
        want[2] //= 2
    assert list(shard_shape) == want
    # same values as an unsharded init from the same seed, and it runs
    plain = nnx.state(Decoder(cfg, nnx.Rngs(9)), nnx.Param)
    check = functools.partial(np.testing.assert_allclose, rtol=1e-6, atol=1e-7)  # jit fusion: ulps
    jax.tree.map(check, jax.device_get(state), plain)
    tokens, pos, leave = causal_inputs(2, 8)
    hidden = _apply(graphdef, state, tokens, pos, leave)
    assert hidden.shape == (2, 8, 64)


def test_tree_shardings_from_logical_axes_on_abstract_state():
    model = nnx.eval_shape(lambda: Decoder(model_cfg(), nnx.Rngs(0)))
    abstract = nnx.state(model, nnx.Param)
    shardings = tree_shardings(make_cells(4)[0], "train", param_logical_axes(abstract), abstract)
    assert shardings["layers"]["down"].spec == P(None, "model", "data")


def test_tied_vs_untied_head():
    tied = Decoder(model_cfg(tie_embeddings=True), nnx.Rngs(0))
    untied = Decoder(model_cfg(tie_embeddings=False), nnx.Rngs(0))
    assert not hasattr(tied, "lm_head") and untied.lm_head[...].shape == (64, 64)
    hidden = jax.random.normal(jax.random.key(0), (1, 3, 64))
    np.testing.assert_allclose(tied.logits(hidden), hidden @ tied.embed[...].T, atol=1e-5)
    np.testing.assert_allclose(untied.logits(hidden), hidden @ untied.lm_head[...], atol=1e-5)


@pytest.mark.slow
def test_remat_gives_same_gradients():
    graphdef, state = nnx.split(Decoder(model_cfg(num_layers=1), nnx.Rngs(0)))
    tokens, pos, leave = causal_inputs(1, 8)

    probe = jax.random.normal(jax.random.key(1), (1, 8, 64))

    def loss(state, remat):  # a random projection: sum(h**2) is flat under the final norm
        return jnp.sum(apply(graphdef, state, tokens, pos, leave, remat=remat) * probe)

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    g0, g1 = grad(state, False), grad(state, True)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4), g0, g1)
