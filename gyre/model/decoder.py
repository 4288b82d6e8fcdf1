"""Qwen3-style decoder in flax.nnx, tree-capable, with a slot KV cache for rollout.

Architecture as HF transformers' Qwen3: pre-norm blocks, RMSNorm (fp32 statistics), GQA
attention with per-head RMSNorm on q and k before RoPE (rotate-half convention), no biases,
SwiGLU MLP, final norm, tied or untied lm_head.

Layer parameters are stacked along a leading 'layers' axis and run with ``jax.lax.scan``, so
compile time does not grow with depth. Every parameter carries a ``logical_axes`` metadata
tuple (names from ``gyre.mesh.RULES``); :func:`param_logical_axes` collects them.
Rollout serves from :func:`serving_weights` instead: one dict per layer, unrolled, made once
per weight install (:func:`forward_serving`, :func:`serving_logits`).
Parameters are float32; activations use ``spec.dtype``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from gyre import bounds
from gyre import mesh as gmesh
from gyre.model import attention

# Logical axes of every parameter, by name. Layer parameters get a leading 'layers' axis.
LAYER_AXES = {
    "attn_norm": ("embed",),
    "q": ("embed", "heads", "head_dim"),
    "k": ("embed", "kv_heads", "head_dim"),
    "v": ("embed", "kv_heads", "head_dim"),
    "o": ("heads", "head_dim", "embed"),
    "q_norm": ("head_dim",),
    "k_norm": ("head_dim",),
    "mlp_norm": ("embed",),
    "gate": ("embed", "mlp"),
    "up": ("embed", "mlp"),
    "down": ("mlp", "embed"),
}
# One layer's K and V in the slot KV cache. K is stored positions-minor, [S, KVH, Dh, M], so
# the score contraction q.K reads it as a plain [Dh] x [Dh, M] product per head; V is stored
# [S, KVH, M, Dh], the layout of the p.V product. With K like V (positions before Dh) XLA:CPU
# transposed each head's K block inside the attention of every step: dense decode loops ran
# 1.1-1.65x slower at batch 8 and 32, live ones 1.03-1.23x (BENCHMARKS.md, "Rollout engine
# decode"; measured on CPU only).
CACHE_AXES = {
    "k": ("batch", "kv_heads", "head_dim", "length"),
    "v": ("batch", "kv_heads", "length", "head_dim"),
}


def cache_shapes(num_slots: int, num_kv_heads: int, max_len: int, head_dim: int) -> dict:
    """{'k','v'} -> one layer's cache shape, in the order of :data:`CACHE_AXES`."""
    size = {"batch": num_slots, "kv_heads": num_kv_heads, "head_dim": head_dim, "length": max_len}
    return {k: tuple(size[axis] for axis in axes) for k, axes in CACHE_AXES.items()}


def _dense_init(key, shape, fan_in):
    return jax.random.normal(key, shape, jnp.float32) * fan_in**-0.5


def _param(value, logical_axes) -> nnx.Param:
    """A parameter with its logical axes. ``eager_sharding`` is fixed, not read from flax's
    global ``flax_always_shard_variable``: the flag is pytree metadata, so weights made under
    one value would not match shardings made under the other (importing Tunix flips it)."""
    return nnx.Param(value, logical_axes=logical_axes, eager_sharding=False)


class Layers(nnx.Module):
    """All decoder blocks, each parameter stacked as [L, ...]."""

    def __init__(self, spec, rngs: nnx.Rngs):
        n, d, h, kvh, dh, f = (
            spec.num_layers, spec.d_model, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.d_ff
        )  # fmt: skip
        shapes = {
            "attn_norm": (d,),
            "q": (d, h, dh),
            "k": (d, kvh, dh),
            "v": (d, kvh, dh),
            "o": (h, dh, d),
            "q_norm": (dh,),
            "k_norm": (dh,),
            "mlp_norm": (d,),
            "gate": (d, f),
            "up": (d, f),
            "down": (f, d),
        }
        fan_in = {"q": d, "k": d, "v": d, "o": h * dh, "gate": d, "up": d, "down": f}
        for name, shape in shapes.items():
            if name in fan_in:
                value = _dense_init(rngs.params(), (n, *shape), fan_in[name])
            else:  # norm scales start at one, as in HF
                value = jnp.ones((n, *shape), jnp.float32)
            setattr(self, name, _param(value, ("layers", *LAYER_AXES[name])))


