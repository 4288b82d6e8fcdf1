"""Trainer checkpoints with orbax: params, optimizer state, counters, RNG, queue position.

Saves are asynchronous (``CheckpointManager.save`` returns while the write goes on; call
:meth:`Checkpointer.wait` or close before exit). Restore reads every array straight into the
shardings of the *new* core cell, so a run may resume on a different number of cells or a
different cell size. Only completed steps are ever listed, so a crash mid-save leaves the last
good checkpoint intact.
"""

from __future__ import annotations

import logging
import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from gyre.model import decoder
from gyre.train import optimizer as topt

log = logging.getLogger(__name__)


class Checkpointer:
    """Thin wrapper over ocp.CheckpointManager with items 'params', 'opt_state', 'meta'.

    The manager is made on first use: making one initialises a JAX backend (orbax asks for the
    process index), which a Ray run's driver, holding a Checkpointer it never uses, must not
    do (on a GPU head node it would take device memory beside the actors)."""

    def __init__(self, directory: str, keep: int = 2):
        if keep < 1:
            raise ValueError(f"train.keep_checkpoints must be >= 1, got {keep}")
        self.directory = os.path.abspath(directory)
        self.keep = keep
        self._manager = None

    @property
    def manager(self) -> ocp.CheckpointManager:
        if self._manager is None:
            self._manager = ocp.CheckpointManager(
                self.directory,
                options=ocp.CheckpointManagerOptions(max_to_keep=self.keep,
                                                     enable_async_checkpointing=True),
            )  # fmt: skip
        return self._manager

    def save(self, step: int, params, opt_state, meta: dict) -> None:
        self.manager.save(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(params),
                opt_state=ocp.args.StandardSave(opt_state),
                meta=ocp.args.JsonSave(meta),
            ),
        )

    def latest_step(self) -> int | None:
        self.manager.wait_until_finished()
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        self.manager.wait_until_finished()
        return list(self.manager.all_steps())

    def restore(self, step: int, abstract_params, abstract_opt_state):
        """-> (params, opt_state, meta), arrays placed as the abstract trees' shardings say."""
        out = self.manager.restore(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardRestore(abstract_params),
                opt_state=ocp.args.StandardRestore(abstract_opt_state),
                meta=ocp.args.JsonRestore(),
            ),
        )
        return out["params"], out["opt_state"], dict(out["meta"])

    def move_aside(self, step: int) -> str:
        """Moves the unreadable checkpoint ``step`` out of the manager's directory into
        ``<directory>.unreadable/<step>`` (kept for inspection) so that the step can be saved
        again when it is re-trained -> where it went."""
        self.manager.wait_until_finished()
        aside = self.directory + ".unreadable"
        os.makedirs(aside, exist_ok=True)
        dest, n = os.path.join(aside, str(step)), 1
        while os.path.exists(dest):  # the same step damaged twice: keep both
            n += 1
            dest = os.path.join(aside, f"{step}.{n}")
        os.replace(os.path.join(self.directory, str(step)), dest)
        self.manager.reload()
        return dest

    def wait(self) -> None:
        if self._manager is not None:  # (none made: nothing written)
            self._manager.wait_until_finished()

    def close(self) -> None:
        if self._manager is not None:
            self._manager.close()


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def _with_shardings(tree, shardings):
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings
    )


def save_trainer(ckpt: Checkpointer, trainer, metadata: dict, wait: bool = False) -> None:
    """Saves a Trainer under its step number (see Trainer.save)."""
    meta = {
        "step": trainer.step,
        "version": trainer.version,
        "microbatches_done": trainer.microbatches_done,
        "rng": np.asarray(jax.random.key_data(trainer.rng)).tolist(),
        "objective": trainer.objective,
        "metadata": metadata,
    }
    ckpt.save(trainer.step, trainer.params, trainer.opt_state, meta)
    if wait:
        ckpt.wait()


def restore_trainer(cls, spec, cells, graphdef, ckpt: Checkpointer, step=None, **kw):
    """Builds ``cls`` (a Trainer) from checkpoint ``step`` on ``cells``. By default the newest
    intact one: an unreadable newer checkpoint (a truncated file, a broken metadata file) is
    skipped with a one-line warning naming it."""
    steps = sorted(ckpt.all_steps(), reverse=True) if step is None else [step]
    if not steps:
        raise FileNotFoundError(f"no checkpoint to restore in {ckpt.directory}")
    core = cells[0]
    _, abstract_params = decoder.abstract_model(spec.model)
    param_sh = decoder.state_shardings(spec.model, core, "train")
    abstract_params = _with_shardings(abstract_params, param_sh)
    tx = topt.make_optimizer(spec.optimizer)
    abstract_opt = topt.abstract_state(tx, abstract_params, param_sh, core.mesh)
    unreadable = []
    for i, step in enumerate(steps):
        try:
            params, opt_state, meta = ckpt.restore(step, abstract_params, abstract_opt)
            break
        except Exception as e:  # orbax raises many types for damaged files
            if i + 1 == len(steps):
                raise OSError(f"no intact checkpoint in {ckpt.directory}: step {step}: "
                              f"{_first_line(e)}") from e  # fmt: skip
            unreadable.append((step, _first_line(e)))
    # An older one read with the same layout, so the newer ones are damaged, not mismatched:
    # they move aside, or their steps, once re-trained, could never be saved.
    for bad, why in unreadable:
        log.warning("checkpoint %d in %s is unreadable (%s); resuming from step %d (moved to %s)",
                    bad, ckpt.directory, why, step, ckpt.move_aside(bad))  # fmt: skip
    rng = jax.random.wrap_key_data(np.asarray(meta["rng"], np.uint32))
    if meta["objective"] != spec.objective:
        raise ValueError(
            f"checkpoint {step} in {ckpt.directory} trained objective {meta['objective']!r}, "
            f"not {spec.objective!r}"
        )
    trainer = cls(spec, cells, graphdef, params, opt_state=opt_state, step=meta["step"],
                  version=meta["version"], rng=rng, **kw)  # fmt: skip
    trainer.microbatches_done = int(meta["microbatches_done"])
    return trainer, meta["metadata"]
