"""What ``launch.py`` calls: fake CPU devices, validate, write the resolved config, dispatch.

``cfg.run.entry`` picks the library function; each takes ``(cfg, workdir)`` and returns a
summary dict, which is written to ``<workdir>/summary.json``.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import warnings

from gyre.config import ConfigError, validate

ENTRIES = {
    "smoke": "gyre.rl.experiment:smoke_test",
    "harness": "gyre.rl.experiment:harness",
    "rl": "gyre.rl.experiment:rl",
}


def resolve_entry(name: str):
    if name not in ENTRIES:
        raise ConfigError(f"config key 'run.entry' is {name!r}, not one of {sorted(ENTRIES)}")
    module, fn = ENTRIES[name].split(":")
    return getattr(importlib.import_module(module), fn)


def setup_devices(cfg) -> None:
    """Fakes cfg.mesh.cpu_devices CPU devices; must run before JAX initialises a backend."""
    import jax

    if jax.config.jax_num_cpu_devices != cfg.mesh.cpu_devices:  # tests set it already
        jax.config.update("jax_num_cpu_devices", cfg.mesh.cpu_devices)


def write_config(cfg, workdir: str) -> str:
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "config.json")
    with open(path, "w") as f:
        f.write(cfg.to_json_best_effort(indent=2, sort_keys=True))
    return path


def main(cfg, workdir: str, **hooks) -> dict:
    """Runs one experiment. A bad config exits with a one-line message naming the key.

    hooks: keyword arguments passed to the entry (tests use them, e.g. after_microbatch).
    """
    try:
        validate(cfg)
        setup_devices(cfg)
        entry = resolve_entry(cfg.run.entry)
    except ConfigError as e:
        sys.exit(f"config error: {e}")
    from gyre import mesh

    # CPU cannot reuse donated batch buffers for the gradient outputs; harmless there.
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    write_config(cfg, workdir)
    if cfg.mesh.compilation_cache:
        mesh.enable_compilation_cache(workdir, cfg.mesh.cache_dir)
    try:
        summary = entry(cfg, workdir, **hooks)
    except ConfigError as e:
        sys.exit(f"config error: {e}")
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, sort_keys=True, default=str)
    return summary
