"""The chat experiments end to end through launch.py on CPU: a tiny random-init Qwen3
directory with a local tokenizer, the chat layer, the sandboxed code task and reasoning-gym,
RL steps, the trained checkpoint exported in the layout it came in, and a resumed run."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # each test launches a run in a subprocess
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(config: str, workdir, *flags):
    cmd = [sys.executable, "launch.py", f"--config={config}", f"--workdir={workdir}", *flags]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def metrics(workdir) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.sandbox
def test_qwen3_code_tiny_runs_two_steps_and_exports_a_qwen3_directory(tmp_path):
    launch("experiments/qwen3_code.py:tiny", tmp_path, "--config.eval.tasks=2")
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["executions"] == 4 and r["generated_tokens"] > 0 for r in rows)
    hf = tmp_path / "hf"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):  # fmt: skip
        assert (hf / name).is_file(), name
    assert "<tool_call>" in json.load(open(hf / "tokenizer_config.json"))["chat_template"]


def test_reasoning_gym_tiny_resumes_from_its_checkpoint(tmp_path):
    first = launch("experiments/reasoning_gym.py:tiny", tmp_path, "--config.run.steps=1",
                   "--config.eval.tasks=0")  # fmt: skip
    assert "step 1/1" in first
    again = launch("experiments/reasoning_gym.py:tiny", tmp_path, "--config.run.steps=2",
                   "--config.eval.tasks=0", "--allow_config_change")  # fmt: skip
    assert "resuming after step 1/2" in again
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["version"] == 2


def test_a_chat_task_without_a_tokenizer_is_one_line(tmp_path):
    cmd = [sys.executable, "launch.py", "--config=experiments/reasoning_gym.py:tiny",
           f"--workdir={tmp_path}", "--config.model.hf_dir="]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "is a chat task: set model.hf_dir" in out.stderr + out.stdout
    assert not (tmp_path / "config.json").exists()
