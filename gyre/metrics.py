"""Metrics: one JSON line per step in <workdir>/metrics.jsonl, TensorBoard scalars, and a
one-line console progress report."""

from __future__ import annotations

import json
import os
import time

import numpy as np


def _scalar(v):
    if isinstance(v, (np.generic, np.ndarray)) and np.ndim(v) == 0:
        return v.item()
    if hasattr(v, "item") and getattr(v, "shape", None) == ():
        return v.item()
    return v


class MetricsWriter:
    """Appends to metrics.jsonl (resumable: an existing file is kept) and TensorBoard."""

    def __init__(self, workdir: str, tensorboard: bool = True):
        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._file = open(self.path, "a")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(workdir, "tb"))
        self._start = time.time()

    def write(self, step: int, metrics: dict) -> dict:
        row = {"step": int(step), "time": round(time.time() - self._start, 3)}
        row.update({k: _scalar(v) for k, v in metrics.items()})
        self._file.write(json.dumps(row, default=str) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                    self._tb.add_scalar(k, v, step)
        return row

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(workdir: str) -> list[dict]:
    """All rows of <workdir>/metrics.jsonl (for notebooks and tests)."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def progress_line(step: int, total: int, metrics: dict, keys=("reward", "success", "loss")) -> str:
    parts = [f"step {step}/{total}"]
    for k in keys:
        if k in metrics and isinstance(metrics[k], (int, float)):
            parts.append(f"{k} {metrics[k]:.4g}")
    return " | ".join(parts)
