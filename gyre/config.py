"""Defaults and validation for every Gyre run: the only module that defines config keys.

An experiment file (``experiments/NAME.py``) starts from :func:`default_config` and
changes what it needs. :func:`validate` then checks the result against the defaults:
an unknown or misspelled key, a value of the wrong type, or an unknown choice
is a one-line ``ConfigError`` that names the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import types

import ml_collections

from gyre import bounds
from gyre.agent.context import AgentSettings
from gyre.cluster.spec import BACKENDS, ClusterSpec
from gyre.elastic.policy import CLOSE_ON, POLICIES, PolicyParams
from gyre.envs.published import FORMATS as PROBLEM_FORMATS
from gyre.envs.registry import ENVIRONMENTS, EnvSpec
from gyre.errors import ConfigError
from gyre.mesh import MeshSpec
from gyre.model.attention import IMPLS
from gyre.model.decoder import DTYPES, REMAT_POLICIES
from gyre.rl.specs import EvalSpec, RunSpec, SftRecipe, SftSpec
from gyre.rollout.programs import RolloutSpec
from gyre.rollout.types import ADMISSIONS, CPU_VECTOR_WIDTHS, HANDOVERS
from gyre.train.loss import LossSpec
from gyre.train.optimizer import OptimizerSpec
from gyre.train.step import TrainerSpec
from gyre.trajectory.advantages import LOSS_MODES, REWARDS
from gyre.trajectory.batch import PACKINGS, TrajectorySpec

__all__ = ["BOUNDS", "ConfigError", "default_config", "validate"]

# Every numeric key's interval: gyre/bounds.py's table, and those declared on spec fields.
SPEC_SECTIONS = (("mesh", MeshSpec), ("cluster", ClusterSpec), ("trajectory", TrajectorySpec),
                 ("train", OptimizerSpec), ("train", LossSpec), ("rollout", RolloutSpec),
                 ("agent", AgentSettings), ("env", EnvSpec), ("scheduler", PolicyParams),
                 ("eval", EvalSpec))  # fmt: skip
BOUNDS = {**bounds.BOUNDS, **bounds.declared(SPEC_SECTIONS)}


def default_config() -> ml_collections.ConfigDict:
    """Every key a run may set, with its default. Types here are the types enforced.

    A key that sets a field of a part's spec takes that field's default: the default is
    stated once, in the spec (its comment there says more); the rest are stated here.
    """
    mesh_, cluster_, traj, agent = (_defaults(MeshSpec), _defaults(ClusterSpec),
                                    _defaults(TrajectorySpec), _defaults(AgentSettings))  # fmt: skip
    opt, loss, trainer = _defaults(OptimizerSpec), _defaults(LossSpec), _defaults(TrainerSpec)
    rollout, env, sched = _defaults(RolloutSpec), _defaults(EnvSpec), _defaults(PolicyParams)
    run, eval_, sft, recipe = (_defaults(RunSpec), _defaults(EvalSpec), _defaults(SftSpec),
                               _defaults(SftRecipe))  # fmt: skip
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.name = "default"

    c.mesh = ml_collections.ConfigDict()
    c.mesh.cell_size = mesh_.cell_size  # devices per cell; K = num_devices // cell_size cells
    c.mesh.num_devices = mesh_.num_devices  # 0: all visible devices
    c.mesh.cpu_devices = mesh_.cpu_devices  # fake this many devices when the platform is CPU
    # size of the intra-cell 'model' axis; 'data' gets the rest
    c.mesh.model_parallel = mesh_.model_parallel
    c.mesh.compilation_cache = mesh_.compilation_cache  # persistent XLA cache
    # where that cache lives ("" = the shared cache, gyre/cache.py)
    c.mesh.cache_dir = mesh_.cache_dir

    # Where the cells live (gyre/cluster/): "local" = every cell in this process; "ray" = each
    # actor a process owning cells_per_actor cells (devices_per_actor = cells_per_actor *
    # mesh.cell_size devices), arrays crossing with jax.experimental.transfer. Ray is an extra
    # (pip install -r requirements-ray.txt).
    c.cluster = ml_collections.ConfigDict()
    c.cluster.backend = cluster_.backend
    # ray: "" = start a local instance; else ray.init's address ("auto")
    c.cluster.address = cluster_.address
    c.cluster.actors = cluster_.actors  # ray: actor processes; actor 0 holds the core cell
    c.cluster.cells_per_actor = cluster_.cells_per_actor
    # ray: a deadline per phase of a call to an actor; past one the call's cell is lost (the
    # core's: the run ends) with a line naming the phase. A cross-process array move:
    c.cluster.transfer_timeout_s = cluster_.transfer_timeout_s
    # an actor's start (its process, devices and transfer server)
    c.cluster.startup_timeout_s = cluster_.startup_timeout_s
    # a checkpoint read or written (actor 0's initial weights, a save)
    c.cluster.load_timeout_s = cluster_.load_timeout_s
    # a program's first call on a cell (compiled, or loaded from the persistent cache)
    c.cluster.compile_timeout_s = cluster_.compile_timeout_s
    # any other call (an engine step, a gradient, an update)
    c.cluster.step_timeout_s = cluster_.step_timeout_s

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
    c.trajectory.max_paths = traj.max_paths  # J; 0 = uncapped (ablation)
    c.trajectory.loss_mode = traj.loss_mode
    c.trajectory.std_normalize = traj.std_normalize
    c.trajectory.row_len = traj.row_len  # tokens per packed row (multiple of 128)
    c.trajectory.packing = traj.packing  # or "flat" (ablation)
    c.trajectory.reward = traj.reward  # or "binary"

    c.train = ml_collections.ConfigDict()
    c.train.lr = opt.lr
    c.train.warmup_steps = opt.warmup_steps
    c.train.weight_decay = opt.weight_decay
    c.train.b1 = opt.b1
    c.train.b2 = opt.b2
    c.train.grad_clip = opt.grad_clip
    c.train.clip_low = loss.clip_low
    c.train.clip_high = loss.clip_high
    c.train.kl_coef = loss.kl_coef
    c.train.tis_cap = loss.tis_cap  # truncated importance weight for stale tokens; 0 = off
    c.train.rows_per_microbatch = trainer.rows_per_microbatch
    c.train.max_bad_steps = trainer.max_bad_steps
    # What each decoder block keeps for the backward pass (gyre/model/decoder.py
    # REMAT_POLICIES: none, full, dots_saveable, ...); `python -m gyre.plan` shows the memory
    c.train.remat = trainer.remat
    # log-probabilities over vocabulary chunks of this many ids (no [rows, T, vocab] float32
    # logits); 0 = in one piece
    c.train.logits_chunk = trainer.logits_chunk
    # each packed row trained prefix first (gyre/train/tree_schedule.py): the same gradient
    # as the tree mask, peak memory of the shared prefix plus one branch; no KL term
    c.train.tree_schedule = trainer.tree_schedule
    c.train.checkpoint_every = run.checkpoint_every
    c.train.keep_checkpoints = run.keep_checkpoints

    c.rollout = ml_collections.ConfigDict()
    c.rollout.slots = rollout.slots
    c.rollout.max_len = rollout.max_len
    c.rollout.prefill_chunk = rollout.prefill_chunk
    # Decode tokens per device loop (one dispatch and one host transfer each); requests join
    # and leave slots, weights change and migrations happen between loops. -1 = auto (16, or
    # 64 on a one-slot cell, which never idles a slot; gyre/rollout/programs.py loop_steps),
    # 1 = one token per dispatch, N = N.
    c.rollout.decode_steps = rollout.decode_steps
    # Preferred SIMD width in bits of the code XLA:CPU emits for the serving programs: -1 =
    # auto (512 for a one-slot cell, whose decode dots are matrix-vector products XLA emits
    # itself: 1.2-1.5x faster with 512-bit vectors on an AVX-512 host; XLA's default
    # otherwise, where dots go to library kernels and the width changed nothing measured);
    # 0 = XLA's default; 128, 256 or 512 = that width for every cell. Accelerators ignore it.
    c.rollout.cpu_vector_width = rollout.cpu_vector_width
    # Attention over the live part of the KV cache in blocks of this many entries
    # (gyre/rollout/programs.py kv_blocks): -1 auto (prefill live, decode live from max_len
    # 1024; blocks of 128), 0 dense over max_len, N > 0 live blocks of N everywhere.
    c.rollout.kv_block = rollout.kv_block
    c.rollout.temperature = rollout.temperature
    c.rollout.top_p = rollout.top_p
    c.rollout.max_new_tokens = agent.max_new_tokens
    # KV pool budget per rollout cell, in tokens (gyre/rollout/engine.py): live requests reserve
    # prompt + max new tokens, idle contexts kept for reuse are evicted least recently used.
    # 0 = derived: slots * max_len on CPU; on an accelerator, device memory minus the cell's
    # weights minus a reserve (capped at slots * max_len, the memory actually allocated).
    c.rollout.kv_tokens = rollout.kv_tokens
    # KV memory as pages of this many tokens (each slot reads its pages through a page table,
    # in blocks of kv_block entries, auto 128, in whole pages: 128 measured fastest on CPU;
    # prompts shared by reference, gyre/kvpool.py); 0 = one max_len row per slot
    c.rollout.kv_page = rollout.kv_page
    # How the proxy admits calls (gyre/rollout/proxy.py): "none" = each call on its own (idle
    # contexts evicted LRU when the pool is short); "resident" = an execution's next call is
    # admitted to its cell only while its context can stay resident there, with a reservation
    # that grows with the context; calls of admitted executions go before new executions.
    c.rollout.admission = rollout.admission

    c.agent = ml_collections.ConfigDict()
    c.agent.max_calls = agent.max_calls
    c.agent.max_tokens = agent.max_tokens
    c.agent.max_seconds = agent.max_seconds
    c.agent.max_retries = agent.max_retries
    c.agent.context_window = agent.context_window
    # compaction summary written by the model (main-summary)
    c.agent.model_summary = agent.model_summary
    c.agent.infra_retries = agent.infra_retries
    # executions in flight at once (RL: across the steps in flight)
    c.agent.concurrency = agent.concurrency

    c.env = ml_collections.ConfigDict()
    c.env.name = env.name
    c.env.num_ops = env.num_ops  # K
    c.env.modulus = env.modulus
    c.env.tool_latency = env.tool_latency  # mean seconds; 0 = instant
    c.env.partial_scale = agent.partial_scale  # partial credit = scale * fraction of milestones
    # seconds before a tool call counts as hung (retried as infra)
    c.env.tool_timeout = env.tool_timeout
    # Chaos testing: this share of tool calls crashes or hangs (gyre/envs/faults.py); the
    # harness retries them as infrastructure errors, never as the policy's failures.
    c.env.fault_rate = env.fault_rate
    # Chat environments (code, reasoning_gym; gyre/envs/registry.py) speak text through the
    # checkpoint's tokenizer and chat template (model.hf_dir).
    c.env.tasks = env.tasks  # reasoning_gym: comma-separated task names ("" = basic_arithmetic)
    c.env.max_runs = env.max_runs  # code: test runs before the task counts as failed
    # code: the problem set, a file ("" = the shipped gyre/envs/data/code_problems.json) read
    # as problem_format: gyre (the project's JSON), humaneval or mbpp (JSONL), or auto
    # (.json -> gyre, else by the first record's fields); gyre/envs/published.py
    c.env.problem_file = env.problem_file
    c.env.problem_format = env.problem_format
    # the environment sees (True) or strips the <think> text
    c.env.keep_thinking = env.keep_thinking
    c.env.enable_thinking = env.enable_thinking  # the chat template's enable_thinking switch

    # What the experiment does; run.entry names the library function (see gyre/run.py).
    c.run = ml_collections.ConfigDict()
    c.run.entry = "rl"
    c.run.steps = 2  # optimizer steps (one RL step each)
    c.run.tasks_per_step = 4
    c.run.samples_per_task = 4  # executions per task (a group for the advantages)
    # Abort (one line, exit 3, thread stacks in <workdir>/error.txt) when nothing progresses
    # (no model call, execution or micro-batch ends) for this long; 0 = off.
    c.run.watchdog_s = run.watchdog_s

    c.scheduler = ml_collections.ConfigDict()
    c.scheduler.policy = run.scheduler_policy  # colocate, async or elastic (gyre/elastic/policy.py)
    c.scheduler.max_staleness = sched.max_staleness  # bound on step - weight version at dispatch
    # fixed split for the async policy; 0 = half
    c.scheduler.async_rollout_cells = sched.async_rollout_cells
    # elastic: spare rollout cells kept beyond the outstanding work
    c.scheduler.slack_cells = sched.slack_cells
    # elastic: a cell leaves rollout only for trainable work that keeps the train cells busy
    # for this many switch round trips (gyre/elastic/policy.py)
    c.scheduler.leave_round_trips = sched.leave_round_trips
    # Carry-over: a step closes once this share of its task groups has finished (1.0 = all,
    # off); groups still running carry into the next step, at most max_carry steps.
    c.scheduler.close_share = sched.close_share
    c.scheduler.max_carry = sched.max_carry
    # which finished groups count towards close_share: "own" (dispatched by the step) or
    # "owned" (every group it trains, carried-in ones included)
    c.scheduler.close_on = sched.close_on
    # What the policy assumes until the run has measured its own figures: seconds a role
    # switch costs, and the calibration (gyre/elastic/calibrations/<name>.json, or a path)
    # whose training speed seeds each cell's train tokens/s.
    c.scheduler.switch_cost_s = run.switch_cost_s
    c.scheduler.calibration = "cpu_measured"
    c.scheduler.handover = run.handover  # live requests of a cell leaving rollout: migrate or retry

    c.eval = ml_collections.ConfigDict()
    c.eval.tasks = eval_.tasks  # greedy held-out tasks per evaluation (0: no evaluation)
    c.eval.every = eval_.every  # evaluate every N steps (0: before and after RL only)
    # 0: greedy; else the sampling policy RL trains, at this temperature
    c.eval.temperature = eval_.temperature

    # Supervised warm start on expert demonstrations (gyre/rl/warmstart.py), cached by its
    # fingerprint in sft.dir.
    c.sft = ml_collections.ConfigDict()
    c.sft.steps = sft.steps  # 0: no warm start
    c.sft.target_accuracy = sft.target_accuracy  # stop early at this held-out per-step accuracy
    c.sft.batch = recipe.batch  # demonstrations per step
    c.sft.lr = 1e-3
    c.sft.eval_every = sft.eval_every
    # share of demonstration steps with a corrected near miss (calc: answered without the tool)
    c.sft.mistake_prob = recipe.mistake_prob
    c.sft.dir = sft.dir  # cache of warm starts ("" = the shared cache, gyre/cache.py)
    # Seed of the warm start (initial weights, demonstrations); -1 = ``seed``. Set it to vary
    # the RL seed over one cached warm start.
    c.sft.seed = -1
    return c


def _defaults(cls) -> types.SimpleNamespace:
    """The field defaults of the spec dataclass ``cls``."""
    fields = dataclasses.fields(cls)
    return types.SimpleNamespace(
        **{f.name: f.default for f in fields if f.default is not dataclasses.MISSING}
    )


def _check_bounds(cfg) -> None:
    for path, bound in BOUNDS.items():
        section, _, key = path.rpartition(".")
        value = (cfg[section] if section else cfg)[key]
        if value not in bound:
            raise ConfigError(f"config key '{path}' {bounds.describe(bound, value)}")


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
    _check_choice(cfg, "scheduler.close_on", CLOSE_ON)
    _check_choice(cfg, "env.name", tuple(ENVIRONMENTS))
    _check_choice(cfg, "env.problem_format", PROBLEM_FORMATS)
    _check_choice(cfg, "model.attention", IMPLS)
    _check_choice(cfg, "cluster.backend", BACKENDS)
    _check_choice(cfg, "model.dtype", DTYPES)
    _check_choice(cfg, "train.remat", tuple(REMAT_POLICIES))
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
