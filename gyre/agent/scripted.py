"""Scripted policies and fault injectors: deterministic token programs for harness tests.

Every policy implements the proxy's ``async generate(GenerateRequest) -> GenerateResponse``,
honours ``max_new_tokens`` and ``stop_tokens``, and returns logprobs <= 0 and a version per
token. Random choices are keyed by (seed, execution id, call id), never by call order.
"""

from __future__ import annotations

import asyncio
import dataclasses
import zlib

import numpy as np

from gyre.envs import vocab as V
from gyre.envs.ledger import apply_op
from gyre.rollout.types import GenerateRequest, GenerateResponse


def _key(request: GenerateRequest, seed: int) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(request.execution_id.encode()), request.call_id])


class ScriptedPolicy:
    """Base class: subclasses write ``program(request) -> list of token ids``."""

    version = 0

    def program(self, request: GenerateRequest) -> list[int]:
        raise NotImplementedError

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        out, finish = [], "length"
        for tok in self.program(request)[: request.max_new_tokens]:
            out.append(tok)
            if tok in request.stop_tokens:
                finish = "stop"
                break
        n = len(out)
        pos = np.arange(n)  # a deterministic, strictly negative logprob per token
        logprobs = -0.01 - 0.5 * ((pos * 7919 + request.call_id * 104729) % 101) / 101.0
        return GenerateResponse(np.asarray(out, np.int32), logprobs.astype(np.float32),
                                np.full(n, self.version, np.int32), finish)  # fmt: skip


@dataclasses.dataclass
class LedgerView:
    """What a ledger prompt says: current (index, value), listed ops, pending observations."""

    idx: int = 0
    value: int = 0
    ops: dict = dataclasses.field(default_factory=dict)  # step -> (op token, arg)
    sub: tuple | None = None  # (value, op token, arg) for a sub-agent prompt
    answer: int | None = None  # an ANSWER observation not yet committed
    wrongs: int = 0
    summary_request: bool = False


def read_ledger(prompt) -> LedgerView:
    """Parses a ledger context (see gyre/envs/ledger.py for the format) left to right."""
    t = prompt.tolist()
    n, i, view, pending = len(t), 0, LedgerView(), None

    def num(j):
        v = 0
        while j < n and V.DIGIT0 <= t[j] < V.DIGIT0 + 10:
            v, j = v * 10 + t[j] - V.DIGIT0, j + 1
        return v, j

    while i < n:
        tok = t[i]
        i += 1
        if tok == V.START:
            view.value, i = num(i)
        elif tok == V.STEP:
            j, i = num(i)
            a, i2 = num(i + 1)
            view.ops[j] = (t[i], a)
            i = i2
        elif tok == V.SUB:
            v, i = num(i)
            a, i2 = num(i + 1)
            view.sub, i = (v, t[i], a), i2
        elif tok == V.COMMIT:
            j, i = num(i)
            d, i = num(i + 1)
            pending, view.answer = (j, d), None
        elif tok == V.OK and pending is not None:
            (view.idx, view.value), pending = pending, None
        elif tok == V.WRONG:
            pending, view.wrongs = None, view.wrongs + 1
        elif tok == V.ANSWER:
            view.answer, i = num(i)
        elif tok == V.SUMMARY:
            if i == n:
                view.summary_request = True
            elif V.is_digit(t[i]):
                n_, i = num(i)
                if i < n and t[i] == V.EQ:  # main: SUMMARY <i> = <v>
                    view.idx, (view.value, i) = n_, num(i + 1)
                else:  # sub-agent: SUMMARY <wrong answers so far>
                    view.wrongs = n_
    return view


