"""The tree schedule: one tree-packed row trained prefix first, then branch by branch.

Instead of one long tree-masked row, the row's first ``P`` tokens (the shared prefix) run
forward once and keep their per-layer K/V; each branch (a closed DFS range after the prefix)
then runs forward and backward against the prefix's K/V as extra keys, giving the gradient
of its loss w.r.t. the parameters, the prefix K/V and the prefix's hidden states (a branch's
first token is predicted from the prefix); those cotangents are summed over the branches in
float32, and the prefix runs backward once with them (``jax.vjp`` over the pieces). Peak
memory is that of the prefix plus one branch, not of the whole tree (AReaL-DTA,
schedule-level tree training). The gradient and the loss equal the tree mask's on the same
row, which equals training on every flattened root-to-leaf path
(tests/test_tree_schedule.py).

    sched = split_row(leave_T, block=128)            # host: prefix length, branch ranges
    srow = schedule_row(row_fields, sched)           # host: prefix and [N, B] branch arrays
    grads, metrics = row_grads(graphdef, params, srow, loss_spec, version_now)

Depth. A branch is any DFS range ``[a, b)`` after the prefix that is closed (no token in it is
an ancestor of a token after it: ``max(leave[a:b]) <= b``), so one level of split is exact
for any tree: a branch that branches again (a retry inside a sub-agent, say) runs whole with
the tree mask inside it. Memory is then bounded by the prefix plus the largest such branch;
for the wide agent trees this targets (a shared prefix and many chains) that is the longest
root-to-leaf path, padded to blocks. Branches of branches are not split again (no second
level of prefix); a range that is not closed is refused with a ValueError. A row holding
several trees (executions binned together, padding) is split the same way: each tree after
the prefix is a top-level subtree.

Memory beyond the path's: the branch gradient and its float32 accumulator (two float32
copies of the parameters' gradient) and the prefix's K/V with their float32 cotangent
(benchmarks/tree_schedule.py measures it; BENCH_35.md).

Branch attention (:func:`context_attention`) is the tree mask's own block-sparse kernel
(``attention.indexed_attention``) with the keys held apart: the branch's queries against
[prefix keys; own keys], query q seeing key k iff ``idx[k] <= idx[q] < leave[k]`` in the
row's own indices, visiting only the key blocks some query of a query block can see. The KL
term (``train.kl_coef`` > 0) is not supported here.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gyre.model import attention, decoder
from gyre.train import loss as tloss
from gyre.trajectory import schema

# ----------------------------------------------------------------------------- the split (host)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How one row is cut. prefix: tokens [0, prefix) run first; branches: ``(a, b)`` closed
    DFS ranges covering [prefix, length) in order; block: the attention block; prefix_pad,
    branch_pad: the static lengths (multiples of ``block``) the prefix and every branch are
    padded to."""

    prefix: int
    branches: tuple[tuple[int, int], ...]
    block: int
    prefix_pad: int
    branch_pad: int

    @property
    def peak_tokens(self) -> int:
        """Tokens whose activations are live at once: the padded prefix and one branch."""
        return self.prefix_pad + self.branch_pad


