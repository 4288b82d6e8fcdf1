"""A local HF Qwen3 directory as a model: read, check, load and save, without torch.

The directory is a tiny Qwen3 written here (gyre/model/tiny_checkpoint.py: random weights, a
locally trained tokenizer, sharded); tests/test_hf.py checks the same paths against
transformers.
"""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gyre.chat.format import ChatFormat
from gyre.config import default_config
from gyre.model import ModelSpec, hf, hf_dir
from gyre.model import tiny_checkpoint as tc
from gyre.model.hf_dir import CheckpointError
from gyre.rl.builder import build_specs

TOK_VOCAB, MODEL_VOCAB = 512, 544  # the model's vocabulary is larger, as Qwen3's is


def base_spec() -> ModelSpec:
    # dense attention: the reference path (test_model compares block_sparse against it)
    return dataclasses.replace(build_specs(default_config()).model, attention="dense")


def tiny_spec(**overrides) -> ModelSpec:
    """The architecture of tests/oracles.py's transformers model."""
    arch = dict(vocab_size=MODEL_VOCAB, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=16, d_ff=128, rope_theta=5000.0, rms_eps=1e-5, tie_embeddings=False)  # fmt: skip
    return dataclasses.replace(base_spec(), **{**arch, **overrides})


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    """A tiny Qwen3 directory in shards of at most 100 kB, with an index."""
    folder = str(tmp_path_factory.mktemp("qwen3") / "tiny")
    return tc.write_tiny_qwen3(folder, tiny_spec(), vocab_size=TOK_VOCAB, max_shard_bytes=100_000)


def copy_of(source: str, tmp_path) -> str:
    folder = str(tmp_path / "ckpt")
    shutil.copytree(source, folder)
    return folder


def test_read_gives_the_architecture_and_the_tokenizer_side(source):
    ckpt = hf_dir.read(source, base_spec())
    # non-architecture fields (attention, dtype) from the base; ids past the tokenizer masked
    assert ckpt.spec == tiny_spec(sample_vocab=TOK_VOCAB)
    text = ckpt.text
    assert text.num_tokens == TOK_VOCAB
    im_end, eot = (text.tokenizer.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>"))
    assert text.stop_ids == (im_end, eot) and text.pad_id == eot
    assert text.chat_template == tc.QWEN3_CHAT_TEMPLATE
    assert text.template_source == os.path.join(source, "tokenizer_config.json") + (
        " field chat_template"
    )
    assert os.path.exists(os.path.join(source, "model.safetensors.index.json"))  # sharded


def test_load_gives_exactly_what_was_written(tmp_path):
    spec = tiny_spec(d_model=32, num_heads=4, head_dim=8, d_ff=64, tie_embeddings=True)
    folder = tc.write_tiny_qwen3(str(tmp_path / "tiny"), spec, seed=3, vocab_size=TOK_VOCAB,
                                 max_shard_bytes=20_000)  # fmt: skip
    got_spec, params, text = hf_dir.load(folder, base_spec())
    assert got_spec == dataclasses.replace(spec, sample_vocab=TOK_VOCAB)
    assert text.num_tokens == TOK_VOCAB
    assert text.tokenizer.to_str() == tc.train_tokenizer(TOK_VOCAB).to_str()
    want = tc.random_params(spec, seed=3)  # exactly what was written, at the decoder's scales
    jax.tree.map(np.testing.assert_array_equal, want, nnx.to_pure_dict(jax.device_get(params)))
    assert np.std(want["layers"]["down"]) == pytest.approx(64**-0.5, rel=0.1)
    assert not np.array_equal(want["embed"], tc.random_params(spec, seed=4)["embed"])


def test_save_round_trips_and_replaces_an_earlier_save(source, tmp_path):
    ckpt = hf_dir.read(source, base_spec())
    params = hf_dir.load_params(ckpt)
    out = tmp_path / "trained"
    hf_dir.save(out, params, ckpt.spec, ckpt, max_shard_bytes=60_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and all((out / s).exists() for s in shards)
    assert not (out / "model.safetensors").exists()

    again = hf_dir.read(out, base_spec())
    assert again.spec == ckpt.spec and again.text.stop_ids == ckpt.text.stop_ids
    assert again.text.tokenizer.to_str() == ckpt.text.tokenizer.to_str()
    assert again.text.chat_template == ckpt.text.chat_template
    params2 = hf_dir.load_params(again)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(params), jax.device_get(params2))

    # Saved over itself as one bfloat16 file: the old shards and index go, values round once.
    hf_dir.save(out, params, again.spec, again, dtype="bfloat16")
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]
    params3 = hf_dir.load_params(hf_dir.read(out, base_spec()))
    rounded = jax.tree.map(lambda x: np.asarray(x).astype(jnp.bfloat16).astype(np.float32), params)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(rounded), jax.device_get(params3))
    assert not list(tmp_path.glob("trained.*"))  # no temporary folders left beside it


