"""The evaluation entry (``launch.py --mode=eval``): the held-out evaluation of a workdir's
latest checkpoint prints the same held-out lines as the end of the run that made it, writes
only eval.json, and with no checkpoint evaluates ``model.hf_dir`` (e.g. an exported hf/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gyre.rl.report import eval_table, summary_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _launch(workdir, cache, *extra):
    args = [sys.executable, "launch.py", "--config=experiments/quickstart.py:tiny",
            f"--workdir={workdir}", "--config.mesh.cell_size=4",
            f"--config.mesh.cache_dir={cache}", "--config.eval.tasks=8",
            "--config.eval.temperature=1.0", *extra]  # fmt: skip
    out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def _held_out(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith(("held-out", "evaluation "))]


def test_eval_table_has_the_run_tables_held_out_lines():
    start = {"eval_success": 0.5, "eval_success_se": 0.1, "eval_milestones": 0.6,
             "eval_milestones_se": 0.05, "eval_tasks": 4}  # fmt: skip
    end = dict(start, eval_success=0.75)
    outcomes = ({"eval_success": [1, 0, 1, 0]}, {"eval_success": [1, 1, 1, 0]})
    summary = dict(name="x", steps=2, scheduler="elastic", eval_start=start, eval_end=end,
                   eval_start_outcomes=outcomes[0], eval_end_outcomes=outcomes[1],
                   eval_temperature=1.0)  # fmt: skip
    ran = summary_table(summary)
    again = eval_table(dict(summary, evaluated="the checkpoint after step 2"))
    assert _held_out(again) == _held_out(ran) and len(_held_out(ran)) == 3
    alone = eval_table({"name": "x", "evaluated": "hf", "eval_end": end})
    assert "held-out success     75.0% ± 10.0%" in alone and "->" not in alone


@pytest.mark.slow
def test_eval_mode_reproduces_a_finished_runs_final_table(tmp_path, xla_cache):
    work, cache = tmp_path / "run", xla_cache
    ran = _launch(work, cache)
    table = _held_out(ran.stdout)
    assert len(table) == 3 and "->" in table[0], ran.stdout[-2000:]
    kept = {n: (work / n).read_text() for n in ("config.json", "summary.json", "specs.json")}
    evaluated = _launch(work, cache, "--mode=eval")
    assert "evaluation of the checkpoint after step 2" in evaluated.stdout
    assert _held_out(evaluated.stdout) == table
    assert {n: (work / n).read_text() for n in kept} == kept  # the run's files are untouched
    result = json.loads((work / "eval.json").read_text())
    assert result["version"] == 2 and result["eval_end"]["eval_tasks"] == 8
    # no checkpoint in the workdir: the weights model.hf_dir names (none here: the initial
    # ones), evaluated alone
    fresh = _launch(tmp_path / "fresh", cache, "--mode=eval")
    assert "evaluation of the initial weights" in fresh.stdout
    assert "->" not in "".join(_held_out(fresh.stdout)) and _held_out(fresh.stdout)
