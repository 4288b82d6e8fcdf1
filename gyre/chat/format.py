"""Chat turns at the token level, rendered with a checkpoint's own chat template.

The harness's context only grows by appending: the model's completion tokens (ending with the
stop token the engine stopped on) and then the environment's observation tokens. So a
:class:`ChatFormat` never renders a conversation and re-tokenises it; it renders the *text that
a turn adds* and tokenises that piece alone:

  - :meth:`ChatFormat.prompt`: system (+ tools) + first user message + generation prompt;
  - :meth:`ChatFormat.after_completion`: what follows a completion that ended with the
    template's end-of-turn token: the rest of the turn end (Qwen3: ``"\\n"``), the new turns
    (tool responses, user messages) and the next generation prompt;
  - :meth:`ChatFormat.close_turn`: the same after a generation prompt the model has *not*
    answered (an empty assistant turn: the end-of-turn token first), used for summary
    requests and compaction.

The added text is found by rendering ``[user, assistant(SENTINEL), *new turns]`` and taking
what follows ``SENTINEL + end-of-turn``: it does not depend on the real history, so templates
that rewrite earlier turns do not disturb it.

Where the appended stream equals the one-piece rendering, ``encode(render(messages, gen))``:
every prompt of an execution whose completions are the canonical text of their messages (see
:func:`assistant_message`; a malformed turn is its own text, so it always is), tokenised
canonically and not starting with whitespace (the token boundaries then fall where the whole
text splits too: at added tokens and where the pre-tokeniser splits). Where it cannot
(``tests/test_chat.py`` shows each with Qwen3's template):
  1. Qwen3's template drops the thinking of assistant turns before the last plain user message
     (and every empty thinking block from earlier turns: with ``enable_thinking=False``, the
     one the generation prompt pre-fills); the appended stream keeps what the model saw. (It
     also gives a conversation's *final* assistant message an empty block when it has none,
     which matters only for a finished conversation rendered without a generation prompt.)
  2. a completion whose text differs from the template's rendering of its parsed message
     (other spacing or key order in a tool call's JSON, extra newlines around the thinking or
     the prose) or whose tokens are not the canonical tokenisation of its text: the stream
     keeps the model's own tokens, never re-tokenised;
  3. a completion that stopped on another stop token than the end-of-turn one (Qwen3's
     ``<|endoftext|>``): the stream keeps that token; the template would write ``<|im_end|>``;
  4. a completion that starts with whitespace: its first token may merge with the end of the
     generation prompt when the whole text is tokenised.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import numpy as np

from gyre.chat.toolcalls import parse_tool_calls, split_thinking, visible_text

SENTINEL = "@@gyre-sentinel-7b1e@@"  # stands in for an assistant turn's text when rendering


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' override: no HTML escaping, json.dumps options exposed
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def compile_template(template: str) -> jinja2.Template:
    """A chat template compiled as transformers' apply_chat_template compiles it (cached)."""
    if not isinstance(template, str) or not template.strip():
        raise ValueError(f"chat template must be a non-empty string, got {type(template).__name__}")
    return _compile(template)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ValueError(
            f"chat template: syntax error at line {exc.lineno}: {exc.message}"
        ) from exc


