"""Tree attention. Query q sees key k iff k <= q < leave[k] (a causal row: leave = T).

STUB (dense reference only); the block-sparse path is being written.
Shapes: q[B,T,H,Dh], k/v[B,T,KVH,Dh], leave[B,T] int32 -> out[B,T,H,Dh].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def tree_mask(leave):
    """bool[B,T,T]: mask[b, q, k] = k <= q < leave[b, k]."""
    t = leave.shape[-1]
    q = jnp.arange(t)[:, None]
    k = jnp.arange(t)[None, :]
    return (k <= q) & (q < leave[:, None, :])


def dense_attention(q, k, v, leave):
    mask = tree_mask(leave)[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")


def attend(q, k, v, leave, impl: str = "block_sparse", block: int = 128):
    """Dispatches to the configured attention path (see gyre.config model.attention)."""
    del impl, block
    return dense_attention(q, k, v, leave)
