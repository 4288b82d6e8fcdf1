"""Safetensors files and checkpoint folders: read, check headers, write. Never networked.

A file is an 8-byte little-endian header length, a JSON header (tensor name -> dtype, shape,
data offsets; plus ``__metadata__``) and the raw data. A folder holds model.safetensors, or
shards named by model.safetensors.index.json's weight_map. Every malformed file is a
one-line :class:`CheckpointError` naming it.
"""

from __future__ import annotations

import json
import os
import re

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
_MAX_HEADER = 100_000_000  # bytes; safetensors itself refuses larger headers
_DTYPES = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "F16": np.float16}
_DTYPE_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


class CheckpointError(ValueError):
    """An unreadable checkpoint file; the message names the file and what is wrong."""


def fail(path: str, what) -> CheckpointError:
    """A one-line error naming the file and what is wrong in it."""
    return CheckpointError(f"{path}: {' '.join(str(what).split())}")


def read_json(path: str) -> dict:
    """A JSON object file; missing, malformed or not an object is a CheckpointError naming it."""
    if not os.path.isfile(path):
        raise fail(path, "missing (a Hugging Face checkpoint directory needs it)")
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except UnicodeDecodeError as e:
        raise fail(path, f"not UTF-8 ({e.reason} at byte {e.start})") from e
    except json.JSONDecodeError as e:
        raise fail(path, f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from e
    if not isinstance(obj, dict):
        raise fail(path, f"expected a JSON object, got {type(obj).__name__}")
    return obj


def write_json(path: str, obj) -> None:
    """JSON as transformers writes it (indented, UTF-8, trailing newline)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


# ---- one file ------------------------------------------------------------------------------


def _header(path: str) -> tuple[dict, int]:
    """(header without __metadata__, header length) of one file, entries checked for form."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        # Bound the length before reading it: a garbage length would allocate up to 2^64 bytes.
        if size < 8 or n > min(size - 8, _MAX_HEADER):
            raise fail(
                path,
                f"header length {n} does not fit the file's {size} bytes "
                "(truncated, or not a safetensors file)",
            )
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
        header = {k: v for k, v in header.items() if k != "__metadata__"}
        for name, entry in header.items():
            shape, offsets = entry["shape"], entry["data_offsets"]
            if not isinstance(entry["dtype"], str) or len(offsets) != 2:
                raise ValueError(f"entry {name!r} is malformed")
            if not all(isinstance(d, int) and d >= 0 for d in [*shape, *offsets]):
                raise ValueError(f"entry {name!r} has a negative or non-integer size")
            if offsets[1] > size - 8 - n:  # a file cut short: refused when read, not loaded
                raise ValueError(f"tensor {name!r} ends at byte {offsets[1]} of data, past the "
                                 f"file's {size - 8 - n} (truncated)")  # fmt: skip
    except UnicodeDecodeError as e:
        raise fail(path, f"header is not UTF-8 ({e.reason} at byte {e.start})") from e
    except json.JSONDecodeError as e:
        raise fail(path, f"header is not JSON ({e})") from e
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise fail(path, f"not a valid safetensors file ({e!r})") from e
    return header, n


def read_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from one file's header, without reading the data."""
    return {name: tuple(entry["shape"]) for name, entry in _header(path)[0].items()}


def read_file(path: str) -> dict[str, np.ndarray]:
    """All tensors of one file as numpy; bfloat16 (absent from numpy) read via ml_dtypes."""
    header, n = _header(path)
    try:
        out = {}
        # safe_open checks every entry (BF16 too): dtype, shape and offsets within the file.
        with safe_open(path, framework="np") as f:
            for name in f.keys():
                if header[name]["dtype"] != "BF16":
                    out[name] = f.get_tensor(name)
        bf16 = [name for name, entry in header.items() if entry["dtype"] == "BF16"]
        if bf16:
            data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
            for name in bf16:
                start, end = header[name]["data_offsets"]
                flat = np.asarray(data[start:end]).view(ml_dtypes.bfloat16)
                out[name] = flat.reshape(header[name]["shape"])
    except (SafetensorError, ValueError, KeyError, TypeError) as e:
        raise fail(path, f"not a valid safetensors file ({e})") from e
    return out


def write_file(path: str, tensors: dict[str, np.ndarray]) -> None:
    """One file (F32, BF16 or F16), tensors in the dict's order, header 8-byte aligned."""
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


# ---- a folder ------------------------------------------------------------------------------


def weight_files(folder: str) -> list[str]:
    """The folder's safetensors files: the index's weight_map values (each must exist), else
    model.safetensors."""
    index_path = os.path.join(folder, INDEX)
    if not os.path.isfile(index_path):
        single = os.path.join(folder, WEIGHTS)
        if not os.path.isfile(single):
            raise fail(single, f"missing (and no {INDEX} naming shards)")
        return [single]
    try:
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise fail(index_path, "weight_map is missing, empty or not an object")
    except CheckpointError as e:
        what = str(e).removeprefix(f"{index_path}: ")
        raise fail(index_path, f"not a safetensors index ({what})") from e
    files = sorted(set(weight_map.values()), key=str)
    for name in files:
        if not isinstance(name, str) or os.path.basename(name) != name:
            raise fail(index_path, f"weight_map names {name!r}, not a file in the folder")
        if not os.path.isfile(os.path.join(folder, name)):
            raise fail(index_path, f"weight_map names {name!r}, which does not exist")
    return [os.path.join(folder, name) for name in files]


def map_file(path: str) -> dict[str, np.ndarray]:
    """All tensors of one file as read-only views of a memory map: nothing is read until a
    tensor's values are used, and a tensor converted and dropped leaves no copy behind (the
    page cache holds the file, not this process's heap). Entries are checked as
    :func:`read_file` checks them: dtype, and offsets that match the shape inside the file."""
    header, n = _header(path)
    if not header:
        return {}
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    out = {}
    for name, entry in header.items():
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise fail(path, f"tensor {name} has dtype {entry['dtype']}, not one of "
                             f"{tuple(_DTYPES)}")  # fmt: skip
        start, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        want = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if end - start != want or end > data.size:
            raise fail(path, f"tensor {name} spans bytes [{start}, {end}) of {data.size}; its "
                             f"shape {list(shape)} needs {want}")  # fmt: skip
        out[name] = data[start:end].view(dtype).reshape(shape)
    return out


def map_folder(folder: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Every tensor of a folder as :func:`map_file` views, and tensor name -> its file."""
    tensors, files = {}, {}
    for path in weight_files(folder):
        mapped = map_file(path)
        tensors.update(mapped)
        files.update(dict.fromkeys(mapped, path))
    return tensors, files


def stored_dtype(folder: str) -> str:
    """The dtype a folder's weights are stored in ('bfloat16', 'float32', 'float16'): that
    of the embedding, else of the most bytes."""
    kinds: dict[str, int] = {}
    for path in weight_files(folder):
        for name, entry in _header(path)[0].items():
            kind = entry["dtype"]
            if name == "model.embed_tokens.weight":
                return str(np.dtype(_DTYPES.get(kind, np.float32)))
            start, end = entry["data_offsets"]
            kinds[kind] = kinds.get(kind, 0) + end - start
    kind = max(kinds, key=kinds.get) if kinds else "F32"
    return str(np.dtype(_DTYPES.get(kind, np.float32)))


def read_folder(folder: str) -> dict[str, np.ndarray]:
    """Every tensor of a folder (one file, or shards with an index)."""
    tensors = {}
    for path in weight_files(folder):
        tensors.update(read_file(path))
    return tensors


def _layer_order(name: str):
    """Sorts model.layers.10 after model.layers.9 (as transformers orders its shards)."""
    return [int(p) if p.isdigit() else p for p in name.split(".")]


def write_folder(folder: str, tensors: dict[str, np.ndarray], max_shard_bytes=None) -> list[str]:
    """Writes model.safetensors, or shards model-0000i-of-0000n.safetensors plus the index when
    the total exceeds ``max_shard_bytes`` (None: one file). Returns the file names written."""
    for stale in os.listdir(folder):  # an earlier save's files would confuse loaders
        if stale in (WEIGHTS, INDEX) or re.fullmatch(r"model-\d+-of-\d+\.safetensors", stale):
            os.remove(os.path.join(folder, stale))
    names = sorted(tensors, key=_layer_order)
    total = sum(tensors[n].nbytes for n in names)
    if max_shard_bytes is None or total <= max_shard_bytes:
        write_file(os.path.join(folder, WEIGHTS), {n: tensors[n] for n in names})
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
        write_file(os.path.join(folder, file), {n: tensors[n] for n in shard})
        weight_map.update(dict.fromkeys(shard, file))
        files.append(file)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_json(os.path.join(folder, INDEX), index)
    return files + [INDEX]
