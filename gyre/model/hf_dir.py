"""A local Hugging Face Qwen3 directory as a model: read, check, load and save. Never networked.

Layout (as transformers writes it): config.json; model.safetensors, or shards named by
model.safetensors.index.json; tokenizer.json (read with the ``tokenizers`` library);
tokenizer_config.json (chat template, eos/pad tokens) or a chat_template.jinja beside it;
generation_config.json (stop ids). :func:`read_checkpoint` checks every file and their
agreement up front, so a bad directory stops a run with one line naming the file and field
before anything is compiled.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from tokenizers import Tokenizer

from gyre.chat.format import compile_template
from gyre.model import decoder, hf
from gyre.model.hf import CheckpointError

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # transformers >= 4.50 saves the template here
GENERATION_CONFIG = "generation_config.json"
# Tokenizer-side files copied verbatim from the source checkpoint when saving.
TOKENIZER_FILES = (
    TOKENIZER,
    TOKENIZER_CONFIG,
    CHAT_TEMPLATE_FILE,
    GENERATION_CONFIG,
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
)
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' customary shard size
_DTYPES = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "F16": np.float16}
_DTYPE_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A checked HF Qwen3 directory: everything but the weights, which :func:`load_weights` reads.

    ``spec``: ``base`` with the architecture of config.json. ``tokenizer``: tokenizer.json.
    ``chat_template``: Jinja source. ``stop_ids``: generation_config.json's eos_token_id(s),
    in its order. ``pad_id``: tokenizer_config.json's pad_token (else generation_config's
    pad_token_id, else the first stop id).
    """

    path: str
    spec: decoder.ModelSpec
    tokenizer: Tokenizer
    chat_template: str
    stop_ids: tuple[int, ...]
    pad_id: int

    @property
    def tokenizer_vocab(self) -> int:
        """Token ids the tokenizer can produce: 0 .. tokenizer_vocab-1 (<= spec.vocab_size)."""
        return _tokenizer_size(self.tokenizer)


def _fail(path: str, what: str) -> CheckpointError:
    """A one-line error naming the file and what is wrong in it."""
    return CheckpointError(f"{path}: {' '.join(str(what).split())}")


def write_json(path: str, obj) -> None:
    """JSON as transformers writes it (indented, UTF-8, trailing newline)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def _read_json(folder: str, name: str, required: bool = True) -> dict | None:
    """A JSON object file of the checkpoint; missing (if required), malformed or not an object
    is a CheckpointError naming it."""
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        if required:
            raise _fail(path, "missing (a Hugging Face checkpoint directory needs it)")
        return None
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except UnicodeDecodeError as e:
        raise _fail(path, f"not UTF-8 ({e.reason} at byte {e.start})") from e
    except json.JSONDecodeError as e:
        raise _fail(path, f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from e
    if not isinstance(obj, dict):
        raise _fail(path, f"expected a JSON object, got {type(obj).__name__}")
    return obj


def _tokenizer_size(tok: Tokenizer) -> int:
    """1 + the largest id the tokenizer knows (added tokens included)."""
    return max(tok.get_vocab(with_added_tokens=True).values()) + 1


def _token_name(value) -> str | None:
    """tokenizer_config.json token fields are a string or {"content": ...} (older files)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _read_chat_template(folder: str, tok_config: dict) -> str:
    """chat_template.jinja if present (transformers prefers it), else tokenizer_config.json's
    chat_template: a string, or a list of {"name", "template"} from which "default" is taken."""
    jinja_path = os.path.join(folder, CHAT_TEMPLATE_FILE)
    cfg_path = os.path.join(folder, TOKENIZER_CONFIG)
    if os.path.isfile(jinja_path):
        where = jinja_path
        with open(jinja_path, encoding="utf-8") as f:
            template = f.read()
    else:
        where = f"{cfg_path} field chat_template"
        template = tok_config.get("chat_template")
        if template is None:
            raise _fail(cfg_path, f"no chat_template field (and no {CHAT_TEMPLATE_FILE})")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            if "default" not in named:
                raise _fail(
                    cfg_path, f"chat_template list has no 'default' entry (names: {sorted(named)})"
                )
            template = named["default"]
        if not isinstance(template, str):
            raise _fail(cfg_path, f"chat_template is {type(template).__name__}, not a string")
    try:  # compile now: a broken template should stop the run here, not mid-rollout
        compile_template(template)
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from e
    return template