def test_save_writes_the_tokenizer_side_when_its_source_is_gone(source, tmp_path):
    gone = copy_of(source, tmp_path)
    ckpt = hf_dir.read(gone, base_spec())
    shutil.rmtree(gone)
    out = hf_dir.save(tmp_path / "out", hf_dir.load_params(hf_dir.read(source, base_spec())),
                      ckpt.spec, ckpt)  # fmt: skip
    again = hf_dir.read(out, base_spec()).text
    assert (again.chat_template, again.stop_ids, again.pad_id) == (
        ckpt.text.chat_template, ckpt.text.stop_ids, ckpt.text.pad_id)  # fmt: skip
    assert again.tokenizer.to_str() == ckpt.text.tokenizer.to_str()


def test_a_directory_without_tokenizer_holds_weights_only(source, tmp_path):
    ckpt = hf_dir.read(source, base_spec())
    params = hf_dir.load_params(ckpt)
    out = hf_dir.save(tmp_path / "export", params, ckpt.spec)  # no source: weights only
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    spec, params2, text = hf_dir.load(out, base_spec())
    assert spec == dataclasses.replace(ckpt.spec, sample_vocab=0) and text is None
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(params), jax.device_get(params2))
    # its saves stay weights only; a chat format needs the tokenizer side
    hf_dir.save(out, params2, spec, hf_dir.read(out, base_spec()))
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    with pytest.raises(ValueError, match="no tokenizer.json"):
        ChatFormat.from_checkpoint(hf_dir.read(out, base_spec()))


def test_train_tokenizer_is_deterministic_and_byte_complete():
    tc._trained_json.cache_clear()  # train for real, twice
    first = tc.train_tokenizer(400).to_str()
    tc._trained_json.cache_clear()
    assert tc.train_tokenizer(400).to_str() == first
    tok = tc.train_tokenizer(400)
    assert tok.get_vocab_size() == 400
    assert [tok.token_to_id(c) for c, _ in tc.SPECIAL_TOKENS] == list(range(374, 400))
    text = bytes(range(256)).decode("latin-1") + "\x00😀"
    assert tok.decode(tok.encode(text).ids) == text
    with pytest.raises(ValueError, match="vocab_size=100"):
        tc.train_tokenizer(100)
    with pytest.raises(ValueError, match="exceeds the model's vocab_size"):
        tc.write_tiny_qwen3(
            "/nonexistent", dataclasses.replace(base_spec(), vocab_size=300), vocab_size=400
        )


def _edit_json(name, change):
    def edit(folder):
        path = os.path.join(folder, name)
        with open(path) as f:
            obj = json.load(f)
        change(obj)
        with open(path, "w") as f:
            json.dump(obj, f)

    return edit


def _remove(name):
    return lambda folder: os.remove(os.path.join(folder, name))


def _write(name, text):
    def write(folder):
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)

    return write


def _drop_shard(folder):
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        os.remove(os.path.join(folder, sorted(set(json.load(f)["weight_map"].values()))[-1]))


