"""Calibration fitting and the simulator's CPU options, on synthetic data only (no timing)."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.elastic import calibration
from gyre.elastic.sim import CostModel, shared_clock, simulate
from gyre.elastic.workload import Call, Execution

COST = CostModel(
    decode_base_s=0.01,
    decode_per_seq_s=0.001,
    decode_per_ctx_token_s=0.0,
    prefill_per_token_s=0.0001,
    train_per_token_s=0.0002,
    switch_r2t_s=0.0,
    switch_t2r_s=0.0,
    slots=8,
    microbatch_tokens=256,
)


def batch(step: int, n: int, calls: int = 2, group_size: int = 1) -> list[Execution]:
    call = Call(prompt_tokens=40, completion_tokens=10, tool_latency_s=0.0, new_prompt_tokens=40)
    return [
        Execution(f"s{step}-e{i}", step, (call,) * calls, 1e6, group=i // group_size)
        for i in range(n)
    ]


def busy_sum(res) -> float:
    return sum(t1 - t0 for _, t0, t1, _, state in res.timeline if state != "idle")


def test_shared_clock_sums_overlapping_work_and_keeps_gaps():
    wall = shared_clock([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)])
    assert wall(1.0) == pytest.approx(1.0)
    assert wall(2.0) == pytest.approx(3.0)  # two units shared [1, 2]
    assert wall(3.0) == pytest.approx(4.0)
    assert wall(5.0) == pytest.approx(6.0)  # the gap runs at wall speed
    assert wall(7.0) == pytest.approx(8.0)
    with pytest.raises(ValueError, match="start <= end"):
        shared_clock([(2.0, 1.0)])


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 50), st.floats(0, 10)), min_size=1, max_size=8))
def test_shared_clock_of_overlapping_intervals_is_their_total(spans):
    busy = [(a, a + d) for a, d in spans]
    end = max(t1 for _, t1 in busy)
    covered = shared_clock([(0.0, end)] + busy)(end)  # one unit spans it all: no gaps
    total = end + sum(d for _, d in spans)
    # Everything that overlaps the spanning unit adds its length; nothing else adds time.
    assert covered == pytest.approx(total, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("policy", ["colocate", "elastic"])
def test_shared_cores_makespan_is_the_serial_sum_of_work(policy):
    steps = [batch(s, 12) for s in range(2)]
    cost = dataclasses.replace(COST, optimizer_s=0.05, checkpoint_s=0.1)
    par = simulate(steps, 3, policy, cost)
    ser = simulate(steps, 3, policy, dataclasses.replace(cost, shared_cores=True))
    # Tool latency 0: no cell ever waits on the wall clock, so serial time = all work done.
    assert ser.makespan_s == pytest.approx(busy_sum(par) + 2 * 0.15, rel=1e-9)
    assert ser.makespan_s > par.makespan_s
    assert len(ser.step_end_s) == 2 and ser.step_end_s[-1] == pytest.approx(ser.makespan_s)
    one = simulate(steps, 1, policy, cost)
    one_ser = simulate(steps, 1, policy, dataclasses.replace(cost, shared_cores=True))
    assert one_ser.makespan_s == pytest.approx(one.makespan_s)  # one cell: nothing to share


def test_chunked_prefill_costs_whole_chunks_and_at_least_one():
    cost = dataclasses.replace(COST, prefill_chunk=64, prefill_call_s=0.002)
    assert cost.prefill_s(0) == pytest.approx(0.002 + 64 * 1e-4)
    assert cost.prefill_s(64) == pytest.approx(0.002 + 64 * 1e-4)
    assert cost.prefill_s(65) == pytest.approx(0.002 + 128 * 1e-4)
    assert COST.prefill_s(65) == pytest.approx(65 * 1e-4)  # default: per token, no call cost


def test_chunked_prefill_samples_the_first_token():
    # One call, alone on one cell: prefill, then completion - 1 decode steps of one request.
    steps = [batch(0, 1, calls=1)]
    cost = dataclasses.replace(COST, prefill_chunk=64)
    res = simulate(steps, 1, "colocate", cost)
    rollout = res.step_end_s[0] - 0.0 - 10 * COST.train_per_token_s * 5  # minus 50 tokens train
    assert rollout == pytest.approx(64 * 1e-4 + 9 * cost.decode_step_s(1, 45.0), rel=1e-6)
    assert res.outcomes["s0-e0"][3] == pytest.approx(50.0)  # 40 prompt + 10 completion tokens


def test_pack_by_group_cuts_micro_batches_per_task_group():
    steps = [batch(0, 8, group_size=2)]  # 4 groups of 2 executions, 200 tokens per group
    cost = dataclasses.replace(
        COST, train_per_token_s=0.0, microbatch_s=0.5, microbatch_tokens=1024
    )
    train_busy = lambda r: sum(
        t1 - t0 for _, t0, t1, role, s in r.timeline if role == "train" and s == "busy"
    )
    streamed = simulate(steps, 2, "colocate", cost)
    grouped = simulate(steps, 2, "colocate", dataclasses.replace(cost, pack_by_group=True))
    assert train_busy(streamed) == pytest.approx(1 * 0.5)  # 800 tokens fill one micro-batch
    assert train_busy(grouped) == pytest.approx(4 * 0.5)  # one per group
    small = dataclasses.replace(cost, pack_by_group=True, microbatch_tokens=64)
    assert train_busy(simulate(steps, 2, "colocate", small)) == pytest.approx(4 * 4 * 0.5)


def test_fit_with_intercepts_recovers_fixed_costs_and_medians():
    truth = dataclasses.replace(COST, prefill_call_s=0.003, microbatch_s=0.02)
    meas = calibration.measurements(truth)
    for row in meas["prefill"]:
        row["seconds"] += truth.prefill_call_s
    for row in meas["train"]:
        row["seconds"] += truth.microbatch_s
    meas["intercepts"] = True
    meas["step"] = [
        {"optimizer_s": x, "publish_s": 0.001, "checkpoint_s": 3 * x} for x in (0.1, 0.2, 9.0)
    ]
    meas["switch"] = [{"seconds": x} for x in (0.004, 0.002, 0.003)]
    cost = calibration.fit(meas)
    for name in ("prefill_call_s", "prefill_per_token_s", "microbatch_s", "train_per_token_s"):
        assert getattr(cost, name) == pytest.approx(getattr(truth, name), rel=1e-6), name
    assert cost.optimizer_s == pytest.approx(0.2)  # the median ignores the 9 s outlier
    assert cost.checkpoint_s == pytest.approx(0.6) and cost.publish_s == pytest.approx(0.001)
    assert cost.switch_r2t_s == cost.switch_t2r_s == pytest.approx(0.003)


def test_fit_with_intercepts_clips_a_negative_slope_to_a_flat_cost():
    meas = calibration.measurements(COST)
    meas["intercepts"] = True
    meas["train"] = [{"tokens": 256, "seconds": 0.03}, {"tokens": 1024, "seconds": 0.02}]
    cost = calibration.fit(meas)
    assert cost.train_per_token_s == 0.0 and cost.microbatch_s == pytest.approx(0.025)


def test_cpu_calibration_file_loads_with_its_source():
    cost = calibration.load("cpu_measured")
    assert "calibrate_cpu.py" in cost.source
    assert cost.shared_cores and cost.prefill_chunk > 0 and cost.decode_base_s > 0
    assert cost.microbatch_s > 0 and cost.checkpoint_s > 0


def test_fit_run_recovers_a_known_model_from_run_timings():
    truth = dataclasses.replace(
        COST, prefill_chunk=64, decode_per_ctx_token_s=1e-6, train_per_token_s=0.0,
        prefill_call_s=0.002, microbatch_s=0.03, checkpoint_s=0.2,
    )  # fmt: skip
    engine_steps, steps = [], []
    for s in range(4):
        engine_s = 0.0
        for b, chunks in ((1, 0), (3, 0), (8, 0), (2, 1), (5, 3), (0, 2)):
            ctx = 40.0 * b + 100.0 * s  # independent of the batch across steps
            t = chunks * 64 * truth.prefill_per_token_s
            t += truth.decode_step_s(b, ctx) if b else 0.0
            engine_steps.append({"step": s, "chunks": chunks, "batch": b, "context_tokens": ctx,
                                 "seconds": t})  # fmt: skip
            engine_s += t
        calls, mbs = 6 + s, 4
        train_s = mbs * truth.microbatch_s
        wall = engine_s + train_s + truth.checkpoint_s + calls * truth.prefill_call_s
        steps.append({"wall_s": wall, "engine_s": engine_s, "train_s": train_s,
                      "checkpoint_s": truth.checkpoint_s, "microbatches": mbs, "calls": calls})  # fmt: skip
    base = dataclasses.replace(truth, decode_base_s=9.0, microbatch_s=9.0, prefill_per_token_s=9.0)
    cost = calibration.fit_run(engine_steps, steps, base, "test")
    for name in ("decode_base_s", "decode_per_seq_s", "decode_per_ctx_token_s",
                 "prefill_per_token_s", "prefill_call_s", "microbatch_s", "checkpoint_s"):  # fmt: skip
        assert getattr(cost, name) == pytest.approx(getattr(truth, name), rel=1e-6), name
    assert cost.slots == truth.slots and cost.source == "test"


def test_fit_run_names_what_it_lacks():
    base = dataclasses.replace(COST, prefill_chunk=64)
    step = {"wall_s": 1, "engine_s": 0, "train_s": 0, "checkpoint_s": 0, "microbatches": 0,
            "calls": 1}  # fmt: skip
    one = [{"step": 1, "chunks": 0, "batch": 1, "context_tokens": 5.0, "seconds": 0.01}]
    with pytest.raises(ValueError, match="at least 3 pure decode steps"):
        calibration.fit_run(one, [step], base, "x")
    with pytest.raises(ValueError, match="prefill_chunk"):
        calibration.fit_run(one * 3, [step], COST, "x")
    with pytest.raises(ValueError, match="needs engine steps"):
        calibration.fit_run([], [step], base, "x")


@pytest.mark.parametrize("prompt,max_new,max_len", [(21, 12, 256), (250, 12, 256), (5, 1, 8)])
def test_engine_pool_reserves_the_engine_footprint(prompt, max_new, max_len):
    """engine_pool: a call reserves what the engine's admission rule reserves."""
    import numpy as np

    from gyre.elastic.sim import Simulator
    from gyre.rollout.engine import footprint
    from gyre.rollout.types import GenerateRequest

    call = Call(prompt, 3, 0.0, prompt)
    cost = dataclasses.replace(COST, kv_capacity_tokens=1e6)
    sim = Simulator([[Execution("e", 0, (call,), 1e6)]], 1, "colocate", cost,
                    engine_pool=(max_new, max_len))  # fmt: skip
    req = GenerateRequest("e", 0, np.zeros(prompt, np.int32), max_new)
    assert sim._need(call) == footprint(req, max_len)


def test_engine_pool_hand_case():
    """One cell, a pool of two footprints (P 21 + 12 new - 1 = 32): three one-call executions a
    step. Two run, finish as idle contexts (21 + 12 - 1 = 32 each); the third is admitted and
    one idle context is evicted (LRU) to fit. New weights clear the rest: one eviction a step.
    The simulator's own rule (reserve P + completion = 33) would run them one at a time."""
    call = Call(21, 12, 0.0, 21)
    steps = [[Execution(f"s{s}-e{i}", s, (call,), 1e6, group=i) for i in range(3)]
             for s in range(2)]  # fmt: skip
    cost = dataclasses.replace(COST, kv_capacity_tokens=64.0)
    res = simulate(steps, 1, "colocate", cost, engine_pool=(12, 256))
    assert res.counters["evictions"] == 2
    assert res.counters["reprefill_tokens"] == 0  # no evicted execution comes back