def render_chat(
    template: str,
    messages: list[dict],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = False,
    **kwargs,
) -> str:
    """The text transformers' ``apply_chat_template(..., tokenize=False)`` renders for a
    conversation (dicts with role/content/tool_calls/reasoning_content; ``tools`` as JSON
    schemas; extra variables such as ``enable_thinking`` or ``eos_token`` in ``kwargs``)."""
    return compile_template(template).render(
        messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs
    )


def _read_stop_ids(folder: str, n_tok: int) -> tuple[tuple[int, ...], dict]:
    path = os.path.join(folder, GENERATION_CONFIG)
    gen = _read_json(folder, GENERATION_CONFIG)
    eos = gen.get("eos_token_id")
    ids = [eos] if _is_int(eos) else eos
    if not isinstance(ids, list) or not ids or not all(_is_int(i) for i in ids):
        raise _fail(path, f"eos_token_id={eos!r} is not an id or a non-empty list of ids")
    bad = [i for i in ids if not 0 <= i < n_tok]
    if bad:
        raise _fail(path, f"eos_token_id {bad} out of range for the tokenizer's {n_tok} tokens")
    return tuple(dict.fromkeys(ids)), gen


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
        for ours, theirs in hf.LAYER_NAMES.items():
            out[f"model.layers.{i}.{theirs}"] = per_layer[ours]
    if not spec.tie_embeddings:
        out["lm_head.weight"] = (v, d)
    return out


def _read_header(path: str) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors header, without reading the data."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n > size - 8:
                raise _fail(path, f"header length {n} does not fit the file's {size} bytes")
            header = json.loads(f.read(n).decode("utf-8"))
        return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # JSON, UTF-8, layout
        raise _fail(path, f"not a valid safetensors header ({e!r})") from e


def _weight_files(folder: str) -> list[str]:
    """The safetensors files: the index's weight_map values (each must exist), else
    model.safetensors."""
    index_path = os.path.join(folder, INDEX)
    if os.path.isfile(index_path):
        index = _read_json(folder, INDEX)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise _fail(index_path, "weight_map is missing, empty or not an object")
        files = sorted(set(weight_map.values()))
        for name in files:
            if not isinstance(name, str) or os.path.basename(name) != name:
                raise _fail(index_path, f"weight_map names {name!r}, not a file in the folder")
            if not os.path.isfile(os.path.join(folder, name)):
                raise _fail(index_path, f"weight_map names {name!r}, which does not exist")
        return [os.path.join(folder, n) for n in files]
    single = os.path.join(folder, WEIGHTS)
    if not os.path.isfile(single):
        raise _fail(single, f"missing (and no {INDEX} naming shards)")
    return [single]


def _check_weights(folder: str, spec: decoder.ModelSpec) -> None:
    """Every tensor the config implies is present with its shape (extra tensors are allowed)."""
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    for path in _weight_files(folder):
        found.update({k: (shape, path) for k, shape in _read_header(path).items()})
    for name, shape in expected_shapes(spec).items():
        if name not in found:
            where = INDEX if os.path.isfile(os.path.join(folder, INDEX)) else WEIGHTS
            raise _fail(os.path.join(folder, where), f"lacks tensor {name} that {CONFIG} implies")
        got, path = found[name]
        if got != shape:
            raise _fail(
                path, f"tensor {name} has shape {list(got)}; {CONFIG} implies {list(shape)}"
            )


