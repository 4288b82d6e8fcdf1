"""A :class:`~gyre.envs.text.TextEnvironment` as the token-level environment the harness drives.

:class:`ChatEnvironment` speaks the text environment's turns through a
:class:`~gyre.chat.format.ChatFormat` (a checkpoint's tokenizer and chat template):

  task prompt   system + tools + first user message + generation prompt;
  a turn        decoded (it must end with a stop token), thinking split off
                (:func:`~gyre.chat.toolcalls.split_thinking`; calls written inside the
                thinking are deliberation, never run); then the rest is
                  tool calls      -> ``TextEnvironment.call_tool`` for each, in order; the
                                     results come back as tool-response turns;
                  a malformed one -> an 'ok' step whose tool response says what is wrong
                                     (the model sees it and may correct itself: never a crash
                                     and never a silent retry);
                  no tool call    -> ``TextEnvironment.answer`` with the text (thinking kept or
                                     stripped by ``ChatFormat.keep_thinking``); its reply comes
                                     back as a user turn;
  compaction    the harness's summary, the model's summary request and the resume message are
                user turns after an empty assistant turn (the open generation prompt is closed
                first), so the compacted context is still a well-formed chat.

The context never drops the model's own tokens (``ChatFormat`` explains where this differs from
rendering the conversation in one piece). A turn's calls run one after the other and stop at
the first 'done' or 'fail'. Steps never return 'error' or 'spawn'. Should a tool raise (an
infrastructure error) after earlier calls of the same turn ran, the harness's retry of that turn
replays their results instead of running them twice (the base protocol's step contract).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from gyre.chat.format import ChatFormat
from gyre.chat.toolcalls import MAX_CALLS, parse_tool_calls, split_thinking
from gyre.envs.base import Environment, StepResult, Task, ToolCall
from gyre.envs.text import TextEnvironment, TextStep

# ToolCall names the adapter reserves (not valid function names, so no tool can clash).
ANSWER = "<answer>"  # args: (text,) a reply without a tool call
MALFORMED = "<malformed>"  # args: (error message,)
CALLS = "<calls>"  # args: a tuple of ToolCall(name, (arguments_json,)), two or more
SUMMARY = "<summary>"  # args: (text,) a model-written summary
RESERVED = (ANSWER, MALFORMED, CALLS, SUMMARY)

SUMMARY_REQUEST = (
    "Your context is almost full. Summarize your progress: what you have done, what you have "
    "learned, and what remains. The summary replaces the conversation so far."
)
RESUME = "{summary}\nContinue the task."


@dataclasses.dataclass
class ChatState:
    """The text environment's state plus the turn being executed (for replays on retry)."""

    task: Task
    inner: Any
    partial: tuple[ToolCall, list[TextStep]] | None = None
    tool_calls: int = 0  # tool calls run (a retried turn's replayed ones counted once)
    malformed: int = 0  # turns whose tool calls did not parse


