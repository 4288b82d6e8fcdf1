"""The packed batch against the tree it came from and against flattened per-path training."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles import ancestors_from_leave, clipped_objective
from strategies import batches, branchy_execution

from gyre.trajectory.advantages import path_coefficients
from gyre.trajectory.pack import (
    build_forest,
    flatten,
    pack,
    rows_for,
    split_forest,
)
from gyre.trajectory.select import select_paths
from gyre.trajectory.tree import build_tree

FIELDS = ("adv_pos", "adv_neg", "w")


def prepare(execs, max_paths, mode, seed):
    trees = [build_tree(recs) for recs in execs]
    kept = [list(select_paths(t, max_paths).kept) for t in trees]
    lens = [np.asarray([t.path_trainable(c) for c in cs]) for t, cs in zip(trees, kept)]
    coefs = path_coefficients(lens, mode)
    adv = np.random.default_rng(seed).normal(size=len(trees))
    adv[0] = 0.0 if len(trees) > 2 else adv[0]  # a zero advantage still carries w
    longest = max(int(t.depth.max()) + 1 for t in trees)
    return trees, kept, coefs, adv, longest


def tree_ancestors(tree, node):
    out = []
    while node >= 0:
        out.append(int(node))
        node = tree.parent[node]
    return set(out)


def per_node(trees, seed):
    """A random value per (execution, node): the per-token function f of the identities."""
    rng = np.random.default_rng(seed)
    return [rng.normal(size=t.num_nodes) for t in trees]


def packed_sum(batch, values, field):
    real = batch.exec_index >= 0
    f = np.zeros(batch.w.shape)
    for e, v in enumerate(values):
        sel = real & (batch.exec_index == e)
        f[sel] = v[batch.node_index[sel]]
    return float(np.sum(getattr(batch, field).astype(np.float64) * f))


def path_sum(trees, kept, coefs, adv, values, field):
    """sum_p c_p * (A_p split by sign, or 1 for w) * sum_{t in p, trainable} f_t."""
    total = 0.0
    for t, cs, c, a, v in zip(trees, kept, coefs, adv, values):
        scale = {"adv_pos": max(a, 0.0), "adv_neg": min(a, 0.0), "w": 1.0}[field]
        for call, cp in zip(cs, c):
            nodes = t.path_nodes(call)
            total += cp * scale * float(np.sum(v[nodes] * t.trainable[nodes]))
    return total


@settings(max_examples=40, deadline=None)
@given(batches(), st.sampled_from([0, 1, 2, 5]), st.sampled_from([0, 3, 200]), st.integers(0, 99))
def test_rows_encode_the_tree(batch_in, max_paths, extra, seed):
    execs, _, _ = batch_in
    trees, kept, coefs, adv, longest = prepare(execs, max_paths, "token-mean", seed)
    b = pack(trees, kept, coefs, adv, longest + extra)
    for r in range(b.tokens.shape[0]):
        t_len = b.tokens.shape[1]
        assert np.all(b.leave[r] <= t_len) and np.all(b.leave[r] > np.arange(t_len))
        sees = ancestors_from_leave(b.leave[r])
        ex, nodes = b.exec_index[r], b.node_index[r]
        real = np.flatnonzero(ex >= 0)
        assert len({(ex[q], nodes[q]) for q in real}) == real.size  # a node once per row
        expect = np.eye(b.tokens.shape[1], dtype=bool)
        for q in real:
            t = trees[ex[q]]
            anc = tree_ancestors(t, nodes[q])
            expect[q, real] = (ex[real] == ex[q]) & np.isin(nodes[real], list(anc))
            assert expect[q].sum() == len(anc)  # every ancestor it needs is in the row
            assert b.pos[r, q] == t.depth[nodes[q]] and b.tokens[r, q] == t.tokens[nodes[q]]
            assert b.old_logp[r, q] == t.logp[nodes[q]] and b.versions[r, q] == t.version[nodes[q]]
            par = t.parent[nodes[q]]
            assert (
                (b.pred[r, q] == -1)
                if par < 0
                else (nodes[b.pred[r, q]] == par and ex[b.pred[r, q]] == ex[q])
            )
        assert np.array_equal(sees, expect)
        pad = ex < 0
        assert np.all(b.pred[r, pad] == -1) and np.all(b.w[r, pad] == 0)
    # every selected path's trainable tokens are loss-bearing exactly once, nothing else is
    bearing = b.w > 0
    got = sorted(zip(b.exec_index[bearing].tolist(), b.node_index[bearing].tolist()))
    want = set()
    for e, (t, cs) in enumerate(zip(trees, kept)):
        for c in cs:
            nodes = t.path_nodes(c)
            want |= {(e, int(n)) for n in nodes[t.trainable[nodes]]}
    assert got == sorted(want)


@settings(max_examples=40, deadline=None)
@given(
    batches(),
    st.sampled_from([0, 2, 5]),
    st.sampled_from(["token-mean", "sequence-mean", "two-level"]),
    st.integers(0, 99),
)
def test_weight_identity_and_clipped_objective(batch_in, max_paths, mode, seed):
    execs, _, _ = batch_in
    trees, kept, coefs, adv, longest = prepare(execs, max_paths, mode, seed)
    tree_b = pack(trees, kept, coefs, adv, longest + 7)
    small_b = pack(trees, kept, coefs, adv, longest)  # splitting invariance: more cuts
    flat_b = flatten(trees, kept, coefs, adv, longest + 7)
    f = per_node(trees, seed)
    for field in FIELDS:
        want = path_sum(trees, kept, coefs, adv, f, field)
        for b in (tree_b, small_b, flat_b):
            assert np.isclose(packed_sum(b, f, field), want, rtol=1e-5, atol=1e-6)
    # PPO clipping for random ratios: sign-split tree loss == sum of per-path clipped losses
    logp = [t.logp + np.random.default_rng(seed + 1).normal(0, 0.3, t.num_nodes) for t in trees]
    want = 0.0
    for t, cs, c, a, lp in zip(trees, kept, coefs, adv, logp):
        r = np.exp(lp - t.logp.astype(np.float64))
        obj = np.minimum(r * a, np.clip(r, 0.8, 1.28) * a)
        for call, cp in zip(cs, c):
            nodes = t.path_nodes(call)
            want -= cp * float(np.sum(obj[nodes] * t.trainable[nodes]))
    for b in (tree_b, small_b, flat_b):
        lp_b = np.zeros(b.w.shape)
        for e, v in enumerate(logp):
            sel = b.exec_index == e
            lp_b[sel] = v[b.node_index[sel]]
        assert np.isclose(clipped_objective(b, lp_b, 0.2, 0.28), want, rtol=1e-5, atol=1e-6)


def test_long_tree_continues_with_repeated_ancestors():
    recs = branchy_execution(5, n_calls=40, vocab=500, max_obs=30, max_gen=30)
    tree = build_tree(recs)
    kept = list(select_paths(tree, 0).kept)
    forest = build_forest(tree, kept, np.ones(len(kept)), 1.0)
    row_len = int(forest.depth.max()) + 1
    chunks = split_forest(forest, row_len)
    assert len(chunks) > 1
    b = pack([tree], [kept], [np.ones(len(kept))], [1.0], row_len)
    assert b.tokens.shape[0] >= len(chunks)
    repeated = (b.exec_index >= 0) & (b.w == 0) & tree.trainable[np.maximum(b.node_index, 0)]
    assert repeated.any()  # continuation rows carry context they do not train on
    bearing = b.pred[b.w > 0]
    assert np.all(bearing >= 0)  # every loss-bearing token is predicted from inside its row


def test_row_buckets_and_padding_rows():
    assert [rows_for(n, (1, 2, 4, 8)) for n in (1, 3, 8, 9, 17)] == [1, 4, 8, 16, 24]
    assert rows_for(5, (4,)) == 8
    recs = branchy_execution(1, n_calls=3)
    tree = build_tree(recs)
    kept = list(tree.leaf_calls)
    b = pack([tree], [kept], [np.ones(len(kept))], [0.5], 128, buckets=(4,))
    assert b.tokens.shape == (4, 128)
    assert np.all(b.leave[1:] == np.arange(1, 129)) and np.all(b.exec_index[1:] == -1)
