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
