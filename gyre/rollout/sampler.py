"""Token sampling keyed by (execution, call, position), never by slot or batch.

Every random draw uses ``fold_in(fold_in(fold_in(base, exec_hash), call_id), position)`` with
``base = PRNGKey(seed)``, so a request samples the same token at the same position whichever
slot, cell or batch it runs in (and after a migration or a retry). ``position`` is the index
of the sampled token in the full sequence (prompt length + completion index).

Logprob convention (the *behaviour* logprob the trainer needs):
- temperature > 0: log-probability of the sampled token under the distribution actually
  sampled from, i.e. ``log_softmax(logits / temperature)`` restricted to the top-p nucleus
  and renormalised there.
- temperature == 0 (greedy): the token is the argmax and its logprob is the plain
  ``log_softmax(logits)`` at temperature 1 (top-p ignored). A point mass would give 0 for every
  token, which carries no information for importance ratios; temperature 1 is the policy the
  trainer evaluates.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def base_key(seed: int) -> jax.Array:
    """Raw uint32[2] key from the config seed (raw so it crosses jit and device_put freely)."""
    return jax.random.PRNGKey(seed)


def token_keys(base, exec_hash_B, call_id_B, position_B):
    """uint32[B, 2] keys, one per row, from the request identity and the token position."""

    def one(h, c, p):
        k = jax.random.fold_in(base, h)
        k = jax.random.fold_in(k, c)
        return jax.random.fold_in(k, p)

    return jax.vmap(one)(
        exec_hash_B.astype(jnp.uint32), call_id_B.astype(jnp.uint32), position_B.astype(jnp.uint32)
    )


def nucleus_mask(logits_BxV, top_p: float):
    """Keeps the smallest set of top tokens whose probability reaches top_p (ties kept)."""
    probs_BxV = jax.nn.softmax(logits_BxV, axis=-1)
    sorted_BxV = jnp.sort(probs_BxV, axis=-1)[:, ::-1]
    # mass strictly before each sorted entry; an entry is kept while that mass is < top_p
    before_BxV = jnp.cumsum(sorted_BxV, axis=-1) - sorted_BxV
    kept_BxV = before_BxV < top_p
    threshold_B = jnp.min(jnp.where(kept_BxV, sorted_BxV, jnp.inf), axis=-1)
    return probs_BxV >= threshold_B[:, None]


def sample(logits_BxV, keys_Bx2, temperature_B, top_p: float = 1.0):
    """-> (token int32[B], logprob float32[B]) per the module's convention. top_p is static."""
    logits_BxV = logits_BxV.astype(jnp.float32)
    greedy_B = temperature_B <= 0.0
    safe_t_B = jnp.where(greedy_B, 1.0, temperature_B)
    scaled_BxV = logits_BxV / safe_t_B[:, None]  # greedy rows: the logits themselves
    if top_p < 1.0:
        scaled_BxV = jnp.where(nucleus_mask(scaled_BxV, top_p), scaled_BxV, -jnp.inf)
    argmax_B = jnp.argmax(logits_BxV, axis=-1)
    # The draw (a Gumbel number per vocabulary entry and row) is skipped when every row is
    # greedy: its result would be discarded, and on CPU it costs as much as a small layer.
    drawn_B = jax.lax.cond(
        jnp.any(~greedy_B),
        lambda: jax.vmap(jax.random.categorical)(keys_Bx2, scaled_BxV).astype(argmax_B.dtype),
        lambda: argmax_B,
    )
    token_B = jnp.where(greedy_B, argmax_B, drawn_B).astype(jnp.int32)
    # log-probability = chosen logit - logsumexp of the row, without materialising a
    # log-softmax over the vocabulary. Greedy rows use the plain logits (temperature 1, no
    # nucleus): with top_p = 1 that is scaled_BxV already.
    base_BxV = scaled_BxV
    if top_p < 1.0:
        base_BxV = jnp.where(greedy_B[:, None], logits_BxV, scaled_BxV)
    chosen_B = jnp.take_along_axis(base_BxV, token_B[:, None], axis=-1)[:, 0]
    return token_B, chosen_B - jax.nn.logsumexp(base_BxV, axis=-1)
