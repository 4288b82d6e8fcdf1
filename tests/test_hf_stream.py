"""Host memory of a checkpoint load (streamed, one parameter at a time) and the export dtype
(the source's by default)."""

import dataclasses
import json
import tracemalloc

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from gyre.config import default_config
from gyre.model import hf_dir, safetensors_io
from gyre.model import tiny_checkpoint as tc
from gyre.rl.builder import build_specs


def _spec():
    base = dataclasses.replace(build_specs(default_config()).model, attention="dense")
    return dataclasses.replace(base, vocab_size=2048, d_model=128, num_layers=4, num_heads=4,
                               num_kv_heads=2, head_dim=32, d_ff=256, tie_embeddings=False)  # fmt: skip


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    """A bfloat16 Qwen3 directory (random weights, a local tokenizer of 512 ids), sharded."""
    root = tmp_path_factory.mktemp("stream")
    src = tc.write_tiny_qwen3(str(root / "f32"), _spec(), vocab_size=512, max_shard_bytes=400_000)
    ckpt = hf_dir.read(src, _spec())
    return hf_dir.save(root / "bf16", hf_dir.load_params(ckpt), ckpt.spec, ckpt, dtype="bfloat16",
                       max_shard_bytes=400_000)  # fmt: skip


def _f32_bytes(params) -> int:
    return sum(x.size * 4 for x in jax.tree.leaves(params))


def test_load_streams_one_parameter_at_a_time(bf16_dir):
    ckpt = hf_dir.read(bf16_dir, _spec())
    tracemalloc.start()
    try:
        params = hf_dir.load_params(ckpt)
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    total = _f32_bytes(params)
    largest = max(x.size * 4 for x in jax.tree.leaves(params))
    # The host's heap at its peak beyond what the load keeps (on CPU the placed parameters
    # may be the very numpy buffers): one or two of a parameter's float32 copies, never the tree
    # (the old path held the file's tensors, a float32 tree and the placed copy at once).
    assert kept <= total * 1.05
    assert peak - kept < 2 * largest + total / 8, (peak, kept, largest, total)  # lm_head.T
    assert peak < 1.5 * total
    tensors = safetensors_io.read_folder(bf16_dir)
    embed = np.asarray(tensors["model.embed_tokens.weight"], np.float32)
    np.testing.assert_array_equal(np.asarray(nnx.to_pure_dict(params)["embed"]), embed)


def test_export_writes_the_source_dtype_by_default(bf16_dir, tmp_path):
    ckpt = hf_dir.read(bf16_dir, _spec())
    assert safetensors_io.stored_dtype(bf16_dir) == "bfloat16"
    params = hf_dir.load_params(ckpt)
    out = hf_dir.save(tmp_path / "again", params, ckpt.spec, ckpt)
    assert safetensors_io.stored_dtype(out) == "bfloat16"
    assert json.loads((tmp_path / "again" / "config.json").read_text())["dtype"] == "bfloat16"
    tensors, _ = safetensors_io.map_folder(out)
    assert all(t.dtype == ml_dtypes.bfloat16 for t in tensors.values())
    # exact: the weights were bfloat16 values already
    again = hf_dir.load_params(hf_dir.read(out, _spec()))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(params), jax.device_get(again))
    f32 = hf_dir.save(tmp_path / "f32", params, ckpt.spec, ckpt, dtype="float32")
    assert safetensors_io.stored_dtype(f32) == "float32"
    assert safetensors_io.stored_dtype(hf_dir.save(tmp_path / "bare", params, ckpt.spec)) == (
        "float32"
    )  # no source: float32


def test_a_mapped_tensor_past_its_file_is_one_line(tmp_path):
    path = str(tmp_path / "model.safetensors")
    safetensors_io.write_file(path, {"a": np.ones((4, 4), np.float32)})
    assert safetensors_io.map_file(path)["a"].shape == (4, 4)
    raw = bytearray(open(path, "rb").read())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header["a"]["shape"] = [4, 5]
    text = json.dumps(header).encode()
    text += b" " * (n - len(text))
    open(path, "wb").write(raw[:8] + text + raw[8 + n :])
    with pytest.raises(safetensors_io.CheckpointError, match="model.safetensors"):
        safetensors_io.map_file(path)
