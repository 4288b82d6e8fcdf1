"""The central test: tree-packed loss and gradient equal the flattened per-path reference.

Two sources of batches: a hand-built trie packer here (independent of gyre.trajectory, so a
packer bug cannot hide in both sides) and, when present, gyre.trajectory.pack with its
``flatten`` reference on hypothesis-generated branchy executions with forced row splits.
"""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import branchy_execution

from gyre.config import default_config
from gyre.mesh import make_cells
from gyre.model import decoder
from gyre.rl.builder import build_specs
from gyre.train import loss as tloss
from gyre.train.step import Microbatch, Trainer, split_microbatches
from gyre.trajectory.batch import ExecutionResult, build_batch

ROW = 128
pytestmark = pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")


def tiny_specs():
    cfg = default_config()
    cfg.model.update(vocab_size=32, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1,
                     head_dim=16, d_ff=64, attn_block=32)  # fmt: skip
    cfg.trajectory.row_len = ROW
    cfg.train.rows_per_microbatch = 4
    return build_specs(cfg)


def agent_paths(seed, vocab=32):
    """Root-to-leaf token paths of one agent-like execution: (tokens, generated mask)."""
    rng = np.random.default_rng(seed)

    def seg(n, gen):
        return rng.integers(0, vocab, n), np.full(n, gen)

    def cat(*parts):
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    system, task = seg(6, False), seg(4, False)
    main = cat(system, task, seg(8, True), seg(5, False), seg(9, True), seg(4, False), seg(7, True))
    cut = 30  # deep retry: resumes inside the second completion
    retry = (np.concatenate([main[0][:cut], rng.integers(0, vocab, 12)]),
             np.concatenate([main[1][:cut], np.full(12, True)]))  # fmt: skip
    compaction = cat(system, seg(5, False), seg(10, True))  # shares only the system prompt
    sub_root = cat(seg(3, False), seg(6, True), seg(2, False), seg(5, True))  # its own root
    sub_shared = cat(system, seg(4, False), seg(8, True))
    return [main, retry, compaction, sub_root, sub_shared]


def pack_paths(paths, adv, coef, node_logp_noise, rng):
    """Trie of paths -> (tree row arrays, flat rows arrays). old_logp is a per-node value."""
    children, parent, token, gen, depth, node_paths = {}, [], [], [], [], []
    for tokens, mask in paths:
        nodes, prev = [], -1
        for d, (t, g) in enumerate(zip(tokens, mask)):
            key = (prev, int(t))
            if key not in children:
                children[key] = len(token)
                parent.append(prev), token.append(int(t)), gen.append(bool(g)), depth.append(d)
            prev = children[key]
            nodes.append(prev)
        node_paths.append(nodes)
    n = len(token)
    kids = [[] for _ in range(n + 1)]  # index n = virtual root
    for (p, _), c in sorted(children.items(), key=lambda kv: kv[1]):
        kids[p if p >= 0 else n].append(c)
    order, leave_of = [], {}

    def dfs(v):
        order.append(v)
        for c in kids[v]:
            dfs(c)
        leave_of[v] = len(order)

    for r in kids[n]:
        dfs(r)
    slot = {v: i for i, v in enumerate(order)}
    old_node = rng.normal(0, node_logp_noise, n)  # added to the model logp later
    tree = _empty(1)
    for v in order:
        i = slot[v]
        tree["tokens"][0, i], tree["pos"][0, i], tree["leave"][0, i] = (
            token[v],
            depth[v],
            leave_of[v],
        )
        tree["pred"][0, i] = slot[parent[v]] if parent[v] >= 0 else -1
        tree["versions"][0, i] = 0 if gen[v] else -1
    flat = _empty(len(paths))
    for p, nodes in enumerate(node_paths):
        m = len(nodes)
        flat["tokens"][p, :m] = [token[v] for v in nodes]
        flat["pos"][p, :m] = np.arange(m)
        flat["leave"][p, :m] = m
        flat["pred"][p, :m] = np.arange(m) - 1
        flat["versions"][p, :m] = [0 if gen[v] else -1 for v in nodes]
        for j, v in enumerate(nodes):
            if not gen[v]:
                continue
            a = adv[p] * coef[p]
            field = "adv_pos" if a > 0 else "adv_neg"
            flat[field][p, j] = a
            flat["w"][p, j] = coef[p]
            tree[field][0, slot[v]] += a
            tree["w"][0, slot[v]] += coef[p]
    noise_tree = np.zeros((1, ROW), np.float32)
    noise_tree[0, [slot[v] for v in range(n)]] = old_node
    noise_flat = np.zeros((len(paths), ROW), np.float32)
    for p, nodes in enumerate(node_paths):
        noise_flat[p, : len(nodes)] = old_node[nodes]
    return tree, flat, noise_tree, noise_flat


