"""Plots written into a workdir at the end of a run (notebooks draw richer ones)."""

from __future__ import annotations

import os

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def learning_curves(rows: list[dict], path: str, keys=("reward", "success", "partial"),
                    start: dict | None = None) -> str:  # fmt: skip
    """Saves one panel per metric key found in ``rows`` (metrics.jsonl rows, step s = after
    s optimizer steps) against step. ``start``: metrics before RL, drawn at step 0. Where a
    row has '<key>_se' (a mean over tasks), a band of one standard error is drawn."""
    rows = ([dict(start, step=0)] if start else []) + list(rows)
    keys = [k for k in keys if any(k in r for r in rows)]
    fig, axes = plt.subplots(1, max(len(keys), 1), figsize=(4 * max(len(keys), 1), 3))
    axes = [axes] if not hasattr(axes, "__len__") else list(axes)
    for ax, key in zip(axes, keys):
        pts = [(r["step"], r[key], r.get(f"{key}_se", 0.0)) for r in rows if key in r]
        x, y, se = (np.asarray(v, np.float64) for v in zip(*pts))
        ax.plot(x, y, marker="o", ms=3)
        if np.any(se > 0):
            ax.fill_between(x, y - se, y + se, alpha=0.25, linewidth=0)
        ax.set_xlabel("step (0: before RL)")
        ax.set_title(key)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


ROLE_COLORS = {"lost": "tab:red", "warmstart": "tab:purple", "eval": "tab:green", "rollout": "tab:blue",
               "train": "tab:orange", "switch": "tab:red"}  # fmt: skip


def role_timeline(spans: list[tuple[int, str, float, float]], path: str) -> str:
    """Gantt chart of cell roles. spans: (cell, role, start_s, end_s)."""
    roles = {s[1] for s in spans}
    colors = {r: c for r, c in ROLE_COLORS.items() if r in roles}
    cells = sorted({s[0] for s in spans})
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(cells) + 1.4))
    for cell, role, start, end in spans:
        ax.barh(cell, end - start, left=start, color=colors.get(role, "k"), height=0.8)
    ax.set_yticks(cells)
    ax.set_xlabel("seconds")
    ax.set_ylabel("cell")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), loc="upper center", bbox_to_anchor=(0.5, -0.3),
              ncol=len(colors), fontsize=8, frameon=False)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
