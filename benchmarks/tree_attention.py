"""Tree attention: block-sparse vs dense mask on one branchy row, forward + backward.

The row is a shared prefix plus sibling branches (default: 2048 + 8 x 1024 = 10240 tokens, the
shape of retries from one point). Also times the same block-sparse kernel on a causal row of the
same length: the like-with-like reference (docs/exactness.md).

    source .venv/bin/activate && PYTHONPATH=. python benchmarks/tree_attention.py [--small]

Ideal ratio = query-key pairs a dense mask computes (T*T) / visible pairs of the tree. The
issue's bar: measured dense / block-sparse speedup >= half the ideal ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from gyre.model.attention import attend, visible_block_fraction


def branchy_leave(prefix: int, branches: int, branch_len: int) -> np.ndarray:
    """leave[T] of a prefix (every token's subtree runs to the row end) and sibling branches."""
    t = prefix + branches * branch_len
    leave = np.full(t, t, np.int32)
    for i in range(branches):
        start = prefix + i * branch_len
        leave[start : start + branch_len] = start + branch_len
    return leave


def visible_pairs(leave: np.ndarray) -> int:
    """Number of (query, key) pairs with k <= q < leave[k]."""
    return int(np.maximum(leave - np.arange(len(leave)), 0).sum())


def time_fwd_bwd(impl, q, k, v, leave, block, runs):
    """Median seconds of a jitted forward + backward (after one warm-up call)."""

    def loss(q, k, v):
        return jnp.sum(attend(q, k, v, leave, impl=impl, block=block).astype(jnp.float32))

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    jax.block_until_ready(step(q, k, v))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(step(q, k, v))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--small", action="store_true", help="512 + 8 x 256 tokens")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv_heads", type=int, default=2)
    parser.add_argument("--head_dim", type=int, default=64)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    prefix, branch_len = (512, 256) if args.small else (2048, 1024)
    leave_T = branchy_leave(prefix, 8, branch_len)
    t = len(leave_T)
    keys = jax.random.split(jax.random.key(args.seed), 3)
    q = jax.random.normal(keys[0], (1, t, args.heads, args.head_dim), jnp.float32)
    k = jax.random.normal(keys[1], (1, t, args.kv_heads, args.head_dim), jnp.float32)
    v = jax.random.normal(keys[2], (1, t, args.kv_heads, args.head_dim), jnp.float32)
    tree = jnp.asarray(leave_T)[None]
    causal = jnp.full((1, t), t, jnp.int32)

    dense_s = time_fwd_bwd("dense", q, k, v, tree, args.block, args.runs)
    sparse_s = time_fwd_bwd("block_sparse", q, k, v, tree, args.block, args.runs)
    causal_s = time_fwd_bwd("block_sparse", q, k, v, causal, args.block, args.runs)

    ideal = t * t / visible_pairs(leave_T)
    ideal_vs_causal = visible_pairs(np.full(t, t)) / visible_pairs(leave_T)
    figures = {
        "tokens": t,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "block": args.block,
        "blocks_visited_tree": round(visible_block_fraction(tree, args.block), 4),
        "blocks_visited_causal": round(visible_block_fraction(causal, args.block), 4),
        "dense_s": round(dense_s, 4),
        "block_sparse_tree_s": round(sparse_s, 4),
        "block_sparse_causal_s": round(causal_s, 4),
        "ideal_ratio_vs_dense": round(ideal, 3),
        "speedup_vs_dense": round(dense_s / sparse_s, 3),
        "speedup_over_ideal": round(dense_s / sparse_s / ideal, 3),
        "ideal_ratio_vs_causal": round(ideal_vs_causal, 3),
        "speedup_vs_causal_block_sparse": round(causal_s / sparse_s, 3),
        "meets_half_ideal": bool(dense_s / sparse_s >= ideal / 2),
    }
    print(
        f"tree attention fwd+bwd, T={t} (prefix {prefix} + 8 x {branch_len}), B=1, "
        f"H={args.heads}, KVH={args.kv_heads}, Dh={args.head_dim}, block={args.block}, "
        f"median of {args.runs}"
    )
    for name, value in figures.items():
        print(f"  {name:32s} {value}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
