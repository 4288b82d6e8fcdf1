"""Config validation: unknown keys, wrong types and impossible layouts are one-line errors."""

import ast
import functools
import glob
import importlib
import os

import ml_collections
import pytest

from gyre.config import BOUNDS, ConfigError, default_config, validate
from gyre.mesh import cells_for
from gyre.rl.builder import build_specs


def check(cfg):
    """What run.py and the builder check before a run starts (on the 8 test devices)."""
    validate(cfg)
    cells_for(build_specs(cfg).mesh)


def test_defaults_validate():
    check(default_config())


def test_unknown_key_is_named_with_suggestion():
    cfg = default_config()
    cfg.train.unlock()
    cfg.train.lrr = 3e-4
    with pytest.raises(
        ConfigError, match=r"unknown config key 'train.lrr' \(did you mean train.lr\?\)"
    ):
        validate(cfg)


def test_unknown_section_is_named():
    cfg = default_config()
    cfg.unlock()
    cfg.trian = {"lr": 1.0}
    with pytest.raises(ConfigError, match="'trian'"):
        validate(cfg)


@pytest.mark.parametrize(
    "section,key,value",
    [
        ("train", "lr", "fast"),
        ("model", "num_layers", 2.5),
        ("model", "tie_embeddings", 1),
        ("mesh", "cell_size", True),
    ],
)
def test_wrong_type_is_named(section, key, value):
    # ConfigDict itself refuses most retyping; a config built from a plain dict does not.
    d = default_config().to_dict()
    d[section][key] = value
    cfg = ml_collections.ConfigDict(d)
    with pytest.raises(ConfigError, match=f"'{section}.{key}' must be"):
        validate(cfg)


def test_int_accepted_for_float():
    cfg = default_config()
    cfg.train.lr = 1
    validate(cfg)


@pytest.mark.parametrize(
    "updates,match",
    [
        ({"mesh.cell_size": 3}, "mesh.cell_size"),
        ({"mesh.num_devices": 16}, "mesh.num_devices"),
        ({"mesh.cell_size": 4, "mesh.model_parallel": 3}, "mesh.model_parallel"),
        (
            {"mesh.cell_size": 4, "mesh.model_parallel": 4, "model.num_kv_heads": 2},
            "model.num_kv_heads",
        ),
        ({"model.num_kv_heads": 3}, "model.num_kv_heads"),
        ({"trajectory.row_len": 100}, "trajectory.row_len"),
        ({"trajectory.loss_mode": "mean"}, "trajectory.loss_mode"),
        ({"scheduler.policy": "fifo"}, "scheduler.policy"),
        ({"rollout.cpu_vector_width": 384}, "rollout.cpu_vector_width"),
        ({"rollout.kv_block": -2}, "rollout.kv_block"),
        ({"env.name": "chess"}, "env.name"),
        ({"train.rows_per_microbatch": -1}, "train.rows_per_microbatch"),
        ({"train.clip_low": 1.5}, "train.clip_low"),
        ({"run.steps": 0}, "steps"),
    ],
)
def test_impossible_layouts_and_choices(updates, match):
    cfg = default_config()
    for path, value in updates.items():
        section, key = path.split(".")
        cfg[section][key] = value
    with pytest.raises(ConfigError, match=match):
        check(cfg)


# Each config key that takes one of a list of values, and the part that owns that list.
CHOICE_OWNERS = {
    "trajectory.loss_mode": ("gyre.trajectory.advantages", "LOSS_MODES"),
    "trajectory.packing": ("gyre.trajectory.batch", "PACKINGS"),
    "trajectory.reward": ("gyre.trajectory.advantages", "REWARDS"),
    "scheduler.policy": ("gyre.elastic.policy", "POLICIES"),
    "scheduler.close_on": ("gyre.elastic.policy", "CLOSE_ON"),
    "scheduler.handover": ("gyre.rollout.types", "HANDOVERS"),
    "env.name": ("gyre.envs.registry", "ENVIRONMENTS"),
    "env.problem_format": ("gyre.envs.published", "FORMATS"),
    "rollout.cpu_vector_width": ("gyre.rollout.types", "CPU_VECTOR_WIDTHS"),
    "rollout.admission": ("gyre.rollout.types", "ADMISSIONS"),
    "model.attention": ("gyre.model.attention", "IMPLS"),
    "model.dtype": ("gyre.model.decoder", "DTYPES"),
    "train.remat": ("gyre.model.decoder", "REMAT_POLICIES"),
    "cluster.backend": ("gyre.cluster.spec", "BACKENDS"),
}


