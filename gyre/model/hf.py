"""HF Qwen3 names and layouts <-> Gyre's: config.json keys, tensor names and shapes.

Pure conversions; the files are read and written by :mod:`gyre.model.hf_dir`.
HF linear weights are [out, in]; Gyre kernels are [in, ...] with heads split out
(q: [D, H, Dh], o: [H, Dh, D]) and layers stacked on a leading axis.
"""

from __future__ import annotations

import dataclasses

import numpy as np

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


def expected_shapes(spec: decoder.ModelSpec) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape ([out, in] for linear weights) that ``spec`` implies."""
    v, d, h, kvh, dh, f = (
        spec.vocab_size, spec.d_model, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.d_ff
    )  # fmt: skip
    per_layer = {
        "attn_norm": (d,),
        "q": (h * dh, d),
        "k": (kvh * dh, d),
        "v": (kvh * dh, d),
        "o": (d, h * dh),
        "q_norm": (dh,),
        "k_norm": (dh,),
        "mlp_norm": (d,),
        "gate": (f, d),
        "up": (f, d),
        "down": (d, f),
    }
    out = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    for i in range(spec.num_layers):
        for ours, theirs in LAYER_NAMES.items():
            out[f"model.layers.{i}.{theirs}"] = per_layer[ours]
    if not spec.tie_embeddings:
        out["lm_head.weight"] = (v, d)
    return out


# Weights are stored as floats; an integer tensor of the right byte count would load as its
# integer values, silently (bfloat16 comes from ml_dtypes, whose kind is not 'f').
FLOAT_DTYPES = ("float32", "float16", "bfloat16")


def hf_to_pure(tensors: dict[str, np.ndarray], spec, files: dict[str, str] | None = None) -> dict:
    """HF tensor dict -> nested float32 numpy dict shaped like nnx.to_pure_dict(state).

    ``files``: tensor name -> the file holding it, so that an error names both (a
    CheckpointError; else the checkpoint)."""
    pure: dict = {"layers": {}}
    for path, value in pure_leaves(tensors, spec, files):
        (pure["layers"] if path[0] == "layers" else pure)[path[-1]] = value
    return pure


def pure_leaves(tensors, spec, files: dict[str, str] | None = None):
    """:func:`hf_to_pure`'s leaves one at a time: yields (path, float32 array), path
    ('embed',) or ('layers', name), ...; ``tensors`` may be lazy (memory-mapped), so a caller
    that places each leaf before taking the next holds one leaf in host memory, not all."""
    from gyre.model.safetensors_io import fail

    d, h, kvh, dh = spec.d_model, spec.num_heads, spec.num_kv_heads, spec.head_dim
    shapes = expected_shapes(spec)

    def get(name):
        where = (files or {}).get(name, "checkpoint")
        if name not in tensors:
            raise fail(where, f"lacks tensor {name}")
        x = tensors[name]
        if str(x.dtype) not in FLOAT_DTYPES:
            raise fail(where, f"tensor {name} has dtype {x.dtype}, not one of {FLOAT_DTYPES}")
        if tuple(x.shape) != shapes.get(name, tuple(x.shape)):
            raise fail(where, f"tensor {name} has shape {list(x.shape)}, the config implies "
                              f"{list(shapes[name])}")  # fmt: skip
        return np.asarray(x, np.float32)

    layout = {  # HF [out, in] -> gyre kernel
        "q": lambda w: w.T.reshape(d, h, dh),
        "k": lambda w: w.T.reshape(d, kvh, dh),
        "v": lambda w: w.T.reshape(d, kvh, dh),
        "o": lambda w: w.T.reshape(h, dh, d),
        "gate": lambda w: w.T,
        "up": lambda w: w.T,
        "down": lambda w: w.T,
    }
    for ours, theirs in LAYER_NAMES.items():
        fix = layout.get(ours, lambda w: w)
        stacked = None
        for i in range(spec.num_layers):  # filled layer by layer: no list of copies
            w = fix(get(f"model.layers.{i}.{theirs}"))
            if stacked is None:
                stacked = np.empty((spec.num_layers, *w.shape), np.float32)
            stacked[i] = w
        yield ("layers", ours), stacked
    yield ("embed",), get("model.embed_tokens.weight")
    yield ("final_norm",), get("model.norm.weight")
    if not spec.tie_embeddings:
        yield ("lm_head",), np.ascontiguousarray(get("lm_head.weight").T)


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
