"""The memory plan (gyre/rl/memory_plan.py, python -m gyre.plan): XLA's figures per device, the
one-line refusal naming the largest term and its setting, and the builder's hook."""

import json
import os
import subprocess
import sys

import pytest
from worlds import small_config

from gyre.config import ConfigError
from gyre.rl import memory_plan
from gyre.rl.builder import build_specs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The tests share one compiled plan (the module fixture): one worker makes it once.
pytestmark = pytest.mark.xdist_group("plan")


@pytest.fixture(scope="module")
def tiny_plan():
    cfg = small_config()
    cfg.trajectory.row_len = 256
    cfg.mesh.cell_size, cfg.mesh.model_parallel = 2, 1
    specs = build_specs(cfg)
    return specs, memory_plan.plan(specs, 1e9)


def test_plan_counts_every_term_per_device(tiny_plan):
    specs, p = tiny_plan
    train, rollout = p.roles
    terms = {t.name.split(" (")[0]: t.bytes for t in train.terms}
    n = sum(x.size for x in __import__("jax").tree.leaves(
        __import__("gyre.model.decoder", fromlist=["x"]).abstract_model(specs.model)[1]))  # fmt: skip
    # float32 weights: FSDP over the 2 'data' devices (every parameter divides here)
    assert terms["weights"] == pytest.approx(4 * n / 2, rel=0.05)
    assert terms["optimizer state"] == pytest.approx(2 * terms["weights"], rel=0.01)
    assert terms["gradient program: temporaries"] > 0
    kv = {t.name.split(" (")[0]: t.bytes for t in rollout.terms}["KV cache"]
    m, r = specs.model, specs.rollout
    assert kv == 2 * m.num_layers * r.slots * r.max_len * m.num_kv_heads * m.head_dim * 4 / 2
    assert p.fits and "fits" in p.table()


def test_a_plan_that_does_not_fit_is_one_line_naming_the_largest_term(tiny_plan):
    specs, p = tiny_plan
    small = memory_plan.Plan(1e5, 0.1, p.roles, p.platform, p.settings)
    assert not small.fits
    line = small.refusal()
    assert "\n" not in line and small.worst().largest().name in line
    assert small.worst().largest().setting in line
    with pytest.raises(ConfigError, match="largest term"):
        memory_plan.check(specs, memory=1e5)
    assert memory_plan.check(specs) is None  # CPU devices report no memory: not checked


@pytest.mark.slow
def test_cli_prints_the_table_and_a_json_line():
    # in the environment scripts/gpu_check.sh --dry-run gives the same command (CPU, no
    # XLA_FLAGS, which JAX's cache keys include): the session's XLA cache compiles it once
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-m", "gyre.plan", "--config=experiments/qwen3_code.py:tiny",
                          "--device_memory=80GB"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env={**env, "JAX_PLATFORMS": "cpu"})  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert "memory plan per device" in lines[0] and lines[-2] == "memory plan: fits"
    assert json.loads(lines[-1])["fits"] is True


def test_auto_rows_is_the_largest_count_that_fits(tiny_plan, monkeypatch):
    """The search (a linear guess from two plans, then bisection over multiples of the 'data'
    shards) against plans whose train total grows by a known amount per row: linearly, and
    faster than linearly (the guess is then too high and the bisection finds the answer)."""
    specs, _ = tiny_plan
    cell = memory_plan.plan_cell(specs)
    data = cell.mesh.shape["data"]
    calls = []
    for grow in (lambda r: 10.0 * r, lambda r: 10.0 * r + r * r):

        def terms(s, cell, tree=None, grow=grow):
            calls.append(s.trainer.rows_per_microbatch)
            return (memory_plan.Term("fixed", 100.0, ""),
                    memory_plan.Term("rows", grow(s.trainer.rows_per_microbatch), ""))  # fmt: skip

        monkeypatch.setattr(memory_plan, "train_terms", terms)
        for budget in (100 + grow(7), 100 + grow(2), 100 + grow(1), 100 + grow(40), 1e9):
            calls.clear()
            got = memory_plan.auto_rows(specs, budget / 0.9, 0.1, cell)
            fitting = [r for r in range(data, 65, data) if 100 + grow(r) <= budget * (1 + 1e-9)]
            assert got == max(fitting, default=0), (budget, got)
            assert all(r % data == 0 for r in calls) and len(set(calls)) <= 8


@pytest.mark.slow
def test_a_tree_row_under_the_schedule_plans_less_than_under_the_mask(tiny_plan):
    specs, _ = tiny_plan
    mask = memory_plan.plan(specs, 1e9, tree=memory_plan.TreeRow(2048))
    sched = memory_plan.plan(specs, 1e9, tree=memory_plan.TreeRow(2048, 256, 256))

    def temps(p):
        (t,) = [t for t in p.roles[0].terms if t.name.startswith("gradient program: temp")]
        return t

    assert "mask" in temps(mask).name and "schedule 256+7x256" in temps(sched).name
    assert temps(sched).bytes < temps(mask).bytes
    assert "tree 2048, schedule" in sched.table()


def test_rows_per_microbatch_zero_is_auto_resolved_by_check_memory(monkeypatch):
    """Config 0 (auto): the default count where devices report no memory (CPU), and the
    largest count that fits where they do, in the trainer and the packer alike."""
    from gyre.rl import builder

    cfg = small_config()
    cfg.trajectory.row_len = 256
    cfg.mesh.cell_size, cfg.mesh.model_parallel = 2, 1
    cfg.train.rows_per_microbatch = 0
    specs = build_specs(cfg)
    assert specs.trainer.rows_auto and specs.trainer.rows_per_microbatch == 4
    assert builder.check_memory(specs) == specs  # CPU: nothing reported, nothing changed
    monkeypatch.setattr(memory_plan, "train_terms", lambda s, cell, tree=None: (
        memory_plan.Term("rows", 1e6 * s.trainer.rows_per_microbatch, ""),))  # fmt: skip
    monkeypatch.setattr(memory_plan, "rollout_terms", lambda s, cell: ())
    monkeypatch.setattr(memory_plan, "device_memory", lambda cell: 13.5e6 / 0.9)
    got = builder.check_memory(specs)
    assert got.trainer.rows_per_microbatch == got.trajectory.rows_per_microbatch == 12
    cfg.train.rows_per_microbatch = 4  # a fixed count stays as it is
    fixed = build_specs(cfg)
    assert not fixed.trainer.rows_auto and builder.check_memory(fixed) == fixed
