"""Code task through the harness with scripted policies and the real sandbox."""

import asyncio
import dataclasses

import pytest
from doubles import CodeScriptPolicy

from gyre.agent.context import AgentSettings
from gyre.agent.harness import run_executions
from gyre.envs.base import Task
from gyre.envs.code import PROBLEMS, CodeEnv
from gyre.envs.sandbox import SandboxLimits
from gyre.envs.vocab import ByteVocab as B
from gyre.trajectory.records import validate_execution

CFG = AgentSettings(max_calls=12, context_window=2048, max_new_tokens=256)
BUGGY = "write_file\ndef is_prime(n):\n    return n % 2 == 1\n"
GOOD = "write_file\n" + PROBLEMS["is_prime"][3]
TASK = Task("prime", 0, ("is_prime",))
# every test here runs code in the real sandbox (CodeEnv refuses to start without)
pytestmark = pytest.mark.sandbox


def run(policy, cfg=CFG, env=None):
    (res,) = asyncio.run(run_executions(env or CodeEnv(), [TASK], policy, cfg))
    if res.records:
        validate_execution(res.records, B.SIZE)
    return res


def test_fix_after_a_failing_run_succeeds_and_counts_milestones():
    res = run(CodeScriptPolicy([BUGGY, "run_tests", GOOD, "run_tests"]))
    assert (res.end_reason, res.score, res.milestones, res.num_milestones) == ("success", 1.0, 5, 5)
    text = B.decode(res.records[-1].prompt)
    assert "[tests 2/5 passed]" in text  # counts only: the hidden tests stay hidden
    for prev, rec in zip(res.records, res.records[1:]):
        assert rec.prompt[: prev.tokens.size].tolist() == prev.tokens.tolist()


def test_timeout_scores_the_best_run_and_bad_calls_are_retried():
    res = run(
        CodeScriptPolicy([BUGGY, "run_tests", "run_tests"]), dataclasses.replace(CFG, max_calls=4)
    )
    assert (res.end_reason, res.milestones) == ("timeout", 2)
    assert res.score == 0.5 * 2 / 5
    res = run(CodeScriptPolicy(["run_tests"]))  # nothing written yet: a tool error, retried
    assert res.end_reason == "failure" and res.stats["retries"] == CFG.max_retries + 1


def test_code_killed_by_the_sandbox_is_a_policy_failure_not_infra():
    hang = "write_file\ndef is_prime(n):\n    while True: pass\n"
    env = CodeEnv(limits=SandboxLimits(wall_seconds=0.3), max_runs=2)
    res = run(CodeScriptPolicy([hang, "run_tests"]), env=env)
    assert res.end_reason == "failure" and res.score == 0.0 and res.stats["infra_retries"] == 0
    assert "[tests not run: timeout]" in B.decode(res.records[-1].prompt)


def test_compaction_keeps_the_file_in_the_summary():
    cfg = AgentSettings(max_calls=12, context_window=480, max_new_tokens=120)
    res = run(CodeScriptPolicy([BUGGY, "run_tests", GOOD, "run_tests"], ["run_tests"]), cfg)
    assert res.end_reason == "success" and res.stats["compactions"] == 1
    assert max(r.tokens.size for r in res.records) <= 480
    restarted = [r for r in res.records if B.SUMMARY in r.prompt.tolist()]
    assert restarted and "def is_prime" in B.decode(restarted[0].prompt)
