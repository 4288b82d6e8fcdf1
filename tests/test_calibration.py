"""Calibration fitting and the simulator's CPU options, on synthetic data only (no timing)."""

import dataclasses
import json

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
    # One cell shares its core only with the optimizer steps (which the parallel model lets
    # overlap the cell's own decoding once the policy returns it to rollout).
    assert one_ser.makespan_s == pytest.approx(busy_sum(one) + 2 * 0.15, rel=1e-9)
    assert one_ser.makespan_s >= one.makespan_s - 1e-9


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


# ---------------------------------------------------------------- decode-only calibrations


def decode_only(truth: CostModel, batches=(1, 2, 8, 32), contexts=(64, 1024)) -> dict:
    """A decode-only measured calibration, laid out as benchmarks/decode.py writes it."""
    rows = [
        {"batch": b, "context_tokens": b * (c + 40.0), "step_s": truth.decode_step_s(b, b * (c + 40.0)),
         "samples": 48, "context_per_seq": c, "round_spread": 0.1}
        for c in contexts for b in batches
    ]  # fmt: skip
    return {"source": "test", "kind": "measured", "base": "cpu_measured", "decode": rows,
            "fixed": {"slots": 32}}  # fmt: skip


def test_decode_only_calibration_takes_the_rest_from_its_base():
    truth = dataclasses.replace(COST, decode_per_ctx_token_s=2e-8)
    cost = calibration.from_dict(decode_only(truth))
    base = calibration.load("cpu_measured")
    for name in ("decode_base_s", "decode_per_seq_s", "decode_per_ctx_token_s"):
        assert getattr(cost, name) == pytest.approx(getattr(truth, name), rel=1e-6), name
    for name in ("prefill_per_token_s", "prefill_call_s", "microbatch_s", "train_per_token_s",
                 "optimizer_s", "checkpoint_s", "switch_r2t_s", "prefill_chunk", "shared_cores"):  # fmt: skip
        assert getattr(cost, name) == getattr(base, name), name
    assert cost.slots == 32 and base.slots != 32  # this file's fixed section wins
    assert cost.source == "test"


def test_a_section_present_beside_a_base_is_fitted_not_inherited():
    spec = decode_only(COST)
    spec["prefill"] = [{"tokens": 100, "seconds": 0.01}, {"tokens": 300, "seconds": 0.03}]
    cost = calibration.from_dict(spec)
    assert cost.prefill_per_token_s == pytest.approx(1e-4)
    assert cost.prefill_call_s == 0.0  # no intercepts: the base's fixed cost is not kept
    assert cost.train_per_token_s == calibration.load("cpu_measured").train_per_token_s


def test_decode_only_calibration_file_loads_by_path(tmp_path):
    path = tmp_path / "dec.json"
    path.write_text(json.dumps(decode_only(COST)))
    cost = calibration.load(str(path))
    for r in decode_only(COST)["decode"]:
        assert cost.decode_step_s(r["batch"], r["context_tokens"]) == pytest.approx(r["step_s"])


@settings(max_examples=40, deadline=None)
@given(
    st.lists(  # (batch, context tokens, longest context in parts of the sum, seconds)
        st.tuples(st.integers(1, 64), st.integers(0, 100_000), st.floats(0, 1),
                  st.floats(1e-4, 1e-1)),
        min_size=3, max_size=24,
    ),
    st.booleans(),
)  # fmt: skip
def test_decode_fit_is_the_non_negative_least_squares_fit(rows, with_max):
    """Reference: scipy's NNLS on the same design; ours is never negative and never worse.
    Contexts are whole token counts (a context of 1e-241 tokens made both solvers' designs
    singular); with_max adds the longest-context column."""
    import numpy as np
    from scipy import optimize

    raw = np.array(rows, float)
    cols = [raw[:, 0], raw[:, 1]] + ([np.round(raw[:, 1] * raw[:, 2])] if with_max else [])
    dec = np.column_stack([*cols, raw[:, 3]])
    design = np.column_stack([np.ones(len(dec)), dec[:, :-1]])
    coef = np.array(calibration._fit_decode(dec))
    assert coef.shape == (design.shape[1],) and np.all(coef >= 0)
    # Column scaling keeps the reference solver well conditioned; it does not change the optimum.
    scale = np.maximum(np.abs(design).max(0), 1.0)
    ref, _ = optimize.nnls(design / scale, dec[:, -1])
    sse = lambda c: float(np.sum((design @ c - dec[:, -1]) ** 2))  # noqa: E731
    assert sse(coef) <= sse(ref / scale) * (1 + 1e-6) + 1e-18


