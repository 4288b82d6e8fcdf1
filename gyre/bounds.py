"""The interval every numeric config key must lie in, stated once.

``config.validate`` checks a config against :data:`BOUNDS` (naming the key); each part's spec
checks its own fields against the same table in ``__post_init__`` (:func:`check`), so a spec
built in code (a notebook, a test) is held to the intervals a config is. This module imports
nothing from gyre: every spec module may use it.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Bound:
    """The interval a numeric key must lie in; ``None`` = unbounded on that side."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, v) -> bool:
        if isinstance(v, bool) or not isinstance(v, int | float) or not representable(v):
            return False
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)

    def __str__(self) -> str:
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {self.lo}"
        return (
            f"in {'(' if self.lo_open else '['}{self.lo}, {self.hi}{')' if self.hi_open else ']'}"
        )


# Every number a key holds reaches a device as int32 or float32 (or is mixed with one): an
# integer outside int32, or a float that float32 rounds to infinity or to zero, is refused.
INT32 = (-(2**31), 2**31 - 1)
F32_MAX, F32_TINY = 3.4028234663852886e38, 1.1754943508222875e-38  # largest, smallest normal


def representable(v) -> bool:
    """Whether ``v`` survives int32 (an int) or float32 (a float) unchanged in kind."""
    if isinstance(v, int):
        return INT32[0] <= v <= INT32[1]
    return math.isfinite(v) and (v == 0 or F32_TINY <= abs(v) <= F32_MAX)


def describe(bound: Bound, v) -> str:
    """'must be <bound>, got v' plus, for a value the bound's interval holds but 32 bits do
    not, why it is refused."""
    why = ""
    if isinstance(v, int | float) and not isinstance(v, bool) and not representable(v):
        why = (" (an integer key holds int32: [-2^31, 2^31 - 1])" if isinstance(v, int) else
               f" (a float key must be 0 or of magnitude in [{F32_TINY:.3g}, {F32_MAX:.3g}]"
               ", float32's finite normal range)")  # fmt: skip
    shown = repr(v) if len(repr(v)) <= 40 else f"{repr(v)[:12]}... ({len(repr(v))} digits)"
    return f"must be {bound}, got {shown}{why}"


def _ge(x):
    return Bound(x)


def _gt(x):
    return Bound(x, lo_open=True)


UNIT, UNIT_OPEN_HI, UNIT_OPEN_LO = Bound(0, 1), Bound(0, 1, hi_open=True), Bound(0, 1, True)
# Rotary base: below 1 the frequencies 1 / theta^(2i/d) grow with i (to infinity as theta
# nears 0) and every position's rotation is noise; real models use 1e4 to 1e7.
ROPE_THETA = Bound(1.0)

# Every numeric key's interval (a test pins that none is missing). Constraints between keys
# (heads vs model_parallel, env vocabulary vs model, row length) are checked in ``validate``
# and in the parts' specs.
BOUNDS: dict[str, Bound] = {
    "seed": _ge(0),
    "mesh.cell_size": _ge(1), "mesh.num_devices": _ge(0), "mesh.cpu_devices": Bound(1, 4096),
    "mesh.model_parallel": _ge(1),
    "cluster.actors": _ge(1), "cluster.cells_per_actor": _ge(1),
    "cluster.transfer_timeout_s": _gt(0),
    "model.vocab_size": _ge(2), "model.d_model": _ge(1), "model.num_layers": _ge(1),
    "model.num_heads": _ge(1), "model.num_kv_heads": _ge(1), "model.head_dim": _ge(2),
    "model.d_ff": _ge(1), "model.rope_theta": ROPE_THETA, "model.rms_eps": _gt(0),
    "model.attn_block": _ge(1),
    "trajectory.max_paths": _ge(0), "trajectory.row_len": _ge(128),
    "train.lr": _gt(0), "train.warmup_steps": _ge(0), "train.weight_decay": _ge(0),
    "train.b1": UNIT_OPEN_HI, "train.b2": UNIT_OPEN_HI, "train.grad_clip": _ge(0),
    "train.clip_low": UNIT_OPEN_HI, "train.clip_high": _ge(0), "train.kl_coef": _ge(0),
    "train.tis_cap": _ge(0), "train.rows_per_microbatch": _ge(0), "train.max_bad_steps": _ge(0),
    "train.logits_chunk": _ge(0),
    "train.checkpoint_every": _ge(1), "train.keep_checkpoints": _ge(1),
    "rollout.slots": _ge(1), "rollout.max_len": _ge(2), "rollout.prefill_chunk": _ge(1),
    "rollout.decode_steps": _ge(-1), "rollout.cpu_vector_width": Bound(-1, 512),
    "rollout.temperature": _ge(0), "rollout.top_p": UNIT_OPEN_LO, "rollout.max_new_tokens": _ge(1),
    "rollout.kv_tokens": _ge(0), "rollout.kv_block": _ge(-1),
    "agent.max_calls": _ge(1), "agent.max_tokens": _ge(1), "agent.max_seconds": _gt(0),
    "agent.max_retries": _ge(0), "agent.context_window": _ge(2), "agent.infra_retries": _ge(0),
    "agent.concurrency": _ge(1),
    "env.num_ops": _ge(1), "env.modulus": _ge(2), "env.tool_latency": _ge(0),
    "env.partial_scale": UNIT_OPEN_HI, "env.fault_rate": UNIT_OPEN_HI, "env.tool_timeout": _gt(0),
    "env.max_runs": _ge(1),
    "run.steps": _ge(1), "run.tasks_per_step": _ge(1), "run.samples_per_task": _ge(1),
    "run.watchdog_s": _ge(0),
    "scheduler.max_staleness": _ge(0), "scheduler.async_rollout_cells": _ge(0),
    "scheduler.slack_cells": _ge(0), "scheduler.switch_cost_s": _ge(0),

    "eval.tasks": _ge(0), "eval.every": _ge(0), "eval.temperature": _ge(0),
    "sft.steps": _ge(0), "sft.target_accuracy": UNIT, "sft.batch": _ge(1), "sft.lr": _gt(0),
    "sft.eval_every": _ge(1), "sft.mistake_prob": UNIT, "sft.seed": _ge(-1),
}  # fmt: skip


def knob(default, bound: Bound):
    """A spec field with its default and its interval declared together (a new knob is then
    one line in its spec and one in config.py): ``x: float = knob(3.0, Bound(0))``."""
    return dataclasses.field(default=default, metadata={"bound": bound})


def declared(sections) -> dict[str, Bound]:
    """The intervals declared on spec fields with :func:`knob`, by config key, for
    ``sections``: (section, spec class) pairs."""
    return {f"{section}.{f.name}": f.metadata["bound"] for section, cls in sections
            for f in dataclasses.fields(cls) if "bound" in f.metadata}  # fmt: skip


def check(spec, section: str, **keys: str) -> None:
    """Raises ValueError naming the first field of ``spec`` outside its interval (declared on
    the field, or :data:`BOUNDS` of ``<section>.<field>``, or of the key ``keys`` names)."""
    for f in dataclasses.fields(spec):
        key = keys.get(f.name, f"{section}.{f.name}")
        bound = f.metadata.get("bound", BOUNDS.get(key))
        value = getattr(spec, f.name)
        if bound is not None and value not in bound:
            raise ValueError(f"{key} {describe(bound, value)}")
