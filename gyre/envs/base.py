"""The environment protocol the harness drives.

An environment turns a seeded :class:`Task` into a mutable state, parses the model's
completions into tool calls (a small grammar over tokens), executes them asynchronously
(tools may take time), counts milestones and judges any ending.

Contract for ``step``: it must not change the state before it can fail, so that the harness
can retry a crashed or hung tool call (an infrastructure error) on the same state.

Step outcomes (``StepResult.kind``):
  'ok'    the observation is appended and the agent continues;
  'error' the tool call failed (bad arguments): the harness retries from before the call;
  'spawn' start a sub-agent with ``sub_prompt`` on ``sub_state``; its outcome is turned into
          the parent's observation by ``Environment.deliver``;
  'done'  the agent's goal is reached (success for the main agent);
  'fail'  the agent has failed (its observation is still appended).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

import numpy as np

STEP_KINDS = ("ok", "error", "spawn", "done", "fail")


@dataclasses.dataclass(frozen=True)
class Task:
    """A seeded task instance; ``params`` holds environment-specific settings (e.g. K)."""

    task_id: str
    seed: int
    params: tuple = ()


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A parsed tool call: the tool's name and its arguments."""

    name: str
    args: tuple = ()


@dataclasses.dataclass
class StepResult:
    """What one tool call did. obs: int32[O] observation tokens appended to the context."""

    kind: str
    obs: np.ndarray
    sub_prompt: np.ndarray | None = None
    sub_state: Any = None

    def __post_init__(self):
        if self.kind not in STEP_KINDS:
            raise ValueError(f"StepResult.kind must be one of {STEP_KINDS}, got {self.kind!r}")
        self.obs = np.asarray(self.obs, np.int32)


class Environment(abc.ABC):
    """Base class; see the module docstring for the step contract."""

    vocab_size: int
    stop_tokens: tuple[int, ...]
    tool_timeout: float = 30.0  # seconds before a tool counts as hung (infrastructure error)

    @abc.abstractmethod
    def reset(self, task: Task) -> Any:
        """A fresh mutable state for the task."""

    @abc.abstractmethod
    def task_prompt(self, state) -> np.ndarray:
        """int32[P]: the task prefix, kept verbatim across compaction."""

    @abc.abstractmethod
    def initial_obs(self, state) -> np.ndarray:
        """int32[O]: observation tokens following the task prefix at the start."""

    @abc.abstractmethod
    def parse(self, completion: np.ndarray, role: str) -> ToolCall | None:
        """The tool call in a completion, or None when it does not parse."""

    @abc.abstractmethod
    async def step(self, state, call: ToolCall, role: str) -> StepResult:
        """Executes a tool call on a state (the main state or a sub-agent's state)."""

    @abc.abstractmethod
    def deliver(self, state, sub_state, succeeded: bool) -> np.ndarray:
        """Observation tokens for the parent once a sub-agent has finished."""

    @abc.abstractmethod
    def summary(self, state, role: str) -> np.ndarray:
        """Harness-written compaction: tokens that follow the task prefix (from env state)."""

    @abc.abstractmethod
    def summary_request(self, role: str) -> np.ndarray:
        """Tokens appended to the context to ask the model for a summary (main-summary)."""

    @abc.abstractmethod
    def resume_obs(self, state, role: str) -> np.ndarray:
        """Observation tokens placed after a model-written summary."""

    @abc.abstractmethod
    def milestones(self, state) -> tuple[int, int]:
        """(completed, total) milestones of the main state."""

    def render_tokens(self, tokens: np.ndarray) -> str:
        """Readable text of int32[T] tokens (transcripts); subclasses with a vocabulary
        override it."""
        return " ".join(str(int(t)) for t in np.asarray(tokens))

    def judge(self, state, end_reason: str, partial_scale: float) -> float | None:
        """Score in [0, 1]: 1 for success, else partial_scale * completed / total.

        Infrastructure errors get no score (None): they are not the policy's doing.
        """
        if not 0.0 <= partial_scale < 1.0:
            raise ValueError(f"partial_scale must be in [0, 1), got {partial_scale}")
        if end_reason == "infra_error":
            return None
        if end_reason == "success":
            return 1.0
        done, total = self.milestones(state)
        return partial_scale * done / max(total, 1)
