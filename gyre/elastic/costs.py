"""The simulator's cost model and result types, and the shared-processor clock.

See gyre/elastic/sim.py for the model these costs feed.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Seconds, per cell. decode_step_s(batch, ctx_sum) = base + per_seq*batch + per_ctx*ctx_sum."""

    decode_base_s: float
    decode_per_seq_s: float
    decode_per_ctx_token_s: float
    prefill_per_token_s: float
    train_per_token_s: float
    optimizer_s: float = 0.0
    publish_s: float = 0.0
    switch_r2t_s: float = 8.5
    switch_t2r_s: float = 3.5
    slots: int = 64
    cell_capacity: float = 0.0  # executions a rollout cell counts as full for the policy; 0 = slots
    microbatch_tokens: int = 65536
    handover_reprefill: bool = True
    prefill_chunk: int = 0  # > 0: chunked prefill like the engine (see the module docstring)
    prefill_call_s: float = 0.0  # fixed cost of one call's prefill (dispatch, first sample)
    microbatch_s: float = 0.0  # fixed cost of one micro-batch
    checkpoint_s: float = 0.0  # per optimizer step, after optimizer_s + publish_s
    shared_cores: bool = False  # all cells share one processor (see the module docstring)
    pack_by_group: bool = False  # micro-batches per finished task group, like the controller
    source: str = ""

    def decode_step_s(self, batch: int, ctx_sum: float) -> float:
        return (
            self.decode_base_s
            + self.decode_per_seq_s * batch
            + self.decode_per_ctx_token_s * ctx_sum
        )

    def prefill_s(self, tokens: float) -> float:
        """Seconds to prefill ``tokens`` uncached prompt tokens of one call."""
        if self.prefill_chunk <= 0:
            return self.prefill_call_s + tokens * self.prefill_per_token_s
        chunks = max(1, math.ceil(tokens / self.prefill_chunk - 1e-9))
        return self.prefill_call_s + chunks * self.prefill_chunk * self.prefill_per_token_s

    @property
    def step_overhead_s(self) -> float:
        """Seconds from a step's last gradient to its published weights (optimizer + I/O)."""
        return self.optimizer_s + self.publish_s + self.checkpoint_s

    def train_tokens_per_s(self) -> float:
        """Tokens one cell trains per second in full micro-batches (inf if training is free)."""
        mb_s = self.microbatch_s + self.microbatch_tokens * self.train_per_token_s
        return self.microbatch_tokens / mb_s if mb_s > 0 else float("inf")

    def replicated(self, m: int) -> CostModel:
        """Each simulated execution stands for m identical ones: per-request costs x m.

        Keeps event counts small at cluster scale; it removes the variance between copies.
        """
        if m < 1 or self.slots % m:
            raise ValueError(f"replication {m} must be >= 1 and divide slots ({self.slots})")
        return dataclasses.replace(
            self,
            decode_per_seq_s=self.decode_per_seq_s * m,
            decode_per_ctx_token_s=self.decode_per_ctx_token_s * m,
            prefill_per_token_s=self.prefill_per_token_s * m,
            train_per_token_s=self.train_per_token_s * m,
            slots=self.slots // m,
            cell_capacity=self.cell_capacity / m,
            microbatch_tokens=max(1, self.microbatch_tokens // m),
        )

    def min_token_work_s(self, ctx: float) -> float:
        """Least cell-seconds one decoded token can cost: its share of a full-batch step."""
        return (
            self.decode_base_s / self.slots
            + self.decode_per_seq_s
            + self.decode_per_ctx_token_s * ctx
        )


@dataclasses.dataclass
class SimResult:
    policy: str
    makespan_s: float
    outcomes: dict  # execution_id -> (end_reason, start_s, end_s, trained_tokens)
    timeline: list  # (cell, start_s, end_s, role, state) with state 'busy' | 'idle' | 'switch'
    work_s: float  # least cell-seconds of the work actually done (rollout + train)
    longest_exec_s: float  # max over executions of min(fastest possible duration, timeout)
    num_cells: int
    switches: int
    end_counts: dict  # execution_id -> times it ended (1 each if nothing is lost or duplicated)
    step_end_s: list = dataclasses.field(default_factory=list)

    @property
    def lower_bound_s(self) -> float:
        return max(self.work_s / self.num_cells, self.longest_exec_s)

    @property
    def utilisation(self) -> float:
        """Least work / (cells x makespan): 1.0 only if every cell did useful work all along."""
        return self.work_s / (self.num_cells * self.makespan_s)

    def busy_fraction(self) -> dict:
        """Fraction of cell-time by state ('busy', 'idle', 'switch') and role."""
        tot = collections.Counter()
        for _, t0, t1, role, state in self.timeline:
            tot[f"{role}-{state}"] += t1 - t0
        return {k: v / (self.num_cells * self.makespan_s) for k, v in sorted(tot.items())}


def shared_clock(busy: list[tuple[float, float]]):
    """tau -> wall seconds on one processor shared by the ``busy`` (start, end) intervals.

    While n intervals overlap, each runs at 1/n speed, so dwall = max(1, n) dtau; outside
    every interval (nothing to compute, e.g. a tool wait) the clocks run together.
    """
    if any(t1 < t0 for t0, t1 in busy):
        raise ValueError("shared_clock: every busy interval needs start <= end")
    deltas = collections.Counter()
    for t0, t1 in busy:
        deltas[t0] += 1
        deltas[t1] -= 1
    xs = sorted(deltas) or [0.0]
    n_after = np.cumsum([deltas[x] for x in xs])  # overlapping intervals right after x
    ws = np.concatenate([[xs[0]], xs[0] + np.cumsum(np.diff(xs) * np.maximum(1, n_after[:-1]))])
    xs = np.asarray(xs, float)

    def wall(tau: float) -> float:
        if tau <= xs[0]:
            return float(tau)
        if tau >= xs[-1]:
            return float(ws[-1] + tau - xs[-1])
        return float(np.interp(tau, xs, ws))

    return wall
