"""The simulator benchmarks run end to end on a small setting and print their JSON line."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def last_json(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_paper_table_reports_hours_throughput_and_bounds():
    res = last_json(["benchmarks/paper_table.py", "--steps", "2", "--scenario", "SWE"])
    (sc,) = res["scenarios"]
    for name, p in sc["policies"].items():
        assert p["hours"] >= sc["lower_bound_h"] * (1 - 1e-9), name  # nothing beats the bound
        assert 0 < p["utilisation"] <= 1 + 1e-9, name
    p = sc["policies"]
    rate = {k: v["tokens_per_exec_k"] / v["hours"] for k, v in p.items()}
    assert abs(sc["throughput_vs_async"] - rate["elastic"] / rate["async"]) < 1e-9
    assert abs(sc["vs_colocate"] - p["colocate"]["hours"] / p["elastic"]["hours"]) < 1e-9
    loaded = last_json(["benchmarks/paper_table.py", "--steps", "2", "--scenario", "SWE",
                        "--load", "2"])["scenarios"][0]  # fmt: skip
    # Twice the executions on the same cluster: every policy takes at least as long.
    for name in p:
        assert loaded["policies"][name]["hours"] >= p[name]["hours"] * 0.999, name


def fake_run(path, seed: int, success: list[float], evals: dict[int, tuple[float, float]]):
    """A finished run's workdir: metrics rows, summary (eval before RL) and config."""
    os.makedirs(path)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        for step, s in enumerate(success, 1):  # row s: after step s
            row = {"step": step, "success": s, "step_seconds": 2.0}
            if step in evals:
                row["eval_success"], row["eval_milestones"] = evals[step]
            f.write(json.dumps(row) + "\n")
    start = {"eval_success": evals[0][0], "eval_milestones": evals[0][1]}
    with open(os.path.join(path, "summary.json"), "w") as f:
        json.dump({"eval_start": start, "wall_seconds": 120.0}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"seed": seed, "eval": {"tasks": 100}}, f)
    with open(os.path.join(path, "trace.jsonl"), "w") as f:  # group 0 mixed, group 1 not
        for group, reasons in enumerate((("success", "failure", "infra_error"),
                                         ("failure", "timeout", "infra_error"))):  # fmt: skip
            for reason in reasons:
                ex = {"step": 0, "group": group, "measured": {"end_reason": reason}}
                f.write(json.dumps(ex) + "\n")
    return str(path)


def test_reward_ablation_averages_seeds_and_reports_the_difference(tmp_path):
    succ = [0.0] * 8 + [1.0] * 8
    p0 = fake_run(tmp_path / "p0", 0, succ, {0: (0.1, 0.5), 8: (0.2, 0.6), 16: (0.4, 0.8)})
    p1 = fake_run(tmp_path / "p1", 1, succ, {0: (0.1, 0.5), 8: (0.3, 0.6), 16: (0.6, 0.8)})
    b0 = fake_run(tmp_path / "b0", 0, succ, {0: (0.1, 0.5), 8: (0.1, 0.5), 16: (0.2, 0.6)})
    out = last_json(["benchmarks/reward_ablation.py", f"partial={p0},{p1}", f"binary={b0}",
                     "--out", str(tmp_path / "cmp.png")])  # fmt: skip
    assert out["partial"]["eval_steps"] == [0, 8, 16] and out["partial"]["seeds"] == 2
    assert out["binary"]["mixed_success_groups"] == 0.5
    assert out["partial"]["eval_success"] == [0.1, 0.25, 0.5]
    assert (
        out["partial"]["train_success_first"] == 0.0 and out["partial"]["train_success_last"] == 1.0
    )
    d = out["difference"]
    assert abs(d["final_success"] - 0.3) < 1e-9 and abs(d["gain_binary"] - 0.1) < 1e-9
    # binomial: mean p(1-p) over seeds / (tasks x seeds), summed over the two labels
    se = ((0.4 * 0.6 + 0.6 * 0.4) / 2 / 200 + 0.2 * 0.8 / 100) ** 0.5
    assert abs(d["standard_error"] - round(se, 4)) < 1e-9
    assert os.path.getsize(tmp_path / "cmp.png") > 0
    bad = subprocess.run([sys.executable, "benchmarks/reward_ablation.py", "partial"], cwd=ROOT,
                         capture_output=True, text=True)  # fmt: skip
    assert bad.returncode != 0 and "LABEL=WORKDIR" in bad.stderr
