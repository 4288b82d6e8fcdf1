"""Trainer: no retrace across steps, updates on the core, failure handling, SFT, layouts."""

import dataclasses
import logging

import jax
import numpy as np
import pytest
from strategies import branchy_execution
from worlds import small_config, train_world

from gyre.model import decoder
from gyre.train.step import Trainer, TrainingDiverged, split_microbatches, update_program
from gyre.trajectory.batch import ExecutionResult, build_batch

pytestmark = pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")


def step_batch(specs, seed):
    """One optimizer step's packed batch (4 rows) from branchy executions of two tasks."""
    results = [
        ExecutionResult(branchy_execution(seed * 10 + i, n_calls=6, vocab=16,
                                          execution_id=f"s{seed}e{i}"), f"t{i % 2}", i / 4)
        for i in range(4)
    ]  # fmt: skip
    batch, report = build_batch(results, specs.trajectory, buckets=(4,))
    assert batch.tokens.shape == (4, 128)
    return batch, [f"s{seed}e{i}" for i in report.used]


@pytest.fixture(scope="module")
def world():
    return train_world(small_config())


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.slow
def test_steps_update_core_weights_without_retrace(world):
    specs, cells, graphdef, params = world
    trainer = Trainer(specs.trainer, cells[:2], graphdef, params)
    before = _leaves(trainer.params)
    programs = [trainer.program(c) for c in cells[:2]] + [update_program(specs.trainer.optimizer)]
    counts = [p._cache_size() for p in programs]
    losses = []
    for s in range(3):
        batch, names = step_batch(specs, s)
        out = trainer.train_step(cells[:2], batch, names)
        assert out.applied and out.version == s + 1 and trainer.version == s + 1
        assert set(out.exec_ids) <= set(names) and out.exec_ids
        losses.append(out.metrics["loss"])
    assert all(np.isfinite(losses))
    new = [p._cache_size() - n for p, n in zip(programs, counts)]
    # one gradient compile per cell, one update compile: the same programs serve every step
    assert new[0] <= 1 and new[1] <= 1
    assert new[2] <= 1
    assert any(np.abs(a - b).max() > 0 for a, b in zip(_leaves(trainer.params), before))
    for x in jax.tree.leaves(trainer.params):
        assert x.sharding.mesh == cells[0].mesh  # weights and optimizer live on the core
    for x in jax.tree.leaves(trainer.opt_state):
        assert x.sharding.mesh == cells[0].mesh
    rollout = trainer.params_for(cells[3], "rollout")
    np.testing.assert_array_equal(_leaves(rollout)[0], _leaves(trainer.params)[0])
    assert jax.tree.leaves(rollout)[0].sharding.mesh == cells[3].mesh


def test_non_finite_steps_are_skipped_then_stop_the_run(world, caplog):
    specs, cells, graphdef, params = world
    spec = dataclasses.replace(specs.trainer, max_bad_steps=2)
    trainer = Trainer(spec, cells[:1], graphdef, params)
    good, names = step_batch(specs, 0)
    assert trainer.train_step(cells[:1], good, names).applied
    weights = _leaves(trainer.params)
    bad, bad_names = step_batch(specs, 1)
    j = np.argwhere(bad.w > 0)[0]
    bad.old_logp[tuple(j)] = -np.inf  # ratio -> inf: a non-finite loss
    with caplog.at_level(logging.WARNING, logger="gyre.train.step"):
        out = trainer.train_step(cells[:1], bad, bad_names)
    # skipped, but a step all the same: the version counts steps, the weights stay
    assert not out.applied and trainer.version == out.version == 2 and trainer.bad_steps == 1
    assert any(bad_names[int(bad.exec_index[tuple(j)])] in r.getMessage() for r in caplog.records)
    for a, b in zip(_leaves(trainer.params), weights):
        np.testing.assert_array_equal(a, b)  # the skipped step left the weights alone
    assert trainer.train_step(cells[:1], good, names).applied  # the run goes on
    assert trainer.bad_steps == 0
    trainer.train_step(cells[:1], bad, bad_names)
    with pytest.raises(TrainingDiverged, match="max_bad_steps=2"):
        trainer.train_step(cells[:1], bad, bad_names)
    assert trainer.version == 5


