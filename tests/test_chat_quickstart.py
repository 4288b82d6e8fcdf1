"""The chat quick start teaches: from the shipped warm start (a tiny Qwen3-shaped model with its
own tokenizer and Qwen3's chat template), RL on the calculator task raises held-out success by
more than two standard errors, with rewards and gradients at every step, tool calls counted in
the metrics and shown in executions.txt."""

import json

import pytest

import experiments.chat_quickstart as chat_quickstart
from gyre import run
from gyre.metrics import read_metrics
from gyre.rl.report import change_se

pytestmark = pytest.mark.slow


def _run(tmp_path, variant):
    cfg = chat_quickstart.get_config(variant)
    cfg.mesh.cache_dir = str(tmp_path / "xla")
    return run.main(cfg, str(tmp_path))


def test_chat_quickstart_learns_to_use_the_calculator(tmp_path):
    summary = _run(tmp_path, "")  # the README's run: 10 steps, 256 held-out tasks
    start, end = summary["eval_start"], summary["eval_end"]
    outcomes = (summary["eval_start_outcomes"], summary["eval_end_outcomes"])
    se = change_se(start, end, "eval_success", outcomes)
    assert end["eval_success"] - start["eval_success"] > 2 * se > 0, (start, end, se)
    assert end["eval_tool_use"] > start["eval_tool_use"]  # what RL learned: call the tool
    rows = read_metrics(str(tmp_path))
    assert all(r["tool_calls"] > 0 and r["reward"] > 0 and r["grad_norm"] > 0 for r in rows)
    text = (tmp_path / "executions.txt").read_text()
    assert "<tool_call>" in text and '"name": "calculator"' in text and "tool calls: 1 run" in text
    assert json.load(open(tmp_path / "summary.json"))["finished"] is True
