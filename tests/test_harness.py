"""Harness: branch shapes, every ending reason, budgets, infra errors, compaction at K=10,000."""

import asyncio
import itertools

import numpy as np
import pytest
from doubles import FlakyClient, RunawayPolicy

from gyre.agent.context import AgentSettings
from gyre.agent.harness import run_executions
from gyre.agent.scripted import FaultyEnv, GarbagePolicy, LedgerExpert, WrongPolicy
from gyre.envs import vocab as V
from gyre.envs.base import Task
from gyre.envs.ledger import LedgerEnv
from gyre.trajectory.records import validate_execution

CFG = AgentSettings(max_calls=200, context_window=512, max_new_tokens=8)


def run(env, policy, n=3, seed=0, cfg=CFG, tasks=None, **kw):
    tasks = tasks or env.make_tasks(seed, n)
    results = asyncio.run(run_executions(env, tasks, policy, cfg, **kw))
    for res in results:
        if res.records:
            validate_execution(res.records, V.VOCAB_SIZE)
            assert all(r.end_reason == res.end_reason for r in res.records)
    return results


def starts_with(long, short):
    return long.size >= short.size and np.array_equal(long[: short.size], short)


def common_prefix(a, b):
    n = min(a.size, b.size)
    diff = np.nonzero(a[:n] != b[:n])[0]
    return int(diff[0]) if diff.size else n


def test_expert_prompts_are_exact_extensions_of_the_previous_context():
    env = LedgerEnv(num_ops=8)
    for res in run(env, LedgerExpert()):
        assert res.end_reason == "success" and res.score == 1.0 and res.milestones == 8
        recs = res.records
        assert recs[0].parent_id is None and len(recs) == 8
        for prev, rec in itertools.pairwise(recs):
            assert rec.parent_id == prev.call_id and starts_with(rec.prompt, prev.tokens)
            assert rec.prompt[prev.tokens.size] == V.OK  # only the observation in between


def test_parse_error_retries_branch_at_the_same_depth():
    env = LedgerEnv(num_ops=8)
    for res in run(env, GarbagePolicy(LedgerExpert(), period=2)):
        assert res.end_reason == "success" and res.stats["retries"] > 0
        bad = [r for r in res.records if r.completion.tolist() == list(GarbagePolicy.GARBAGE)]
        assert len(bad) == res.stats["retries"]
        for b in bad:
            (retry,) = [r for r in res.records if r.parent_id == b.call_id]
            assert np.array_equal(retry.prompt, b.prompt)  # resumes from before the failure
            later = [r for r in res.records if r.call_id > b.call_id]
            assert not any(starts_with(r.prompt, b.tokens) for r in later)  # a dead branch


def test_persistent_parse_errors_and_runaway_completions_end_in_failure():
    env = LedgerEnv(num_ops=8)
    (res,) = run(env, GarbagePolicy(LedgerExpert(), period=1, persistent=True), n=1)
    assert res.end_reason == "failure" and len(res.records) == CFG.max_retries + 1
    assert all(np.array_equal(r.prompt, res.records[0].prompt) for r in res.records)
    (res,) = run(env, RunawayPolicy(), n=1)
    assert res.end_reason == "failure" and res.records[0].completion.size == CFG.max_new_tokens
    (res,) = run(env, WrongPolicy(), n=1)  # WRONG stays in context; the 3rd wrong one fails
    assert res.end_reason == "failure" and len(res.records) == 3 and res.score == 0.0


def test_sub_agents_start_fresh_and_return_their_answer_to_the_parent():
    env = LedgerEnv(num_ops=8)
    for res in run(env, LedgerExpert(delegate_prob=0.5, seed=1)):
        assert res.end_reason == "success" and res.stats["sub_agents"] > 0
        by_id = {r.call_id: r for r in res.records}
        subs = [r for r in res.records if r.role == "sub-agent"]
        assert len(subs) == res.stats["sub_agents"]
        for sub in subs:
            spawner = by_id[sub.parent_id]
            assert spawner.role == "main" and spawner.completion[0] == V.DELEGATE
            assert sub.prompt[:2].tolist() == [V.BOS, V.SUB]  # its own root, not the parent's
            (nxt,) = [r for r in res.records if r.parent_id == spawner.call_id and r.role == "main"]
            obs = nxt.prompt[spawner.tokens.size :].tolist()
            assert starts_with(nxt.prompt, spawner.tokens) and obs == sub.completion[:-1].tolist()


