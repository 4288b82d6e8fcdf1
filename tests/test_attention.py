"""Tree attention: block-sparse vs the dense-mask reference (values and gradients)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.model import attention

T, BLOCK, H, KVH, DH = 64, 16, 4, 2, 8


def leave_from_parents(parents: list[int], t: int) -> np.ndarray:
    """leave[t] for a forest given parent[i] < i (-1 = root), in DFS order, padded to t."""
    n = len(parents)
    children = [[] for _ in range(n)]
    roots = []
    for i, p in enumerate(parents):
        (children[p] if p >= 0 else roots).append(i)
    leave = np.arange(1, t + 1, dtype=np.int32)  # padding: isolated one-token roots
    position = 0

    def visit(node):  # recursive DFS is fine: trees here have at most t nodes
        nonlocal position
        start = position
        position += 1
        for child in children[node]:
            visit(child)
        leave[start] = position

    for root in roots:
        visit(root)
    return leave


@st.composite
def forests(draw, t=T):
    n = draw(st.integers(1, t))
    # Parents drawn near the node keep branches long, so many key blocks are skipped.
    parents = [draw(st.integers(-1, i - 1)) if i else -1 for i in range(n)]
    return leave_from_parents(parents, t)


def random_qkv(seed, b=2, t=T, h=H, kvh=KVH, dtype=jnp.float32):
    """Standard normal q, k, v (``dtype``) and a float32 cotangent, drawn on the host (with
    jax.random each new shape compiled a program)."""
    rng = np.random.default_rng(seed)
    shapes = ((b, t, h, DH), (b, t, kvh, DH), (b, t, kvh, DH), (b, t, h, DH))
    q, k, v, cotangent = (rng.standard_normal(s, np.float32) for s in shapes)
    return (*(jnp.asarray(x, dtype) for x in (q, k, v)), jnp.asarray(cotangent))


@functools.partial(jax.jit, static_argnames=("impl", "block"))
def value_and_grads(q, k, v, leave, cotangent, impl, block=BLOCK):
    def loss(q, k, v):
        out = attention.attend(q, k, v, leave, impl=impl, block=block)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, grads


def assert_matches_dense(q, k, v, leave, cotangent, atol, block=BLOCK):
    out, grads = value_and_grads(q, k, v, leave, cotangent, "block_sparse", block)
    ref_out, ref_grads = value_and_grads(q, k, v, leave, cotangent, "dense", block)
    np.testing.assert_allclose(np.float32(out), np.float32(ref_out), atol=atol, rtol=atol)
    for name, g, ref in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(
            np.float32(g), np.float32(ref), atol=atol, rtol=atol, err_msg=f"d{name}"
        )


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(forests(), forests(), st.integers(0, 2**16))
def test_random_trees_match_dense(leave0, leave1, seed):
    q, k, v, cotangent = random_qkv(seed)
    leave = jnp.asarray(np.stack([leave0, leave1]))
    assert_matches_dense(q, k, v, leave, cotangent, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(forests())
def test_block_visibility_is_exact(leave):
    """A block pair is visited iff some (query, key) pair in it is visible."""
    mask_TxT = np.asarray(attention.tree_mask(jnp.asarray(leave)[None])[0])
    nb = T // BLOCK
    expected = mask_TxT.reshape(nb, BLOCK, nb, BLOCK).any(axis=(1, 3))
    got = np.asarray(attention.block_visibility(jnp.asarray(leave), BLOCK))
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("kvh", [1, 4])
def test_causal_and_padding_rows(kvh):
    q, k, v, cotangent = random_qkv(1, kvh=kvh)
    causal = np.full(T, T, np.int32)
    padding = np.arange(1, T + 1, dtype=np.int32)
    assert_matches_dense(q, k, v, jnp.asarray(np.stack([causal, padding])), cotangent, atol=1e-5)


def test_padding_row_is_self_attention():
    q, k, v, _ = random_qkv(2, b=1)
    leave = jnp.arange(1, T + 1, dtype=jnp.int32)[None]
    out = attention.block_sparse_attention(q, k, v, leave, BLOCK)
    expected = jnp.repeat(v, H // KVH, axis=2)  # each query sees only its own key
    np.testing.assert_allclose(out, expected, atol=1e-6)


def test_query_that_sees_nothing_is_zero_not_nan():
    # leave[k] = k: key k is seen by no query, so no query sees anything at all in blocks 0-1.
    leave_T = np.full(T, T, np.int32)
    leave_T[: 2 * BLOCK] = np.arange(2 * BLOCK)
    q, k, v, cotangent = random_qkv(3, b=1)
    leave = jnp.asarray(leave_T)[None]
    out, grads = value_and_grads(q, k, v, leave, cotangent, "block_sparse")
    assert np.all(np.isfinite(out)) and all(np.all(np.isfinite(g)) for g in grads)
    np.testing.assert_array_equal(np.asarray(out[:, : 2 * BLOCK]), 0.0)
    assert_matches_dense(q, k, v, leave, cotangent, atol=1e-5)


@pytest.mark.slow
def test_bf16_matches_dense_loosely():
    leave = jnp.asarray(np.stack([leave_from_parents([-1, 0, 1, 1, 3, 0], T)] * 2))
    leave = leave.at[:, 0].set(T).at[:, 1:40].set(40)  # a prefix-then-branches shape
    q, k, v, cotangent = random_qkv(4, dtype=jnp.bfloat16)
    out, grads = value_and_grads(q, k, v, leave, cotangent, "block_sparse")
    assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
    assert_matches_dense(q, k, v, leave, cotangent, atol=6e-2)


def test_branchy_tree_visits_fewer_blocks_than_causal():
    t = 256
    leave = np.full(t, t, np.int32)  # prefix of 64, then 4 branches of 48
    for start in range(64, t, 48):
        leave[start : start + 48] = min(start + 48, t)
    leave[-1] = t
    causal = np.full(t, t, np.int32)
    tree_fraction = attention.visible_block_fraction(leave, 32)
    causal_fraction = attention.visible_block_fraction(causal, 32)
    assert causal_fraction == pytest.approx(36 / 64)  # 8 blocks: lower triangle with diagonal
    assert tree_fraction < 0.8 * causal_fraction


def test_bad_inputs_raise_clearly():
    q, k, v, _ = random_qkv(5)
    leave = jnp.full((2, T), T, jnp.int32)
    with pytest.raises(ValueError, match="not a multiple of the attention block 24"):
        attention.attend(q, k, v, leave, block=24)
    with pytest.raises(ValueError, match="unknown attention impl 'flash'"):
        attention.attend(q, k, v, leave, impl="flash")
    with pytest.raises(ValueError, match="multiple of KVH"):
        attention.attend(q, k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2), leave)
    with pytest.raises(ValueError, match="leave has shape"):
        attention.attend(q, k, v, leave[:, :-1])


def naive_index_mask(q_idx, k_idx, k_leave):
    """bool[B,Tq,Tk], the rule written out by loops: query i sees key j iff
    k_idx[j] <= q_idx[i] < k_leave[j] (q_idx < 0: a padding query, sees nothing)."""
    b, tq = q_idx.shape
    mask = np.zeros((b, tq, k_idx.shape[1]), bool)
    for r in range(b):
        for i, qi in enumerate(q_idx[r]):
            for j, (ki, kl) in enumerate(zip(k_idx[r], k_leave[r])):
                mask[r, i, j] = 0 <= qi and ki <= qi < kl
    return mask


TQ, TK = 2 * BLOCK, 3 * BLOCK  # queries and keys held apart: lengths of their own


@st.composite
def held_apart(draw, t=T):
    """(q_idx[TQ], k_idx[TK], k_leave[TK]) of one forest row of ``t`` tokens: its queries and
    its keys as two random subsets, in token order (the tree schedule's shape: ascending
    runs) or any order; then padding (queries -1, keys with leave 0: seen by none)."""
    leave = draw(forests(t))
    tokens = st.integers(0, t - 1)
    keys = draw(st.lists(tokens, min_size=1, max_size=TK, unique=True))
    queries = draw(st.lists(tokens, min_size=1, max_size=TQ, unique=True))
    if draw(st.booleans()):
        keys, queries = sorted(keys), sorted(queries)
    pad_keys = draw(st.lists(tokens, min_size=TK - len(keys), max_size=TK - len(keys)))
    k_idx = np.asarray(keys + pad_keys, np.int32)
    k_leave = np.r_[leave[keys], np.zeros(len(pad_keys))].astype(np.int32)
    return np.asarray(queries + [-1] * (TQ - len(queries)), np.int32), k_idx, k_leave


@jax.jit
def indexed_value_and_grads(q, k, v, q_idx, k_idx, k_leave, cotangent):
    def loss(q, k, v):
        out = attention.indexed_attention(q, k, v, q_idx, k_idx, k_leave, BLOCK)
        return jnp.sum(out * cotangent), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, grads


@jax.jit
def masked_value_and_grads(q, k, v, mask_BxTqxTk, cotangent):
    """The dense reference with an explicit mask (zeros where a query sees nothing)."""

    def loss(q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, mask=mask_BxTqxTk[:, None],
                                           implementation="xla")  # fmt: skip
        out = out * mask_BxTqxTk.any(-1)[:, :, None, None]
        return jnp.sum(out * cotangent), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, grads


@settings(max_examples=15, deadline=None)
@given(held_apart(), held_apart(), st.integers(0, 2**16))
def test_indexed_attention_matches_a_dense_mask_on_keys_held_apart(row0, row1, seed):
    """Queries and keys as separate sets (Tq != Tk, any order, padding on both): the output
    and gradients of the dense mask built by loops; the block visibility covers every block
    pair holding a visible (query, key) pair."""
    q_idx, k_idx, k_leave = (np.stack(x) for x in zip(row0, row1))
    mask = naive_index_mask(q_idx, k_idx, k_leave)
    np.testing.assert_array_equal(attention.index_mask(q_idx, k_idx, k_leave), mask)
    vis = np.asarray(attention.index_block_visibility(q_idx, k_idx, k_leave, BLOCK))
    pairs = mask.reshape(2, TQ // BLOCK, BLOCK, TK // BLOCK, BLOCK).any(axis=(2, 4))
    assert not (pairs & ~vis).any()

    q, _, _, cotangent = random_qkv(seed, t=TQ)
    _, k, v, _ = random_qkv(seed + 1, t=TK)
    idx = (jnp.asarray(x) for x in (q_idx, k_idx, k_leave))
    out, grads = indexed_value_and_grads(q, k, v, *idx, cotangent)
    ref_out, ref_grads = masked_value_and_grads(q, k, v, jnp.asarray(mask), cotangent)
    np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=1e-5)
    for name, g, ref in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(g, ref, atol=1e-5, rtol=1e-5, err_msg=f"d{name}")


def test_indexed_attention_with_a_row_own_indices_is_block_sparse_attention():
    q, k, v, _ = random_qkv(13)
    leave = jnp.asarray(np.stack([leave_from_parents([-1, 0, 1, 1, 3, 0], T)] * 2))
    idx = jnp.broadcast_to(jnp.arange(T), (2, T))
    own = attention.block_sparse_attention(q, k, v, leave, BLOCK)
    np.testing.assert_array_equal(attention.indexed_attention(q, k, v, idx, idx, leave, BLOCK),
                                  own)  # fmt: skip


def test_indexed_attention_bad_inputs_raise_clearly():
    q, _, _, _ = random_qkv(14, t=TQ)
    _, k, v, _ = random_qkv(15, t=TK)
    q_idx, k_idx = jnp.zeros((2, TQ), jnp.int32), jnp.zeros((2, TK), jnp.int32)
    with pytest.raises(ValueError, match=r"q_idx has shape \(2, 48\), expected \(2, 32\)"):
        attention.indexed_attention(q, k, v, k_idx, k_idx, k_idx, BLOCK)
    with pytest.raises(ValueError, match=r"k_idx has shape \(2, 32\), expected \(2, 48\)"):
        attention.indexed_attention(q, k, v, q_idx, q_idx, k_idx, BLOCK)
    with pytest.raises(ValueError, match=r"k_leave has shape \(2, 47\)"):
        attention.indexed_attention(q, k, v, q_idx, k_idx, k_idx[:, :-1], BLOCK)
    with pytest.raises(ValueError, match="keys=40 is not a multiple of the attention block 16"):
        attention.indexed_attention(q, k[:, :40], v[:, :40], q_idx, k_idx[:, :40],
                                    k_idx[:, :40], BLOCK)  # fmt: skip
    with pytest.raises(ValueError, match="queries=32 is not a multiple of the attention block 24"):
        attention.indexed_attention(q, k, v, q_idx, k_idx, k_idx, 24)
    with pytest.raises(ValueError, match="disagree"):  # keys of another batch
        attention.indexed_attention(q, k[:1], v[:1], q_idx, k_idx[:1], k_idx[:1], BLOCK)
    with pytest.raises(ValueError, match="a row attends to its own T keys"):
        attention.attend(q, k, v, q_idx)


def naive_cached(q, k_cache, v_cache, q_pos_index, kv_len):
    """Per-query numpy loop: softmax over cache entries j <= pos, j < kv_len (cache
    [B, M, KVH, Dh], the layout a reader would write down first)."""
    b, t, h, d = q.shape
    group = h // k_cache.shape[2]
    out = np.zeros(q.shape, np.float64)
    for bi in range(b):
        for ti in range(t):
            n = min(int(q_pos_index[bi, ti]) + 1, int(kv_len[bi]))
            for hi in range(h):
                keys = np.float64(k_cache[bi, :n, hi // group])
                s = keys @ np.float64(q[bi, ti, hi]) / np.sqrt(d)
                p = np.exp(s - s.max())
                out[bi, ti, hi] = p / p.sum() @ np.float64(v_cache[bi, :n, hi // group])
    return out


def random_cache(seed, shape):
    """Two standard normal caches (K, V) of ``shape``, drawn on the host."""
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(shape, np.float32) for _ in range(2))


def k_layout(x):
    """[B, M, KVH, Dh] (the reader's layout) -> the cache's K, [B, KVH, Dh, M] (moved on the
    host: an eager jnp transpose compiles once per shape)."""
    return jnp.asarray(np.transpose(np.asarray(x), (0, 2, 3, 1)))


def v_layout(x):
    """[B, M, KVH, Dh] -> the cache's V, [B, KVH, M, Dh]."""
    return jnp.asarray(np.swapaxes(np.asarray(x), 1, 2))


@pytest.mark.slow
def test_cached_attention_decode_and_prefill():
    m = 24
    q, _, _, _ = random_qkv(6, t=3)
    k_cache, v_cache = random_cache(7, (2, m, KVH, DH))
    # Row 0: a 3-token prefill chunk at 5..7 of a 8-entry slot; row 1: decode positions 20..22
    # with entries beyond kv_len holding garbage that must not leak in.
    q_pos_index = jnp.array([[5, 6, 7], [20, 21, 22]], jnp.int32)
    kv_len = jnp.array([8, 23], jnp.int32)
    out = attention.cached_attention(q, k_layout(k_cache), v_layout(v_cache), q_pos_index, kv_len)
    ref = naive_cached(*(np.asarray(x) for x in (q, k_cache, v_cache, q_pos_index, kv_len)))
    np.testing.assert_allclose(out, ref, atol=1e-5)


@pytest.mark.parametrize("b", [1, 3])  # one row attends by sums, more rows by dots
def test_one_query_decode_matches_the_loop_reference(b):
    m = 24
    q, _, _, _ = random_qkv(11, b=b, t=1)
    k_cache, v_cache = random_cache(12, (b, m, KVH, DH))
    # Row 0 decodes at 9 (entries past it hold garbage); rows 1 and 2: at 0 (sees only entry
    # 0) and an idle row aimed past the cache (pos = kv_len - 1 = m), which sees every entry.
    pos = jnp.array([9, 0, m][:b], jnp.int32)[:, None]
    kv_len = pos[:, 0] + 1
    out = jax.jit(attention.cached_attention)(q, k_layout(k_cache), v_layout(v_cache), pos, kv_len)
    ref = naive_cached(*(np.asarray(x) for x in (q, k_cache, v_cache, pos, kv_len)))
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(out, ref, atol=1e-5)


def test_cached_attention_equals_causal_tree_attention():
    q, k, v, _ = random_qkv(8)
    positions = jnp.broadcast_to(jnp.arange(T), (2, T))
    out = attention.cached_attention(q, k_layout(k), v_layout(v), positions, jnp.full((2,), T))
    ref = attention.dense_attention(q, k, v, jnp.full((2, T), T, jnp.int32))
    np.testing.assert_allclose(out, ref, atol=1e-5)


def live_inputs(seed, pos, m):
    """q[B,1,H,Dh], own k/v [B,1,KVH,Dh] and a cache (K [B,KVH,Dh,M], V [B,KVH,M,Dh]) of
    random (garbage past each row's pos) entries; the row's own k/v are also written at its
    pos (as the engine does), so naive_cached over entries j <= pos is the reference."""
    b = len(pos)
    # numpy draws: jax.random compiled a program per shape, most of this test's time
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, 1, H, DH), np.float32))
    k_cache, v_cache = (rng.standard_normal((b, m, KVH, DH), np.float32) for _ in range(2))
    k_own, v_own = (rng.standard_normal((b, 1, KVH, DH), np.float32) for _ in range(2))
    for i, p in enumerate(pos):
        if p < m:
            k_cache[i, p], v_cache[i, p] = k_own[i, 0], v_own[i, 0]
    own = (jnp.asarray(k_own), jnp.asarray(v_own))
    return q, *own, k_layout(k_cache), v_layout(v_cache), (k_cache, v_cache)


