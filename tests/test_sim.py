"""Simulator checks: lower bound, colocate closed form, nothing lost or duplicated, purity."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.elastic import calibration
from gyre.elastic.policy import PolicyParams
from gyre.elastic.sim import CostModel, simulate
from gyre.elastic.workload import Call, Execution, WorkloadSpec, generate, read_trace, write_trace

COST = CostModel(
    decode_base_s=0.02,
    decode_per_seq_s=5e-4,
    decode_per_ctx_token_s=2e-8,
    prefill_per_token_s=5e-5,
    train_per_token_s=2e-4,
    optimizer_s=3.0,
    publish_s=2.0,
    switch_r2t_s=8.5,
    switch_t2r_s=3.5,
    slots=4,
    microbatch_tokens=4000,
)


def small_workload(seed=0, steps=3, branching=0.1, timeout=3600.0):
    spec = WorkloadSpec(
        steps=steps,
        queries_per_step=3,
        samples_per_query=3,
        mean_calls=6,
        mean_completion_tokens=200,
        mean_observation_tokens=300,
        mean_tool_latency_s=20.0,
        context_window=3000,
        summary_tokens=200,
        system_tokens=300,
        timeout_s=timeout,
        retry_rate=branching,
        subagent_rate=branching,
        subagent_calls=2,
        seed=seed,
    )
    return generate(spec)


def all_ids(steps):
    return {ex.execution_id for batch in steps for ex in batch}


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    cells=st.integers(1, 5),
    policy=st.sampled_from(["colocate", "async", "elastic"]),
    timeout=st.sampled_from([300.0, 3600.0]),
    slots=st.sampled_from([1, 3, 8]),
    staleness=st.integers(0, 2),
)
def test_no_policy_beats_the_lower_bound_and_nothing_is_lost(
    seed, cells, policy, timeout, slots, staleness
):
    if policy == "async" and cells < 2:
        cells = 2
    steps = small_workload(seed, steps=2, timeout=timeout)
    cost = dataclasses.replace(COST, slots=slots)
    r = simulate(steps, cells, policy, cost, PolicyParams(max_staleness=staleness))
    assert r.makespan_s >= r.lower_bound_s * (1 - 1e-9)
    assert r.end_counts == {i: 1 for i in all_ids(steps)}
    assert 0 < r.utilisation <= 1 + 1e-9


def test_colocate_matches_closed_form():
    # m identical executions per cell, slots = m: every round all prefill (serially), then
    # decode together, then wait on the tool, on every cell in lockstep.
    k, m, steps_n = 2, 4, 3
    calls = (Call(1000, 100, 30.0, 1000), Call(1400, 50, 10.0, 300), Call(1800, 200, 5.0, 350))
    steps = [[Execution(f"s{s}-e{e}", s, calls, 1e9) for e in range(k * m)] for s in range(steps_n)]
    tokens_per_step = k * m * sum(c.new_prompt_tokens + c.completion_tokens for c in calls)
    rounds = 4
    cost = dataclasses.replace(COST, slots=m, microbatch_tokens=tokens_per_step // (k * rounds))
    assert tokens_per_step % (k * rounds) == 0
    rollout = sum(
        m * c.new_prompt_tokens * cost.prefill_per_token_s
        + c.completion_tokens
        * cost.decode_step_s(m, m * (c.prompt_tokens + c.completion_tokens / 2))
        + c.tool_latency_s
        for c in calls
    )
    train = rounds * cost.microbatch_tokens * cost.train_per_token_s
    step = rollout + cost.switch_r2t_s + train + cost.optimizer_s + cost.publish_s
    expected = steps_n * step + (steps_n - 1) * cost.switch_t2r_s
    r = simulate(steps, k, "colocate", cost)
    assert r.makespan_s == pytest.approx(expected, rel=1e-9)
    assert r.switches == k * (2 * steps_n - 1)


def test_elastic_hands_over_without_losing_or_duplicating_tokens():
    # Cheap switches and tiny micro-batches make the waterlevel move cells often.
    steps = small_workload(seed=3, steps=4, branching=0.3, timeout=1e9)
    cost = dataclasses.replace(COST, switch_r2t_s=0.5, switch_t2r_s=0.2, microbatch_tokens=500)
    r = simulate(steps, 4, "elastic", cost, PolicyParams(max_staleness=1))
    assert r.switches > 8
    assert r.end_counts == {i: 1 for i in all_ids(steps)}
    by_id = {ex.execution_id: ex for batch in steps for ex in batch}
    for ex_id, (reason, _, _, tokens) in r.outcomes.items():
        assert reason == "success"
        assert tokens == pytest.approx(by_id[ex_id].train_tokens, rel=1e-9)


def test_async_dispatch_respects_staleness_bound():
    steps = small_workload(seed=1, steps=5)
    for k in (0, 1):
        r = simulate(steps, 4, "async", COST, PolicyParams(async_rollout_cells=2, max_staleness=k))
        for batch in steps[k + 1 :]:
            s = batch[0].step
            starts = [r.outcomes[ex.execution_id][1] for ex in batch]
            assert min(starts) >= r.step_end_s[s - k - 1]  # version >= s - k at dispatch
        # The split never changes after the first decision.
        assert r.switches == 2


def test_simulation_is_deterministic_and_timeouts_cap_durations():
    steps = small_workload(seed=5, timeout=200.0)
    a = simulate(steps, 3, "elastic", COST)
    b = simulate(steps, 3, "elastic", COST)
    assert a.makespan_s == b.makespan_s and a.timeline == b.timeline
    durations = [end - start for _, start, end, _ in a.outcomes.values()]
    assert max(durations) <= 200.0 + 1e-6
    assert any(reason == "timeout" for reason, *_ in a.outcomes.values())


def test_trace_roundtrip(tmp_path):
    steps = small_workload(seed=2, steps=2)
    path = tmp_path / "trace.jsonl"
    write_trace(str(path), steps)
    assert read_trace(str(path)) == steps
    path.write_text('{"execution_id": "x", "step": 0}\n')
    with pytest.raises(ValueError, match="trace.jsonl:1"):
        read_trace(str(path))


def test_calibration_fit_recovers_a_known_cost_model():
    truth = dataclasses.replace(COST, decode_per_ctx_token_s=3e-9)
    fitted = calibration.fit(calibration.measurements(truth))
    for name in (
        "decode_base_s",
        "decode_per_seq_s",
        "decode_per_ctx_token_s",
        "prefill_per_token_s",
        "train_per_token_s",
    ):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6), name
    noisy = calibration.fit(calibration.measurements(truth, noise=0.02, seed=1))
    assert noisy.decode_base_s == pytest.approx(truth.decode_base_s, rel=0.1)


def test_calibration_files_load_and_need_a_source():
    for name in ("h200_122b_a10b", "h200_2p4t"):
        cost = calibration.load(name)
        assert cost.source and cost.train_per_token_s > 0 and cost.switch_r2t_s == 8.5
    bad = calibration.measurements(COST)
    del bad["source"]
    with pytest.raises(ValueError, match="source"):
        calibration.from_dict(bad)


def test_replication_scales_costs_and_keeps_the_lower_bound_consistent():
    cost = dataclasses.replace(COST, slots=8, cell_capacity=8.0)
    rep = cost.replicated(4)
    assert rep.slots == 2 and rep.decode_step_s(2, 2000.0) == pytest.approx(
        cost.decode_step_s(8, 8000.0)
    )
    # One simulated token stands for 4 real ones.
    assert rep.min_token_work_s(1000.0) == pytest.approx(4 * cost.min_token_work_s(1000.0))
