"""Pure-functional packing of selected token trees into padded rows.

Per execution, the union of its selected paths is laid out in DFS order (``Forest``): every
subtree is contiguous, ``leave`` is one past its end, ``pred`` is the parent. A forest longer
than a row is cut into DFS ranges; a range ``[a, b)`` is preceded in its row by the ancestors of
node ``a`` (the only nodes outside the range that it can see) as zero-weight context. Ranges
(and whole small forests) are then binned into rows first-fit-decreasing, and the row count is
rounded up to a bucket. ``flatten`` produces the same batch type with one causal segment per
selected path: the reference (and the flat-training ablation).

The packer lays out the rows (``leave``, ``pred``); every other field, and its padding, is
declared in :mod:`gyre.trajectory.schema`, which this module fills field by field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from gyre.trajectory import schema
from gyre.trajectory.schema import PackedBatch, Segment
from gyre.trajectory.tree import Tree


@dataclasses.dataclass(frozen=True, eq=False)
class Forest:
    """The union of one execution's selected paths in DFS order; M nodes.

    node: int32[M] tree node ids; depth/leave/parent: int32[M] (parent as a DFS index, -1 root);
    w: float64[M] sum of c_p over the selected paths through each trainable node (0 for
    context); adv: the execution's advantage, so adv_pos = w * max(adv, 0), adv_neg likewise.
    """

    node: np.ndarray
    depth: np.ndarray
    leave: np.ndarray
    parent: np.ndarray
    w: np.ndarray
    adv: float


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
    m, n_paths = int(off[-1]), len(order)
    # A node at depth d of piece k lies on paths k..last-1, where piece `last` is the first later
    # piece attaching at depth <= d; its subtree ends where that piece starts.
    last = np.empty(m, np.int64)
    lcp_arr = np.asarray(lcp)
    for k in range(n_paths):
        later = -np.minimum.accumulate(lcp_arr[k + 1 :])
        depths = np.arange(lcp[k], ends[k])
        last[off[k] : off[k + 1]] = k + 1 + np.searchsorted(later, -depths, side="left")
    first = np.repeat(np.arange(n_paths), sizes)
    # parents: the previous node within a piece; a piece's first node hangs off the pieces
    # still open on the previous path (a stack of pieces by start depth).
    parent = np.arange(-1, m - 1, dtype=np.int32)
    stack = []
    for k in range(n_paths):
        while stack and lcp[stack[-1]] > lcp[k] - 1:
            stack.pop()
        parent[off[k]] = off[stack[-1]] + lcp[k] - 1 - lcp[stack[-1]] if lcp[k] else -1
        stack.append(k)
    # w of a node = sum of c_p over the paths through it (the paths of one execution share A)
    cum = np.concatenate([[0.0], np.cumsum(np.asarray(coef, np.float64)[order])])
    w = (cum[last] - cum[first]) * tree.trainable[node]
    return Forest(node, tree.depth[node], off[last].astype(np.int32), parent, w, float(adv))


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


def _bin(sizes: list[int], row_len: int) -> tuple[list[tuple[int, int]], int]:
    """First-fit decreasing: (row, offset) of each segment, and the number of rows used."""
    free = np.zeros(0, np.int64)
    where = [(0, 0)] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        fits = np.flatnonzero(free >= sizes[i])
        r = int(fits[0]) if fits.size else free.size
        if r == free.size:
            free = np.append(free, row_len)
        where[i] = (r, int(row_len - free[r]))
        free[r] -= sizes[i]
    return where, max(free.size, 1)


def _write(out, r: int, o: int, seg: Segment, trained: bool) -> slice:
    """Writes every schema field with a value for ``seg`` at row r from column o.

    Weighted fields only where ``trained``: repeated ancestors are context and keep their zero
    padding. Returns the columns written."""
    cols = slice(o, o + seg.nodes.size)
    for f in schema.fields():
        if f.value is not None and (trained or not f.weighted):
            out[f.name][r, cols] = f.value(seg)
    return cols


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
    chunks = []  # (execution, forest, a, b, ancestors of a)
    for e, tree in enumerate(trees):
        forest = build_forest(tree, kept[e], coefs[e], advantages[e])
        chunks += [(e, forest, a, b, anc) for a, b, anc in split_forest(forest, row_len)]
    where, n_rows = _bin([anc.size + b - a for _, _, a, b, anc in chunks], row_len)
    out = schema.empty(rows_for(n_rows, buckets), row_len)
    for (e, forest, a, b, anc), (r, o) in zip(chunks, where):
        d = anc.size
        if d:  # repeated ancestors: a chain of zero-weight context
            seg = Segment(trees[e], forest.node[anc], e, np.zeros(d), forest.adv)
            cols = _write(out, r, o, seg, trained=False)
            out["leave"][r, cols] = o + d + np.minimum(forest.leave[anc], b) - a
            out["pred"][r, cols] = np.arange(o - 1, o + d - 1)
            out["pred"][r, o] = -1
        seg = Segment(trees[e], forest.node[a:b], e, forest.w[a:b], forest.adv)
        cols = _write(out, r, o + d, seg, trained=True)
        out["leave"][r, cols] = o + d + np.minimum(forest.leave[a:b], b) - a
        par = forest.parent[a:b]
        inside = np.where(par >= a, o + d + par - a, o + forest.depth[np.maximum(par, 0)])
        out["pred"][r, cols] = np.where(par < 0, -1, inside)
    return PackedBatch(out)


def flatten(
    trees: Sequence[Tree],
    kept: Sequence[Sequence[int]],
    coefs: Sequence[Sequence[float]],
    advantages: Sequence[float],
    row_len: int,
    buckets: Sequence[int] = (1,),
) -> PackedBatch:
    """Reference / flat ablation: each selected path as its own causal segment."""
    paths = [(e, call, c) for e in range(len(trees)) for call, c in zip(kept[e], coefs[e])]
    sizes = [int(trees[e].depth[trees[e].call_end[call]]) + 1 for e, call, _ in paths]
    if max(sizes, default=0) > row_len:
        raise ValueError(f"a path of {max(sizes)} tokens exceeds row_len {row_len}")
    where, n_rows = _bin(sizes, row_len)
    out = schema.empty(rows_for(n_rows, buckets), row_len)
    for (e, call, c), (r, o) in zip(paths, where):
        nodes = trees[e].path_nodes(call)
        seg = Segment(trees[e], nodes, e, c * trees[e].trainable[nodes], float(advantages[e]))
        cols = _write(out, r, o, seg, trained=True)
        out["leave"][r, cols] = o + nodes.size
        out["pred"][r, cols] = np.arange(o - 1, o + nodes.size - 1)
        out["pred"][r, o] = -1
    return PackedBatch(out)
