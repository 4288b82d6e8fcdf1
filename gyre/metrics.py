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

    def scalars(self, prefix: str, step: int, values: dict) -> None:
        """TensorBoard only: numbers of ``values`` as '<prefix>/<key>' at ``step`` (e.g. the
        warm start's history, the evaluation before RL at step 0)."""
        if self._tb is None:
            return
        for k, v in values.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                self._tb.add_scalar(f"{prefix}/{k}" if prefix else k, v, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def write_json(path: str, data) -> None:
    """Writes ``data`` as JSON atomically: a kill mid-write leaves the previous file."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True, default=str)
    os.replace(tmp, path)


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


def standard_error(values) -> float:
    """Standard error of the mean of ``values`` (0 for fewer than two)."""
    values = np.asarray(values, np.float64)
    if values.size < 2:
        return 0.0
    return float(values.std(ddof=1) / np.sqrt(values.size))


def clock(seconds: float) -> str:
    """m:ss (or h:mm:ss) of a duration."""
    s = int(round(max(seconds, 0.0)))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


def eta(elapsed: float, done: float, total: float) -> str:
    """'ETA m:ss' from the rate so far ('ETA ?' before the first unit is done)."""
    if done <= 0 or total <= done:
        return "ETA ?" if done <= 0 else "ETA 0:00"
    return f"ETA {clock(elapsed / done * (total - done))}"


class Heartbeat:
    """Prints what the run is doing at least every ``every`` seconds, from a daemon thread, so
    progress shows while a compile or a long step blocks the main thread.

    ``status`` is a callable returning the current line (read from the thread: it must only
    read counters); :meth:`say` prints a line now and restarts the interval.
    """

    def __init__(self, every: float = 9.0, status=None, stream=None):
        import sys
        import threading

        self.every, self.status = every, status or (lambda: "")
        self.stream = stream or sys.stdout
        self.t0 = self._last = time.monotonic()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._beat, daemon=True)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def say(self, line: str) -> None:
        with self._lock:
            print(f"[{clock(self.elapsed())}] {line}", file=self.stream, flush=True)
            self._last = time.monotonic()

    def tick(self, now: float | None = None) -> None:
        """Prints the status line if ``every`` seconds passed since the last line."""
        now = time.monotonic() if now is None else now
        if now - self._last < self.every:
            return
        try:
            line = self.status()
        except Exception as e:  # a status read mid-update: report, never crash
            line = f"(status unavailable: {e!r})"
        if line:
            self.say(line)

    def _beat(self) -> None:
        while not self._stop.wait(0.5):  # so no gap exceeds every + 0.5 s
            self.tick()

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
