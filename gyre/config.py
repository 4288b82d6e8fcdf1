"""Defaults and validation for every Gyre run: the only module that defines config keys.

An experiment file (``experiments/NAME.py``) starts from :func:`default_config` and
changes what it needs. :func:`validate` then checks the result against the defaults:
an unknown or misspelled key, a value of the wrong type, or an unknown choice
is a one-line ``ConfigError`` that names the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import math

import ml_collections

from gyre.cluster.spec import BACKENDS
from gyre.elastic.policy import POLICIES
from gyre.envs.registry import ENVIRONMENTS
from gyre.errors import ConfigError
from gyre.model.attention import IMPLS
from gyre.model.decoder import DTYPES
from gyre.rollout.types import ADMISSIONS, CPU_VECTOR_WIDTHS, HANDOVERS
from gyre.trajectory.advantages import LOSS_MODES, REWARDS
from gyre.trajectory.batch import PACKINGS

__all__ = ["BOUNDS", "ConfigError", "default_config", "validate"]


def default_config() -> ml_collections.ConfigDict:
    """Every key a run may set, with its default. Types here are the types enforced."""
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.name = "default"

    c.mesh = ml_collections.ConfigDict()
    c.mesh.cell_size = 1  # devices per cell; K = num_devices // cell_size cells
    c.mesh.num_devices = 0  # 0: all visible devices
    c.mesh.cpu_devices = 8  # fake this many devices when the platform is CPU
    c.mesh.model_parallel = 1  # size of the intra-cell 'model' axis; 'data' gets the rest
    c.mesh.compilation_cache = True  # persistent XLA cache
    c.mesh.cache_dir = ""  # where that cache lives ("" = the shared cache, gyre/cache.py)

    # Where the cells live (gyre/cluster/): "local" = every cell in this process; "ray" = each
    # actor a process owning cells_per_actor cells (devices_per_actor = cells_per_actor *
    # mesh.cell_size devices), arrays crossing with jax.experimental.transfer. Ray is an extra
    # (pip install -r requirements-ray.txt).
    c.cluster = ml_collections.ConfigDict()
    c.cluster.backend = "local"
    c.cluster.address = ""  # ray: "" = start a local instance; else ray.init's address ("auto")
    c.cluster.actors = 2  # ray: actor processes; actor 0 holds the core cell
    c.cluster.cells_per_actor = 1
    c.cluster.transfer_timeout_s = 120.0  # a cross-process move past this declares its cell lost

    c.model = ml_collections.ConfigDict()
    c.model.vocab_size = 64
    c.model.d_model = 64
    c.model.num_layers = 2
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.head_dim = 16
    c.model.d_ff = 128
    c.model.rope_theta = 10000.0
    c.model.rms_eps = 1e-6
    c.model.tie_embeddings = True
    c.model.dtype = "float32"  # activation dtype; parameters stay float32
    c.model.attention = "block_sparse"  # or "dense" (the reference)
    c.model.attn_block = 128  # key/query block of the block-sparse attention
    # A Hugging Face Qwen3 checkpoint directory (config.json + safetensors) to start from; its
    # architecture must equal the keys above. "" = random init from ``seed``.
    c.model.hf_dir = ""

    c.trajectory = ml_collections.ConfigDict()
    c.trajectory.max_paths = 5  # J; 0 = uncapped (ablation)
    c.trajectory.loss_mode = "two-level"
    c.trajectory.std_normalize = False
    c.trajectory.row_len = 1024  # tokens per packed row (multiple of 128)
    c.trajectory.packing = "tree"  # or "flat" (ablation)
    c.trajectory.reward = "partial"  # or "binary"

    c.train = ml_collections.ConfigDict()
    c.train.lr = 1e-4
    c.train.warmup_steps = 0
    c.train.weight_decay = 0.0
    c.train.b1 = 0.9
    c.train.b2 = 0.999
    c.train.grad_clip = 1.0
    c.train.clip_low = 0.2
    c.train.clip_high = 0.28
    c.train.kl_coef = 0.0
    c.train.tis_cap = 0.0  # truncated importance weight for stale tokens; 0 = off
    c.train.rows_per_microbatch = 4
    c.train.max_bad_steps = 3
    c.train.checkpoint_every = 1
    c.train.keep_checkpoints = 2

    c.rollout = ml_collections.ConfigDict()
    c.rollout.slots = 16
    c.rollout.max_len = 512
    c.rollout.prefill_chunk = 64
    # Decode tokens per device loop (one dispatch and one host transfer each); requests join
    # and leave slots, weights change and migrations happen between loops. -1 = auto (16, or
    # 64 on a one-slot cell, which never idles a slot; gyre/rollout/programs.py loop_steps),
    # 1 = one token per dispatch, N = N.
    c.rollout.decode_steps = -1
    # Preferred SIMD width in bits of the code XLA:CPU emits for the serving programs: -1 =
    # auto (512 for a one-slot cell, whose decode dots are matrix-vector products XLA emits
    # itself: 1.2-1.5x faster with 512-bit vectors on an AVX-512 host; XLA's default
    # otherwise, where dots go to library kernels and the width changed nothing measured);
    # 0 = XLA's default; 128, 256 or 512 = that width for every cell. Accelerators ignore it.
    c.rollout.cpu_vector_width = -1
    # Attention over the live part of the KV cache in blocks of this many entries
    # (gyre/rollout/programs.py kv_blocks): -1 auto (prefill live, decode live from max_len
    # 1024; blocks of 128), 0 dense over max_len, N > 0 live blocks of N everywhere.
    c.rollout.kv_block = -1
    c.rollout.temperature = 1.0
    c.rollout.top_p = 1.0
    c.rollout.max_new_tokens = 32
    # KV pool budget per rollout cell, in tokens (gyre/rollout/engine.py): live requests reserve
    # prompt + max new tokens, idle contexts kept for reuse are evicted least recently used.
    # 0 = derived: slots * max_len on CPU; on an accelerator, device memory minus the cell's
    # weights minus a reserve (capped at slots * max_len, the memory actually allocated).
    c.rollout.kv_tokens = 0
    # How the proxy admits calls (gyre/rollout/proxy.py): "none" = each call on its own (idle
    # contexts evicted LRU when the pool is short); "resident" = an execution's next call is
    # admitted to its cell only while its context can stay resident there, with a reservation
    # that grows with the context; calls of admitted executions go before new executions.
    c.rollout.admission = "none"

    c.agent = ml_collections.ConfigDict()
    c.agent.max_calls = 64
    c.agent.max_tokens = 100_000
    c.agent.max_seconds = 600.0
    c.agent.max_retries = 2
    c.agent.context_window = 512
    c.agent.model_summary = False  # compaction summary written by the model (main-summary)
    c.agent.infra_retries = 2
    c.agent.concurrency = 64  # executions in flight at once (RL: across the steps in flight)

    c.env = ml_collections.ConfigDict()
    c.env.name = "ledger"
    c.env.num_ops = 8  # K
    c.env.modulus = 10
    c.env.tool_latency = 0.0  # mean seconds; 0 = instant
    c.env.partial_scale = 0.5  # partial credit = scale * fraction of milestones
    c.env.tool_timeout = 30.0  # seconds before a tool call counts as hung (retried as infra)
    # Chaos testing: this share of tool calls crashes or hangs (gyre/envs/faults.py); the
    # harness retries them as infrastructure errors, never as the policy's failures.
    c.env.fault_rate = 0.0
    # Chat environments (code, reasoning_gym; gyre/envs/registry.py) speak text through the
    # checkpoint's tokenizer and chat template (model.hf_dir).
    c.env.tasks = ""  # reasoning_gym: comma-separated task names ("" = basic_arithmetic)
    c.env.max_runs = 8  # code: test runs before the task counts as failed
    c.env.keep_thinking = False  # the environment sees (True) or strips the <think> text
    c.env.enable_thinking = True  # the chat template's enable_thinking switch

    # What the experiment does; run.entry names the library function (see gyre/run.py).
    c.run = ml_collections.ConfigDict()
    c.run.entry = "rl"
    c.run.steps = 2  # optimizer steps (one RL step each)
    c.run.tasks_per_step = 4
    c.run.samples_per_task = 4  # executions per task (a group for the advantages)
    # Abort (one line, exit 3, thread stacks in <workdir>/error.txt) when nothing progresses
    # (no model call, execution or micro-batch ends) for this long; 0 = off.
    c.run.watchdog_s = 1800.0

    c.scheduler = ml_collections.ConfigDict()
    c.scheduler.policy = "elastic"  # colocate, async or elastic (gyre/elastic/policy.py)
    c.scheduler.max_staleness = 1  # bound on step - weight version at dispatch
    c.scheduler.async_rollout_cells = 0  # fixed split for the async policy; 0 = half
    c.scheduler.slack_cells = 1  # elastic: spare rollout cells kept beyond the outstanding work
    # elastic: a cell leaves rollout only for trainable work that keeps the train cells busy
    # for this many switch round trips (gyre/elastic/policy.py)
    c.scheduler.leave_round_trips = 3.0
    # What the policy assumes until the run has measured its own figures: seconds a role
    # switch costs, and the calibration (gyre/elastic/calibrations/<name>.json, or a path)
    # whose training speed seeds each cell's train tokens/s.
    c.scheduler.switch_cost_s = 0.0
    c.scheduler.calibration = "cpu_measured"
    c.scheduler.handover = "migrate"  # live requests of a cell leaving rollout: migrate or retry

    c.eval = ml_collections.ConfigDict()
    c.eval.tasks = 0  # greedy held-out tasks per evaluation (0: no evaluation)
    c.eval.every = 0  # evaluate every N steps (0: before and after RL only)
    c.eval.temperature = 0.0  # 0: greedy; else the sampling policy RL trains, at this temperature

    # Supervised warm start on expert demonstrations (gyre/rl/warmstart.py), cached by its
    # fingerprint in sft.dir.
    c.sft = ml_collections.ConfigDict()
    c.sft.steps = 0  # 0: no warm start
    c.sft.target_accuracy = 0.0  # stop early at this held-out per-step accuracy
    c.sft.batch = 16  # demonstrations per step
    c.sft.lr = 1e-3
    c.sft.eval_every = 50
    c.sft.mistake_prob = 0.1  # share of demonstration steps with a corrected near miss
    c.sft.dir = ""  # cache of warm starts ("" = the shared cache, gyre/cache.py)
    # Seed of the warm start (initial weights, demonstrations); -1 = ``seed``. Set it to vary
    # the RL seed over one cached warm start.
    c.sft.seed = -1
    return c


@dataclasses.dataclass(frozen=True)
class Bound:
    """The interval a numeric key must lie in; ``None`` = unbounded on that side."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, v) -> bool:
        if not math.isfinite(v):
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


