"""What ``launch.py`` calls: the config's one boundary.

:func:`main` validates the ConfigDict, builds every part's spec from it once
(gyre/rl/builder.py), writes both beside the run (``config.json``, ``specs.json``) and calls
the entry ``specs.entry`` names with ``(specs, workdir)``; nothing after that reads the
config. Each entry returns a summary dict, written to ``<workdir>/summary.json``.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
import time
import traceback
import warnings

from gyre import signals
from gyre.config import ConfigError, validate
from gyre.errors import AlreadyFinished, Stopped

ENTRIES = {
    "smoke": "gyre.rl.experiment:smoke_test",
    "harness": "gyre.rl.experiment:harness",
    "rl": "gyre.rl.experiment:rl",
    "sft": "gyre.rl.experiment:sft",
    "eval": "gyre.rl.experiment:evaluate",  # --mode=eval: a run's weights on held-out tasks
}


def resolve_entry(name: str):
    if name not in ENTRIES:
        raise ConfigError(f"config key 'run.entry' is {name!r}, not one of {sorted(ENTRIES)}")
    module, fn = ENTRIES[name].split(":")
    return getattr(importlib.import_module(module), fn)


def setup_devices(cpu_devices: int) -> None:
    """Fakes ``cpu_devices`` CPU devices; must run before JAX initialises a backend."""
    import jax

    if jax.config.jax_num_cpu_devices != cpu_devices:  # tests set it already
        jax.config.update("jax_num_cpu_devices", cpu_devices)


def write_config(cfg, specs, workdir: str) -> None:
    """The config as given (config.json) and the specs built from it (specs.json)."""
    from gyre.metrics import write_atomic
    from gyre.rl.specs import to_json

    os.makedirs(workdir, exist_ok=True)
    write_atomic(
        os.path.join(workdir, "config.json"), cfg.to_json_best_effort(indent=2, sort_keys=True)
    )
    write_atomic(os.path.join(workdir, "specs.json"), to_json(specs))


# Keys a relaunch may change without --allow_config_change: where caches live, and how many
# steps the run has (raising it continues a finished run).
FREE_KEYS = ("mesh.cache_dir", "sft.dir", "run.steps")


def last_checkpoint(workdir: str) -> int | None:
    """The step of the newest checkpoint in the workdir (None: no run there yet)."""
    ckpt = os.path.join(workdir, "checkpoints")
    steps = [int(n) for n in os.listdir(ckpt) if n.isdigit()] if os.path.isdir(ckpt) else []
    return max(steps, default=None)


def config_changes(cfg, workdir: str) -> list[str]:
    """'key: old -> new' for each key that differs from the config of the run in ``workdir``
    (none when the workdir holds no run yet), leaving out FREE_KEYS."""
    from gyre.rl.builder import flat_keys

    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path) or last_checkpoint(workdir) is None:
        return []
    with open(path) as f:
        old = flat_keys(json.load(f))
    new = flat_keys(json.loads(cfg.to_json_best_effort()))
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
            if old.get(k) != new.get(k) and k not in FREE_KEYS]  # fmt: skip


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def check_fits(specs, env, sample: int = 16) -> None:
    """Refuses settings under which a task's first model call cannot be served: its prompt
    plus rollout.max_new_tokens must fit agent.context_window (else every execution ends
    context_overflow), rollout.max_len (the slot) and the KV pool (else every call fails, an
    infrastructure error), and a context the agent may grow must fit the slot. Checked on
    ``sample`` training and held-out tasks: a run where every execution fails then costs one
    line instead of its steps."""
    r, a = specs.rollout, specs.agent
    new = a.max_new_tokens
    if a.context_window > r.max_len:
        raise ConfigError(f"config key 'agent.context_window' ({a.context_window}) exceeds "
                          f"rollout.max_len ({r.max_len}): a context that grows past the slot "
                          "cannot be served")  # fmt: skip
    tasks = env.make_tasks(specs.seed, sample) + env.make_tasks(specs.seed, sample, "eval")
    longest, task = 0, None
    for t in tasks:
        state = env.reset(t)
        n = len(env.task_prompt(state)) + len(env.initial_obs(state))
        if n > longest:
            longest, task = n, t.task_id
    need = longest + new
    if need > a.context_window:
        raise ConfigError(f"config key 'agent.context_window' ({a.context_window}) is smaller "
                          f"than task {task}'s prompt ({longest} tokens) plus "
                          f"rollout.max_new_tokens ({new})")  # fmt: skip
    if r.kv_tokens and need - 1 > r.kv_tokens:
        raise ConfigError(f"config key 'rollout.kv_tokens' ({r.kv_tokens}) is smaller than "
                          f"task {task}'s prompt ({longest} tokens) plus rollout.max_new_tokens "
                          f"({new}) - 1: no call of it could be admitted")  # fmt: skip


def main(cfg, workdir: str, allow_config_change: bool = False, mode: str = "run",
         **hooks) -> dict:  # fmt: skip
    """Runs one experiment. A bad config exits with a one-line message naming the key; a
    relaunch with a config other than the workdir's run is refused unless
    ``allow_config_change``; Ctrl-C or SIGTERM stop after the step in progress (a second one
    at once) with one line saying how to resume (gyre/signals.py).

    hooks: keyword arguments passed to the entry (tests use them, e.g. after_microbatch).
    mode "eval": the ``eval`` entry instead of the config's; it writes only <workdir>/eval.json
    (the run's config, specs and summary stay as they are) and may change any key.
    """
    evaluating = mode == "eval"
    try:
        validate(cfg)
        from gyre import mesh
        from gyre.rl import builder

        # every part's own checks, the cell layout and the environment, before anything is
        # written into the workdir (a tiny checkpoint may be made in the cache)
        specs = builder.build_specs(cfg)  # touches no JAX backend: the device count comes next
        entry = resolve_entry("eval" if evaluating else specs.entry)
        setup_devices(specs.mesh.cpu_devices)
        if specs.cluster.backend == "local":  # a Ray actor checks its own devices
            mesh.cells_for(specs.mesh)
            # the memory plan, where devices report their memory (and rows_per_microbatch 0)
            specs = builder.check_memory(specs)
            if specs.trainer.rows_auto:
                print(
                    f"train.rows_per_microbatch auto: {specs.trainer.rows_per_microbatch}"
                    " (by the memory plan where devices report memory, else the default)"
                )
        sampled = specs.entry in ("rl", "sft") or evaluating
        try:
            env = builder.environment(specs, with_model=sampled)
        except (ValueError, KeyError) as e:  # e.g. a misspelled reasoning-gym task name
            raise ConfigError(f"env.name {specs.env.name!r}: {_first_line(e)}") from e
        if sampled:
            check_fits(specs, env)
    except ConfigError as e:
        sys.exit(f"config error: {e}")
    changes = [] if evaluating else config_changes(cfg, workdir)
    if changes and not allow_config_change:
        sys.exit(f"config error: {workdir} holds a run with another config ({'; '.join(changes)});"
                 " use a new --workdir, or relaunch with --allow_config_change to go on with "
                 "the new values")  # fmt: skip
    from gyre.cache import cache_dir

    # CPU cannot reuse donated batch buffers for the gradient outputs; harmless there.
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    if changes:
        with open(os.path.join(workdir, "config_changes.jsonl"), "a") as f:
            f.write(json.dumps({"time": time.time(), "changes": changes}) + "\n")
    try:
        if not evaluating:
            write_config(cfg, specs, workdir)
    except OSError as e:
        sys.exit(f"workdir error: cannot write into {workdir}: {e.strerror or e}")
    del cfg  # the boundary: from here on only the specs travel
    if specs.mesh.compilation_cache:
        mesh.enable_compilation_cache(cache_dir("xla", specs.mesh.cache_dir))
    signals.install()
    try:
        summary = entry(specs, workdir, **hooks)
    except ConfigError as e:
        sys.exit(f"config error: {e}")
    except (AlreadyFinished, Stopped) as e:
        print(str(e), flush=True)
        return {}
    except Exception as e:  # anything else: one line, the traceback kept in the workdir
        from gyre.metrics import write_atomic

        path = os.path.join(workdir, "error.txt")
        write_atomic(path, traceback.format_exc())
        first = (str(e).strip().splitlines() or [""])[0]
        sys.exit(f"error: {type(e).__name__}: {first} (traceback in {path}; relaunch the same "
                 f"command to resume from the last checkpoint)")  # fmt: skip
    except KeyboardInterrupt:
        step = last_checkpoint(workdir)
        where = f"its checkpoint after step {step}" if step else "the start (no step finished)"
        sys.exit(f"interrupted: relaunch the same command to resume {workdir} from {where}")
    from gyre.metrics import write_json

    write_json(os.path.join(workdir, "eval.json" if evaluating else "summary.json"), summary)
    return summary


# ---- the memory plan's command line (python -m gyre.plan): a config read like a run's

# Architectures by name, as their config.json states them (no download): --shapes=NAME.
SHAPES = {
    "qwen3-0.6b": dict(vocab_size=151936, d_model=1024, num_layers=28, num_heads=16,
                       num_kv_heads=8, head_dim=128, d_ff=3072, rope_theta=1e6, rms_eps=1e-6,
                       tie_embeddings=True),
    "qwen3-1.7b": dict(vocab_size=151936, d_model=2048, num_layers=28, num_heads=16,
                       num_kv_heads=8, head_dim=128, d_ff=6144, rope_theta=1e6, rms_eps=1e-6,
                       tie_embeddings=True),
    "qwen3-4b": dict(vocab_size=151936, d_model=2560, num_layers=36, num_heads=32,
                     num_kv_heads=8, head_dim=128, d_ff=9728, rope_theta=1e6, rms_eps=1e-6,
                     tie_embeddings=True),
}  # fmt: skip
# Qwen3's tokenizer produces ids below this; the rest of the vocabulary is padding.
QWEN3_TOKENIZER_IDS = 151669


def parse_bytes(text: str) -> float:
    """'80GB', '80G', '80e9', '141GiB' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*(gib|gb|g|mib|mb|m|b)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"--device_memory={text!r}: expected e.g. 80GB, 141GiB or 8e10")
    unit = (m.group(2) or "b").lower()
    scale = {"gib": 2**30, "gb": 1e9, "g": 1e9, "mib": 2**20, "mb": 1e6, "m": 1e6, "b": 1}[unit]
    return float(m.group(1)) * scale


