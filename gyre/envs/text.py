"""Text environments: tasks spoken in chat text with JSON tools, for models with a tokenizer.

A :class:`TextEnvironment` never sees tokens. It gives the system prompt, the tools (JSON
schemas, rendered by the checkpoint's chat template), the first user message, and executes
tool calls and final answers on a mutable state. The chat adapter
(:mod:`gyre.envs.chat_env`) turns one into the token-level
:class:`~gyre.envs.base.Environment` the harness drives, with the checkpoint's tokenizer and
chat template, so every environment here runs with any Qwen3-style checkpoint.

Outcome kinds of :class:`TextStep` are those of :class:`~gyre.envs.base.StepResult` but
'error' and 'spawn': 'ok' (the text is the tool's response and the agent continues), 'done'
(goal reached), 'fail' (the agent has failed). A tool that cannot run because of the
infrastructure raises (the harness retries it); a tool call with bad arguments is an 'ok'
step whose text says what was wrong: the model sees it and may correct itself.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

from gyre.envs.base import Task

TEXT_STEP_KINDS = ("ok", "done", "fail")


@dataclasses.dataclass(frozen=True)
class TextStep:
    """What one tool call or final answer did: ``text`` goes back to the model."""

    kind: str
    text: str

    def __post_init__(self):
        if self.kind not in TEXT_STEP_KINDS:
            raise ValueError(f"TextStep.kind must be one of {TEXT_STEP_KINDS}, got {self.kind!r}")


class TextEnvironment(abc.ABC):
    """A chat task with tools. Subclasses set ``name`` and implement the abstract methods.

    ``tools``: OpenAI-style function schemas, e.g. ``{"type": "function", "function":
    {"name": ..., "description": ..., "parameters": {...}}}``; empty for answer-only tasks.
    """

    name: str
    system_prompt: str = ""
    tools: tuple[dict, ...] = ()
    tool_timeout: float = 30.0  # seconds before a tool call counts as hung

    @abc.abstractmethod
    def make_tasks(self, seed: int, n: int, split: str = "train") -> list[Task]:
        """``n`` tasks keyed by ``seed``; ``split`` 'train' or 'eval' (disjoint problems)."""

    @abc.abstractmethod
    def reset(self, task: Task) -> Any:
        """A fresh mutable state for the task."""

    @abc.abstractmethod
    def task_text(self, state) -> str:
        """The first user message."""

    @abc.abstractmethod
    async def call_tool(self, state, name: str, arguments: dict) -> TextStep:
        """Executes one tool call (unknown names and bad arguments: an 'ok' step saying so)."""

    @abc.abstractmethod
    async def answer(self, state, text: str) -> TextStep:
        """The model replied without a tool call: ``text`` (thinking stripped) is its answer
        (async: judging it may run code)."""

    @abc.abstractmethod
    def milestones(self, state) -> tuple[int, int]:
        """(completed, total) milestones, for the partial score of an unfinished execution."""

    def score(self, state) -> float | None:
        """A task's own fractional score in [0, 1] when it has one (None: use milestones)."""
        return None

    def summary_text(self, state) -> str:
        """Harness-written compaction: what the agent has achieved so far, as text."""
        done, total = self.milestones(state)
        return f"Progress so far: {done}/{total} milestones."
