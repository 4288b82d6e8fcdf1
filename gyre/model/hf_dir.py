"""A local Hugging Face Qwen3 directory as a model: read, check, load, save. Never networked.

Layout (as transformers writes it): config.json; model.safetensors, or shards named by
model.safetensors.index.json; and, when the directory has a tokenizer, the tokenizer-side
files (:mod:`gyre.model.tokenizer_files`). A directory without tokenizer.json holds weights
only (e.g. a ledger task's export): that is a case, not an error, and its ``text`` is None.

    ckpt = read(path, base)                 # config, tokenizer side, weight headers: checked
    params = load_params(ckpt, cell, role)  # the weights, placed for a cell's role
    save(out, params, ckpt.spec, ckpt)      # opens in transformers; keeps the tokenizer side

:func:`read` checks every file and their agreement up front, so a bad directory stops a run
with one line naming the file and field before anything is compiled.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from gyre.model import decoder, hf, safetensors_io, tokenizer_files
from gyre.model.safetensors_io import INDEX, WEIGHTS, fail, read_json
from gyre.model.safetensors_io import CheckpointError as CheckpointError  # callers catch it here
from gyre.model.tokenizer_files import TokenizerFiles

CONFIG = "config.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' customary shard size


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A checked HF Qwen3 directory: everything but the weights, which :func:`load_params`
    reads. ``spec``: ``base`` with the architecture of config.json. ``text``: the tokenizer
    side, None for a directory without tokenizer.json."""

    path: str
    spec: decoder.ModelSpec
    text: TokenizerFiles | None


def read(path, base: decoder.ModelSpec) -> Checkpoint:
    """Reads and cross-checks a local HF Qwen3 directory (weights: headers only).

    ``base`` supplies the non-architecture fields (dtype, attention, attn_block); a tokenizer
    with fewer ids than the vocabulary sets ``sample_vocab`` (the rest are padding). Raises
    CheckpointError (one line: file, field, problem) on any missing or inconsistent file.
    """
    folder = os.fspath(path)
    if not os.path.isdir(folder):
        raise fail(folder, "not a directory (model.hf_dir must name a checkpoint folder)")
    config_path = os.path.join(folder, CONFIG)
    config = read_json(config_path)
    try:
        spec = hf.config_from_hf(config, base)
    except (ValueError, TypeError, KeyError) as e:
        raise fail(config_path, str(e).removeprefix("config.json ")) from e
    text = None
    if tokenizer_files.has_tokenizer(folder):
        text = tokenizer_files.read(folder, spec.vocab_size)
        if text.num_tokens < spec.vocab_size:  # padded ids: never sampled (ModelSpec)
            spec = dataclasses.replace(spec, sample_vocab=text.num_tokens)
    _check_weights(folder, spec)
    return Checkpoint(folder, spec, text)


def _check_weights(folder: str, spec: decoder.ModelSpec) -> None:
    """Every tensor the config implies is present with its shape (extra tensors are allowed)."""
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    for path in safetensors_io.weight_files(folder):
        found.update({k: (shape, path) for k, shape in safetensors_io.read_shapes(path).items()})
    for name, shape in hf.expected_shapes(spec).items():
        if name not in found:
            where = INDEX if os.path.isfile(os.path.join(folder, INDEX)) else WEIGHTS
            raise fail(os.path.join(folder, where), f"lacks tensor {name} that {CONFIG} implies")
        got, path = found[name]
        if got != shape:
            raise fail(path, f"tensor {name} has shape {list(got)}; {CONFIG} implies {list(shape)}")


