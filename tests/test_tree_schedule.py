"""The tree schedule (gyre/train/tree_schedule.py): prefix forward once, branches forward and
backward against its K/V, prefix backward once. Its loss, metrics and gradient equal the tree
mask's on the same row (the gradient program, step._objective) and the flattened paths'
(packing='flat'), on agent-shaped and hypothesis-generated branchy trees.

Tolerances (float32 model): gradients within 2e-5 of the largest gradient entry and 2e-5
relative; loss and metrics 1e-5 relative (they sum the same terms in another order).
"""

import dataclasses
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import branchy_execution

from gyre.config import default_config
from gyre.mesh import make_cells
from gyre.model import attention, decoder
from gyre.rl.builder import build_specs
from gyre.train import step as tstep
from gyre.train import tree_schedule as ts
from gyre.trajectory import schema
from gyre.trajectory.batch import ExecutionResult, build_batch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
from tree_vs_flat import agent_execution  # noqa: E402

# one xdist worker runs the module: the model and the programs its tests share compile once
pytestmark = pytest.mark.xdist_group("tree_schedule")

TOL = 2e-5
VERSION = 1  # the trainer's version: tokens of version 0 are stale (tis_cap on)


@pytest.fixture(scope="module")
def setup():
    cfg = default_config()
    cfg.model.update(vocab_size=32, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1,
                     head_dim=16, d_ff=64, attn_block=32)  # fmt: skip
    cfg.trajectory.row_len = 256
    cfg.train.tis_cap = 2.0
    specs = build_specs(cfg)
    cell = make_cells(1)[0]
    graphdef, params = decoder.init_sharded(specs.model, 0, cell, "train")
    return specs, graphdef, params


@functools.cache
def _mask_program(graphdef, loss_spec, remat, chunk):
    return jax.jit(lambda p, b: tstep._objective(graphdef, "ppo", loss_spec, False, p, None, b,
                                                 VERSION, remat, chunk))  # fmt: skip


@functools.cache
def _schedule_program(graphdef, loss_spec, remat, chunk):
    return jax.jit(lambda p, s: ts.row_grads(graphdef, p, s, loss_spec, VERSION, remat=remat,
                                             logits_chunk=chunk))  # fmt: skip


def device_rows(batch):
    return {k: np.asarray(batch[k]) for k in schema.device_names()}


# the fixed pads of the agent and branchy trees' schedules: one compiled program for both
PADS = {"n_branches": 5, "prefix_pad": 128, "branch_pad": 128}
MASK_ROWS = 8  # the mask reference's row count: padding rows (which add nothing) fill it up


def mask_grads(setup, rows, remat="none", chunk=0):
    """The tree mask's gradient and metric sums over ``rows``, padded with padding rows to
    MASK_ROWS rows of 256: one compile for every test's batch (tree, flat, hand-made, branchy)."""
    specs, graphdef, params = setup
    r, t = rows["tokens"].shape
    assert r <= MASK_ROWS and t <= specs.trajectory.row_len, (r, t)
    padded = schema.empty(MASK_ROWS, specs.trajectory.row_len, rows.keys())
    for k, v in rows.items():
        padded[k][:r, :t] = v
    return _mask_program(graphdef, specs.trainer.loss, remat, chunk)(params, padded)


def schedule_grads(setup, rows, remat="none", chunk=0, n_branches=None, **split):
    """Sum over the rows of the scheduled rows' gradients and metric sums."""
    specs, graphdef, params = setup
    program = _schedule_program(graphdef, specs.trainer.loss, remat, chunk)
    total, metrics = None, []
    for r in range(rows["tokens"].shape[0]):
        row = {k: v[r] for k, v in rows.items()}
        sched = ts.split_row(row["leave"], block=specs.model.attn_block, **split)
        g, m = program(params, ts.schedule_row(row, sched, n_branches))
        total = g if total is None else jax.tree.map(jnp.add, total, g)
        metrics.append(jax.device_get(m))
    return total, {k: ts.combine_host([m[k] for m in metrics], k) for k in metrics[0]}


