"""The notebooks' helpers (gyre/analysis.py) against brute-force references."""

import asyncio
import collections
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles import token_trie
from strategies import executions

from gyre import analysis
from gyre.elastic.workload import Call, Execution
from gyre.trajectory.tree import build_tree


def test_resolve_workdir_reads_the_env_var_and_anchors_relative_paths(monkeypatch, tmp_path):
    monkeypatch.delenv(analysis.WORKDIR_ENV, raising=False)
    assert analysis.resolve_workdir("workdirs/x") == f"{analysis.REPO_ROOT}/workdirs/x"
    monkeypatch.setenv(analysis.WORKDIR_ENV, str(tmp_path))
    assert analysis.resolve_workdir("workdirs/x") == str(tmp_path)


def test_workdir_problem_names_what_is_missing(tmp_path):
    assert "no workdir at" in analysis.workdir_problem(str(tmp_path / "nope"))
    assert "lacks trace.jsonl" in analysis.workdir_problem(str(tmp_path), ("trace.jsonl",))
    (tmp_path / "trace.jsonl").write_text("")
    assert analysis.workdir_problem(str(tmp_path), ("trace.jsonl",)) is None


def test_series_and_ending_counts():
    rows = [
        {"step": 0, "reward": 0.5, "end_success": 1, "end_timeout": 3, "applied": True},
        {"step": 1, "end_failure": 2, "applied": False},
        {"step": 2, "reward": 1.0, "end_success": 4},
    ]
    steps, values = analysis.series(rows, "reward")
    assert steps.tolist() == [0, 2] and values.tolist() == [0.5, 1.0]
    assert analysis.series(rows, "applied")[0].size == 0  # booleans are not a curve
    reasons, steps, counts = analysis.ending_counts(rows)
    assert reasons == ["failure", "success", "timeout"] and steps.tolist() == [0, 1, 2]
    assert counts.tolist() == [[0, 1, 3], [2, 0, 0], [0, 4, 0]]


def _execution(eid, step, calls, measured):
    c = tuple(Call(10, n, 0.0, 10 if i == 0 else 0) for i, n in enumerate(calls))
    return Execution(eid, step, c, 60.0, measured=measured)


def test_trace_table_and_measured_intervals():
    steps = [
        [_execution("a", 0, [3, 4], {"start_s": 1.0, "end_s": 2.5, "end_reason": "success"})],
        [_execution("b", 1, [5], None)],
    ]
    table = analysis.trace_table(steps)
    assert [(t["execution_id"], t["calls"], t["completion_tokens"]) for t in table] == [
        ("a", 2, 7),
        ("b", 1, 5),
    ]
    assert table[0]["seconds"] == 1.5 and table[0]["end_reason"] == "success"
    assert table[1]["seconds"] is None and table[1]["train_tokens"] == 15
    assert analysis.measured_intervals(steps) == [(1.0, 2.5)]


def test_read_timeline_sorts_and_drops_empty_spans(tmp_path):
    raw = [
        {"cell": 1, "role": "train", "start": 2.0, "end": 5.0},
        {"cell": 0, "role": "rollout", "start": 0.0, "end": 5.0},
        {"cell": 1, "role": "rollout", "start": 0.0, "end": 2.0},
        {"cell": 1, "role": "train", "start": 5.0, "end": 5.0},
    ]
    (tmp_path / "timeline.json").write_text(json.dumps(raw))
    spans = analysis.read_timeline(str(tmp_path))
    assert [(s.cell, s.start) for s in spans] == [(0, 0.0), (1, 0.0), (1, 2.0)]
    assert analysis.role_fractions(spans) == pytest.approx({"rollout": 0.7, "train": 0.3})


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), max_size=12))
def test_live_executions_counts_intervals_in_flight(pairs):
    intervals = [(float(min(a, b)), float(max(a, b))) for a, b in pairs]
    times, count = analysis.live_executions(intervals)
    assert np.all(np.diff(times) > 0)
    for t in np.arange(-0.5, 21, 0.5):  # between and at event times
        ref = sum(s <= t < e for s, e in intervals)
        i = np.searchsorted(times, t, side="right") - 1
        assert (count[i] if i >= 0 else 0) == ref, t


def test_rollout_busy_fraction_by_hand():
    spans = [analysis.Span(0, "rollout", 0.0, 10.0), analysis.Span(1, "rollout", 0.0, 4.0),
             analysis.Span(1, "train", 4.0, 10.0)]  # fmt: skip
    intervals = [(2.0, 3.0), (5.0, 6.0), (5.5, 7.0)]  # in flight during [2, 3) and [5, 7)
    assert analysis.rollout_busy_fraction(spans, intervals) == pytest.approx((3 + 1) / 14)
    assert analysis.rollout_busy_fraction(spans, []) == 0.0


def _prefixes(records):
    """Every node of the execution's trie as its chain of node ids from the root, brute force
    (oracles.token_trie: a node per distinct prefix and behaviour of its generated tokens)."""
    _, paths = token_trie(records)
    return {tuple(path[: j + 1]) for path in paths for j in range(len(path))}


