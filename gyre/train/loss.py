"""Tree-packed policy loss (pure): PPO with sign-split clipping, KL, stale-token correction.

A packed row holds a prefix-shared token tree (docs/data_flow.md, "Packed batch"). Token j is
predicted by the output at its parent ``pred[j]`` (-1 for a root), so log-probs are gathered
as ``log_softmax(logits[pred[j]])[tokens[j]]``; shifted labels would be wrong at branch points.
Logits are computed once per row position and shared by every child of that position.

Per path p with coefficient c_p >= 0 and advantage A_p, PPO maximises
``min(r A_p, clip(r) A_p)`` which is ``A_p min(r, clip(r))`` for A_p > 0 and
``A_p max(r, clip(r))`` for A_p < 0. Summing over the paths through a token gives

    L = -sum_j [min(r_j, clip(r_j)) adv_pos_j + max(r_j, clip(r_j)) adv_neg_j]

with ``adv_pos = sum c_p A_p [A_p > 0]`` and ``adv_neg = sum c_p A_p [A_p < 0]``: exactly the
flattened per-path loss (value and gradient). ``clip(r) = clip(r, 1 - clip_low, 1 + clip_high)``.

Linear terms use ``w = sum c_p``. Every metric is returned as a w-weighted *sum* (plus
``w_sum``), so micro-batches add up and the step mean is ``sum / w_sum``; each metric's kind
(summed, mean, count, max) is declared in ``gyre.trajectory.schema.METRICS``.

Objectives: ``LOSSES`` maps each objective name to its loss; the batch side of an objective
(which executions are targets, with which advantage) is ``gyre.trajectory.schema.OBJECTIVES``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from gyre import bounds
from gyre.model import decoder
from gyre.trajectory import schema


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """Static (hashable) loss settings; part of the gradient program's cache key."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.0
    tis_cap: float = 0.0  # 0 = off; else stale tokens get min(pi_start / pi_behaviour, cap)

    def __post_init__(self):
        bounds.check(self, "train")


def token_logprobs(logits_RxTxV, tokens_RxT, pred_RxT):
    """-> (logp[R,T], entropy[R,T]) of each token under the distribution at its parent.

    Roots (pred = -1) get logp 0 and entropy 0; they never carry weight.
    """
    logits_RxTxV = logits_RxTxV.astype(jnp.float32)
    logsm_RxTxV = jax.nn.log_softmax(logits_RxTxV, axis=-1)
    ent_RxT = -jnp.sum(jnp.exp(logsm_RxTxV) * logsm_RxTxV, axis=-1)
    is_child = pred_RxT >= 0
    parent = jnp.where(is_child, pred_RxT, 0)
    # logp_j = logsm[parent_j, token_j]: one gather along T, then one along V.
    at_parent_RxTxV = jnp.take_along_axis(logsm_RxTxV, parent[..., None], axis=1)
    logp = jnp.take_along_axis(at_parent_RxTxV, tokens_RxT[..., None], axis=2)[..., 0]
    ent = jnp.take_along_axis(ent_RxT, parent, axis=1)
    return jnp.where(is_child, logp, 0.0), jnp.where(is_child, ent, 0.0)


