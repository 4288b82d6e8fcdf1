"""The checker of scripts/kill_run.py (a run killed at random points loses nothing): it finds
every kind of loss and duplication in metrics, ledger and trace, and ignores only what measures
time. The run itself: ``python scripts/kill_run.py`` (BENCH_36.md has its figures)."""

import copy
import json
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "scripts"))  # fmt: skip
import kill_run  # noqa: E402

STEPS = 3


def _run():
    """A 3-step run's files as the checker reads them: 2 executions a step."""
    metrics = [{"step": s, "time": 10.0 * s, "reward": 0.5 * s, "loss": -1e-9 * s,
                "grad_norm": 0.1 + s, "step_seconds": 1.0, "kv_admissions": 3,
                "role_train_frac": 0.3, "version": s} for s in range(1, STEPS + 1)]  # fmt: skip
    ledger = [{"step": s, "executions": [f"e{s}a", f"e{s}b"], "groups": [[s, 0]]}
              for s in range(STEPS)]  # fmt: skip
    trace = [{"execution_id": e, "step": row["step"], "group": 0,
              "calls": [{"prompt_tokens": 5, "completion_tokens": 3, "tool_latency_s": 0.01}],
              "measured": {"start_s": 1.0, "end_s": 2.0, "end_reason": "failure"}}
             for row in ledger for e in row["executions"]]  # fmt: skip
    return {"metrics.jsonl": metrics, "ledger.jsonl": ledger, "trace.jsonl": trace}


def _write(path, files, raw=None):
    os.makedirs(path, exist_ok=True)
    for name, rows in files.items():
        with open(os.path.join(path, name), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
            if raw and name in raw:
                f.write(raw[name])


def _check(tmp_path, change=None, raw=None):
    ref, got = _run(), _run()
    if change:
        change(got)
    _write(tmp_path / "ref", ref)
    _write(tmp_path / "got", got, raw)
    return kill_run.compare(str(tmp_path / "ref"), str(tmp_path / "got"), STEPS)["problems"]


def test_the_same_run_with_other_times_passes(tmp_path):
    def retime(files):
        for r in files["metrics.jsonl"]:
            r.update(time=r["time"] + 7, step_seconds=3.5, kv_admissions=9, role_train_frac=0.9)
        for t in files["trace.jsonl"]:
            t["measured"] = {"start_s": 5.0}
            t["calls"][0]["tool_latency_s"] = 0.7
        files["trace.jsonl"].reverse()  # lines of a step in another order: the same trace

    assert _check(tmp_path, retime) == []
    out = kill_run.compare(str(tmp_path / "ref"), str(tmp_path / "got"), STEPS)
    assert (out["metrics_rows"], out["ledger_lines"], out["trace_lines"]) == (3, 3, 6)
    assert "time" in out["fields_skipped"] and "loss" not in out["fields_skipped"]


LOSSES = {
    "a lost metrics row": (lambda f: f["metrics.jsonl"].pop(1), "metrics.jsonl: steps [2] lost"),
    "a metrics row twice": (lambda f: f["metrics.jsonl"].insert(1, f["metrics.jsonl"][1]),
                            "metrics.jsonl: steps [2] written more than once"),
    "a lost ledger line": (lambda f: f["ledger.jsonl"].pop(), "ledger.jsonl: steps [2] lost"),
    "a ledger line twice": (lambda f: f["ledger.jsonl"].append(f["ledger.jsonl"][0]),
                            "ledger.jsonl: steps [0] written more than once"),
    "a lost trace line": (lambda f: f["trace.jsonl"].pop(3), "trained executions not traced"),
    "a trace line twice": (lambda f: f["trace.jsonl"].append(f["trace.jsonl"][0]),
                           "traced more than once"),
    "an execution trained by another step": (
        lambda f: f["ledger.jsonl"][1]["executions"].__setitem__(0, "e0a"),
        "an execution trained twice"),
    "a loss one bit off": (lambda f: f["metrics.jsonl"][2].update(
        loss=math.nextafter(f["metrics.jsonl"][2]["loss"], 0.0)),
                           "metrics.jsonl step 3: ['loss'] differ"),
    "a field missing": (lambda f: f["metrics.jsonl"][0].pop("reward"),
                        "metrics.jsonl step 1: ['reward'] differ"),
    "other tokens in a trace": (
        lambda f: f["trace.jsonl"][4]["calls"][0].update(completion_tokens=4),
        "trace.jsonl step 2 e2a: differs"),
}  # fmt: skip


@pytest.mark.parametrize("what", sorted(LOSSES))
def test_every_loss_or_duplicate_is_found(tmp_path, what):
    change, want = LOSSES[what]
    problems = _check(tmp_path, change)
    assert any(want in p for p in problems), problems


def test_a_line_cut_short_is_found_not_skipped(tmp_path):
    problems = _check(tmp_path, raw={"metrics.jsonl": '{"step": 4, "rew'})
    assert problems == ["killed metrics.jsonl line 4 is not JSON"]


def test_the_kill_plan_is_seeded_and_hits_resumes():
    a, b = kill_run.plan(0, 12, 40, 3), kill_run.plan(0, 12, 40, 3)
    assert a == b and a != kill_run.plan(1, 12, 40, 3)
    assert {k for k, _ in a[1::3]} <= {"restore", "rewrite"}  # every third is in a resume
    assert all(0 < w for _, w in a)
    assert copy.deepcopy(a) == a
