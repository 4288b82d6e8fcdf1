"""HF Qwen3 checkpoints (config.json + safetensors) <-> Gyre decoder state. Never networked.

HF linear weights are [out, in]; Gyre kernels are [in, ...] with heads split out
(q: [D, H, Dh], o: [H, Dh, D]) and layers stacked on a leading axis.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from gyre.model import decoder

# gyre config key -> HF config.json key (architecture only)
CONFIG_KEYS = {
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "d_ff": "intermediate_size",
    "rms_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings",
}
# gyre layer parameter -> HF name inside model.layers.{i}.
LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
}


def _typed(key: str, value, kind: type):
    """A config.json value checked against the field's type (bool("false") would be True)."""
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool) and value > 0,
        float: isinstance(value, int | float) and not isinstance(value, bool) and value > 0,
    }.get(kind, True)
    if not ok:
        want = {bool: "true or false", int: "a positive integer", float: "a positive number"}
        raise ValueError(f"config.json {key}={value!r} is not {want[kind]}")
    return kind(value)


def config_from_hf(hf: dict, base: decoder.ModelSpec) -> decoder.ModelSpec:
    """``base`` with its architecture fields replaced by an HF Qwen3 config.json dict's; the
    others (dtype, attention, attn_block) are kept."""
    if hf.get("model_type") not in (None, "qwen3"):
        raise ValueError(f"config.json model_type is {hf.get('model_type')!r}, expected 'qwen3'")
    for key, ok in (("attention_bias", False), ("use_sliding_window", False)):
        if hf.get(key, ok) != ok:
            raise ValueError(f"config.json {key}={hf[key]!r} is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(
            f"config.json hidden_act={hf['hidden_act']!r} is not supported (silu only)"
        )
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"config.json rope type {rope.get('rope_type')!r} is not supported")
    hf = dict(hf)
    if "head_dim" not in hf:  # Qwen3 configs may leave it implicit
        for key in ("hidden_size", "num_attention_heads"):
            if key not in hf:
                raise ValueError(f"config.json lacks {key!r}")
            _typed(key, hf[key], int)
        hf["head_dim"] = hf["hidden_size"] // hf["num_attention_heads"]
    hf.setdefault("tie_word_embeddings", False)
    arch = {}
    for ours, theirs in CONFIG_KEYS.items():
        if theirs not in hf:
            raise ValueError(f"config.json lacks {theirs!r}")
        arch[ours] = _typed(theirs, hf[theirs], type(getattr(base, ours)))
    arch["rope_theta"] = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    return dataclasses.replace(base, **arch)


def config_to_hf(spec: decoder.ModelSpec) -> dict:
    """HF Qwen3 config.json dict for a gyre model config."""
    out = {theirs: getattr(spec, ours) for ours, theirs in CONFIG_KEYS.items()}
    out.update(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        hidden_act="silu",
        attention_bias=False,
        attention_dropout=0.0,
        use_sliding_window=False,
        max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": float(spec.rope_theta)},
        dtype="float32",
    )
    return out


class CheckpointError(ValueError):
    """An unreadable checkpoint file; the message names the file and what is wrong."""


_MAX_HEADER = 100_000_000  # bytes; safetensors itself refuses larger headers


