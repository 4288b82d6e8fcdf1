"""The memory plan of a run: what one device of a train cell and of a rollout cell holds.

    p = plan(specs, device_memory=80e9)   # compiles the programs abstractly; allocates nothing
    print(p.table()); p.fits; p.refusal() # one line: the largest term and the setting to change
    check(specs)                          # the builder's hook: ConfigError when it does not fit

The gradient program (``gyre.train.step.gradient_program``), the optimizer update
(``update_program``) and a rollout cell's decode step and prefill chunk
(``decoder.forward_serving`` + ``serving_logits``, the cache donated as the engine donates it)
are lowered on ``jax.ShapeDtypeStruct`` arguments with the cell's shardings and compiled;
XLA's ``memory_analysis()`` of each compiled per-device program gives its temporaries and
outputs. Resident state (weights, AdamW moments, the core's gradient sum, a reference copy, the
KV cache) is counted from the shard shapes of its shardings. Figures are per device and come
from the platform the plan compiles on (XLA:CPU with fake devices when no accelerator is
present: its fusion and scheduling differ from a GPU's, so temporaries are an estimate
there); the allocator's own reserve is not included (``headroom`` leaves room for it).

Per device of a train cell (the core, which also holds the optimizer):
  weights + optimizer state + gradient sum [+ reference weights]
  + max(gradient program: its gradient output + temporaries + batch, update: temporaries)
Per device of a rollout cell: weights (rollout layout) + KV cache + max(decode, prefill) temps.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from gyre import mesh as gmesh
from gyre.errors import ConfigError
from gyre.model import decoder
from gyre.rollout.programs import kv_blocks
from gyre.train import loss as tloss
from gyre.train import optimizer as topt
from gyre.train import step as tstep
from gyre.train import tree_schedule as tsched
from gyre.trajectory import schema

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Term:
    name: str
    bytes: float
    setting: str  # what to change to shrink it


@dataclasses.dataclass(frozen=True)
class RolePlan:
    role: str
    terms: tuple[Term, ...]

    @property
    def total(self) -> float:
        return sum(t.bytes for t in self.terms)

    def largest(self) -> Term:
        return max(self.terms, key=lambda t: t.bytes)


@dataclasses.dataclass(frozen=True)
class Plan:
    device_memory: float  # bytes per device
    headroom: float  # share of device_memory kept free
    roles: tuple[RolePlan, ...]
    platform: str
    settings: dict  # the settings the figures depend on, for the table's header

    @property
    def usable(self) -> float:
        return self.device_memory * (1 - self.headroom)

    @property
    def fits(self) -> bool:
        return all(r.total <= self.usable for r in self.roles)

    def worst(self) -> RolePlan:
        return max(self.roles, key=lambda r: r.total)

    def refusal(self) -> str:
        """One line: the role over budget, its largest term and the setting to change."""
        r = self.worst()
        t = r.largest()
        return (f"memory plan: a {r.role} device needs {r.total / GB:.1f} GB of "
                f"{self.usable / GB:.1f} GB usable ({self.device_memory / GB:.0f} GB, "
                f"{self.headroom:.0%} headroom); largest term: {t.name} {t.bytes / GB:.1f} GB; "
                f"{t.setting}")  # fmt: skip

    def table(self) -> str:
        s = self.settings
        lines = [
            f"memory plan per device ({self.platform} compile; {self.device_memory / GB:.0f} GB "
            f"devices, {self.headroom:.0%} headroom)",
            "  " + ", ".join(f"{k}={v}" for k, v in s.items()),
            f"  {'role':<9}{'term':<40}{'GB':>9}",
        ]
        for r in self.roles:
            for t in r.terms:
                lines.append(f"  {r.role:<9}{t.name:<40}{t.bytes / GB:>9.2f}")
            ok = "fits" if r.total <= self.usable else "DOES NOT FIT"
            lines.append(f"  {r.role:<9}{'total':<40}{r.total / GB:>9.2f}  {ok}")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {
            "device_memory_gb": self.device_memory / GB, "headroom": self.headroom,
            "fits": self.fits, "platform": self.platform, "settings": self.settings,
            **{f"{r.role}_{t.name.split(' (')[0].replace(' ', '_')}_gb": round(t.bytes / GB, 3)
               for r in self.roles for t in r.terms},
            **{f"{r.role}_total_gb": round(r.total / GB, 3) for r in self.roles},
        }  # fmt: skip


def _shard_bytes(tree) -> float:
    return float(sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
                     for x in jax.tree.leaves(tree)))  # fmt: skip


def _abstract(tree, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        tree, shardings)  # fmt: skip


def plan_cell(specs) -> gmesh.Cell:
    """One cell of the run's layout on this process's first ``mesh.cell_size`` devices."""
    m = specs.mesh
    devices = jax.devices()
    if len(devices) < m.cell_size:
        raise ConfigError(f"the memory plan needs {m.cell_size} devices (mesh.cell_size) to "
                          f"compile a cell's programs; this process has {len(devices)}")  # fmt: skip
    return gmesh.make_cells(m.cell_size, m.model_parallel, devices[: m.cell_size])[0]


@dataclasses.dataclass(frozen=True)
class TreeRow:
    """One long tree row to plan instead of ``rows_per_microbatch`` rows of ``row_len``.

    tokens: the row's length. branch = 0: the tree mask (a row of ``tokens`` per 'data'
    shard through the gradient program). branch > 0: the tree schedule
    (gyre/train/tree_schedule.py; the row replicated over the cell): a
    prefix of ``prefix`` tokens, then ceil((tokens - prefix) / branch) branches of ``branch``
    tokens each (lengths rounded up to the attention block)."""

    tokens: int
    prefix: int = 0
    branch: int = 0

    @property
    def schedule(self) -> bool:
        return self.branch > 0

    def shapes(self, block: int) -> tuple[int, int, int]:
        """(prefix_pad, branch_pad, n_branches) of the schedule."""
        up = lambda n: max(block, -(-n // block) * block)  # noqa: E731
        return up(self.prefix), up(self.branch), max(1, -(-(self.tokens - self.prefix)
                                                         // self.branch))  # fmt: skip

    def label(self) -> str:
        if not self.schedule:
            return f"tree {self.tokens}, mask"
        pp, bp, n = self.shapes(128)
        return f"tree {self.tokens}, schedule {self.prefix}+{n}x{self.branch}"


def _schedule_terms(specs, cell, tree: TreeRow, params, p_sh, use_ref):
    """(gradient output bytes, temporaries, batch bytes) of the tree-schedule program."""
    t, model = specs.trainer, specs.model
    if use_ref:
        raise ConfigError("the tree schedule does not compute the KL term: plan it with "
                          "train.kl_coef=0")  # fmt: skip
    graphdef, _ = decoder.abstract_model(model, specs.seed)
    rep = NamedSharding(cell.mesh, PartitionSpec())
    pp, bp, n = tree.shapes(model.attn_block)
    srow = tsched.abstract_row(pp, bp, n, rep)
    program = tsched.schedule_program(graphdef, model, t.objective, t.loss, cell.mesh, t.remat,
                                      t.logits_chunk)  # fmt: skip
    m = program.lower(params, srow, jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
                      ).compile().memory_analysis()  # fmt: skip
    return float(m.output_size_in_bytes), float(m.temp_size_in_bytes), _shard_bytes(srow)


def train_terms(specs, cell, tree: TreeRow | None = None) -> tuple[Term, ...]:
    """The train role's terms; ``tree``: plan one long tree row instead (:class:`TreeRow`)."""
    t, model = specs.trainer, specs.model
    if tree is not None and not tree.schedule:
        # the mask: one row of the tree's length per 'data' shard (one per device's share)
        rl, n = -(-tree.tokens // 128) * 128, cell.mesh.shape["data"]
        specs = dataclasses.replace(
            specs, trajectory=dataclasses.replace(specs.trajectory, row_len=rl,
                                                  rows_per_microbatch=n),
            trainer=dataclasses.replace(t, rows_per_microbatch=n))  # fmt: skip
        t = specs.trainer
    graphdef, abstract = decoder.abstract_model(model, specs.seed)
    p_sh = decoder.state_shardings(model, cell, "train")
    params = _abstract(abstract, p_sh)
    use_ref = tloss.objective_loss(t.objective).needs_ref(t.loss)
    rows, row_len = t.rows_per_microbatch, specs.trajectory.row_len
    rows_sh = NamedSharding(cell.mesh, PartitionSpec("data", None))
    rep = NamedSharding(cell.mesh, PartitionSpec())
    batch = {f.name: jax.ShapeDtypeStruct((rows, row_len), f.dtype, sharding=rows_sh)
             for f in schema.fields() if f.name in schema.device_names()}  # fmt: skip
    version = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
    if tree is not None and tree.schedule:
        g_out, g_temp, batch_bytes = _schedule_terms(specs, cell, tree, params, p_sh, use_ref)
        what = tree.label()
    else:
        program = tstep.gradient_program(graphdef, model, t.objective, t.loss, use_ref,
                                         cell.mesh, t.remat, t.logits_chunk)  # fmt: skip
        g = program.lower(params, params if use_ref else None, batch, version).compile()
        g = g.memory_analysis()
        g_out, g_temp, batch_bytes = (float(g.output_size_in_bytes), float(g.temp_size_in_bytes),
                                      _shard_bytes(batch))  # fmt: skip
        what = tree.label() if tree is not None else f"{rows}x{row_len}"
    tx = topt.make_optimizer(t.optimizer)
    opt = topt.abstract_state(tx, params, p_sh, cell.mesh)
    ok = jax.ShapeDtypeStruct((), jnp.bool_, sharding=rep)
    upd = tstep.update_program(t.optimizer).lower(params, opt, params, ok).compile()
    u = upd.memory_analysis()
    weights = _shard_bytes(params)
    grad_peak = g_out + g_temp + batch_bytes
    more = ("lower train.rows_per_microbatch" if t.remat != "none"
            else f"set train.remat=full (now {t.remat!r}) or lower train.rows_per_microbatch")  # fmt: skip
    mp = "raise mesh.model_parallel or mesh.cell_size"
    terms = [
        Term("weights (float32, train layout)", weights, mp),
        Term("optimizer state", _shard_bytes(opt), mp),
        Term("gradient sum (core)", weights, mp),
    ]
    if use_ref:
        terms.append(Term("reference weights (train.kl_coef)", weights, "set train.kl_coef=0"))
    if grad_peak >= u.temp_size_in_bytes:
        setting = (
            f"{more} (now {rows}) or trajectory.row_len (now {row_len})"
            if tree is None
            else "shorter tree rows, the tree schedule, or train.remat=full"
        )
        terms += [
            Term("gradient program: gradient out", g_out, mp),
            Term(f"gradient program: temporaries ({what})", g_temp, setting),
            Term("gradient program: batch", batch_bytes, "lower train.rows_per_microbatch"),
        ]  # fmt: skip
    else:
        terms.append(Term("update program: temporaries", float(u.temp_size_in_bytes), mp))
    return tuple(terms)


def rollout_terms(specs, cell) -> tuple[Term, ...]:
    model, r = specs.model, specs.rollout
    graphdef, abstract = decoder.abstract_model(model, specs.seed)
    abstract_w = jax.eval_shape(lambda st: decoder.serving_weights(graphdef, st), abstract)
    w_sh = gmesh.tree_shardings(cell, "rollout", decoder.serving_logical_axes(model), abstract_w)
    weights = _abstract(abstract_w, w_sh)
    shapes = decoder.cache_shapes(r.slots, model.num_kv_heads, r.max_len, model.head_dim)
    cache_shapes = {k: (jax.ShapeDtypeStruct(shapes[k], model.dtype),) * model.num_layers
                    for k in "kv"}  # fmt: skip
    c_sh = gmesh.tree_shardings(cell, "rollout", decoder.cache_logical_axes(model.num_layers),
                                cache_shapes)  # fmt: skip
    cache = _abstract(cache_shapes, c_sh)
    vec = NamedSharding(cell.mesh, PartitionSpec("data"))
    one = NamedSharding(cell.mesh, PartitionSpec())
    i32 = jnp.int32

    prefill_block, decode_block = kv_blocks(r)  # the engine's attention paths

    def decode(w, cache, tokens_S, start_S):
        hidden, cache = decoder.forward_serving(model, w, tokens_S[:, None], start_S[:, None],
                                                cache, None, start_S, decode_block)  # fmt: skip
        return cache, decoder.serving_logits(model, w, hidden)[:, 0].argmax(-1)

    def prefill(w, cache, tokens_1xC, start_1, slot_1):
        pos = start_1[:, None] + jnp.arange(tokens_1xC.shape[1], dtype=i32)[None, :]
        hidden, cache = decoder.forward_serving(model, w, tokens_1xC, pos, cache, slot_1, start_1,
                                                prefill_block)  # fmt: skip
        return cache, decoder.serving_logits(model, w, hidden[:, -1:])[:, 0].argmax(-1)

    s = r.slots
    dec = jax.jit(decode, donate_argnums=(1,)).lower(
        weights, cache, jax.ShapeDtypeStruct((s,), i32, sharding=vec),
        jax.ShapeDtypeStruct((s,), i32, sharding=vec)).compile().memory_analysis()  # fmt: skip
    c = min(r.prefill_chunk, r.max_len)
    pre = jax.jit(prefill, donate_argnums=(1,)).lower(
        weights, cache, jax.ShapeDtypeStruct((1, c), i32, sharding=one),
        jax.ShapeDtypeStruct((1,), i32, sharding=one),
        jax.ShapeDtypeStruct((1,), i32, sharding=one)).compile().memory_analysis()  # fmt: skip
    step = (Term("decode step: temporaries", float(dec.temp_size_in_bytes),
                 f"lower rollout.slots (now {r.slots})")
            if dec.temp_size_in_bytes >= pre.temp_size_in_bytes else
            Term(f"prefill chunk of {c}: temporaries", float(pre.temp_size_in_bytes),
                 f"lower rollout.prefill_chunk (now {r.prefill_chunk})"))  # fmt: skip
    return (
        Term("weights (float32, rollout layout)", _shard_bytes(weights),
             "raise mesh.model_parallel"),
        Term(f"KV cache ({r.slots} slots x {r.max_len})", _shard_bytes(cache),
             f"lower rollout.slots (now {r.slots}) or rollout.max_len (now {r.max_len})"),
        step,
    )  # fmt: skip


def plan(specs, device_memory: float, headroom: float = 0.1, cell=None,
         tree: TreeRow | None = None) -> Plan:  # fmt: skip
    """The memory plan of ``specs`` on devices of ``device_memory`` bytes (see the module);
    ``tree``: the train role for one long tree row (:class:`TreeRow`) instead."""
    cell = plan_cell(specs) if cell is None else cell
    t = specs.trainer
    settings = {
        "cell": f"{specs.mesh.cell_size} devices (model {specs.mesh.model_parallel})",
        "row_len": specs.trajectory.row_len, "rows_per_microbatch": t.rows_per_microbatch,
        "remat": t.remat, "logits_chunk": t.logits_chunk, "dtype": specs.model.dtype,
        "vocab": specs.model.vocab_size, "layers": specs.model.num_layers,
        "d_model": specs.model.d_model,
    }  # fmt: skip
    if tree is not None:
        settings["tree_row"] = tree.label()
    roles = (RolePlan("train", train_terms(specs, cell, tree)),
             RolePlan("rollout", rollout_terms(specs, cell)))  # fmt: skip
    return Plan(float(device_memory), headroom, roles, cell.platform, settings)


def auto_rows(specs, device_memory: float, headroom: float = 0.1, cell=None,
              most: int = 64) -> int:  # fmt: skip
    """``train.rows_per_microbatch: auto``: the largest count (a multiple of the cell's
    'data' shards, at most ``most``) whose train plan fits; 0 when not even the smallest
    does. The train total is near linear in the rows: two compiles (one and two shards'
    worth of rows) give a guess, and a bisection between counts known to fit and not to
    fit checks it (the guess and its neighbour: usually four compiles in all)."""
    cell = plan_cell(specs) if cell is None else cell
    step_ = cell.mesh.shape["data"]
    usable = device_memory * (1 - headroom)
    seen = {}

    def total(rows: int) -> float:
        if rows not in seen:
            t = dataclasses.replace(specs.trainer, rows_per_microbatch=rows)
            tr = dataclasses.replace(specs.trajectory, rows_per_microbatch=rows)
            s = dataclasses.replace(specs, trainer=t, trajectory=tr)
            seen[rows] = sum(term.bytes for term in train_terms(s, cell))
        return seen[rows]

    if total(step_) > usable:
        return 0
    if 2 * step_ > most:
        return step_
    slope = max(total(2 * step_) - total(step_), 1.0) / step_
    guess = int(step_ + (usable - total(step_)) // slope) // step_ * step_
    guess = max(step_, min(guess, most // step_ * step_))
    lo, hi = step_, most // step_ * step_ + step_  # lo fits; hi is past every candidate
    for probe in (guess, guess + step_):
        if probe <= lo or probe >= hi:
            continue
        lo, hi = (probe, hi) if total(probe) <= usable else (lo, probe)
    while hi - lo > step_:  # lo fits, hi does not (or is past ``most``)
        mid = (lo + hi) // 2 // step_ * step_
        lo, hi = (mid, hi) if total(mid) <= usable else (lo, mid)
    return lo


def device_memory(cell) -> float | None:
    """The smallest memory any device of ``cell`` reports (None where one reports none, as
    CPU devices do)."""
    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in cell.devices]
    return None if not limits or any(b is None for b in limits) else float(min(limits))


def check(specs, memory: float | None = None, headroom: float = 0.1) -> Plan | None:
    """The builder's hook: raises ConfigError (:meth:`Plan.refusal`, one line) when the plan
    of ``specs`` does not fit devices of ``memory`` bytes (default: what the devices of the
    first cell report; nothing is checked, and nothing compiled, where they report none, as
    on CPU). Returns the plan, or None when unchecked."""
    cell = plan_cell(specs)
    memory = device_memory(cell) if memory is None else memory
    if memory is None:
        return None
    p = plan(specs, memory, headroom, cell)
    if not p.fits:
        raise ConfigError(p.refusal())
    return p