live = jax.jit(attention.live_decode_attention, static_argnums=6)


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(
    st.integers(1, 40), st.integers(1, 16), st.lists(st.integers(0, 40), min_size=1, max_size=4),
    st.integers(0, 2**16),
)  # fmt: skip
def test_live_decode_attention_matches_the_loop_reference(m, block, raw_pos, seed):
    # Any cache length, block (the last block is clamped when block does not divide M) and
    # positions, idle rows (pos >= M) among them, one row (sums) or more (dots): running rows
    # equal softmax over j <= pos.
    pos = [p if p <= m else m for p in raw_pos]
    q, k_own, v_own, k_cache, v_cache, (k_np, v_np) = live_inputs(seed, pos, m)
    out = np.asarray(live(q, k_own, v_own, k_cache, v_cache, jnp.asarray(pos), block))
    running = [i for i, p in enumerate(pos) if p < m]
    if running:
        pos_Bx1 = np.asarray(pos)[running, None]
        ref = naive_cached(np.asarray(q)[running], k_np[running], v_np[running], pos_Bx1,
                           pos_Bx1[:, 0] + 1)  # fmt: skip
        np.testing.assert_allclose(out[running], ref, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("block", [4, 7, 16])  # 40 = 16 + 16 + 8: a clamped last block
def test_live_decode_attention_rows_do_not_depend_on_their_batch(block):
    # Row 0 (pos 5) next to short rows and next to a long one: the long one adds blocks row 0
    # cannot see, which must leave its numbers bit for bit as they were.
    m = 40
    q, k_own, v_own, k_cache, v_cache, _ = live_inputs(3, [5, 2, 39], m)
    short = live(q[:2], k_own[:2], v_own[:2], k_cache[:2], v_cache[:2], jnp.array([5, 2]), block)
    full = live(q, k_own, v_own, k_cache, v_cache, jnp.array([5, 2, 39]), block)
    idle = live(q, k_own, v_own, k_cache, v_cache, jnp.array([5, 2, m]), block)
    np.testing.assert_array_equal(np.asarray(short[0]), np.asarray(full[0]))
    np.testing.assert_array_equal(np.asarray(idle[:2]), np.asarray(short))


def test_attention_refuses_a_k_cache_in_the_wrong_layout():
    # K laid out like V ([B, KVH, M, Dh]) or cut short is refused by name (M != Dh here, so
    # the shapes differ; where M == Dh only the engine's own cache writes keep them apart)
    q, k_own, v_own, k_cache, v_cache, _ = live_inputs(5, [3], DH + 1)
    pos = jnp.array([[3]])
    k_like_v = jnp.swapaxes(k_cache, 2, 3)
    with pytest.raises(ValueError, match="KV cache layout"):
        attention.cached_attention(q, k_like_v, v_cache, pos, jnp.array([4]))
    with pytest.raises(ValueError, match="KV cache layout"):
        attention.live_decode_attention(q, k_own, v_own, k_like_v, v_cache, pos[:, 0], 4)
    with pytest.raises(ValueError, match="KV cache layout"):
        attention.live_prefill_attention(q, k_cache[..., :-1], v_cache, 0, pos, jnp.array([4]), 4)


def test_live_decode_attention_bad_heads_raise():
    q, k_own, v_own, k_cache, v_cache, _ = live_inputs(5, [3], 8)
    with pytest.raises(ValueError, match="not a multiple of cache kv heads"):
        attention.live_decode_attention(q[:, :, :3], k_own, v_own, k_cache, v_cache,
                                        jnp.array([3]), 4)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "start,t,block",
    [
        (9, 5, 4),  # mid-slot chunk, several blocks
        (9, 5, 64),  # one block (block > M)
        (0, 6, 4),  # a chunk that starts the slot
        (18, 6, 7),  # reaches the last block, clamped (24 = 7 + 7 + 7 + 3)
        (20, 8, 7),  # a padded chunk past M: kv_len 28 > 24, its tail writes nowhere
    ],
)
def test_live_prefill_attention_matches_the_loop_reference(start, t, block):
    # A chunk of slot 2 in a cache of 3 slots x 24 entries (garbage past kv_len and in the
    # other slots): equal to softmax over j <= pos, j < kv_len, for every query inside M.
    m, slot = 24, 2
    q, _, _, _ = random_qkv(21, b=1, t=t)
    k_np, v_np = random_cache(22, (3, m, KVH, DH))
    k_cache, v_cache = k_layout(k_np), v_layout(v_np)
    q_pos = jnp.arange(start, start + t, dtype=jnp.int32)[None]
    kv_len = jnp.array([start + t], jnp.int32)
    out = jax.jit(attention.live_prefill_attention, static_argnums=6)(
        q, k_cache, v_cache, jnp.int32(slot), q_pos, kv_len, block
    )
    inside = min(t, m - start)  # queries at a cache index (a padded tail past M is ignored)
    rows = lambda x: np.asarray(x[slot : slot + 1])  # noqa: E731
    ref = naive_cached(np.asarray(q), rows(k_np), rows(v_np), np.asarray(q_pos),
                       np.minimum(kv_len, m))  # fmt: skip
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(out[:, :inside], ref[:, :inside], atol=1e-5)


@pytest.mark.slow
def test_live_prefill_attention_takes_one_row():
    q, _, _, _ = random_qkv(23, b=2, t=3)
    k_cache, v_cache = jnp.zeros((3, KVH, DH, 8)), jnp.zeros((3, KVH, 8, DH))
    with pytest.raises(ValueError, match="one row"):
        attention.live_prefill_attention(q, k_cache, v_cache, 0, jnp.zeros((2, 3), jnp.int32),
                                         jnp.array([3, 3]), 4)  # fmt: skip