def rms_norm(x, weight, eps):
    """HF Qwen3RMSNorm: statistics in fp32, back to the input dtype, then times weight."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * x32.astype(x.dtype)


def rope(x_BxTxHxDh, pos_BxT, theta):
    """Rotary embedding, rotate-half convention; angles computed in fp32 as HF does."""
    dh = x_BxTxHxDh.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))
    freqs_BxTxF = pos_BxT.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs_BxTxF, freqs_BxTxF], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb).astype(x_BxTxHxDh.dtype), jnp.sin(emb).astype(x_BxTxHxDh.dtype)
    x1, x2 = jnp.split(x_BxTxHxDh, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x_BxTxHxDh * cos + rotated * sin


def _qkv(p, x, pos, spec, dtype):
    """Pre-norm input -> q[B,T,H,Dh], k/v[B,T,KVH,Dh] with q/k norm and RoPE applied."""
    h = rms_norm(x, p["attn_norm"], spec.rms_eps)
    q = jnp.einsum("btd,dhk->bthk", h, p["q"].astype(dtype))
    k = jnp.einsum("btd,dhk->bthk", h, p["k"].astype(dtype))
    v = jnp.einsum("btd,dhk->bthk", h, p["v"].astype(dtype))
    q = rope(rms_norm(q, p["q_norm"], spec.rms_eps), pos, spec.rope_theta)
    k = rope(rms_norm(k, p["k_norm"], spec.rms_eps), pos, spec.rope_theta)
    return q, k, v


def _finish_block(p, x, attn_BxTxHxDh, spec, dtype):
    """Output projection, residual, SwiGLU MLP, residual."""
    x = x + jnp.einsum("bthk,hkd->btd", attn_BxTxHxDh, p["o"].astype(dtype))
    h = rms_norm(x, p["mlp_norm"], spec.rms_eps)
    gate = jax.nn.silu(h @ p["gate"].astype(dtype))
    return x + (gate * (h @ p["up"].astype(dtype))) @ p["down"].astype(dtype)


# Activation dtypes a model may run in (parameters stay float32).
DTYPES = ("float32", "bfloat16")

# What a decoder block keeps for the backward pass (``train.remat``); everything else is
# recomputed from the block's input there. 'none': everything (fastest, most memory);
# 'full': only the block input (one [B, T, D] per layer; one more forward); 'dots_saveable':
# every matmul output; 'dots_no_batch': matmuls with no batch dimension (the projections
# and the MLP, not the attention's); 'save_qkv_attn': the q/k/v projections and the
# attention output (the attention is not run again).
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_qkv_attn": jax.checkpoint_policies.save_only_these_names("q", "k", "v", "attn_out"),
}


def remat_block(block, remat: str | bool):
    """``block`` under the rematerialisation policy named ``remat`` (True = 'full')."""
    name = ("full" if remat else "none") if isinstance(remat, bool) else remat
    if name not in REMAT_POLICIES:
        raise ValueError(f"train.remat must be one of {tuple(REMAT_POLICIES)}, got {remat!r}")
    if name == "none":
        return block
    return jax.checkpoint(block, policy=REMAT_POLICIES[name])


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The architecture (frozen, hashable: static data of the graphdef and of jit caches)."""

    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    d_ff: int
    rope_theta: float
    rms_eps: float
    tie_embeddings: bool
    dtype: str
    attention: str
    attn_block: int
    # Ids at or past this are never sampled nor scored: their logits are masked out
    # (:func:`mask_vocab`) in sampling and training alike, so the behaviour and trained
    # distributions stay one. A checkpoint's vocabulary padded past its tokenizer (Qwen3:
    # ids 151,669-151,935 of 151,936) sets it from the tokenizer; 0 = every id.
    sample_vocab: int = 0

    def __post_init__(self):
        bounds.check(self, "model")
        if not 0 <= self.sample_vocab <= self.vocab_size:
            raise ValueError(f"model.sample_vocab must be in [0, vocab_size={self.vocab_size}], "
                             f"got {self.sample_vocab}")  # fmt: skip
        if self.dtype not in DTYPES:
            raise ValueError(f"model.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_kv_heads ({self.num_kv_heads}) must divide model.num_heads ({self.num_heads})"
            )


