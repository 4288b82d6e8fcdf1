"""Settings that cannot train are refused with one line before anything is written, and a
run that trains nothing says so."""

import asyncio
import os
import subprocess
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest
from worlds import small_config

import experiments.quickstart as quickstart
from gyre import run
from gyre.config import ConfigError, default_config, validate
from gyre.rl import builder
from gyre.rl.experiment import StepRecorder
from gyre.rl.progress import RoleTimeline
from gyre.rl.work import StepRecord
from gyre.train import optimizer as topt
from gyre.train.step import update_program
from gyre.trajectory.batch import ExecutionResult

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _launch(*flags):
    return subprocess.run([sys.executable, "launch.py", *flags], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--config.trian.lr=1"], "'trian'"),  # no --config: the default file reads it
        (["--config=experiments/nope.py", "--config.train.lr=1"], "experiments/nope.py"),
        (["--config=experiments/smoke.py", "--config.model.tie_embeddings=1"],
         "'model.tie_embeddings' must be true or false"),
        (["--config=experiments/smoke.py", "stray"], "unexpected arguments ['stray']"),
    ],
)  # fmt: skip
def test_launch_errors_are_one_line(tmp_path, flags, needle):
    out = _launch(*flags, f"--workdir={tmp_path}/run")
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], out.stderr[-3000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "key,value,needle",
    [
        ("seed", 2**64, "int32"),
        ("seed", 10**400, "digits"),  # an OverflowError in the bound check before
        ("train.lr", 1e300, "float32"),  # infinite in float32
        ("train.lr", 1e-50, "float32"),  # zero in float32
        ("model.rope_theta", 1e-9, "model.rope_theta"),
        ("agent.max_tokens", 2**40, "int32"),
    ],
)
def test_values_no_device_can_hold_are_refused(key, value, needle):
    cfg = default_config()
    section, _, name = key.rpartition(".")
    (cfg[section] if section else cfg)[name] = value
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
        validate(cfg)
    assert needle in str(e.value) and "\n" not in str(e.value) and len(str(e.value)) < 300


@pytest.mark.parametrize(
    "key,value,needle",
    [
        ("rollout.kv_tokens", 20, "rollout.kv_tokens"),
        ("agent.context_window", 30, "agent.context_window"),
        ("rollout.max_len", 256, "exceeds rollout.max_len"),
    ],
)
def test_a_pool_or_slot_smaller_than_a_first_call_is_refused_before_writing(
    tmp_path, key, value, needle
):
    cfg = quickstart.get_config()
    section, name = key.split(".")
    cfg[section][name] = value
    with pytest.raises(SystemExit) as e:
        run.main(cfg, str(tmp_path / "run"))
    assert needle in str(e.value.code) and "\n" not in str(e.value.code)
    assert not (tmp_path / "run").exists()


def test_the_quickstart_fits():
    specs = builder.build_specs(quickstart.get_config())
    run.check_fits(specs, builder.environment(specs))  # raises nothing


def test_a_misspelled_reasoning_gym_task_is_one_line(tmp_path):
    pytest.importorskip("reasoning_gym")
    import experiments.reasoning_gym as rg

    cfg = rg.get_config("tiny")
    cfg.env.tasks = "basic_arithmetc"
    with pytest.raises(SystemExit) as e:
        run.main(cfg, str(tmp_path / "run"))
    msg = str(e.value.code)
    assert "basic_arithmetc" in msg and "basic_arithmetic" in msg and "\n" not in msg
    assert not (tmp_path / "run").exists()


def test_a_chat_task_on_a_checkpoint_without_tokenizer_names_the_file(tmp_path):
    cfg = quickstart.get_config()
    cfg.env.name, cfg.sft.steps = "code", 0
    cfg.model.hf_dir = os.path.join(ROOT, "experiments/assets/ledger4_warm")
    with pytest.raises(SystemExit) as e:
        run.main(cfg, str(tmp_path / "run"))
    assert "ledger4_warm/tokenizer.json: missing" in str(e.value.code)
    assert not (tmp_path / "run").exists()


def test_the_update_refuses_non_finite_new_weights():
    # lr 3e38 is finite in float32, but two Adam steps of ~lr each overflow the weights.
    spec = topt.OptimizerSpec(lr=3e38)
    tx = topt.make_optimizer(spec)
    params = {"w": jnp.ones(4)}
    opt_state = tx.init(params)
    update = update_program(spec)
    oks = []
    for _ in range(3):
        grads = {"w": jnp.ones(4)}
        params, opt_state, ok, _ = update(params, opt_state, grads, jnp.asarray(True))
        oks.append(bool(ok))
    assert oks == [True, False, False]
    assert np.isfinite(np.asarray(params["w"])).all()


def _recorder(tmp_path, max_bad_steps):
    cfg = small_config()
    cfg.train.max_bad_steps = max_bad_steps
    specs = builder.build_specs(cfg)
    ns = types.SimpleNamespace
    rt = ns(specs=specs, path=lambda name: str(tmp_path / name),
            env=ns(render_tokens=lambda t: ""), trainer=ns(version=0, save=lambda *a, **k: None),
            checkpointer=None)  # fmt: skip
    ledger = ns(record_step=lambda *a: None)
    writer = ns(write=lambda *a: None)
    lines = []
    return StepRecorder(rt, ns(timeline=RoleTimeline(1)), ledger, writer, lines.append), lines


def _record(version, reasons):
    results = [ExecutionResult([], "t0", None, f"e{version}-{i}", r,
                               stats={"detail": "model call failed: ValueError('needs 600 KV "
                                                "tokens')"})
               for i, r in enumerate(reasons)]  # fmt: skip
    return StepRecord(version - 1, version, version - 1, 1.0, results, [], None, {}, {}, 0.0)


def test_steps_that_train_nothing_say_so_and_a_run_of_them_stops(tmp_path):
    rec, lines = _recorder(tmp_path, max_bad_steps=2)
    asyncio.run(rec(_record(1, ["infra_error", "infra_error"])))
    (line,) = [x for x in lines if "infrastructure" in x]
    assert "step 1: all 2 executions" in line and "needs 600 KV tokens" in line
    asyncio.run(rec(_record(2, ["infra_error", "failure"])))  # one trained: the count restarts
    asyncio.run(rec(_record(3, ["infra_error"])))
    with pytest.raises(RuntimeError, match="2 steps in a row"):
        asyncio.run(rec(_record(4, ["infra_error"])))
