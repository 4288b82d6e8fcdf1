"""Qwen3-style decoder (flax.nnx), tree-capable attention, HF safetensors I/O."""

from gyre.model.decoder import (
    Decoder,
    ModelSpec,
    apply,
    apply_logits,
    cache_logical_axes,
    init_sharded,
    param_logical_axes,
    state_shardings,
)

__all__ = [
    "Decoder",
    "ModelSpec",
    "apply",
    "apply_logits",
    "cache_logical_axes",
    "init_sharded",
    "param_logical_axes",
    "state_shardings",
]
