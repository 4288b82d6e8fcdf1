"""Tree attention. Query q sees key k iff k <= q < leave[k] (a causal row: leave = T).

Shapes: q[B,T,H,Dh], k/v[B,T,KVH,Dh] (GQA: H a multiple of KVH), leave[B,T] int32
-> out[B,T,H,Dh]. Scale 1/sqrt(Dh); softmax is accumulated in fp32 for fp32 and bf16 inputs.
A query that sees no key at all returns zeros (and gets zero gradient) on every path.

The rule with explicit indices (:func:`index_mask`): queries and keys each carry an index in
one row's numbering, q_idx[B,Tq] and k_idx[B,Tk], and each key its subtree end k_leave[B,Tk];
query i sees key j iff k_idx[j] <= q_idx[i] < k_leave[j] (q_idx < 0: a padding query that
sees nothing). A row's own attention is q_idx = k_idx = arange(T), k_leave = leave;
:func:`indexed_attention` takes queries and keys held apart (the tree schedule,
gyre/train/tree_schedule.py: a branch's queries against [prefix keys; own keys]).

The fast path (`block_sparse_attention`, `indexed_attention`: one kernel) is flash-attention
style: an online softmax over key blocks that visits only the key blocks some query of the
query block may see, so its work follows the tree, not the row. Block visibility is judged
from bounds (:func:`index_block_visibility`): key block kb may be seen by query block qb iff
the least index of its valid keys is <= qb's largest query index and its largest leave is >
qb's least one; the exact mask is applied per pair. With a row's own indices (ascending,
contiguous) the bounds are exact: key block kb is seen by exactly the query blocks kb .. the
one holding (max leave in kb) - 1. Forward and the custom backward (FA2 order: key blocks
outside, the query blocks that may see them inside) both loop with data-dependent trip
counts, so skipped blocks cost nothing at run time.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

IMPLS = ("block_sparse", "dense")


def index_mask(q_idx, k_idx, k_leave):
    """bool[..., Tq, Tk]: query i sees key j iff k_idx[j] <= q_idx[i] < k_leave[j] and
    q_idx[i] >= 0 (q_idx[..., Tq]; k_idx, k_leave[..., Tk]; leading axes broadcast). The one
    mask rule: the dense reference's and every block pair's of the kernel."""
    qi = q_idx[..., :, None]
    return (k_idx[..., None, :] <= qi) & (qi < k_leave[..., None, :]) & (qi >= 0)


def tree_mask(leave):
    """bool[B,T,T]: mask[b, q, k] = k <= q < leave[b, k]."""
    idx = jnp.arange(leave.shape[-1])
    return index_mask(idx, idx, leave)


def dense_attention(q, k, v, leave):
    """Reference: a dense [B,1,T,T] tree mask through jax.nn.dot_product_attention."""
    mask_Bx1xTxT = tree_mask(leave)[:, None]
    out = jax.nn.dot_product_attention(q, k, v, mask=mask_Bx1xTxT, implementation="xla")
    # XLA returns the mean of V for a fully masked query; the tree paths return zeros.
    sees_any_BxT = jnp.any(mask_Bx1xTxT[:, 0], axis=-1)
    return out * sees_any_BxT[:, :, None, None].astype(out.dtype)


# ----------------------------------------------------------------------------- block visibility


def index_block_visibility(q_idx, k_idx, k_leave, block: int):
    """bool[..., nQ, nK]: False only where no query of block qb can see a key of block kb.

    q_idx[..., Tq], k_idx/k_leave[..., Tk] (leading axes broadcast), Tq and Tk multiples of
    ``block``. From bounds: kb's valid keys (k_idx < k_leave: the others are seen by no
    query) have least index k_lo and largest leave k_hi; qb's valid queries (q_idx >= 0)
    span [q_lo, q_hi]; visible iff k_lo <= q_hi and k_hi > q_lo. Exact for ascending
    contiguous indices (a row's own), conservative otherwise (pairs are masked exactly)."""
    _check_block(q_idx.shape[-1], block, "queries")
    _check_block(k_idx.shape[-1], block, "keys")
    big = jnp.iinfo(jnp.int32).max

    def per_block(x, reduce):
        return reduce(x.reshape(*x.shape[:-1], -1, block), axis=-1)

    valid = k_leave > k_idx
    k_lo = per_block(jnp.where(valid, k_idx, big), jnp.min)
    k_hi = per_block(jnp.where(valid, k_leave, -1), jnp.max)
    q_lo = per_block(jnp.where(q_idx >= 0, q_idx, big), jnp.min)
    q_hi = per_block(q_idx, jnp.max)  # all padding: < 0, below every valid key
    return (k_lo[..., None, :] <= q_hi[..., :, None]) & (k_hi[..., None, :] > q_lo[..., :, None])


def block_visibility(leave, block: int):
    """bool[..., nQ, nK]: vis[qb, kb] iff some query of block qb sees some key of block kb."""
    idx = jnp.arange(leave.shape[-1])
    return index_block_visibility(idx, idx, leave, block)


def visible_block_fraction(leave, block: int) -> float:
    """Fraction of the nQ x nK (query block, key block) pairs the block-sparse path visits."""
    vis = np.asarray(block_visibility(jnp.asarray(leave), block))
    return float(vis.mean())


def _visible_first(vis_XxY):
    """int32[X, Y]: per x, the y with vis[x, y] first (ascending), then the rest; and
    int32[X]: how many are visible (a loop's trip count)."""
    ny = vis_XxY.shape[-1]
    order = jnp.where(vis_XxY, jnp.arange(ny), ny + jnp.arange(ny))
    return jnp.argsort(order, axis=-1).astype(jnp.int32), vis_XxY.sum(-1).astype(jnp.int32)


def _check_block(n: int, block: int, what: str = "sequence length T"):
    if block <= 0 or n % block:
        raise ValueError(f"{what}={n} is not a multiple of the attention block {block}")


# ----------------------------------------------------------------------------- one row kernels
# Inside the kernels a row is head-major: q[KVH,G,Tq,D], k/v[KVH,Tk,D]; softmax state is fp32.
# q_idx[Tq], k_idx[Tk], k_leave[Tk] int32: the row's indices (the module docstring's rule).


def _scores(q_blk, k_blk, scale):
    return jnp.einsum("kgqd,ksd->kgqs", q_blk, k_blk, preferred_element_type=jnp.float32) * scale


def _pair_mask(q_idx, k_idx, k_leave, q0, k0, block):
    """bool[q, s] for the query block starting at q0 and the key block starting at k0."""
    sl = functools.partial(jax.lax.dynamic_slice_in_dim, slice_size=block)
    return index_mask(sl(q_idx, q0), sl(k_idx, k0), sl(k_leave, k0))


def _row_forward(q, k, v, q_idx, k_idx, k_leave, block, scale):
    """One row: out[KVH,G,Tq,D] (fp32) and lse[KVH,G,Tq] (-inf where a query sees nothing)."""
    kvh, g, t, d = q.shape
    vis_QxK = index_block_visibility(q_idx, k_idx, k_leave, block)
    kv_blocks_QxK, kv_count_Q = _visible_first(vis_QxK)
    slice_t = functools.partial(jax.lax.dynamic_slice_in_dim, slice_size=block, axis=-2)

    def query_block(qb, carry):
        out, lse = carry
        q0 = qb * block
        q_blk = slice_t(q, q0)

        def key_block(i, state):
            k0 = kv_blocks_QxK[qb, i] * block
            s = _scores(q_blk, slice_t(k, k0), scale)
            s = jnp.where(_pair_mask(q_idx, k_idx, k_leave, q0, k0, block), s, -jnp.inf)

            def mix(p):
                return jnp.einsum("kgqs,ksd->kgqd", p.astype(v.dtype), slice_t(v, k0),
                                  preferred_element_type=jnp.float32)  # fmt: skip

            return _fold_block(state, s, mix, empty_rows=True)

        init = (
            jnp.full((kvh, g, block), -jnp.inf, jnp.float32),
            jnp.zeros((kvh, g, block), jnp.float32),
            jnp.zeros((kvh, g, block, d), jnp.float32),
        )
        m, denom, acc = jax.lax.fori_loop(0, kv_count_Q[qb], key_block, init)
        seen = denom > 0
        denom = jnp.where(seen, denom, 1.0)
        o_blk = acc / denom[..., None]
        lse_blk = jnp.where(seen, m + jnp.log(denom), -jnp.inf)
        out = jax.lax.dynamic_update_slice_in_dim(out, o_blk, q0, axis=-2)
        lse = jax.lax.dynamic_update_slice_in_dim(lse, lse_blk, q0, axis=-1)
        return out, lse

    init = (jnp.zeros((kvh, g, t, d), jnp.float32), jnp.full((kvh, g, t), -jnp.inf, jnp.float32))
    return jax.lax.fori_loop(0, t // block, query_block, init)


def _row_backward(q, k, v, q_idx, k_idx, k_leave, out, lse, dout, block, scale):
    """One row, FA2 order: dq, dk, dv (fp32) visiting only visible (query, key) block pairs:
    key blocks outside (dk, dv of a block accumulate in registers), the query blocks that may
    see them inside, ascending (dq accumulates in place)."""
    vis_QxK = index_block_visibility(q_idx, k_idx, k_leave, block)
    q_blocks_KxQ, q_count_K = _visible_first(vis_QxK.T)
    slice_t = functools.partial(jax.lax.dynamic_slice_in_dim, slice_size=block, axis=-2)
    slice_r = functools.partial(jax.lax.dynamic_slice_in_dim, slice_size=block, axis=-1)
    delta = jnp.sum(dout.astype(jnp.float32) * out, axis=-1)  # [KVH,G,Tq]
    lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)

    def key_block(kb, carry):
        dq, dk, dv = carry
        k0 = kb * block
        k_blk, v_blk = slice_t(k, k0), slice_t(v, k0)

        def query_block(i, state):
            dq, dk_blk, dv_blk = state
            q0 = q_blocks_KxQ[kb, i] * block
            q_blk, do_blk = slice_t(q, q0), slice_t(dout, q0)
            vis = _pair_mask(q_idx, k_idx, k_leave, q0, k0, block)
            s = _scores(q_blk, k_blk, scale)
            p = jnp.where(vis, jnp.exp(s - slice_r(lse_safe, q0)[..., None]), 0.0)
            dv_blk += jnp.einsum(
                "kgqs,kgqd->ksd", p.astype(v.dtype), do_blk, preferred_element_type=jnp.float32
            )
            dp = jnp.einsum("kgqd,ksd->kgqs", do_blk, v_blk, preferred_element_type=jnp.float32)
            ds = (p * (dp - slice_r(delta, q0)[..., None])).astype(q.dtype)
            dk_blk += scale * jnp.einsum(
                "kgqs,kgqd->ksd", ds, q_blk, preferred_element_type=jnp.float32
            )
            dq_blk = slice_t(dq, q0) + scale * jnp.einsum(
                "kgqs,ksd->kgqd", ds, k_blk, preferred_element_type=jnp.float32
            )
            return jax.lax.dynamic_update_slice_in_dim(dq, dq_blk, q0, axis=-2), dk_blk, dv_blk

        zeros = jnp.zeros(k_blk.shape, jnp.float32)
        dq, dk_blk, dv_blk = jax.lax.fori_loop(0, q_count_K[kb], query_block, (dq, zeros, zeros))
        dk = jax.lax.dynamic_update_slice_in_dim(dk, dk_blk, k0, axis=-2)
        dv = jax.lax.dynamic_update_slice_in_dim(dv, dv_blk, k0, axis=-2)
        return dq, dk, dv

    init = (
        jnp.zeros(q.shape, jnp.float32),
        jnp.zeros(k.shape, jnp.float32),
        jnp.zeros(v.shape, jnp.float32),
    )
    return jax.lax.fori_loop(0, k.shape[-2] // block, key_block, init)


# ----------------------------------------------------------------------------- batched, with vjp


def _to_rows(q, k, v):
    """[B,Tq,H,D] -> [B,KVH,G,Tq,D] and [B,Tk,KVH,D] -> [B,KVH,Tk,D]."""
    b, t, h, d = q.shape
    kvh = k.shape[2]
    q_rows = q.reshape(b, t, kvh, h // kvh, d).transpose(0, 2, 3, 1, 4)
    return q_rows, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def _from_q_rows(x):
    b, kvh, g, t, d = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(b, t, kvh * g, d)


def _forward_rows(q, k, v, q_idx, k_idx, k_leave, block):
    scale = 1.0 / math.sqrt(q.shape[-1])
    q_r, k_r, v_r = _to_rows(q, k, v)
    # lax.map, not vmap: each row keeps its own data-dependent trip counts.
    return jax.lax.map(lambda xs: _row_forward(*xs, block, scale),
                       (q_r, k_r, v_r, q_idx, k_idx, k_leave))  # fmt: skip


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _block_sparse(q, k, v, q_idx, k_idx, k_leave, block):
    out_r, _ = _forward_rows(q, k, v, q_idx, k_idx, k_leave, block)
    return _from_q_rows(out_r).astype(q.dtype)


def _block_sparse_fwd(q, k, v, q_idx, k_idx, k_leave, block):
    out_r, lse_r = _forward_rows(q, k, v, q_idx, k_idx, k_leave, block)
    return _from_q_rows(out_r).astype(q.dtype), (q, k, v, q_idx, k_idx, k_leave, out_r, lse_r)


def _block_sparse_bwd(block, residuals, dout):
    q, k, v, q_idx, k_idx, k_leave, out_r, lse_r = residuals
    scale = 1.0 / math.sqrt(q.shape[-1])
    q_r, k_r, v_r = _to_rows(q, k, v)
    dout_r = _to_rows(dout, k, v)[0]
    dq_r, dk_r, dv_r = jax.lax.map(
        lambda xs: _row_backward(*xs, block, scale),
        (q_r, k_r, v_r, q_idx, k_idx, k_leave, out_r, lse_r, dout_r),
    )
    dq = _from_q_rows(dq_r).astype(q.dtype)
    dk = dk_r.transpose(0, 2, 1, 3).astype(k.dtype)
    dv = dv_r.transpose(0, 2, 1, 3).astype(v.dtype)
    return dq, dk, dv, None, None, None


_block_sparse.defvjp(_block_sparse_fwd, _block_sparse_bwd)


def _check_heads(q, k, v):
    """q[B,Tq,H,Dh] against k/v[B,Tk,KVH,Dh]: a ValueError naming the mismatch."""
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4:
        raise ValueError(
            f"expected q[B,T,H,Dh], k/v[B,T,KVH,Dh]; got {q.shape}, {k.shape}, {v.shape}"
        )
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(f"q {q.shape} and k/v {k.shape} disagree (H must be a multiple of KVH)")


def _check_qkv(q, k, v, leave):
    _check_heads(q, k, v)
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"q {q.shape} and k/v {k.shape} disagree: a row attends to its own "
                         "T keys (indexed_attention takes other keys)")  # fmt: skip
    if leave.shape != q.shape[:2]:
        raise ValueError(f"leave has shape {leave.shape}, expected {q.shape[:2]}")


def block_sparse_attention(q, k, v, leave, block: int = 128):
    """Tree attention visiting only visible key blocks. q[B,T,H,Dh] -> out[B,T,H,Dh]."""
    _check_qkv(q, k, v, leave)
    _check_block(q.shape[1], block)
    idx_BxT = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32), leave.shape)
    return _block_sparse(q, k, v, idx_BxT, idx_BxT, leave.astype(jnp.int32), block)


