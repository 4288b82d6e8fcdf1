"""The config's one boundary: every key reaches a spec, the specs travel alone.

gyre/run.py validates the ConfigDict, builds the specs once (gyre/rl/builder.py), writes them to
specs.json and hands only them on. These tests pin the three halves of that promise: no key
is read by nobody, no module below the builder sees a ConfigDict, and specs.json reads back
as the specs that ran.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from gyre.config import default_config, validate
from gyre.errors import ConfigError
from gyre.rl import builder
from gyre.rl.specs import Specs, from_json, to_json

# A valid value other than the default, for keys whose generic change (below) is invalid or
# means nothing; strings all need one.
CHANGED = {
    "name": "other",
    "mesh.cpu_devices": 4,
    "mesh.cache_dir": "/somewhere/xla",
    "model.head_dim": 32,
    "model.num_heads": 8,
    "model.num_kv_heads": 1,
    "model.attention": "dense",
    "model.dtype": "bfloat16",
    "model.hf_dir": "tiny",  # resolved to a cache path; building writes nothing
    "trajectory.row_len": 2048,
    "trajectory.loss_mode": "token-mean",
    "trajectory.packing": "flat",
    "trajectory.reward": "binary",
    "rollout.kv_block": 64,
    "rollout.decode_steps": 4,
    "rollout.cpu_vector_width": 256,
    "rollout.admission": "resident",
    "scheduler.close_on": "own",
    "train.remat": "full",
    "cluster.backend": "ray",
    "cluster.address": "auto",
    "env.name": "code",
    "env.tasks": "chain_sum",
    "env.problem_file": "/somewhere/set.jsonl",
    "env.problem_format": "mbpp",
    "run.entry": "sft",
    "scheduler.policy": "async",
    "scheduler.handover": "retry",
    "scheduler.calibration": "h200_2p4t",
    "sft.dir": "/somewhere/warmstarts",
    "sft.seed": 5,
}


def _flat_keys(c, prefix=""):
    for key in c.keys():
        value = c[key]
        if hasattr(value, "keys"):
            yield from _flat_keys(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _changed(key: str, value):
    if key in CHANGED:
        return CHANGED[key]
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value / 2 if value > 0 else 0.25
    raise AssertionError(f"no changed value for the string key {key!r}: add it to CHANGED")


def _set(cfg, key: str, value) -> None:
    section, _, name = key.rpartition(".")
    (cfg[section] if section else cfg)[name] = value


KEYS = [k for k, _ in _flat_keys(default_config())]


@pytest.mark.parametrize("key", KEYS)
def test_every_config_key_changes_the_specs(key):
    base = builder.build_specs(default_config())
    cfg = default_config()
    _set(cfg, key, _changed(key, dict(_flat_keys(cfg))[key]))
    validate(cfg)
    assert builder.build_specs(cfg) != base, f"config key {key!r} changes no spec"


def test_a_key_no_spec_takes_is_refused(monkeypatch):
    """A key that validates but that the builder never reads (a renamed spec field's old
    name, say) is an error, not a silent no-op."""
    cfg = default_config()
    cfg.train.old_name = 1.0
    with pytest.raises(ConfigError, match=r"\['train\.old_name'\] reach no spec"):
        builder.build_specs(cfg)


def test_specs_json_reads_back_as_the_specs():
    cfg = default_config()
    cfg.model.hf_dir = "tiny"
    cfg.scheduler.policy = "async"
    specs = builder.build_specs(cfg)
    back = from_json(to_json(specs))
    assert isinstance(back, Specs) and back == specs
    assert hash(back) == hash(specs)  # tuples stay tuples: specs key jit caches


def test_building_specs_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("GYRE_CACHE_DIR", str(tmp_path / "cache"))
    cfg = default_config()
    cfg.model.hf_dir = "tiny"
    specs = builder.build_specs(cfg)
    assert specs.init_dir.startswith(str(tmp_path / "cache")) and specs.tiny_init
    assert not (tmp_path / "cache").exists()


PACKAGE = pathlib.Path(builder.__file__).resolve().parents[1]
# Where a ConfigDict may appear: its definition, the boundaries (the run, and the memory
# plan's command line, which builds specs as the run does), and the builder they call.
CONFIG_READERS = {"config.py", "run.py", "plan.py", "rl/builder.py"}


def test_no_module_below_the_builder_receives_a_config():
    """Statically: no module outside config, run and the builder imports ml_collections or
    gyre.config, calls build_specs, or takes an argument named ``cfg`` (the imports are what
    guard; the name check catches the common way a config would be handed down)."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = str(path.relative_to(PACKAGE))
        if name in CONFIG_READERS:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                mods = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                )
                if any(m.startswith("ml_collections") or m == "gyre.config" for m in mods):
                    offenders.append(f"{name}:{node.lineno} imports {mods}")
            if isinstance(node, ast.Attribute) and node.attr == "build_specs":
                offenders.append(f"{name}:{node.lineno} calls build_specs")
            if isinstance(node, ast.arg) and node.arg == "cfg":
                offenders.append(f"{name}:{node.lineno} takes a 'cfg' argument")
    assert not offenders, offenders


