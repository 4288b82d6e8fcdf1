"""Ablations in one command: run (or read) arms x seeds of one experiment and compare them.

    python benchmarks/ablate.py --config=experiments/quickstart.py --arms=J5,uncapped --seeds=3
    python benchmarks/ablate.py --config=experiments/quickstart.py \\
        --arms=default,flat,binary,J1 --seeds=3 --root=workdirs/ablate --set run.steps=20

An arm is a config variant (the part after ``:`` of ``--config``; ``default`` = none; several
joined by ``+``, e.g. ``J1+binary``: ``experiments/quickstart.py`` documents J1/J3/J5/uncapped,
partial/binary, flat, elastic/async/colocate). Each (arm, seed) runs as
``python launch.py --config=CONFIG:ARM --workdir=ROOT/ARM/sSEED --config.seed=SEED [--config.K=V
...]``, one after the other; a workdir whose ``summary.json`` says ``finished`` is read, not run
again (so an interrupted ablation resumes, and ``--read_only`` only reads).

Per run it reads ``summary.json`` and ``metrics.jsonl``: held-out success before and after RL
(and the change), training success over the first and last ``--window`` steps, seconds per step
(median) and wall time. Per arm it prints the mean over seeds ± the standard error over seeds
(SE = sample SD / sqrt(seeds); with one seed, the run's own binomial SE of held-out success),
then each arm's difference to the first arm with its SE (sqrt(SE_a^2 + SE_b^2)) and how many
SEs that is. ``--out`` saves one figure: training success per step, mean over seeds with a ±1
SE band per arm, and held-out success before/after as points with error bars. The last line
is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def arm_variant(arm: str) -> str:
    """'default' -> '' ; 'J1+binary' -> 'J1,binary' (the config file's variant string)."""
    return "" if arm in ("default", "") else arm.replace("+", ",")


def command(config: str, arm: str, seed: int, workdir: str, overrides=()) -> list[str]:
    variant = arm_variant(arm)
    spec = f"{config}:{variant}" if variant else config
    return [sys.executable, os.path.join(ROOT, "launch.py"), f"--config={spec}",
            f"--workdir={workdir}", f"--config.seed={seed}",
            *(f"--config.{kv}" for kv in overrides)]  # fmt: skip


def launch(cmd: list[str], workdir: str) -> None:
    """The default runner: one launch.py process; its console goes to <workdir>.log."""
    os.makedirs(os.path.dirname(workdir) or ".", exist_ok=True)
    with open(workdir.rstrip("/") + ".log", "w") as log:
        code = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {code}; see {workdir}.log")


def finished(workdir: str) -> bool:
    try:
        with open(os.path.join(workdir, "summary.json")) as f:
            return bool(json.load(f).get("finished"))
    except (OSError, ValueError):
        return False


def read_run(workdir: str, window: int) -> dict:
    """One finished run's figures (module docstring)."""
    with open(os.path.join(workdir, "summary.json")) as f:
        summary = json.load(f)
    rows = []
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    start, end = summary.get("eval_start") or {}, summary.get("eval_end") or {}
    success = np.array([r["success"] for r in rows if "success" in r], float)
    step_s = [r["step_seconds"] for r in rows if "step_seconds" in r]
    n_eval = end.get("eval_tasks") or start.get("eval_tasks") or 0
    before, after = start.get("eval_success"), end.get("eval_success")
    return {
        "workdir": workdir,
        "before": before,
        "after": after,
        "change": None if before is None or after is None else after - before,
        "eval_tasks": n_eval,
        "train_first": float(success[:window].mean()) if success.size else None,
        "train_last": float(success[-window:].mean()) if success.size else None,
        "train_curve": success.tolist(),
        "step_s": float(np.median(step_s)) if step_s else None,
        "wall_s": summary.get("wall_seconds"),
    }


def mean_se(values, fallback_se=None) -> tuple[float, float]:
    """(mean, SE over seeds); one value: (value, fallback_se or nan)."""
    xs = [v for v in values if v is not None and math.isfinite(v)]
    if not xs:
        return float("nan"), float("nan")
    if len(xs) == 1:
        return xs[0], float("nan") if fallback_se is None else fallback_se
    return float(np.mean(xs)), float(np.std(xs, ddof=1) / math.sqrt(len(xs)))


METRICS = (  # (key, heading, format)
    ("after", "held-out after", "{:.1%}"),
    ("change", "change", "{:+.1%}"),
    ("train_last", "train last", "{:.1%}"),
    ("step_s", "s/step", "{:.2f}"),
    ("wall_s", "wall s", "{:.0f}"),
)


def aggregate(runs: list[dict]) -> dict:
    out = {"seeds": len(runs)}
    for key, _, _ in METRICS:
        fallback = None
        if key in ("after", "change") and len(runs) == 1 and runs[0]["eval_tasks"]:
            p, n = runs[0]["after"] or 0.0, runs[0]["eval_tasks"]
            fallback = math.sqrt(p * (1 - p) / n)  # binomial, one run
        out[key] = mean_se([r[key] for r in runs], fallback)
    return out


def table(arms: dict[str, dict]) -> list[str]:
    names = list(arms)
    lines = [f"{'arm':16s} {'seeds':>5s} " + " ".join(f"{h:>18s}" for _, h, _ in METRICS)]
    for arm in names:
        cells = []
        for key, _, fmt in METRICS:
            m, se = arms[arm][key]
            text = "n/a" if math.isnan(m) else fmt.format(m) + (
                "" if math.isnan(se) else " ± " + fmt.format(se).lstrip("+"))  # fmt: skip
            cells.append(f"{text:>18s}")
        lines.append(f"{arm:16s} {arms[arm]['seeds']:5d} " + " ".join(cells))
    base = names[0]
    for arm in names[1:]:
        for key, heading, fmt in METRICS[:2] + METRICS[3:4]:
            d, se = difference(arms[arm][key], arms[base][key])
            signed, plain = fmt.replace("{:+", "{:").replace("{:", "{:+"), fmt.replace("{:+", "{:")
            z = "" if not se or math.isnan(se) else f" ({d / se:+.1f} SE)"
            spread = "n/a" if math.isnan(se) else plain.format(se)
            value = "n/a" if math.isnan(d) else signed.format(d)
            lines.append(f"{arm} - {base}: {heading} {value} ± {spread}{z}")
    return lines


def difference(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    return a[0] - b[0], math.sqrt(a[1] ** 2 + b[1] ** 2)


def plot(runs: dict[str, list[dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a0, a1) = plt.subplots(1, 2, figsize=(11, 3.6))
    for ci, (arm, rs) in enumerate(runs.items()):
        n = min(len(r["train_curve"]) for r in rs)
        if n:
            curves = np.array([r["train_curve"][:n] for r in rs])
            m = curves.mean(0)
            se = curves.std(0, ddof=1) / math.sqrt(len(rs)) if len(rs) > 1 else np.zeros(n)
            x = np.arange(1, n + 1)
            a0.plot(x, m, color=f"C{ci}", label=f"{arm} ({len(rs)} seeds)")
            a0.fill_between(x, m - se, m + se, color=f"C{ci}", alpha=0.2)
        for k, key in enumerate(("before", "after")):
            m, se = mean_se([r[key] for r in rs])
            a1.errorbar([k + 0.05 * ci], [m], yerr=[0 if math.isnan(se) else se], fmt="o",
                        color=f"C{ci}", capsize=3, label=arm if k == 0 else None)  # fmt: skip
    a0.set(xlabel="RL step", ylabel="training success", title="training success (mean ± SE)")
    a1.set(xticks=[0, 1], xticklabels=["before RL", "after RL"], ylabel="held-out success",
           title="held-out success (mean ± SE over seeds)")  # fmt: skip
    for ax in (a0, a1):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None, runner=launch) -> dict:
    """``runner(cmd, workdir)`` runs one (arm, seed); tests pass a stub."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--config", required=True, help="experiment file, e.g. experiments/quickstart.py"
    )
    ap.add_argument("--arms", required=True, help="comma-separated variants; 'default' = none")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first_seed", type=int, default=0)
    ap.add_argument("--root", default="", help="workdir root (default workdirs/ablate_<config>)")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every run (repeatable), e.g. run.steps=20",
    )
    ap.add_argument("--window", type=int, default=8, help="steps averaged for train success")
    ap.add_argument("--read_only", action="store_true", help="read finished runs, run nothing")
    ap.add_argument("--out", default="", help="save the figure here (png)")
    args = ap.parse_args(argv)
    if ":" in args.config:
        raise SystemExit("--config takes the file alone; variants go in --arms")
    if args.seeds < 1:
        raise SystemExit("--seeds must be >= 1")
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms:
        raise SystemExit("--arms is empty")
    name = os.path.splitext(os.path.basename(args.config))[0]
    root = args.root or os.path.join("workdirs", f"ablate_{name}")
    runs: dict[str, list[dict]] = {}
    for arm in arms:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            workdir = os.path.join(root, arm, f"s{seed}")
            if not finished(workdir):
                if args.read_only:
                    print(f"missing: {workdir} (not finished)")
                    continue
                cmd = command(args.config, arm, seed, workdir, args.set)
                print(f"running {arm} seed {seed}: {' '.join(cmd[1:])}", flush=True)
                runner(cmd, workdir)
            runs.setdefault(arm, []).append(read_run(workdir, args.window))
    if not runs:
        raise SystemExit("no finished runs to compare")
    stats = {arm: aggregate(rs) for arm, rs in runs.items()}
    print(f"== {name}: {', '.join(runs)}; mean ± SE over seeds ==")
    for line in table(stats):
        print(line)
    if args.out:
        plot(runs, args.out)
        print(f"figure: {args.out}")

    def num(x):  # NaN (no figure) as null: the last line stays strict JSON
        return None if isinstance(x, float) and math.isnan(x) else x

    result = {"config": args.config, "root": root,
              "arms": {arm: {k: (v if k == "seeds" else {"mean": num(v[0]), "se": num(v[1])})
                             for k, v in s.items()} for arm, s in stats.items()}}  # fmt: skip
    print(json.dumps(result, allow_nan=False))
    return result


if __name__ == "__main__":
    main()
