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


def write_atomic(path: str, text: str) -> None:
    """Replaces ``path`` with ``text`` through a temporary file and os.replace: a kill at any
    point leaves either the old file or the new one, never a part of either."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json(path: str, data) -> None:
    """Writes ``data`` as JSON atomically: a kill mid-write leaves the previous file."""
    write_atomic(path, json.dumps(data, indent=1, sort_keys=True, default=str))


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


def all_infra_line(step: int, results) -> str | None:
    """One line when every execution of a step ended as an infrastructure error (the step
    trained on nothing; the first one's reason, last line, says why), else None."""
    if not results or any(r.end_reason != "infra_error" for r in results):
        return None
    why = str(results[0].stats.get("detail", "")).strip().splitlines() or ["no detail"]
    return (f"step {step}: all {len(results)} executions ended as infrastructure errors, "
            f"nothing trained; the first: {why[-1].strip()[:300]}")  # fmt: skip


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


class RunClock:
    """Where a run of ``total`` steps stands in time, and an ETA that says only what was
    measured: the seconds per step from the steps finished in this process (none before the
    first has finished: the caller names that phase), the seconds of an evaluation from one
    measured before (``eval_s``: the evaluation before RL, or one carried over by a resume).

    The estimate is ``steps left x seconds per step + evaluations left x eval_s``, the step
    in progress counting what is left of it (never less than nothing): within a step it
    falls with the clock or stays, and it moves only when a step ends. The first interval
    measured in a process holds the compiles, so once a second exists it is left out.
    Evaluations are timed apart from the steps (``eval_started``/``eval_done``).

    done: steps already done when this process started (a resume); eval_due(v): whether an
    evaluation follows step v; eval_calls: the model calls of a measured evaluation: during
    one, once a tenth of that many have returned (:meth:`tick` counts them), what is left of
    it is read from their rate instead of ``eval_s``; clock: seconds (tests pass a fake one).
    """

    def __init__(self, total: int, done: int = 0, eval_due=lambda v: False,
                 eval_s: float | None = None, clock=time.monotonic,
                 eval_calls: int = 0):  # fmt: skip
        self.total, self.done, self.first = total, done, done
        self.eval_due, self.eval_s, self.clock = eval_due, eval_s, clock
        self.intervals: list[float] = []  # seconds of the steps finished here, evaluations out
        self.last_end: float | None = None  # when the latest step ended (or RL started)
        self.eval_t0: float | None = None  # when the evaluation in progress started
        self._eval_in_gap = 0.0  # evaluation seconds since the latest step ended
        self._eval_pending = False  # a step ended whose evaluation has not started yet
        self.eval_calls, self.calls = eval_calls, 0  # expected; returned in this evaluation

    def start(self) -> None:
        """RL starts now (after the warm start and the evaluation before RL)."""
        self.last_end = self.clock()

    def step_done(self, version: int) -> None:
        now = self.clock()
        if self.last_end is None:
            self.last_end = now
        else:
            self.intervals.append(max(now - self.last_end - self._eval_in_gap, 0.0))
        self.last_end, self._eval_in_gap, self.done = now, 0.0, version
        self._eval_pending = bool(self.eval_due(version))

    def eval_started(self) -> None:
        self.eval_t0, self._eval_pending, self.calls = self.clock(), False, 0

    def tick(self) -> None:
        """A model call returned (counted while an evaluation runs)."""
        if self.eval_t0 is not None:
            self.calls += 1

    def eval_done(self) -> float:
        """Ends the evaluation in progress -> its seconds (the estimate of the next one)."""
        seconds = self.clock() - self.eval_t0
        self.eval_s, self.eval_t0 = seconds, None
        self._eval_in_gap += seconds
        return seconds

    def _eval_left(self, elapsed: float) -> float:
        if self.eval_calls and self.calls >= 0.1 * self.eval_calls:
            share = min(self.calls / self.eval_calls, 0.99)
            return elapsed * (1.0 - share) / share
        return max(self.eval_s - elapsed, 0.0)

    def step_seconds(self) -> float | None:
        """Seconds per step measured in this process (None before one step has finished)."""
        if not self.intervals:
            return None
        xs = self.intervals[1:] or self.intervals
        return sum(xs) / len(xs)

    def remaining(self) -> float | None:
        """Seconds to the end of the run, or None while nothing is measured to say it."""
        now, left = self.clock(), self.total - self.done
        per_step = self.step_seconds()
        if left > 0 and (per_step is None or self.last_end is None):
            return None
        evals = sum(bool(self.eval_due(v)) for v in range(self.done + 1, self.total + 1))
        if (evals or self._eval_pending or self.eval_t0 is not None) and self.eval_s is None:
            return None
        seconds = 0.0
        if left > 0:
            in_step = now - self.last_end - self._eval_in_gap
            if self.eval_t0 is not None:
                in_step -= now - self.eval_t0
            seconds += (left - 1) * per_step + max(per_step - in_step, 0.0)
        if self.eval_t0 is not None:
            seconds += self._eval_left(now - self.eval_t0)
        elif self._eval_pending:
            seconds += self.eval_s
        return seconds + evals * (self.eval_s or 0.0)

    def eta(self) -> str:
        left = self.remaining()
        if left is None:
            return "ETA ?"
        if len(self.intervals) == 1 and self.done < self.total:  # its compiles included
            return f"ETA {clock(left)} or less (from the first step, compiles included)"
        return f"ETA {clock(left)}"


def steady_seconds(events: list[float], start: float, end: float) -> float:
    """What a run of work from ``start`` to ``end`` would take without its start-up (compiles):
    twice the time from its middle event (of ``events``, e.g. model calls returning) to its
    end; the whole span when it has fewer than two events."""
    if len(events) < 2:
        return end - start
    return min(2.0 * (end - sorted(events)[len(events) // 2]), end - start)
