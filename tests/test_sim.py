"""Simulator checks: lower bound, colocate closed form, nothing lost or duplicated, purity,
and the engine mechanisms (memory, affinity, eviction, hand-over, chunked prefill, weight
loads, context-dependent training) against hand-computed cases."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.elastic import calibration
from gyre.elastic.costs import CellMemory, kv_bytes_per_token
from gyre.elastic.policy import TRAIN, PolicyParams
from gyre.elastic.sim import CostModel, Simulator, Switched, simulate
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

# The memory model: no slot cap, a KV pool, KV migration possible, context-dependent costs.
MEM = dataclasses.replace(
    COST,
    slots=0,
    kv_capacity_tokens=1e9,
    kv_bytes_per_token=1000.0,
    link_bytes_per_s=1e8,
    prefill_per_ctx_token_s=1e-9,
    train_per_ctx_token_s=1e-9,
    weight_load_s=2.0,
    reduce_s=1.5,
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


def biggest_need(steps):
    return max(c.prompt_tokens + c.completion_tokens for b in steps for ex in b for c in ex.calls)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    cells=st.integers(2, 4),
    policy=st.sampled_from(["colocate", "async", "elastic"]),
    timeout=st.sampled_from([300.0, 3600.0]),
    contexts=st.sampled_from([1.0, 2.5, 8.0]),
    migrate=st.booleans(),
    mixed=st.sampled_from([0, 256]),
    staleness=st.integers(0, 2),
)
def test_memory_model_keeps_the_bound_and_loses_nothing(
    seed, cells, policy, timeout, contexts, migrate, mixed, staleness
):
    # Cheap switches and small micro-batches make elastic hand cells over mid-rollout.
    steps = small_workload(seed, steps=2, timeout=timeout, branching=0.2)
    cost = dataclasses.replace(
        MEM, kv_capacity_tokens=contexts * biggest_need(steps), handover_migrate=migrate,
        mixed_chunk=mixed, switch_r2t_s=0.5, switch_t2r_s=0.2, microbatch_tokens=500,
    )  # fmt: skip
    sim = Simulator(steps, cells, policy, cost, PolicyParams(max_staleness=staleness))
    r = sim.run()
    assert r.makespan_s >= r.lower_bound_s * (1 - 1e-9)
    assert r.end_counts == {i: 1 for i in all_ids(steps)}
    assert 0 < r.utilisation <= 1 + 1e-9
    if timeout > 1000:  # nothing timed out: every token of every execution was trained
        by_id = {ex.execution_id: ex for batch in steps for ex in batch}
        for ex_id, (reason, _, _, tokens) in r.outcomes.items():
            if reason == "success":
                assert tokens == pytest.approx(by_id[ex_id].train_tokens, rel=1e-9)
    for c in sim.cells:  # memory is returned when the executions end
        assert not c.idle and c.kv_live == pytest.approx(0.0, abs=1e-6)


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


@pytest.mark.parametrize("memory", [False, True])
@pytest.mark.parametrize("train_scale", [1.0, 10.0])
def test_elastic_never_loses_to_a_fixed_split_beyond_its_switch_costs(memory, train_scale):
    # A fixed split is a special case of an elastic policy: on a small grid (no memory model /
    # KV pools, light / heavy training) elastic's equal-work time is within one switch round
    # trip per step of the best fixed split, the most its role moves can put on a step's
    # critical path.
    steps = small_workload(seed=0, steps=4)
    base = MEM if memory else COST
    cost = dataclasses.replace(base, train_per_token_s=base.train_per_token_s * train_scale)
    full = sum(ex.train_tokens for batch in steps for ex in batch)

    def equal_work_s(policy, params):
        r = simulate(steps, 4, policy, cost, params)
        assert r.end_counts == {i: 1 for i in all_ids(steps)}
        return r.makespan_s * full / r.counters["trained_tokens"]

    best = min(equal_work_s("async", PolicyParams(async_rollout_cells=k)) for k in (1, 2, 3))
    round_trip = cost.switch_r2t_s + cost.switch_t2r_s
    assert equal_work_s("elastic", PolicyParams()) <= best + len(steps) * round_trip


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


# ---- the engine mechanisms, each against a case computed by hand ----------------------------

P, C, OBS = 1000, 100, 100  # first prompt, completion, observation tokens
PLAIN = dataclasses.replace(MEM, prefill_per_ctx_token_s=0.0, train_per_ctx_token_s=0.0,
                            weight_load_s=0.0, reduce_s=0.0, switch_r2t_s=0.0,
                            switch_t2r_s=0.0)  # fmt: skip


def two_calls(eid, tool=1000.0, timeout=1e9):
    """call 1: P fresh tokens; call 2: the context + OBS new tokens (P + C cached)."""
    return Execution(eid, 0, (Call(P, C, tool, P), Call(P + C + OBS, C, 0.0, OBS)), timeout)


def test_kv_cap_evicts_lru_and_the_evicted_context_is_reprefilled():
    # One cell holding 2700 KV tokens: two first calls (1100 each) fit, a third does not.
    e2 = Execution("e2", 0, (Call(P, C, 0.0, P),), 3.0)  # one call, a 3 s timeout
    steps = [[two_calls("e0"), two_calls("e1"), e2]]
    cost = dataclasses.replace(PLAIN, kv_capacity_tokens=2 * (P + C) + 500)
    r = simulate(steps, 1, "colocate", cost)
    pt, d = cost.prefill_per_token_s, cost.decode_step_s
    # e0, e1 admitted; e2 waits (admission). Both prefill (decode paused), decode together.
    t1 = 2 * P * pt + C * d(2, 2 * (P + C / 2))
    # e2 is admitted at t1: it evicts e0's idle context (least recently used), runs alone.
    t2 = t1 + P * pt + C * d(1, P + C / 2)
    # At t1 + 1000 e0 returns: evicted, so it prefills its whole prompt; e1 only its new OBS.
    t3 = t1 + 1000.0 + (P + C + OBS + OBS) * pt + C * d(2, 2 * (P + C + OBS + C / 2))
    assert r.outcomes["e2"][1:3] == pytest.approx((t1, t2))  # the clock starts at admission
    assert r.outcomes["e2"][0] == "success"  # 3 s from dispatch would have cut it (t2 > 3)
    assert t2 > 3.0 > t2 - t1
    assert r.outcomes["e0"][2] == pytest.approx(t3) and r.outcomes["e1"][2] == pytest.approx(t3)
    assert r.counters["evictions"] == 1
    assert r.counters["reprefill_tokens"] == P + C  # e0's evicted context, nothing else
    assert r.counters["moved_calls"] == 0


def test_timeout_clock_starts_at_admission_not_dispatch():
    # A KV pool for one call: the second execution waits for the first to end entirely.
    steps = [[Execution(f"e{i}", 0, (Call(P, C, 0.0, P),), 10.0) for i in range(2)]]
    cost = dataclasses.replace(PLAIN, kv_capacity_tokens=P + C)
    r = simulate(steps, 1, "colocate", cost)
    run = P * cost.prefill_per_token_s + C * cost.decode_step_s(1, P + C / 2)
    assert r.outcomes["e0"][1:3] == pytest.approx((0.0, run))
    assert r.outcomes["e1"][1:3] == pytest.approx((run, 2 * run))
    short = [[Execution(f"e{i}", 0, (Call(P, C, 0.0, P),), 0.5 * run) for i in range(2)]]
    r = simulate(short, 1, "colocate", cost)
    for eid in ("e0", "e1"):  # both run 0.5 x run from their own admission, then time out
        reason, start, end, _ = r.outcomes[eid]
        assert reason == "timeout" and end - start == pytest.approx(0.5 * run)


def test_prefill_attention_is_quadratic_in_context():
    cost = dataclasses.replace(PLAIN, prefill_per_ctx_token_s=1e-8)
    attn = lambda n, c=0.0: cost.prefill_s(n, c) - n * cost.prefill_per_token_s
    assert attn(1000) == pytest.approx(1e-8 * 1000 * 500)
    assert attn(2000) == pytest.approx(4 * attn(1000))  # quadratic from scratch
    assert attn(100, 10_000) == pytest.approx(1e-8 * 100 * (10_000 + 50))  # linear in cache
    # The simulator charges it: one call alone, prefill then C decode steps.
    r = simulate([[Execution("e", 0, (Call(8000, C, 0.0, 8000),), 1e9)]], 1, "colocate", cost)
    assert r.outcomes["e"][2] == pytest.approx(
        cost.prefill_s(8000) + C * cost.decode_step_s(1, 8000 + C / 2)
    )


def test_decode_batch_is_every_resident_request_not_a_slot_cap():
    n = 100  # beyond the old fixed 64 slots
    steps = [[Execution(f"e{i}", 0, (Call(P, C, 0.0, P),), 1e9) for i in range(n)]]
    r = simulate(steps, 1, "colocate", dataclasses.replace(PLAIN, kv_capacity_tokens=1e7))
    assert r.counters["mean_decode_batch"] == pytest.approx(n)  # prefills first, then all decode
    end = n * P * PLAIN.prefill_per_token_s + C * PLAIN.decode_step_s(n, n * (P + C / 2))
    assert max(o[2] for o in r.outcomes.values()) == pytest.approx(end)
    # A pool of 40 contexts: 40 decode together at most, the rest wait for room.
    r = simulate(steps, 1, "colocate", dataclasses.replace(PLAIN, kv_capacity_tokens=40 * (P + C)))
    assert 20 < r.counters["mean_decode_batch"] <= 40 + 1e-9


def test_mixed_chunked_prefill_runs_alongside_decode():
    # e0: short prompt, long completion; e1: a 4-chunk prompt admitted behind e0's prefill.
    e0 = Execution("e0", 0, (Call(64, 1000, 0.0, 64),), 1e9)
    e1 = Execution("e1", 0, (Call(4096, 10, 0.0, 4096),), 1e9)
    cost = dataclasses.replace(PLAIN, mixed_chunk=1024)
    r = simulate([[e0, e1]], 1, "colocate", cost)
    pt, d = cost.prefill_per_token_s, cost.decode_step_s
    d0, d2 = d(1, 64 + 500), d(2, 64 + 500 + 4096 + 5)
    t_e1 = 64 * pt + 4 * (d0 + 1024 * pt) + 10 * d2  # e0 decodes 4 tokens during e1's prefill
    assert r.outcomes["e1"][2] == pytest.approx(t_e1)
    assert r.outcomes["e0"][2] == pytest.approx(t_e1 + (1000 - 4 - 10) * d0)


def run_until(sim, t):
    sim._decide()
    while sim.events and sim.events[0][0] < t:
        sim._pop()


@pytest.mark.parametrize("migrate", [True, False])
def test_a_cell_leaving_rollout_hands_over_its_idle_contexts(migrate):
    # 2 cells, 4 executions: two contexts per cell sit idle in a 1000 s tool wait when cell 1
    # leaves rollout. Migration moves them (bytes / link); re-prefill drops them.
    steps = [[two_calls(f"e{i}") for i in range(4)]]
    cost = dataclasses.replace(PLAIN, handover_migrate=migrate, switch_r2t_s=1.0)
    sim = Simulator(steps, 2, "colocate", cost)
    run_until(sim, 500.0)
    assert [len(c.idle) for c in sim.cells] == [2, 2]
    sim._switch(sim.cells[1], TRAIN)
    moved = 2 * (P + C)
    switch_end = max(e[0] for e in sim.events if isinstance(e[2], Switched))
    extra = moved * cost.kv_bytes_per_token / cost.link_bytes_per_s if migrate else 0.0
    assert switch_end == pytest.approx(sim.t + 1.0 + extra)
    r = sim.run()  # colocate brings the cell back; nothing is lost
    assert r.end_counts == {f"e{i}": 1 for i in range(4)}
    for i in range(4):
        assert r.outcomes[f"e{i}"][3] == pytest.approx(steps[0][i].train_tokens)
    if migrate:
        assert r.counters["migrated_tokens"] == moved and r.counters["reprefill_tokens"] == 0
    else:
        assert r.counters["dropped_contexts"] == 2 and r.counters["reprefill_tokens"] == moved


def test_live_requests_migrate_with_their_kv_and_continue():
    steps = [[Execution(f"e{i}", 0, (Call(P, 5000, 0.0, P),), 1e9) for i in range(2)]]
    cost = dataclasses.replace(PLAIN, handover_migrate=True)
    sim = Simulator(steps, 2, "colocate", cost)
    run_until(sim, 1.0)  # both decoding, one per cell
    sim._switch(sim.cells[1], TRAIN)
    assert len(sim.cells[0].active) == 2 and sim.counters["migrated_contexts"] == 1
    r = sim.run()
    assert r.counters["reprefill_tokens"] == 0
    assert all(o[3] == pytest.approx(P + 5000) for o in r.outcomes.values())


def test_rollout_cells_pause_to_load_new_weights():
    # async 1 train / 1 rollout cell, staleness 1: step 1's long execution decodes while
    # step 0 is trained and published, so it pauses once for the load.
    steps = [
        [Execution("s0", 0, (Call(100, 10, 0.0, 100),), 1e9)],
        [Execution("s1", 1, (Call(100, 20_000, 0.0, 100),), 1e9)],
    ]
    base = dataclasses.replace(PLAIN, kv_capacity_tokens=1e6)
    p = PolicyParams(async_rollout_cells=1, max_staleness=1)
    fast = simulate(steps, 2, "async", base, p)
    slow = simulate(steps, 2, "async", dataclasses.replace(base, weight_load_s=7.0), p)
    assert fast.step_end_s[0] < fast.outcomes["s1"][2]  # published mid-decode
    assert slow.outcomes["s1"][2] - fast.outcomes["s1"][2] == pytest.approx(7.0)
    assert slow.makespan_s - fast.makespan_s == pytest.approx(7.0)


def test_training_cost_grows_with_context_and_reduction_with_train_cells():
    assert [MEM.allreduce_s(n) for n in (1, 2, 4)] == pytest.approx([0.0, 1.5, 2.25])
    call = Call(P, C, 0.0, P)
    tokens = P + C
    ctx = P * (P / 2) + C * (P + C / 2)  # each token's context: its call's mid-point
    cost = dataclasses.replace(PLAIN, train_per_ctx_token_s=1e-7, reduce_s=3.0,
                               microbatch_tokens=tokens // 3 + 1, microbatch_s=0.5)  # fmt: skip
    r = simulate([[Execution("e", 0, (call,), 1e9)]], 3, "colocate", cost)
    rollout = P * cost.prefill_per_token_s + C * cost.decode_step_s(1, P + C / 2)
    mb = tokens // 3 + 1
    mbs = [mb, mb, tokens - 2 * mb]  # three micro-batches, one per cell, in parallel
    train = max(cost.train_s(m, m * ctx / tokens) for m in mbs)
    expected = rollout + train + cost.allreduce_s(3) + cost.step_overhead_s
    assert r.step_end_s[0] == pytest.approx(expected)
    assert cost.train_s(10, 1e6) == pytest.approx(0.5 + 10 * cost.train_per_token_s + 0.1)


def test_cell_memory_from_model_and_hardware():
    kv = kv_bytes_per_token(layers=48, kv_heads=4, head_dim=128, dtype_bytes=2)
    assert kv == 98_304  # the 122B calibration's figure
    mem = CellMemory(device_bytes=141e9, devices=8, weight_bytes=244e9, kv_bytes_per_token=kv,
                     reserve_fraction=0.1)  # fmt: skip
    assert mem.kv_tokens == pytest.approx((8 * 141e9 * 0.9 - 244e9) / kv)
    with pytest.raises(ValueError, match="no KV pool"):
        _ = dataclasses.replace(mem, weight_bytes=2e12).kv_tokens
    # A call larger than a cell's pool could never run: refused up front.
    with pytest.raises(ValueError, match="could never run"):
        simulate(
            [[two_calls("e")]], 1, "colocate", dataclasses.replace(PLAIN, kv_capacity_tokens=500)
        )


def test_replication_scales_memory_like_the_other_costs():
    rep = dataclasses.replace(MEM, kv_capacity_tokens=1.6e6, mixed_chunk=8192).replicated(16)
    assert rep.kv_capacity_tokens == pytest.approx(1e5) and rep.mixed_chunk == 512
    assert rep.kv_bytes_per_token == 16 * MEM.kv_bytes_per_token
    assert rep.prefill_s(100, 1000) == pytest.approx(16 * MEM.prefill_s(100, 1000))
    assert rep.train_s(100, 5e4) == pytest.approx(
        16 * MEM.train_s(100, 5e4) - 15 * MEM.microbatch_s
    )