def _empty(rows):
    idx = np.broadcast_to(np.arange(ROW, dtype=np.int32), (rows, ROW))
    out = {k: np.zeros((rows, ROW), np.float32) for k in ("old_logp", "adv_pos", "adv_neg", "w")}
    out.update(tokens=np.zeros((rows, ROW), np.int32), pos=np.zeros((rows, ROW), np.int32),
               leave=(idx + 1).copy(), pred=np.full((rows, ROW), -1, np.int32),
               versions=np.full((rows, ROW), -1, np.int32))  # fmt: skip
    return out


def _pad_rows(arrays, rows):
    (mb,) = split_microbatches(arrays, rows)
    return mb.arrays


@functools.partial(jax.jit, static_argnums=0)
def _logp(graphdef, params, tokens, pos, leave, pred):
    hidden = decoder.apply(graphdef, params, tokens, pos, leave)
    logits = decoder.apply_logits(graphdef, params, hidden)
    return tloss.token_logprobs(logits, tokens, pred)[0]


def model_logp(graphdef, params, arrays):
    """Current per-token logp of a packed batch (to build old_logp near the policy)."""
    return np.asarray(
        _logp(graphdef, params, *(arrays[k] for k in ("tokens", "pos", "leave", "pred")))
    )


def _flat_leaves(tree):
    return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(tree)])


def assert_same_grads(a, b, rtol=1e-5):
    ga, gb = _flat_leaves(a), _flat_leaves(b)
    scale = np.abs(gb).max()
    assert scale > 0
    np.testing.assert_allclose(ga, gb, rtol=rtol, atol=rtol * scale)


@pytest.fixture(scope="module")
def setup():
    specs = tiny_specs()
    cells = make_cells(1)
    graphdef, params = decoder.init_sharded(specs.model, 0, cells[0], "train")
    return specs, cells, graphdef, params, Trainer(specs.trainer, cells, graphdef, params)


def test_tree_equals_flat_on_agent_shaped_execution(setup):
    _, cells, graphdef, params, trainer = setup
    rng = np.random.default_rng(0)
    paths = agent_paths(1)
    adv = np.array([1.0, -0.7, 0.4, -1.3, 0.9])  # mixed signs
    coef = rng.uniform(0.01, 0.05, len(paths))
    tree, flat, noise_tree, noise_flat = pack_paths(paths, adv, coef, 0.4, rng)
    tree, flat = _pad_rows(tree, 8), _pad_rows(flat, 8)  # one shape: one compile
    # old_logp = current logp + per-node noise, so a good share of tokens is clipped
    tree["old_logp"] = model_logp(graphdef, params, tree) + _pad_rows_noise(noise_tree, 8)
    flat["old_logp"] = model_logp(graphdef, params, flat) + _pad_rows_noise(noise_flat, 8)
    gt = trainer.compute_grads(cells[0], Microbatch(tree, ["e0"]))
    gf = trainer.compute_grads(cells[0], Microbatch(flat, ["e0"]))
    mt, mf = jax.device_get(gt.metrics), jax.device_get(gf.metrics)
    assert mt["clip_low_frac"] > 0 and mt["clip_high_frac"] > 0  # clipping really happens
    np.testing.assert_allclose(mt["loss"], mf["loss"], rtol=1e-5)
    for key in ("w_sum", "entropy", "clip_low_frac", "clip_high_frac", "approx_kl"):
        np.testing.assert_allclose(mt[key], mf[key], rtol=1e-5, err_msg=key)
    assert mt["tokens"] < mf["tokens"]  # the tree holds each shared token once
    assert_same_grads(gt.grads, gf.grads)


def _pad_rows_noise(noise, rows):
    out = np.zeros((rows, ROW), np.float32)
    out[: noise.shape[0]] = noise
    return out


