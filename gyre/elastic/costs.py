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
    """Seconds, per cell. decode_step_s(batch, ctx_sum, ctx_max) = base + per_seq*batch +
    per_ctx*ctx_sum + per_max_ctx*ctx_max."""

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
    # The engine's memory and the costs that grow with context (all off by default; see sim.py).
    kv_capacity_tokens: float = 0.0  # KV pool of one cell in tokens; 0 = no memory model
    kv_bytes_per_token: float = 0.0  # KV bytes of one token (what a migration moves)
    link_bytes_per_s: float = 0.0  # one cell's bandwidth to another (KV migration)
    handover_migrate: bool = False  # memory model: hand resident contexts over by KV migration
    # memory model: admit an execution only while its context can stay resident (no eviction)
    resident_admission: bool = False
    mixed_chunk: int = 0  # > 0: prefill in chunks of this many tokens alongside decode steps
    prefill_per_ctx_token_s: float = 0.0  # attention: per new token per context token before it
    train_per_ctx_token_s: float = 0.0  # attention in training: per token per context token
    weight_load_s: float = 0.0  # a rollout cell pauses this long to load new weights
    reduce_s: float = 0.0  # gradient bytes of one cell / link: ring all-reduce = 2(n-1)/n x this
    # Decode per token of the longest live context: an engine that runs every slot up to it
    # (gyre's live KV blocks) pays this, whatever the other contexts (0 = per context only).
    decode_per_max_ctx_token_s: float = 0.0
    source: str = ""

    def decode_step_s(self, batch: int, ctx_sum: float, ctx_max: float = 0.0) -> float:
        return (
            self.decode_base_s
            + self.decode_per_seq_s * batch
            + self.decode_per_ctx_token_s * ctx_sum
            + self.decode_per_max_ctx_token_s * ctx_max
        )

    def prefill_s(self, tokens: float, cached: float = 0.0) -> float:
        """Seconds to prefill ``tokens`` uncached prompt tokens after ``cached`` ones in KV.

        Linear per token, plus attention: each new token attends to the cached context and
        the new tokens before it, ``prefill_per_ctx_token_s * tokens * (cached + tokens / 2)``
        (quadratic in the context when nothing is cached).
        """
        attention = self.prefill_per_ctx_token_s * tokens * (cached + tokens / 2)
        if self.prefill_chunk <= 0:
            return self.prefill_call_s + tokens * self.prefill_per_token_s + attention
        chunks = max(1, math.ceil(tokens / self.prefill_chunk - 1e-9))
        return (
            self.prefill_call_s + chunks * self.prefill_chunk * self.prefill_per_token_s + attention
        )

    def train_s(self, tokens: float, ctx_tokens: float = 0.0) -> float:
        """Seconds of one micro-batch of ``tokens`` whose contexts sum to ``ctx_tokens``."""
        return (
            self.microbatch_s
            + tokens * self.train_per_token_s
            + ctx_tokens * self.train_per_ctx_token_s
        )

    def allreduce_s(self, cells: int) -> float:
        """Ring all-reduce of the gradients over ``cells`` train cells: 2 (n - 1) / n x reduce_s."""
        return 2 * (cells - 1) / cells * self.reduce_s if cells > 1 else 0.0

    def migrate_s(self, tokens: float) -> float:
        """Seconds to move ``tokens`` of KV from one cell to another."""
        return tokens * self.kv_bytes_per_token / self.link_bytes_per_s

    @property
    def memory(self) -> bool:
        """Whether the simulator models KV memory (affinity, admission, eviction)."""
        return self.kv_capacity_tokens > 0

    @property
    def step_overhead_s(self) -> float:
        """Seconds from a step's last gradient to its published weights (optimizer + I/O)."""
        return self.optimizer_s + self.publish_s + self.checkpoint_s

    def train_tokens_per_s(self, mean_ctx: float = 0.0) -> float:
        """Tokens one cell trains per second in full micro-batches whose tokens sit at a mean
        context of ``mean_ctx`` tokens (the attention term; inf if training is free)."""
        mb = self.microbatch_tokens
        mb_s = self.train_s(mb, mb * mean_ctx)
        return mb / mb_s if mb_s > 0 else float("inf")

    def replicated(self, m: int) -> CostModel:
        """Each simulated execution stands for m identical ones: per-request costs x m.

        Keeps event counts small at cluster scale; it removes the variance between copies.
        The step's base and its longest-context term are per step, not per request: m
        copies of a batch share them, so they stay as they are.
        """
        if m < 1 or self.slots % m:
            raise ValueError(f"replication {m} must be >= 1 and divide slots ({self.slots})")
        return dataclasses.replace(
            self,
            decode_per_seq_s=self.decode_per_seq_s * m,
            decode_per_ctx_token_s=self.decode_per_ctx_token_s * m,
            prefill_per_token_s=self.prefill_per_token_s * m,
            prefill_per_ctx_token_s=self.prefill_per_ctx_token_s * m,
            train_per_token_s=self.train_per_token_s * m,
            train_per_ctx_token_s=self.train_per_ctx_token_s * m,
            slots=self.slots // m,
            cell_capacity=self.cell_capacity / m,
            microbatch_tokens=max(1, self.microbatch_tokens // m),
            kv_capacity_tokens=self.kv_capacity_tokens / m,
            kv_bytes_per_token=self.kv_bytes_per_token * m,
            mixed_chunk=max(1, self.mixed_chunk // m) if self.mixed_chunk > 0 else 0,
        )

    def min_token_work_s(self, ctx: float) -> float:
        """Least cell-seconds one decoded token can cost: its share of a full-batch step.

        With no slot cap (``slots`` 0, memory bounds the batch) the step's base and its
        longest-context term (shared by the batch, at least this token's ``ctx``) are left out.
        """
        shared = self.decode_base_s + self.decode_per_max_ctx_token_s * ctx
        return (
            (shared / self.slots if self.slots > 0 else 0.0)
            + self.decode_per_seq_s
            + self.decode_per_ctx_token_s * ctx
        )


def kv_bytes_per_token(
    layers: int, kv_heads: int, head_dim: int, dtype_bytes: float, tensors: int = 2
) -> float:
    """KV bytes of one token: layers x kv heads x head dim x tensors x dtype bytes.

    ``tensors`` is 2 for separate K and V, 1 for a compressed latent shared by both.
    """
    return float(layers * kv_heads * head_dim * tensors * dtype_bytes)


@dataclasses.dataclass(frozen=True)
class CellMemory:
    """One rollout cell's device memory: weights + KV pool + reserve = devices x device bytes.

    The reserve (activations, workspaces, fragmentation) is a fraction of the whole.
    """

    device_bytes: float  # per device
    devices: int
    weight_bytes: float  # one copy of the model, sharded over the cell's devices
    kv_bytes_per_token: float
    reserve_fraction: float = 0.1

    @property
    def total_bytes(self) -> float:
        return self.device_bytes * self.devices

    @property
    def kv_pool_bytes(self) -> float:
        return self.total_bytes * (1 - self.reserve_fraction) - self.weight_bytes

    @property
    def kv_tokens(self) -> float:
        """Tokens of KV the cell holds at once."""
        if self.kv_pool_bytes <= 0 or self.kv_bytes_per_token <= 0:
            raise ValueError(
                f"no KV pool: {self.total_bytes / 1e9:.0f} GB per cell, weights "
                f"{self.weight_bytes / 1e9:.0f} GB, reserve {self.reserve_fraction:.0%}"
            )
        return self.kv_pool_bytes / self.kv_bytes_per_token


def hardware_engine_fields(spec: dict, memory: CellMemory, link_bytes_per_s: float) -> dict:
    """CostModel fields of the engine mechanisms, from a ``kind: hardware`` calibration dict.

    KV pool and bytes from ``memory``; attention 4 x layers x attn_dim FLOPs per (token,
    context token) pair, at the prefill MFU for prefill and 3x at the train MFU for training
    (whose per-token term then drops calibration.project's fixed mean-context attention);
    gradient reduction: 2 bytes (bf16) per parameter over one cell's link.
    """
    try:
        hw, model, eff = spec["hardware"], spec["model"], spec["efficiency"]
        flops = hw["devices_per_cell"] * hw["flops_per_s"]
        attn = 4 * model["layers"] * model["attn_dim"]
        linear = model["train_flops_per_param"] * model["active_params"]
        return dict(
            kv_capacity_tokens=memory.kv_tokens,
            kv_bytes_per_token=memory.kv_bytes_per_token,
            link_bytes_per_s=link_bytes_per_s,
            prefill_per_ctx_token_s=attn / (flops * eff["prefill_mfu"]),
            train_per_token_s=linear / (flops * eff["train_mfu"]),
            train_per_ctx_token_s=3 * attn / (flops * eff["train_mfu"]),
            reduce_s=2 * model["total_params"] / link_bytes_per_s,
        )
    except KeyError as e:
        raise ValueError(f"hardware calibration lacks field {e}") from e


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
    # evictions, reprefill_tokens (beyond the trace's own), migrated_contexts / _tokens,
    # dropped_contexts (handed over without room), moved_calls (served off their context's
    # cell), mean_decode_batch (over decode time), trained_tokens
    counters: dict = dataclasses.field(default_factory=dict)

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