def read_checkpoint(path, base: decoder.ModelSpec) -> Checkpoint:
    """Reads and cross-checks a local HF Qwen3 directory (weights: headers only).

    ``base`` supplies the non-architecture fields (dtype, attention, attn_block). Raises
    CheckpointError (one line: file, field, problem) on any missing or inconsistent file.
    """
    folder = os.fspath(path)
    if not os.path.isdir(folder):
        raise _fail(folder, "not a directory (model.hf_dir must name a checkpoint folder)")
    config_path = os.path.join(folder, CONFIG)
    try:
        spec = hf.config_from_hf(_read_json(folder, CONFIG), base)
    except (ValueError, TypeError, KeyError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise _fail(config_path, str(e).removeprefix("config.json ")) from e

    tok_path = os.path.join(folder, TOKENIZER)
    if not os.path.isfile(tok_path):
        raise _fail(tok_path, "missing (a Hugging Face checkpoint directory needs it)")
    try:
        tokenizer = Tokenizer.from_file(tok_path)
    except Exception as e:  # the Rust side raises plain Exception
        raise _fail(tok_path, f"not a tokenizers file ({e})") from e
    if not tokenizer.get_vocab(with_added_tokens=True):
        raise _fail(tok_path, "the vocabulary is empty")
    n_tok = _tokenizer_size(tokenizer)
    if n_tok > spec.vocab_size:
        raise _fail(
            tok_path,
            f"tokenizer ids reach {n_tok - 1}, beyond config.json vocab_size={spec.vocab_size}",
        )

    tok_config_path = os.path.join(folder, TOKENIZER_CONFIG)
    tok_config = _read_json(folder, TOKENIZER_CONFIG)
    chat_template = _read_chat_template(folder, tok_config)
    ids = {}
    for field in ("eos_token", "pad_token"):
        value = tok_config.get(field)
        if value is None:
            continue
        name = _token_name(value)
        if name is None or tokenizer.token_to_id(name) is None:
            raise _fail(tok_config_path, f"{field}={value!r} is not a token of {TOKENIZER}")
        ids[field] = tokenizer.token_to_id(name)

    stop_ids, gen = _read_stop_ids(folder, n_tok)
    pad_id = ids.get("pad_token", gen.get("pad_token_id"))
    if pad_id is None:
        pad_id = stop_ids[0]
    if not _is_int(pad_id) or not 0 <= pad_id < n_tok:
        raise _fail(
            os.path.join(folder, GENERATION_CONFIG),
            f"pad_token_id={pad_id!r} is not an id below the tokenizer's {n_tok} tokens",
        )
    _check_weights(folder, spec)
    return Checkpoint(folder, spec, tokenizer, chat_template, stop_ids, pad_id)


def load_weights(ckpt: Checkpoint, cell=None, role: str = "train"):
    """The checkpoint's weights as Gyre state -> (graphdef, state), placed on ``cell`` for
    ``role`` if given (float32, whatever the stored dtype)."""
    try:
        graphdef, state, _ = hf.load_hf(ckpt.path, ckpt.spec, cell=cell, role=role)
    except CheckpointError:
        raise
    except (KeyError, ValueError, OSError) as e:
        raise _fail(os.path.join(ckpt.path, WEIGHTS), str(e).strip("'\"")) from e
    return graphdef, state


def _write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
    """One safetensors file (F32, BF16 or F16), tensors in name order, header 8-byte aligned."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, x in tensors.items():
        dtype = _DTYPE_NAMES.get(x.dtype)
        if dtype is None:
            raise ValueError(f"tensor {name}: dtype {x.dtype} cannot be saved (F32/BF16/F16)")
        header[name] = {
            "dtype": dtype,
            "shape": list(x.shape),
            "data_offsets": [offset, offset + x.nbytes],
        }
        offset += x.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for x in tensors.values():
            f.write(np.ascontiguousarray(x).tobytes())


def _layer_order(name: str):
    """Sorts model.layers.10 after model.layers.9 (as transformers orders its shards)."""
    return [int(p) if p.isdigit() else p for p in name.split(".")]


def write_weights(folder: str, tensors: dict[str, np.ndarray], max_shard_bytes=None) -> list[str]:
    """Writes model.safetensors, or shards model-0000i-of-0000n.safetensors plus the index when
    the total exceeds ``max_shard_bytes`` (None: one file). Returns the file names written."""
    for stale in os.listdir(folder):  # an earlier save's files would confuse loaders
        if stale in (WEIGHTS, INDEX) or re.fullmatch(r"model-\d+-of-\d+\.safetensors", stale):
            os.remove(os.path.join(folder, stale))
    names = sorted(tensors, key=_layer_order)
    total = sum(tensors[n].nbytes for n in names)
    if max_shard_bytes is None or total <= max_shard_bytes:
        _write_safetensors(os.path.join(folder, WEIGHTS), {n: tensors[n] for n in names})
        return [WEIGHTS]
    shards, size = [[]], 0
    for name in names:  # greedy; a tensor larger than the limit gets a shard of its own
        nbytes = tensors[name].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    files, weight_map = [], {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_safetensors(os.path.join(folder, file), {n: tensors[n] for n in shard})
        weight_map.update(dict.fromkeys(shard, file))
        files.append(file)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_json(os.path.join(folder, INDEX), index)
    return files + [INDEX]


def _saved_config(spec: decoder.ModelSpec, source: Checkpoint, dtype: str) -> dict:
    """The source's config.json (token ids, context length, ...) with ``spec``'s architecture."""
    src = _read_json(source.path, CONFIG, required=False) or {}
    out = {**src, **hf.config_to_hf(spec)}
    if "max_position_embeddings" in src:
        out["max_position_embeddings"] = src["max_position_embeddings"]
    out["rope_theta"] = float(spec.rope_theta)  # the key older transformers read
    out.pop("rope_scaling", None)  # superseded by rope_parameters (default rope only)
    out["dtype"] = dtype
    if "torch_dtype" in src:
        out["torch_dtype"] = dtype
    return out


def save_checkpoint(
    path,
    graphdef,
    state,
    spec: decoder.ModelSpec,
    source: Checkpoint,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: str = "float32",
) -> str:
    """Writes ``state`` as a HF Qwen3 directory at ``path`` that transformers opens.

    Weights in ``dtype`` ("float32": exact; "bfloat16": half the bytes), sharded with an index
    above ``max_shard_bytes``; tokenizer files, chat template and generation config copied
    from ``source`` (or written from its fields when its folder is gone). The folder is
    built beside ``path`` and swapped in, so a crash never leaves a half-written checkpoint
    and stale shards never survive. ``path`` may be ``source.path``. Returns ``path``.
    """
    del graphdef  # the layout is fixed by the spec
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"save dtype {dtype!r}: expected 'float32' or 'bfloat16'")
    if source.tokenizer_vocab > spec.vocab_size:
        raise ValueError(
            f"tokenizer has {source.tokenizer_vocab} tokens, the model only {spec.vocab_size}"
        )
    folder = os.path.abspath(os.fspath(path))
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"{folder}: exists and is not a directory")
    tmp = f"{folder}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)

    pure = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), nnx.to_pure_dict(state))
    np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    tensors = {k: v.astype(np_dtype, copy=False) for k, v in hf.pure_to_hf(pure, spec).items()}
    del pure
    write_json(os.path.join(tmp, CONFIG), _saved_config(spec, source, dtype))
    write_weights(tmp, tensors, max_shard_bytes)
    del tensors

    for name in TOKENIZER_FILES:
        src = os.path.join(source.path, name)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(tmp, name))
    if not os.path.isfile(os.path.join(tmp, TOKENIZER)):
        source.tokenizer.save(os.path.join(tmp, TOKENIZER))
    if not os.path.isfile(os.path.join(tmp, TOKENIZER_CONFIG)):
        write_json(os.path.join(tmp, TOKENIZER_CONFIG), {"chat_template": source.chat_template})
    if not os.path.isfile(os.path.join(tmp, GENERATION_CONFIG)):
        gen = {"eos_token_id": list(source.stop_ids), "pad_token_id": source.pad_id}
        write_json(os.path.join(tmp, GENERATION_CONFIG), gen)

    if os.path.isdir(folder):
        old = f"{folder}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(folder, old)
        os.rename(tmp, folder)
        shutil.rmtree(old)
    else:
        os.rename(tmp, folder)
    return folder
