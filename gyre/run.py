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
    from gyre.rl.specs import to_json

    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(cfg.to_json_best_effort(indent=2, sort_keys=True))
    with open(os.path.join(workdir, "specs.json"), "w") as f:
        f.write(to_json(specs))


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


def main(cfg, workdir: str, allow_config_change: bool = False, **hooks) -> dict:
    """Runs one experiment. A bad config exits with a one-line message naming the key; a
    relaunch with a config other than the workdir's run is refused unless
    ``allow_config_change``; Ctrl-C or SIGTERM stop after the step in progress (a second one
    at once) with one line saying how to resume (gyre/signals.py).

    hooks: keyword arguments passed to the entry (tests use them, e.g. after_microbatch).
    """
    try:
        validate(cfg)
        from gyre import mesh
        from gyre.rl import builder

        # every part's own checks, the cell layout and the environment, before anything is
        # written into the workdir (a tiny checkpoint may be made in the cache)
        specs = builder.build_specs(cfg)  # touches no JAX backend: the device count comes next
        entry = resolve_entry(specs.entry)
        setup_devices(specs.mesh.cpu_devices)
        if specs.cluster.backend == "local":  # a Ray actor checks its own devices
            mesh.cells_for(specs.mesh)
        builder.environment(specs, with_model=specs.entry in ("rl", "sft"))
    except ConfigError as e:
        sys.exit(f"config error: {e}")
    changes = config_changes(cfg, workdir)
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
        path = os.path.join(workdir, "error.txt")
        with open(path, "w") as f:
            traceback.print_exc(file=f)
        first = (str(e).strip().splitlines() or [""])[0]
        sys.exit(f"error: {type(e).__name__}: {first} (traceback in {path}; relaunch the same "
                 f"command to resume from the last checkpoint)")  # fmt: skip
    except KeyboardInterrupt:
        step = last_checkpoint(workdir)
        where = f"its checkpoint after step {step}" if step else "the start (no step finished)"
        sys.exit(f"interrupted: relaunch the same command to resume {workdir} from {where}")
    from gyre.metrics import write_json

    write_json(os.path.join(workdir, "summary.json"), summary)
    return summary