def indexed_attention(q, k, v, q_idx, k_idx, k_leave, block: int = 128):
    """Tree attention of queries against keys held apart, both indexed in one row's numbering.

    q[B,Tq,H,Dh]; k/v[B,Tk,KVH,Dh] (GQA: H a multiple of KVH); q_idx[B,Tq], k_idx[B,Tk],
    k_leave[B,Tk] int. Query i sees key j iff ``k_idx[j] <= q_idx[i] < k_leave[j]``
    (:func:`index_mask`); a query with q_idx < 0, or that sees no key, returns zeros (zero
    gradient); a key with k_leave <= k_idx is seen by none. Keys may come in any order (a
    block's visibility is judged from its bounds: ascending runs skip the most). Tq and Tk
    multiples of ``block``. The block-sparse kernel of :func:`block_sparse_attention` (which
    is this with q_idx = k_idx = arange(T)). -> out[B,Tq,H,Dh]."""
    _check_heads(q, k, v)
    (b, tq), tk = q.shape[:2], k.shape[1]
    for name, x, want in (("q_idx", q_idx, (b, tq)), ("k_idx", k_idx, (b, tk)),
                          ("k_leave", k_leave, (b, tk))):  # fmt: skip
        if x.shape != want:
            raise ValueError(f"{name} has shape {x.shape}, expected {want} (q {q.shape}, "
                             f"k/v {k.shape})")  # fmt: skip
    _check_block(tq, block, "queries")
    _check_block(tk, block, "keys")
    i32 = jnp.int32
    return _block_sparse(q, k, v, q_idx.astype(i32), k_idx.astype(i32), k_leave.astype(i32),
                         block)  # fmt: skip


