"""Pure-functional packing of selected token trees into padded rows (DESIGN.md, "Packed batch").

Per execution, the union of its selected paths is laid out in DFS order (``Forest``): every
subtree is contiguous, ``leave`` is one past its end, ``pred`` is the parent. A forest longer
than a row is cut into DFS ranges; a range ``[a, b)`` is preceded in its row by the ancestors of
node ``a`` (the only nodes outside the range that it can see) as zero-weight context. Ranges
(and whole small forests) are then binned into rows first-fit-decreasing, and the row count is
rounded up to a bucket. ``flatten`` produces the same batch type with one causal segment per
selected path: the reference (and the flat-training ablation).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from gyre.trajectory.tree import Tree


class PackedBatch(NamedTuple):
    """Every field is [R, T]. Padding: isolated one-token roots with zero weight.

    tokens, pos (depth), leave (subtree end; k is seen by q iff k <= q < leave[k]),
    pred (parent position, -1 for a root): int32. old_logp, adv_pos, adv_neg, w: float32.
    versions: int32 policy version (-1 for context). exec_index: int32 index of the
    execution in the step (-1 for padding). node_index: int32 tree node id (-1 for padding).
    A token is loss-bearing iff w > 0 (trainable and on a selected path).
    """

    tokens: np.ndarray
    pos: np.ndarray
    leave: np.ndarray
    pred: np.ndarray
    old_logp: np.ndarray
    adv_pos: np.ndarray
    adv_neg: np.ndarray
    w: np.ndarray
    versions: np.ndarray
    exec_index: np.ndarray
    node_index: np.ndarray


@dataclasses.dataclass(frozen=True, eq=False)
class Forest:
    """The union of one execution's selected paths in DFS order; M nodes.

    node: int32[M] tree node ids; depth/leave/parent: int32[M] (parent as a DFS index, -1 root);
    adv_pos/adv_neg/w: float64[M] summed over the selected paths through each trainable node.
    """

    node: np.ndarray
    depth: np.ndarray
    leave: np.ndarray
    parent: np.ndarray
    adv_pos: np.ndarray
    adv_neg: np.ndarray
    w: np.ndarray


def _path_lcp(tree: Tree, p, q) -> int:
    """Common prefix (in nodes) of two call paths given as run pairs."""
    for (r1, t1), (r2, t2) in zip(p, q):
        if r1 != r2:
            return int(tree.depth[tree.run_start[r1]])
        if t1 != t2:
            return int(tree.depth[tree.run_start[r1]]) + min(t1, t2)
    r, t = p[min(len(p), len(q)) - 1]  # one path is a prefix of the other (not for leaves)
    return int(tree.depth[tree.run_start[r]]) + t


def _dfs_pieces(tree: Tree, calls: Sequence[int]) -> tuple[list[int], list[int], np.ndarray]:
    """Paths sorted so shared prefixes are adjacent; lcp[k] with the previous; end depths + 1."""
    if len(calls) == 0:
        raise ValueError(f"execution {tree.execution_id!r} has no selected path")
    paths = [tree.call_paths[c] for c in calls]
    order = sorted(range(len(paths)), key=lambda i: paths[i])
    lcp = [0] + [_path_lcp(tree, paths[i], paths[j]) for i, j in zip(order, order[1:])]
    ends = np.asarray([int(tree.depth[tree.call_end[calls[i]]]) + 1 for i in order])
    return order, lcp, ends


def union_size(tree: Tree, calls: Sequence[int]) -> int:
    """Distinct nodes on the paths ending at ``calls`` (what tree packing forwards once)."""
    _, lcp, ends = _dfs_pieces(tree, calls)
    return int(ends.sum() - sum(lcp))


def build_forest(tree: Tree, calls: Sequence[int], coef: Sequence[float], adv: float) -> Forest:
    """DFS layout of the paths ending at ``calls`` with per-path coefficients ``coef``.

    Paths sorted by their run pairs group every shared prefix together, so emitting each
    path's suffix beyond its common prefix with the previous one is a preorder DFS.
    """
    order, lcp, ends = _dfs_pieces(tree, calls)
    paths = [tree.call_paths[c] for c in calls]
    ranges = []
    for k, i in enumerate(order):
        for r, t in paths[i]:
            d0 = int(tree.depth[tree.run_start[r]])
            if d0 + t > lcp[k]:
                s = int(tree.run_start[r])
                ranges.append(np.arange(s + max(lcp[k] - d0, 0), s + t))
    node = np.concatenate(ranges).astype(np.int32)
    sizes = ends - np.asarray(lcp)
    off = np.concatenate([[0], np.cumsum(sizes)])
    m = int(off[-1])
    # leave: a node at depth d in piece k spans to the first later piece attaching at <= d
    leave = np.empty(m, np.int64)
    lcp_arr = np.asarray(lcp)
    for k in range(len(order)):
        depths = np.arange(lcp[k], ends[k])
        later = -np.minimum.accumulate(lcp_arr[k + 1 :])
        j = np.searchsorted(later, -depths, side="left")
        leave[off[k] : off[k + 1]] = off[k + 1 + j]  # off[P] = m: no later piece
    inv = np.full(tree.num_nodes, -1, np.int64)
    inv[node] = np.arange(m)
    par = tree.parent[node]
    parent = np.where(par >= 0, inv[np.maximum(par, 0)], -1)
    # weight of u = sum over paths whose leaf lies in [u, leave[u]) (prefix sums at the leaves)
    leaf = off[1:] - 1
    c = np.asarray(coef, np.float64)[order]
    sums = {}
    for name, val in (("adv_pos", c * max(adv, 0.0)), ("adv_neg", c * min(adv, 0.0)), ("w", c)):
        cum = np.zeros(m + 1)
        cum[leaf + 1] = val
        cum = np.cumsum(cum)
        sums[name] = (cum[leave] - cum[np.arange(m)]) * tree.trainable[node]
    return Forest(node, tree.depth[node], leave.astype(np.int32), parent.astype(np.int32), **sums)


def split_forest(forest: Forest, row_len: int) -> list[tuple[int, int, np.ndarray]]:
    """Cuts a forest into ``(a, b, ancestors of a)`` chunks that fit ``row_len`` each.

    Each cut minimises the space it leaves unused plus the context the next chunk repeats:
    argmin over b of (a + cap - b) + depth[b].
    """
    m = forest.node.size
    if int(forest.depth.max()) >= row_len:
        raise ValueError(
            f"a path of {int(forest.depth.max()) + 1} tokens exceeds row_len {row_len}"
        )
    chunks, a = [], 0
    while a < m:
        anc = np.flatnonzero(forest.leave[:a] > a)  # ancestors of a, by depth
        cap = row_len - anc.size
        if m - a <= cap:
            chunks.append((a, m, anc))
            break
        cand = np.arange(a + 1, a + cap + 1)
        cost = forest.depth[cand] - cand
        b = int(cand[cand.size - 1 - np.argmin(cost[::-1])])  # latest of the cheapest
        chunks.append((a, b, anc))
        a = b
    return chunks


def rows_for(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= n; beyond the largest, the next multiple of the largest."""
    buckets = sorted(buckets)
    for b in buckets:
        if b >= n:
            return b
    return -(-n // buckets[-1]) * buckets[-1]


def _empty(n_rows: int, row_len: int) -> dict[str, np.ndarray]:
    shape = (n_rows, row_len)
    out = {f: np.zeros(shape, np.int32) for f in ("tokens", "pos")}
    out["leave"] = np.broadcast_to(np.arange(1, row_len + 1, dtype=np.int32), shape).copy()
    for f in ("pred", "versions", "exec_index", "node_index"):
        out[f] = np.full(shape, -1, np.int32)
    for f in ("old_logp", "adv_pos", "adv_neg", "w"):
        out[f] = np.zeros(shape, np.float32)
    return out


def _place(segments: list[dict], row_len: int, buckets: Sequence[int]) -> PackedBatch:
    """Bins segments (dicts of local arrays; leave/pred local) into rows, first-fit decreasing."""
    sizes = np.asarray([s["tokens"].size for s in segments], np.int64)
    free = np.zeros(0, np.int64)
    where = []
    for i in np.argsort(-sizes, kind="stable"):
        fits = np.flatnonzero(free >= sizes[i])
        if fits.size:
            r = int(fits[0])
        else:
            r, free = free.size, np.append(free, row_len)
        where.append((i, r, int(row_len - free[r])))
        free[r] -= sizes[i]
    out = _empty(rows_for(max(free.size, 1), buckets), row_len)
    for i, r, o in where:
        seg, n = segments[i], int(sizes[i])
        for f, v in seg.items():
            out[f][r, o : o + n] = v
        out["leave"][r, o : o + n] += o
        pred = out["pred"][r, o : o + n]
        pred[pred >= 0] += o
    return PackedBatch(**out)


def _gather(tree: Tree, nodes: np.ndarray, exec_index: int) -> dict[str, np.ndarray]:
    return dict(
        tokens=tree.tokens[nodes],
        pos=tree.depth[nodes],
        old_logp=tree.logp[nodes],
        versions=tree.version[nodes],
        exec_index=np.full(nodes.size, exec_index, np.int32),
        node_index=nodes,
    )


def pack(
    trees: Sequence[Tree],
    kept: Sequence[Sequence[int]],
    coefs: Sequence[Sequence[float]],
    advantages: Sequence[float],
    row_len: int,
    buckets: Sequence[int] = (1,),
) -> PackedBatch:
    """Tree packing. kept[e]: selected call indices of trees[e]; coefs[e]: their c_p;
    advantages[e]: A of execution e. Returns [rows_for(n, buckets), row_len] arrays."""
    segments = []
    for e, tree in enumerate(trees):
        forest = build_forest(tree, kept[e], coefs[e], advantages[e])
        for a, b, anc in split_forest(forest, row_len):
            idx = np.concatenate([anc, np.arange(a, b)])
            d, par = anc.size, forest.parent[idx]
            seg = _gather(tree, forest.node[idx], e)
            seg["leave"] = d + np.minimum(forest.leave[idx], b) - a
            seg["pred"] = np.where(
                par < 0, -1, np.where(par >= a, d + par - a, forest.depth[np.maximum(par, 0)])
            )
            for f in ("adv_pos", "adv_neg", "w"):
                seg[f] = np.concatenate([np.zeros(d), getattr(forest, f)[a:b]])
            segments.append(seg)
    return _place(segments, row_len, buckets)


def flatten(
    trees: Sequence[Tree],
    kept: Sequence[Sequence[int]],
    coefs: Sequence[Sequence[float]],
    advantages: Sequence[float],
    row_len: int,
    buckets: Sequence[int] = (1,),
) -> PackedBatch:
    """Reference / flat ablation: each selected path as its own causal segment."""
    segments = []
    for e, tree in enumerate(trees):
        for call, c in zip(kept[e], coefs[e]):
            nodes = tree.path_nodes(call)
            n = nodes.size
            if n > row_len:
                raise ValueError(f"a path of {n} tokens exceeds row_len {row_len}")
            seg = _gather(tree, nodes, e)
            seg["leave"] = np.full(n, n, np.int32)
            seg["pred"] = np.arange(-1, n - 1, dtype=np.int32)
            cw = c * tree.trainable[nodes]
            seg.update(
                adv_pos=cw * max(advantages[e], 0.0), adv_neg=cw * min(advantages[e], 0.0), w=cw
            )
            segments.append(seg)
    return _place(segments, row_len, buckets)


def ancestors_from_leave(leave_T: np.ndarray) -> np.ndarray:
    """bool[T, T]: sees[q, k] = k <= q < leave[k] (k is q or an ancestor of q)."""
    t = leave_T.shape[-1]
    q, k = np.arange(t)[:, None], np.arange(t)[None, :]
    return (k <= q) & (q < leave_T[None, :])


def clipped_objective(
    batch: PackedBatch, logp_RxT: np.ndarray, clip_low: float, clip_high: float
) -> float:
    """Numpy reference of the sign-split PPO loss -sum_j [min(r, clip r) adv_pos + max(r, clip r) adv_neg]."""
    r = np.exp(logp_RxT.astype(np.float64) - batch.old_logp)
    rc = np.clip(r, 1 - clip_low, 1 + clip_high)
    return float(-np.sum(np.minimum(r, rc) * batch.adv_pos + np.maximum(r, rc) * batch.adv_neg))