def head_logprobs(hidden_RxTxD, head_VxD, tokens_RxT, pred_RxT, *, chunk: int, dtype,
                  sample_vocab: int = 0):  # fmt: skip
    """:func:`token_logprobs` of ``logits = hidden @ head.T`` (the head run in ``dtype``,
    accumulated in float32), without a [R, T, V] array when ``chunk`` < V.

    The vocabulary is cut into ceil(V / chunk) chunks of ``chunk`` ids; a scan keeps a
    running max, sum of exponentials and sum of exp * logit per position (an online
    log-sum-exp), so the largest float32 array is one chunk's [R*T, chunk] logits. Each
    chunk's body is rematerialised: the backward pass recomputes its logits instead of
    keeping them (one more [R*T, D] x [D, chunk] product per chunk). The token's own logit
    is a [D] dot with its head row at the parent's hidden state. Equals the one-piece
    computation to float32 round-off (tests/test_chunked_logprobs.py); ``chunk`` = 0 or
    >= V is the one-piece computation itself. Ids >= ``sample_vocab`` (when set) are masked
    as :func:`gyre.model.decoder.mask_vocab` masks them.
    """
    r, t, d = hidden_RxTxD.shape
    v = head_VxD.shape[0]
    limit = sample_vocab if 0 < sample_vocab < v else v
    if not chunk or chunk >= v:
        logits = jnp.einsum("rtd,vd->rtv", hidden_RxTxD.astype(dtype), head_VxD.astype(dtype),
                            preferred_element_type=jnp.float32)  # fmt: skip
        if limit < v:
            logits = jnp.where(jnp.arange(v) < limit, logits, decoder.MASKED)
        return token_logprobs(logits, tokens_RxT, pred_RxT)
    n = -(-v // chunk)
    head = head_VxD.astype(dtype)
    if n * chunk > v:
        head = jnp.pad(head, ((0, n * chunk - v), (0, 0)))
    # Chunk k holds the ids c * n + k (c < chunk): a vocabulary axis sharded in contiguous
    # blocks stays sharded along each chunk's ids, so every device works on every chunk.
    head_NxCxD = jnp.swapaxes(head.reshape(chunk, n, d), 0, 1)
    ids_NxC = jnp.arange(chunk)[None, :] * n + jnp.arange(n)[:, None]
    # float32 outside the scan, so the hidden state's gradient sums over chunks in float32
    h32 = hidden_RxTxD.reshape(r * t, d).astype(jnp.float32)

    @jax.checkpoint
    def body(carry, xs):
        m, s, u = carry
        w_CxD, ids_C = xs
        z = jnp.einsum("md,cd->mc", h32.astype(dtype), w_CxD, preferred_element_type=jnp.float32)
        ok = ids_C < limit
        top = jax.lax.stop_gradient(jnp.max(jnp.where(ok, z, -jnp.inf), axis=-1))
        m_new = jnp.maximum(m, top)
        scale = jnp.exp(m - m_new)
        e = jnp.where(ok, jnp.exp(z - m_new[:, None]), 0.0)
        s = s * scale + jnp.sum(e, axis=-1)
        u = u * scale + jnp.sum(e * jnp.where(ok, z, 0.0), axis=-1)
        return (m_new, s, u), None

    zero = jnp.zeros((r * t,), jnp.float32)
    (m, s, u), _ = jax.lax.scan(body, (zero - 1e30, zero, zero), (head_NxCxD, ids_NxC))
    lse_RxT = (m + jnp.log(s)).reshape(r, t)
    ent_RxT = (jnp.log(s) + m - u / s).reshape(r, t)
    is_child = pred_RxT >= 0
    parent = jnp.where(is_child, pred_RxT, 0)
    # gathered in float32 and rounded to ``dtype`` after: their gradients (scatter-adds over
    # repeated tokens and branch points) sum in float32
    h_par = jnp.take_along_axis(h32.reshape(r, t, d), parent[..., None], axis=1).astype(dtype)
    w_tok = jnp.take(head_VxD, tokens_RxT, axis=0).astype(dtype)
    z_tok = jnp.sum(h_par.astype(jnp.float32) * w_tok.astype(jnp.float32), axis=-1)
    if limit < v:
        z_tok = jnp.where(tokens_RxT < limit, z_tok, decoder.MASKED)
    logp = z_tok - jnp.take_along_axis(lse_RxT, parent, axis=1)
    ent = jnp.take_along_axis(ent_RxT, parent, axis=1)
    return jnp.where(is_child, logp, 0.0), jnp.where(is_child, ent, 0.0)


def _k3(logp_a, logp_b):
    """k3 estimator of KL(b || a) from samples of b: exp(a - b) - (a - b) - 1 (>= 0)."""
    d = logp_a - logp_b
    return jnp.exp(d) - d - 1.0


def policy_loss(logp, entropy, batch, spec: LossSpec, version_now, ref_logp=None):
    """Sign-split clipped policy loss of one packed micro-batch -> (loss, metrics).

    logp, entropy: [R,T] from :func:`token_logprobs` under the current parameters.
    batch: mapping with old_logp, adv_pos, adv_neg, w, versions ([R,T]; versions -1 = context).
    version_now: int scalar, the version of the parameters being trained (start of the step).
    ref_logp: [R,T] reference-policy logprobs for the KL penalty (needed when kl_coef > 0).

    With tis_cap > 0, a stale token (0 <= version < version_now) is corrected as in decoupled
    PPO: the ratio is taken to the start-of-step policy pi_start = stop_grad(logp) (exact, as
    every micro-batch of a step sees the same parameters) and the term is weighted by
    min(pi_start / pi_behaviour, tis_cap). Fresh tokens keep the ratio to the behaviour logp.
    """
    old = batch["old_logp"].astype(jnp.float32)
    adv_pos = batch["adv_pos"].astype(jnp.float32)
    adv_neg = batch["adv_neg"].astype(jnp.float32)
    w = batch["w"].astype(jnp.float32)
    versions = batch["versions"]
    weighted = w > 0

    base = old
    iw = jnp.ones_like(logp)
    stale = (versions >= 0) & (versions < version_now)
    if spec.tis_cap > 0:
        start = jax.lax.stop_gradient(logp)
        base = jnp.where(stale, start, old)
        iw = jnp.where(stale, jnp.minimum(jnp.exp(start - old), spec.tis_cap), 1.0)
    ratio = jnp.exp(logp - base)
    clipped = jnp.clip(ratio, 1.0 - spec.clip_low, 1.0 + spec.clip_high)
    surrogate = jnp.minimum(ratio, clipped) * adv_pos + jnp.maximum(ratio, clipped) * adv_neg
    pg_loss = -jnp.sum(iw * surrogate)

    kl = jnp.zeros(())
    if spec.kl_coef > 0:
        if ref_logp is None:
            raise ValueError("train.kl_coef > 0 needs reference logprobs (ref_logp)")
        kl = jnp.sum(w * _k3(ref_logp.astype(jnp.float32), logp))
    loss = pg_loss + spec.kl_coef * kl

    lag = jnp.where(weighted, version_now - versions, 0)
    metrics = {
        "loss": loss,
        "pg_loss": pg_loss,
        "kl_ref": kl,
        "w_sum": jnp.sum(w),
        "tokens": jnp.sum(weighted).astype(jnp.float32),
        "entropy": jnp.sum(w * entropy),
        "approx_kl": jnp.sum(w * _k3(jax.lax.stop_gradient(logp), old)),
        "clip_low_frac": jnp.sum(w * (ratio < 1.0 - spec.clip_low)),
        "clip_high_frac": jnp.sum(w * (ratio > 1.0 + spec.clip_high)),
        "version_lag": jnp.sum(w * lag),
        "version_lag_max": jnp.max(lag).astype(jnp.float32),
        "stale_frac": jnp.sum(w * stale),
    }
    return loss, metrics


def sft_loss(logp, entropy, batch):
    """Cross-entropy on trainable tokens: -sum_j w_j logp_j (w = 0 marks context)."""
    w = batch["w"].astype(jnp.float32)
    loss = -jnp.sum(w * logp)
    metrics = {
        "loss": loss,
        "w_sum": jnp.sum(w),
        "tokens": jnp.sum(w > 0).astype(jnp.float32),
        "entropy": jnp.sum(w * entropy),
        "nll": loss,
    }
    return loss, metrics


def _never(spec: LossSpec) -> bool:
    return False


@dataclasses.dataclass(frozen=True)
class ObjectiveLoss:
    """The device side of an objective.

    loss: (logp, entropy, batch, spec, version_now, ref_logp) -> (loss, metric sums); logp,
    entropy [R,T] from :func:`token_logprobs`; batch: the micro-batch's device fields by name;
    ref_logp: [R,T] reference logprobs, or None when ``needs_ref(spec)`` is false.
    """

    loss: Callable
    needs_ref: Callable[[LossSpec], bool] = _never


def _sft(logp, entropy, batch, spec, version_now, ref_logp):
    return sft_loss(logp, entropy, batch)


# Objective name -> its loss. A new objective: one entry here and one in schema.OBJECTIVES.
LOSSES: dict[str, ObjectiveLoss] = {
    "ppo": ObjectiveLoss(policy_loss, needs_ref=lambda spec: spec.kl_coef > 0),
    "sft": ObjectiveLoss(_sft),
}


def objective_loss(name: str) -> ObjectiveLoss:
    if name not in LOSSES:
        raise ValueError(f"objective must be one of {tuple(LOSSES)}, got {name!r}")
    return LOSSES[name]


def combine_metrics(per_microbatch: list[dict]) -> dict:
    """Combines micro-batch metric sums by their kind (schema.METRICS): maxima for MAX, sums
    otherwise, then MEAN metrics divided by the combined ``w_sum``."""
    if not per_microbatch:
        raise ValueError("combine_metrics got no micro-batch metrics")
    out = {}
    for key in per_microbatch[0]:
        vals = [float(m[key]) for m in per_microbatch]
        out[key] = max(vals) if schema.metric_kind(key) == schema.MAX else sum(vals)
    w_sum = out.get("w_sum", 0.0)
    for key in out:
        if schema.metric_kind(key) == schema.MEAN:
            out[key] = out[key] / w_sum if w_sum > 0 else 0.0
    return out


def scale_metrics(metrics: dict, s: float) -> dict:
    """A part's metric sums as the whole step's: those linear in the loss coefficients times
    ``s``, the rest (counts, maxima) as they are."""
    return {k: (v * s if schema.rescaled(k) else v) for k, v in metrics.items()}
