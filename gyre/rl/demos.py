"""Expert demonstrations for a supervised warm start: the ledger task, and the calculator chat
task (gyre/envs/calc_chat.py, :func:`chat_demo_executions`).

A demonstration is a real harness execution of :class:`LedgerExpert` (so its records have the
exact token layout the RL harness produces), with occasional near-miss mistakes that the
environment answers WRONG and the expert then corrects.

Masking choice: every call is one record, and each record carries a per-token loss mask
over its completion, 0 on the digits of a wrong value (so the warm start never learns to make
the mistake, only to recover from it: the WRONG observation and the corrected retry are
trained) and 1 elsewhere.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re

import numpy as np

from gyre.agent.context import AgentSettings
from gyre.agent.harness import run_executions
from gyre.agent.scripted import LedgerExpert, ScriptedPolicy, _key, read_ledger
from gyre.chat.toolcalls import format_tool_call
from gyre.envs import vocab as V
from gyre.envs.base import Task
from gyre.envs.calc_chat import evaluate_expression, parse_question
from gyre.envs.ledger import LedgerEnv, apply_op
from gyre.trajectory.records import CallRecord


@dataclasses.dataclass
class Demonstration:
    """records: one execution; loss_masks[j]: float32[C_j] for records[j].completion."""

    task: Task
    records: list[CallRecord]
    loss_masks: list[np.ndarray]
    end_reason: str


def mistake_mask(env: LedgerEnv, values: np.ndarray, rec: CallRecord) -> np.ndarray:
    """float32[C]: 0 on the value digits of a wrong COMMIT or sub-agent ANSWER, else 1."""
    mask = np.ones(rec.completion.size, np.float32)
    call = env.parse(rec.completion, rec.role)
    if call is None:
        return mask
    if call.name == "commit":
        i, d = call.args
        wrong = not (1 <= i <= env.num_ops) or d != values[i - 1]
    elif call.name == "answer":
        v, op, a = read_ledger(rec.prompt).sub
        wrong = call.args[0] != apply_op(v, V.OP_IDS.index(op), a, env.modulus)
    else:
        return mask
    if wrong:  # the value digits sit between '=' (or ANSWER) and the final EOS
        first = len(V.number(call.args[-1]))
        mask[-1 - first : -1] = 0.0
    return mask


def demo_executions(seed: int, n: int, num_ops: int = 8, mistake_prob: float = 0.1,
                    delegate_prob: float = 0.0, modulus: int = 10, header_ops: int = 64,
                    max_wrong: int = 2, context_window: int = 4096) -> list[Demonstration]:  # fmt: skip
    """n expert executions on tasks drawn from ``seed``; all end in success."""
    env = LedgerEnv(num_ops=num_ops, modulus=modulus, header_ops=header_ops, max_wrong=max_wrong)
    expert = LedgerExpert(modulus, mistake_prob, delegate_prob, max_mistakes=max_wrong, seed=seed)
    settings = AgentSettings(
        max_calls=4 * (num_ops + max_wrong) + 8, max_tokens=10**9, context_window=context_window
    )
    results = asyncio.run(run_executions(env, env.make_tasks(seed, n), expert, settings))
    demos = []
    for res in results:
        values = env.reset(res.task).values
        masks = [mistake_mask(env, values, rec) for rec in res.records]
        demos.append(Demonstration(res.task, res.records, masks, res.end_reason))
    return demos


_TOOL_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)


class CalcExpert(ScriptedPolicy):
    """The calculator task's demonstrator, speaking chat text through ``chat`` (a
    :class:`~gyre.chat.format.ChatFormat`): it calls ``calculator`` with the question's
    expression and replies with the result; with probability ``direct_prob`` (keyed by
    execution and call) it replies with the right number at once, without the tool. A tiny
    model cannot learn the arithmetic behind those direct replies, so its warm start knows the
    tool-call format but uses the tool only about 1 - direct_prob of the time."""

    def __init__(self, chat, direct_prob: float = 0.5, seed: int = 0):
        if not 0.0 <= direct_prob <= 1.0:
            raise ValueError(f"direct_prob must be in [0, 1], got {direct_prob}")
        self.chat, self.direct_prob, self.seed = chat, float(direct_prob), seed

    def text(self, request) -> str:
        context = self.chat.decode(request.prompt)
        question = parse_question(context)
        if question is None:
            raise ValueError("CalcExpert: no calculator question in the prompt")
        a, op, b = question
        results = _TOOL_RESPONSE.findall(context)
        if results:  # the tool has answered: copy its result
            return results[-1].strip()
        if _key(request, self.seed).random() < self.direct_prob:
            return str(evaluate_expression(f"{a} {op} {b}"))
        return format_tool_call("calculator", {"expression": f"{a} {op} {b}"})

    def program(self, request) -> list[int]:
        return [*self.chat.encode(self.text(request)).tolist(), self.chat.turn_end_id]


def chat_demo_executions(env, seed: int, n: int, direct_prob: float = 0.5,
                         context_window: int = 4096, max_new_tokens: int = 64,
                         samples: int = 1) -> list[Demonstration]:  # fmt: skip
    """n :class:`CalcExpert` executions through the chat environment ``env`` (the run's
    token-level :class:`~gyre.envs.chat_env.ChatEnvironment` on the 'calc' task), ``samples``
    per task; every token of every completion is a target (mask 1)."""
    chat = env.chat
    expert = CalcExpert(chat, direct_prob, seed)
    settings = AgentSettings(max_calls=4, max_tokens=10**9, context_window=context_window,
                             max_new_tokens=max_new_tokens)  # fmt: skip
    tasks = [t for t in env.make_tasks(seed, -(-n // samples)) for _ in range(samples)][:n]
    results = asyncio.run(run_executions(env, tasks, expert, settings))
    demos = []
    for res in results:
        if res.end_reason != "success":
            raise ValueError(f"a calculator demonstration ended in {res.end_reason}: "
                             f"{res.stats.get('detail')}")  # fmt: skip
        masks = [np.ones(rec.completion.size, np.float32) for rec in res.records]
        demos.append(Demonstration(res.task, res.records, masks, res.end_reason))
    return demos
