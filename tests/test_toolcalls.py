"""Tool-call and thinking parsing: round trips, every error rule, adversarial text (hypothesis)."""

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.chat.toolcalls import (
    CLOSE,
    MAX_CALLS,
    OPEN,
    THINK_CLOSE,
    THINK_OPEN,
    ParsedCall,
    ParsedTurn,
    format_tool_call,
    parse_tool_calls,
    split_thinking,
    visible_text,
)

TAGS = (OPEN, CLOSE, THINK_OPEN, THINK_CLOSE)
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def no_tags(s: str) -> bool:
    return not any(tag in s for tag in TAGS)


names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-]{0,24}", fullmatch=True)
texts = st.text(max_size=40).filter(no_tags)
scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | texts
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=12,
)
arguments = st.dictionaries(texts, json_values, max_size=5)
blank = st.text(alphabet=" \n\t", max_size=3)


def check_invariants(turn):
    """What any parse result must satisfy, whatever the input."""
    assert isinstance(turn, ParsedTurn) and isinstance(turn.content, str)
    if turn.error is not None:
        assert isinstance(turn.error, str) and turn.error and turn.calls == ()
    for call in turn.calls:
        assert isinstance(call.name, str) and call.name.strip()
        assert isinstance(call.arguments, dict)
        json.loads(call.arguments_json())  # re-serialisable


# ---- round trips ------------------------------------------------------------------------
@FAST
@given(
    st.lists(st.tuples(names, arguments), min_size=1, max_size=4),
    texts,
    st.lists(blank, min_size=5, max_size=5),
)
def test_well_formed_calls_round_trip(calls, prose, gaps):
    text = prose + "\n"
    for i, (name, args) in enumerate(calls):
        text += format_tool_call(name, args) + (gaps[i] if i < len(calls) - 1 else "\n")
    turn = parse_tool_calls(text)
    assert turn.error is None, turn.error
    assert turn.content == prose.strip()
    assert [(c.name, c.arguments) for c in turn.calls] == calls
    for call, (name, args) in zip(turn.calls, calls):
        assert format_tool_call(call.name, call.arguments) == format_tool_call(name, args)


@FAST
@given(texts)
def test_text_without_tags_is_a_plain_answer(prose):
    assert parse_tool_calls(prose) == ParsedTurn(prose.strip())


def test_escaped_tags_inside_arguments_read_back_as_the_tags():
    body = '{"name": "echo", "arguments": {"s": "\\u003ctool_call>x<\\/tool_call>"}}'
    turn = parse_tool_calls(f"{OPEN}\n{body}\n{CLOSE}")
    assert turn.error is None and turn.calls[0].arguments == {"s": "<tool_call>x</tool_call>"}


def test_huge_argument_strings_parse():
    big = "é" * 1_000_000
    turn = parse_tool_calls(format_tool_call("write", {"content": big}))
    assert turn.error is None and turn.calls[0].arguments["content"] == big


# ---- each error rule ----------------------------------------------------------------------
def call_text(body: str) -> str:
    return f"{OPEN}\n{body}\n{CLOSE}"


GOOD = call_text('{"name": "f", "arguments": {}}')


@pytest.mark.parametrize(
    "text, needle",
    [
        (f"{OPEN}\n" + '{"name": "f", "arguments": {}}', "without a closing"),
        (f"hi {CLOSE}", "without an opening"),
        (GOOD + f"\n{CLOSE}", "without an opening"),
        (f"{OPEN}\n{GOOD}", "inside another tool call"),
        (call_text('{"name": "f", "arguments": {}'), "invalid JSON"),
        (call_text(""), "invalid JSON"),
        (call_text("[1, 2]"), "got list"),
        (call_text('{"arguments": {}}'), "'name' must be a non-empty string"),
        (call_text('{"name": 3, "arguments": {}}'), "'name' must be a non-empty string"),
        (call_text('{"name": "  ", "arguments": {}}'), "'name' must be a non-empty string"),
        (call_text('{"name": "f"}'), "missing 'arguments'"),
        (call_text('{"name": "f", "arguments": [1]}'), "'arguments' must be a JSON object"),
        (call_text('{"name": "f", "arguments": "{}"}'), "'arguments' must be a JSON object"),
        (call_text('{"name": "f", "arguments": {}, "id": 1}'), "unexpected keys ['id']"),
        (call_text('{"name": "f", "name": "g", "arguments": {}}'), "duplicate key 'name'"),
        (call_text('{"name": "f", "arguments": {"x": NaN}}'), "invalid JSON"),
        (call_text('{"name": "f", "arguments": {"x": -Infinity}}'), "invalid JSON"),
        (call_text('{"name": "f", "arguments": {"x": ' + "[" * 100_000 + "}}"), "too deeply"),
        (call_text('{"name": "f", "arguments": {"x": ' + "9" * 5000 + "}}"), "invalid JSON"),
        (GOOD + "\nDone!", "text after the last tool call"),
        (GOOD + "\nand then\n" + GOOD, "text after tool call 1"),
        ("\n".join([GOOD] * (MAX_CALLS + 1)), f"more than {MAX_CALLS} tool calls"),
    ],
)
def test_malformed_calls_are_reported_never_raised(text, needle):
    turn = parse_tool_calls(text)
    check_invariants(turn)
    assert turn.error is not None and needle in turn.error, turn.error


def test_error_messages_name_the_failing_call_and_stay_short():
    turn = parse_tool_calls(GOOD + "\n" + call_text('{"name": "g", "arguments": 7}'))
    assert turn.error.startswith("tool call 2:")
    turn = parse_tool_calls(call_text("{" + "x" * 100_000))
    assert turn.error.startswith("tool call 1: invalid JSON") and len(turn.error) < 400


def test_non_text_input_is_an_error_not_a_crash():
    assert parse_tool_calls(None).error == "expected text, got NoneType"
    assert split_thinking(b"<think>") == ("", "")


# ---- adversarial text ---------------------------------------------------------------------
pieces = st.sampled_from(
    [*TAGS, "{", "}", "[", "]", '"', ":", ",", '"name"', '"arguments"', '"f"', "{}", "\n", " ",
     "\\", "1e999", "NaN", "null", "é", "\x00", "\ud800", "\u202e", "x" * 1000]
)  # fmt: skip
adversarial = st.lists(pieces | st.text(max_size=8), max_size=40).map("".join)


@FAST
@given(adversarial)
def test_adversarial_text_never_raises(text):
    check_invariants(parse_tool_calls(text))
    thinking, rest = split_thinking(text)
    assert thinking in text and rest in text
    assert visible_text(text, True) == text and visible_text(text, False) == rest


@FAST
@given(
    st.lists(st.tuples(names, arguments), min_size=1, max_size=3),
    st.data(),
)
def test_mutated_calls_never_raise_and_parse_only_to_valid_calls(calls, data):
    text = "\n".join(format_tool_call(n, a) for n, a in calls)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(text)))
        j = data.draw(st.integers(i, min(len(text), i + 8)))
        text = text[:i] + data.draw(pieces | st.just("")) + text[j:]
    check_invariants(parse_tool_calls(text))


@FAST
@given(st.lists(st.tuples(names, arguments), min_size=1, max_size=3), st.sampled_from(TAGS))
def test_a_tag_inside_a_call_is_an_error(calls, tag):
    # A tag written raw inside an argument string breaks the block structure: reported.
    calls = [(calls[0][0], {**calls[0][1], "s": f"a{tag}b"}), *calls[1:]]
    turn = parse_tool_calls("\n".join(format_tool_call(n, a) for n, a in calls))
    check_invariants(turn)
    if tag in (OPEN, CLOSE):
        assert turn.error is not None
    else:  # think tags mean nothing inside a call
        assert turn.error is None and turn.calls[0].arguments["s"] == f"a{tag}b"


def test_float_arguments_survive_exactly():
    turn = parse_tool_calls(format_tool_call("f", {"x": 0.1, "y": -0.0, "z": 1e308}))
    args = turn.calls[0].arguments
    assert args["x"] == 0.1 and math.copysign(1, args["y"]) < 0 and args["z"] == 1e308


# ---- thinking -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, thinking, rest",
    [
        ("<think>\nplan\n</think>\n\nanswer", "plan", "answer"),
        ("  <think>a</think>b", "a", "b"),
        ("plan\n</think>\n\nanswer", "plan", "answer"),  # the prompt opened the block
        ("<think>\nstill thinking", "still thinking", ""),  # stopped mid-thought
        ("no thinking here", "", "no thinking here"),
        ("prose <think>x</think> more", "", "prose <think>x</think> more"),
        ("<think>a</think>b<think>c</think>d", "a", "b<think>c</think>d"),
        ("<think>\n\n</think>\n\n", "", ""),
        ("", "", ""),
    ],
)
def test_split_thinking(text, thinking, rest):
    assert split_thinking(text) == (thinking, rest)


def test_keep_or_strip_thinking():
    text = "<think>\nhmm\n</think>\n\n42"
    assert visible_text(text, keep_thinking=False) == "42"
    assert visible_text(text, keep_thinking=True) == text


def test_tool_calls_inside_thinking_are_not_calls():
    text = f"<think>\nmaybe {GOOD}\n</think>\n\nNo tool needed: 42"
    thinking, rest = split_thinking(text)
    assert GOOD in thinking and parse_tool_calls(rest) == ParsedTurn("No tool needed: 42")


def test_parsed_call_arguments_json_is_the_template_tojson():
    call = ParsedCall("f", {"b": "ü", "a": [1, 2.5]})
    assert call.arguments_json() == '{"b": "ü", "a": [1, 2.5]}'
