"""One process's cells: their rollout engines, gradient programs and (actor 0) the trainer.

A :class:`CellWorker` is what a Ray actor holds (gyre/cluster/remote.py), and it is plain
Python: every method takes and returns host data (requests, micro-batches, responses, metrics,
:class:`~gyre.cluster.transfer.Ticket` s), so the driver's mirrors stay exact and tests can
drive it without Ray. Arrays never leave the process except through the transfer point:

- weights: the core (actor 0, cell 0, the optimizer's owner) reshards its parameters into the
  receiver's role layout on its own mesh and offers them; the receiver pulls the same specs;
- gradients: a train cell offers its micro-batch gradient in the 'train' layout; the core
  pulls it into its own 'train' layout at once, so a later loss of that cell loses nothing
  computed;
- KV rows: a migrating request's rows are offered by the source cell and pulled by the
  target cell's engine (the same 'rollout' specs).

Cells of one worker move between each other with ``jax.device_put`` (gyre/mesh.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import os

import jax
import numpy as np

from gyre import mesh
from gyre.cluster.transfer import Ticket, TransferPoint, retarget
from gyre.model import decoder
from gyre.rollout.engine import Engine, SlotExport
from gyre.train.checkpoint import Checkpointer
from gyre.train.step import gradient_program, microbatch_grads


def _target(shardings, leaves):
    """ShapeDtypeStructs over ``shardings`` (a pytree) from the sender's leaf (shape, dtype)s."""
    flat, treedef = jax.tree.flatten(shardings)
    if len(flat) != len(leaves):
        raise ValueError(f"transfer of {len(leaves)} arrays into a tree of {len(flat)}")
    return treedef.unflatten([jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=s)
                              for s, (shape, dtype) in zip(flat, leaves)])  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Offer:
    """A ticket and the offered leaves' (shape, dtype) in tree order (what a pull needs)."""

    ticket: Ticket
    leaves: tuple


