"""Frozen settings of the RL runtime itself, and the bundle of every part's spec.

Each part owns its spec next to its code (ModelSpec in gyre/model/decoder.py, TrainerSpec in
gyre/train/step.py, ...); :func:`gyre.rl.builder.build_specs` makes all of them from the
config once, and nothing below the builder reads the config again.
"""

from __future__ import annotations

import dataclasses
import json
import typing

from gyre import bounds
from gyre.agent.context import AgentSettings
from gyre.cluster.spec import ClusterSpec
from gyre.elastic.policy import PolicyParams
from gyre.envs.registry import EnvSpec
from gyre.mesh import MeshSpec
from gyre.model.decoder import ModelSpec
from gyre.rollout.programs import RolloutSpec
from gyre.train.step import TrainerSpec
from gyre.trajectory.batch import TrajectorySpec


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """What the controller runs: ``steps`` RL steps of tasks_per_step x samples_per_task
    executions under ``scheduler_policy`` (a name in gyre/elastic/policy.py POLICIES);
    ``seed`` keys every step's tasks."""

    steps: int
    tasks_per_step: int
    samples_per_task: int
    scheduler_policy: str = "elastic"
    handover: str = "migrate"
    switch_cost_s: float = 0.0
    checkpoint_every: int = 1
    keep_checkpoints: int = 2
    seed: int = 0
    watchdog_s: float = 1800.0  # abort when nothing progresses this long; 0 = off
    # train tokens/s one cell is assumed to do until the run measures its own
    # (scheduler.calibration); the switch cost's seed is switch_cost_s
    seed_train_tps: float = 1000.0

    def __post_init__(self):
        bounds.check(self, "run", checkpoint_every="train.checkpoint_every",
                     keep_checkpoints="train.keep_checkpoints",
                     switch_cost_s="scheduler.switch_cost_s")  # fmt: skip

    @property
    def executions_per_step(self) -> int:
        return self.tasks_per_step * self.samples_per_task


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    """Held-out evaluation: ``tasks`` tasks every ``every`` steps (0: start and end), greedy
    (temperature 0) or sampled at ``temperature``."""

    tasks: int = 0
    every: int = 0
    temperature: float = 0.0
    seed: int = 0

    def __post_init__(self):
        bounds.check(self, "eval")

    def due(self, version: int, last: bool) -> bool:
        """Whether to evaluate after the optimizer step that made weight ``version``."""
        return bool(self.tasks) and (last or bool(self.every and version % self.every == 0))


@dataclasses.dataclass(frozen=True)
class SftRecipe:
    """What the warm start's weights depend on; its hash is the warm-start cache key, so a new
    field here changes the key without any list to update. ``trainer`` and ``trajectory`` are
    the RL specs with the SFT objective, learning rate and packing (token-mean, all paths)."""

    trainer: TrainerSpec
    trajectory: TrajectorySpec
    env: EnvSpec
    batch: int = 16  # demonstrations per step
    mistake_prob: float = 0.1
    context_window: int = 512
    seed: int = 0

    def __post_init__(self):
        bounds.check(self, "sft", context_window="agent.context_window")


@dataclasses.dataclass(frozen=True)
class SftSpec:
    """The supervised warm start (gyre/rl/warmstart.py): a recipe and its stopping rule.

    The stopping rule is not part of the cache key: demonstrations are keyed by step, so a
    longer warm start continues a cached shorter one exactly."""

    recipe: SftRecipe
    steps: int = 0
    target_accuracy: float = 0.0
    eval_every: int = 50
    eval_tasks: int = 16
    dir: str = ""  # "" = the shared cache (gyre/cache.py)

    def __post_init__(self):
        bounds.check(self, "sft", eval_tasks="eval.tasks")

    def done(self, steps: int, accuracy: float) -> bool:
        target = self.target_accuracy
        return steps >= self.steps or bool(target and accuracy >= target)


@dataclasses.dataclass(frozen=True)
class Specs:
    """Every part's spec, as the builder made them (written to <workdir>/specs.json)."""

    name: str
    seed: int
    entry: str  # the library function run.py calls (gyre/run.py ENTRIES)
    init_dir: str  # HF checkpoint directory of the initial weights ("" = random init)
    tiny_init: bool  # init_dir is a tiny checkpoint made in the cache on first use
    mesh: MeshSpec
    model: ModelSpec
    rollout: RolloutSpec
    trainer: TrainerSpec
    trajectory: TrajectorySpec
    agent: AgentSettings
    env: EnvSpec
    scheduler: PolicyParams  # the scheduler policy's parameters
    run: RunSpec
    eval: EvalSpec
    sft: SftSpec
    cluster: ClusterSpec = ClusterSpec()


def to_json(specs: Specs) -> str:
    """The specs as JSON (what :func:`from_json` reads back)."""
    return json.dumps(dataclasses.asdict(specs), indent=2, sort_keys=True)


def from_json(text: str) -> Specs:
    """The :class:`Specs` of :func:`to_json`'s text (e.g. a workdir's specs.json)."""
    return _decode(Specs, json.loads(text))


def _decode(cls, value):
    """``value`` (parsed JSON) as an instance of the type ``cls``: dataclasses field by field,
    tuples from lists, anything else as it is."""
    if dataclasses.is_dataclass(cls):
        hints = typing.get_type_hints(cls)
        return cls(**{f.name: _decode(hints[f.name], value[f.name])
                      for f in dataclasses.fields(cls) if f.name in value})  # fmt: skip
    if typing.get_origin(cls) is tuple:
        args = typing.get_args(cls)
        item = args[0] if args else typing.Any
        return tuple(_decode(item, v) for v in value)
    return value
