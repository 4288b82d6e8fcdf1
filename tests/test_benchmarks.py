"""The simulator benchmarks run end to end on a small setting and print their JSON line."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def last_json(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_paper_table_compares_like_for_like():
    res = last_json(["benchmarks/paper_table.py", "--steps", "2", "--seeds", "2", "--scenario",
                     "SWE", "--splits", "2,6"])  # fmt: skip
    (sc,) = res["scenarios"]
    p = sc["policies"]
    assert set(p) == {"colocate", "async_half", "async_best", "elastic", "elastic_s0"}
    for name, v in p.items():
        assert v["hours"] >= sc["lower_bound_h"] * (1 - 1e-9), name  # nothing beats the bound
        assert 0 < v["utilisation"] <= 1 + 1e-9, name
        assert v["tokens_per_exec_k"] > 0, name
        # No policy trains more than the whole workload: equal-work hours >= hours.
        assert v["equal_work_h"] >= v["hours"] * (1 - 1e-9), name
    assert p["async_half"]["split"] == 4 and set(sc["async_splits"]) == {"2", "4", "6"}
    assert p["async_best"]["split"] == sc["best_async_split"]
    assert p["async_best"]["equal_work_h"] <= p["async_half"]["equal_work_h"] * (1 + 1e-12)
    assert sc["async_splits"][str(sc["best_async_split"])] == min(sc["async_splits"].values())
    for key in ("vs_async_best", "vs_async_half", "vs_colocate", "vs_colocate_equal_staleness"):
        assert sc[key]["mean"] > 0 and sc[key]["se"] >= 0, key
    assert sc["memory"]["kv_tokens_m"] > 0 and sc["seeds"] == 2
    assert any("admission" in a for a in sc["assumptions"])  # the assumptions travel with it


def test_colocate_step_lengths_add_up_per_step():
    res = last_json(["benchmarks/colocate_step.py", "--steps", "3", "--carry", "1.0:1,0.5:2"])
    assert res["timeout_h"] == 4.0 and [r["close_share"] for r in res["rows"]] == [1.0, 0.5]
    for r in res["rows"]:
        # Colocate: every cell plays one role at a time, so a step's time splits between them.
        both = r["train_role_per_step_h"] + r["rollout_role_per_step_h"]
        assert both == pytest.approx(r["mean_step_h"], rel=0.05), r
        assert r["min_step_h"] <= r["median_step_h"] <= max(r["mean_step_h"], r["median_step_h"])
        assert 0 <= r["timeout_share"] <= 1
    assert res["below_timeout"] == [r["close_share"] for r in res["rows"]
                                    if r["mean_step_h"] < res["timeout_h"]]  # fmt: skip


@pytest.mark.slow
def test_regimes_map_writes_its_grid_and_picture(tmp_path):
    out = tmp_path / "regimes.png"
    res = last_json(["benchmarks/regimes.py", "--quick", "--out", str(out)])
    assert res["png"] == str(out) and os.path.getsize(out) > 0
    assert len(res["grid"]) == len(res["kv_ratios"]) * len(res["train_shares"])
    for cell in res["grid"]:
        for key in ("vs_async_best", "vs_colocate", "vs_colocate_equal_staleness"):
            assert cell[key] > 0, key
        assert 1 <= cell["best_split"] < res["cells"]
    assert {s["name"] for s in res["scenarios"]} >= {"SWE / terminal"}
    for s in res["scenarios"]:
        assert s["kv_ratio"] > 0 and 0 < s["train_share"] < 1


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


@pytest.mark.slow
def test_decode_load_sweep_writes_a_calibration_its_fit_reproduces(tmp_path):
    from gyre.elastic import calibration

    path = tmp_path / "decode.json"
    res = last_json(["benchmarks/decode.py", "--quick", "--load-only", "--write-calibration",
                     str(path)])["load"]  # fmt: skip
    spec = json.loads(path.read_text())
    rows = spec["decode"]
    grid = {(r["batch"], r["context_per_seq"]) for r in rows}
    assert grid == {(b, c) for b in (1, 2, 4, 8) for c in (32, 160)} and len(rows) == len(grid)
    for r in rows:
        n = spec["setting"]["decode_steps"]
        assert r["step_s"] > 0 and r["samples"] >= 3 * n  # several steady dispatches each
        # context: prompt + the tokens sampled so far, on every live row
        assert r["batch"] * r["context_per_seq"] <= r["context_tokens"]
        assert r["context_tokens"] <= r["batch"] * (
            r["context_per_seq"] + spec["setting"]["new_tokens"]
        )
        assert res["tok_s"][f"b{r['batch']}_c{r['context_per_seq']}"] == round(
            r["batch"] / r["step_s"], 1
        )
    cost = calibration.load(str(path))  # the public loader, with the base it names
    base = calibration.load(spec["base"])
    assert cost.slots == res["slots"] == 8 and cost.prefill_per_token_s == base.prefill_per_token_s
    step = lambda r: cost.decode_step_s(r["batch"], r["context_tokens"], r["context_max"])  # noqa: E731
    rel = [abs(step(r) - r["step_s"]) / r["step_s"] for r in rows]
    assert max(rel) <= res["fit"]["max_rel_err"] * (1 + 1e-6) + 1e-12
    assert max(rel) == pytest.approx(spec["fit"]["max_rel_err"], rel=1e-6)
    for r in rows:  # every live row of a point holds the same context
        assert r["context_max"] == pytest.approx(r["context_tokens"] / r["batch"])
    names = ("decode_base_s", "decode_per_seq_s", "decode_per_ctx_token_s",
             "decode_per_max_ctx_token_s")  # fmt: skip
    for name in names:
        assert getattr(cost, name) == pytest.approx(spec["fit"][name], rel=1e-9, abs=1e-15), name


def test_decode_steps_option_works_with_and_without_the_spec_field():
    import dataclasses
    import importlib.util

    mod_spec = importlib.util.spec_from_file_location(
        "decode_bench", f"{ROOT}/benchmarks/decode.py"
    )
    decode = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(decode)

    @dataclasses.dataclass(frozen=True)
    class Old:
        slots: int = 4

    @dataclasses.dataclass(frozen=True)
    class New:
        slots: int = 4
        decode_steps: int = 16

    assert decode.with_decode_steps(Old(), None) == Old() and decode.tokens_per_dispatch(Old()) == 1
    assert decode.with_decode_steps(Old(), 1) == Old()
    with pytest.raises(SystemExit, match="no decode_steps field"):
        decode.with_decode_steps(Old(), 4)
    assert decode.tokens_per_dispatch(decode.with_decode_steps(New(), 4)) == 4
    assert decode.tokens_per_dispatch(New()) == 16
    # auto (-1) resolves by the engine's own rule: 64 on one slot, 16 on more
    assert decode.tokens_per_dispatch(New(slots=1, decode_steps=-1)) == 64
    assert decode.tokens_per_dispatch(New(slots=4, decode_steps=-1)) == 16


@pytest.mark.slow
def test_live_attention_benchmark_compares_both_settings_on_the_same_tokens():
    res = last_json(["benchmarks/live_attention.py", "--quick", "--runs", "1"])
    assert res["benchmark"] == "live_attention" and res["block"] == 32
    assert [(r["batch"], r["prompt"], r["max_len"]) for r in res["rows"]] == [
        (1, 16, 48), (4, 16, 256), (4, 200, 256)
    ]  # fmt: skip
    for r in res["rows"]:
        assert r["dense_first_ms"] > 0 and r["live_first_ms"] > 0
        if r["ratio"] is not None:  # None: noise made a 1-token call the slower one
            assert r["dense_tok_s"] > 0 and r["live_tok_s"] > 0
            assert abs(r["ratio"] - r["live_tok_s"] / r["dense_tok_s"]) < 0.01 * r["ratio"]
        assert 0 <= r["match"] <= res["new"] and r["auto_kv_block"] == 0
