"""Config validation: unknown keys, wrong types and impossible layouts are one-line errors."""

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
        ({"train.rows_per_microbatch": 0}, "train.rows_per_microbatch"),
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


def test_every_choice_list_has_one_owner():
    """The config's choices are the parts' own lists, not copies."""
    from gyre.elastic.policy import POLICIES
    from gyre.envs.registry import ENVIRONMENTS

    for name in POLICIES:
        cfg = default_config()
        cfg.scheduler.policy = name
        check(cfg)
    for name in ENVIRONMENTS:
        cfg = default_config()
        cfg.env.name = name
        validate(cfg)


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
