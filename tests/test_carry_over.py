"""Carry-over: a step closes once ``close_share`` of its groups has finished, and the groups
still running are trained by a later step, each exactly once (the work bookkeeping, the
simulator, and a resume's restart of the groups a kill left untrained)."""

import collections
import dataclasses
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.elastic.policy import PolicyParams
from gyre.elastic.sim import Simulator, simulate
from gyre.envs.base import Task
from gyre.rl.rollouts import Rollouts
from gyre.rl.work import Group, StepWork
from tests.test_sim import COST, MEM, small_workload


def _group(step, index):
    return Group(step, index, Task(f"t{step}-{index}", None))


def test_a_step_closes_at_its_share_and_hands_its_running_groups_on():
    work = StepWork(0, 0, num_groups=4, dispatched_at=0.0, need=2, max_carry=1)
    groups = [_group(0, i) for i in range(4)]
    for g in groups:
        work.own(g, spec=None)
    assert not work.closable and len(work.open_groups) == 4
    work.finish(groups[0], [], spec=None)  # no executions: nothing to pack
    assert not work.closable
    work.finish(groups[1], [], spec=None)
    assert (
        work.closable and work.own_done == 2 and work.groups == [(0, 0), (0, 1)]
    )  # 2 of 4 finished; the other two may be carried
    left = work.close()
    assert [g.key for g in left] == [(0, 2), (0, 3)]
    assert all(g.work is None and g.carried == 1 for g in left)
    nxt = StepWork(1, 0, num_groups=4, dispatched_at=0.0, need=2, max_carry=1)
    for g in left:
        nxt.own(g, spec=None)
    assert nxt.carried_in == 2 and all(g.work is nxt for g in left)
    for i in range(4):  # every own group finished, but the carried ones reached max_carry
        g = _group(1, i)
        nxt.own(g, spec=None)
        nxt.finish(g, [], spec=None)
    assert nxt.own_done == 4 and not nxt.closable
    for g in left:
        nxt.finish(g, [], spec=None)
    assert nxt.closable and nxt.own_done == 4  # carried groups are not its own


def test_without_carry_over_a_step_waits_for_every_group():
    work = StepWork(0, 0, num_groups=3, dispatched_at=0.0)
    assert work.need == 3
    groups = [_group(0, i) for i in range(3)]
    for g in groups:
        work.own(g, spec=None)
    for g in groups[:2]:
        work.finish(g, [], spec=None)
    assert not work.closable
    work.finish(groups[2], [], spec=None)
    assert work.closable


def test_close_on_owned_counts_carried_in_groups_towards_the_share():
    work = StepWork(1, 0, num_groups=4, dispatched_at=0.0, need=2, max_carry=2,
                    count_carried=True)  # fmt: skip
    carried = [_group(0, 2), _group(0, 3)]
    for g in carried:
        g.carried = 1
        work.own(g, spec=None)
    for i in range(4):
        work.own(_group(1, i), spec=None)
    for g in carried:  # two carried-in groups finish before any of its own
        work.finish(g, [], spec=None)
    assert work.own_done == 2 and work.closable  # its 4 own groups may still be carried
    assert [g.key for g in work.close()] == [(1, i) for i in range(4)]
    own = StepWork(1, 0, num_groups=4, dispatched_at=0.0, need=2, max_carry=2)
    for g in [_group(0, 0), _group(0, 1)]:
        own.own(g, spec=None)
        own.finish(g, [], spec=None)
    assert own.own_done == 0 and not own.closable  # "own": carried groups do not count


def test_close_on_is_checked_by_name():
    with pytest.raises(ValueError, match="scheduler.close_on"):
        PolicyParams(close_on="any")
    from gyre import config

    cfg = config.default_config()
    cfg.scheduler.close_on = "first"
    with pytest.raises(config.ConfigError, match="scheduler.close_on"):
        config.validate(cfg)


def _slowed(ex, extra_s):
    calls = tuple(dataclasses.replace(c, tool_latency_s=c.tool_latency_s + extra_s)
                  for c in ex.calls)  # fmt: skip
    return dataclasses.replace(ex, calls=calls)