def test_microbatch_gradients_summed_over_cells_equal_single_batch(setup):
    specs, _, graphdef, params, single = setup
    rng = np.random.default_rng(3)
    paths = agent_paths(2)
    adv = rng.normal(size=len(paths))
    _, flat, _, noise = pack_paths(paths, adv, rng.uniform(0.01, 0.05, len(paths)), 0.3, rng)
    flat = _pad_rows(flat, 8)
    flat["old_logp"] = model_logp(graphdef, params, flat) + _pad_rows_noise(noise, 8)
    whole = single.compute_grads(single.core, Microbatch(dict(flat), ["e"]))
    cells = make_cells(4)  # 2 cells of 4 devices; core = cells[0]
    multi = Trainer(specs.trainer, cells, graphdef, params)
    parts = split_microbatches(flat, 4)
    results = [multi.compute_grads(cells[i % 2], mb) for i, mb in enumerate(parts)]
    assert [r.cell_index for r in results] == [0, 1]
    summed = multi.sum_grads(results)
    assert all(x.sharding.mesh == cells[0].mesh for x in jax.tree.leaves(summed))
    assert_same_grads(summed, whole.grads)
    loss = sum(float(r.metrics["loss"]) for r in results)
    np.testing.assert_allclose(loss, float(whole.metrics["loss"]), rtol=1e-5)


def _execution_batches(specs, seed, n_calls):
    """Three executions of one task (mixed-sign advantages) packed as tree and as flat."""
    results = [
        ExecutionResult(
            branchy_execution(seed + i, n_calls=n_calls, vocab=16, max_obs=6, max_gen=8,
                              execution_id=f"e{i}"),
            "t0",
            score=i / 3,
        )
        for i in range(3)
    ]  # fmt: skip
    out = []
    for mode in ("tree", "flat"):
        spec = dataclasses.replace(specs.trajectory, packing=mode)
        batch, report = build_batch(results, spec, buckets=(16,))
        assert not report.rejected, report.rejected
        out.append(batch)
    return out


def _rows_per_execution(batch):
    return [int((batch.exec_index == e).any(1).sum()) for e in range(3)]


@settings(max_examples=6, deadline=None, derandomize=True)
@given(st.integers(0, 10_000), st.integers(14, 28))
def test_pack_equals_flatten_on_branchy_executions(setup, seed, n_calls):
    """gyre.trajectory pack vs its flatten reference; rows of 128 force splits of big trees."""
    check_pack_equivalence(setup, seed, n_calls)


def check_pack_equivalence(setup, seed, n_calls):
    specs, cells, graphdef, params, trainer = setup
    tree, flat = _execution_batches(specs, seed, n_calls)
    if tree.tokens.shape != (16, ROW) or flat.tokens.shape != (16, ROW):
        return  # a rare oversize batch would only cost a second compile
    # old_logp per tree node: the current logp plus node-keyed noise (both sides agree)
    logp_tree = model_logp(graphdef, params, tree._asdict())
    logp_flat = model_logp(graphdef, params, flat._asdict())
    rng = np.random.default_rng(seed)
    noise = {}
    for b, lp in ((tree, logp_tree), (flat, logp_flat)):
        old = np.zeros_like(b.old_logp)
        for idx in zip(*np.nonzero(b.w > 0)):
            key = (int(b.exec_index[idx]), int(b.node_index[idx]))
            if key not in noise:
                noise[key] = (lp[idx], rng.normal(0, 0.4))
            np.testing.assert_allclose(lp[idx], noise[key][0], rtol=1e-5, atol=1e-5)
            old[idx] = sum(noise[key])
        b.old_logp[...] = old
    gt = trainer.compute_grads(cells[0], split_microbatches(tree, 16)[0])
    gf = trainer.compute_grads(cells[0], split_microbatches(flat, 16)[0])
    mt, mf = jax.device_get(gt.metrics), jax.device_get(gf.metrics)
    np.testing.assert_allclose(mt["loss"], mf["loss"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(mt["w_sum"], mf["w_sum"], rtol=1e-5)
    assert_same_grads(gt.grads, gf.grads)


def test_row_splits_are_exercised(setup):
    """A case whose trees are split over several rows, checked for equivalence too."""
    tree, _ = _execution_batches(setup[0], 7, 24)
    assert max(_rows_per_execution(tree)) > 1
    check_pack_equivalence(setup, 7, 24)
