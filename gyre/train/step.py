"""Per-cell gradient programs, a shared micro-batch queue, and the optimizer on the core cell.

API for the controller::

    trainer = Trainer(spec, cells, graphdef, params)     # params: any layout; cells[0] = core
    mbs = split_microbatches(packed_batch, spec.rows_per_microbatch)
    for mb in mbs:                                        # any train cell may take the next one
        results.append(trainer.compute_grads(cell, mb))   # -> GradResult (grads on `cell`)
    out = trainer.apply_step(results)                     # sum on core, update -> StepOutcome
    out = trainer.apply_parts(parts, counts)              # streamed parts, rescaled, then applied
    trainer.version                                       # authoritative weight version (int)
    trainer.params_for(cell, "rollout")                   # weights moved to a cell's layout
    trainer.train_step(cells, packed_batch)               # all of the above, round-robin
    trainer.save(checkpointer); Trainer.restore(spec, cells, graphdef, checkpointer)

Each cell gets its own jit program (its own shardings: parameters in the 'train' layout,
batch rows over 'data'), compiled once per shape bucket; the batch buffers are donated.
Gradients of other cells cross to the core with ``gyre.mesh.move`` only: arrays of two cells
never meet inside one program. The core alone holds the optimizer state. A non-finite loss or
gradient skips the update (logged with the batch's execution ids) but counts as a step: the
weights stay and the version advances; ``spec.max_bad_steps`` skipped steps in a row raise
:class:`TrainingDiverged`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from gyre import mesh as gmesh
from gyre.model import decoder
from gyre.train import loss as tloss
from gyre.train import optimizer as topt
from gyre.train import tree_schedule as tsched
from gyre.trajectory import schema

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TrainerSpec:
    """Everything the gradient and update programs depend on (frozen: it keys their caches)."""

    model: decoder.ModelSpec
    optimizer: topt.OptimizerSpec = topt.OptimizerSpec()
    loss: tloss.LossSpec = tloss.LossSpec()
    objective: str = "ppo"  # a name in loss.LOSSES: 'ppo' (policy loss), 'sft' (cross-entropy)
    rows_per_microbatch: int = 4
    max_bad_steps: int = 3
    seed: int = 0
    # What each decoder block keeps for the backward pass: a name in decoder.REMAT_POLICIES
    # ('none', 'full', 'dots_saveable', ...); gradients are equal under every policy.
    remat: str = "none"
    # Log-probabilities and entropy over the vocabulary in chunks of this many ids
    # (loss.head_logprobs): no [rows, T, vocab] float32 logits; 0 = in one piece.
    logits_chunk: int = 8192
    # Each row through the tree schedule (gyre/train/tree_schedule.py: prefix forward once,
    # branches one at a time against its K/V, prefix backward once) instead of the tree mask:
    # the same gradient, peak memory of the prefix plus one branch. Rows run one at a time,
    # replicated on the cell; static lengths are bucketed to powers of two (few compiles).
    tree_schedule: bool = False
    # train.rows_per_microbatch was 0 ('auto'): the builder's check_memory sets the count to
    # the largest that fits the devices by the memory plan (it stays at the default where
    # devices report no memory, as on CPU)
    rows_auto: bool = False

    def __post_init__(self):
        tloss.objective_loss(self.objective)  # raises for an unknown objective
        if self.remat not in decoder.REMAT_POLICIES:
            raise ValueError(f"train.remat must be one of {tuple(decoder.REMAT_POLICIES)}, "
                             f"got {self.remat!r}")  # fmt: skip
        if self.tree_schedule and tloss.objective_loss(self.objective).needs_ref(self.loss):
            raise ValueError("train.tree_schedule does not compute the KL term: set "
                             "train.kl_coef=0 or turn the tree schedule off")  # fmt: skip
        if self.logits_chunk < 0:
            raise ValueError(f"train.logits_chunk must be >= 0, got {self.logits_chunk}")
        if self.rows_per_microbatch < 1:
            raise ValueError(
                f"train.rows_per_microbatch must be >= 1, got {self.rows_per_microbatch}"
            )


class TrainingDiverged(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient."""


@dataclasses.dataclass
class Microbatch:
    """Host numpy arrays (the schema's device fields, each [R, T]) and the execution ids
    they hold."""

    arrays: dict
    exec_ids: list
    index: int = 0

    @property
    def trainable_tokens(self) -> float:
        """Tokens with a loss weight: the work this micro-batch asks of a train cell."""
        return float(np.sum(self.arrays["w"] > 0))