def assert_same(a, b, tol=TOL):
    (ga, ma), (gb, mb) = a, b
    ma, mb = jax.device_get(ma), jax.device_get(mb)
    for key in ma:
        np.testing.assert_allclose(ma[key], mb[key], rtol=1e-5, atol=1e-6, err_msg=key)
    fa = np.concatenate([np.ravel(x) for x in jax.tree.leaves(ga)])
    fb = np.concatenate([np.ravel(x) for x in jax.tree.leaves(gb)])
    scale = np.abs(fb).max()
    assert scale > 0
    np.testing.assert_allclose(fa, fb, rtol=tol, atol=tol * scale)


def agent_batches(setup, seed=0, **shape):
    """Two agent-shaped executions of one task (mixed-sign advantages), tree-packed one per
    row of 256, and their flattened paths."""
    specs = setup[0]
    rng = np.random.default_rng(seed)
    shape = {"prefix": 24, "n_main": 3, "retries": 3, "compactions": 2, "subs": 3, "gen": 16,
             "obs": 8, **shape}  # fmt: skip
    execs = [ExecutionResult(agent_execution(rng, f"e{i}", 32, end_reason=r, **shape), "t",
                             score=0.0) for i, r in enumerate(("success", "failure"))]  # fmt: skip
    spec = dataclasses.replace(specs.trajectory, max_paths=0)
    tree, report = build_batch(execs, spec, buckets=(1,))
    flat, _ = build_batch(execs, dataclasses.replace(spec, packing="flat"), buckets=(1,))
    assert not report.rejected and min(report.advantages) < 0 < max(report.advantages)
    return device_rows(tree), device_rows(flat)


def test_split_row_cuts_at_subtree_boundaries():
    # a chain 0-3, then three children of token 3: [4, 7) a chain, [7, 8), [8, 12) a chain
    # with a branch of its own (token 9 has children 10 and 11), then padding
    leave = np.array([12, 12, 12, 12, 7, 7, 7, 8, 12, 12, 11, 12, 13, 14, 15, 16])
    sched = ts.split_row(leave, block=4)
    assert sched.prefix == 4 and sched.prefix_pad == 4 and sched.branch_pad == 4
    # top-level subtrees [4, 7), [7, 8), [8, 12), then 4 padding roots, merged up to 4 tokens
    assert ts.top_subtrees(leave, 4, 12) == [(4, 7), (7, 8), (8, 12)]
    assert sched.branches == ((4, 8), (8, 12), (12, 16))
    assert ts.split_row(leave, block=4, prefix=0).branches == ((0, 12), (12, 16))
    with pytest.raises(ValueError, match="not a closed branch"):
        ts.check_closed(leave, 8, 10)  # token 9's subtree runs to 12
    with pytest.raises(ValueError, match="branch_pad"):
        ts.split_row(leave, block=4, branch_pad=2)
    bad = dataclasses.replace(sched, branches=((4, 6), (6, 16)))
    row = schema.empty(1, 16, schema.device_names())
    row = {k: v[0] for k, v in row.items()}
    row["leave"] = leave
    with pytest.raises(ValueError, match="not a closed branch"):
        ts.schedule_row(row, bad)


def random_leave(rng, t):
    """Subtree ends of a random DFS-ordered forest of ``t`` tokens."""
    parent = [-1]
    for j in range(1, t):
        chain, a = [], j - 1
        while a >= 0:
            chain.append(a)
            a = parent[a]
        parent.append(int(rng.choice(chain + [-1])) if rng.random() < 0.4 else j - 1)
    leave = np.arange(1, t + 1)
    for j in range(t - 1, 0, -1):
        if parent[j] >= 0:
            leave[parent[j]] = max(leave[parent[j]], leave[j])
    return leave


@settings(max_examples=20, deadline=None, derandomize=True)
@given(st.integers(0, 10_000), st.integers(1, 200), st.sampled_from([4, 16]))
def test_best_prefix_minimises_the_peak_over_every_prefix(seed, t, block):
    """Against walking the top-level subtrees after every prefix length (not only the
    candidates): no prefix has a smaller padded prefix + largest branch."""
    leave = random_leave(np.random.default_rng(seed), t)

    def cost(p):
        big = max((b - a for a, b in ts.top_subtrees(leave, p, t)), default=1)
        return ts._round(p, block) * (p > 0) + ts._round(big, block)

    assert cost(ts.best_prefix(leave, block)) == min(cost(p) for p in range(t + 1))
    sched = ts.split_row(leave, block)
    for a, b in sched.branches:
        ts.check_closed(leave, a, b)
    assert [r for br in sched.branches for r in range(*br)] == list(range(sched.prefix, t))


