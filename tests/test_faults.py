"""Faults a run must survive or end cleanly on: tool calls that crash or hang, a NaN gradient,
a SIGTERM (one whole run through all three), and a hang that only the watchdog can end."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from gyre.envs.base import Task, ToolCall
from gyre.envs.faults import FaultyTools, InjectedFault
from gyre.watchdog import Watchdog

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def shared(xla_cache, tiny_warm):
    """The session's XLA cache and tiny warm-start cache (tests/conftest.py), which the
    other tests' tiny runs share (test_controller's launches use the same warm start)."""
    return {"cache": xla_cache, "warm": tiny_warm}


def _launch(workdir, shared, *extra, hooks=()):
    """The tiny quickstart run under colocate (rollout and training never overlap, so what is
    trained cannot depend on timing, which the faults change)."""
    args = [sys.executable, "tests/killable_launch.py" if hooks else "launch.py", *hooks,
            "--config=experiments/quickstart.py:tiny", f"--workdir={workdir}",
            "--config.run.steps=3", "--config.mesh.cell_size=4",
            "--config.scheduler.policy=colocate", "--config.scheduler.max_staleness=0",
            f"--config.mesh.cache_dir={shared['cache']}", f"--config.sft.dir={shared['warm']}",
            "--config.sft.steps=120", "--config.sft.lr=3e-3", "--config.sft.eval_every=120",
            "--config.eval.tasks=0", "--config.run.tasks_per_step=4", *extra]  # fmt: skip
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)


def _rows(workdir):
    return [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]


def _ledger(workdir):
    return [json.loads(line) for line in open(os.path.join(workdir, "ledger.jsonl"))]


FAULTS = ("--config.env.fault_rate=0.1", "--config.env.tool_timeout=0.3")


@pytest.mark.slow
def test_crashes_hangs_a_nan_gradient_and_sigterm_in_one_run(shared, tmp_path):
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    # The reference: the same NaN gradient (step 0), no tool faults, no signal.
    ref = _launch(clean, shared, hooks=("--nan_at_step=0",))
    assert ref.returncode == 0, ref.stderr[-2000:]
    # 10% of tool calls crash or hang (cut at 0.3 s), step 0's gradient is NaN, and a SIGTERM
    # arrives inside step 2: the run stops after that step, checkpointed, exit 0 ...
    stopped = _launch(faulty, shared, *FAULTS, hooks=(
        "--nan_at_step=0", "--kill_after_microbatches=6", "--kill_signal=TERM"))  # fmt: skip
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    assert stopped.stdout.strip().splitlines()[-1].startswith("stopped on request after step 2/3")
    # ... and the relaunch completes it.
    again = _launch(faulty, shared, *FAULTS)
    assert again.returncode == 0, again.stderr[-2000:]

    a, b = _rows(clean), _rows(faulty)
    assert [r["step"] for r in b] == [1, 2, 3]  # no row lost or written twice
    assert [r["applied"] for r in a] == [r["applied"] for r in b] == [False, True, True]
    assert np.isnan(b[0]["grad_norm"]) and b[0]["version"] == 1  # skipped, but a step
    assert sum(r["infra_retries"] for r in b) > 0 == sum(r["infra_retries"] for r in a)
    # Faults were retried, never the policy's doing: the same executions, the same endings
    # and rewards as the run without faults, and none ended as an infrastructure error.
    assert _ledger(faulty) == _ledger(clean)
    for ra, rb in zip(a, b):
        for key in ("reward", "success", "milestones", "executions", "generated_tokens"):
            assert ra[key] == rb[key], (key, ra["step"])
        assert {k: v for k, v in ra.items() if k.startswith("end_")} == {
            k: v for k, v in rb.items() if k.startswith("end_")}  # fmt: skip
        assert "end_infra_error" not in rb


@pytest.mark.slow
def test_a_run_that_hangs_is_ended_by_the_watchdog_in_one_line(shared, tmp_path):
    # No warm start (sft.steps=0): the hang must be the only long wait, even on a loaded machine
    # where this test's worker has no cached warm start and compiling it could outlast 3 s. The
    # hook makes every model call a tool call, so the untrained model hangs whatever it samples
    # (what it samples differs between CPUs).
    out = _launch(tmp_path, shared, "--config.run.watchdog_s=3", "--config.env.tool_timeout=1e4",
                  "--config.sft.steps=0", hooks=("--hang_tools",))  # fmt: skip
    assert out.returncode == 3, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: watchdog: no progress for") and "steps in flight [0]" in last
    assert "Traceback" not in out.stderr
    stacks = (tmp_path / "error.txt").read_text()
    assert "Stacks of every thread" in stacks and "MainThread" not in last


def test_watchdog_fires_only_after_the_timeout_without_a_beat():
    now = [0.0]
    fired = []
    dog = Watchdog(10.0, lambda: "step 3", on_expire=fired.append, clock=lambda: now[0])
    now[0] = 9.9
    assert dog.check() is None
    dog.beat()
    now[0] = 19.8
    assert dog.check() is None
    now[0] = 20.0
    assert dog.check().startswith("watchdog: no progress for 10 s") and "step 3" in dog.check()
    off = Watchdog(0.0, clock=lambda: now[0])
    now[0] = 1e9
    assert off.check() is None and off.start()._thread is None  # 0 = off: no thread
    broken = Watchdog(1.0, describe=lambda: 1 / 0, clock=lambda: now[0])
    now[0] += 5
    assert "state unavailable: ZeroDivisionError" in broken.check()  # still fires
    with pytest.raises(ValueError, match=">= 0"):
        Watchdog(-1.0)


class _Echo:
    vocab_size, tool_timeout = 5, 0.05

    async def step(self, state, call, role):
        return ("ok", call.args)


class _State:
    def __init__(self, task):
        self.task = task


def _outcomes(env, states, calls=4):
    import asyncio

    async def go():
        out = []
        for s in states:
            for j in range(calls):
                try:
                    out.append(await asyncio.wait_for(env.step(s, ToolCall("t", (j,)), "main"),
                                                      env.tool_timeout))  # fmt: skip
                except InjectedFault:
                    out.append("crash")
                except TimeoutError:
                    out.append("hang")
        return out

    return asyncio.run(go())


def test_injected_faults_are_keyed_by_seed_and_leave_the_tool_alone():
    tasks = [Task(f"t{i}", i, ()) for i in range(60)]
    a = _outcomes(FaultyTools(_Echo(), 0.2, seed=1), [_State(t) for t in tasks])
    again = _outcomes(FaultyTools(_Echo(), 0.2, seed=1), [_State(t) for t in tasks])
    other = _outcomes(FaultyTools(_Echo(), 0.2, seed=2), [_State(t) for t in tasks])
    assert a == again != other  # the same faults on a rerun (or a resume), others per seed
    faults = [o for o in a if o in ("crash", "hang")]
    assert {"crash", "hang"} <= set(faults) and 0.1 < len(faults) / len(a) < 0.3
    assert all(o == ("ok", (j % 4,)) for j, o in enumerate(a) if o not in ("crash", "hang"))
    assert _outcomes(FaultyTools(_Echo(), 0.0, seed=1), [_State(tasks[0])]) == [
        ("ok", (j,)) for j in range(4)]  # fmt: skip
    with pytest.raises(ValueError, match="fault_rate"):
        FaultyTools(_Echo(), 1.0, seed=0)