def test_decode_fit_keeps_the_plain_fit_when_it_is_non_negative():
    truth = dataclasses.replace(COST, decode_per_ctx_token_s=3e-9)
    meas = calibration.measurements(truth, noise=0.01, seed=3)
    import numpy as np

    dec = np.array([[r["batch"], r["context_tokens"], r["step_s"]] for r in meas["decode"]])
    plain, *_ = np.linalg.lstsq(
        np.column_stack([np.ones(len(dec)), dec[:, :2]]), dec[:, 2], rcond=None
    )
    assert np.all(plain > 0)
    assert calibration._fit_decode(dec) == pytest.approx(tuple(plain), rel=1e-9)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda r: r.pop("step_s"), r"'decode' row 2 lacks field 'step_s'"),
        (lambda r: r.pop("context_tokens"), r"'decode' row 2 lacks field 'context_tokens'"),
        (lambda r: r.update(step_s=-0.001), r"'decode' row 2 field 'step_s' must be >= 0"),
        (lambda r: r.update(context_tokens=-5), r"row 2 field 'context_tokens' must be >= 0"),
        (lambda r: r.update(step_s=float("nan")), r"row 2 field 'step_s' must be a finite"),
        (lambda r: r.update(step_s="fast"), r"row 2 field 'step_s' must be a finite"),
        (lambda r: r.update(batch=True), r"row 2 field 'batch' must be a finite"),
        (lambda r: r.update(batch=0), r"'decode' row 2 field 'batch' must be >= 1"),
    ],
)
def test_bad_decode_rows_are_named(change, message):
    spec = decode_only(COST)
    change(spec["decode"][2])
    with pytest.raises(ValueError, match=message):
        calibration.from_dict(spec)


def test_bad_decode_sections_and_bases_are_named(tmp_path):
    spec = decode_only(COST)
    spec["decode"] = {"batch": 1}
    with pytest.raises(ValueError, match="'decode' must be a list of rows"):
        calibration.from_dict(spec)
    spec["decode"] = [[1, 2, 3]]
    with pytest.raises(ValueError, match="'decode' row 0 must be an object"):
        calibration.from_dict(spec)
    spec = decode_only(COST)
    del spec["decode"]
    with pytest.raises(ValueError, match="no 'decode' measurements"):
        calibration.from_dict(spec)
    spec = decode_only(COST)
    del spec["base"]  # without a base, prefill and train must be measured here
    with pytest.raises(ValueError, match="no 'prefill' measurements"):
        calibration.from_dict(spec)
    spec["base"] = "no_such_calibration"
    with pytest.raises(ValueError, match="no calibration 'no_such_calibration'"):
        calibration.from_dict(spec)
    path = tmp_path / "loop.json"
    spec["base"] = str(path)  # a file that is its own base
    path.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="refers back to itself"):
        calibration.load(str(path))
    path.write_text("{not json")
    with pytest.raises(ValueError, match="loop.json: not valid JSON"):
        calibration.load(str(path))
    hw = {"source": "x", "kind": "hardware", "base": "cpu_measured"}
    with pytest.raises(ValueError, match="'base' is for measured calibrations only"):
        calibration.from_dict(hw)
    bad_row = decode_only(COST)
    bad_row["decode"][0]["step_s"] = -1.0
    path.write_text(json.dumps(bad_row))
    with pytest.raises(ValueError, match=r"loop.json: calibration 'decode' row 0 field 'step_s'"):
        calibration.load(str(path))


def test_a_longest_context_term_is_fitted_when_every_row_names_it():
    # An engine whose step follows the longest live context (live KV blocks): rows with mixed
    # contexts, so the sum and the longest differ; the fit recovers both terms exactly.
    truth = dataclasses.replace(COST, decode_per_ctx_token_s=2e-8,
                                decode_per_max_ctx_token_s=3e-6)  # fmt: skip
    rows = []
    for b, short, long in [(1, 64, 64), (4, 64, 1024), (8, 256, 256), (16, 64, 512),
                           (32, 512, 1024), (2, 128, 900), (12, 300, 300)]:  # fmt: skip
        ctx = (b - 1) * short + long
        rows.append({"batch": b, "context_tokens": ctx, "context_max": long,
                     "step_s": truth.decode_step_s(b, ctx, long)})  # fmt: skip
    spec = {"source": "test", "kind": "measured", "base": "cpu_measured", "decode": rows}
    cost = calibration.from_dict(spec)
    for name in ("decode_base_s", "decode_per_seq_s", "decode_per_ctx_token_s",
                 "decode_per_max_ctx_token_s"):  # fmt: skip
        assert getattr(cost, name) == pytest.approx(getattr(truth, name), rel=1e-6), name
    del rows[3]["context_max"]  # one row without it: the three-term fit, no longest term
    assert calibration.from_dict(spec).decode_per_max_ctx_token_s == 0.0


def test_the_simulator_charges_the_longest_live_context():
    # A short and a long call decode together on one cell; the step costs the longest live
    # context (1000 + 20 / 2 = 1010 tokens), so the short call takes 20 such steps.
    short = Call(prompt_tokens=10, completion_tokens=20, tool_latency_s=0.0, new_prompt_tokens=10)
    long = Call(prompt_tokens=1000, completion_tokens=20, tool_latency_s=0.0,
                new_prompt_tokens=1000)  # fmt: skip
    steps = [[Execution("short", 0, (short,), 1e6), Execution("long", 0, (long,), 1e6)]]
    flat = dataclasses.replace(COST, prefill_per_token_s=0.0, decode_per_seq_s=0.0,
                               decode_base_s=1e-3)  # fmt: skip
    by_max = dataclasses.replace(flat, decode_per_max_ctx_token_s=1e-4)
    assert by_max.decode_step_s(2, 1030, 1010) == pytest.approx(1e-3 + 1e-4 * 1010)
    ends = {}
    for name, cost in (("flat", flat), ("by_max", by_max)):
        out = simulate(steps, 1, "colocate", cost).outcomes
        ends[name] = {e: out[e][2] - out[e][1] for e in ("short", "long")}
    for e in ("short", "long"):
        assert ends["by_max"][e] - ends["flat"][e] == pytest.approx(20 * 1e-4 * 1010, rel=1e-6)