class Decoder(nnx.Module):
    """Qwen3 decoder of the architecture ``spec`` (a :class:`ModelSpec`)."""

    def __init__(self, spec: ModelSpec, rngs: nnx.Rngs):
        if not isinstance(spec, ModelSpec):
            raise TypeError(f"Decoder takes a ModelSpec, got {type(spec).__name__}")
        self.spec = spec
        self.dtype = jnp.dtype(spec.dtype)
        v, d = spec.vocab_size, spec.d_model
        # HF initialises embeddings with std 0.02; any small scale works for training from scratch
        embed = jax.random.normal(rngs.params(), (v, d), jnp.float32) * 0.02
        self.embed = _param(embed, ("vocab", "embed"))
        self.layers = Layers(spec, rngs)
        self.final_norm = _param(jnp.ones((d,), jnp.float32), ("embed",))
        if not spec.tie_embeddings:
            head = _dense_init(rngs.params(), (d, v), d)
            self.lm_head = _param(head, ("embed", "vocab"))

    def _layer_params(self):
        return {name: getattr(self.layers, name)[...] for name in LAYER_AXES}

    def __call__(self, tokens_BxT, pos_BxT, leave_BxT, remat: str | bool = "none"):
        """Tree forward -> final-normed hidden [B,T,D]. Query q sees key k iff k<=q<leave[k].

        ``remat``: a name in :data:`REMAT_POLICIES` (True = 'full', False = 'none'): what each
        block keeps for the backward pass; the rest is recomputed there."""
        spec, dtype = self.spec, self.dtype
        x = self.embed[...].astype(dtype)[tokens_BxT]

        def block(x, p):
            q, k, v = _qkv(p, x, pos_BxT, spec, dtype)
            q, k, v = (checkpoint_name(a, n) for a, n in ((q, "q"), (k, "k"), (v, "v")))
            out = attention.attend(q, k, v, leave_BxT, impl=spec.attention, block=spec.attn_block)
            out = checkpoint_name(out, "attn_out")
            return _finish_block(p, x, out, spec, dtype), None

        block = remat_block(block, remat)
        x, _ = jax.lax.scan(block, x, self._layer_params())
        return rms_norm(x, self.final_norm[...], spec.rms_eps)

    def logits(self, hidden_BxNxD):
        """Vocabulary logits [B,N,V] in float32 (the head runs in spec.dtype, accumulates fp32)."""
        return serving_logits(self.spec, self.serving_weights(layers=False), hidden_BxNxD)

    def init_cache(self, num_slots: int, max_len: int, dtype=jnp.float32):
        """Empty slot KV cache: {'k': L arrays [S, KVH, Dh, M], 'v': L arrays [S, KVH, M, Dh]}
        (:data:`CACHE_AXES`).

        One array per layer, heads before positions: a decode step reads each layer's K/V
        in place, in the layout attention contracts it (a stacked [L, ...] cache indexed
        inside a loop over layers is copied out layer by layer, every step)."""
        spec = self.spec
        shapes = cache_shapes(num_slots, spec.num_kv_heads, max_len, spec.head_dim)
        return {k: tuple(jnp.zeros(shapes[k], dtype) for _ in range(spec.num_layers)) for k in "kv"}

    def unstack_layers(self) -> list[dict]:
        """The stacked layer parameters as one dict of arrays per layer (a copy)."""
        stacked = self._layer_params()
        return [{k: v[i] for k, v in stacked.items()} for i in range(self.spec.num_layers)]

    def serving_weights(self, layers: bool = True) -> dict:
        """The weights in the rollout engine's layout (see :func:`serving_weights`)."""
        w = {"embed": self.embed[...], "final_norm": self.final_norm[...]}
        if not self.spec.tie_embeddings:
            w["lm_head"] = self.lm_head[...]
        if layers:
            w["layers"] = tuple(self.unstack_layers())
        return w


def head_matrix(spec: ModelSpec, weights: dict):
    """The output head as [V, D] float32 rows (the tied embedding, or lm_head transposed)."""
    return weights["embed"] if spec.tie_embeddings else weights["lm_head"].T