@pytest.mark.parametrize("model_summary", [False, True])
def test_compaction_restarts_from_the_task_prefix(model_summary):
    env = LedgerEnv(num_ops=60, header_ops=4)
    cfg = AgentSettings(max_calls=400, context_window=64, max_new_tokens=8,
                        model_summary=model_summary)  # fmt: skip
    for res in run(env, LedgerExpert(), cfg=cfg):
        assert res.end_reason == "success" and res.stats["compactions"] > 5
        assert max(r.tokens.size for r in res.records) <= 64
        prefix = env.task_prompt(env.reset(res.task))
        by_id = {r.call_id: r for r in res.records}
        summaries = [r for r in res.records if r.role == "main-summary"]
        assert len(summaries) == (res.stats["compactions"] if model_summary else 0)
        restarts = 0
        for rec in res.records[1:]:
            parent = by_id[rec.parent_id]
            if starts_with(rec.prompt, parent.tokens):
                continue
            restarts += 1  # a compaction branch: shares only the task prefix
            assert rec.prompt[prefix.size] == V.SUMMARY
            # shares the task prefix (and, after an earlier compaction, the SUMMARY head)
            assert prefix.size <= common_prefix(rec.prompt, parent.tokens) < prefix.size + 6
            if model_summary:  # the summary call's own completion is carried over
                body = parent.completion[:-1]
                assert parent.role == "main-summary" and parent.prompt[-1] == V.SUMMARY
                assert (
                    rec.prompt[prefix.size + 1 : prefix.size + 1 + body.size].tolist()
                    == body.tolist()
                )
        assert restarts == res.stats["compactions"]


@pytest.mark.parametrize("model_summary", [False, True])
def test_sub_agents_compact_on_their_own(model_summary):
    env = LedgerEnv(num_ops=6, header_ops=2, max_wrong=12)
    cfg = AgentSettings(max_calls=300, context_window=40, max_new_tokens=5,
                        model_summary=model_summary, max_retries=1)  # fmt: skip
    policy = LedgerExpert(delegate_prob=1.0, sub_mistakes=10)
    (res,) = run(env, policy, n=1, cfg=cfg)
    roles = {r.role for r in res.records}
    assert res.end_reason == "success" and "sub-agent" in roles
    assert ("sub-agent-summary" in roles) == model_summary
    subs = [r for r in res.records if r.role.startswith("sub-agent")]
    assert all(r.prompt[:2].tolist() == [V.BOS, V.SUB] for r in subs)
    assert max(r.tokens.size for r in res.records) <= 40
    by_id = {r.call_id: r for r in res.records}
    restarts = [r for r in subs if r.role == "sub-agent" and by_id[r.parent_id].role != "main"
                and not starts_with(r.prompt, by_id[r.parent_id].tokens)]  # fmt: skip
    assert restarts and all(r.prompt[5] == V.SUMMARY for r in restarts)


def test_budgets_end_in_timeout_with_partial_credit():
    env = LedgerEnv(num_ops=8)
    cfg = AgentSettings(max_calls=5, max_new_tokens=8)
    (res,) = run(env, LedgerExpert(), n=1, cfg=cfg)
    assert (res.end_reason, res.milestones, res.score) == ("timeout", 5, 0.5 * 5 / 8)
    cfg = AgentSettings(max_tokens=12, max_new_tokens=8)  # 5 + 5, then a 2-token truncation
    (res,) = run(env, LedgerExpert(), n=1, cfg=cfg)
    assert (res.end_reason, res.milestones, res.score) == ("timeout", 2, 0.5 * 2 / 8)
    assert res.records[-1].completion.size == 2 and res.stats["generated"] == 12
    ticks = itertools.count()  # a fake clock: one second per reading, no test sleeps
    cfg = AgentSettings(max_seconds=7.5, max_new_tokens=8)
    (res,) = run(env, LedgerExpert(), n=1, cfg=cfg, clock=lambda: float(next(ticks)))
    assert res.end_reason == "timeout" and 0 < res.milestones < 8
    assert res.score == 0.5 * res.milestones / 8


def test_context_overflow_when_even_the_compacted_context_does_not_fit():
    env = LedgerEnv(num_ops=100, header_ops=8)
    cfg = AgentSettings(context_window=48, max_new_tokens=8)  # 2-digit indices outgrow 1-digit
    (res,) = run(env, LedgerExpert(), n=1, cfg=cfg)
    assert res.end_reason == "context_overflow" and res.records
    assert res.score == 0.5 * res.milestones / 100
    (res,) = run(env, LedgerExpert(), n=1, cfg=AgentSettings(context_window=20, max_new_tokens=8))
    assert res.end_reason == "context_overflow" and res.records == []  # the task alone is too big