def _ge(x):
    return Bound(x)


def _gt(x):
    return Bound(x, lo_open=True)


UNIT, UNIT_OPEN_HI, UNIT_OPEN_LO = Bound(0, 1), Bound(0, 1, hi_open=True), Bound(0, 1, True)

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
    "model.d_ff": _ge(1), "model.rope_theta": _gt(0), "model.rms_eps": _gt(0),
    "model.attn_block": _ge(1),
    "trajectory.max_paths": _ge(0), "trajectory.row_len": _ge(128),
    "train.lr": _gt(0), "train.warmup_steps": _ge(0), "train.weight_decay": _ge(0),
    "train.b1": UNIT_OPEN_HI, "train.b2": UNIT_OPEN_HI, "train.grad_clip": _ge(0),
    "train.clip_low": UNIT_OPEN_HI, "train.clip_high": _ge(0), "train.kl_coef": _ge(0),
    "train.tis_cap": _ge(0), "train.rows_per_microbatch": _ge(1), "train.max_bad_steps": _ge(0),
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
    "scheduler.leave_round_trips": _ge(0),
    "eval.tasks": _ge(0), "eval.every": _ge(0), "eval.temperature": _ge(0),
    "sft.steps": _ge(0), "sft.target_accuracy": UNIT, "sft.batch": _ge(1), "sft.lr": _gt(0),
    "sft.eval_every": _ge(1), "sft.mistake_prob": UNIT, "sft.seed": _ge(-1),
}  # fmt: skip


