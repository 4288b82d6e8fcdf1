"""Qwen3-style decoder (flax.nnx), tree-capable attention, HF safetensors I/O."""

from gyre.model.decoder import (
    Decoder,
    ModelSpec,
    apply,
    apply_cached,
    apply_logits,
    cache_logical_axes,
    init_sharded,
    param_logical_axes,
    state_shardings,
)
from gyre.model.hf import load_hf, save_hf

__all__ = [
    "Decoder",
    "ModelSpec",
    "apply",
    "apply_cached",
    "apply_logits",
    "cache_logical_axes",
    "init_sharded",
    "load_hf",
    "param_logical_axes",
    "save_hf",
    "state_shardings",
]