def _round(n: int, block: int) -> int:
    return max(block, -(-n // block) * block)


def top_subtrees(leave_T: np.ndarray, start: int, end: int) -> list[tuple[int, int]]:
    """The top-level subtrees ``[a, leave[a])`` of the DFS range [start, end) (closed
    ranges: a subtree in DFS order is contiguous and holds its descendants)."""
    out, a = [], start
    while a < end:
        b = int(leave_T[a])
        if b <= a or b > end:
            raise ValueError(f"token {a}'s subtree ends at {b}, outside [{a + 1}, {end}]: "
                             "not a DFS-ordered tree row")  # fmt: skip
        out.append((a, b))
        a = b
    return out


def check_closed(leave_T: np.ndarray, a: int, b: int) -> None:
    """ValueError unless [a, b) is a closed DFS range (no token in it sees past b)."""
    if b > a and int(np.max(leave_T[a:b])) > b:
        raise ValueError(f"tokens [{a}, {b}) are not a closed branch: a token in it is an "
                         f"ancestor of token {b} or later (leave up to "
                         f"{int(np.max(leave_T[a:b]))}); split at a subtree boundary")  # fmt: skip


def _group(atoms, cap: int) -> list[tuple[int, int]]:
    """Consecutive atoms merged into ranges of at most ``cap`` tokens (an atom over ``cap``
    stands alone)."""
    out = []
    for a, b in atoms:
        if out and b - out[-1][0] <= cap:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def split_row(leave_T, block: int = 128, prefix: int | None = None, length: int | None = None,
              prefix_pad: int | None = None, branch_pad: int | None = None) -> Schedule:  # fmt: skip
    """The schedule of a row with subtree ends ``leave_T`` (int[T]).

    ``prefix``: the prefix length; None picks the P that minimises the padded prefix plus
    the largest top-level subtree after it (candidates: every branch point's children and
    block boundaries), i.e. the peak memory. ``length``: tokens to schedule (default T;
    tokens past it must be padding). Branches are the top-level subtrees after the prefix,
    merged in order while a merged range stays within the largest one's padded length (so
    padding rows and short branches share a branch slot). ``prefix_pad``, ``branch_pad``:
    fixed static lengths (multiples of ``block``; one compile for many rows) instead of the
    smallest that hold the prefix and the largest branch."""
    leave_T = np.asarray(leave_T, np.int64)
    t = int(leave_T.size if length is None else length)
    if prefix is None:
        prefix = best_prefix(leave_T[:t], block, prefix_pad, branch_pad)
    if not 0 <= prefix <= t:
        raise ValueError(f"prefix {prefix} outside [0, {t}]")
    atoms = top_subtrees(leave_T, prefix, t)
    need = _round(max((b - a for a, b in atoms), default=1), block)
    cap = need if branch_pad is None else branch_pad
    pp = _round(prefix, block) if prefix_pad is None else prefix_pad
    for name, n, have in (("branch", need, cap), ("prefix", prefix, pp)):
        if have < n or have % block:
            raise ValueError(f"{name}_pad={have} must be a multiple of the block {block} and "
                             f"hold {n} tokens")  # fmt: skip
    return Schedule(prefix, tuple(_group(atoms, cap)), block, pp, cap)


def best_prefix(leave_T: np.ndarray, block: int, max_prefix: int | None = None,
                max_branch: int | None = None) -> int:  # fmt: skip
    """The prefix length that minimises padded prefix + padded largest branch (ties: the
    shorter prefix), with at most ``max_prefix`` tokens and no top-level subtree after it
    over ``max_branch``. Candidates: 0, every token with two or more children (just past
    it) and block boundaries, so a long chain trunk is cut where its branches begin."""
    t = leave_T.size
    ends = leave_T
    # a token with >= 2 children: its first child's subtree ends before its own does
    first_child_end = np.where(np.arange(t) + 1 < t, np.r_[ends[1:], 0], 0)
    branchy = np.flatnonzero((ends > np.arange(t) + 1) & (first_child_end < ends))
    cands = sorted({0, t, *(branchy + 1).tolist(), *range(0, t, block)})
    # largest[a]: the largest top-level subtree of [a, t) (subtrees chain a -> leave[a]),
    # right to left once, instead of walking the chain for every candidate
    largest = [0] * (t + 1)
    ends_l = np.minimum(ends, t).tolist()
    for a in range(t - 1, -1, -1):
        b = ends_l[a] if ends_l[a] > a else a + 1
        largest[a] = max(b - a, largest[b])
    best, best_cost = None, None
    for p in cands:
        if max_prefix is not None and p > max_prefix:
            continue
        big = max(largest[p], 1)
        if max_branch is not None and big > max_branch:
            continue
        cost = _round(p, block) * (p > 0) + _round(big, block)
        if best_cost is None or cost < best_cost:
            best, best_cost = p, cost
    if best is None:
        raise ValueError(f"no prefix of at most {max_prefix} tokens leaves every branch within "
                         f"{max_branch} tokens")  # fmt: skip
    return best


def schedule_row(row: dict, sched: Schedule, n_branches: int | None = None) -> dict:
    """Host arrays of one row's schedule from its packed fields (each [T], the schema's device
    fields): {'prefix': fields [Pp] (leave clipped to the prefix), 'branch': fields [N, Bp],
    'ctx_idx' [Pp], 'ctx_leave' [Pp], 'idx' [N, Bp], 'own_leave' [N, Bp]} (int32 indices in
    the row's own numbering; padding keys have leave 0: never seen). ``n_branches``: a fixed
    branch count (>= the schedule's; the rest are all padding and add nothing)."""
    names = schema.device_names()
    row = {k: np.asarray(row[k]) for k in names}
    p, pp, bp = sched.prefix, sched.prefix_pad, sched.branch_pad
    leave = row["leave"].astype(np.int64)
    for a, b in sched.branches:
        check_closed(leave, a, b)
    pre = schema.empty(1, pp, names)
    pre = {k: v[0] for k, v in pre.items()}
    for k in names:
        pre[k][:p] = row[k][:p]
    pre["leave"][:p] = np.minimum(leave[:p], p)  # the prefix forward's own tree mask
    ctx_idx = np.arange(pp, dtype=np.int32)
    ctx_leave = np.where(np.arange(pp) < p, np.r_[leave[:p], np.zeros(pp - p)], 0).astype(np.int32)
    n = max(len(sched.branches), 1) if n_branches is None else n_branches
    if n < len(sched.branches):
        raise ValueError(f"n_branches={n} < the schedule's {len(sched.branches)} branches")
    br = {k: v.copy() for k, v in schema.empty(n, bp, names).items()}
    idx = np.full((n, bp), -1, np.int32)
    own_leave = np.zeros((n, bp), np.int32)
    for i, (a, b) in enumerate(sched.branches):
        if b - a > bp:
            raise ValueError(f"branch [{a}, {b}) is longer than the branch length {bp}")
        for k in names:
            br[k][i, : b - a] = row[k][a:b]
        idx[i, : b - a] = np.arange(a, b)
        own_leave[i, : b - a] = leave[a:b]
    return {"prefix": pre, "branch": br, "ctx_idx": ctx_idx, "ctx_leave": ctx_leave,
            "idx": idx, "own_leave": own_leave,
            "start": np.asarray([a for a, _ in sched.branches] + [p] * (n - len(sched.branches)),
                                np.int32)}  # fmt: skip


# ----------------------------------------------------------------------------- context attention


def context_attention(q, k, v, q_idx, k_idx, k_leave, block: int = 128):
    """Tree attention of one row's queries against keys indexed in its numbering (a branch's
    queries against [prefix keys; own keys]): :func:`attention.indexed_attention` on one row.

    q[Tq,H,Dh]; k/v[Tk,KVH,Dh] (GQA); q_idx[Tq], k_idx[Tk], k_leave[Tk] int. Query i sees
    key j iff ``k_idx[j] <= q_idx[i] < k_leave[j]``; a query with q_idx < 0 or that sees no
    key returns zeros. Tq and Tk multiples of ``block``. -> out[Tq,H,Dh]."""
    rows = (x[None] for x in (q, k, v, q_idx, k_idx, k_leave))
    return attention.indexed_attention(*rows, block)[0]


# ----------------------------------------------------------------------------- model pieces


def prefix_forward(model, tokens_P, pos_P, leave_P, remat="none"):
    """The prefix run once: -> (final-normed hidden [P, D], K [L, P, KVH, Dh], V likewise),
    the tree mask inside the prefix (``leave_P`` within [1, P])."""
    spec, dtype = model.spec, model.dtype
    x = model.embed[...].astype(dtype)[tokens_P[None]]

    def block(x, p):
        q, k, v = decoder._qkv(p, x, pos_P[None], spec, dtype)
        out = attention.attend(q, k, v, leave_P[None], impl=spec.attention, block=spec.attn_block)
        return decoder._finish_block(p, x, out, spec, dtype), (k[0], v[0])

    x, (k, v) = jax.lax.scan(decoder.remat_block(block, remat), x, model._layer_params())
    return decoder.rms_norm(x, model.final_norm[...], spec.rms_eps)[0], k, v


def branch_forward(model, tokens_B, pos_B, idx_B, own_leave_B, k_ctx, v_ctx, ctx_idx, ctx_leave,
                   remat="none", block=128):  # fmt: skip
    """One branch against the prefix's K/V (k_ctx/v_ctx [L, Pp, KVH, Dh]): -> final-normed
    hidden [B, D]. Keys are [prefix; own] with indices ``ctx_idx``/``idx_B`` and subtree
    ends ``ctx_leave``/``own_leave_B`` in the row's numbering."""
    spec, dtype = model.spec, model.dtype
    x = model.embed[...].astype(dtype)[tokens_B[None]]
    k_idx = jnp.concatenate([ctx_idx, idx_B])
    k_leave = jnp.concatenate([ctx_leave, own_leave_B])

    def blk(x, layer):
        p, kc, vc = layer
        q, k, v = decoder._qkv(p, x, pos_B[None], spec, dtype)
        keys = jnp.concatenate([kc.astype(dtype), k[0]])
        vals = jnp.concatenate([vc.astype(dtype), v[0]])
        out = context_attention(q[0], keys, vals, idx_B, k_idx, k_leave, block)
        return decoder._finish_block(p, x, out[None], spec, dtype), None

    x, _ = jax.lax.scan(decoder.remat_block(blk, remat), x, (model._layer_params(), k_ctx, v_ctx))
    return decoder.rms_norm(x, model.final_norm[...], spec.rms_eps)[0]


def _logprobs(model, h_par_N, tokens_N, has_parent_N, chunk):
    """(logp, entropy) [1, N] of each token under the head at its parent's hidden h_par."""
    spec = model.spec
    head = decoder.head_matrix(spec, model.serving_weights(layers=False))
    pred = jnp.where(has_parent_N, jnp.arange(tokens_N.shape[0]), -1)
    return tloss.head_logprobs(h_par_N[None], head, tokens_N[None], pred[None], chunk=chunk,
                               dtype=jnp.dtype(spec.dtype), sample_vocab=spec.sample_vocab)  # fmt: skip


def combine_host(values, key: str) -> float:
    """One metric over rows (host floats): the max for MAX metrics, else the sum."""
    values = [float(v) for v in values]
    return max(values) if schema.metric_kind(key) == schema.MAX else sum(values)


def _combine(a: dict, b: dict) -> dict:
    """Metric sums of two parts of a row: maxima for MAX metrics, sums otherwise."""
    return {k: jnp.maximum(a[k], b[k]) if schema.metric_kind(k) == schema.MAX else a[k] + b[k]
            for k in a}  # fmt: skip


def row_grads(graphdef, params, srow: dict, loss_spec, version_now, *, objective="ppo",
              remat="none", logits_chunk=0, block=None):  # fmt: skip
    """(grads, metric sums) of one scheduled row (:func:`schedule_row`, device or host
    arrays): equal to the tree-mask gradient program on the row (``step._objective``)."""
    obj = tloss.objective_loss(objective)
    if obj.needs_ref(loss_spec):
        raise NotImplementedError("the tree schedule does not compute the KL term: set "
                                  "train.kl_coef=0 or use the tree mask")  # fmt: skip
    pre, br = srow["prefix"], srow["branch"]
    spec = nnx.merge(graphdef, params).spec
    block = block or spec.attn_block
    pp = pre["tokens"].shape[0]

    def loss_of(logp, ent, fields):
        batch = {k: v[None] for k, v in fields.items()}
        return obj.loss(logp, ent, batch, loss_spec, version_now, None)

    # 1. the prefix forward, once; its residuals stay until step 3
    def fwd(p):
        return prefix_forward(nnx.merge(graphdef, p), pre["tokens"], pre["pos"], pre["leave"],
                              remat)  # fmt: skip

    (h_P, k_P, v_P), prefix_vjp = jax.vjp(fwd, params)

    # the prefix's own tokens: their parents are in the prefix
    def prefix_loss(p, h):
        model = nnx.merge(graphdef, p)
        par = jnp.maximum(pre["pred"], 0)
        logp, ent = _logprobs(model, h[par], pre["tokens"], pre["pred"] >= 0, logits_chunk)
        return loss_of(logp, ent, pre)

    (_, metrics), (g_head, g_h) = jax.value_and_grad(prefix_loss, (0, 1), has_aux=True)(
        params, h_P)  # fmt: skip

    # 2. every branch, forward and backward, one after the other (a scan: one branch's
    # activations live at a time), its cotangents for the prefix summed in float32
    def branch_loss(p, k_ctx, v_ctx, h_ctx, b):
        model = nnx.merge(graphdef, p)
        f = b["fields"]
        h_B = branch_forward(model, f["tokens"], f["pos"], b["idx"], b["own_leave"], k_ctx,
                             v_ctx, srow["ctx_idx"], srow["ctx_leave"], remat, block)  # fmt: skip
        pred = f["pred"]
        in_prefix = pred < b["start"]
        h_par = jnp.where(in_prefix[:, None], h_ctx[jnp.clip(pred, 0, pp - 1)],
                          h_B[jnp.clip(pred - b["start"], 0, h_B.shape[0] - 1)])  # fmt: skip
        logp, ent = _logprobs(model, h_par, f["tokens"], pred >= 0, logits_chunk)
        return loss_of(logp, ent, f)

    f32 = functools.partial(jax.tree.map, lambda x: x.astype(jnp.float32))

    def step(carry, b):
        g_p, g_k, g_v, g_h, m = carry
        (_, mb), grads = jax.value_and_grad(branch_loss, (0, 1, 2, 3), has_aux=True)(
            params, k_P, v_P, h_P, b)  # fmt: skip
        gp, gk, gv, gh = f32(grads)
        return (jax.tree.map(jnp.add, g_p, gp), g_k + gk, g_v + gv, g_h + gh,
                _combine(m, mb)), None  # fmt: skip

    xs = {"fields": br, "idx": srow["idx"], "own_leave": srow["own_leave"],
          "start": srow["start"]}  # fmt: skip
    zeros = functools.partial(jax.tree.map, lambda x: jnp.zeros(x.shape, jnp.float32))
    init = (zeros(params), zeros(k_P), zeros(v_P), g_h.astype(jnp.float32), metrics)
    (g_p, g_k, g_v, g_h, metrics), _ = jax.lax.scan(step, init, xs)

    # 3. the prefix backward, once, with the summed cotangents
    (g_pre,) = prefix_vjp((g_h.astype(h_P.dtype), g_k.astype(k_P.dtype), g_v.astype(v_P.dtype)))
    grads = jax.tree.map(lambda a, b, c: (a + b + c).astype(a.dtype), g_pre, f32(g_head), g_p)
    return grads, metrics


# ----------------------------------------------------------------------------- programs


def abstract_row(prefix_pad: int, branch_pad: int, n_branches: int, sharding=None) -> dict:
    """ShapeDtypeStructs of :func:`schedule_row`'s output for these static lengths (for a
    memory plan: nothing allocated)."""

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    fields = {f.name: f for f in schema.fields() if f.name in schema.device_names()}
    i32 = np.int32
    return {
        "prefix": {k: sds((prefix_pad,), f.dtype) for k, f in fields.items()},
        "branch": {k: sds((n_branches, branch_pad), f.dtype) for k, f in fields.items()},
        "ctx_idx": sds((prefix_pad,), i32), "ctx_leave": sds((prefix_pad,), i32),
        "idx": sds((n_branches, branch_pad), i32), "own_leave": sds((n_branches, branch_pad), i32),
        "start": sds((n_branches,), i32),
    }  # fmt: skip


@functools.cache
def schedule_program(graphdef, spec, objective, loss_spec, mesh, remat="none", logits_chunk=0):
    """The jitted tree-schedule gradient program of one cell: (params, scheduled row,
    version) -> (grads, metric sums); parameters in the cell's 'train' layout (as
    ``step.gradient_program``'s), the row replicated."""
    from jax.sharding import NamedSharding, PartitionSpec

    from gyre import mesh as gmesh

    p_sh = decoder.state_shardings(spec, gmesh.Cell(-1, mesh), "train")
    rep = NamedSharding(mesh, PartitionSpec())

    def fn(params, srow, version_now):
        return row_grads(graphdef, params, srow, loss_spec, version_now, objective=objective,
                         remat=remat, logits_chunk=logits_chunk)  # fmt: skip

    return jax.jit(fn, in_shardings=(p_sh, rep, rep), out_shardings=(p_sh, rep))
