"""The quick start teaches: from the shipped warm start, its RL steps raise held-out success by
more than two standard errors, and the elastic scheduler hands live requests over."""

import json

import pytest

import experiments.quickstart as quickstart
from gyre import run


@pytest.mark.slow
def test_quickstart_learns_and_hands_requests_over(tmp_path, capsys):
    cfg = quickstart.get_config()  # the README's run, with its own compilation cache
    cfg.mesh.cache_dir = str(tmp_path / "xla")
    summary = run.main(cfg, str(tmp_path))
    out = capsys.readouterr().out
    start, end = summary["eval_start"], summary["eval_end"]
    a = summary["eval_start_outcomes"]["eval_success"]
    b = summary["eval_end_outcomes"]["eval_success"]
    assert len(a) == len(b) == 256
    from gyre.rl.report import change_se

    se = change_se(start, end, "eval_success", (summary["eval_start_outcomes"],
                                                summary["eval_end_outcomes"]))  # fmt: skip
    assert end["eval_success"] - start["eval_success"] > 2 * se > 0, (start, end, se)
    assert sum(summary["handovers"].values()) >= 1 and summary["switches"] >= 1
    assert "held-out success" in out and "live requests handed over" in out
    assert json.load(open(tmp_path / "summary.json"))["finished"] is True