@settings(max_examples=8, deadline=None, derandomize=True)
@given(st.integers(0, 10_000))
def test_context_attention_equals_the_dense_tree_mask(seed):
    """A branch's queries against [its row's keys]: the dense mask's output and gradients."""
    rng = np.random.default_rng(seed)
    t, block, cut = 64, 16, 32
    leave = random_leave(rng, t)  # each token's parent: an ancestor of its predecessor
    q, k, v = (jnp.asarray(rng.normal(size=(1, t, h, 8)), jnp.float32) for h in (4, 2, 2))
    w = jnp.asarray(rng.normal(size=(1, t - cut, 4, 8)), jnp.float32)
    lv = jnp.asarray(leave[None], jnp.int32)

    want = _dense_value_and_grad(q, k, v, lv, w, cut)
    got = _ctx_value_and_grad(q, k, v, lv, w, cut, block)
    np.testing.assert_allclose(got[0], want[0], atol=1e-4)  # a sum of 1024 products
    for a, b in zip(got[1], want[1]):
        np.testing.assert_allclose(a, b, atol=1e-5)


@functools.partial(jax.jit, static_argnums=(5,))
def _dense_value_and_grad(q, k, v, lv, w, cut):
    def dense(q, k, v):
        return jnp.sum(attention.dense_attention(q, k, v, lv)[:, cut:] * w)

    return jax.value_and_grad(dense, (0, 1, 2))(q, k, v)


@functools.partial(jax.jit, static_argnums=(5, 6))
def _ctx_value_and_grad(q, k, v, lv, w, cut, block):
    idx = jnp.arange(q.shape[1])

    def ctx(q, k, v):  # queries [cut, t) only, keys the whole row
        out = ts.context_attention(q[0, cut:], k[0], v[0], idx[cut:], idx, lv[0], block)
        return jnp.sum(out[None] * w)

    return jax.value_and_grad(ctx, (0, 1, 2))(q, k, v)


def hand_made_row(rng, t=64):
    """A prefix chain of 10 tokens, then three branches off its last token: a chain, a chain
    that branches again (a retry inside it), a one-token branch; then padding."""
    parent = list(range(-1, 9))  # tokens 0-9: the prefix chain
    parent += [9] + list(range(10, 21))  # 10-21: a chain off 9
    parent += [9] + list(range(22, 29)) + [25] + list(range(30, 34))  # 22-34: retry at 25
    parent += [9]  # 35: a one-token branch
    n = len(parent)
    row = {k: v[0] for k, v in schema.empty(1, t, schema.device_names()).items()}
    leave = np.arange(1, t + 1)
    for j in range(n - 1, 0, -1):
        if parent[j] >= 0:
            leave[parent[j]] = max(leave[parent[j]], leave[j])
    depth = [0] * n
    for j in range(1, n):
        depth[j] = depth[parent[j]] + 1
    gen = rng.random(n) < 0.7
    row["tokens"][:n] = rng.integers(0, 32, n)
    row["pos"][:n], row["leave"], row["pred"][:n] = depth, leave, parent
    row["old_logp"][:n] = -rng.exponential(3.0, n)
    row["w"][:n] = np.where(gen, rng.uniform(0.1, 1.0, n), 0.0)
    row["adv_pos"][:n] = row["w"][:n] * np.where(rng.random(n) < 0.5, 1.0, 0.0)
    row["adv_neg"][:n] = -row["w"][:n] * (row["adv_pos"][:n] == 0)
    row["versions"][:n] = np.where(gen, rng.integers(0, 2, n), -1)
    return row


@pytest.mark.slow
def test_schedule_equals_mask_on_a_hand_made_row(setup):
    row = hand_made_row(np.random.default_rng(0))
    # top-level subtrees [10, 22), [22, 35), [35, 36), then padding, merged up to 32 tokens
    sched = ts.split_row(row["leave"], block=32, prefix=10)
    assert sched.branches == ((10, 42), (42, 64))
    rows = {k: v[None] for k, v in row.items()}
    assert_same(schedule_grads(setup, rows, prefix=10), mask_grads(setup, rows))


