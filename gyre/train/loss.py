"""Tree-packed policy loss (pure): PPO with sign-split clipping, KL, stale-token correction.

A packed row holds a prefix-shared token tree (DESIGN.md, "Packed batch"). Token j is predicted
by the output at its parent ``pred[j]`` (-1 for a root), so log-probs are gathered as
``log_softmax(logits[pred[j]])[tokens[j]]``; shifted labels would be wrong at branch points.
Logits are computed once per row position and shared by every child of that position.

Per path p with coefficient c_p >= 0 and advantage A_p, PPO maximises
``min(r A_p, clip(r) A_p)`` which is ``A_p min(r, clip(r))`` for A_p > 0 and
``A_p max(r, clip(r))`` for A_p < 0. Summing over the paths through a token gives

    L = -sum_j [min(r_j, clip(r_j)) adv_pos_j + max(r_j, clip(r_j)) adv_neg_j]

with ``adv_pos = sum c_p A_p [A_p > 0]`` and ``adv_neg = sum c_p A_p [A_p < 0]``: exactly the
flattened per-path loss (value and gradient). ``clip(r) = clip(r, 1 - clip_low, 1 + clip_high)``.

Linear terms use ``w = sum c_p``. Every metric is returned as a w-weighted *sum* (plus
``w_sum``), so micro-batches add up and the step mean is ``sum / w_sum``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# Fields of a packed batch the device programs read ([R, T] each); ids stay on the host.
TRAIN_FIELDS = ("tokens", "pos", "leave", "pred", "old_logp", "adv_pos", "adv_neg", "w", "versions")


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """Static (hashable) loss settings; part of the gradient program's cache key."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.0
    tis_cap: float = 0.0  # 0 = off; else stale tokens get min(pi_start / pi_behaviour, cap)

    def __post_init__(self):
        if self.clip_low < 0 or self.clip_high < 0 or self.clip_low >= 1:
            raise ValueError(
                f"train.clip_low ({self.clip_low}) must be in [0, 1) and train.clip_high "
                f"({self.clip_high}) >= 0"
            )
        if self.tis_cap < 0:
            raise ValueError(f"train.tis_cap must be >= 0, got {self.tis_cap}")


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


def _k3(logp_a, logp_b):
    """k3 estimator of KL(b || a) from samples of b: exp(a - b) - (a - b) - 1 (>= 0)."""
    d = logp_a - logp_b
    return jnp.exp(d) - d - 1.0


def policy_loss(logp, entropy, batch, cfg: LossSpec, version_now, ref_logp=None):
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
    if cfg.tis_cap > 0:
        start = jax.lax.stop_gradient(logp)
        base = jnp.where(stale, start, old)
        iw = jnp.where(stale, jnp.minimum(jnp.exp(start - old), cfg.tis_cap), 1.0)
    ratio = jnp.exp(logp - base)
    clipped = jnp.clip(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    surrogate = jnp.minimum(ratio, clipped) * adv_pos + jnp.maximum(ratio, clipped) * adv_neg
    pg_loss = -jnp.sum(iw * surrogate)

    kl = jnp.zeros(())
    if cfg.kl_coef > 0:
        if ref_logp is None:
            raise ValueError("train.kl_coef > 0 needs reference logprobs (ref_logp)")
        kl = jnp.sum(w * _k3(ref_logp.astype(jnp.float32), logp))
    loss = pg_loss + cfg.kl_coef * kl

    lag = jnp.where(weighted, version_now - versions, 0)
    metrics = {
        "loss": loss,
        "pg_loss": pg_loss,
        "kl_ref": kl,
        "w_sum": jnp.sum(w),
        "tokens": jnp.sum(weighted).astype(jnp.float32),
        "entropy": jnp.sum(w * entropy),
        "approx_kl": jnp.sum(w * _k3(jax.lax.stop_gradient(logp), old)),
        "clip_low_frac": jnp.sum(w * (ratio < 1.0 - cfg.clip_low)),
        "clip_high_frac": jnp.sum(w * (ratio > 1.0 + cfg.clip_high)),
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


# Metrics that are maxima, not sums, when micro-batches are combined.
MAX_METRICS = ("version_lag_max",)


def combine_metrics(per_microbatch: list[dict]) -> dict:
    """Adds micro-batch metric sums (maxima for MAX_METRICS) and derives the step means."""
    if not per_microbatch:
        raise ValueError("combine_metrics got no micro-batch metrics")
    out = {}
    for key in per_microbatch[0]:
        vals = [float(m[key]) for m in per_microbatch]
        out[key] = max(vals) if key in MAX_METRICS else sum(vals)
    w_sum = out.get("w_sum", 0.0)
    for key in ("entropy", "approx_kl", "clip_low_frac", "clip_high_frac", "version_lag",
                "stale_frac"):  # fmt: skip
        if key in out:
            out[key] = out[key] / w_sum if w_sum > 0 else 0.0
    return out