def test_spec_defaults_equal_the_config_defaults():
    """A spec built in code (a notebook, a test) behaves as one built from the default
    config: where a spec field has a default, it is the config key's default."""
    import dataclasses

    from gyre.agent.context import AgentSettings
    from gyre.cluster.spec import ClusterSpec
    from gyre.elastic.policy import PolicyParams
    from gyre.envs.registry import EnvSpec
    from gyre.mesh import MeshSpec
    from gyre.rollout.programs import RolloutSpec
    from gyre.train.loss import LossSpec
    from gyre.train.optimizer import OptimizerSpec
    from gyre.trajectory.batch import TrajectorySpec

    sections = {"mesh": [MeshSpec], "cluster": [ClusterSpec], "agent": [AgentSettings],
                "env": [EnvSpec], "rollout": [RolloutSpec], "trajectory": [TrajectorySpec],
                "train": [OptimizerSpec, LossSpec], "scheduler": [PolicyParams]}  # fmt: skip
    cfg, differ = default_config(), []
    for section, classes in sections.items():
        for cls in classes:
            for f in dataclasses.fields(cls):
                if f.name in cfg[section] and f.default is not dataclasses.MISSING:
                    if f.default != cfg[section][f.name]:
                        differ.append(f"{section}.{f.name}: config {cfg[section][f.name]!r}, "
                                      f"{cls.__name__} {f.default!r}")  # fmt: skip
    assert not differ, differ


def test_a_spec_built_in_code_is_held_to_the_config_s_intervals():
    """One table of intervals (gyre/bounds.py): config.validate and every spec read it, so a
    value a config refuses is refused by the spec built in a notebook too, naming the key."""
    from gyre.agent.context import AgentSettings
    from gyre.elastic.policy import PolicyParams
    from gyre.envs.registry import EnvSpec
    from gyre.train.optimizer import OptimizerSpec

    cases = [
        (lambda: EnvSpec(fault_rate=1.0), r"env\.fault_rate must be in \[0, 1\)"),
        (lambda: AgentSettings(max_new_tokens=0), r"rollout\.max_new_tokens must be >= 1"),
        (lambda: OptimizerSpec(b2=1.0), r"train\.b2 must be in \[0, 1\)"),
        (lambda: PolicyParams(leave_round_trips=-1.0), r"scheduler\.leave_round_trips"),
    ]
    for make, message in cases:
        with pytest.raises(ValueError, match=message):
            make()
    cfg = default_config()
    cfg.env.fault_rate = 1.0
    with pytest.raises(ConfigError, match="env.fault_rate"):
        validate(cfg)


def test_a_scheduler_knob_is_a_field_and_a_config_line(monkeypatch):
    """The README's recipe: a PolicyParams field declared with its default and interval
    (gyre/elastic/policy.py) and one config line (gyre/config.py) are all a knob needs."""
    import dataclasses

    from gyre import bounds, config
    from gyre.elastic import policy

    Knobbed = dataclasses.make_dataclass(
        "PolicyParams",
        [("my_knob", float, bounds.knob(1.0, bounds.Bound(0)))],
        bases=(policy.PolicyParams,),
        frozen=True,
    )
    monkeypatch.setattr(policy, "PolicyParams", Knobbed)  # the field, in its module ...
    monkeypatch.setattr(builder, "PolicyParams", Knobbed)  # (the builder's import of it)
    monkeypatch.setattr(config, "PolicyParams", Knobbed)
    make = config.default_config

    def with_line():  # ... and the one config line
        c = make()
        c.scheduler.my_knob = Knobbed.__dataclass_fields__["my_knob"].default
        return c

    monkeypatch.setattr(config, "default_config", with_line)
    sections = [(s, Knobbed if s == "scheduler" else c) for s, c in config.SPEC_SECTIONS]
    monkeypatch.setattr(config, "BOUNDS", {**bounds.BOUNDS, **bounds.declared(sections)})
    cfg = with_line()
    cfg.scheduler.my_knob = 2.5
    config.validate(cfg)
    assert builder.build_specs(cfg).scheduler.my_knob == 2.5
    cfg.scheduler.my_knob = -1.0
    with pytest.raises(ConfigError, match="'scheduler.my_knob' must be >= 0"):
        config.validate(cfg)
    with pytest.raises(ValueError, match="scheduler.my_knob must be >= 0"):
        Knobbed(my_knob=-1.0)