def test_close_on_owned_closes_a_colocated_step_on_its_carried_in_work():
    """Step 0 closes on its 3 fast executions and carries 6 medium ones; step 1's own are
    all slow. Counting its own, step 1 waits for 3 slow executions; counting what it owns, it
    closes once 3 of the carried ones (part-way through already) have finished."""
    steps = small_workload(seed=2, steps=3, timeout=1e7)
    steps[0][3:] = [_slowed(ex, 100.0) for ex in steps[0][3:]]
    steps[1] = [_slowed(ex, 2000.0) for ex in steps[1]]
    runs = {}
    for close_on in ("own", "owned"):
        params = PolicyParams(close_share=0.3, max_carry=2, close_on=close_on)
        sim = Simulator(steps, 2, "colocate", COST, params)
        runs[close_on] = (sim, sim.run())
    (own, a), (owned, b) = runs["own"], runs["owned"]
    slow_s = 2000.0 * min(len(ex.calls) for ex in steps[1])
    assert a.step_end_s[1] - a.step_end_s[0] > slow_s  # waits for 3 of its slow ones
    assert b.step_end_s[1] - b.step_end_s[0] < slow_s / 2
    assert b.makespan_s < a.makespan_s
    for sim, res in runs.values():  # each trained exactly once, within max_carry
        assert set(res.end_counts.values()) == {1}
        assert all(ex.step <= sim.trained_by[ex.execution_id] <= ex.step + 2
                   for batch in steps for ex in batch)  # fmt: skip
    assert sum(owned.trained_by[ex.execution_id] == 2 for ex in steps[1]) > sum(
        own.trained_by[ex.execution_id] == 2 for ex in steps[1]
    )  # step 1 closed before its slow ones: they went on to the last step


@pytest.mark.parametrize("close_on", ["own", "owned"])
@pytest.mark.parametrize("policy", ["async", "elastic", "colocate"])
@pytest.mark.parametrize("memory", [COST, MEM])
def test_simulated_carry_over_trains_every_execution_exactly_once(policy, memory, close_on):
    steps = small_workload(seed=3, steps=4)
    params = PolicyParams(async_rollout_cells=2, close_share=0.5, max_carry=2, close_on=close_on)
    sim = Simulator(steps, 3, policy, memory, params)
    res = sim.run()
    ids = {ex.execution_id: ex for b in steps for ex in b}
    assert set(res.outcomes) == set(ids) and set(res.end_counts.values()) == {1}
    assert set(sim.trained_by) == set(ids)
    for eid, step in sim.trained_by.items():  # trained by its own step or one of the next two
        assert ids[eid].step <= step <= ids[eid].step + 2
    assert res.counters["carried"] > 0
    assert sum(sim.trained_by[e] != ids[e].step for e in ids) > 0
    assert len(res.step_end_s) == len(steps)
    last = len(steps) - 1  # the last step waits for everything: nothing carried beyond it
    assert max(sim.trained_by.values()) == last
    full = sum(o[3] for o in res.outcomes.values())
    assert res.counters["trained_tokens"] == pytest.approx(full)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 1000), share=st.sampled_from([0.3, 0.5, 0.9]),
       max_carry=st.integers(1, 3), policy=st.sampled_from(["async", "elastic", "colocate"]),
       close_on=st.sampled_from(["own", "owned"]))  # fmt: skip
def test_carry_over_never_trains_a_group_beyond_max_carry(seed, share, max_carry, policy,
                                                          close_on):  # fmt: skip
    steps = small_workload(seed=seed, steps=4)
    params = PolicyParams(async_rollout_cells=1, close_share=share, max_carry=max_carry,
                          close_on=close_on)  # fmt: skip
    sim = Simulator(steps, 2, policy, COST, params)
    sim.run()
    for batch in steps:
        for ex in batch:
            assert ex.step <= sim.trained_by[ex.execution_id] <= ex.step + max_carry


def test_close_share_one_is_the_model_without_carry_over():
    steps = small_workload(seed=1, steps=3)
    a = simulate(steps, 3, "async", MEM, PolicyParams(async_rollout_cells=2))
    b = simulate(steps, 3, "async", MEM, PolicyParams(async_rollout_cells=2, close_share=1.0,
                                                      max_carry=3))  # fmt: skip
    assert a == b and a.counters["carried"] == 0


def test_colocate_steps_no_longer_wait_for_a_straggler():
    """One execution per step runs ~10x longer than the rest: with carry-over colocate's
    steps close without it, and it is trained by the next step."""
    steps = small_workload(seed=2, steps=3)
    slow = steps[0][0]
    calls = tuple(
        dataclasses.replace(c, tool_latency_s=c.tool_latency_s + 600.0) for c in slow.calls
    )
    steps[0][0] = dataclasses.replace(slow, calls=calls)
    waits = simulate(steps, 2, "colocate", COST, PolicyParams(close_share=1.0))
    carries = Simulator(steps, 2, "colocate", COST, PolicyParams(close_share=0.8))
    res = carries.run()
    assert waits.step_end_s[0] > 600.0 * len(calls) * 0.9  # the straggler holds step 0
    assert res.step_end_s[0] < waits.step_end_s[0] / 2
    assert carries.trained_by[slow.execution_id] == 1
    assert res.makespan_s < waits.makespan_s


def _rollouts(specs, env):
    """A Rollouts with its bookkeeping only (no proxy, no trace file)."""
    ro = Rollouts.__new__(Rollouts)
    ro.specs, ro.env, ro.carried, ro.restart = specs, env, [], []
    ro.counters = collections.Counter()
    return ro