def _read_safetensors(path: str) -> dict[str, np.ndarray]:
    """All tensors of one file as numpy; bfloat16 (absent from numpy) read via ml_dtypes.

    Every malformed file (truncated, bad header, offsets past the end) is a CheckpointError.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        # Bound the length before reading it: a garbage length would allocate up to 2^64 bytes.
        if size < 8 or header_len > min(size - 8, _MAX_HEADER):
            raise CheckpointError(
                f"{path}: header length {header_len} does not fit the file's {size} bytes "
                "(truncated, or not a safetensors file)"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
        out = {}
        # safe_open checks every entry (BF16 too): dtype, shape and offsets within the file.
        with safe_open(path, framework="np") as f:
            for name in f.keys():
                if header[name]["dtype"] != "BF16":
                    out[name] = f.get_tensor(name)
        bf16 = [n for n, h in header.items() if n != "__metadata__" and h["dtype"] == "BF16"]
        if bf16:
            data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
            for name in bf16:
                start, end = header[name]["data_offsets"]
                flat = np.asarray(data[start:end]).view(ml_dtypes.bfloat16)
                out[name] = flat.reshape(header[name]["shape"])
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: header is not UTF-8 ({e.reason} at byte {e.start})") from e
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: header is not JSON ({e})") from e
    except (SafetensorError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise CheckpointError(f"{path}: not a valid safetensors file ({e})") from e
    return out


def read_tensors(folder: str) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint folder (single file or sharded with an index)."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # JSON, UTF-8, layout
            raise CheckpointError(f"{index}: not a safetensors index ({e!r})") from e
        paths = [os.path.join(folder, name) for name in files]
    else:
        paths = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not paths:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    tensors = {}
    for path in paths:
        tensors.update(_read_safetensors(path))
    return tensors


def hf_to_pure(tensors: dict[str, np.ndarray], spec) -> dict:
    """HF tensor dict -> nested float32 numpy dict shaped like nnx.to_pure_dict(state)."""
    d, h, kvh, dh = spec.d_model, spec.num_heads, spec.num_kv_heads, spec.head_dim

    def get(name):
        if name not in tensors:
            raise KeyError(f"checkpoint lacks tensor {name!r}")
        return np.asarray(tensors[name], np.float32)

    layout = {  # HF [out, in] -> gyre kernel
        "q": lambda w: w.T.reshape(d, h, dh),
        "k": lambda w: w.T.reshape(d, kvh, dh),
        "v": lambda w: w.T.reshape(d, kvh, dh),
        "o": lambda w: w.T.reshape(h, dh, d),
        "gate": lambda w: w.T,
        "up": lambda w: w.T,
        "down": lambda w: w.T,
    }
    layers = {}
    for ours, theirs in LAYER_NAMES.items():
        fix = layout.get(ours, lambda w: w)
        per_layer = [fix(get(f"model.layers.{i}.{theirs}")) for i in range(spec.num_layers)]
        layers[ours] = np.stack(per_layer)
    pure = {
        "embed": get("model.embed_tokens.weight"),
        "layers": layers,
        "final_norm": get("model.norm.weight"),
    }
    if not spec.tie_embeddings:
        pure["lm_head"] = get("lm_head.weight").T
    return pure


def pure_to_hf(pure: dict, spec) -> dict[str, np.ndarray]:
    """Inverse of hf_to_pure: nested numpy dict -> HF tensor names, [out, in] layout."""
    d = spec.d_model
    layout = {
        "q": lambda w: w.reshape(d, -1).T,
        "k": lambda w: w.reshape(d, -1).T,
        "v": lambda w: w.reshape(d, -1).T,
        "o": lambda w: w.reshape(-1, d).T,
        "gate": lambda w: w.T,
        "up": lambda w: w.T,
        "down": lambda w: w.T,
    }
    out = {"model.embed_tokens.weight": pure["embed"], "model.norm.weight": pure["final_norm"]}
    for ours, theirs in LAYER_NAMES.items():
        fix = layout.get(ours, lambda w: w)
        for i in range(spec.num_layers):
            out[f"model.layers.{i}.{theirs}"] = fix(pure["layers"][ours][i])
    if not spec.tie_embeddings:
        out["lm_head.weight"] = pure["lm_head"].T
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def load_hf(folder: str, base: decoder.ModelSpec, cell=None, role: str = "train"):
    """HF Qwen3 folder -> (graphdef, state, spec); state placed on ``cell`` if given.

    Architecture fields of ``base`` are replaced by the checkpoint's; the others (dtype,
    attention, attn_block) are kept.
    """
    with open(os.path.join(folder, "config.json")) as f:
        spec = config_from_hf(json.load(f), base)
    graphdef, abstract = decoder.abstract_model(spec)
    pure = hf_to_pure(read_tensors(folder), spec)
    want = jax.tree.map(lambda x: x.shape, nnx.to_pure_dict(abstract))
    got = jax.tree.map(lambda x: x.shape, pure)
    if want != got:
        raise ValueError(f"checkpoint shapes {got} do not match the config's {want}")
    state = abstract  # replaced leaf by leaf below
    nnx.replace_by_pure_dict(state, pure)
    if cell is not None:
        state = jax.device_put(state, decoder.state_shardings(spec, cell, role))
    else:
        state = jax.device_put(state)
    return graphdef, state, spec


def save_hf(folder: str, graphdef, state, spec: decoder.ModelSpec) -> None:
    """Writes config.json + model.safetensors (float32) that transformers can load."""
    del graphdef  # the layout is fixed by the spec
    os.makedirs(folder, exist_ok=True)
    pure = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), nnx.to_pure_dict(state))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config_to_hf(spec), f, indent=2)
    save_file(pure_to_hf(pure, spec), os.path.join(folder, "model.safetensors"), {"format": "pt"})
