"""Harness settings, the per-execution call log, and the control-flow exception for endings."""

from __future__ import annotations

import dataclasses

import numpy as np

from gyre import bounds
from gyre.trajectory.records import CallRecord


class Ended(Exception):
    """Raised inside an execution to end it with one of records.END_REASONS."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclasses.dataclass(frozen=True)
class AgentSettings:
    """Harness limits (frozen). The builder makes it from the ``agent.*`` keys plus
    rollout.max_new_tokens and env.partial_scale."""

    max_calls: int = 64
    max_tokens: int = 100_000  # generated tokens per execution
    max_seconds: float = 600.0
    max_retries: int = 2  # consecutive failed attempts at one point before giving up
    context_window: int = 512
    model_summary: bool = False
    infra_retries: int = 2
    concurrency: int = 64
    max_new_tokens: int = 32
    partial_scale: float = 0.5
    vocab_size: int = 0  # 0: the environment's vocabulary

    def __post_init__(self):
        bounds.check(self, "agent", max_new_tokens="rollout.max_new_tokens",
                     partial_scale="env.partial_scale")  # fmt: skip

    def for_env(self, env) -> AgentSettings:
        """These settings with the environment's vocabulary when none is set."""
        if self.vocab_size or env is None:
            return self
        return dataclasses.replace(self, vocab_size=env.vocab_size)


class CallLog:
    """The calls of one execution, in call order; records are built once the ending is known."""

    def __init__(self, execution_id: str):
        self.execution_id = execution_id
        self._calls: list[tuple] = []
        self.generated = 0

    @property
    def num_calls(self) -> int:
        return len(self._calls)

    def add(self, role: str, prompt: np.ndarray, resp, parent: int | None, vocab_size: int):
        """Checks a response (a malformed one is a serving error) and logs the call."""
        tokens = np.asarray(resp.tokens, np.int32)
        logprobs = np.asarray(resp.logprobs, np.float32)
        versions = np.asarray(resp.versions, np.int32)
        n = tokens.size
        problem = None
        if n == 0:
            problem = "no tokens"
        elif logprobs.shape != (n,) or versions.shape != (n,):
            problem = f"logprobs/versions shapes {logprobs.shape}/{versions.shape} for {n} tokens"
        elif tokens.min() < 0 or (vocab_size and tokens.max() >= vocab_size):
            problem = f"token id outside the vocabulary of {vocab_size}"
        elif not np.all(np.isfinite(logprobs)) or logprobs.max() > 1e-4:
            problem = "non-finite or positive logprob"
        if problem:
            raise Ended("infra_error", f"malformed model response: {problem}")
        self._calls.append((role, prompt, tokens, logprobs, versions, parent))
        self.generated += n

    def records(self, end_reason: str) -> list[CallRecord]:
        return [
            CallRecord(
                prompt=p,
                completion=t,
                logprobs=lp,
                versions=v,
                role=role,
                execution_id=self.execution_id,
                call_id=i,
                parent_id=parent,
                end_reason=end_reason,
            )  # fmt: skip
            for i, (role, p, t, lp, v, parent) in enumerate(self._calls)
        ]