def _check_bounds(cfg) -> None:
    for path, bound in BOUNDS.items():
        section, _, key = path.rpartition(".")
        value = (cfg[section] if section else cfg)[key]
        if value not in bound:
            raise ConfigError(f"config key '{path}' must be {bound}, got {value!r}")


def _check_tree(cfg, ref, prefix: str) -> None:
    for key in cfg.keys():
        path = f"{prefix}{key}"
        if key not in ref:
            close = difflib.get_close_matches(key, list(ref.keys()), n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            raise ConfigError(f"unknown config key '{path}'{hint}")
        value, default = cfg[key], ref[key]
        if isinstance(default, ml_collections.ConfigDict):
            if not isinstance(value, ml_collections.ConfigDict):
                raise ConfigError(f"config key '{path}' must be a section, got {value!r}")
            _check_tree(value, default, path + ".")
            continue
        ok_types = (int, float) if isinstance(default, float) else (type(default),)
        if isinstance(value, bool) != isinstance(default, bool) or not isinstance(value, ok_types):
            raise ConfigError(
                f"config key '{path}' must be {type(default).__name__}, got {value!r}"
            )


def _check_choice(cfg, path: str, choices) -> None:
    section, key = path.split(".")
    if cfg[section][key] not in choices:
        raise ConfigError(
            f"config key '{path}' must be one of {choices}, got {cfg[section][key]!r}"
        )


def validate(cfg: ml_collections.ConfigDict) -> None:
    """Raises ConfigError naming the first bad key; returns None for a runnable config."""
    _check_tree(cfg, default_config(), "")
    _check_bounds(cfg)
    _check_choice(cfg, "trajectory.loss_mode", LOSS_MODES)
    _check_choice(cfg, "trajectory.packing", PACKINGS)
    _check_choice(cfg, "trajectory.reward", REWARDS)
    _check_choice(cfg, "scheduler.policy", tuple(POLICIES))
    _check_choice(cfg, "scheduler.handover", HANDOVERS)
    _check_choice(cfg, "env.name", tuple(ENVIRONMENTS))
    _check_choice(cfg, "model.attention", IMPLS)
    _check_choice(cfg, "cluster.backend", BACKENDS)
    _check_choice(cfg, "model.dtype", DTYPES)
    _check_choice(cfg, "rollout.cpu_vector_width", CPU_VECTOR_WIDTHS)
    _check_choice(cfg, "rollout.admission", ADMISSIONS)
    # Checks that need one part's settings only live in that part's spec (ModelSpec,
    # TrajectorySpec, TrainerSpec, ...) and in mesh.make_cells: the builder turns their errors
    # into ConfigErrors. Checked here: what crosses two sections.
    if cfg.model.head_dim % 2:
        raise ConfigError(f"config key 'model.head_dim' ({cfg.model.head_dim}) must be even "
                          "(rotary embeddings rotate pairs)")  # fmt: skip
    mp = cfg.mesh.model_parallel
    if mp >= 1:
        for key in ("num_kv_heads", "num_heads", "d_ff"):
            if cfg.model[key] % mp:
                raise ConfigError(
                    f"config key 'model.{key}' ({cfg.model[key]}) is not divisible by "
                    f"mesh.model_parallel ({mp})"
                )