def load_params(ckpt: Checkpoint, cell=None, role: str = "train"):
    """The checkpoint's weights as the decoder's parameter state (float32, whatever the stored
    dtype), placed on ``cell`` for ``role`` if given.

    Streamed: the files are memory-mapped, and each parameter (a stacked layer tensor, the
    embedding, ...) is converted to float32 on the host and placed on its devices before the
    next is made, so the host holds one parameter's float32 copy at a time beside what is
    placed (tests/test_hf_stream.py measures the peak)."""
    try:
        tensors, files = safetensors_io.map_folder(ckpt.path)  # errors name the file
    except OSError as e:  # a file removed or unreadable since read()
        raise fail(os.path.join(ckpt.path, WEIGHTS), e) from e
    _, state = decoder.abstract_model(ckpt.spec)
    shardings = nnx.to_pure_dict(decoder.state_shardings(ckpt.spec, cell, role)) if cell else None
    placed: dict = {"layers": {}}
    try:
        for path, value in hf.pure_leaves(tensors, ckpt.spec, files):
            target = shardings
            for key in path:
                target = target[key] if target is not None else None
            (placed["layers"] if path[0] == "layers" else placed)[path[-1]] = (
                jax.device_put(value, target) if target is not None else jax.device_put(value)
            )
            del value
    except OSError as e:  # a file cut short under the map
        raise fail(os.path.join(ckpt.path, WEIGHTS), e) from e
    del tensors
    nnx.replace_by_pure_dict(state, placed)
    return state


def load(path, base: decoder.ModelSpec, cell=None, role: str = "train"):
    """:func:`read` then :func:`load_params` -> (spec, params, text or None)."""
    ckpt = read(path, base)
    return ckpt.spec, load_params(ckpt, cell, role), ckpt.text


SAVE_DTYPES = ("float32", "bfloat16", "float16")


def source_dtype(source: Checkpoint | None) -> str:
    """The dtype ``source``'s weights are stored in; float32 without a readable source."""
    if source is None:
        return "float32"
    try:
        return safetensors_io.stored_dtype(source.path)
    except (CheckpointError, OSError):  # its folder gone since it was read
        return "float32"


def _saved_config(spec: decoder.ModelSpec, source: Checkpoint | None, dtype: str) -> dict:
    """The source's config.json (token ids, context length, ...) with ``spec``'s architecture."""
    src_path = os.path.join(source.path, CONFIG) if source else ""
    src = read_json(src_path) if os.path.isfile(src_path) else {}
    out = {**src, **hf.config_to_hf(spec)}
    if "max_position_embeddings" in src:
        out["max_position_embeddings"] = src["max_position_embeddings"]
    out["rope_theta"] = float(spec.rope_theta)  # the key older transformers read
    out.pop("rope_scaling", None)  # superseded by rope_parameters (default rope only)
    out["dtype"] = dtype
    if "torch_dtype" in src:
        out["torch_dtype"] = dtype
    return out


def save(
    path,
    params,
    spec: decoder.ModelSpec,
    source: Checkpoint | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: str | None = None,
) -> str:
    """Writes ``params`` as a HF Qwen3 directory at ``path`` that transformers opens.

    Weights in ``dtype`` ("float32": exact; "bfloat16": half the bytes; None: the dtype the
    ``source`` stores its weights in, so a bf16 checkpoint exports as bf16, and float32
    without a source with weights), sharded with an index
    above ``max_shard_bytes``. With a ``source`` that has a tokenizer side, its files are
    copied (or written from its fields when its folder is gone); without one the directory
    holds weights only. The folder is built beside ``path`` and swapped in, so a crash never
    leaves a half-written checkpoint and stale shards never survive. ``path`` may be
    ``source.path``. Returns ``path``.
    """
    if dtype is None:
        dtype = source_dtype(source)
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"save dtype {dtype!r}: expected one of {SAVE_DTYPES}")
    text = source.text if source else None
    if text is not None and text.num_tokens > spec.vocab_size:
        raise ValueError(
            f"tokenizer has {text.num_tokens} tokens, the model only {spec.vocab_size}"
        )
    folder = os.path.abspath(os.fspath(path))
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"{folder}: exists and is not a directory")
    tmp = f"{folder}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)

    pure = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), nnx.to_pure_dict(params))
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    tensors = {k: v.astype(np_dtype, copy=False) for k, v in hf.pure_to_hf(pure, spec).items()}
    del pure
    safetensors_io.write_json(os.path.join(tmp, CONFIG), _saved_config(spec, source, dtype))
    safetensors_io.write_folder(tmp, tensors, max_shard_bytes)
    del tensors
    if text is not None:
        tokenizer_files.write(tmp, text, source.path)

    if os.path.isdir(folder):
        old = f"{folder}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(folder, old)
        os.rename(tmp, folder)
        shutil.rmtree(old)
    else:
        os.rename(tmp, folder)
    return folder