def attend(q, k, v, leave, impl: str = "block_sparse", block: int = 128):
    """Dispatches to the configured attention path (see gyre.config model.attention).

    A row shorter than the block is one block (short test and smoke rows need no padding).
    """
    if impl == "block_sparse":
        return block_sparse_attention(q, k, v, leave, min(block, q.shape[1]))
    if impl == "dense":
        _check_qkv(q, k, v, leave)
        return dense_attention(q, k, v, leave)
    raise ValueError(f"unknown attention impl {impl!r}; expected one of {IMPLS}")


def _cache_dims(q, k_cache, v_cache) -> tuple[int, int]:
    """(KVH, M) of a slot KV cache laid out as decoder.CACHE_AXES (K [S, KVH, Dh, M], V
    [S, KVH, M, Dh]) that queries q[..., H, Dh] can attend to; a ValueError naming the
    mismatch otherwise (where M == Dh the shapes cannot tell a K stored like V; the engine's
    cache writes, decoder.forward_serving, are what keep the layouts apart)."""
    h, d = q.shape[-2:]
    kvh, m, dv = v_cache.shape[1:]
    if dv != d or tuple(k_cache.shape[1:]) != (kvh, d, m):
        raise ValueError(
            f"KV cache layout: want K [S, {kvh}, {d}, {m}] (kv heads, head dim, positions) "
            f"and V [S, {kvh}, {m}, {d}] for queries of head dim {d}; got K "
            f"{tuple(k_cache.shape)}, V {tuple(v_cache.shape)}"
        )
    if h % kvh:
        raise ValueError(f"query heads {h} are not a multiple of cache kv heads {kvh}")
    return kvh, m


