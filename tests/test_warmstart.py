"""Warm start: demonstration batches mask mistakes; a cached warm start continues exactly."""

import dataclasses

import jax
import numpy as np
import pytest

import experiments.quickstart as quickstart
from gyre import mesh
from gyre.model import decoder
from gyre.rl.builder import build_specs
from gyre.rl.warmstart import demo_batch, fingerprint, warm_start


def tiny():
    cfg = quickstart.get_config("tiny")
    cfg.sft.batch, cfg.sft.eval_every, cfg.sft.mistake_prob = 4, 2, 0.5
    return cfg


def recipe(cfg):
    return build_specs(cfg).sft.recipe


def test_demo_batch_weights_sum_to_one_and_skip_wrong_digits():
    cfg = tiny()
    batch = demo_batch(recipe(cfg), seed=3, n=4)
    again = demo_batch(recipe(cfg.copy_and_resolve_references()), seed=3, n=4)
    assert np.all(batch.w >= 0) and np.all(batch.adv_neg == 0)
    np.testing.assert_array_equal(batch.adv_pos, batch.w)
    # token-mean: weights of every trainable token on the selected paths add to 1, less the
    # masked digits of wrong commits (there are some at mistake_prob 0.5)
    assert 0.8 < batch.w.sum() < 1.0 - 1e-6
    np.testing.assert_array_equal(batch.w, again.w)  # keyed by the seed: reproducible


@pytest.mark.slow
def test_longer_warm_start_continues_a_cached_one_exactly(tmp_path):
    cfg = tiny()
    specs = build_specs(cfg)
    cells = mesh.make_cells(4)
    graphdef, params = decoder.init_sharded(specs.model, specs.sft.recipe.seed, cells[0], "train")
    evals = []

    def evaluate(p):
        evals.append(1)
        return {"eval_milestones": 0.0}

    sft = dataclasses.replace(specs.sft, steps=2)
    short, info = warm_start(sft, cells, graphdef, params, str(tmp_path / "a"), evaluate)
    assert info["steps"] == 2 and not info["cached"]
    sft = dataclasses.replace(specs.sft, steps=4)
    longer, info = warm_start(sft, cells, graphdef, params, str(tmp_path / "a"), evaluate)
    assert info["steps"] == 4 and [h["step"] for h in info["history"]] == [2, 4]
    direct, _ = warm_start(sft, cells, graphdef, params, str(tmp_path / "b"), evaluate)
    for a, b in zip(jax.tree.leaves(longer), jax.tree.leaves(direct)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(
        not np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(short), jax.tree.leaves(longer))
    )
    again, info = warm_start(sft, cells, graphdef, params, str(tmp_path / "a"), evaluate)
    assert info["cached"] and len(evals) == 4  # 2 + 1 (continuation) + 2 (direct), none here
    cfg.sft.steps = 9
    assert fingerprint(recipe(cfg)) == info["fingerprint"]  # the stopping rule is not in the key


def test_sft_seed_keys_the_warm_start_apart_from_the_rl_seed():
    cfg = tiny()
    base = fingerprint(recipe(cfg))
    cfg.sft.seed = cfg.seed  # explicit, same seed: same cache
    assert fingerprint(recipe(cfg)) == base
    cfg.seed = 7  # another RL seed over the same warm start
    assert fingerprint(recipe(cfg)) == base
    cfg.sft.seed = 7
    assert fingerprint(recipe(cfg)) != base


def test_only_what_the_warm_start_uses_is_in_its_key():
    """RL-only settings (reward, packing, PPO clipping, RL lr, path cap, steps) share one
    cached warm start; settings the warm start trains with give another."""
    base = fingerprint(recipe(tiny()))
    for path, value in [("trajectory.reward", "binary"), ("trajectory.packing", "flat"),
                        ("train.clip_low", 0.1), ("train.lr", 3e-4), ("trajectory.max_paths", 1),
                        ("run.steps", 9), ("scheduler.policy", "colocate"),
                        ("env.fault_rate", 0.1), ("env.tool_timeout", 2.0),
                        ("run.watchdog_s", 5.0)]:  # fmt: skip
        cfg = tiny()
        section, key = path.split(".")
        cfg[section][key] = value
        assert fingerprint(recipe(cfg)) == base, path
    for path, value in [("sft.lr", 1e-4), ("sft.batch", 8), ("model.d_model", 64),
                        ("env.num_ops", 5), ("train.b2", 0.99), ("trajectory.row_len", 512)]:  # fmt: skip
        cfg = tiny()
        section, key = path.split(".")
        cfg[section][key] = value
        assert fingerprint(recipe(cfg)) != base, path