def assistant_message(text: str) -> dict:
    """The chat message an assistant turn's text stands for (its stop token removed).

    Thinking goes to ``reasoning_content``; well-formed tool calls to ``tool_calls`` and the
    prose before them to ``content``; a malformed turn keeps its text as ``content``. Rendering
    the message gives back ``text`` when ``text`` is in the template's canonical form.
    """
    thinking, rest = split_thinking(text)
    msg: dict[str, Any] = {"role": "assistant"}
    if thinking or "</think>" in text:
        msg["reasoning_content"] = thinking
    turn = parse_tool_calls(rest)
    if turn.error is None and turn.calls:
        msg["content"] = turn.content
        msg["tool_calls"] = [
            {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in turn.calls
        ]
    else:
        msg["content"] = rest
    return msg


class ChatFormat:
    """A tokenizer plus a chat template, speaking turns as token arrays.

    tokenizer: a ``tokenizers.Tokenizer``; template: the jinja chat template (the
    checkpoint's ``chat_template``); stop_ids: the tokens generation stops on (the
    checkpoint's ``eos_token_id``), one of which must be the template's end-of-turn token.
    keep_thinking: whether the environment reads a turn's thinking block (False: stripped; the
    model's context always keeps its own tokens). enable_thinking: the template switch (Qwen3:
    False pre-fills an empty thinking block). bos_token/eos_token: strings some templates
    print. vocab_size: the model's vocabulary (default: the tokenizer's; may be larger).
    """

    def __init__(self, tokenizer, template: str, stop_ids: Sequence[int], *,
                 keep_thinking: bool = False, enable_thinking: bool = True,
                 bos_token: str | None = None, eos_token: str | None = None,
                 vocab_size: int | None = None):  # fmt: skip
        self.tokenizer = tokenizer
        self.template = compile_template(template)
        self.template_text = template
        self.keep_thinking, self.enable_thinking = bool(keep_thinking), bool(enable_thinking)
        self.bos_token, self.eos_token = bos_token, eos_token
        n_tok = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        self.vocab_size = n_tok if vocab_size is None else int(vocab_size)
        if self.vocab_size < n_tok:
            raise ValueError(f"vocab_size={self.vocab_size} is below the tokenizer's {n_tok}")
        self.stop_ids = tuple(int(i) for i in stop_ids)
        if not self.stop_ids:
            raise ValueError("stop_ids is empty: generation needs a stop token")
        bad = [i for i in self.stop_ids if not 0 <= i < n_tok]
        if bad:
            raise ValueError(f"stop_ids {bad} are outside the tokenizer's {n_tok} tokens")
        self.turn_end_id, self.turn_end_text = self._find_turn_end()

    @classmethod
    def from_checkpoint(cls, ckpt, **kw) -> ChatFormat:
        """The chat format of a checkpoint (``gyre.model.hf_dir.Checkpoint``): its tokenizer,
        chat template and stop ids, with the model's vocabulary; ``kw`` as the constructor.

        A template that does not compile, or does not end a turn with a stop token, is a
        one-line ValueError naming the file it came from."""
        text = ckpt.text
        if text is None:
            raise ValueError(f"{ckpt.path}: no tokenizer.json, so no tokenizer or chat template")
        kw.setdefault("vocab_size", ckpt.spec.vocab_size)
        try:
            return cls(text.tokenizer, text.chat_template, text.stop_ids, **kw)
        except ValueError as e:  # the tokenizer side was checked when read: it is the template
            raise ValueError(f"{text.template_source}: {e}") from e

    # ---- text ----------------------------------------------------------------------------
    def render(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
               add_generation_prompt: bool = False) -> str:  # fmt: skip
        """The template applied to ``messages`` (as transformers' apply_chat_template)."""
        variables = dict(
            messages=list(messages),
            tools=list(tools) if tools else None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=self.enable_thinking,
        )
        if self.bos_token is not None:
            variables["bos_token"] = self.bos_token
        if self.eos_token is not None:
            variables["eos_token"] = self.eos_token
        try:
            return self.template.render(**variables)
        except jinja2.exceptions.TemplateError as exc:
            roles = [m.get("role") for m in messages]
            raise ValueError(f"chat template failed on roles {roles}: {exc}") from exc

    def encode(self, text: str) -> np.ndarray:
        """int32[T]: ``text`` tokenised alone (added tokens matched, nothing prepended)."""
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, np.int32)

    def decode(self, tokens) -> str:
        """Text of int32[T] tokens, special tokens included."""
        return self.tokenizer.decode([int(t) for t in tokens], skip_special_tokens=False)

    def completion_text(self, completion) -> str | None:
        """The text of a completion without its final stop token; None when it did not stop."""
        completion = np.asarray(completion)
        if completion.ndim != 1 or completion.size == 0:
            return None
        if int(completion[-1]) not in self.stop_ids:
            return None
        return self.decode(completion[:-1])

    def visible(self, text: str) -> str:
        """A turn's text as the environment reads it (thinking stripped unless kept)."""
        return visible_text(text, self.keep_thinking)

    # ---- tokens --------------------------------------------------------------------------
    def prompt(self, system: str, user: str, tools: Sequence[dict] | None = None) -> np.ndarray:
        """int32[P]: system (when non-empty) and tools, the first user turn, generation prompt."""
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": user})
        return self.encode(self.render(messages, tools, add_generation_prompt=True))

    def after_completion(self, messages: Sequence[dict]) -> np.ndarray:
        """int32[O]: appended after a completion that ended with the end-of-turn token.

        The rest of that turn's ending, ``messages`` (tool or user turns) and the next
        generation prompt.
        """
        history = [{"role": "user", "content": "."}, {"role": "assistant", "content": SENTINEL}]
        text = self.render([*history, *messages], add_generation_prompt=True)
        mark = SENTINEL + self.turn_end_text
        at = text.find(mark)
        if at < 0 or text.find(mark, at + 1) >= 0:
            raise ValueError("chat template: an assistant turn's end could not be located once")
        return self.encode(text[at + len(mark) :])

    def close_turn(self, messages: Sequence[dict]) -> np.ndarray:
        """int32[O]: appended right after a generation prompt: an empty assistant turn
        (the end-of-turn token) and then as :meth:`after_completion`."""
        tail = self.after_completion(messages)
        return np.concatenate([[self.turn_end_id], tail]).astype(np.int32)

    def tool_responses(self, texts: Sequence[str]) -> np.ndarray:
        """int32[O]: tool-response turns for ``texts`` after a completion."""
        return self.after_completion([{"role": "tool", "content": t} for t in texts])

    def user_turn(self, text: str) -> np.ndarray:
        """int32[O]: a plain user turn after a completion."""
        return self.after_completion([{"role": "user", "content": text}])

    # ---- setup ---------------------------------------------------------------------------
    def _find_turn_end(self) -> tuple[int, str]:
        """The stop token that ends an assistant turn in the template, and its text."""
        history = [{"role": "user", "content": "."}, {"role": "assistant", "content": SENTINEL}]
        text = self.render(history)
        at = text.find(SENTINEL)
        if at < 0:
            raise ValueError("chat template does not print an assistant message's content")
        tail = text[at + len(SENTINEL) :]
        for token_id in self.stop_ids:
            token_text = self.decode([token_id])
            if token_text and tail.startswith(token_text):
                return token_id, token_text
        names = [self.decode([i]) for i in self.stop_ids]
        raise ValueError(
            f"chat template ends an assistant turn with {tail[:20]!r}, which starts with none "
            f"of the stop tokens {names}"
        )