def test_infra_errors_are_retried_get_no_score_and_stay_isolated():
    env = LedgerEnv(num_ops=8)
    tasks = env.make_tasks(0, 3)
    bad_task = tasks[1].task_id
    flaky = FlakyClient(LedgerExpert(), lambda eid, cid: cid == 2, times=1)
    results = run(env, flaky, tasks=tasks)
    assert [r.end_reason for r in results] == ["success"] * 3
    assert all(r.stats["infra_retries"] == 1 for r in results)
    dead = FlakyClient(LedgerExpert(), lambda eid, cid: eid.startswith(bad_task) and cid == 3, 99)
    results = run(env, dead, tasks=tasks)
    assert [r.end_reason for r in results] == ["success", "infra_error", "success"]
    assert results[1].score is None and len(results[1].records) == 3
    for kind in ("crash", "hang"):  # transient env faults are retried; persistent ones are infra
        faulty = FaultyEnv(env, lambda tid, n, kind=kind: kind if n == 4 else None, times=1)
        assert [r.end_reason for r in run(faulty, LedgerExpert(), tasks=tasks)] == ["success"] * 3
        faulty = FaultyEnv(env, lambda tid, n, kind=kind: kind if tid == bad_task else None, 9)
        ends = [r.end_reason for r in run(faulty, LedgerExpert(), tasks=tasks)]
        assert ends == ["success", "infra_error", "success"]


def test_an_exception_in_one_execution_never_affects_the_others():
    class Broken(LedgerEnv):
        def reset(self, task):
            if task.task_id == "boom":
                raise ValueError("corrupt task")
            return super().reset(task)

    env = Broken(num_ops=4)
    tasks = [Task("a", 1), Task("boom", 2), Task("a", 1)]
    results = run(env, LedgerExpert(), tasks=tasks)
    assert [r.end_reason for r in results] == ["success", "infra_error", "success"]
    assert [r.execution_id for r in results] == ["a#0", "boom#0", "a#1"]
    assert "corrupt task" in results[1].stats["detail"]


def test_ten_thousand_steps_run_in_a_bounded_window():
    env = LedgerEnv(num_ops=10_000, header_ops=4)
    cfg = AgentSettings(max_calls=11_000, max_tokens=10**6, context_window=128, max_new_tokens=10)
    (res,) = run(env, LedgerExpert(), n=1, cfg=cfg)
    assert res.end_reason == "success" and res.milestones == 10_000
    assert res.stats["max_context"] <= 128 and res.stats["compactions"] > 1000
    assert max(r.tokens.size for r in res.records) <= 128


def test_trees_have_the_expected_shapes():
    from gyre.trajectory.tree import build_tree

    env = LedgerEnv(num_ops=8)
    for res in run(env, GarbagePolicy(LedgerExpert(), period=2)):  # retries: dead branches
        tree = build_tree(res.records)
        r = res.stats["retries"]
        assert len(tree.leaf_calls) == 1 + r
        assert tree.num_nodes == res.records[-1].tokens.size + len(GarbagePolicy.GARBAGE) * r
    env = LedgerEnv(num_ops=60, header_ops=4)
    cfg = AgentSettings(max_calls=400, context_window=64, max_new_tokens=8)
    for res in run(env, LedgerExpert(), cfg=cfg, n=2):  # compaction: one path per segment
        tree = build_tree(res.records)
        assert len(tree.leaf_calls) == res.stats["compactions"] + 1
        assert tree.num_nodes < sum(r.completion.size + r.prompt.size for r in res.records)
    (res,) = run(LedgerEnv(num_ops=8), LedgerExpert(delegate_prob=0.5, seed=1), n=1)
    tree = build_tree(res.records)  # each sub-agent is its own leaf path
    assert len(tree.leaf_calls) == 1 + res.stats["sub_agents"]


def test_scripted_harness_driver_reports_endings_and_tree_stats(capsys):
    import importlib.util
    import json
    import pathlib

    from gyre.agent.driver import run_scripted_harness
    from gyre.config import validate
    from gyre.envs.registry import make_env
    from gyre.rl.builder import build_specs

    path = pathlib.Path(__file__).parents[1] / "experiments" / "harness_ledger.py"
    spec = importlib.util.spec_from_file_location("harness_ledger", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = mod.get_config("16")
    validate(cfg)
    specs = build_specs(cfg)
    summary = run_scripted_harness(make_env(specs.env), specs.agent, specs.seed,
                                   specs.run.tasks_per_step, specs.run.samples_per_task)  # fmt: skip
    assert sum(summary["end_reasons"].values()) == summary["executions"] == 32
    assert {"success", "failure", "timeout", "infra_error"} <= set(summary["end_reasons"])
    assert summary["flat_tokens"] >= summary["unique_tokens"] > 0
    assert summary["paths"] >= summary["executions"] - summary["end_reasons"]["infra_error"]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary
