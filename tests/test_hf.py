"""HF Qwen3 parity with transformers (the reference): logits of loaded checkpoints (causal and
tree), saves that transformers opens, tokenisation and the chat template's rendering.

The directories come from a random transformers Qwen3ForCausalLM, plus a tokenizer trained
here with ``tokenizers``; tests/test_hf_dir.py checks reading and saving without torch.
"""

import dataclasses
import unicodedata

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from oracles import qwen3_torch_model  # noqa: E402

from gyre.chat.format import ChatFormat  # noqa: E402
from gyre.config import default_config  # noqa: E402
from gyre.mesh import make_cells  # noqa: E402
from gyre.model import ModelSpec, apply, apply_logits, decoder, hf_dir  # noqa: E402
from gyre.model import tiny_checkpoint as tc  # noqa: E402
from gyre.rl.builder import build_specs  # noqa: E402

T = 16


def gyre_cfg() -> ModelSpec:
    # the reference path; test_model compares block_sparse against it
    return dataclasses.replace(build_specs(default_config()).model, attention="dense")


def torch_model(tie: bool, seed: int = 0):
    return qwen3_torch_model(128, tie, seed)


def random_tree(seed: int, t: int):
    """DFS-ordered branchy tree: (tokens, pos, leave), each int numpy [t]."""
    rng = np.random.default_rng(seed)
    pos, leave, stack = np.zeros(t, np.int64), np.full(t, t, np.int64), []
    for i in range(t):
        if stack and rng.random() < 0.35:
            for _ in range(rng.integers(1, len(stack) + 1)):
                leave[stack.pop()] = i
        pos[i] = len(stack)
        stack.append(i)
    return rng.integers(0, 128, t), pos, leave


def torch_logits(model, tokens, pos, visible=None):
    """Logits [B,T,V]; ``visible`` bool [B,T,T] becomes an additive 4-D mask."""
    kwargs = {"position_ids": torch.tensor(np.array(pos))}
    if visible is not None:
        additive = np.where(visible, 0.0, np.finfo(np.float32).min).astype(np.float32)
        kwargs["attention_mask"] = torch.as_tensor(additive[:, None])
    with torch.no_grad():
        return model(torch.tensor(np.array(tokens)), **kwargs).logits.numpy()


def gyre_logits(graphdef, state, tokens, pos, leave):
    hidden = apply(graphdef, state, jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(leave))
    return np.asarray(apply_logits(graphdef, state, hidden))


@pytest.mark.slow
@pytest.mark.parametrize("tie", [True, False])
def test_logits_match_transformers_causal_and_tree(tmp_path, tie):
    model = torch_model(tie)
    # the tied case goes through a sharded checkpoint with an index file
    model.save_pretrained(tmp_path, max_shard_size="50KB" if tie else "1GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == tie
    cfg, state, text = hf_dir.load(tmp_path, gyre_cfg())
    graphdef = decoder.abstract_model(cfg)[0]
    assert text is None  # no tokenizer.json: weights only
    assert (cfg.d_model, cfg.num_layers, cfg.head_dim, cfg.tie_embeddings) == (64, 2, 16, tie)
    assert cfg.rope_theta == 5000.0 and cfg.rms_eps == 1e-5

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 128, (2, T))
    pos = np.broadcast_to(np.arange(T), (2, T))
    want = torch_logits(model, tokens, pos)
    got = gyre_logits(graphdef, state, tokens, pos, np.full((2, T), T))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)

    rows = [random_tree(seed, T) for seed in (1, 2)]
    tokens, pos, leave = (np.stack([r[i] for r in rows]) for i in range(3))
    assert (pos.max(1) < T - 1).all()  # really branchy, not a chain
    q, k = np.arange(T)[:, None], np.arange(T)[None, :]
    visible = (k <= q) & (q < leave[:, None, :])
    want = torch_logits(model, tokens, pos, visible)
    got = gyre_logits(graphdef, state, tokens, pos, leave)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_save_hf_round_trips_through_transformers(tmp_path):
    model = torch_model(tie=False, seed=1)
    model.save_pretrained(tmp_path / "src")
    cell = make_cells(2)[0]
    cfg, state, _ = hf_dir.load(tmp_path / "src", gyre_cfg(), cell=cell, role="train")
    assert state["layers"]["q"].sharding.spec[1] == "data"  # placed per the train RULES
    hf_dir.save(tmp_path / "out", state, cfg)
    back = transformers.Qwen3ForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager"
    ).eval()
    tokens = np.random.default_rng(3).integers(0, 128, (1, T))
    pos = np.arange(T)[None]
    np.testing.assert_allclose(
        torch_logits(back, tokens, pos), torch_logits(model, tokens, pos), atol=1e-5, rtol=1e-5
    )
    _, state2, _ = hf_dir.load(tmp_path / "out", gyre_cfg())
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state), jax.device_get(state2))


def test_bfloat16_checkpoint_loads(tmp_path):
    model = torch_model(tie=True, seed=2).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    _, state, _ = hf_dir.load(tmp_path, gyre_cfg())
    want = model.model.layers[1].self_attn.o_proj.weight.detach().float().numpy()  # [D, H*Dh]
    got = np.asarray(state["layers"]["o"][1]).reshape(-1, 64).T
    np.testing.assert_array_equal(got, want)
    assert state["embed"].dtype == jnp.float32


# ---- a whole directory: weights, tokenizer and chat template --------------------------------

TOK_VOCAB, MODEL_VOCAB = 512, 544  # the model's vocabulary is larger, as Qwen3's is


def causal_logits(graphdef, state, tokens_BxT):
    b, t = tokens_BxT.shape
    pos = np.broadcast_to(np.arange(t), (b, t))
    return gyre_logits(graphdef, state, tokens_BxT, pos, np.full((b, t), t))


def torch_causal_logits(model, tokens_BxT):
    return torch_logits(
        model, tokens_BxT, np.broadcast_to(np.arange(tokens_BxT.shape[1]), tokens_BxT.shape)
    )


@pytest.fixture(scope="module")
def tokenizer():
    return tc.train_tokenizer(TOK_VOCAB)


@pytest.fixture(scope="module")
def source(tmp_path_factory, tokenizer):
    """(folder, torch model): transformers' sharded save plus our tokenizer files."""
    folder = tmp_path_factory.mktemp("qwen3")
    model = qwen3_torch_model(MODEL_VOCAB, tie=False)
    model.save_pretrained(folder, max_shard_size="100KB")
    tc.write_tokenizer_files(str(folder), tokenizer)
    return str(folder), model


@pytest.fixture(scope="module")
def hf_tokenizer(source):
    return transformers.AutoTokenizer.from_pretrained(source[0])


def chat_tokens(ckpt, batch: int = 2) -> np.ndarray:
    """[batch, T] ids: a rendered conversation's tokens, then ids the tokenizer never emits
    (the model's vocabulary is larger)."""
    text = ChatFormat.from_checkpoint(ckpt).render(*CONVERSATIONS[1])
    ids = ckpt.text.tokenizer.encode(text).ids[: T - 4]
    rng = np.random.default_rng(0)
    rows = [ids + list(rng.integers(TOK_VOCAB, MODEL_VOCAB, T - len(ids))) for _ in range(batch)]
    rows[1] = list(rng.integers(0, MODEL_VOCAB, T))
    return np.array(rows)


