"""A local HF Qwen3 directory as a model (issue 18, part 1): read, check, load, save.

The directory comes from a random-init transformers Qwen3ForCausalLM plus a tokenizer trained
here with `tokenizers`; transformers is the reference for logits, tokenisation and the chat
template's rendering.
"""

import dataclasses
import json
import os
import shutil
import unicodedata

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from oracles import qwen3_torch_model  # noqa: E402

from gyre.config import default_config  # noqa: E402
from gyre.model import ModelSpec, apply, apply_logits  # noqa: E402
from gyre.model import tiny_checkpoint as tc  # noqa: E402
from gyre.model.hf import CheckpointError  # noqa: E402
from gyre.model.hf_dir import (  # noqa: E402
    load_weights,
    read_checkpoint,
    render_chat,
    save_checkpoint,
)
from gyre.rl.builder import build_specs  # noqa: E402

TOK_VOCAB, MODEL_VOCAB = 512, 544  # the model's vocabulary is larger, as Qwen3's is
T = 24


def base_spec() -> ModelSpec:
    # dense attention: the reference path (test_model compares block_sparse against it)
    return dataclasses.replace(build_specs(default_config()).model, attention="dense")


def torch_model(seed: int = 0):
    return qwen3_torch_model(MODEL_VOCAB, tie=False, seed=seed)


def torch_logits(model, tokens_BxT):
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens_BxT))).logits.numpy()


def gyre_logits(graphdef, state, tokens_BxT):
    b, t = tokens_BxT.shape
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    hidden = apply(graphdef, state, jnp.asarray(tokens_BxT), pos, jnp.full((b, t), t))
    return np.asarray(apply_logits(graphdef, state, hidden))


@pytest.fixture(scope="module")
def tokenizer():
    return tc.train_tokenizer(TOK_VOCAB)


@pytest.fixture(scope="module")
def source(tmp_path_factory, tokenizer):
    """(folder, torch model): transformers' sharded save plus our tokenizer files."""
    folder = tmp_path_factory.mktemp("qwen3")
    model = torch_model()
    model.save_pretrained(folder, max_shard_size="100KB")
    tc.write_tokenizer_files(str(folder), tokenizer)
    return str(folder), model


@pytest.fixture(scope="module")
def hf_tokenizer(source):
    return transformers.AutoTokenizer.from_pretrained(source[0])


def chat_tokens(ckpt, batch: int = 2) -> np.ndarray:
    """[batch, T] ids: a rendered conversation's tokens, then ids the tokenizer never emits
    (the model's vocabulary is larger)."""
    text = render_chat(ckpt.chat_template, CONVERSATIONS[1][0], CONVERSATIONS[1][1])
    ids = ckpt.tokenizer.encode(text).ids[: T - 4]
    rng = np.random.default_rng(0)
    rows = [ids + list(rng.integers(TOK_VOCAB, MODEL_VOCAB, T - len(ids))) for _ in range(batch)]
    rows[1] = list(rng.integers(0, MODEL_VOCAB, T))
    return np.array(rows)


def test_read_checkpoint_and_load_weights_match_transformers(source):
    folder, model = source
    ckpt = read_checkpoint(folder, base_spec())
    spec = ckpt.spec
    assert (spec.vocab_size, spec.d_model, spec.num_layers, spec.d_ff) == (MODEL_VOCAB, 64, 2, 128)
    assert (spec.rope_theta, spec.rms_eps, spec.tie_embeddings) == (5000.0, 1e-5, False)
    assert spec.attention == "dense"  # non-architecture fields come from the base
    assert ckpt.tokenizer_vocab == TOK_VOCAB
    im_end, eot = (ckpt.tokenizer.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>"))
    assert ckpt.stop_ids == (im_end, eot) and ckpt.pad_id == eot
    assert ckpt.chat_template == tc.QWEN3_CHAT_TEMPLATE
    assert os.path.exists(os.path.join(folder, "model.safetensors.index.json"))  # sharded

    graphdef, state = load_weights(ckpt)
    tokens = chat_tokens(ckpt)
    np.testing.assert_allclose(
        gyre_logits(graphdef, state, tokens), torch_logits(model, tokens), atol=1e-4, rtol=1e-4
    )


def test_save_checkpoint_sharded_opens_in_transformers(source, tmp_path):
    folder, model = source
    ckpt = read_checkpoint(folder, base_spec())
    graphdef, state = load_weights(ckpt)
    out = tmp_path / "trained"
    save_checkpoint(out, graphdef, state, ckpt.spec, ckpt, max_shard_bytes=60_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and all((out / s).exists() for s in shards)
    assert not (out / "model.safetensors").exists()

    back = transformers.Qwen3ForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    tokens = chat_tokens(ckpt)
    np.testing.assert_allclose(
        torch_logits(back, tokens), torch_logits(model, tokens), atol=1e-5, rtol=1e-5
    )
    assert list(back.generation_config.eos_token_id) == list(ckpt.stop_ids)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok.eos_token == "<|im_end|>" and hf_tok.chat_template == ckpt.chat_template

    again = read_checkpoint(out, base_spec())
    assert again.spec == ckpt.spec and again.stop_ids == ckpt.stop_ids
    assert again.tokenizer.to_str() == ckpt.tokenizer.to_str()
    _, state2 = load_weights(again)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state), jax.device_get(state2))

    # Saved over itself as one bfloat16 file: the old shards and index go, values round once.
    save_checkpoint(out, graphdef, state, again.spec, again, dtype="bfloat16")
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]
    _, state3 = load_weights(read_checkpoint(out, base_spec()))
    rounded = jax.tree.map(lambda x: np.asarray(x).astype(jnp.bfloat16).astype(np.float32), state)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(rounded), jax.device_get(state3))
    assert not list(tmp_path.glob("trained.*"))  # no temporary folders left beside it


