"""Cells: the visible devices cut into K equal slices of one mesh, and role layouts.

Every cell has the same intra-cell mesh, axes ``('data', 'model')`` of shape
``(cell_size // model_parallel, model_parallel)`` with Auto axis types, so a program
compiled for a role runs on any cell. Parameters and activations carry *logical* axis
names ('batch', 'embed', 'mlp', 'heads', 'kv_heads', 'vocab', 'head_dim', 'length');
``RULES`` maps them to mesh axes per role, declared once here:

- train: FSDP over 'data' (parameters sharded along 'embed') plus tensor parallelism
  over 'model'; the batch is split over 'data'.
- rollout: parameters replicated over 'data' (every data shard serves its own KV slots
  without gathering weights each step) and tensor-parallel over 'model'.

A role switch is :func:`move`: ``jax.device_put`` into the target cell's shardings.
Arrays of two cells never meet inside one jit call; they cross only through ``move``.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from gyre import bounds
from gyre.errors import ConfigError

AXES = ("data", "model")
ROLES = ("train", "rollout")

RULES: dict[str, dict[str, str | None]] = {
    "train": {
        "batch": "data",
        "embed": "data",
        "mlp": "model",
        "heads": "model",
        "kv_heads": "model",
        "vocab": "model",
        "head_dim": None,
        "length": None,
        "layers": None,
    },
    "rollout": {
        "batch": "data",
        "embed": None,
        "mlp": "model",
        "heads": "model",
        "kv_heads": "model",
        "vocab": "model",
        "head_dim": None,
        "length": None,
        "layers": None,
    },
}


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """How the devices are cut: ``num_devices`` (0 = all visible) into cells of ``cell_size``
    devices, each a ('data', 'model') mesh with ``model_parallel`` devices on 'model'.

    cpu_devices: devices faked when the platform is CPU (set before JAX starts a backend);
    compilation_cache / cache_dir: the persistent XLA cache and where it lives ("" = the
    shared cache, gyre/cache.py)."""

    cell_size: int = 1
    num_devices: int = 0
    model_parallel: int = 1
    cpu_devices: int = 8
    compilation_cache: bool = True
    cache_dir: str = ""

    def __post_init__(self):
        bounds.check(self, "mesh")


@dataclasses.dataclass(frozen=True)
class Cell:
    """One equal slice of the devices. index 0 is the core cell (it owns the optimizer)."""

    index: int
    mesh: Mesh

    @property
    def devices(self) -> list:
        return list(self.mesh.devices.flat)

    @property
    def size(self) -> int:
        return self.mesh.devices.size

    @property
    def platform(self) -> str:
        return self.devices[0].platform


def make_cells(cell_size: int, model_parallel: int = 1, devices=None) -> list[Cell]:
    """Splits ``devices`` (default: all) into len(devices) // cell_size cells."""
    devices = list(jax.devices() if devices is None else devices)
    if cell_size < 1 or len(devices) % cell_size:
        raise ConfigError(
            f"config key 'mesh.cell_size' ({cell_size}) does not divide the {len(devices)} devices"
        )
    if model_parallel < 1 or cell_size % model_parallel:
        raise ConfigError(
            f"config key 'mesh.model_parallel' ({model_parallel}) must divide "
            f"mesh.cell_size ({cell_size})"
        )
    shape = (cell_size // model_parallel, model_parallel)
    cells = []
    for k in range(len(devices) // cell_size):
        grid = np.array(devices[k * cell_size : (k + 1) * cell_size], dtype=object).reshape(shape)
        cells.append(Cell(k, Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))))
    return cells


def cells_for(spec: MeshSpec, devices=None) -> list[Cell]:
    """The cells of ``spec`` over ``devices`` (default: all visible devices)."""
    devices = list(jax.devices() if devices is None else devices)
    if spec.num_devices:
        if spec.num_devices > len(devices):
            raise ConfigError(
                f"config key 'mesh.num_devices' ({spec.num_devices}) exceeds the "
                f"{len(devices)} visible devices"
            )
        devices = devices[: spec.num_devices]
    return make_cells(spec.cell_size, spec.model_parallel, devices)


def logical_to_spec(logical: tuple | PartitionSpec | None, role: str) -> PartitionSpec:
    """Maps a tuple of logical axis names (None = unsharded dim) to a mesh PartitionSpec."""
    if role not in RULES:
        raise ValueError(f"unknown role {role!r}; expected one of {ROLES}")
    if logical is None:
        return PartitionSpec()
    rules = RULES[role]
    out = []
    for name in tuple(logical):
        if name is None:
            out.append(None)
        elif name not in rules:
            raise ValueError(f"logical axis {name!r} has no rule for role {role!r}")
        else:
            out.append(rules[name])
    return PartitionSpec(*out)


def sharding_for(cell: Cell, role: str, logical, shape=None, name: str = "array") -> NamedSharding:
    """NamedSharding of one array on ``cell`` in ``role``; checks divisibility if shape given."""
    spec = logical_to_spec(logical, role)
    if shape is not None:
        for dim, axis in zip(shape, spec):
            if axis is None:
                continue
            n = cell.mesh.shape[axis]
            if dim % n:
                raise ConfigError(
                    f"{name}: dimension {dim} is not divisible by mesh axis '{axis}' "
                    f"of size {n} (role {role}); change mesh.cell_size or mesh.model_parallel"
                )
    return NamedSharding(cell.mesh, spec)


def tree_shardings(cell: Cell, role: str, logical_tree, abstract_tree):
    """Shardings for a pytree of arrays, given a matching pytree of logical-axis tuples.

    logical_tree leaves are tuples of names (or None); tuples are treated as leaves.
    """
    flat_arrays, treedef = jax.tree_util.tree_flatten_with_path(abstract_tree)
    flat_logical = treedef.flatten_up_to(logical_tree)
    out = []
    for (path, arr), logical in zip(flat_arrays, flat_logical):
        out.append(sharding_for(cell, role, logical, arr.shape, jax.tree_util.keystr(path)))
    return jax.tree_util.tree_unflatten(treedef, out)


def move(tree, target_shardings):
    """Moves a pytree onto other devices/layout. The only way arrays cross between cells."""
    return jax.device_put(tree, target_shardings)


def enable_compilation_cache(path: str) -> str:
    """Persistent XLA cache in ``path``: a relaunch or a role switch never waits on XLA for a
    program compiled before (by any run sharing the folder)."""
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