def test_a_resume_restarts_exactly_the_groups_no_trained_step_holds():
    """Groups of the last max_carry steps absent from the ledger were running at the kill:
    they start again, carried to the resumed step; none of an older step, none trained."""
    env = types.SimpleNamespace(
        make_tasks=lambda seed, n: [Task(f"{seed}-{i}", None) for i in range(n)]
    )
    specs = types.SimpleNamespace(
        run=types.SimpleNamespace(seed=0, tasks_per_step=3, samples_per_task=2, steps=5),
        scheduler=PolicyParams(close_share=0.5, max_carry=2),
    )
    ro = _rollouts(specs, env)
    trained = {(0, 0), (0, 1), (0, 2), (1, 0), (1, 2), (2, 1)}
    assert ro.restart_untrained(3, trained) == 3  # step 0 is beyond max_carry
    got = sorted((g.key, g.carried) for g in ro.restart)
    assert got == [((1, 1), 2), ((2, 0), 1), ((2, 2), 1)]
    same_tasks = [g.task.task_id for g in ro.restart]
    assert len(set(same_tasks)) == 3  # the tasks their steps drew, keyed by (seed, step)
    off = types.SimpleNamespace(run=specs.run, scheduler=PolicyParams(close_share=1.0))
    assert _rollouts(off, env).restart_untrained(3, set()) == 0  # nothing is ever carried


@pytest.mark.parametrize("close_on", ["own", "owned"])
def test_dispatch_builds_the_step_work_the_close_rule_names(close_on):
    env = types.SimpleNamespace(
        make_tasks=lambda seed, n: [Task(f"{seed}-{i}", None) for i in range(n)]
    )
    specs = types.SimpleNamespace(
        run=types.SimpleNamespace(seed=0, tasks_per_step=4, samples_per_task=2, steps=5),
        scheduler=PolicyParams(close_share=0.5, max_carry=2, close_on=close_on),
        trajectory=None,
    )
    ro = _rollouts(specs, env)
    ro.packed_tokens, started = 0.0, []
    ro.start_groups = lambda groups, work=None: started.extend((g, work) for g in groups)
    carried = _group(0, 3)
    carried.carried = 1
    ro.carried = [carried]
    work = ro.dispatch(1, version=1)
    assert work.need == 2 and work.max_carry == 2 and work.carried_in == 1
    assert len(started) == 4 and all(w is work for _, w in started)
    work.finish(carried, [], spec=None)
    assert work.own_done == (1 if close_on == "owned" else 0)
    last = ro.dispatch(4, version=4)  # the run's last step waits for everything
    assert last.need == 4 and last.max_carry == 0


def test_the_simulators_snapshot_counts_executions_ended_at_their_timeout():
    steps = small_workload(seed=1, steps=2, timeout=300.0)
    sim = Simulator(steps, 2, "elastic", COST, PolicyParams(close_share=0.5, max_carry=2))
    seen = []
    snapshot = sim._snapshot
    sim._snapshot = lambda: seen.append(snapshot()) or seen[-1]
    res = sim.run()
    timeouts = sum(o[0] == "timeout" for o in res.outcomes.values())
    assert 0 < timeouts < len(res.outcomes)
    assert seen[-1].timed_out == timeouts and seen[-1].finished == len(res.outcomes)
    shares = [s.timeout_share for s in seen]
    assert shares[0] == 0.0 and max(shares) > 0.0


def test_the_controllers_rollouts_count_executions_ended_at_their_timeout(monkeypatch):
    """Rollouts counts each finished execution, and those that ended at their timeout apart
    (the controller's snapshot reads both)."""
    import asyncio

    import gyre.rl.rollouts as rollouts_mod

    reasons = iter(["success", "timeout", "timeout", "failure"])

    async def fake_run(env, task, client, agent, eid):
        return types.SimpleNamespace(end_reason=next(reasons), execution_id=eid)

    monkeypatch.setattr(rollouts_mod, "run_execution", fake_run)
    specs = types.SimpleNamespace(
        run=types.SimpleNamespace(samples_per_task=4), agent=None, trajectory=None
    )
    ro = _rollouts(specs, env=None)
    ro.gate, ro.first_start, ro.packed_tokens = asyncio.Semaphore(4), None, 0.0
    ro.timeline = types.SimpleNamespace(now=lambda: 0.0)
    ro.client = types.SimpleNamespace(end_execution=lambda eid: None)
    ro.trace = types.SimpleNamespace(record=lambda *a: None)
    ro.on_progress = lambda: None
    group = _group(0, 0)  # carried to a step not yet dispatched: its results wait on it
    asyncio.run(ro._run_group(group))
    assert ro.counters["finished"] == 4 and ro.counters["timed_out"] == 2
    assert [r.end_reason for r in group.results] == ["success", "timeout", "timeout", "failure"]