def apply_shapes(cfg, name: str) -> None:
    """Sets the config's architecture keys to a named architecture (no checkpoint needed)."""
    if name not in SHAPES:
        raise ValueError(f"--shapes={name!r}: expected one of {tuple(SHAPES)}")
    cfg.model.update(SHAPES[name])
    cfg.model.hf_dir = ""


def plan_main(argv=None) -> int:
    """``python -m gyre.plan``: the memory plan of an experiment per device (gyre/plan.py)."""
    from absl import flags
    from ml_collections import config_flags

    cfg_flag = config_flags.DEFINE_config_file("config", None, "Experiment config file[:ARG].")
    mem_flag = flags.DEFINE_string("device_memory", "80GB", "Memory of one device.")
    shapes_flag = flags.DEFINE_string("shapes", "", f"An architecture by name: {tuple(SHAPES)}.")
    headroom_flag = flags.DEFINE_float("headroom", 0.1, "Share of device memory kept free.")
    json_flag = flags.DEFINE_bool("json", False, "Print only the JSON line.")
    tree_flag = flags.DEFINE_integer(
        "tree_row",
        0,
        "Plan one tree row of this many tokens instead of the config's micro-batch rows.",
    )
    prefix_flag = flags.DEFINE_integer(
        "tree_prefix", 0, "With --tree_branch: the schedule's shared prefix (tokens)."
    )
    branch_flag = flags.DEFINE_integer(
        "tree_branch", 0, "The tree schedule's branch length (tokens); 0: the tree mask."
    )
    auto_flag = flags.DEFINE_bool(
        "auto_rows",
        False,
        "Also print the largest train.rows_per_microbatch that fits (several compiles).",
    )
    flags.FLAGS(sys.argv if argv is None else argv)
    cfg = cfg_flag.value
    if cfg is None:
        print("usage: python -m gyre.plan --config=experiments/NAME.py --device_memory=80GB")
        return 2
    if shapes_flag.value:
        apply_shapes(cfg, shapes_flag.value)
    memory = parse_bytes(mem_flag.value)

    try:
        validate(cfg)
        from gyre.rl import builder

        specs = builder.build_specs(cfg)
    except ConfigError as e:
        print(f"config error: {e}")
        return 2
    import jax

    jax.config.update("jax_num_cpu_devices", specs.mesh.cell_size)  # before any backend starts
    devices = jax.devices()
    if len(devices) < specs.mesh.cell_size:  # e.g. one GPU: plan the cell on CPU devices
        devices = jax.devices("cpu")
    from gyre import mesh as gmesh

    cell = gmesh.make_cells(specs.mesh.cell_size, specs.mesh.model_parallel,
                            devices[: specs.mesh.cell_size])[0]  # fmt: skip
    if shapes_flag.value.startswith("qwen3"):  # as a Qwen3 directory's tokenizer sets it
        import dataclasses

        model = dataclasses.replace(specs.model, sample_vocab=QWEN3_TOKENIZER_IDS)
        specs = dataclasses.replace(specs, model=model,
                                    trainer=dataclasses.replace(specs.trainer, model=model),
                                    rollout=dataclasses.replace(specs.rollout, model=model))  # fmt: skip
    from gyre.rl import memory_plan

    tree = None
    if tree_flag.value:
        tree = memory_plan.TreeRow(tree_flag.value, prefix_flag.value, branch_flag.value)
    p = memory_plan.plan(specs, memory, headroom_flag.value, cell, tree=tree)
    out = p.as_dict()
    if auto_flag.value:
        out["auto_rows_per_microbatch"] = memory_plan.auto_rows(specs, memory,
                                                                headroom_flag.value, cell)  # fmt: skip
    if not json_flag.value:
        print(p.table())
        print(p.refusal() if not p.fits else "memory plan: fits")
        if auto_flag.value:
            print(f"train.rows_per_microbatch=auto: {out['auto_rows_per_microbatch']}")
    print(json.dumps(out, sort_keys=True))
    return 0 if p.fits else 1