def cached_attention(q, k_cache, v_cache, q_pos_index, kv_len):
    """Decode/prefill attention over a slot KV cache (causal within the slot).

    q[B,T,H,Dh]; k_cache[B,KVH,Dh,M], v_cache[B,KVH,M,Dh] (the cache's layouts,
    decoder.CACHE_AXES: both contractions read it as stored); q_pos_index[B,T] int: the
    cache index of each query; kv_len[B] int: valid cache entries. Query at index i sees
    entries j <= i, j < kv_len. Dense over all M entries (rollout.kv_block 0;
    :func:`live_decode_attention` and :func:`live_prefill_attention` read only the live
    blocks).
    """
    b, t, h, d = q.shape
    kvh, m = _cache_dims(q, k_cache, v_cache)
    if t == 1:
        return _decode_attention(q, k_cache, v_cache, q_pos_index[:, 0], kv_len)
    q_BxTxKxGxD = q.reshape(b, t, kvh, h // kvh, d)
    s = jnp.einsum(
        "btkgd,bkdm->bkgtm", q_BxTxKxGxD, k_cache, preferred_element_type=jnp.float32
    ) / math.sqrt(d)
    j = jnp.arange(m)
    vis_BxTxM = (j[None, None, :] <= q_pos_index[:, :, None]) & (
        j[None, None, :] < kv_len[:, None, None]
    )
    out = jnp.einsum(
        "bkgtm,bkmd->btkgd", _masked_softmax(s, vis_BxTxM[:, None, None]).astype(v_cache.dtype),
        v_cache, preferred_element_type=jnp.float32,
    )  # fmt: skip
    return out.reshape(b, t, h, d).astype(q.dtype)


def _decode_attention(q, k_cache, v_cache, q_pos_B, kv_len_B):
    """cached_attention for one query per row (T = 1), without a query-length axis: the
    scores are [B, KVH, G, M] with positions minor, so neither contraction transposes the
    probabilities (with a T axis XLA:CPU copied them into the dot's layout, every layer
    and step: a 1.2x slower decode loop at batch 8 and 32).

    A single row drops its batch axis and contracts by multiply-and-sum instead of dots:
    with B = 1 XLA:CPU drops the unit axis from the dot's operand, fuses that reshape into
    the cache write, duplicates the write and copies every layer's cache four times a step
    (a 13-25% slower decode loop at batch 1); a sum reads the written cache in place, and
    one without the unit batch axis is 3-9% faster again. At B > 1 the dots are 0-7% faster.
    K's positions are minor (``[KVH, Dh, M]`` per row): the scores are a plain product per
    head, no transpose of the cache (see decoder.CACHE_AXES)."""
    b, _, h, d = q.shape
    kvh, m = v_cache.shape[1], v_cache.shape[2]
    j = jnp.arange(m)
    if b == 1:
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731  (products in f32, as the dots')
        q_KxGxD = f32(q.reshape(kvh, h // kvh, d))
        s = (q_KxGxD[..., None] * f32(k_cache[0])[:, None]).sum(-2) / math.sqrt(d)
        vis_M = (j <= q_pos_B[0]) & (j < kv_len_B[0])
        p = _visible_softmax(s, vis_M[None, None, :]).astype(v_cache.dtype)
        out = (f32(p)[..., None] * f32(v_cache[0])[:, None, :, :]).sum(-2)
        return out.reshape(1, 1, h, d).astype(q.dtype)
    q_BxKxGxD = q.reshape(b, kvh, h // kvh, d)
    s = jnp.einsum("bkgd,bkdm->bkgm", q_BxKxGxD, k_cache, preferred_element_type=jnp.float32)
    vis_BxM = (j[None, :] <= q_pos_B[:, None]) & (j[None, :] < kv_len_B[:, None])
    p = _visible_softmax(s / math.sqrt(d), vis_BxM[:, None, None, :]).astype(v_cache.dtype)
    out = jnp.einsum("bkgm,bkmd->bkgd", p, v_cache, preferred_element_type=jnp.float32)
    return out.reshape(b, 1, h, d).astype(q.dtype)


def _live_block(i, blk: int, m: int):
    """Block ``i`` of ``blk`` cache entries -> (lo, start, j): its nominal first index, where
    it is read (a last block that would pass M is clamped inside the cache) and the indices
    read, int[blk]; the caller masks j < lo (entries the block before already saw)."""
    lo = i * blk
    start = jnp.minimum(lo, m - blk)
    return lo, start, start + jnp.arange(blk)


def _fold_block(state, s, mix, empty_rows: bool = False):
    """One online-softmax step: state (running max, denominator, unnormalised output) and a
    block's masked scores ``s[..., N]`` (-inf where not visible) -> the new state; ``mix(p)``:
    p's product with the block's values. Against a finite running max, a block with no
    visible entry leaves the state bit for bit: exp(0) = 1 and exact zeros.

    ``empty_rows``: a row may have seen nothing yet (running max -inf after the block: tree
    rows' padding queries); its max is taken as 0 there, not -inf (no -inf - -inf = NaN), so
    it stays at zeros. The cache folds leave it off: their rows always see an entry."""
    m_run, l_run, acc = state
    m_new = jnp.maximum(m_run, s.max(-1))
    m_ref = jnp.where(jnp.isfinite(m_new), m_new, 0.0) if empty_rows else m_new
    c = jnp.exp(m_run - m_ref)
    p = jnp.exp(s - m_ref[..., None])
    return m_new, l_run * c + p.sum(-1), acc * c[..., None] + mix(p)


def live_length(pos_B, max_len):
    """Cache entries before the longest running row's query: max pos over rows < max_len."""
    return jnp.where(pos_B < max_len, pos_B, 0).max()


def live_decode_attention(q, k_new, v_new, k_cache, v_cache, pos_B, block, live=None):
    """One query per row against the live part of a slot KV cache, ``block`` entries at a time.

    q[B,1,H,Dh]; k_new/v_new[B,1,KVH,Dh]: the row's own key and value (at index pos);
    k_cache[B,KVH,Dh,M], v_cache[B,KVH,M,Dh] as stored (decoder.CACHE_AXES; cast to q's
    dtype a block at a time); pos_B int[B]: the query's cache index. Row b attends to its
    own k/v and to cache entries j < pos_B[b]; rows with pos >= M are idle (their output is
    garbage and they set no work). ``live``: int scalar, max pos over running rows
    (computed here when None; a caller with several layers passes it once: one reduction a
    step where slots are sharded). -> out[B,1,H,Dh].

    An online softmax (flash-attention style) in a device loop over the blocks up to the
    longest live row, so a step costs what the live contexts need, not max_len: with
    max_len 2048 and contexts under 200 tokens a decode loop ran 1.7-4.0x faster than dense
    attention over the whole cache (2.6-4.0x on a quiet machine; benchmarks/live_attention.py).
    Rows are independent of their batch bit for bit: the fold starts from the row's own k/v
    (a finite score), and a block a shorter row cannot see scales its state by exp(0) = 1
    and adds exact zeros. A final block that would pass M is clamped in place and masks the
    entries it repeats."""
    kvh, m = _cache_dims(q, k_cache, v_cache)
    blk = min(block, m)

    def read(i):
        lo, start, j = _live_block(i, blk, m)
        # only the block is cast, not the cache; K's positions are its last axis
        k_blk = jax.lax.dynamic_slice_in_dim(k_cache, start, blk, axis=3)
        v_blk = jax.lax.dynamic_slice_in_dim(v_cache, start, blk, axis=2)
        return lo, j, k_blk, v_blk

    if live is None:
        live = live_length(pos_B, m)
    return _decode_fold(q, k_new, v_new, pos_B, kvh, read, (live + blk - 1) // blk)


def pages_per_block(page: int, block: int) -> int:
    """Pages a paged attention block reads at once: ``block`` entries (at least one page)."""
    return max(1, block // page)


def _gather_pages(pages, idx, axis: int):
    """The pages ``idx`` names, side by side: pages[N, *dims] (a page's entries on ``dims[axis]``),
    idx int[*lead, k] (clamped into [0, N)) -> [*lead, *dims] with ``dims[axis]`` k x as long,
    page idx[..., 0]'s entries first: the layout of a block of k x page contiguous cache
    entries, written straight by one gather (no transpose after it)."""
    dims = pages.shape[1:]
    lead = idx.ndim - 1
    k = idx.shape[-1]
    batch_at = (*range(lead), lead + axis)  # where the gather's index axes land
    offset = tuple(i for i in range(lead + 1 + len(dims)) if i not in batch_at)
    out = jax.lax.gather(
        pages,
        idx[..., None],
        jax.lax.GatherDimensionNumbers(
            offset_dims=offset, collapsed_slice_dims=(0,), start_index_map=(0,)
        ),
        slice_sizes=(1, *dims),
        mode=jax.lax.GatherScatterMode.CLIP,
    )
    return out.reshape(*idx.shape[:-1], *dims[:axis], k * dims[axis], *dims[axis + 1 :])


def _padded_table(table, k: int, num_pages: int):
    """``table`` (pages on its last axis) padded with ``num_pages`` (clamped, never visible) to
    a multiple of ``k`` columns, so every block of k columns is read where it starts."""
    pad = -table.shape[-1] % k
    if not pad:
        return table
    widths = [(0, 0)] * (table.ndim - 1) + [(0, pad)]
    return jnp.pad(table, widths, constant_values=num_pages)


def paged_decode_attention(q, k_new, v_new, k_pages, v_pages, table_BxP, pos_B, block, live=None):
    """:func:`live_decode_attention` over a paged KV cache: the same fold, blocks of pages.

    k_pages[N,KVH,Dh,ps], v_pages[N,KVH,ps,Dh] (a slot cache's layouts with pages for
    slots); table_BxP int: row b's pages in token order (entries past its pages: any index,
    clamped, never visible). Block i of row b is its pages ``i * n .. i * n + n - 1`` (n =
    :func:`pages_per_block` (ps, block)), gathered into the layout of a slot's block of n x
    ps entries, so a step reads only the live pages of each row, and the arithmetic is
    :func:`live_decode_attention`'s with ``block`` = n x ps, bit for bit, whatever the page
    size. Several pages a block, not one: each block is one trip of a device loop, whose
    fixed cost, not the bytes read, dominated a CPU decode step with pages of 16-64 (a loop
    over pages of 64 ran at 0.35-0.5x the slot layout's blocks of 128; benchmarks/
    kv_capacity.py). -> out[B,1,H,Dh]."""
    kvh, ps = _cache_dims(q, k_pages, v_pages)
    m = table_BxP.shape[1] * ps
    n = pages_per_block(ps, block)
    table = _padded_table(table_BxP, n, k_pages.shape[0])

    def read(i):
        idx_Bxn = jax.lax.dynamic_slice_in_dim(table, i * n, n, axis=1)
        k_blk = _gather_pages(k_pages, idx_Bxn, 2)  # [B, KVH, Dh, n ps]
        v_blk = _gather_pages(v_pages, idx_Bxn, 1)  # [B, KVH, n ps, Dh]
        return i * n * ps, i * n * ps + jnp.arange(n * ps), k_blk, v_blk

    if live is None:
        live = live_length(pos_B, m)
    return _decode_fold(q, k_new, v_new, pos_B, kvh, read, (live + n * ps - 1) // (n * ps))


def _decode_fold(q, k_new, v_new, pos_B, kvh, read, n_blocks):
    """The online softmax of one query per row over ``n_blocks`` blocks; ``read(i)`` -> (lo,
    j int[N], K block [B,KVH,Dh,N], V block [B,KVH,N,Dh]): block i's nominal first index,
    the cache indices it holds (entries j < lo are masked: a clamped block repeats them)."""
    b, _, h, d = q.shape
    g = h // kvh
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731  (products in f32, as the dots')
    q_BxKxGxD = f32(q.reshape(b, kvh, g, d))
    if b == 1:  # multiply-and-sum, not dots: see _decode_attention on B = 1
        q_KxGxD = q_BxKxGxD[0]

        def scores(k):
            return (q_KxGxD[..., None] * f32(k[0])[:, None]).sum(-2)[None]

        def mix(p, v):  # p rounded to v's dtype first, as the dots do
            return (f32(p[0].astype(v.dtype))[..., None] * f32(v[0])[:, None]).sum(-2)[None]

    else:
        scores = lambda k: jnp.einsum(  # noqa: E731
            "bkgd,bkdm->bkgm", q_BxKxGxD.astype(k.dtype), k, preferred_element_type=jnp.float32
        )
        mix = lambda p, v: jnp.einsum(  # noqa: E731
            "bkgm,bkmd->bkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32
        )
    scale = 1.0 / math.sqrt(d)
    # The fold's state: running max, denominator, unnormalised output, from the own k/v.
    m_BxKxG = (q_BxKxGxD * f32(k_new.reshape(b, kvh, 1, d))).sum(-1) * scale
    l_BxKxG = jnp.ones_like(m_BxKxG)
    acc_BxKxGxD = jnp.broadcast_to(f32(v_new.reshape(b, kvh, 1, d)), (b, kvh, g, d))

    def fold(i, state):
        lo, j, k_blk, v_blk = read(i)
        vis_BxN = (j[None, :] >= lo) & (j[None, :] < pos_B[:, None])
        k_blk, v_blk = k_blk.astype(q.dtype), v_blk.astype(q.dtype)
        s = jnp.where(vis_BxN[:, None, None, :], scores(k_blk) * scale, -jnp.inf)
        return _fold_block(state, s, lambda p: mix(p, v_blk))

    state = (m_BxKxG, l_BxKxG, acc_BxKxGxD)
    _, l_BxKxG, acc_BxKxGxD = jax.lax.fori_loop(0, n_blocks, fold, state)
    out = acc_BxKxGxD / l_BxKxG[..., None]
    return out.reshape(b, 1, h, d).astype(q.dtype)


def live_prefill_attention(q, k_cache, v_cache, slot, q_pos_1xT, kv_len_1, block):
    """Prefill attention of one row's chunk against the live blocks of its slot.

    q[1,T,H,Dh]; k_cache[S,KVH,Dh,M], v_cache[S,KVH,M,Dh] (every slot, as stored; the
    blocks read are cast to q's dtype; the chunk's own k/v already written); slot int
    scalar; q_pos_1xT int >= 0: each query's cache index; kv_len_1 int >= 1: valid entries
    (may pass M: a padded chunk's tail). Query at index i sees entries j <= i, j < kv_len.
    An online softmax over blocks of ``block`` entries up to kv_len, read straight from the
    slot (no gather of its whole max_len row): the cost follows the row's context, not
    max_len. One row at a time, as the prefill program runs them, so the trip count is the
    row's own. -> out[1,T,H,Dh]."""
    if q.shape[0] != 1:
        raise ValueError(f"live_prefill_attention takes one row, got {q.shape[0]}")
    kvh, m = _cache_dims(q, k_cache, v_cache)
    d, blk = q.shape[-1], min(block, m)

    def read(i):
        lo, start, j = _live_block(i, blk, m)
        k_blk = jax.lax.dynamic_slice(k_cache, (slot, 0, 0, start), (1, kvh, d, blk))[0]
        v_blk = jax.lax.dynamic_slice(v_cache, (slot, 0, start, 0), (1, kvh, blk, d))[0]
        return lo, j, k_blk, v_blk

    n_blocks = (jnp.minimum(kv_len_1[0], m) + blk - 1) // blk
    return _prefill_fold(q, kvh, read, n_blocks, q_pos_1xT, kv_len_1)


def paged_prefill_attention(q, k_pages, v_pages, table_P, q_pos_1xT, kv_len_1, block):
    """:func:`live_prefill_attention` over a paged KV cache: block i is the row's pages ``i *
    n .. i * n + n - 1`` (n = :func:`pages_per_block` (ps, block); k_pages[N,KVH,Dh,ps],
    v_pages[N,KVH,ps,Dh]; the chunk's own k/v already written to its pages), gathered into
    the layout of a slot's block: the same fold with ``block`` = n x ps. -> out[1,T,H,Dh]."""
    if q.shape[0] != 1:
        raise ValueError(f"paged_prefill_attention takes one row, got {q.shape[0]}")
    kvh, ps = _cache_dims(q, k_pages, v_pages)
    m = table_P.shape[0] * ps
    n = pages_per_block(ps, block)
    table = _padded_table(table_P, n, k_pages.shape[0])

    def read(i):
        idx_n = jax.lax.dynamic_slice_in_dim(table, i * n, n)
        k_blk = _gather_pages(k_pages, idx_n, 2)  # [KVH, Dh, n ps]
        v_blk = _gather_pages(v_pages, idx_n, 1)  # [KVH, n ps, Dh]
        return i * n * ps, i * n * ps + jnp.arange(n * ps), k_blk, v_blk

    n_blocks = (jnp.minimum(kv_len_1[0], m) + n * ps - 1) // (n * ps)
    return _prefill_fold(q, kvh, read, n_blocks, q_pos_1xT, kv_len_1)


def _prefill_fold(q, kvh, read, n_blocks, q_pos_1xT, kv_len_1):
    """The online softmax of one row's chunk over ``n_blocks`` blocks; ``read(i)`` -> (lo,
    j int[N], K block [KVH,Dh,N], V block [KVH,N,Dh]) as in :func:`_decode_fold`."""
    _, t, h, d = q.shape
    g = h // kvh
    q_KxGxTxD = q[0].reshape(t, kvh, g, d).transpose(1, 2, 0, 3)
    scale = 1.0 / math.sqrt(d)

    def fold(i, state):
        lo, j, k_blk, v_blk = read(i)
        vis_TxN = (j[None, :] >= lo) & (j[None, :] <= q_pos_1xT[0, :, None]) & (j < kv_len_1[0])
        k_blk, v_blk = k_blk.astype(q.dtype), v_blk.astype(q.dtype)
        s = jnp.einsum("kgtd,kdm->kgtm", q_KxGxTxD, k_blk, preferred_element_type=jnp.float32)
        s = jnp.where(vis_TxN, s * scale, -jnp.inf)

        def mix(p):
            return jnp.einsum("kgtm,kmd->kgtd", p.astype(v_blk.dtype), v_blk,
                              preferred_element_type=jnp.float32)  # fmt: skip

        # the running max starts at -inf and is finite from block 0 on (entry 0 is visible)
        return _fold_block(state, s, mix)

    init = (jnp.full((kvh, g, t), -jnp.inf), jnp.zeros((kvh, g, t)), jnp.zeros((kvh, g, t, d)))
    _, l_run, acc = jax.lax.fori_loop(0, n_blocks, fold, init)
    out_KxGxTxD = acc / l_run[..., None]
    return out_KxGxTxD.transpose(2, 0, 1, 3).reshape(1, t, h, d).astype(q.dtype)


def _visible_softmax(s, vis):
    """Softmax over the last axis where ``vis``. Entry 0 is always visible (q_pos >= 0 and
    kv_len >= 1 for any row, idle ones included), so no row is all -inf and the plain
    softmax needs none of :func:`_masked_softmax`'s guards."""
    s = jnp.where(vis, s, -jnp.inf)
    p = jnp.exp(s - s.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def _masked_softmax(s, vis):
    """Softmax of scores ``s`` over the last axis where ``vis`` (broadcast); rows that see
    nothing get zeros, not NaNs."""
    s = jnp.where(vis, s, -jnp.inf)
    m_safe = jnp.where(vis.any(-1), s.max(-1), 0.0)
    p = jnp.where(vis, jnp.exp(s - m_safe[..., None]), 0.0)
    denom = p.sum(-1, keepdims=True)
    return p / jnp.where(denom > 0, denom, 1.0)