@dataclasses.dataclass
class GradResult:
    grads: object  # parameter-shaped pytree on the computing cell
    metrics: dict  # device scalars (sums over the micro-batch)
    cell_index: int
    exec_ids: list


@dataclasses.dataclass
class StepOutcome:
    applied: bool
    version: int
    step: int
    metrics: dict  # host floats: combined sums and step means, grad_norm
    exec_ids: list


def _field(batch, name):
    return batch[name] if isinstance(batch, dict) else getattr(batch, name)


def split_microbatches(batch, rows: int, exec_names=None) -> list[Microbatch]:
    """Cuts a packed batch ([R, T] fields) into micro-batches of ``rows`` rows; the last one is
    filled with padding rows (``schema.FIELDS``' padding values) so every micro-batch has the
    same shape (one compile).

    Each micro-batch records the executions it holds (from the batch's ``exec_index`` field,
    mapped through ``exec_names`` when given) for logging a bad step.
    """
    if rows < 1:
        raise ValueError(f"train.rows_per_microbatch must be >= 1, got {rows}")
    names = schema.device_names()
    arrays = {name: np.asarray(_field(batch, name)) for name in names}
    r, t = arrays["tokens"].shape
    try:
        exec_index = np.asarray(_field(batch, "exec_index"))
    except (KeyError, AttributeError):
        exec_index = np.full((r, t), -1)
    out = []
    for i, start in enumerate(range(0, r, rows)):
        part = {k: v[start : start + rows] for k, v in arrays.items()}
        missing = rows - part["tokens"].shape[0]
        if missing:
            pad = schema.empty(missing, t, names)
            part = {k: np.concatenate([v, pad[k].astype(v.dtype)]) for k, v in part.items()}
        ids = [int(e) for e in np.unique(exec_index[start : start + rows]) if e >= 0]
        out.append(Microbatch(part, [exec_names[e] for e in ids] if exec_names else ids, i))
    return out


def _tree_add(a, b):
    return jax.tree.map(jnp.add, a, b)


_ADD = jax.jit(_tree_add, donate_argnums=(0,))


def _objective(graphdef, objective, loss_spec, use_ref, params, ref_params, batch, version_now,
               remat="none", logits_chunk=0):  # fmt: skip
    """(grads, metric sums) of one micro-batch under ``params``."""
    tokens, pred = batch["tokens"], batch["pred"]

    def logprobs(p):
        model = nnx.merge(graphdef, p)
        hidden = model(tokens, batch["pos"], batch["leave"], remat=remat)
        spec = model.spec
        head = decoder.head_matrix(spec, model.serving_weights(layers=False))
        return tloss.head_logprobs(hidden, head, tokens, pred, chunk=logits_chunk,
                                   dtype=jnp.dtype(spec.dtype), sample_vocab=spec.sample_vocab)  # fmt: skip

    def loss_of(p):
        logp, ent = logprobs(p)
        ref = jax.lax.stop_gradient(logprobs(ref_params)[0]) if use_ref else None
        return tloss.objective_loss(objective).loss(logp, ent, batch, loss_spec, version_now, ref)

    (_, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
    return grads, metrics


def gradient_program(graphdef, spec, objective, loss_spec, use_ref, mesh, remat="none",
                     logits_chunk=0):  # fmt: skip
    """The jitted gradient program of one cell (shared by every Trainer with these settings):
    parameters in the cell's 'train' layout, batch rows over 'data', batch buffers donated.
    ``remat``, ``logits_chunk``: :class:`TrainerSpec`'s."""
    return _gradient_program(graphdef, spec, objective, loss_spec, use_ref, mesh,
                             schema.device_names(), remat, logits_chunk)  # fmt: skip


@functools.cache
def _gradient_program(graphdef, spec, objective, loss_spec, use_ref, mesh, fields, remat="none",
                      logits_chunk=0):  # fmt: skip
    # ``fields`` keys the cache too: the program's batch is exactly the schema's device fields.
    cell = gmesh.Cell(-1, mesh)
    p_sh = decoder.state_shardings(spec, cell, "train")
    rows = NamedSharding(mesh, PartitionSpec("data", None))
    rep = NamedSharding(mesh, PartitionSpec())
    b_sh = {name: rows for name in fields}

    def fn(params, ref_params, batch, version_now):
        return _objective(graphdef, objective, loss_spec, use_ref, params, ref_params, batch,
                          version_now, remat, logits_chunk)  # fmt: skip

    return jax.jit(
        fn,
        in_shardings=(p_sh, p_sh if use_ref else None, b_sh, rep),
        out_shardings=(p_sh, rep),
        donate_argnums=(2,),
    )


@functools.cache
def update_program(spec: topt.OptimizerSpec):
    """(params, opt_state, grads, loss_ok) -> (params, opt_state, ok, grad_norm) on the core.

    The update is kept only if the loss, the gradient and the new weights are finite (else
    the old state is returned unchanged)."""
    tx = topt.make_optimizer(spec)

    def fn(params, opt_state, grads, loss_ok):
        leaves = jax.tree.leaves(grads)
        grad_norm = jnp.sqrt(sum(jnp.sum(g.astype(jnp.float32) ** 2) for g in leaves))
        updates, new_opt = tx.update(grads, opt_state, params)
        new_params = jax.tree.map(lambda p, u: p + u, params, updates)
        finite = [jnp.isfinite(p).all() for p in jax.tree.leaves(new_params)]  # a huge lr
        ok = loss_ok & jnp.isfinite(grad_norm) & jnp.stack(finite).all()

        def keep(new, old):
            return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)

        return keep(new_params, params), keep(new_opt, opt_state), ok, grad_norm

    return jax.jit(fn, donate_argnums=(1, 2))


