"""benchmarks/ablate.py: arms x seeds run once each through the runner (a stub here that
writes what a finished run writes), finished workdirs are read rather than run again, and the
table gives means with standard errors over seeds and each arm's difference to the first."""

import importlib.util
import json
import math
import os

import pytest

PATH = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks", "ablate.py")
spec = importlib.util.spec_from_file_location("gyre_bench_ablate", PATH)
ablate = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ablate)

# What each (arm, seed) "reaches": held-out success after RL and seconds per step.
AFTER = {"J5": [0.50, 0.54, 0.52], "uncapped": [0.60, 0.62, 0.64]}
STEP_S = {"J5": 1.0, "uncapped": 1.5}


def fake_runner(calls):
    def run(cmd, workdir):
        calls.append(cmd)
        arm = os.path.basename(os.path.dirname(workdir))
        seed = int(next(c for c in cmd if c.startswith("--config.seed="))[len("--config.seed=") :])
        os.makedirs(workdir)
        after = AFTER[arm][seed]
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump({"finished": True, "wall_seconds": 10.0 + seed,
                       "eval_start": {"eval_success": 0.40, "eval_tasks": 256},
                       "eval_end": {"eval_success": after, "eval_tasks": 256}}, f)  # fmt: skip
        with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
            for step in range(1, 5):
                row = {"step": step, "success": 0.3 + 0.05 * step + 0.01 * seed,
                       "step_seconds": STEP_S[arm]}  # fmt: skip
                f.write(json.dumps(row) + "\n")

    return run


def test_arms_by_seeds_run_once_and_compare_with_standard_errors(tmp_path, capsys):
    calls = []
    argv = ["--config=experiments/quickstart.py", "--arms=J5,uncapped", "--seeds=3",
            f"--root={tmp_path}", "--set", "run.steps=4", "--window=2",
            f"--out={tmp_path / 'ablate.png'}"]  # fmt: skip
    result = ablate.main(argv, runner=fake_runner(calls))
    assert len(calls) == 6
    first = calls[0]
    assert first[2:] == ["--config=experiments/quickstart.py:J5", f"--workdir={tmp_path}/J5/s0",
                         "--config.seed=0", "--config.run.steps=4"]  # fmt: skip
    j5, unc = result["arms"]["J5"], result["arms"]["uncapped"]
    assert j5["seeds"] == 3 and j5["after"]["mean"] == pytest.approx(0.52)
    assert j5["after"]["se"] == pytest.approx(0.02 / math.sqrt(3))  # SD 0.02 over 3 seeds
    assert unc["change"]["mean"] == pytest.approx(0.22) and unc["step_s"]["mean"] == 1.5
    out = capsys.readouterr().out
    assert "uncapped - J5: held-out after +10.0% ± 1.6% (+6.1 SE)" in out
    assert "uncapped - J5: s/step +0.50 ± 0.00" in out
    assert os.path.getsize(tmp_path / "ablate.png") > 0
    assert json.loads(out.strip().splitlines()[-1])["arms"]["J5"]["seeds"] == 3
    # Finished workdirs are read, not run again; --read_only runs nothing.
    again = []
    ablate.main(argv + ["--arms=J5,uncapped,J1", "--read_only"], runner=fake_runner(again))
    assert again == [] and "missing:" in capsys.readouterr().out
    ablate.main(argv, runner=fake_runner(again))
    assert again == []


def test_variants_and_bad_arguments():
    assert ablate.arm_variant("default") == "" and ablate.arm_variant("J1+binary") == "J1,binary"
    cmd = ablate.command("experiments/quickstart.py", "default", 2, "w")
    assert cmd[2:4] == ["--config=experiments/quickstart.py", "--workdir=w"]
    with pytest.raises(SystemExit, match="variants go in --arms"):
        ablate.main(["--config=experiments/quickstart.py:J1", "--arms=J5"], runner=None)
    # One seed: the run's own binomial SE of held-out success stands in.
    m, se = ablate.aggregate([{"after": 0.5, "change": 0.1, "eval_tasks": 100, "train_last": 0.4,
                               "step_s": 1.0, "wall_s": 3.0}])["after"]  # fmt: skip
    assert m == 0.5 and se == pytest.approx(0.05)
