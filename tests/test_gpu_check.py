"""scripts/gpu_check.sh in its CPU dry-run mode: every section runs and the JSON is written."""

import json
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_gpu_check_dry_run_writes_every_section(tmp_path):
    out = tmp_path / "check.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["dry_run"] is True
    for name in ("train_mfu", "decode", "switch", "path_cap", "plan"):
        assert "error" not in res[name], (name, res[name], proc.stderr[-3000:])
    assert res["train_mfu"]["tokens_per_s"] > 0
    assert set(res["path_cap"]["caps"]) == {"1", "3", "5", "uncapped"}
    assert res["plan"]["fits"] is True