def mask_vocab(spec: ModelSpec, logits_NxV, ids_V=None):
    """``logits`` with the ids at or past ``spec.sample_vocab`` set to :data:`MASKED` (a
    no-op when it is 0). ``ids_V``: the vocabulary ids of the last axis (default 0..V-1)."""
    if not spec.sample_vocab or spec.sample_vocab >= spec.vocab_size:
        return logits_NxV
    if ids_V is None:
        ids_V = jnp.arange(logits_NxV.shape[-1])
    return jnp.where(ids_V < spec.sample_vocab, logits_NxV, MASKED)


# The logit of a masked id: exp underflows to 0 at any temperature, and it stays finite, so
# 0 * logit terms (entropy) are 0, never NaN.
MASKED = -1e9


def serving_logical_axes(spec: ModelSpec) -> dict:
    """Logical axes of :func:`serving_weights`' pytree (tuples are leaves)."""
    axes = {"embed": ("vocab", "embed"), "final_norm": ("embed",),
            "layers": (dict(LAYER_AXES),) * spec.num_layers}  # fmt: skip
    if not spec.tie_embeddings:
        axes["lm_head"] = ("embed", "vocab")
    return axes


def serving_logits(spec: ModelSpec, weights: dict, hidden_BxNxD):
    """Vocabulary logits [B,N,V] in float32 from serving (or any dict with 'embed' and, when
    untied, 'lm_head') weights."""
    dtype = jnp.dtype(spec.dtype)
    w_DxV = weights["embed"].T if spec.tie_embeddings else weights["lm_head"]
    logits = jnp.einsum("bnd,dv->bnv", hidden_BxNxD.astype(dtype), w_DxV.astype(dtype),
                        preferred_element_type=jnp.float32)  # fmt: skip
    return mask_vocab(spec, logits)


def forward_serving(
    spec: ModelSpec, weights: dict, tokens_BxT, pos_BxT, cache, slot_B, start_B, kv_block: int = 0
):
    """Causal forward of T new tokens per row against slot ``slot_B[b]`` of the cache.

    ``weights``: :func:`serving_weights` (one dict of arrays per layer, made once per weight
    install, so a decode loop reads each layer's weights in place and no dispatch copies
    them out of the stacked [L, ...] parameters). Writes the new K/V at cache positions
    start..start+T-1 of the slot and lets token t attend to entries [0, start+t] of that
    slot. Returns (hidden [B,T,D], new cache). Used for chunked prefill (T = chunk) and
    decode (T = 1). Tokens past the real prompt in a padded chunk are computed and written
    like real ones; the caller ignores their outputs and later overwrites their entries (the
    next write starts at the true length). Writes past max_len are dropped, so keep
    start + T <= max_len for real tokens. Slots must be distinct within one call.
    ``slot_B=None``: row b is slot b, every slot (decode), which reads each layer's cache in
    place instead of gathering its rows. Layers run unrolled (static indices).
    ``kv_block`` > 0: attention reads the cache in blocks of that many entries up to the
    live context instead of all max_len entries: decode (T = 1, ``slot_B=None``) up to the
    longest running row (:func:`attention.live_decode_attention`), prefill of one row (a
    given slot) up to its own length (:func:`attention.live_prefill_attention`).
    """
    dtype = jnp.dtype(spec.dtype)
    t = tokens_BxT.shape[1]
    every = slot_B is None
    if every:
        slot_B = jnp.arange(tokens_BxT.shape[0], dtype=start_B.dtype)
    idx_BxT = start_B[:, None] + jnp.arange(t, dtype=start_B.dtype)[None, :]
    slot_BxT = jnp.broadcast_to(slot_B[:, None], idx_BxT.shape)
    x = weights["embed"].astype(dtype)[tokens_BxT]
    ks, vs = list(cache["k"]), list(cache["v"])
    live_decode = bool(kv_block) and every and t == 1
    live_prefill = bool(kv_block) and not every and tokens_BxT.shape[0] == 1
    live = attention.live_length(start_B, vs[0].shape[2]) if live_decode else None
    for i, p in enumerate(weights["layers"]):
        q, k, v = _qkv(p, x, pos_BxT, spec, dtype)
        # K [S, KVH, Dh, M] at (slot, :, :, idx) and V [S, KVH, M, Dh] at (slot, :, idx): both
        # indexed views are [B, T, KVH, Dh] (the advanced indices' axes come first)
        ks[i] = ks[i].at[slot_BxT, :, :, idx_BxT].set(k.astype(ks[i].dtype), mode="drop")
        vs[i] = vs[i].at[slot_BxT, :, idx_BxT].set(v.astype(vs[i].dtype), mode="drop")
        if live_decode:  # decode over the live blocks only
            k_own, v_own = (a.astype(ks[i].dtype).astype(dtype) for a in (k, v))  # as stored
            out = attention.live_decode_attention(
                q, k_own, v_own, ks[i], vs[i], start_B, kv_block, live
            )
            x = _finish_block(p, x, out, spec, dtype)
            continue
        if live_prefill:  # one prefill row over its live blocks
            out = attention.live_prefill_attention(
                q, ks[i], vs[i], slot_B[0], idx_BxT, start_B + t, kv_block,
            )  # fmt: skip
            x = _finish_block(p, x, out, spec, dtype)
            continue
        k_BxKxDhxM = (ks[i] if every else ks[i][slot_B]).astype(dtype)
        v_BxKxMxDh = (vs[i] if every else vs[i][slot_B]).astype(dtype)
        out = attention.cached_attention(q, k_BxKxDhxM, v_BxKxMxDh, idx_BxT, start_B + t)
        x = _finish_block(p, x, out, spec, dtype)
    x = rms_norm(x, weights["final_norm"], spec.rms_eps)
    return x, {"k": tuple(ks), "v": tuple(vs)}


