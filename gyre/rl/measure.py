"""Figures the scheduler policy sees, measured by the run itself (never placeholders).

- Train throughput per cell: trainable tokens per second of that cell's micro-batches, an
  exponential running mean of real compute times. A gradient program returns before it has
  run (asynchronous dispatch), so a worker thread waits for each result and times it from
  the later of its dispatch and the end of the cell's previous micro-batch.
- Switch seconds per direction: a running mean of timed role switches (hand-over and weight
  load included).
- KV pools per step: :class:`PoolCounters` turns the proxy's cumulative counters into each
  step's share.

Each figure starts from a seed (a calibration, or the configured switch cost) and follows the
run's measurements from the first one on. Cells that have not trained yet take the mean of
those that have.
"""

from __future__ import annotations

import queue
import threading
import time

import jax


class RunningMean:
    """Exponential running mean: ``value`` is the seed until the first ``update``."""

    def __init__(self, seed: float, weight: float = 0.3):
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"running-mean weight must be in (0, 1], got {weight}")
        self.value, self.weight, self.count = float(seed), weight, 0

    def update(self, x: float) -> None:
        self.value = x if self.count == 0 else (1 - self.weight) * self.value + self.weight * x
        self.count += 1


class RunFigures:
    """Train tokens/s per cell and switch seconds, from the run's own timings.

    seed_train_tps: tokens/s one cell is assumed to train before it is measured;
    seed_switch_s: seconds a switch is assumed to take before one is measured.
    """

    def __init__(self, num_cells: int, seed_train_tps: float, seed_switch_s: float,
                 clock=time.perf_counter):  # fmt: skip
        if seed_train_tps <= 0:
            raise ValueError(f"seed train throughput must be > 0, got {seed_train_tps}")
        self.clock = clock
        self.train = [RunningMean(seed_train_tps) for _ in range(num_cells)]
        self.switch = {"r2t": RunningMean(seed_switch_s), "t2r": RunningMean(seed_switch_s)}
        self._lock = threading.Lock()
        self._ended = [0.0] * num_cells  # when each cell's latest micro-batch finished
        self._pending: queue.Queue = queue.Queue()
        self._worker: threading.Thread | None = None

    # ------------------------------------------------------------------ train throughput

    def record_microbatch(self, cell: int, tokens: float, seconds: float) -> None:
        if seconds > 0 and tokens > 0:
            with self._lock:
                self.train[cell].update(tokens / seconds)

    def time_microbatch(self, cell: int, tokens: float, result, dispatched: float) -> None:
        """Times ``result`` (a pytree of arrays being computed) once it is ready, off the
        caller's thread, and records its throughput."""
        if self._worker is None:
            self._worker = threading.Thread(target=self._wait, name="gyre-train-timer",
                                            daemon=True)  # fmt: skip
            self._worker.start()
        self._pending.put((cell, tokens, result, dispatched))

    def _wait(self) -> None:
        while True:
            item = self._pending.get()
            if item is None:
                return
            cell, tokens, result, dispatched = item
            try:
                jax.block_until_ready(result)
            except Exception:  # the trainer reports a failed program; timing just skips it
                continue
            end = self.clock()
            start = max(dispatched, self._ended[cell])
            self._ended[cell] = end
            self.record_microbatch(cell, tokens, end - start)

    def close(self) -> None:
        if self._worker is not None:
            self._pending.put(None)

    def train_throughput(self) -> tuple[float, ...]:
        """Tokens/s per cell: its own estimate once measured, else the measured cells' mean,
        else the seed."""
        with self._lock:
            measured = [m.value for m in self.train if m.count]
            fallback = sum(measured) / len(measured) if measured else self.train[0].value
            return tuple(m.value if m.count else fallback for m in self.train)

    # ------------------------------------------------------------------ switches

    def record_switch(self, direction: str, seconds: float) -> None:
        self.switch[direction].update(seconds)

    @property
    def switch_r2t_s(self) -> float:
        return self.switch["r2t"].value

    @property
    def switch_t2r_s(self) -> float:
        return self.switch["t2r"].value

    def as_metrics(self) -> dict:
        """What the policy currently assumes, for a metrics row (``policy_*``)."""
        tps = self.train_throughput()
        return {"policy_train_tokens_per_s": sum(tps) / len(tps),
                "policy_switch_r2t_s": self.switch_r2t_s,
                "policy_switch_t2r_s": self.switch_t2r_s}  # fmt: skip


class PoolCounters:
    """Per-step KV-pool figures from ``Proxy.kv_stats()`` samples: the counters that only grow
    become each step's share, the rest (current state) pass through."""

    CUMULATIVE = ("kv_evictions", "kv_evicted_tokens", "kv_reprefilled_tokens", "kv_admissions",
                  "kv_admission_wait_s", "kv_prompt_tokens", "kv_reused_tokens",
                  "kv_shared_tokens", "kv_decode_slot_steps", "kv_decode_idle_slot_steps")  # fmt: skip

    def __init__(self, first: dict):
        self.before = first

    def since_last(self, now: dict) -> dict:
        out = {k: v - self.before[k] if k in self.CUMULATIVE else v for k, v in now.items()}
        self.before = now
        waits = out["kv_admissions"]
        out["kv_admission_wait_mean_s"] = out["kv_admission_wait_s"] / waits if waits else 0.0
        # share of the decode loops' slot-steps spent idle (a slot done before its loop ended):
        # the cost of rollout.decode_steps tokens per dispatch
        slot_steps = out.get("kv_decode_slot_steps", 0)
        out["kv_decode_idle_frac"] = (
            out.get("kv_decode_idle_slot_steps", 0) / slot_steps if slot_steps else 0.0
        )
        return out
