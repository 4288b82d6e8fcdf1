"""Streaming a step group by group: rescaled parts equal the whole step, in the coefficients and
in the update (Trainer.apply_parts over the groups = Trainer.apply_step over the whole batch)."""

import dataclasses

import jax
import numpy as np
import pytest
from strategies import branchy_execution
from worlds import small_config, train_world

from gyre.train.step import Trainer, split_microbatches
from gyre.trajectory.advantages import LOSS_MODES, normaliser_count, path_coefficients
from gyre.trajectory.batch import ExecutionResult, build_batch

pytestmark = pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")


@pytest.mark.parametrize("mode", LOSS_MODES)
def test_part_coefficients_rescale_to_step_coefficients(mode):
    rng = np.random.default_rng(0)
    lens = [rng.integers(0, 20, size=rng.integers(1, 5)) for _ in range(9)]
    lens[3] = np.zeros(2, np.int64)  # an execution with no trainable token
    whole = path_coefficients(lens, mode)
    total = normaliser_count(lens, mode)
    parts = [lens[:4], lens[4:7], lens[7:]]
    streamed = []
    for part in parts:
        scale = normaliser_count(part, mode) / total
        streamed += [c * scale for c in path_coefficients(part, mode)]
    for a, b in zip(whole, streamed):
        np.testing.assert_allclose(a, b, rtol=1e-12)


def test_normaliser_count_rejects_unknown_mode():
    with pytest.raises(ValueError, match="loss mode"):
        normaliser_count([np.ones(2)], "median")


# ---------------------------------------------------------------- apply_parts = apply_step


@pytest.fixture(scope="module")
def world():
    return train_world(small_config())


def _groups():
    """Three task groups of unequal sizes (so the parts' normalisers differ); scores differ
    within each group and one execution is an infrastructure error (never trained on). Group g
    was sampled by weights of version g, so the groups' version lags differ too (a maximum
    that were rescaled like a sum would show)."""
    groups = []
    for g, size in enumerate((2, 3, 4)):
        group = []
        for i in range(size):
            infra = (g, i) == (2, 3)
            records = branchy_execution(10 * g + i, n_calls=8, vocab=16, execution_id=f"g{g}e{i}",
                                        end_reason="infra_error" if infra else None)  # fmt: skip
            for rec in records:
                rec.versions[:] = g
            group.append(ExecutionResult(records, f"t{g}", None if infra else (i + g) / 6))
        groups.append(group)
    return groups


def _record_summed_grads(trainer) -> list:
    """Keeps a host copy of every gradient sum the trainer hands to its update (before the
    update program donates it)."""
    seen, inner = [], trainer.sum_grads

    def sum_grads(results):
        total = inner(results)
        seen.append(jax.device_get(total))
        return total

    trainer.sum_grads = sum_grads
    return seen


def _assert_trees_close(a, b, what, atol=None):
    """Parts and the whole batch pack different rows, so float sums run in another order:
    close to float32 rounding (by default 1e-5 relative, 1e-6 of the leaf's largest value
    absolute), far tighter than any wrong scale."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb), what
    for x, y in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        tol = 1e-6 * float(np.max(np.abs(y), initial=0.0)) if atol is None else atol
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=tol, err_msg=what)


@pytest.mark.slow
@pytest.mark.parametrize("mode", LOSS_MODES)
def test_apply_parts_over_groups_equals_apply_step_over_the_whole_batch(world, mode):
    specs, cells, graphdef, params = world
    traj = dataclasses.replace(specs.trajectory, loss_mode=mode)
    rows = traj.rows_per_microbatch
    groups = _groups()
    # version 3 > every behaviour version (0-2): lags and stale tokens are non-zero
    whole = Trainer(specs.trainer, cells[:2], graphdef, params, version=3)
    streamed = Trainer(specs.trainer, cells[:2], graphdef, params, version=3)
    whole_grads, streamed_grads = _record_summed_grads(whole), _record_summed_grads(streamed)

    results = [r for g in groups for r in g]
    batch, report = build_batch(results, traj)
    mbs = split_microbatches(batch, rows, [results[i].execution_id for i in report.used])
    assert len(mbs) > 1
    want = whole.apply_step([whole.compute_grads(cells[i % 2], mb) for i, mb in enumerate(mbs)])

    # as the controller streams a step: each group packed alone, with its own normaliser
    parts, counts, i = [], [], 0
    for group in groups:
        part_batch, report = build_batch(group, traj)
        part = len(counts)
        counts.append(report.normaliser)
        names = [group[k].execution_id for k in report.used]
        for mb in split_microbatches(part_batch, rows, names):
            parts.append((part, streamed.compute_grads(cells[i % 2], mb)))
            i += 1
    assert len(set(counts)) > 1  # the scales differ from part to part
    got = streamed.apply_parts(parts, counts)

    assert got.applied and want.applied
    assert (got.version, got.step, got.exec_ids) == (want.version, want.step, want.exec_ids)
    assert "g2e3" not in want.exec_ids  # the infrastructure error was not trained on
    assert got.metrics.keys() == want.metrics.keys()
    assert want.metrics["version_lag_max"] > 0 and want.metrics["stale_frac"] > 0
    _assert_trees_close(streamed_grads, whole_grads, "summed gradients")
    for key, value in want.metrics.items():
        assert got.metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    # Adam's first update is lr g / (|g| + eps) per element, about lr sign(g): a wrong scale
    # shows in the gradients and the moments rather than here, and where |g| is near eps,
    # float32 rounding of g moves an element by a fraction of lr. Checked to 1% of lr.
    lr = specs.trainer.optimizer.lr
    _assert_trees_close(streamed.params, whole.params, "parameters after the update", 1e-2 * lr)
    _assert_trees_close(streamed.opt_state, whole.opt_state, "optimizer state")


def test_apply_parts_without_gradients_advances_the_counters(world):
    specs, cells, graphdef, params = world
    trainer = Trainer(specs.trainer, cells[:1], graphdef, params)
    before = [np.asarray(x) for x in jax.tree.leaves(trainer.params)]
    assert trainer.apply_parts([], []) is None
    assert (trainer.step, trainer.version) == (1, 1)
    for a, b in zip(jax.tree.leaves(trainer.params), before):
        np.testing.assert_array_equal(np.asarray(a), b)
