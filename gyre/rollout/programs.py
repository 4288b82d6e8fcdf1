"""The jit programs of a rollout cell: chunked prefill, batched decode, KV row moves.

Every shape is fixed (one prefill chunk for one slot; one decode token for every slot), so
each compiles once per cell, and every engine built for the same (cell, config) shares them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from gyre import mesh as gmesh
from gyre.model import decoder as gdec
from gyre.rollout import sampler


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
    """What a rollout cell's programs and engine depend on (frozen: it keys the jit cache)."""

    model: gdec.ModelSpec
    slots: int = 16  # KV slots per cell (concurrent requests)
    max_len: int = 512  # tokens per slot
    prefill_chunk: int = 64
    temperature: float = 1.0  # default for requests that set none
    top_p: float = 1.0
    seed: int = 0  # sampler base key
    # KV pool budget per cell in tokens (gyre/rollout/engine.py); 0 = derived: slots * max_len
    # on CPU, device memory minus weights minus a reserve where the platform reports memory.
    # Not a shape: the programs ignore it (programs_for drops it from the jit cache key).
    kv_tokens: int = 0

    def __post_init__(self):
        for name in ("slots", "max_len", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_tokens < 0:
            raise ValueError(f"rollout.kv_tokens must be >= 0, got {self.kv_tokens}")


class Programs:
    """The jit programs of one cell (one compile per cell; every shape is fixed)."""

    def __init__(self, r: RolloutSpec, cell: gmesh.Cell):
        spec = r.model
        self.graphdef, abstract_state = gdec.abstract_model(spec)
        s, m, c = r.slots, r.max_len, r.prefill_chunk
        cache_shape = (spec.num_layers, s, m, spec.num_kv_heads, spec.head_dim)
        abstract_cache = {k: jax.ShapeDtypeStruct(cache_shape, spec.dtype) for k in "kv"}
        rows_axes = ("layers", None, "length", "kv_heads", "head_dim")
        self.state_sh = gdec.state_shardings(spec, cell, "rollout")
        self.cache_sh = gmesh.tree_shardings(
            cell, "rollout", gdec.cache_logical_axes(), abstract_cache
        )
        self.rows_sh = {k: gmesh.sharding_for(cell, "rollout", rows_axes) for k in "kv"}
        rep = NamedSharding(cell.mesh, PartitionSpec())
        vec = gmesh.sharding_for(cell, "rollout", ("batch",), (s,), "rollout.slots")
        base = sampler.base_key(r.seed)
        graphdef, top_p = self.graphdef, float(r.top_p)

        def prefill(state, cache, tokens_1xC, start_1, slot_1, last_1, hash_1, call_1, temp_1):
            pos_1xC = start_1[:, None] + jnp.arange(c, dtype=jnp.int32)[None, :]
            hidden, cache = gdec.apply_cached(
                graphdef, state, tokens_1xC, pos_1xC, cache, slot_1, start_1
            )
            h_1x1xD = jnp.take_along_axis(hidden, last_1[:, None, None], axis=1)
            logits_1xV = gdec.apply_logits(graphdef, state, h_1x1xD)[:, 0]
            keys = sampler.token_keys(base, hash_1, call_1, start_1 + last_1 + 1)
            return (cache, *sampler.sample(logits_1xV, keys, temp_1, top_p))

        def decode(state, cache, tokens_S, start_S, hash_S, call_S, temp_S):
            slot_S = jnp.arange(s, dtype=jnp.int32)
            hidden, cache = gdec.apply_cached(
                graphdef, state, tokens_S[:, None], start_S[:, None], cache, slot_S, start_S
            )
            logits_SxV = gdec.apply_logits(graphdef, state, hidden)[:, 0]
            keys = sampler.token_keys(base, hash_S, call_S, start_S + 1)
            return (cache, *sampler.sample(logits_SxV, keys, temp_S, top_p))

        def read_rows(cache, slot):
            return {k: jax.lax.dynamic_slice_in_dim(v, slot, 1, axis=1) for k, v in cache.items()}

        def write_rows(cache, rows, slot):
            return {
                k: jax.lax.dynamic_update_slice_in_dim(v, rows[k].astype(v.dtype), slot, axis=1)
                for k, v in cache.items()
            }

        out = (self.cache_sh, rep, rep)
        self.prefill = jax.jit(prefill, donate_argnums=1, out_shardings=out)
        self.decode = jax.jit(
            decode,
            donate_argnums=1,
            in_shardings=(self.state_sh, self.cache_sh, vec, vec, vec, vec, vec),
            out_shardings=(self.cache_sh, vec, vec),
        )
        self.read_rows = jax.jit(read_rows, out_shardings=self.rows_sh)
        self.write_rows = jax.jit(write_rows, donate_argnums=0, out_shardings=self.cache_sh)
        zeros = lambda: {k: jnp.zeros(cache_shape, spec.dtype) for k in "kv"}
        self.new_cache = jax.jit(zeros, out_shardings=self.cache_sh)


def programs_for(spec: RolloutSpec, cell: gmesh.Cell) -> Programs:
    """Programs of ``cell`` for ``spec``, shared by every engine built for the same pair.

    Engines that differ only in their KV budget (``kv_tokens``, host-side accounting) share them.
    """
    return _programs_for(dataclasses.replace(spec, kv_tokens=0), cell)


@functools.lru_cache(maxsize=64)
def _programs_for(spec: RolloutSpec, cell: gmesh.Cell) -> Programs:
    return Programs(spec, cell)
