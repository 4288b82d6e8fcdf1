"""Tool calls and thinking blocks in generated text, in Qwen3's (Hermes-style) format.

A turn of a Qwen3 model is optional thinking, optional prose, then zero or more calls::

    <think>
    ...
    </think>

    Let me look.
    <tool_call>
    {"name": "read_file", "arguments": {"path": "a.py"}}
    </tool_call>

:func:`split_thinking` separates the thinking from the rest; :func:`parse_tool_calls` reads
the calls from the rest. Neither raises on any input: a malformed turn is a
:class:`ParsedTurn` whose ``error`` says what is wrong, so the model can be told.

Parsing rules (``parse_tool_calls``):
  - no ``<tool_call>`` and no ``</tool_call>`` anywhere: no calls, the whole text is content
    (a plain answer);
  - text before the first ``<tool_call>`` is content (prose); surrounding whitespace dropped;
  - each block's body (between ``<tool_call>`` and the next ``</tool_call>``) is one JSON
    object with exactly the keys ``name`` (a non-empty string) and ``arguments`` (an object);
    NaN/Infinity, duplicate keys, nesting too deep for the JSON reader and bad JSON are errors;
  - a ``<tool_call>`` before the block's ``</tool_call>`` (nested), an unterminated block and a
    stray ``</tool_call>`` are errors; so the tag texts cannot appear verbatim inside a call's
    JSON strings: write them escaped (``"\\u003ctool_call>"``), which JSON reads back the same;
  - only whitespace may separate blocks and follow the last one: prose after a call is an error
    (was it meant to be read before or after the call ran?), as are more than ``max_calls``.
"""

from __future__ import annotations

import dataclasses
import json

OPEN, CLOSE = "<tool_call>", "</tool_call>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
MAX_CALLS = 16  # more calls than this in one turn is an error


@dataclasses.dataclass(frozen=True)
class ParsedCall:
    """One tool call: ``arguments`` is the decoded JSON object."""

    name: str
    arguments: dict

    def arguments_json(self) -> str:
        """The arguments as JSON the way chat templates render them (``tojson``)."""
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
    """The calls of one turn, or ``error`` (then ``calls`` is empty); ``content``: the prose."""

    content: str
    calls: tuple[ParsedCall, ...] = ()
    error: str | None = None


def split_thinking(text: str) -> tuple[str, str]:
    """(thinking, rest) of a turn. Never raises.

    The thinking block is the text up to the first ``</think>``, after an optional leading
    ``<think>`` (templates that open the block in the generation prompt leave it out of the
    completion); its surrounding newlines are dropped, as are the newlines that start the rest.
    A ``<think>`` left open (the turn stopped mid-thought) makes the whole turn thinking. A turn
    whose first non-blank text is not ``<think>`` and that has no ``</think>`` has no thinking.
    Any later think tags stay in ``rest`` as plain text.
    """
    if not isinstance(text, str):
        return "", ""
    end = text.find(THINK_CLOSE)
    body = text.lstrip()
    opened = body.startswith(THINK_OPEN)
    if end < 0:
        if opened:
            return body[len(THINK_OPEN) :].strip("\n"), ""
        return "", text
    thinking = text[:end]
    start = thinking.find(THINK_OPEN)
    if start >= 0:
        if thinking[:start].strip():  # prose before <think>: that block is not a leading one
            return "", text
        thinking = thinking[start + len(THINK_OPEN) :]
    return thinking.strip("\n"), text[end + len(THINK_CLOSE) :].lstrip("\n")


def visible_text(text: str, keep_thinking: bool) -> str:
    """The turn as the environment reads it: whole, or with its thinking block stripped."""
    return text if keep_thinking else split_thinking(text)[1]


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _unique_keys(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def _parse_call(body: str, index: int) -> ParsedCall | str:
    """One block's body as a call, or the error message."""
    where = f"tool call {index}"
    try:
        obj = json.loads(body, object_pairs_hook=_unique_keys, parse_constant=_reject_constant)
    except RecursionError:
        return f"{where}: JSON nested too deeply"
    except Exception as exc:  # JSONDecodeError, ValueError (duplicate keys, huge ints, NaN)
        return f"{where}: invalid JSON ({_short(str(exc))}) in {_short(body.strip())!r}"
    if not isinstance(obj, dict):
        return (
            f"{where}: expected a JSON object with 'name' and 'arguments', got {type(obj).__name__}"
        )
    extra = sorted(set(obj) - {"name", "arguments"})
    if extra:
        return f"{where}: unexpected keys {extra}; expected only 'name' and 'arguments'"
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return f"{where}: 'name' must be a non-empty string, got {_short(repr(name))}"
    if "arguments" not in obj:
        return f"{where}: missing 'arguments' (use {{}} for none)"
    args = obj["arguments"]
    if not isinstance(args, dict):
        return f"{where}: 'arguments' must be a JSON object, got {type(args).__name__}"
    return ParsedCall(name, args)


def parse_tool_calls(text: str, max_calls: int = MAX_CALLS) -> ParsedTurn:
    """The tool calls in a turn (thinking already split off); see the module docstring.

    Never raises: anything malformed is a ParsedTurn with ``error`` set and no calls.
    """
    if not isinstance(text, str):
        return ParsedTurn("", (), f"expected text, got {type(text).__name__}")
    first_open, first_close = text.find(OPEN), text.find(CLOSE)
    if first_open < 0 and first_close < 0:
        return ParsedTurn(text.strip())
    if first_close >= 0 and (first_open < 0 or first_close < first_open):
        return ParsedTurn(text.strip(), (), f"{CLOSE} without an opening {OPEN}")
    content = text[:first_open].strip()
    calls: list[ParsedCall] = []
    pos = first_open
    while True:
        index = len(calls) + 1
        start = pos + len(OPEN)
        end = text.find(CLOSE, start)
        if end < 0:
            return ParsedTurn(content, (), f"tool call {index}: {OPEN} without a closing {CLOSE}")
        body = text[start:end]
        if OPEN in body:
            return ParsedTurn(content, (), f"tool call {index}: {OPEN} inside another tool call")
        call = _parse_call(body, index)
        if isinstance(call, str):
            return ParsedTurn(content, (), call)
        calls.append(call)
        if len(calls) > max_calls:
            return ParsedTurn(content, (), f"more than {max_calls} tool calls in one turn")
        pos = end + len(CLOSE)
        nxt_open, nxt_close = text.find(OPEN, pos), text.find(CLOSE, pos)
        if nxt_close >= 0 and (nxt_open < 0 or nxt_close < nxt_open):
            return ParsedTurn(content, (), f"{CLOSE} without an opening {OPEN}")
        between = text[pos:] if nxt_open < 0 else text[pos:nxt_open]
        if between.strip():
            where = "after the last tool call" if nxt_open < 0 else f"after tool call {index}"
            return ParsedTurn(
                content, (), f"text {where} ({_short(between.strip())!r}); only calls may follow"
            )
        if nxt_open < 0:
            return ParsedTurn(content, tuple(calls))
        pos = nxt_open


def format_tool_call(name: str, arguments: dict) -> str:
    """One call as Qwen3's chat template renders it (``name`` written raw, as the template does)."""
    return f'{OPEN}\n{{"name": "{name}", "arguments": {json.dumps(arguments, ensure_ascii=False)}}}\n{CLOSE}'