def test_read_and_load_params_match_transformers(source):
    folder, model = source
    ckpt = hf_dir.read(folder, gyre_cfg())
    spec = ckpt.spec
    assert (spec.vocab_size, spec.d_model, spec.num_layers, spec.d_ff) == (MODEL_VOCAB, 64, 2, 128)
    assert (spec.rope_theta, spec.rms_eps, spec.tie_embeddings) == (5000.0, 1e-5, False)
    assert spec.attention == "dense"  # non-architecture fields come from the base
    assert ckpt.text.num_tokens == TOK_VOCAB
    assert ckpt.text.chat_template == tc.QWEN3_CHAT_TEMPLATE

    state = hf_dir.load_params(ckpt)
    tokens = chat_tokens(ckpt)
    ours = causal_logits(decoder.abstract_model(spec)[0], state, tokens)
    # The ids past the tokenizer's are padding: masked (never sampled), the rest as transformers
    assert spec.sample_vocab == TOK_VOCAB < MODEL_VOCAB
    assert (ours[..., TOK_VOCAB:] == decoder.MASKED).all()
    np.testing.assert_allclose(
        ours[..., :TOK_VOCAB],
        torch_causal_logits(model, tokens)[..., :TOK_VOCAB],
        atol=1e-4,
        rtol=1e-4,
    )


def test_saved_directory_opens_in_transformers(source, tmp_path):
    folder, model = source
    ckpt = hf_dir.read(folder, gyre_cfg())
    out = tmp_path / "trained"
    hf_dir.save(out, hf_dir.load_params(ckpt), ckpt.spec, ckpt, max_shard_bytes=60_000)
    assert len(list(out.glob("model-*-of-*.safetensors"))) >= 3
    back = transformers.Qwen3ForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    tokens = chat_tokens(ckpt)
    np.testing.assert_allclose(
        torch_causal_logits(back, tokens), torch_causal_logits(model, tokens), atol=1e-5, rtol=1e-5
    )
    assert list(back.generation_config.eos_token_id) == list(ckpt.text.stop_ids)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok.eos_token == "<|im_end|>" and hf_tok.chat_template == ckpt.text.chat_template


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
    tok = hf_dir.read(source[0], gyre_cfg()).text.tokenizer
    ours = tok.encode(text).ids
    assert hf_tokenizer(text)["input_ids"] == ours
    assert tok.decode(ours, skip_special_tokens=False) == text
    for marker in ("<|im_start|>", "<think>", "</tool_call>"):  # added tokens: one id each
        if marker in text:
            assert tok.token_to_id(marker) in ours


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
    ckpt = hf_dir.read(source[0], gyre_cfg())
    chat = ChatFormat.from_checkpoint(ckpt, enable_thinking=thinking)
    messages, tools = CONVERSATIONS[case]
    kwargs = dict(tools=tools, add_generation_prompt=True, enable_thinking=thinking)
    want = hf_tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    got = chat.render(messages, tools, add_generation_prompt=True)
    assert got == want
    ids = hf_tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert list(ids) == ckpt.text.tokenizer.encode(got).ids
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


def test_tiny_qwen3_opens_in_transformers(tmp_path):
    spec = dataclasses.replace(
        gyre_cfg(), vocab_size=MODEL_VOCAB, d_model=32, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8, d_ff=64, tie_embeddings=True, rope_theta=1e4,
    )  # fmt: skip
    folder = tc.write_tiny_qwen3(str(tmp_path / "tiny"), spec, seed=3, vocab_size=TOK_VOCAB,
                                 max_shard_bytes=20_000)  # fmt: skip
    ckpt = hf_dir.read(folder, gyre_cfg())
    model = transformers.Qwen3ForCausalLM.from_pretrained(folder, attn_implementation="eager")
    tokens = chat_tokens(ckpt)
    np.testing.assert_allclose(
        causal_logits(decoder.abstract_model(spec)[0], hf_dir.load_params(ckpt), tokens),
        torch_causal_logits(model.eval(), tokens),
        atol=1e-4,
        rtol=1e-4,
    )
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    tok = ckpt.text.tokenizer
    text = ChatFormat.from_checkpoint(ckpt).render(*CONVERSATIONS[1], add_generation_prompt=True)
    assert hf_tok(text)["input_ids"] == tok.encode(text).ids
    assert hf_tok.pad_token == "<|endoftext|>" and hf_tok.eos_token_id == ckpt.text.stop_ids[0]
    decoded = hf_tok.decode(tok.encode(text).ids, skip_special_tokens=True)
    assert "<|im_start|>" not in decoded and "<tool_call>" in decoded  # Qwen3's special flags
