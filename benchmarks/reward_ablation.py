"""Compares finished RL runs (e.g. partial credit vs binary reward) from their workdirs.

    python benchmarks/reward_ablation.py partial=workdirs/mid_p0,workdirs/mid_p1 \\
        binary=workdirs/mid_b0,workdirs/mid_b1 --out workdirs/reward_ablation.png

Each argument is LABEL=WORKDIR[,WORKDIR...] (one workdir per seed). Reads each run's
``metrics.jsonl`` and ``summary.json`` (held-out greedy evaluation before RL is in the
summary, later ones in the metrics rows) and prints, per run and per label (mean over seeds):
held-out success at every evaluation, milestones (per-step accuracy) before and after,
training success over the first and last 8 steps, the share of task groups with both a
success and a failure (the only groups a binary reward learns from; from trace.jsonl), and
wall time. The difference between the
first two labels comes with its standard error (binomial on the evaluation tasks, seeds
averaged). Saves the curves to ``--out``; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gyre.metrics import read_metrics  # noqa: E402

WINDOW = 8  # steps averaged for the first / last training success


def load_run(workdir: str) -> dict:
    """-> eval curve [(RL steps done, success, milestones)], train success per step, timings."""
    rows = read_metrics(workdir)
    if not rows:
        raise ValueError(f"{workdir}: no metrics.jsonl rows (has the run started?)")
    with open(os.path.join(workdir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(workdir, "config.json")) as f:
        cfg = json.load(f)
    start = summary.get("eval_start") or {}
    evals = [(0, start["eval_success"], start["eval_milestones"])] if start else []
    evals += [(r["step"], r["eval_success"], r["eval_milestones"])
              for r in rows if "eval_success" in r]  # fmt: skip
    success = np.array([r["success"] for r in rows])
    return {
        "workdir": workdir,
        "evals": evals,
        "eval_tasks": cfg["eval"]["tasks"],
        "seed": cfg["seed"],
        "success": success,
        "first": float(success[:WINDOW].mean()),
        "last": float(success[-WINDOW:].mean()),
        "steps": len(rows),
        "mixed": mixed_success_share(workdir),
        "wall_s": summary.get("wall_seconds"),
        "step_s": float(np.median([r["step_seconds"] for r in rows])),
        "warm_start": summary.get("warm_start", {}),
    }


def mixed_success_share(workdir: str) -> float:
    """Share of task groups (over all steps) with both a success and a failure, from the
    run's trace.jsonl: the groups a binary reward can learn from (partial credit also
    separates groups without a success). Infrastructure errors are left out."""
    groups: dict = {}
    path = os.path.join(workdir, "trace.jsonl")
    if not os.path.exists(path):
        return float("nan")
    with open(path) as f:
        for line in f:
            ex = json.loads(line)
            reason = ex["measured"]["end_reason"]
            if reason != "infra_error":
                groups.setdefault((ex["step"], ex["group"]), set()).add(reason == "success")
    return float(np.mean([len(v) == 2 for v in groups.values()])) if groups else float("nan")


def parse(args: list[str]) -> dict[str, list[str]]:
    runs = {}
    for a in args:
        label, sep, dirs = a.partition("=")
        if not sep or not dirs:
            raise SystemExit(f"expected LABEL=WORKDIR[,WORKDIR...], got {a!r}")
        runs[label] = dirs.split(",")
    return runs


def plot(groups: dict[str, list[dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a0, a1, a2) = plt.subplots(1, 3, figsize=(13, 3.4))
    for ci, (label, runs) in enumerate(groups.items()):
        for si, run in enumerate(runs):
            style = dict(color=f"C{ci}", ls=("-", "--", ":", "-.")[si % 4], marker="o", ms=3)
            name = f"{label} s{si}"
            e = np.array(run["evals"])
            a0.plot(e[:, 0], e[:, 1], label=name, **style)
            a1.plot(e[:, 0], e[:, 2], label=name, **style)
            sm = np.convolve(run["success"], np.ones(WINDOW) / WINDOW, mode="valid")
            a2.plot(np.arange(WINDOW, WINDOW + sm.size), sm, label=name, color=f"C{ci}",
                    ls=style["ls"])  # fmt: skip
    for ax, title in ((a0, "held-out success (greedy)"), (a1, "held-out milestones"),
                      (a2, f"train success ({WINDOW}-step mean)")):  # fmt: skip
        ax.set_xlabel("RL step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    a0.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="LABEL=WORKDIR[,WORKDIR...]")
    ap.add_argument("--out", default="workdirs/reward_ablation.png")
    args = ap.parse_args()
    groups = {label: [load_run(d) for d in dirs] for label, dirs in parse(args.runs).items()}
    print(f"{'run':>28} {'eval success at step':>40} {'milestones':>15} "
          f"{'train first/last':>17} {'mixed':>6} {'wall min':>8} {'s/step':>6}")  # fmt: skip
    out = {}
    for label, runs in groups.items():
        for run in runs:
            ev = " ".join(f"{s}:{x:.1%}" for s, x, _ in run["evals"])
            ms = f"{run['evals'][0][2]:.3f}->{run['evals'][-1][2]:.3f}"
            wall = (run["wall_s"] or 0) / 60
            print(f"{label + ' ' + os.path.basename(run['workdir']):>28} {ev:>40} {ms:>15} "
                  f"{run['first']:>8.1%}/{run['last']:<8.1%} {run['mixed']:>6.0%} {wall:>8.1f} {run['step_s']:>6.1f}")  # fmt: skip
        n = min(len(r["evals"]) for r in runs)
        curve = np.mean([np.array(r["evals"][:n]) for r in runs], axis=0)
        out[label] = {
            "seeds": len(runs),
            "eval_steps": [int(x) for x in curve[:, 0]],
            "eval_success": [round(float(x), 4) for x in curve[:, 1]],
            "eval_milestones": [round(float(x), 4) for x in curve[:, 2]],
            "train_success_first": round(float(np.mean([r["first"] for r in runs])), 4),
            "train_success_last": round(float(np.mean([r["last"] for r in runs])), 4),
            "wall_minutes": round(float(np.mean([(r["wall_s"] or 0) / 60 for r in runs])), 1),
            "mixed_success_groups": round(float(np.mean([r["mixed"] for r in runs])), 4),
        }
        o = out[label]
        print(f"{label + ' (mean)':>28} {' '.join(f'{s}:{x:.1%}' for s, x in zip(o['eval_steps'], o['eval_success'])):>40} "
              f"{o['eval_milestones'][0]:.3f}->{o['eval_milestones'][-1]:.3f} "
              f"{o['train_success_first']:>8.1%}/{o['train_success_last']:<8.1%}")  # fmt: skip
    labels = list(groups)
    if len(labels) >= 2:
        a, b = (out[x] for x in labels[:2])
        tasks = [r["eval_tasks"] or 0 for x in labels[:2] for r in groups[x]]
        n_tasks = min(tasks) if all(tasks) else 0
        diff = a["eval_success"][-1] - b["eval_success"][-1]
        # Binomial variance of each run's final success on n_tasks, seeds averaged per label.
        var = sum(
            float(np.mean([r["evals"][-1][1] * (1 - r["evals"][-1][1]) for r in groups[x]]))
            / (n_tasks * len(groups[x]))
            for x in labels[:2]
        ) if n_tasks else float("nan")  # fmt: skip
        gain = lambda o: o["eval_success"][-1] - o["eval_success"][0]
        out["difference"] = {"final_success": round(diff, 4), "standard_error": round(var**0.5, 4),
                             f"gain_{labels[0]}": round(gain(a), 4),
                             f"gain_{labels[1]}": round(gain(b), 4)}  # fmt: skip
        print(f"final held-out success, {labels[0]} - {labels[1]}: {diff:+.1%} "
              f"(standard error {var**0.5:.1%}); RL gain {gain(a):+.1%} vs {gain(b):+.1%}")  # fmt: skip
    plot(groups, args.out)
    print(f"curves: {args.out}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