def _bucket(n: int, block: int) -> int:
    """``n`` rounded up to ``block`` times a power of two (a few static shapes)."""
    k = max(1, -(-n // block))
    return block * (1 << (k - 1).bit_length())


def schedule_rows(mb: Microbatch, block: int) -> list[dict]:
    """Each row of ``mb`` with a trainable token as a scheduled row
    (:func:`tree_schedule.schedule_row`), lengths and branch count bucketed to powers of
    two; rows without one add nothing to the gradient or the metric sums and are left out."""
    out = []
    for r in range(mb.arrays["tokens"].shape[0]):
        row = {k: np.asarray(v[r]) for k, v in mb.arrays.items()}
        if not np.any(row["w"] > 0):
            continue
        first = tsched.split_row(row["leave"], block)
        sched = tsched.split_row(row["leave"], block, prefix=first.prefix,
                                 prefix_pad=_bucket(first.prefix, block),
                                 branch_pad=_bucket(first.branch_pad, block))  # fmt: skip
        n = 1 << (max(len(sched.branches), 1) - 1).bit_length()
        out.append(tsched.schedule_row(row, sched, n))
    return out


def schedule_microbatch_grads(trainer, cell, mb: Microbatch) -> GradResult:
    """:func:`microbatch_grads` through the tree schedule, row by row (``train.tree_schedule``):
    the sum of the rows' gradients and their combined metric sums."""
    s = trainer.spec
    program = tsched.schedule_program(trainer.graphdef, s.model, s.objective, s.loss, cell.mesh,
                                      s.remat, s.logits_chunk)  # fmt: skip
    rep = NamedSharding(cell.mesh, PartitionSpec())
    params = trainer.params_for(cell)
    version = jax.device_put(np.int32(trainer.version), rep)
    grads, metrics = None, None
    for srow in schedule_rows(mb, s.model.attn_block):
        g, m = program(params, jax.device_put(srow, rep), version)
        if grads is None:
            grads, metrics = g, m
        else:
            grads = _ADD(grads, g)
            metrics = tsched._combine(metrics, m)
    if grads is None:  # nothing trainable: a zero gradient, the mask program's metrics
        return microbatch_grads(trainer.program(cell), cell, params, None, mb, trainer.version)
    return GradResult(grads, metrics, cell.index, list(mb.exec_ids))


def microbatch_grads(program, cell, params, ref_params, mb: Microbatch, version: int) -> GradResult:
    """One micro-batch through ``program`` (a :func:`gradient_program` of ``cell``'s mesh) at
    ``params`` (the 'train' layout on ``cell``) -> its gradient on ``cell`` and metric sums."""
    rows = mb.arrays["tokens"].shape[0]
    data = cell.mesh.shape["data"]
    if rows % data:
        raise ValueError(
            f"micro-batch has {rows} rows, not divisible by the {data} data shards of cell "
            f"{cell.index}; set train.rows_per_microbatch to a multiple of {data}"
        )
    rows_sh = NamedSharding(cell.mesh, PartitionSpec("data", None))
    batch = {k: jax.device_put(np.asarray(mb.arrays[k]), rows_sh) for k in schema.device_names()}
    version = jax.device_put(np.int32(version), NamedSharding(cell.mesh, PartitionSpec()))
    grads, metrics = program(params, ref_params, batch, version)
    return GradResult(grads, metrics, cell.index, list(mb.exec_ids))


class Trainer:
    """Gradient programs on any train cell, optimizer state and authoritative weights on the
    core cell (``cells[0]``). It owns the step and version counters and step skipping."""

    def __init__(self, spec: TrainerSpec, cells, graphdef, params, *, ref_params=None,
                 opt_state=None, step: int = 0, version: int = 0, rng=None):  # fmt: skip
        if not cells:
            raise ValueError("Trainer needs at least one cell (cells[0] is the core)")
        self.spec, self.graphdef, self.objective = spec, graphdef, spec.objective
        self.core = cells[0]
        self._param_sh, self._copies = {}, {}
        self.tx = topt.make_optimizer(spec.optimizer)
        self.params = gmesh.move(params, self.param_shardings(self.core))
        self.use_ref = tloss.objective_loss(spec.objective).needs_ref(spec.loss)
        if self.use_ref and ref_params is None:
            raise ValueError("train.kl_coef > 0 needs ref_params (the reference policy)")
        self._ref_host = ref_params if self.use_ref else None
        self._ref = {}
        self._opt_sh = opt_sh = topt.state_shardings(
            self.tx, self.params, self.param_shardings(self.core), self.core.mesh
        )
        if opt_state is None:
            opt_state = jax.jit(self.tx.init, out_shardings=opt_sh)(self.params)
        self.opt_state = gmesh.move(opt_state, opt_sh)
        self.step, self.version, self.bad_steps = int(step), int(version), 0
        self.rng = jax.random.key(spec.seed) if rng is None else rng
        self.microbatches_done = 0  # queue position: micro-batches consumed over the run

    # ------------------------------------------------------------------ layouts and weights

    def param_shardings(self, cell, role: str = "train"):
        key = (cell.mesh, role)
        if key not in self._param_sh:
            self._param_sh[key] = decoder.state_shardings(self.spec.model, cell, role)
        return self._param_sh[key]

    def params_for(self, cell, role: str = "train"):
        """The current weights laid out for ``role`` on ``cell`` (cached per version)."""
        if cell.mesh == self.core.mesh and role == "train":
            return self.params
        key = (cell.mesh, role)
        version, tree = self._copies.get(key, (None, None))
        if version != self.version:
            tree = gmesh.move(self.params, self.param_shardings(cell, role))
            self._copies[key] = (self.version, tree)
        return tree

    def _ref_for(self, cell):
        if not self.use_ref:
            return None
        if cell.mesh not in self._ref:
            self._ref[cell.mesh] = gmesh.move(self._ref_host, self.param_shardings(cell))
        return self._ref[cell.mesh]

    # ------------------------------------------------------------------ gradient program

    def program(self, cell):
        """The jitted gradient program of ``cell`` (cached across Trainers with equal specs)."""
        s = self.spec
        return gradient_program(self.graphdef, s.model, s.objective, s.loss, self.use_ref,
                                cell.mesh, s.remat, s.logits_chunk)  # fmt: skip

    def compute_grads(self, cell, mb: Microbatch) -> GradResult:
        """Gradient (on ``cell``, 'train' layout) and metric sums of one micro-batch."""
        if self.spec.tree_schedule:
            res = schedule_microbatch_grads(self, cell, mb)
        else:
            res = microbatch_grads(self.program(cell), cell, self.params_for(cell),
                                   self._ref_for(cell), mb, self.version)  # fmt: skip
        self.microbatches_done += 1
        return res

    # ------------------------------------------------------------------ update on the core

    def sum_grads(self, results: list[GradResult]):
        """Sum of all micro-batch gradients, on the core cell."""
        if not results:
            raise ValueError("apply_step got no gradients")
        core_sh = self.param_shardings(self.core)
        total = None
        for res in results:
            g = gmesh.move(res.grads, core_sh)  # a no-op for the core's own gradients
            total = g if total is None else _ADD(total, g)
        return total

    def apply_step(self, results: list[GradResult]) -> StepOutcome:
        """Sums the gradients onto the core and applies one optimizer update (or skips it)."""
        grads = self.sum_grads(results)
        metrics = tloss.combine_metrics([jax.device_get(r.metrics) for r in results])
        exec_ids = sorted({i for r in results for i in r.exec_ids}, key=str)
        loss_ok = bool(np.isfinite(metrics["loss"]))
        update = update_program(self.spec.optimizer)
        params, opt_state, ok, grad_norm = update(self.params, self.opt_state, grads,
                                                  jnp.asarray(loss_ok))  # fmt: skip
        # Back to the declared layouts: XLA may return an equivalent but unequal sharding (a
        # size-1 axis dropped), which would add a second dispatch-cache entry to the gradient
        # and update programs. The move copies nothing.
        self.params = gmesh.move(params, self.param_shardings(self.core))
        self.opt_state = gmesh.move(opt_state, self._opt_sh)
        metrics["grad_norm"] = float(grad_norm)
        # A skipped update still counts as a step (an identity update): the version names
        # the number of steps taken, so step numbers, checkpoints and staleness stay aligned.
        self.step += 1
        self.version += 1
        if bool(ok):
            self.bad_steps = 0
            return StepOutcome(True, self.version, self.step, metrics, exec_ids)
        self.bad_steps += 1
        log.warning(
            "step %d skipped: non-finite %s (loss=%s grad_norm=%s); executions %s",
            self.step, "loss" if not loss_ok else "gradient or new weights", metrics["loss"],
            metrics["grad_norm"],
            exec_ids,
        )  # fmt: skip
        if self.bad_steps >= self.spec.max_bad_steps:
            raise TrainingDiverged(
                f"{self.bad_steps} optimizer steps in a row had a non-finite loss or gradient "
                f"(train.max_bad_steps={self.spec.max_bad_steps}); last executions "
                f"{exec_ids}; weights kept as after step {self.version - self.bad_steps}"
            )
        return StepOutcome(False, self.version, self.step, metrics, exec_ids)

    def apply_parts(self, parts: list[tuple[int, GradResult]], counts: list[float]):
        """One update from gradients computed part by part while a step streamed in.

        Part p's loss was normalised by its own ``counts[p]``; scaling its gradient and its
        linear metric sums (``tloss.scale_metrics``) by ``counts[p] / sum(counts)`` makes the
        sum the gradient of the whole step's loss: the update equals :meth:`apply_step` over
        the whole step's batch (tests/test_stream.py). With no gradient at all (every
        execution of the step an infrastructure error) the weights stay and the counters
        advance, so the run goes on. Returns the StepOutcome, or None for such an empty step.
        """
        total = sum(counts)
        results = []
        for part, res in parts:
            s = counts[part] / total
            grads = jax.tree.map(lambda g, s=s: g * s, res.grads)
            metrics = tloss.scale_metrics(res.metrics, s)
            results.append(GradResult(grads, metrics, res.cell_index, res.exec_ids))
        if results:
            return self.apply_step(results)
        self.step += 1
        self.version += 1
        return None

    def train_step(self, cells, batch, exec_names=None) -> StepOutcome:
        """One optimizer step over ``batch`` (packed), micro-batches dealt round-robin to cells."""
        mbs = split_microbatches(batch, self.spec.rows_per_microbatch, exec_names)
        results = [self.compute_grads(cells[i % len(cells)], mb) for i, mb in enumerate(mbs)]
        return self.apply_step(results)

    # ------------------------------------------------------------------ checkpoints

    def save(self, checkpointer, metadata: dict | None = None, wait: bool = False):
        """Asynchronous save of params, optimizer state, counters, RNG and queue position."""
        from gyre.train import checkpoint

        checkpoint.save_trainer(checkpointer, self, metadata or {}, wait=wait)

    @classmethod
    def restore(cls, spec, cells, graphdef, checkpointer, step: int | None = None, **kw):
        """A Trainer whose state comes from a checkpoint, laid out on ``cells`` (any count or
        cell size). Returns (trainer, metadata)."""
        from gyre.train import checkpoint

        return checkpoint.restore_trainer(cls, spec, cells, graphdef, checkpointer, step, **kw)
