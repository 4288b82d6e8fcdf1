"""Chat turns appended as tokens equal Qwen3's template rendered in one piece where it allows;
each documented exception is shown with exactly the difference it causes."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.chat.format import ChatFormat, assistant_message
from gyre.chat.toolcalls import format_tool_call
from gyre.model.tiny_checkpoint import QWEN3_CHAT_TEMPLATE, train_tokenizer

TOOLS = [
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                       "b": {"type": "integer"}}}}},
    {"type": "function", "function": {
        "name": "write_file", "description": "Write a file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"},
                                                       "content": {"type": "string"}}}}},
]  # fmt: skip
SYSTEM, TASK = "You are a careful agent.", "Add 2 and 3, then save the result to out.txt."
GEN = "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer()


def make_chat(tok, **kw) -> ChatFormat:
    stops = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    return ChatFormat(tok, QWEN3_CHAT_TEMPLATE, stops, **kw)


class Dialogue:
    """Builds the appended token stream and the message list of the same conversation."""

    def __init__(self, chat: ChatFormat, tools=TOOLS):
        self.chat, self.tools = chat, tools
        self.messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
        self.stream = chat.prompt(SYSTEM, TASK, tools)
        self.pieces = [self.stream]

    def _add(self, tokens):
        self.pieces.append(np.asarray(tokens, np.int32))
        self.stream = np.concatenate(self.pieces)

    def model(self, text, tokens=None, stop=None):
        """A completion: canonical tokens of ``text`` unless given, then the stop token."""
        body = self.chat.encode(text) if tokens is None else tokens
        self._add(np.append(body, self.chat.turn_end_id if stop is None else stop))
        self.messages.append(assistant_message(text))

    def tool(self, *texts):
        self._add(self.chat.tool_responses(texts))
        self.messages += [{"role": "tool", "content": t} for t in texts]

    def user(self, text):
        self._add(self.chat.user_turn(text))
        self.messages.append({"role": "user", "content": text})

    def one_piece_text(self, gen=True):
        return self.chat.render(self.messages, self.tools, add_generation_prompt=gen)

    def one_piece(self, gen=True):
        return self.chat.encode(self.one_piece_text(gen))


def think(thought, rest):
    return f"<think>\n{thought}\n</think>\n\n{rest}"


ADD = format_tool_call("add", {"a": 2, "b": 3})
WRITE = format_tool_call("write_file", {"path": "out.txt", "content": "5 ✓\n"})
T1 = think("I need the sum first.", "Let me add.\n" + ADD)
T2 = think("Now save it; also double-check.", WRITE + "\n" + ADD)  # two calls, no prose
T3 = think("Both done.", "The sum is 5; saved to out.txt.")


def test_a_tool_loop_appended_as_tokens_equals_the_one_piece_rendering(tok):
    chat = make_chat(tok)
    d = Dialogue(chat)
    assert np.array_equal(d.stream, d.one_piece())
    d.model(T1)
    d.tool("5")
    assert np.array_equal(d.stream, d.one_piece())  # the second prompt
    d.model(T2)
    d.tool("wrote 4 bytes", "5")
    assert np.array_equal(d.stream, d.one_piece())  # the third prompt
    d.model(T3)
    # The whole conversation: the template ends the last turn with "<|im_end|>\n".
    assert np.array_equal(np.append(d.stream, chat.encode("\n")), d.one_piece(gen=False))
    # Each completion's tokens sit in the stream unchanged (nothing re-tokenised).
    assert d.one_piece_text(gen=False).count("<think>") == 3


def test_rendering_matches_transformers_apply_chat_template(tok):
    utils = pytest.importorskip("transformers.utils.chat_template_utils")
    for enable in (True, False):
        chat = make_chat(tok, enable_thinking=enable)
        d = Dialogue(chat)
        d.model(T1)
        d.tool("5")
        d.model(T3)
        d.user("Now multiply them.")
        for gen in (True, False):
            (ref,), _ = utils.render_jinja_template(
                [d.messages], tools=TOOLS, chat_template=QWEN3_CHAT_TEMPLATE,
                add_generation_prompt=gen, enable_thinking=enable,
            )  # fmt: skip
            assert chat.render(d.messages, TOOLS, add_generation_prompt=gen) == ref


# Canonical turns with random thinking, prose, calls (unicode JSON) and tool responses.
def plain(s: str) -> bool:
    return s == s.strip() and not any(
        t in s for t in ("<think>", "</think>", "<tool_", "</tool_", "<|")
    )


prose = st.text(max_size=30).filter(plain)
thoughts = st.none() | st.text(min_size=1, max_size=30).filter(lambda s: plain(s) and s)
json_leaf = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False,
            allow_infinity=False) | st.text(max_size=12)  # fmt: skip
calls = st.lists(
    st.tuples(st.from_regex(r"[a-z_][a-z0-9_]{0,12}", fullmatch=True),
              st.dictionaries(st.text(max_size=8), json_leaf, max_size=3)),
    min_size=1, max_size=3,
)  # fmt: skip
tool_turns = st.tuples(thoughts, prose, calls, st.data())


def canonical(thought, text, turn_calls=()):
    parts = [text] if text else []
    parts += [format_tool_call(n, a) for n, a in turn_calls]
    body = "\n".join(parts)
    return body if thought is None else think(thought, body)


@pytest.fixture(scope="module")
def chats(tok):
    return {enable: make_chat(tok, enable_thinking=enable) for enable in (True, False)}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(tool_turns, max_size=3), thoughts, prose, st.booleans())
def test_random_tool_loops_append_to_the_one_piece_rendering(chats, turns, thought, last, enable):
    chat = chats[enable]
    d = Dialogue(chat)
    for t, text, turn_calls, data in turns:
        d.model(canonical(t if enable else None, text, turn_calls))
        # tool responses: any text (tags and all), one per call
        d.tool(*[data.draw(st.text(max_size=20)) for _ in turn_calls])
        if enable:  # (exception 1b: without thinking, earlier turns lose the empty block)
            assert np.array_equal(d.stream, d.one_piece())
    final = canonical(thought if enable else None, last)
    d.model(final)
    assert chat.decode(d.pieces[-1][:-1]) == final
    if enable and thought is not None:  # (exception 1c: else Qwen3 adds an empty block)
        assert np.array_equal(np.append(d.stream, chat.encode("\n")), d.one_piece(gen=False))


def test_exception_1c_a_final_turn_without_thinking_gets_an_empty_block(tok):
    chat = make_chat(tok)
    d = Dialogue(chat)
    d.model("5")
    text = d.one_piece_text(gen=False)
    assert text.endswith(GEN + "<think>\n\n</think>\n\n5<|im_end|>\n")
    assert chat.decode(d.stream).endswith(GEN + "5<|im_end|>")


def test_turn_pieces_are_what_qwen3_expects(tok):
    chat = make_chat(tok)
    assert chat.turn_end_id == tok.token_to_id("<|im_end|>") and chat.turn_end_text == "<|im_end|>"
    assert chat.decode(chat.tool_responses(["a", "b"])) == (
        "\n<|im_start|>user\n<tool_response>\na\n</tool_response>\n<tool_response>\nb\n"
        "</tool_response><|im_end|>\n" + GEN
    )
    assert chat.decode(chat.user_turn("hi")) == "\n<|im_start|>user\nhi<|im_end|>\n" + GEN
    assert chat.decode(chat.prompt("", "hi")) == "<|im_start|>user\nhi<|im_end|>\n" + GEN
    assert chat.decode(chat.close_turn([{"role": "user", "content": "sum up"}])) == (
        "<|im_end|>\n<|im_start|>user\nsum up<|im_end|>\n" + GEN
    )


def test_closing_an_unanswered_generation_prompt_is_an_empty_assistant_turn(tok):
    # The compaction pieces: [system, user, assistant "", user request] + generation prompt.
    chat = make_chat(tok)
    request = {"role": "user", "content": "Summarize your progress."}
    stream = np.concatenate([chat.prompt(SYSTEM, TASK, TOOLS), chat.close_turn([request])])
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK},
                {"role": "assistant", "content": ""}, request]  # fmt: skip
    assert np.array_equal(stream, chat.encode(chat.render(messages, TOOLS, True)))


# ---- the documented exceptions ------------------------------------------------------------
def test_exception_1_qwen3_drops_earlier_thinking_once_a_user_turn_follows(tok):
    chat = make_chat(tok)
    d = Dialogue(chat)
    d.model(T1)
    d.tool("5")
    d.model(T3)
    d.user("Now multiply them.")
    assert not np.array_equal(d.stream, d.one_piece())
    # Exactly the thinking blocks differ: the stream with them cut out is the one-piece render.
    cut = [p if i % 2 == 0 else np.append(chat.encode(text.split("</think>\n\n")[1]), p[-1])
           for i, (p, text) in enumerate(zip(d.pieces, ["", T1, "", T3, ""]))]  # fmt: skip
    assert np.array_equal(np.concatenate(cut), d.one_piece())


def test_exception_1b_without_thinking_the_prefilled_empty_block_is_dropped(tok):
    chat = make_chat(tok, enable_thinking=False)
    d = Dialogue(chat)
    assert chat.decode(d.stream).endswith(GEN + "<think>\n\n</think>\n\n")
    d.model("Let me add.\n" + ADD)
    d.tool("5")
    assert not np.array_equal(d.stream, d.one_piece())
    text = d.one_piece_text()
    head, gen = text[: text.rindex(GEN)], text[text.rindex(GEN) :]
    expected = head.replace(GEN, GEN + "<think>\n\n</think>\n\n") + gen
    assert np.array_equal(d.stream, chat.encode(expected))


def test_exception_2_a_non_canonical_call_keeps_the_models_text(tok):
    chat = make_chat(tok)
    raw = 'Let me add.\n<tool_call>\n{"arguments": {"a": 2, "b": 3},  "name": "add"}\n</tool_call>'
    assert assistant_message(raw) == assistant_message("Let me add.\n" + ADD)  # same call
    d = Dialogue(chat)
    d.model(raw)
    d.tool("5")
    assert not np.array_equal(d.stream, d.one_piece())
    assert np.array_equal(d.stream, chat.encode(d.one_piece_text().replace(ADD, raw[12:])))


def test_exception_2b_non_canonical_tokens_are_kept_not_retokenised(tok):
    chat = make_chat(tok)
    text = "The sum is 5."
    chars = np.concatenate([chat.encode(c) for c in text])  # one token per character
    assert not np.array_equal(chars, chat.encode(text))
    d = Dialogue(chat)
    d.model(text, tokens=chars)
    d.user("Thanks.")
    assert not np.array_equal(d.stream, d.one_piece())
    assert chat.decode(d.stream) == d.one_piece_text()
    assert np.array_equal(d.pieces[1][:-1], chars)


def test_exception_3_stopping_on_endoftext_keeps_that_token(tok):
    chat = make_chat(tok)
    d = Dialogue(chat)
    d.model(T1, stop=tok.token_to_id("<|endoftext|>"))
    d.tool("5")
    text = d.one_piece_text()
    assert text.count(ADD + "<|im_end|>") == 1  # the completion's end in the one-piece text
    expected = text.replace(ADD + "<|im_end|>", ADD + "<|endoftext|>")
    assert not np.array_equal(d.stream, d.one_piece())
    assert np.array_equal(d.stream, chat.encode(expected))


def test_exception_4_a_completion_starting_with_a_newline_may_merge_tokens():
    # A tokenizer that has learned "\n\n" as one token (Qwen3's has).
    tok = train_tokenizer(corpus=["one\n\ntwo\n\nthree"] * 50)
    chat = make_chat(tok)
    assert chat.encode("\n\n").size == 1
    d = Dialogue(chat, tools=None)
    d.model("\nHello.")
    d.user("Hi.")
    assert chat.decode(d.stream) == d.one_piece_text()
    assert not np.array_equal(d.stream, d.one_piece())


# ---- switches, decoding, bad input --------------------------------------------------------
def test_thinking_switches(tok):
    text = think("hmm", "42")
    assert make_chat(tok).visible(text) == "42"
    assert make_chat(tok, keep_thinking=True).visible(text) == text
    assert make_chat(tok, enable_thinking=True).decode(make_chat(tok).prompt("", "q")).endswith(GEN)
    off = make_chat(tok, enable_thinking=False)
    assert off.decode(off.prompt("", "q")).endswith(GEN + "<think>\n\n</think>\n\n")


def test_completion_text_requires_a_final_stop_token(tok):
    chat = make_chat(tok)
    body = chat.encode("<think>\nx\n</think>\n\nok")
    assert chat.completion_text(np.append(body, chat.turn_end_id)) == "<think>\nx\n</think>\n\nok"
    eot = tok.token_to_id("<|endoftext|>")
    assert chat.completion_text(np.append(body, eot)) == "<think>\nx\n</think>\n\nok"
    assert chat.completion_text(body) is None
    assert chat.completion_text(np.zeros(0, np.int32)) is None
    assert chat.completion_text(np.zeros((2, 2), np.int32)) is None


def test_bad_setup_is_reported(tok):
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    with pytest.raises(ValueError, match="stop_ids is empty"):
        ChatFormat(tok, QWEN3_CHAT_TEMPLATE, [])
    with pytest.raises(ValueError, match=r"stop_ids \[5000\] are outside"):
        ChatFormat(tok, QWEN3_CHAT_TEMPLATE, [im_end, 5000])
    with pytest.raises(ValueError, match="starts with none of the stop tokens"):
        ChatFormat(tok, QWEN3_CHAT_TEMPLATE, [eot])
    with pytest.raises(ValueError, match="vocab_size=10 is below"):
        ChatFormat(tok, QWEN3_CHAT_TEMPLATE, [im_end], vocab_size=10)
    with pytest.raises(ValueError, match="syntax error at line 2"):
        ChatFormat(tok, "ok\n{% if %}", [im_end])
    with pytest.raises(ValueError, match="non-empty string"):
        ChatFormat(tok, "", [im_end])
    with pytest.raises(ValueError, match="does not print an assistant message"):
        ChatFormat(tok, "{{ messages | length }}", [im_end])
    strict = "{% if messages[0].role != 'system' %}{{ raise_exception('system first') }}{% endif %}"
    with pytest.raises(ValueError, match=r"roles \['user', 'assistant'\]: system first"):
        ChatFormat(tok, strict, [im_end])
    assert ChatFormat(tok, QWEN3_CHAT_TEMPLATE, [im_end], vocab_size=4096).vocab_size == 4096


def test_from_checkpoint_uses_the_models_vocabulary(tok):
    from types import SimpleNamespace

    from gyre.model.hf_dir import Checkpoint, TokenizerFiles

    ids = (tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>"))
    text = TokenizerFiles(tok, QWEN3_CHAT_TEMPLATE, "here", ids, ids[1])
    ckpt = Checkpoint("ckpt", SimpleNamespace(vocab_size=1536), text)
    chat = ChatFormat.from_checkpoint(ckpt, enable_thinking=False)
    assert chat.vocab_size == 1536 and chat.stop_ids == ids and not chat.enable_thinking
    # ids the model has but the tokenizer lacks decode to nothing (the harness bounds them)
    assert chat.completion_text(np.array([64, 1500, 65, ids[0]])) == chat.decode([64, 65])
