"""The real entry point: smoke and harness experiments in-process, flag errors in a subprocess."""

import json
import os
import subprocess
import sys

import pytest

import experiments.harness_ledger as harness_ledger
import experiments.smoke as smoke
from gyre import run
from gyre.config import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_smoke_experiment_moves_weights_exactly(tmp_path):
    summary = run.main(smoke.get_config(), str(tmp_path))
    assert summary["moved_equal"] and summary["cells"] == 4
    assert summary["loss"] > 0 and summary["grad_norm"] > 0
    resolved = json.load(open(tmp_path / "config.json"))
    assert resolved["run"]["entry"] == "smoke" and resolved["mesh"]["cell_size"] == 2
    assert json.load(open(tmp_path / "summary.json"))["moved_equal"] is True


@pytest.mark.slow
def test_harness_experiment_reports_every_ending(tmp_path):
    cfg = harness_ledger.get_config("8")
    summary = run.main(cfg, str(tmp_path))
    assert summary["executions"] == cfg.run.tasks_per_step * cfg.run.samples_per_task
    assert {"success", "failure", "timeout", "infra_error"} <= set(summary["end_reasons"])
    assert summary["flat_tokens"] >= summary["unique_tokens"] > 0


def test_unknown_entry_is_a_config_error():
    with pytest.raises(ConfigError, match="run.entry"):
        run.resolve_entry("nope")


def _launch(*flags):
    return subprocess.run(
        [sys.executable, "launch.py", *flags], cwd=ROOT, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize(
    "flag,needle",
    [
        ("--config.train.lrr=3e-4", "lrr"),
        ("--config.mesh.cell_size=3", "mesh.cell_size"),
        ("--config.train.lr=fast", "lr"),
        ("--config=experiments/quickstart.py:colocat", "unknown quickstart variant 'colocat'"),
        ("--config.train.rows_per_microbatch=-1", "train.rows_per_microbatch"),
        ("--config.trajectory.row_len=-128", "trajectory.row_len"),
        ("--config.model.num_kv_heads=0", "model.num_kv_heads"),
        # smoke's model (vocabulary 64) cannot serve the ledger (28): checked before writing
        ("--config.run.entry=sft", "model.vocab_size"),
    ],
)
def test_bad_flags_stop_with_a_message_naming_the_key(tmp_path, flag, needle):
    out = _launch("--config=experiments/smoke.py", f"--workdir={tmp_path}", flag)
    assert out.returncode != 0
    assert needle in out.stderr.strip().splitlines()[-1]
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "config.json").exists()  # nothing written for a bad config
    assert not (tmp_path / "summary.json").exists()


def test_missing_config_file_and_unwritable_workdir_are_one_line(tmp_path):
    out = _launch("--config=experiments/nope.py", f"--workdir={tmp_path}")
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "experiments/nope.py" in out.stderr.strip().splitlines()[-1]
    blocked = tmp_path / "file"
    blocked.write_text("")
    out = _launch("--config=experiments/smoke.py", f"--workdir={blocked}/run")
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith("workdir error:")


def test_an_unexpected_error_is_one_line_with_the_traceback_kept(tmp_path, monkeypatch):
    import gyre.rl.experiment as experiment

    def exploding(cfg, workdir):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(experiment, "smoke_test", exploding)
    with pytest.raises(SystemExit) as exit_info:
        run.main(smoke.get_config(), str(tmp_path))
    message = str(exit_info.value.code)
    assert message.startswith("error: RuntimeError: boom (traceback in") and "\n" not in message
    assert "second line" in (tmp_path / "error.txt").read_text()