class CellWorker:
    """The cells ``specs.cluster.cells_of(actor)`` on this process's first devices.

    Actor 0 also builds the trainer, in :meth:`load`, with ``make_trainer(specs, cells,
    graphdef, checkpointer) -> (trainer, resumed)``: the builder passes its own (gyre/rl/builder.py,
    ``initial_trainer``: restored from ``<workdir>/checkpoints`` when one exists, else the
    initial weights), so an actor's trainer is made exactly as the in-process one.
    """

    def __init__(self, specs, workdir: str, actor: int, host: str = "127.0.0.1",
                 make_trainer=None):  # fmt: skip
        if actor == 0 and make_trainer is None:
            raise ValueError("actor 0 holds the core cell: it needs make_trainer")
        self.specs, self.actor = specs, actor
        indices = specs.cluster.cells_of(actor)
        size = specs.mesh.cell_size
        devices = jax.devices()
        if len(devices) < size * len(indices):
            raise ValueError(f"actor {actor} sees {len(devices)} devices, its "
                             f"{len(indices)} cell(s) of {size} need {size * len(indices)}")  # fmt: skip
        local = mesh.make_cells(size, specs.mesh.model_parallel, devices[: size * len(indices)])
        self.cells = {i: dataclasses.replace(c, index=i) for i, c in zip(indices, local)}
        self.point = TransferPoint(host)
        self.graphdef, self.abstract = decoder.abstract_model(specs.model, specs.seed)
        self.engines: dict[int, Engine] = {}
        self.train_params: dict[int, tuple[int, object]] = {}  # cell -> (version, params)
        self.grads: dict[str, object] = {}  # gradients held here, by key
        self._keys = itertools.count()
        self.trainer = self.checkpointer = None
        self.resumed = False
        self._workdir, self._make_trainer = workdir, make_trainer

    def load(self) -> dict:
        """Actor 0: builds the trainer (restored from the workdir's checkpoints, or the initial
        weights) -> its status. Apart from the start so that it has its own deadline
        (``cluster.load_timeout_s``); a worker of another actor has nothing to load."""
        if self.actor != 0:
            return {}
        if self.trainer is None:
            self.checkpointer = Checkpointer(os.path.join(self._workdir, "checkpoints"),
                                             self.specs.run.keep_checkpoints)  # fmt: skip
            cells = [self.cells[i] for i in self.specs.cluster.cells_of(0)]
            self.trainer, self.resumed = self._make_trainer(self.specs, cells, self.graphdef,
                                                            self.checkpointer)  # fmt: skip
        return self.status()

    # ------------------------------------------------------------------ transfers

    def address(self) -> str:
        return self.point.address

    def transfer_stats(self) -> dict:
        return dict(self.point.stats)

    def _offer(self, tree) -> Offer:
        leaves = tuple((x.shape, x.dtype.str) for x in jax.tree.leaves(tree))
        return Offer(self.point.offer(tree), leaves)

    def _pull(self, offer: Offer, shardings, cell: int):
        """``offer``'s pytree in ``shardings``' specs on local cell ``cell``."""
        target = _target(retarget(shardings, self.cells[cell].mesh), offer.leaves)
        return self.point.pull(offer.ticket, target)

    # ------------------------------------------------------------------ weights (core)

    def status(self) -> dict:
        """The core's counters (the driver's mirror of the trainer)."""
        t = self.trainer
        return {"version": t.version, "step": t.step, "microbatches_done": t.microbatches_done,
                "resumed": self.resumed}  # fmt: skip

    def offer_weights(self, role: str) -> Offer:
        """The core's current parameters in ``role``'s layout (on the core's mesh)."""
        return self._offer(self.trainer.params_for(self.trainer.core, role))

    def _weights(self, cell: int, role: str, offer: Offer | None):
        if offer is None:  # this process holds the trainer: an in-process move
            return self.trainer.params_for(self.cells[cell], role)
        return self._pull(offer, decoder.state_shardings(self.specs.model, self.cells[cell], role),
                          cell)  # fmt: skip

    def host_params(self):
        """The core's parameters on the host (an export)."""
        return jax.device_get(self.trainer.params)

    # ------------------------------------------------------------------ rollout

    def engine_status(self, cell: int) -> dict:
        e = self.engines[cell]
        return {"num_live": e.num_live, "free_slots": e.free_slots(), "room": e.room(),
                "live_ids": e.live_ids(), "capacity": e.capacity_contexts(), "pool": e.pool(),
                "stats": dict(e.stats), "budget": e.budget}  # fmt: skip

    def resume(self, cell: int, offer: Offer | None, version: int) -> dict:
        """Brings ``cell`` into rollout with the weights of ``version`` (its engine is made on
        first use: its programs compile, or load from the persistent cache, here)."""
        state = self._weights(cell, "rollout", offer)
        if cell not in self.engines:
            self.engines[cell] = Engine(self.specs.rollout, self.cells[cell], state, version)
        else:
            self.engines[cell].resume(state, version)
        return self.engine_status(cell)

    def set_weights(self, cell: int, offer: Offer | None, version: int) -> dict:
        self.engines[cell].set_weights(self._weights(cell, "rollout", offer), version)
        return self.engine_status(cell)

    def warmup(self, cell: int) -> dict:
        self.engines[cell].warmup()
        return self.engine_status(cell)

    def submit(self, cell: int, request, rid: int) -> dict:
        self.engines[cell].submit(request, rid)
        return self.engine_status(cell)

    def step(self, cell: int):
        """One engine step -> (finished [(rid, response)], rids admitted, status)."""
        admitted: list[int] = []
        self.engines[cell].on_admit = admitted.append
        done = self.engines[cell].step()
        return done, admitted, self.engine_status(cell)

    def cancel(self, cell: int, rid: int) -> dict:
        self.engines[cell].cancel(rid)
        return self.engine_status(cell)

    def suspend(self, cell: int) -> dict:
        self.engines[cell].suspend()
        return self.engine_status(cell)

    def export(self, cell: int, rid: int):
        """A live request lifted out; its KV rows (if it had a slot) offered -> (SlotExport with
        an :class:`Offer` for rows, status)."""
        exp = self.engines[cell].export(rid)
        rows = None if exp.rows is None else self._offer(exp.rows)
        return SlotExport(exp.live, exp.held, rows), self.engine_status(cell)

    def import_(self, cell: int, exp: SlotExport) -> dict:
        """Installs an exported request; rows offered elsewhere are pulled here first."""
        engine = self.engines[cell]
        if isinstance(exp.rows, Offer):
            rows = self._pull(exp.rows, engine.programs.rows_sh, cell)
            exp = SlotExport(exp.live, exp.held, rows)
        engine.import_(exp)
        return self.engine_status(cell)

    # ------------------------------------------------------------------ gradients

    def compute_grads(self, cell: int, mb, version: int, offer: Offer | None):
        """One micro-batch's gradient on ``cell`` at weights ``version`` (pulled from the core
        by ``offer`` when this cell does not hold them) -> (key, host metrics, exec ids).
        The gradient stays here under ``key`` until :meth:`offer_grads` (or, on the core,
        :meth:`apply_parts`)."""
        c = self.cells[cell]
        if self.trainer is not None:
            res = self.trainer.compute_grads(c, mb)
        else:
            held = self.train_params.get(cell)
            if held is None or held[0] != version:
                if offer is None:
                    raise ValueError(f"cell {cell} has no weights of version {version}")
                held = (version, self._weights(cell, "train", offer))
                self.train_params[cell] = held
            s = self.specs.trainer
            program = gradient_program(self.graphdef, s.model, s.objective, s.loss, False, c.mesh,
                                       s.remat, s.logits_chunk)  # fmt: skip
            res = microbatch_grads(program, c, held[1], None, mb, version)
        key = f"{cell}:{next(self._keys)}"
        self.grads[key] = res.grads
        return key, jax.device_get(res.metrics), res.exec_ids

    def offer_grads(self, key: str) -> Offer:
        """Offers (and lets go of) a held gradient."""
        return self._offer(self.grads.pop(key))

    def take_grads(self, key: str, offer: Offer) -> None:
        """Core: pulls a gradient offered by another process into the core's 'train' layout."""
        core = self.trainer.core
        self.grads[key] = self._pull(offer, self.trainer.param_shardings(core), core.index)

    def apply_parts(self, parts: list, counts: list[float]):
        """Core: one update from held gradients. parts: [(part, key, metrics, cell, exec ids)]
        -> (StepOutcome or None, status)."""
        from gyre.train.step import GradResult

        results = [(part, GradResult(self.grads.pop(key), metrics, cell, ids))
                   for part, key, metrics, cell, ids in parts]  # fmt: skip
        outcome = self.trainer.apply_parts(results, counts)
        return outcome, self.status()

    def save(self, metadata: dict, microbatches_done: int, wait: bool) -> None:
        """Core: a checkpoint, with the run's micro-batch count (the driver's)."""
        self.trainer.microbatches_done = microbatches_done
        self.trainer.save(self.checkpointer, metadata, wait=wait)

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()