@settings(max_examples=30, deadline=None)
@given(executions(max_calls=10))
def test_tree_shape_and_segments_match_the_brute_force_trie(records):
    tree = build_tree(records)
    nodes = _prefixes(records)
    leaves = [p for p in nodes if not any(q[: len(p)] == p and len(q) > len(p) for q in nodes)]
    kids = collections.Counter(p[:-1] for p in nodes if len(p) > 1)
    shape = analysis.tree_shape(tree)
    assert shape["nodes"] == len(nodes) and shape["paths"] == len(leaves)
    assert shape["flat_tokens"] == sum(len(p) for p in leaves)
    assert shape["max_depth"] == max(len(p) for p in leaves)
    assert shape["branch_nodes"] == sum(n > 1 for n in kids.values())
    assert shape["dup_ratio"] == pytest.approx(shape["flat_tokens"] / shape["nodes"])
    segs = analysis.path_segments(tree)
    assert segs[0].branch_depth == 0 and sorted(s.end_depth for s in segs) == sorted(
        len(p) for p in leaves
    )
    # each segment adds exactly the nodes no earlier path has, so together they tile the trie
    assert sum(s.end_depth - s.branch_depth for s in segs) == len(nodes)


@pytest.fixture(scope="module")
def scripted():
    results = analysis.scripted_executions(num_ops=12, tasks=2, samples=3, seed=1)
    return results, [build_tree(r.records) for r in results]


def test_scripted_executions_are_seeded_and_run_inside_an_event_loop(scripted):
    async def inside():  # a Jupyter kernel calls from a running loop
        return analysis.scripted_executions(num_ops=12, tasks=2, samples=3, seed=1)

    again = asyncio.run(inside())
    results, trees = scripted
    assert [[r.completion.tolist() for r in x.records] for x in again] == [
        [r.completion.tolist() for r in x.records] for x in results
    ]
    roles = {t.call_roles[c] for t in trees for c in t.leaf_calls}
    assert {"main", "main-summary", "sub-agent"} <= roles  # the mix makes branchy trees


def test_cap_effects_invariants(scripted):
    _, trees = scripted
    caps = analysis.cap_effects(trees, caps=(1, 2, 5, 0))
    total_paths = sum(len(t.leaf_calls) for t in trees)
    assert all(c["kept"] + c["dropped"] == total_paths for c in caps)
    one, *_, uncapped = caps
    assert one["kept"] == len(trees) and one["dup_ratio"] == 1.0  # one path: nothing shared
    assert uncapped["unique_tokens"] == sum(t.num_nodes for t in trees)
    assert uncapped["trained_share"] == 1.0
    unique = [c["unique_tokens"] for c in caps]
    share = [c["trained_share"] for c in caps]
    assert unique == sorted(unique) and share == sorted(share)


def test_packing_sweep_counts_positions_and_padding(scripted):
    results, trees = scripted
    sweep = analysis.packing_sweep(results, row_lens=(256, 1024), max_paths=5)
    cap5 = analysis.cap_effects(trees, caps=(5,))[0]
    by = {(s["row_len"], s["packing"]): s for s in sweep}
    for s in sweep:
        assert s["padding"] == pytest.approx(1 - s["positions"] / (s["rows"] * s["row_len"]))
        assert s["rejected"] == 0
    assert by[1024, "flat"]["positions"] == cap5["flat_tokens"]
    # no forest is split at 1024, so the tree rows hold each kept union exactly once
    assert by[1024, "tree"]["positions"] == cap5["unique_tokens"]
    assert by[1024, "tree"]["loss_tokens"] <= by[1024, "flat"]["loss_tokens"]


def test_replay_workdir_simulates_the_run_s_own_trace(tmp_path):
    from gyre.config import default_config
    from gyre.elastic.workload import WorkloadSpec, generate, write_trace
    from gyre.rl.builder import build_specs
    from gyre.rl.specs import to_json

    cfg = default_config()
    cfg.scheduler.policy = "colocate"
    (tmp_path / "specs.json").write_text(to_json(build_specs(cfg)))
    spans = [{"cell": c, "role": "rollout", "start": 0.0, "end": 1.0} for c in range(3)]
    (tmp_path / "timeline.json").write_text(json.dumps(spans))
    spec = WorkloadSpec(steps=2, queries_per_step=2, samples_per_query=2, mean_calls=3,
                        mean_completion_tokens=8, mean_observation_tokens=16, system_tokens=20,
                        mean_tool_latency_s=0.0, seed=3)  # fmt: skip
    steps = generate(spec)
    write_trace(str(tmp_path / "trace.jsonl"), steps)
    res = analysis.replay_workdir(str(tmp_path))
    assert res.policy == "colocate" and res.num_cells == 3
    ids = {ex.execution_id for step in steps for ex in step}
    assert set(res.end_counts) == ids and set(res.end_counts.values()) == {1}
    assert len(res.step_end_s) == 2 and res.makespan_s >= res.lower_bound_s