TEXTS = [
    "Hello, world! It's 2024; the answer is 42.",
    "def f(x):\n    return x ** 2  # square\n\n\nprint(f(3))",
    '{"name": "run_tests", "arguments": {"path": "tests/"}}',
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nok<|im_end|>",
    "<tool_call>\n{}\n</tool_call><tool_response>x</tool_response>",
    "naïve café — 東京 😀\t\r\n  \u00a0trailing   ",
    "<|im_start<|im_end|>>",
    "",
]


@pytest.mark.parametrize("text", TEXTS)
def test_transformers_tokenizer_encodes_like_ours(source, hf_tokenizer, text):
    ckpt = read_checkpoint(source[0], base_spec())
    ours = ckpt.tokenizer.encode(text).ids
    assert hf_tokenizer(text)["input_ids"] == ours
    assert ckpt.tokenizer.decode(ours, skip_special_tokens=False) == text
    for marker in ("<|im_start|>", "<think>", "</tool_call>"):  # added tokens: one id each
        if marker in text:
            assert ckpt.tokenizer.token_to_id(marker) in ours


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(max_size=60) | st.binary(max_size=40).map(lambda b: b.decode("utf-8", "replace"))
)
def test_any_text_encodes_like_transformers_and_round_trips(tokenizer, hf_tokenizer, text):
    ours = tokenizer.encode(text).ids
    assert hf_tokenizer(text)["input_ids"] == ours
    assert all(0 <= i < TOK_VOCAB for i in ours)
    # byte-level: nothing is unknown; the normaliser is Qwen3's NFC
    assert tokenizer.decode(ours, skip_special_tokens=False) == unicodedata.normalize("NFC", text)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Write text to a file <in the sandbox> & overwrite it.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                "required": ["path", "content"],
            },
        },
    },
    {"type": "function", "function": {"name": "run_tests", "parameters": {"type": "object"}}},
]
CONVERSATIONS = [
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}], None),
    (
        [
            {"role": "system", "content": "Fix the bug."},
            {"role": "user", "content": "The tests fail. Ünïcode: 東京"},
            {
                "role": "assistant",
                "content": "<think>\nI should look.\n</think>\n\nWriting the fix.",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {
                            "name": "write_file",
                            "arguments": {"path": "a.py", "content": "x = 1\n"},
                        },
                    },
                    {"type": "function", "function": {"name": "run_tests", "arguments": "{}"}},
                ],
            },
            {"role": "tool", "content": "wrote 6 bytes"},
            {"role": "tool", "content": "1 passed"},
            {"role": "assistant", "content": "<think>done</think>All tests pass."},
        ],
        TOOLS,
    ),
    (
        [
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "<think>\nold reasoning\n</think>\n\nreply one"},
            {"role": "user", "content": "second"},
        ],
        None,
    ),
]