def param_logical_axes(model_or_state):
    """Pytree matching nnx.state(model, nnx.Param) whose leaves are logical-axis tuples."""
    state = model_or_state
    if isinstance(model_or_state, nnx.Module):
        state = nnx.state(model_or_state, nnx.Param)
    return jax.tree.map(
        lambda v: v.replace(tuple(v.get_metadata()["logical_axes"])),
        state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )


def cache_logical_axes(num_layers: int):
    """Logical axes of init_cache's pytree (slots over 'batch', kv heads over 'kv_heads')."""
    return {k: (CACHE_AXES[k],) * num_layers for k in "kv"}


def abstract_model(spec, seed: int = 0):
    """(graphdef, abstract state) without allocating parameters."""
    return nnx.split(nnx.eval_shape(lambda: Decoder(spec, nnx.Rngs(seed))))


def state_shardings(spec, cell, role: str):
    """NamedShardings of the parameter state on ``cell`` laid out for ``role``."""
    _, abstract_state = abstract_model(spec)
    return gmesh.tree_shardings(cell, role, param_logical_axes(abstract_state), abstract_state)


def init_sharded(spec, seed: int, cell, role: str):
    """Initialises the parameters directly in their sharded layout -> (graphdef, state)."""
    graphdef, _ = abstract_model(spec, seed)
    shardings = state_shardings(spec, cell, role)

    @functools.partial(jax.jit, out_shardings=shardings)
    def init():
        return nnx.state(Decoder(spec, nnx.Rngs(seed)), nnx.Param)

    return graphdef, init()


def apply(graphdef, state, tokens_BxT, pos_BxT, leave_BxT, remat: str | bool = "none"):
    """Pure forward for plain jax.jit: -> final-normed hidden [B,T,D]."""
    return nnx.merge(graphdef, state)(tokens_BxT, pos_BxT, leave_BxT, remat=remat)


def apply_logits(graphdef, state, hidden_BxNxD):
    """Pure head: hidden [B,N,D] -> float32 logits [B,N,V]."""
    return nnx.merge(graphdef, state).logits(hidden_BxNxD)


def serving_weights(graphdef, state) -> dict:
    """The parameter state in the rollout engine's layout: {'embed' [V,D], 'final_norm' [D],
    'lm_head' [D,V] (untied only), 'layers': L dicts of one layer's arrays} (a copy of the
    stacked layers; the engine keeps only this). Axes: :func:`serving_logical_axes`."""
    return nnx.merge(graphdef, state).serving_weights()