@functools.cache
def _gyre_literals() -> tuple:
    """Every module of gyre/, parsed once: (path from gyre/, module name, its tree, [(node,
    frozenset of its values)] of each tuple, list or set literal of constants)."""
    root = os.path.dirname(importlib.import_module("gyre").__file__)
    out = []
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        module = "gyre." + os.path.relpath(path, root)[:-3].replace(os.sep, ".")
        module = module.removesuffix(".__init__")
        tree = ast.parse(open(path, encoding="utf-8").read())
        literals = [(node, frozenset(e.value for e in node.elts)) for node in ast.walk(tree)
                    if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and node.elts
                    and all(isinstance(e, ast.Constant) for e in node.elts)]  # fmt: skip
        out.append((os.path.relpath(path, root), module, tree, literals))
    return tuple(out)


def _literal_copies(values, owner_module: str, owner_name: str) -> list[str]:
    """Where a tuple, list or set literal in gyre/ spells out ``values`` (the owner's own
    definition aside): 'path:line' each."""
    want, found = frozenset(values), []
    for rel, module, tree, literals in _gyre_literals():
        own = set()
        if module == owner_module:
            for node in ast.walk(tree):
                targets = getattr(node, "targets", [getattr(node, "target", None)])
                if any(isinstance(t, ast.Name) and t.id == owner_name for t in targets):
                    own |= {id(n) for n in ast.walk(node)}
        found += [f"{rel}:{node.lineno}" for node, got in literals
                  if got == want and id(node) not in own]  # fmt: skip
    return found


def test_every_choice_list_has_one_owner(monkeypatch):
    """Every config key that takes one of a list of values is checked against the list of the
    part that owns it: each value it holds is accepted, a value it does not hold is refused,
    one added to a registry is accepted at once, and no copy of the list is written anywhere
    in gyre/ (a copy would keep validating after the part's list changed)."""
    defaults = default_config()
    choice_keys = set()
    for section, group in defaults.items():
        if not isinstance(group, ml_collections.ConfigDict):
            continue
        for key, value in group.items():
            if isinstance(value, str):
                cfg = default_config()
                cfg[section][key] = "no-such-choice"
                try:
                    validate(cfg)
                except ConfigError as e:
                    if "one of" in str(e):
                        choice_keys.add(f"{section}.{key}")
    assert choice_keys <= set(CHOICE_OWNERS), choice_keys - set(CHOICE_OWNERS)
    problems = []
    for path, (module, name) in CHOICE_OWNERS.items():
        section, key = path.split(".")
        owner = getattr(importlib.import_module(module), name, None)
        if owner is None:
            problems.append(f"{path}: no owner list {module}.{name}")
            continue
        for value in owner:
            cfg = default_config()
            cfg[section][key] = value
            validate(cfg)
        cfg = default_config()
        cfg[section][key] = -12345 if isinstance(defaults[section][key], int) else "no-such"
        with pytest.raises(ConfigError, match=path):
            validate(cfg)
        if isinstance(owner, dict):  # a registry: what is registered is a valid choice at once
            with monkeypatch.context() as m:
                m.setitem(owner, "newly-registered", next(iter(owner.values())))
                cfg = default_config()
                cfg[section][key] = "newly-registered"
                validate(cfg)
        problems += [f"{path}: a copy of {module}.{name} at {where}"
                     for where in _literal_copies(owner, module, name)]  # fmt: skip
    assert not problems, "\n".join(problems)


def _numeric_leaves(cfg, prefix=""):
    for key, value in cfg.items():
        if isinstance(value, ml_collections.ConfigDict):
            yield from _numeric_leaves(value, f"{prefix}{key}.")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield f"{prefix}{key}", value


def test_every_numeric_key_has_bounds():
    numeric = dict(_numeric_leaves(default_config()))
    assert set(BOUNDS) == set(numeric), set(BOUNDS) ^ set(numeric)
    for path, default in numeric.items():
        assert default in BOUNDS[path], (path, default)


def _outside(path, default):
    """Values just outside the key's bound (and non-finite ones for float keys)."""
    b, step = BOUNDS[path], 1 if isinstance(default, int) else 1e-3
    out = [] if isinstance(default, int) else [float("nan"), float("inf")]
    if b.lo is not None:
        out.append(b.lo if b.lo_open else type(default)(b.lo - step))
    if b.hi is not None:
        out.append(b.hi if b.hi_open else type(default)(b.hi + step))
    return out


@pytest.mark.parametrize("path", sorted(BOUNDS))
def test_each_bound_rejects_values_outside_it_naming_the_key(path):
    default = dict(_numeric_leaves(default_config()))[path]
    values = _outside(path, default)
    assert values, path
    for value in values:
        cfg = default_config()
        section, _, key = path.rpartition(".")
        (cfg[section] if section else cfg)[key] = value
        with pytest.raises(ConfigError, match=f"'{path}'"):
            validate(cfg)


def test_odd_head_dim_and_env_vocabulary_mismatch_are_config_errors():
    from gyre.rl.builder import environment

    cfg = default_config()
    cfg.model.head_dim = 15
    with pytest.raises(ConfigError, match="model.head_dim"):
        validate(cfg)
    cfg = default_config()
    cfg.model.vocab_size = 30
    with pytest.raises(ConfigError, match="model.vocab_size"):
        environment(build_specs(cfg))