BAD = {
    "no config": (_remove("config.json"), r"config\.json: missing"),
    "no tokenizer_config": (_remove("tokenizer_config.json"), r"tokenizer_config\.json: missing"),
    "no generation_config": (_remove("generation_config.json"), r"generation_config\.json: missing"),
    "missing shard": (_drop_shard, r"index\.json: weight_map names 'model-0000\d-of-0000\d\.safetensors', which does not exist"),
    "no weights": (_remove("model.safetensors.index.json"), r"model\.safetensors: missing"),
    "tokenizer > model vocab": (
        _edit_json("config.json", lambda c: c.update(vocab_size=500)),
        r"tokenizer\.json: tokenizer ids reach 511, beyond config\.json vocab_size=500",
    ),
    "eos out of range": (
        _edit_json("generation_config.json", lambda c: c.update(eos_token_id=[5, 9999])),
        r"generation_config\.json: eos_token_id \[9999\] out of range",
    ),
    "eos not an id": (
        _edit_json("generation_config.json", lambda c: c.update(eos_token_id="<|im_end|>")),
        r"generation_config\.json: eos_token_id='<\|im_end\|>' is not an id",
    ),
    "malformed config": (_write("config.json", '{"vocab_size": 544,'), r"config\.json: not valid JSON"),
    "malformed tokenizer_config": (_write("tokenizer_config.json", "{'a': 1}"), r"tokenizer_config\.json: not valid JSON"),
    "malformed generation_config": (_write("generation_config.json", "[1, 2]"), r"generation_config\.json: expected a JSON object"),
    "malformed index": (_write("model.safetensors.index.json", "{"), r"index\.json: not a safetensors index \(not valid JSON"),
    "malformed tokenizer": (_write("tokenizer.json", '{"model": 3}'), r"tokenizer\.json: not a tokenizers file"),
    "string hidden_size": (
        _edit_json("config.json", lambda c: c.update(hidden_size="64")),
        r"config\.json: hidden_size='64' is not a positive integer",
    ),
    "string tie flag": (
        _edit_json("config.json", lambda c: c.update(tie_word_embeddings="false")),
        r"config\.json: tie_word_embeddings='false' is not true or false",
    ),
    "shape mismatch": (
        _edit_json("config.json", lambda c: c.update(intermediate_size=96)),
        r"model-\d+-of-\d+\.safetensors: tensor model\.layers\.0\.mlp\.\w+_proj\.weight has shape .* config\.json implies",
    ),
    "no chat template": (
        _edit_json("tokenizer_config.json", lambda c: c.pop("chat_template")),
        r"tokenizer_config\.json: no chat_template field",
    ),
    "named templates without default": (
        _edit_json("tokenizer_config.json", lambda c: c.update(chat_template=[{"name": "tool_use", "template": "x"}])),
        r"tokenizer_config\.json: chat_template list has no 'default' entry",
    ),
    "unknown eos token": (
        _edit_json("tokenizer_config.json", lambda c: c.update(eos_token="<|eot|>")),
        r"tokenizer_config\.json: eos_token='<\|eot\|>' is not a token",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_directory_is_one_line_naming_file_and_field(source, tmp_path, case):
    folder = copy_of(source, tmp_path)
    breakage, message = BAD[case]
    breakage(folder)
    with pytest.raises(CheckpointError, match=message) as err:
        hf_dir.read(folder, base_spec())
    assert "\n" not in str(err.value)


def test_broken_chat_template_names_where_it_was_read(source, tmp_path):
    """The template is text to the model package; the chat format compiles it."""
    folder = copy_of(source, tmp_path)
    _edit_json("tokenizer_config.json", lambda c: c.update(chat_template="{% if x %}"))(folder)
    ckpt = hf_dir.read(folder, base_spec())
    with pytest.raises(ValueError) as err:
        ChatFormat.from_checkpoint(ckpt)
    message = r"tokenizer_config\.json field chat_template: chat template: syntax error at line 1"
    assert err.match(message) and "\n" not in str(err.value)
    _write("chat_template.jinja", "{% for m in messages %}{{ m.content }}{% endfor %}")(folder)
    with pytest.raises(ValueError, match=r"chat_template\.jinja: chat template ends"):
        ChatFormat.from_checkpoint(hf_dir.read(folder, base_spec()))


def test_named_chat_templates_and_template_file(source, tmp_path):
    """HF's list-of-named-templates form gives "default"; a chat_template.jinja wins."""
    folder = copy_of(source, tmp_path)
    named = [{"name": "rag", "template": "R"}, {"name": "default", "template": "D{{ 1 }}"}]
    _edit_json("tokenizer_config.json", lambda c: c.update(chat_template=named))(folder)
    assert hf_dir.read(folder, base_spec()).text.chat_template == "D{{ 1 }}"
    _write("chat_template.jinja", "J")(folder)
    text = hf_dir.read(folder, base_spec()).text
    assert (text.chat_template, text.template_source) == ("J", f"{folder}/chat_template.jinja")
    with pytest.raises(CheckpointError, match="not a directory"):
        hf_dir.read(os.path.join(folder, "config.json"), base_spec())


def test_unsupported_config_is_a_clear_error():
    with pytest.raises(ValueError, match="attention_bias"):
        hf.config_from_hf(dict(model_type="qwen3", attention_bias=True), base_spec())
    with pytest.raises(ValueError, match="model_type"):
        hf.config_from_hf({"model_type": "llama"}, base_spec())