class LedgerExpert(ScriptedPolicy):
    """Solves the ledger from the prompt alone; optional near-miss mistakes and delegation."""

    def __init__(self, modulus=10, mistake_prob=0.0, delegate_prob=0.0, max_mistakes=2, seed=0,
                 sub_mistakes=0):  # fmt: skip
        self.m, self.mistake_prob, self.delegate_prob = modulus, mistake_prob, delegate_prob
        self.max_mistakes, self.seed, self.sub_mistakes = max_mistakes, seed, sub_mistakes

    def program(self, request):
        view = read_ledger(request.prompt)
        if view.sub is not None:  # sub-agent: one operation
            if view.summary_request:
                return [*V.number(view.wrongs), V.EOS]
            v, op, a = view.sub
            d = apply_op(v, V.OP_IDS.index(op), a, self.m)
            if view.wrongs < self.sub_mistakes:  # wrong answers first: a multi-turn sub-agent
                d = (d + 1) % self.m
            return [V.ANSWER, *V.number(d), V.EOS]
        if view.summary_request:
            return [*V.number(view.idx), V.EQ, *V.number(view.value), V.EOS]
        i = view.idx + 1
        if view.answer is not None:
            return [V.COMMIT, *V.number(i), V.EQ, *V.number(view.answer), V.EOS]
        return self.turn(request, view, i)

    def turn(self, request, view: LedgerView, i: int) -> list[int]:
        op, a = view.ops[i]
        d = apply_op(view.value, V.OP_IDS.index(op), a, self.m)
        if self.mistake_prob or self.delegate_prob:
            u_delegate, u_mistake, u_sign = _key(request, self.seed).random(3)
            if u_delegate < self.delegate_prob:
                return [V.DELEGATE, *V.number(i), V.EOS]
            if view.wrongs < self.max_mistakes and u_mistake < self.mistake_prob:
                d = (d + (1 if u_sign < 0.5 else -1)) % self.m  # a near miss
        return [V.COMMIT, *V.number(i), V.EQ, *V.number(d), V.EOS]


class StallPolicy(LedgerExpert):
    """Expert up to step ``stop_after``, then re-commits that step forever (valid, no progress)."""

    def __init__(self, stop_after: int, **kw):
        super().__init__(**kw)
        self.stop_after = stop_after

    def turn(self, request, view, i):
        if view.idx >= self.stop_after:
            return [V.COMMIT, *V.number(view.idx), V.EQ, *V.number(view.value), V.EOS]
        return super().turn(request, view, i)


class WrongPolicy(LedgerExpert):
    """Always commits a wrong value for the next step (ends in failure)."""

    def turn(self, request, view, i):
        op, a = view.ops[i]
        d = (apply_op(view.value, V.OP_IDS.index(op), a, self.m) + 1) % self.m
        return [V.COMMIT, *V.number(i), V.EQ, *V.number(d), V.EOS]


class GarbagePolicy(ScriptedPolicy):
    """Emits an unparseable completion at the first attempt (every attempt when ``persistent``)
    at prompts whose CRC32 is divisible by ``period``; otherwise defers to ``inner``."""

    GARBAGE = (V.STEP, V.EOS)

    def __init__(self, inner: ScriptedPolicy, period=3, persistent=False):
        self.inner, self.period, self.persistent = inner, period, persistent
        self.seen: set = set()

    def program(self, request):
        crc = zlib.crc32(request.prompt.tobytes())
        key = (request.execution_id, request.prompt.size, crc)
        first = key not in self.seen
        self.seen.add(key)
        if crc % self.period == 0 and (first or self.persistent):
            return list(self.GARBAGE)
        return self.inner.program(request)


class FaultyEnv:
    """Wraps an environment; crashes or hangs the tool call at chosen (task, step) points.

    fault(task_id, n) -> 'crash' | 'hang' | None, where n counts completed main-state steps.
    Each faulty point fails ``times`` attempts, then works (``times`` large = persistent).
    """

    def __init__(self, env, fault, times=1, tool_timeout=0.01):
        self.env, self.fault, self.times = env, fault, times
        self.tool_timeout = tool_timeout
        self.attempts: dict = {}
        self.done_steps: dict = {}

    def __getattr__(self, name):
        return getattr(self.env, name)

    async def step(self, state, call, role):
        task = getattr(state, "task", None)
        if task is not None:
            n = self.done_steps.get(task.task_id, 0)
            kind = self.fault(task.task_id, n)
            key = (task.task_id, n)
            if kind and self.attempts.get(key, 0) < self.times:
                self.attempts[key] = self.attempts.get(key, 0) + 1
                if kind == "crash":
                    raise RuntimeError(f"injected env crash at {key}")
                await asyncio.Event().wait()  # hangs until the harness's tool limit
            self.done_steps[task.task_id] = n + 1
        return await self.env.step(state, call, role)