def test_poisoned_gradient_is_skipped(world):
    specs, cells, graphdef, params = world
    trainer = Trainer(specs.trainer, cells[:1], graphdef, params)
    batch, names = step_batch(specs, 2)
    (mb, *rest) = split_microbatches(batch, 2, names)
    res = trainer.compute_grads(cells[0], mb)
    res.grads = jax.tree.map(lambda g: g * np.nan, res.grads)
    out = trainer.apply_step([res])
    assert not out.applied and not np.isfinite(out.metrics["grad_norm"])


@pytest.mark.slow
def test_sft_gradient_matches_cross_entropy_on_a_causal_row(world):
    specs, cells, graphdef, params = world
    sft = dataclasses.replace(specs.trainer, objective="sft")
    trainer = Trainer(sft, cells[:1], graphdef, params)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 16, (2, 128)).astype(np.int32)
    w = (rng.random((2, 128)) < 0.5).astype(np.float32)
    w[:, 0] = 0
    arrays = {
        "tokens": tokens, "pos": np.tile(np.arange(128, dtype=np.int32), (2, 1)),
        "leave": np.full((2, 128), 128, np.int32),
        "pred": np.tile(np.arange(-1, 127, dtype=np.int32), (2, 1)),
        "old_logp": np.zeros((2, 128), np.float32), "adv_pos": np.zeros((2, 128), np.float32),
        "adv_neg": np.zeros((2, 128), np.float32), "w": w,
        "versions": np.zeros((2, 128), np.int32),
    }  # fmt: skip
    (mb,) = split_microbatches(arrays, 2)
    res = trainer.compute_grads(cells[0], mb)

    def ce(p):  # shifted-label cross-entropy: correct for a causal row
        hidden = decoder.apply(graphdef, p, tokens, arrays["pos"], arrays["leave"])
        logp = jax.nn.log_softmax(decoder.apply_logits(graphdef, p, hidden)[:, :-1], -1)
        lp = jax.numpy.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
        return -(lp * w[:, 1:]).sum()

    want_loss, want = jax.jit(jax.value_and_grad(ce))(trainer.params)
    np.testing.assert_allclose(float(res.metrics["loss"]), float(want_loss), rtol=1e-5)
    for a, b in zip(_leaves(res.grads), _leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    nll = [trainer.apply_step([trainer.compute_grads(cells[0], mb)]).metrics["loss"]]
    for _ in range(3):
        (mb,) = split_microbatches(arrays, 2)
        nll.append(trainer.apply_step([trainer.compute_grads(cells[0], mb)]).metrics["loss"])
    assert nll[-1] < nll[0]


def test_microbatch_rows_must_divide_the_data_axis(world):
    specs, cells, graphdef, params = world
    trainer = Trainer(specs.trainer, cells[:1], graphdef, params)
    batch, _ = step_batch(specs, 0)
    (mb, *_) = split_microbatches(batch, 3)
    with pytest.raises(ValueError, match="rows_per_microbatch"):
        trainer.compute_grads(cells[0], mb)


@pytest.mark.slow
def test_kl_to_an_identical_reference_is_zero(world):
    specs, cells, graphdef, params = world
    loss = dataclasses.replace(specs.trainer.loss, kl_coef=0.1)
    spec = dataclasses.replace(specs.trainer, loss=loss)
    trainer = Trainer(spec, cells[:1], graphdef, params, ref_params=params)
    batch, _ = step_batch(specs, 0)
    res = trainer.compute_grads(cells[0], split_microbatches(batch, 2)[0])
    assert abs(float(res.metrics["kl_ref"])) < 1e-6
    with pytest.raises(ValueError, match="ref_params"):
        Trainer(spec, cells[:1], graphdef, params)


def test_sft_on_packed_records_lowers_the_loss(world):
    specs, cells, graphdef, params = world
    demos = [
        ExecutionResult(branchy_execution(s, n_calls=4, vocab=16, execution_id=f"d{s}"), f"d{s}")
        for s in range(3)
    ]
    # every path of a demonstration is a target, each token weighing the same
    traj = dataclasses.replace(specs.trajectory, max_paths=0, loss_mode="token-mean")
    batch, report = build_batch(demos, traj, "sft", buckets=(4,))
    assert report.used == (0, 1, 2)  # every demonstration is packed
    assert batch.tokens.shape == (4, 128)
    np.testing.assert_allclose(batch.w.sum(), 1.0, rtol=1e-5)  # token-mean coefficients
    sft = dataclasses.replace(specs.trainer, objective="sft")
    trainer = Trainer(sft, cells[:1], graphdef, params)
    losses = [trainer.train_step(cells[:1], batch).metrics["loss"] for _ in range(4)]
    assert losses[-1] < losses[0]
