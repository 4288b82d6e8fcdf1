"""The experiment builder: the config becomes frozen specs once, the specs become the parts.

    specs = build_specs(cfg)              # run.py, once: the config's only reader
    rt = build_runtime(specs, workdir)    # an entry: cells, env, weights, trainer, engines
    ctrl = Controller(rt)                 # gyre/rl/controller.py: schedules only

Every spec is a frozen dataclass owned by its part (ModelSpec by the decoder, TrainerSpec by
the trainer, ...), so jit caches and the warm-start cache key on the specs themselves. A spec
that rejects its values raises ValueError; here that becomes a ConfigError naming the key.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import os

from gyre import mesh
from gyre.agent.context import AgentSettings
from gyre.cluster.spec import ClusterSpec
from gyre.elastic import calibration
from gyre.elastic.policy import PolicyParams
from gyre.envs.base import Environment
from gyre.envs.registry import EnvSpec, is_chat, make_env
from gyre.errors import ConfigError
from gyre.model import decoder, hf_dir
from gyre.model.safetensors_io import CheckpointError
from gyre.rl import evaluation
from gyre.rl.specs import EvalSpec, RunSpec, SftRecipe, SftSpec, Specs
from gyre.rl.warmstart import DEMONSTRATED
from gyre.rollout.engine import Engine
from gyre.rollout.programs import RolloutSpec
from gyre.rollout.proxy import Proxy
from gyre.train.checkpoint import Checkpointer
from gyre.train.loss import LossSpec
from gyre.train.optimizer import OptimizerSpec
from gyre.train.step import Trainer, TrainerSpec
from gyre.trajectory.batch import TrajectorySpec

log = logging.getLogger(__name__)


class ConfigKeys:
    """A validated config as flat 'section.key' -> value, recording every key the builder
    reads: a key that reaches no spec (a renamed spec field's old name, say) is an error
    instead of a setting that validates and does nothing."""

    def __init__(self, cfg):
        self.values = flat_keys(cfg.to_dict())
        self.read: set[str] = set()

    def __getitem__(self, key: str):
        self.read.add(key)
        return self.values[key]

    def pick(self, cls, section: str, **extra):
        """``cls`` from the keys of ``section`` named like its fields (plus ``extra``)."""
        names = {f.name for f in dataclasses.fields(cls)} - set(extra)
        given = {k: self[f"{section}.{k}"] for k in names if f"{section}.{k}" in self.values}
        return cls(**given, **extra)

    def unread(self) -> list[str]:
        return sorted(set(self.values) - self.read)


def flat_keys(d: dict, prefix: str = "") -> dict:
    """A nested dict (a ConfigDict's to_dict()) as flat 'section.key' -> value."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat_keys(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _checkpoint_model(path: str, model: decoder.ModelSpec, seed: int):
    """(directory, architecture, tiny) of ``model.hf_dir``; reads, never writes.

    "" = none (random init from the config's architecture); "tiny" = a tiny Qwen3 directory
    of the config's architecture with a locally trained tokenizer, made in the cache on first
    use (:func:`prepare`; gyre/model/tiny_checkpoint.py): CPU runs of chat tasks go through
    the same loading path as a real checkpoint. A directory with a tokenizer (a Hugging Face
    Qwen3 checkpoint) defines the architecture: the config's model.* keys then only set what
    config.json does not hold (attention implementation, dtype). A directory without one (a
    ledger export) must match the config's architecture (checked here, from its config.json).
    """
    if path == "tiny":
        from gyre.cache import cache_path
        from gyre.model.tiny_checkpoint import tiny_qwen3_path

        return tiny_qwen3_path(cache_path("tiny_qwen3"), model, seed), model, True
    if path:
        ckpt = _read_checkpoint(path, model)
        if ckpt.text is not None:
            return path, ckpt.spec, False
        diff = [f"{f.name}: checkpoint {getattr(ckpt.spec, f.name)!r}, config "
                f"{getattr(model, f.name)!r}" for f in dataclasses.fields(model)
                if getattr(ckpt.spec, f.name) != getattr(model, f.name)]  # fmt: skip
        if diff:
            raise ConfigError(f"config key 'model.hf_dir' ({path}): the checkpoint's "
                              f"architecture differs from the config's ({'; '.join(diff)})")  # fmt: skip
    return path, model, False


@functools.cache  # the specs check reads it, the runtime loads it: the files are read once
def _read_checkpoint(path: str, base: decoder.ModelSpec) -> hf_dir.Checkpoint:
    try:
        return hf_dir.read(path, base)
    except ValueError as e:  # CheckpointError names the file and the field
        raise ConfigError(f"config key 'model.hf_dir' ({path}): {e}") from e


def _seed_train_tps(name: str) -> float:
    """Train tokens/s of one cell in the calibration ``name``: the policy's figure until the
    run has timed its own micro-batches."""
    try:
        tps = calibration.load(name).train_tokens_per_s()
    except ValueError as e:
        raise ConfigError(f"config key 'scheduler.calibration': {e}") from e
    return tps if math.isfinite(tps) else 1e9


def build_specs(cfg) -> Specs:
    """Every part's spec from a validated config, read once (run.py calls it, and then only
    the specs travel); a value a part rejects, or a key no spec takes, is a ConfigError.
    Writes nothing."""
    keys = ConfigKeys(cfg)
    try:
        specs = _build(keys)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from e
    if keys.unread():
        raise ConfigError(f"config keys {keys.unread()} reach no spec: the builder "
                          "(gyre/rl/builder.py) must map them or config.py drop them")  # fmt: skip
    return specs


def _build(keys: ConfigKeys) -> Specs:
    seed, entry = keys["seed"], keys["run.entry"]
    init_dir, model, tiny = _checkpoint_model(keys["model.hf_dir"],
                                              keys.pick(decoder.ModelSpec, "model"), seed)  # fmt: skip
    env_name, sft_steps = keys["env.name"], keys["sft.steps"]
    if keys["cluster.backend"] == "ray" and (sft_steps or entry != "rl"):
        raise ConfigError("config key 'cluster.backend' ('ray') runs the RL entry without a "
                          "warm start: set sft.steps=0 (start from a warm start's export "
                          "with model.hf_dir) and run.entry='rl'")  # fmt: skip
    if is_chat(env_name) and sft_steps and env_name not in DEMONSTRATED:
        raise ConfigError(f"config key 'sft.steps' must be 0 for the chat task {env_name!r}: "
                          f"the warm start has demonstrations of {list(DEMONSTRATED)} only")  # fmt: skip
    rows = keys["train.rows_per_microbatch"]  # 0 = auto: check_memory sets it
    rows_auto, rows = rows == 0, rows or TrainerSpec.rows_per_microbatch
    trainer = TrainerSpec(
        model=model,
        optimizer=keys.pick(OptimizerSpec, "train"),
        loss=keys.pick(LossSpec, "train"),
        rows_per_microbatch=rows,
        max_bad_steps=keys["train.max_bad_steps"],
        seed=seed,
        remat=keys["train.remat"],
        logits_chunk=keys["train.logits_chunk"],
        tree_schedule=keys["train.tree_schedule"],
        rows_auto=rows_auto,
    )
    trajectory = keys.pick(TrajectorySpec, "trajectory", vocab_size=model.vocab_size,
                           rows_per_microbatch=rows)  # fmt: skip
    env = keys.pick(EnvSpec, "env", max_wrong=keys["agent.max_retries"], seed=seed)
    sft_seed = seed if keys["sft.seed"] < 0 else keys["sft.seed"]
    context_window = keys["agent.context_window"]
    # The recipe holds only what the warm start uses, so RL-only settings (the reward, the
    # packing ablation, PPO clipping) leave its cache key, and its cached weights, alone.
    recipe = SftRecipe(
        trainer=dataclasses.replace(
            trainer,
            objective="sft",
            seed=sft_seed,
            loss=LossSpec(),
            optimizer=dataclasses.replace(trainer.optimizer, lr=keys["sft.lr"]),
        ),  # fmt: skip
        # every path of a demonstration is a target, each token weighing the same
        trajectory=TrajectorySpec(
            model.vocab_size,
            max_paths=0,
            loss_mode="token-mean",
            row_len=trajectory.row_len,
            rows_per_microbatch=trajectory.rows_per_microbatch,
        ),  # fmt: skip
        # the task only: demonstrations never call a tool, so tool limits, injected faults
        # and the RL seed leave the warm start (and its cache key) as it is
        env=dataclasses.replace(env, tool_timeout=EnvSpec.tool_timeout, fault_rate=0.0, seed=0),
        batch=keys["sft.batch"],
        mistake_prob=keys["sft.mistake_prob"],
        context_window=context_window,
        seed=sft_seed,
    )
    eval_tasks = keys["eval.tasks"]
    return Specs(
        name=keys["name"],
        seed=seed,
        entry=entry,
        init_dir=init_dir,
        tiny_init=tiny,
        mesh=keys.pick(mesh.MeshSpec, "mesh"),
        model=model,
        rollout=keys.pick(RolloutSpec, "rollout", model=model, seed=seed),
        trainer=trainer,
        trajectory=trajectory,
        agent=keys.pick(
            AgentSettings,
            "agent",
            max_new_tokens=keys["rollout.max_new_tokens"],
            partial_scale=keys["env.partial_scale"],
        ),  # fmt: skip
        env=env,
        scheduler=keys.pick(PolicyParams, "scheduler"),
        run=keys.pick(
            RunSpec,
            "run",
            scheduler_policy=keys["scheduler.policy"],
            handover=keys["scheduler.handover"],
            switch_cost_s=keys["scheduler.switch_cost_s"],
            checkpoint_every=keys["train.checkpoint_every"],
            keep_checkpoints=keys["train.keep_checkpoints"],
            seed=seed,
            seed_train_tps=_seed_train_tps(keys["scheduler.calibration"]),
        ),  # fmt: skip
        cluster=keys.pick(ClusterSpec, "cluster"),
        eval=EvalSpec(eval_tasks, keys["eval.every"], keys["eval.temperature"], seed),
        sft=SftSpec(
            recipe,
            sft_steps,
            keys["sft.target_accuracy"],
            keys["sft.eval_every"],
            max(eval_tasks, 16),
            keys["sft.dir"],
        ),  # fmt: skip
    )


def check_memory(specs: Specs) -> Specs:
    """Refuses (ConfigError, one line naming the largest term and the setting to change) a
    run whose memory plan does not fit its devices (gyre/rl/memory_plan.py); checks nothing
    where devices report no memory (CPU). With ``train.rows_per_microbatch`` 0 (auto) -> the
    specs with the largest count that fits (unchanged where nothing is checked). Call after
    the devices are set up, before writing."""
    from gyre.rl import memory_plan

    if specs.cluster.backend != "local":
        return specs
    memory = memory_plan.device_memory(memory_plan.plan_cell(specs))
    if specs.trainer.rows_auto and memory is not None:
        rows = memory_plan.auto_rows(specs, memory)
        if rows:  # else not even the smallest count fits: the check below says what does not
            specs = dataclasses.replace(
                specs,
                trainer=dataclasses.replace(specs.trainer, rows_per_microbatch=rows),
                trajectory=dataclasses.replace(specs.trajectory, rows_per_microbatch=rows),
            )
    memory_plan.check(specs, memory)
    return specs


def prepare(specs: Specs) -> None:
    """Makes the inputs the specs name but nobody ships: the tiny checkpoint of a ``tiny``
    run, in the cache (once; named by what it depends on)."""
    if specs.tiny_init and not os.path.isdir(specs.init_dir):
        from gyre.model.tiny_checkpoint import cached_tiny_qwen3

        cached_tiny_qwen3(os.path.dirname(specs.init_dir), specs.model, specs.seed)


@dataclasses.dataclass
class Runtime:
    """The parts of one RL run, built from its specs (see :func:`build_runtime`)."""

    specs: Specs
    workdir: str
    cells: list
    env: Environment
    graphdef: object
    trainer: Trainer
    checkpointer: Checkpointer
    proxy: Proxy
    resumed: bool  # the trainer came from a checkpoint in the workdir
    cluster: object = None  # the Ray actors' handles (gyre/cluster/remote.py); None in-process

    def path(self, name: str) -> str:
        return os.path.join(self.workdir, name)

    def final_params(self):
        """The trainer's current weights, for an export (fetched to the host from Ray)."""
        return self.trainer.params if self.cluster is None else self.cluster.host_params()

    def close(self) -> None:
        """Waits for checkpoint writes; ends the Ray actors (and a Ray instance it started)."""
        self.checkpointer.close()
        if self.cluster is not None:
            self.cluster.close()

    def install(self, params) -> None:
        """Starts RL from ``params`` (e.g. the warm start) at version 0."""
        self.trainer = Trainer(self.specs.trainer, self.cells, self.graphdef, params)
        self.proxy.set_weights(self.trainer.params, self.trainer.version)

    def evaluate_now(self, params, num_tasks: int, seed: int, temperature: float = 0.0,
                     on_call=None) -> dict:  # fmt: skip
        """Evaluation of ``params`` outside the RL loop (e.g. during the warm start);
        on_call() after every model call (a watchdog's beat)."""

        async def go():
            pump = asyncio.create_task(self.proxy.run())
            client = evaluation.Notifying(self.proxy, on_call) if on_call else self.proxy
            try:
                return await evaluation.evaluate(self.env, client, self.specs.agent,
                                                 num_tasks, seed, temperature)  # fmt: skip
            finally:
                pump.cancel()

        self.proxy.set_weights(params, self.trainer.version)
        return asyncio.run(go())

    def init_params(self, seed: int):
        """Fresh weights from ``seed``, in the core cell's train layout."""
        return decoder.init_sharded(self.specs.model, seed, self.cells[0], "train")[1]


def text_checkpoint(specs: Specs):
    """The run's Hugging Face checkpoint (gyre.model.hf_dir.Checkpoint) when ``model.hf_dir``
    is one with a tokenizer, else None (no checkpoint, or a ledger export). Read once."""
    prepare(specs)
    if not specs.init_dir:
        return None
    ckpt = _read_checkpoint(specs.init_dir, specs.model)
    return ckpt if ckpt.text is not None else None


def load_initial(specs: Specs, cell):
    """The weights of ``specs.init_dir`` on ``cell`` (its architecture was checked against
    the config's when the specs were built)."""
    prepare(specs)
    ckpt = _read_checkpoint(specs.init_dir, specs.model)
    try:
        return hf_dir.load_params(ckpt, cell, "train")
    except CheckpointError as e:
        raise ConfigError(f"config key 'model.hf_dir' ({specs.init_dir}): {e}") from e


def environment(specs: Specs, with_model: bool = True):
    """The run's environment, checked against the model when one samples from it (run.py
    calls it before writing anything, so a mismatch costs one line, not a half-made
    workdir)."""
    if is_chat(specs.env.name):
        return make_env(specs.env, chat_format(specs))
    env = make_env(specs.env)
    if with_model and env.vocab_size != specs.model.vocab_size:
        # A larger model vocabulary would sample ids the environment cannot read.
        raise ConfigError(
            f"config key 'model.vocab_size' ({specs.model.vocab_size}) must equal the "
            f"{specs.env.name} vocabulary ({env.vocab_size})"
        )
    return env


def chat_format(specs: Specs):
    """The checkpoint's tokenizer and chat template, for chat environments; ConfigError
    without a checkpoint that has them."""
    from gyre.chat.format import ChatFormat

    ckpt = text_checkpoint(specs)
    if ckpt is None and specs.init_dir:
        raise ConfigError(f"config key 'model.hf_dir' ({specs.init_dir}): "
                          f"{os.path.join(specs.init_dir, 'tokenizer.json')}: missing (the chat "
                          f"task {specs.env.name!r} needs the checkpoint's tokenizer)")  # fmt: skip
    if ckpt is None:
        raise ConfigError(
            f"config key 'env.name' ({specs.env.name!r}) is a chat task: set model.hf_dir to a "
            "Qwen3 checkpoint directory with its tokenizer (or 'tiny' for a small local one)"
        )
    try:
        return ChatFormat.from_checkpoint(ckpt, keep_thinking=specs.env.keep_thinking,
                                          enable_thinking=specs.env.enable_thinking)  # fmt: skip
    except ValueError as e:
        raise ConfigError(f"config key 'model.hf_dir' ({specs.init_dir}): {e}") from e


def initial_trainer(specs: Specs, cells, graphdef, ckpt: Checkpointer) -> tuple[Trainer, bool]:
    """The trainer on ``cells`` (cells[0] the core): restored from ``ckpt`` when it holds a
    checkpoint (the initial weights are then never made), else from ``model.hf_dir`` or a
    fresh init from the seed -> (trainer, resumed)."""
    if ckpt.latest_step() is not None:
        trainer, _ = Trainer.restore(specs.trainer, cells, graphdef, ckpt)
        log.info("resumed at version %d from %s", trainer.version, ckpt.directory)
        return trainer, True
    params = (load_initial(specs, cells[0]) if specs.init_dir
              else decoder.init_sharded(specs.model, specs.seed, cells[0], "train")[1])  # fmt: skip
    return Trainer(specs.trainer, cells, graphdef, params), False


def build_runtime(specs: Specs, workdir: str, params=None) -> Runtime:
    """Cells, environment, weights (``params``, a checkpoint in the workdir, or a fresh init
    from the seed), trainer, one rollout engine per cell and the proxy over them. With
    ``cluster.backend=ray`` the cells, trainer and engines live in Ray actors
    (gyre/cluster/remote.py; ``params`` is not used there) and the runtime holds their
    handles."""
    env = environment(specs)
    graphdef, _ = decoder.abstract_model(specs.model, specs.seed)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), specs.run.keep_checkpoints)
    cluster = None
    if specs.cluster.backend == "ray":
        cluster, cells, trainer, engines = _ray_parts(specs, workdir)
        resumed = trainer.resumed
    else:
        cells = mesh.cells_for(specs.mesh)
        if params is not None and ckpt.latest_step() is None:
            trainer, resumed = Trainer(specs.trainer, cells, graphdef, params), False
        else:
            trainer, resumed = initial_trainer(specs, cells, graphdef, ckpt)
        engines = [Engine(specs.rollout, cell, trainer.params_for(cell, "rollout"),
                          trainer.version) for cell in cells]  # fmt: skip
    proxy = Proxy(engines, specs.rollout.admission)
    proxy.latest_weights = (trainer.params, trainer.version)
    return Runtime(specs, workdir, cells, env, graphdef, trainer, ckpt, proxy, resumed, cluster)


def _ray_parts(specs: Specs, workdir: str):
    """The Ray actors of ``specs`` and the handles standing for their cells, trainer and
    engines -> (cluster, cells, trainer, engines); actor 0 builds its trainer with
    :func:`initial_trainer`, as the in-process run does."""
    from gyre.cluster.remote import RayCluster, RemoteCell, RemoteEngine, RemoteTrainer

    cluster = RayCluster(specs, workdir, initial_trainer)
    try:
        trainer = RemoteTrainer(cluster)
        cells = [RemoteCell(i, specs.mesh.cell_size, cluster.platform)
                 for i in range(specs.cluster.num_cells)]  # fmt: skip
        engines = [RemoteEngine(cluster, c, specs.rollout, trainer.version) for c in cells]
    except BaseException:
        cluster.close()
        raise
    return cluster, cells, trainer, engines
