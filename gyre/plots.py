"""Plots written into a workdir at the end of a run: the learning curves and the cells' roles
over time (notebooks/ show the same figures, and more from the same files). Each ``*_figure``
returns a matplotlib Figure (display it in a notebook); the others save it."""

from __future__ import annotations

import os

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle
from matplotlib.ticker import MaxNLocator

# Figures are made without pyplot: no backend is chosen or changed (a notebook keeps its own),
# and nothing stays open after a save.

# (row key, held-out key drawn on the same axes, panel title, y-axis label). The loss is left
# out: at the start of an on-policy step it is ~0 by construction (ratio 1, mean-centred
# advantages), so it says nothing about learning; metrics.jsonl and TensorBoard have it.
PANELS = (
    ("success", "eval_success", "success", "share of executions that succeed"),
    ("milestones", "eval_milestones", "milestones", "share of milestones reached"),
    ("partial", None, "partial score of the failures", "mean score, executions that failed"),
    ("reward", None, "reward", "mean reward per execution"),
    ("entropy", None, "policy entropy", "nats per generated token"),
    ("grad_norm", None, "gradient norm", "global norm before clipping"),
)


def _numeric(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def learning_curves(rows: list[dict], path: str, start: dict | None = None,
                    title: str = "", panels=PANELS) -> str:  # fmt: skip
    """Saves :func:`learning_curves_figure` to ``path``."""
    return _save(learning_curves_figure(rows, start, title, panels), path)


def learning_curves_figure(rows: list[dict], start: dict | None = None, title: str = "",
                           panels=PANELS):  # fmt: skip
    """A grid of panels against the RL step (row s = after s optimizer steps; step 0 = before
    RL): each training metric of ``rows`` (metrics.jsonl) as a line with a band of one
    standard error where the row has '<key>_se'; the held-out evaluations (``start``: the one
    before RL; rows with eval_*) as points with error bars at their steps. Panels whose
    metrics no row has are left out."""
    evals = ([dict(start, step=0)] if start else []) + [r for r in rows if "eval_success" in r]
    drawn = [p for p in panels if any(_numeric(r.get(p[0])) for r in rows)
             or (p[1] and any(p[1] in r for r in evals))]  # fmt: skip
    n = max(len(drawn), 1)
    ncols = min(3, n)
    nrows = -(-n // ncols)
    fig = Figure(figsize=(4.2 * ncols, 3.2 * nrows + 0.6))
    axes = fig.subplots(nrows, ncols, squeeze=False)
    last = max([r["step"] for r in rows] + [0])
    for ax, (key, held, name, ylabel) in zip(axes.flat, drawn):
        pts = [(r["step"], r[key], r.get(f"{key}_se", 0.0)) for r in rows if _numeric(r.get(key))]
        if pts:
            x, y, se = (np.asarray(v, np.float64) for v in zip(*pts))
            ax.plot(x, y, marker="o", ms=3, label="training (per step)")
            if np.any(se > 0):
                ax.fill_between(x, y - se, y + se, alpha=0.25, linewidth=0, label="± 1 SE")
        if held:
            ev = [(r["step"], r[held], r.get(f"{held}_se", 0.0)) for r in evals if held in r]
            if ev:
                x, y, se = (np.asarray(v, np.float64) for v in zip(*ev))
                ax.errorbar(x, y, yerr=se, fmt="s", ms=6, capsize=4, color="tab:green",
                            label="held-out evaluation ± 1 SE")  # fmt: skip
        ax.set_title(name)
        ax.set_xlabel("RL step (0 = before RL)")
        ax.set_ylabel(ylabel)
        ax.set_xlim(-0.5, last + 0.5)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    for ax in list(axes.flat)[len(drawn) :]:
        ax.set_visible(False)
    fig.suptitle(title or "learning curves", fontsize=11)
    fig.tight_layout()
    return fig


def _save(fig, path: str) -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


ROLE_COLORS = {"lost": "black", "warmstart": "tab:purple", "eval": "tab:green", "rollout": "tab:blue",
               "train": "tab:orange", "switch": "tab:red"}  # fmt: skip


def handovers(spans: list[tuple[int, str, float, float]]) -> list[tuple[int, float]]:
    """(cell, time) of every switch from rollout to train: where a cell hands its live
    requests over to the other rollout cells."""
    out = []
    by_cell: dict[int, list] = {}
    for s in sorted(spans, key=lambda s: (s[0], s[2])):
        by_cell.setdefault(s[0], []).append(s)
    for cell, seq in by_cell.items():
        seq = [s for s in seq if s[3] > s[2] or s[1] == "switch"]
        for a, b, c in zip(seq, seq[1:], seq[2:]):
            if a[1] == "rollout" and b[1] == "switch" and c[1] == "train":
                out.append((cell, b[2]))
    return out


def role_timeline(spans: list[tuple[int, str, float, float]], path: str, title: str = "",
                  step_ends: list[tuple[int, float]] = ()) -> str:  # fmt: skip
    """Saves :func:`role_timeline_figure` to ``path``."""
    return _save(role_timeline_figure(spans, title, step_ends), path)


def role_timeline_figure(spans: list[tuple[int, str, float, float]], title: str = "",
                         step_ends: list[tuple[int, float]] = ()):  # fmt: skip
    """Gantt chart of cell roles. spans: (cell, role, start_s, end_s); step_ends: (step,
    seconds) where each RL step ended (dotted lines, labelled); every rollout -> train switch
    (where the cell's live requests, if any, are handed over) is marked with a triangle."""
    roles = {s[1] for s in spans}
    colors = {r: c for r, c in ROLE_COLORS.items() if r in roles}
    cells = sorted({s[0] for s in spans})
    fig = Figure(figsize=(11, 0.45 * len(cells) + 2.2))
    ax = fig.subplots()
    for cell, role, start, end in spans:
        ax.barh(cell, end - start, left=start, color=colors.get(role, "k"), height=0.8)
    marks = handovers(spans)
    handles = [Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    labels = list(colors)
    if marks:
        h = ax.scatter([t for _, t in marks], [c - 0.5 for c, _ in marks], marker="v", s=28,
                       color="black", zorder=3)  # fmt: skip
        handles.append(h)
        labels.append("rollout -> train switch (live requests, if any, handed over)")
    for step, t in step_ends:
        ax.axvline(t, color="0.3", linestyle=":", linewidth=0.8)
        ax.text(t, 1.0, str(step), transform=ax.get_xaxis_transform(), ha="center",
                va="bottom", fontsize=7, color="0.3")  # fmt: skip
    if step_ends:
        handles.append(Line2D([], [], color="0.3", linestyle=":"))
        labels.append("end of RL step (number above)")
    ax.set_yticks(cells)
    ax.set_ylim(max(cells, default=0) + 0.7, min(cells, default=0) - 0.9)
    ax.set_xlabel("seconds since the run started")
    ax.set_ylabel("cell")
    ax.set_title(title or "cell roles over time", pad=14)
    ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.22),
              ncol=min(len(labels), 4), fontsize=8, frameon=False)  # fmt: skip
    fig.tight_layout()
    return fig