@pytest.mark.parametrize("case", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("thinking", [True, False])
def test_chat_template_renders_like_transformers(source, hf_tokenizer, case, thinking):
    ckpt = read_checkpoint(source[0], base_spec())
    messages, tools = CONVERSATIONS[case]
    kwargs = dict(tools=tools, add_generation_prompt=True, enable_thinking=thinking)
    want = hf_tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    got = render_chat(ckpt.chat_template, messages, **kwargs)
    assert got == want
    ids = hf_tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert list(ids) == ckpt.tokenizer.encode(got).ids
    assert got.endswith("<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n"))
    if case == 1:  # Qwen3's own format: tools in the system turn, calls as JSON, results as user
        assert got.startswith("<|im_start|>system\nFix the bug.\n\n# Tools\n")
        assert '"description": "Write text to a file <in the sandbox> & overwrite it."' in got
        assert (
            'Writing the fix.\n<tool_call>\n{"name": "write_file", "arguments": '
            '{"path": "a.py", "content": "x = 1\\n"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "run_tests", "arguments": {}}\n</tool_call><|im_end|>\n'
        ) in got
        assert (
            "<|im_start|>user\n<tool_response>\nwrote 6 bytes\n</tool_response>\n"
            "<tool_response>\n1 passed\n</tool_response><|im_end|>\n"
        ) in got
        # reasoning after the last user query is kept, re-wrapped in Qwen3's layout
        assert "<|im_start|>assistant\n<think>\nI should look.\n</think>\n\nWriting" in got
        assert "<think>\ndone\n</think>\n\nAll tests pass.<|im_end|>" in got
    if case == 2:  # reasoning of turns before the last user query is dropped
        assert "old reasoning" not in got and "<|im_start|>assistant\nreply one<|im_end|>" in got


def test_write_tiny_qwen3_loads_in_gyre_and_transformers(tmp_path):
    spec = dataclasses.replace(
        base_spec(), vocab_size=MODEL_VOCAB, d_model=32, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8, d_ff=64, tie_embeddings=True, rope_theta=1e4,
    )  # fmt: skip
    folder = tc.write_tiny_qwen3(str(tmp_path / "tiny"), spec, seed=3, vocab_size=TOK_VOCAB,
                                 max_shard_bytes=20_000)  # fmt: skip
    ckpt = read_checkpoint(folder, base_spec())
    assert ckpt.spec == spec and ckpt.tokenizer_vocab == TOK_VOCAB
    assert ckpt.tokenizer.to_str() == tc.train_tokenizer(TOK_VOCAB).to_str()
    graphdef, state = load_weights(ckpt)
    want = tc.random_params(spec, seed=3)  # exactly what was written, at the decoder's scales
    jax.tree.map(np.testing.assert_array_equal, want, nnx.to_pure_dict(jax.device_get(state)))
    assert np.std(want["layers"]["down"]) == pytest.approx(64**-0.5, rel=0.1)
    assert not np.array_equal(want["embed"], tc.random_params(spec, seed=4)["embed"])

    model = transformers.Qwen3ForCausalLM.from_pretrained(folder, attn_implementation="eager")
    tokens = chat_tokens(ckpt)
    np.testing.assert_allclose(
        gyre_logits(graphdef, state, tokens),
        torch_logits(model.eval(), tokens),
        atol=1e-4,
        rtol=1e-4,
    )
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    text = render_chat(ckpt.chat_template, *CONVERSATIONS[1], add_generation_prompt=True)
    assert hf_tok(text)["input_ids"] == ckpt.tokenizer.encode(text).ids
    assert hf_tok.pad_token == "<|endoftext|>" and hf_tok.eos_token_id == ckpt.stop_ids[0]
    decoded = hf_tok.decode(ckpt.tokenizer.encode(text).ids, skip_special_tokens=True)
    assert "<|im_start|>" not in decoded and "<tool_call>" in decoded  # Qwen3's special flags


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
    "no tokenizer": (_remove("tokenizer.json"), r"tokenizer\.json: missing"),
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
    "malformed index": (_write("model.safetensors.index.json", "{"), r"index\.json: not valid JSON"),
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
    "broken chat template": (
        _edit_json("tokenizer_config.json", lambda c: c.update(chat_template="{% if x %}")),
        r"tokenizer_config\.json field chat_template: chat template: syntax error at line 1",
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
    folder = str(tmp_path / "ckpt")
    shutil.copytree(source[0], folder)
    breakage, message = BAD[case]
    breakage(folder)
    with pytest.raises(CheckpointError, match=message) as err:
        read_checkpoint(folder, base_spec())
    assert "\n" not in str(err.value)


def test_named_chat_templates_and_template_file(source, tmp_path):
    """HF's list-of-named-templates form gives "default"; a chat_template.jinja wins."""
    folder = str(tmp_path / "ckpt")
    shutil.copytree(source[0], folder)
    named = [{"name": "rag", "template": "R"}, {"name": "default", "template": "D{{ 1 }}"}]
    _edit_json("tokenizer_config.json", lambda c: c.update(chat_template=named))(folder)
    assert read_checkpoint(folder, base_spec()).chat_template == "D{{ 1 }}"
    _write("chat_template.jinja", "J")(folder)
    assert read_checkpoint(folder, base_spec()).chat_template == "J"
    with pytest.raises(CheckpointError, match="not a directory"):
        read_checkpoint(os.path.join(folder, "config.json"), base_spec())
