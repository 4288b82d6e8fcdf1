"""The tree policy loss against per-path PPO references, on small hand-built arrays."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.config import default_config
from gyre.rl.builder import build_specs
from gyre.train import loss as tloss

CFG = tloss.LossSpec(clip_low=0.2, clip_high=0.28)


def _ppo_path(r, a, cfg=CFG):
    """Textbook per-path PPO objective min(r A, clip(r) A)."""
    return np.minimum(r * a, np.clip(r, 1 - cfg.clip_low, 1 + cfg.clip_high) * a)


def _batch(old, adv_pos, adv_neg, w, versions=None):
    n = np.shape(old)
    return {
        "old_logp": jnp.asarray(old, jnp.float32),
        "adv_pos": jnp.asarray(adv_pos, jnp.float32),
        "adv_neg": jnp.asarray(adv_neg, jnp.float32),
        "w": jnp.asarray(w, jnp.float32),
        "versions": jnp.zeros(n, jnp.int32) if versions is None else jnp.asarray(versions),
    }


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.floats(-0.6, 0.6), min_size=1, max_size=6),
    st.lists(st.tuples(st.floats(-2, 2), st.floats(0.01, 1.0)), min_size=1, max_size=5),
)
def test_sign_split_equals_sum_of_per_path_ppo(log_ratios, paths):
    """Each token lies on every path; the split form equals sum_p c_p PPO(r, A_p), grads too."""
    logp0 = jnp.asarray(log_ratios, jnp.float32)[None]
    a = np.array([p[0] for p in paths])
    c = np.array([p[1] for p in paths])
    ones = np.ones(logp0.shape)
    batch = _batch(0 * ones, ones * np.sum(c * a * (a > 0)), ones * np.sum(c * a * (a < 0)),
                   ones * c.sum())  # fmt: skip

    def tree(lp):
        return tloss.policy_loss(lp, jnp.zeros_like(lp), batch, CFG, 0)[0]

    def flat(lp):
        r = jnp.exp(lp)
        clip = jnp.clip(r, 1 - CFG.clip_low, 1 + CFG.clip_high)
        return -sum(ci * jnp.sum(jnp.minimum(r * ai, clip * ai)) for ai, ci in zip(a, c))

    np.testing.assert_allclose(tree(logp0), flat(logp0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jax.grad(tree)(logp0), jax.grad(flat)(logp0), rtol=1e-5, atol=1e-6)
    r = np.exp(np.asarray(log_ratios))
    np.testing.assert_allclose(
        -float(tree(logp0)), sum(ci * _ppo_path(r, ai).sum() for ai, ci in zip(a, c)), rtol=1e-5,
        atol=1e-6,
    )  # fmt: skip


def test_token_logprobs_gathers_at_parent():
    """Two children of position 0 are both scored from logits[0]; a root gets 0."""
    key = jax.random.key(0)
    logits = jax.random.normal(key, (1, 4, 5))
    tokens = jnp.array([[1, 3, 2, 4]])
    pred = jnp.array([[-1, 0, 0, 2]])
    logp, ent = tloss.token_logprobs(logits, tokens, pred)
    ls = jax.nn.log_softmax(logits[0], -1)
    want = [0.0, ls[0, 3], ls[0, 2], ls[2, 4]]
    np.testing.assert_allclose(logp[0], want, rtol=1e-6)
    p = jnp.exp(ls)
    ents = -(p * ls).sum(-1)
    np.testing.assert_allclose(ent[0], [0.0, ents[0], ents[0], ents[2]], rtol=1e-6)


def test_clip_fractions_and_lag_metrics():
    logp = jnp.log(jnp.array([[0.5, 1.0, 1.5, 1.0]]))  # ratios (old = 0): low, mid, high, mid
    batch = _batch(np.zeros((1, 4)), [[1, 1, 1, 0]], [[0, 0, 0, 0]], [[1, 1, 1, 0]],
                   versions=[[3, 5, 4, -1]])  # fmt: skip
    loss, m = tloss.policy_loss(logp, jnp.zeros_like(logp), batch, CFG, 5)
    assert float(m["clip_low_frac"]) == 1.0 and float(m["clip_high_frac"]) == 1.0
    assert float(m["version_lag"]) == 2 + 0 + 1 and float(m["version_lag_max"]) == 2
    assert float(m["stale_frac"]) == 2 and float(m["tokens"]) == 3
    # positive advantages: min(r, clip r) -> 0.5 + 1 + 1.28
    np.testing.assert_allclose(float(loss), -(0.5 + 1.0 + 1.28), rtol=1e-6)
    out = tloss.combine_metrics([jax.device_get(m), jax.device_get(m)])
    assert out["clip_low_frac"] == pytest.approx(1 / 3) and out["version_lag_max"] == 2


def test_kl_penalty_is_k3_weighted_by_w():
    cfg = tloss.LossSpec(kl_coef=0.5)
    logp = jnp.array([[-1.0, -2.0]])
    ref = jnp.array([[-1.5, -2.0]])
    batch = _batch(np.zeros((1, 2)), np.zeros((1, 2)), np.zeros((1, 2)), [[2.0, 1.0]])
    loss, m = tloss.policy_loss(logp, logp, batch, cfg, 0, ref_logp=ref)
    d = -0.5
    np.testing.assert_allclose(float(m["kl_ref"]), 2.0 * (np.exp(d) - d - 1), rtol=1e-6)
    np.testing.assert_allclose(float(loss), 0.5 * float(m["kl_ref"]), rtol=1e-6)
    with pytest.raises(ValueError, match="ref_logp"):
        tloss.policy_loss(logp, logp, batch, cfg, 0)


def test_truncated_importance_weight_only_on_stale_tokens():
    cfg = tloss.LossSpec(tis_cap=2.0)
    logp = jnp.array([[-1.0, -1.0, -1.0]])
    old = [[-4.0, -1.2, -4.0]]  # pi/mu = e^3 (capped at 2), e^0.2, e^3
    batch = _batch(old, [[1.0, 1.0, 1.0]], np.zeros((1, 3)), np.ones((1, 3)),
                   versions=[[1, 1, 2]])  # fmt: skip
    g = jax.grad(lambda lp: tloss.policy_loss(lp, lp, batch, cfg, 2)[0])(logp)
    # stale: ratio to stop_grad(logp) is 1 (unclipped) times the weight; fresh token 2 has
    # r = e^3 > 1 + clip_high, so the clipped positive term has no gradient.
    np.testing.assert_allclose(g[0], [-2.0, -np.exp(0.2), 0.0], rtol=1e-5)


def test_sft_loss_is_weighted_nll():
    logp = jnp.array([[-1.0, -2.0, -3.0]])
    batch = {"w": jnp.array([[0.0, 1.0, 0.5]])}
    loss, m = tloss.sft_loss(logp, logp, batch)
    np.testing.assert_allclose(float(loss), 2.0 + 1.5)
    assert float(m["tokens"]) == 2


def test_loss_config_rejects_bad_clip():
    cfg = default_config()
    cfg.train.clip_low = 1.5
    with pytest.raises(ValueError, match="clip_low"):  # a ConfigError from the builder
        build_specs(cfg)
    with pytest.raises(ValueError, match="clip_low"):  # the spec itself, at construction
        tloss.LossSpec(clip_low=1.5)
