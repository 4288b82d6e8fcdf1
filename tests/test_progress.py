"""Run bookkeeping: resume drops exactly the re-run steps' lines; the role time line continues
across a resume and counts only real switches."""

import json

from gyre.rl.progress import RoleTimeline, RunLedger


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _steps(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line]


def test_resume_keeps_the_first_steps_of_ledger_metrics_and_trace(tmp_path):
    # A kill after step 3's metrics row but before its checkpoint: the checkpoint holds
    # version 2, so step 3 is re-run; its ledger line (index 2) and row (step 3) must go.
    _write(tmp_path / "ledger.jsonl", [{"step": s, "executions": []} for s in range(3)])
    _write(tmp_path / "trace.jsonl", [{"step": s} for s in range(3)])
    _write(tmp_path / "metrics.jsonl", [{"step": s} for s in (1, 2, 3)])
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "cut sh')  # a line cut short by the kill
    RunLedger(str(tmp_path)).truncate(2)
    assert _steps(tmp_path / "ledger.jsonl") == [0, 1]
    assert _steps(tmp_path / "trace.jsonl") == [0, 1]
    assert _steps(tmp_path / "metrics.jsonl") == [1, 2]


def test_timeline_continues_after_a_resume_and_counts_real_switches(tmp_path):
    first = RoleTimeline(2)
    first.set_all("warmstart")
    first.set_all("rollout")
    first.switch(0, "switch")
    first.switch(0, "train")  # one real switch (rollout -> train), through a 'switch' span
    path = str(tmp_path / "timeline.json")
    first.save(path)
    saved = json.load(open(path))
    end = max(s["end"] for s in saved)

    again = RoleTimeline.load(path, 2)
    assert again.switches == first.switches == 1
    assert again.now() >= end  # new spans start where the saved ones ended
    again.switch(0, "rollout")
    assert again.switches == 2
    spans = again.to_json()
    assert spans[: len(saved)] == saved
    roles = {s["role"] for s in spans}
    assert roles >= {"warmstart", "rollout", "switch", "train"}
    fractions = again.fractions()
    assert "warmstart_frac" not in fractions and abs(sum(
        v for k, v in fractions.items() if k.endswith("_frac")) - 1.0) < 1e-9  # fmt: skip