@pytest.mark.slow
def test_schedule_equals_mask_and_flat_on_agent_trees(setup):
    tree, flat = agent_batches(setup)
    via_mask = mask_grads(setup, tree)
    via_flat = mask_grads(setup, flat)
    via_schedule = schedule_grads(setup, tree, **PADS)  # the branchy trees' program
    assert float(via_mask[1]["loss"]) != 0
    assert_same(via_schedule, via_mask)
    g_s, m_s = via_schedule
    g_f, m_f = via_flat
    assert m_s["tokens"] < float(m_f["tokens"])  # the tree holds each shared token once
    for key in ("loss", "w_sum", "entropy", "approx_kl", "stale_frac"):
        np.testing.assert_allclose(m_s[key], m_f[key], rtol=1e-5, atol=1e-7, err_msg=key)
    assert_same((g_s, {}), (g_f, {}))


@pytest.mark.slow
def test_schedule_with_any_prefix_remat_and_chunked_logits(setup):
    """Every prefix length is exact (the prefix may end inside a branch's trunk, or hold
    whole subtrees); with remat and vocabulary chunks too."""
    tree, _ = agent_batches(setup, seed=1)
    ref = mask_grads(setup, tree, "full", 8)
    for prefix in (0, 5, 40, 128):  # one compile: fixed pads
        got = schedule_grads(setup, tree, "full", 8, n_branches=4, prefix=prefix, prefix_pad=128,
                             branch_pad=256)  # fmt: skip
        assert_same(got, ref)


@pytest.mark.slow
@settings(max_examples=6, deadline=None, derandomize=True)
@given(st.integers(0, 10_000), st.integers(8, 20))
def test_schedule_equals_mask_on_branchy_trees(setup, seed, n_calls):
    """Hypothesis-generated executions (retries, compactions, sub-agents, summaries; several
    trees in a row, rows split with repeated ancestors), fixed pads: one compile."""
    specs = setup[0]
    execs = [ExecutionResult(branchy_execution(seed + i, n_calls=n_calls, vocab=16, max_obs=6,
                                               max_gen=8, execution_id=f"e{i}"), "t", score=0.0)
             for i in range(3)]  # fmt: skip
    tree, report = build_batch(execs, specs.trajectory, buckets=(1,))
    if report.rejected or max(report.advantages, default=0) == 0:
        return
    rows = device_rows(tree)
    via_schedule = schedule_grads(setup, rows, **PADS)
    assert_same(via_schedule, mask_grads(setup, rows))


def test_kl_is_refused(setup):
    specs, graphdef, params = setup
    row = {k: v[0] for k, v in schema.empty(1, 32, schema.device_names()).items()}
    srow = ts.schedule_row(row, ts.split_row(row["leave"], block=32))
    spec = dataclasses.replace(specs.trainer.loss, kl_coef=0.1)
    with pytest.raises(NotImplementedError, match="kl_coef"):
        ts.row_grads(graphdef, params, srow, spec, 0)


@pytest.mark.slow
def test_trainer_with_the_tree_schedule_equals_the_mask(setup):
    """train.tree_schedule in the Trainer: a micro-batch's gradient and metric sums equal the
    mask program's (rows bucketed, padding rows left out)."""
    specs, graphdef, params = setup
    tree, _ = agent_batches(setup, seed=2)
    cells = make_cells(1)[:1]
    mb = tstep.split_microbatches(tree, 4)[0]  # 2 tree rows and 2 padding rows
    plain = tstep.Trainer(specs.trainer, cells, graphdef, params, version=VERSION)
    spec = dataclasses.replace(specs.trainer, tree_schedule=True)
    scheduled = tstep.Trainer(spec, cells, graphdef, params, version=VERSION)
    a, b = scheduled.compute_grads(cells[0], mb), plain.compute_grads(cells[0], mb)
    assert_same((a.grads, a.metrics), (b.grads, b.metrics))
    with pytest.raises(ValueError, match="kl_coef"):
        dataclasses.replace(spec, loss=dataclasses.replace(spec.loss, kl_coef=0.1))


def test_the_config_key_reaches_the_trainer_and_refuses_kl_in_one_line():
    from gyre.config import ConfigError, validate

    cfg = default_config()
    cfg.train.tree_schedule = True
    validate(cfg)
    assert build_specs(cfg).trainer.tree_schedule
    cfg.train.kl_coef = 0.1
    with pytest.raises(ConfigError, match="train.tree_schedule does not compute the KL term"):
        build_specs(cfg)