class ChatEnvironment(Environment):
    """See the module docstring. ``text_env`` and ``chat`` are used as given (not copied).

    summary_request: the user message asking for a model-written summary; resume: the user
    message after it (``{summary}`` is replaced with ``TextEnvironment.summary_text``);
    max_calls: the most tool calls one turn may make (more is a malformed turn).
    """

    def __init__(self, text_env: TextEnvironment, chat: ChatFormat, *,
                 summary_request: str = SUMMARY_REQUEST, resume: str = RESUME,
                 max_calls: int = MAX_CALLS):  # fmt: skip
        if max_calls < 1:
            raise ValueError(f"max_calls must be >= 1, got {max_calls}")
        self.text_env, self.chat = text_env, chat
        self.vocab_size = chat.vocab_size
        self.stop_tokens = chat.stop_ids
        self.tool_timeout = text_env.tool_timeout
        self.summary_request_text, self.resume_text = summary_request, resume
        self.max_calls = max_calls
        self.name = getattr(text_env, "name", type(text_env).__name__)

    def render_tokens(self, tokens) -> str:
        return self.chat.decode(tokens)

    def make_tasks(self, seed: int, n: int, split: str = "train") -> list[Task]:
        return self.text_env.make_tasks(seed, n, split)

    # ---- prompts -------------------------------------------------------------------------
    def reset(self, task: Task) -> ChatState:
        return ChatState(task, self.text_env.reset(task))

    def task_prompt(self, state: ChatState) -> np.ndarray:
        env = self.text_env
        return self.chat.prompt(env.system_prompt, env.task_text(state.inner), env.tools)

    def initial_obs(self, state: ChatState) -> np.ndarray:
        return np.zeros(0, np.int32)

    # ---- turns ---------------------------------------------------------------------------
    def parse(self, completion: np.ndarray, role: str) -> ToolCall | None:
        """None when the completion did not end with a stop token (or for sub-agent roles)."""
        text = self.chat.completion_text(completion)
        if text is None:
            return None
        if role == "main-summary":
            return ToolCall(SUMMARY, (split_thinking(text)[1],))
        if role != "main":
            return None  # text environments start no sub-agents
        rest = split_thinking(text)[1]
        turn = parse_tool_calls(rest, self.max_calls)
        if turn.error is not None:
            return ToolCall(MALFORMED, (turn.error,))
        if not turn.calls:
            return ToolCall(ANSWER, (self.chat.visible(text),))
        clash = [c.name for c in turn.calls if c.name in RESERVED]
        if clash:
            return ToolCall(MALFORMED, (f"unknown tool {clash[0]!r}",))
        calls = tuple(ToolCall(c.name, (c.arguments_json(),)) for c in turn.calls)
        return calls[0] if len(calls) == 1 else ToolCall(CALLS, calls)

    async def step(self, state: ChatState, call: ToolCall, role: str) -> StepResult:
        if call.name == MALFORMED:
            (error,) = call.args
            state.malformed += 1
            return StepResult("ok", self.chat.tool_responses([f"Error: {error}"]))
        if call.name == ANSWER:
            (text,) = call.args
            result = await self.text_env.answer(state.inner, text)
            return StepResult(result.kind, self.chat.user_turn(result.text))
        if call.name == SUMMARY:
            raise ValueError("a summary is not a tool call: the harness never steps it")
        calls = call.args if call.name == CALLS else (call,)
        done: list[TextStep] = []
        if state.partial is not None and state.partial[0] == call:
            done = state.partial[1]  # a retried turn: these calls already ran
        state.partial = (call, done)
        for one in calls[len(done) :]:
            if done and done[-1].kind != "ok":
                break
            (arguments_json,) = one.args
            done.append(
                await self.text_env.call_tool(state.inner, one.name, json.loads(arguments_json))
            )
            state.tool_calls += 1
        state.partial = None
        kind = next((r.kind for r in done if r.kind != "ok"), "ok")
        obs = self.chat.after_completion(
            [{"role": "tool", "name": c.name, "content": r.text} for c, r in zip(calls, done)]
        )
        return StepResult(kind, obs)

    def execution_stats(self, state: ChatState) -> dict:
        """Counts the harness adds to an execution's stats (metrics ``tool_calls``,
        ``malformed_calls``; the transcripts show them)."""
        return {"tool_calls": state.tool_calls, "malformed_calls": state.malformed}

    def deliver(self, state, sub_state, succeeded: bool) -> np.ndarray:
        return np.zeros(0, np.int32)  # text environments start no sub-agents

    # ---- compaction ----------------------------------------------------------------------
    def summary(self, state: ChatState, role: str) -> np.ndarray:
        return self.chat.close_turn([self._user(self.text_env.summary_text(state.inner))])

    def summary_request(self, role: str) -> np.ndarray:
        return self.chat.close_turn([self._user(self.summary_request_text)])

    def resume_obs(self, state: ChatState, role: str) -> np.ndarray:
        text = self.resume_text.replace("{summary}", self.text_env.summary_text(state.inner))
        return self.chat.close_turn([self._user(text)])

    @staticmethod
    def _user(text: str) -> dict:
        return {"role": "user", "content": text}

    # ---- judging -------------------------------------------------------------------------
    def milestones(self, state: ChatState) -> tuple[int, int]:
        return self.text_env.milestones(state.inner)

    def judge(self, state: ChatState, end_reason: str, partial_scale: float) -> float | None:
        """1 for success; else partial_scale * the task's own score when it has one
        (``TextEnvironment.score``), else the milestone fraction; None for infra errors."""
        if not 0.0 <= partial_scale < 1.0:
            raise ValueError(f"partial_scale must be in [0, 1), got {partial_scale}")
        if end_reason in ("infra_error", "success"):
            return super().judge(state, end_reason, partial_scale)
        score = self.text_env.score(state.inner)
        if score is None:
            return super().judge(state, end_reason, partial_scale)
        if not 0.0 <= score <= 1.0:
            raise ValueError(f"{self.name}: score() returned {score}, outside [0, 1]")
        return partial_scale * float(score)


def tool_metrics(results, prefix: str = "") -> dict:
    """Tool use of finished executions (their harness stats from
    :meth:`ChatEnvironment.execution_stats`): ``tool_calls`` run in all, ``tool_use`` the share
    of executions that ran at least one, ``malformed_calls``; {} when no execution counted any
    (a token environment)."""
    stats = [r.stats for r in results if r.stats and "tool_calls" in r.stats]
    if not stats:
        return {}
    calls = [int(s["tool_calls"]) for s in stats]
    return {
        f"{prefix}tool_calls": sum(calls),
        f"{prefix}tool_use": float(np.mean([c > 0 for c in calls])),
        f"{prefix}malformed_calls": sum(int(s.get("malformed_calls", 0)) for s in stats),
    }
