"""Plots written into a workdir at the end of a run (notebooks draw richer ones)."""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def learning_curves(rows: list[dict], path: str, keys=("reward", "success", "partial")) -> str:
    """Saves one panel per metric key found in ``rows`` (metrics.jsonl rows) against step."""
    keys = [k for k in keys if any(k in r for r in rows)]
    fig, axes = plt.subplots(1, max(len(keys), 1), figsize=(4 * max(len(keys), 1), 3))
    axes = [axes] if not hasattr(axes, "__len__") else list(axes)
    for ax, key in zip(axes, keys):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3)
        ax.set_xlabel("step")
        ax.set_title(key)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def role_timeline(spans: list[tuple[int, str, float, float]], path: str) -> str:
    """Gantt chart of cell roles. spans: (cell, role, start_s, end_s)."""
    colors = {"rollout": "tab:blue", "train": "tab:orange", "switch": "tab:gray"}
    cells = sorted({s[0] for s in spans})
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(cells) + 1))
    for cell, role, start, end in spans:
        ax.barh(cell, end - start, left=start, color=colors.get(role, "k"), height=0.8)
    ax.set_yticks(cells)
    ax.set_xlabel("seconds")
    ax.set_ylabel("cell")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
