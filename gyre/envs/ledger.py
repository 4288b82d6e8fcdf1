"""The ledger task: a start value and K arithmetic steps modulo m, each committed by a tool call.

Token format (see gyre/envs/vocab.py; numbers are digit runs, indices are 1-based):
  task prefix   BOS TASK <K> START <v0>
  listing       STEP <i> <op> <a>  for the next ``header_ops`` uncommitted steps
  main turn     COMMIT <i> = <d> EOS  |  DELEGATE <i> EOS
  observation   OK [STEP ... newly listed steps]  |  WRONG  |  ANSWER <d> (after a delegate)
  sub-agent     prompt BOS SUB <v> <op> <a>; turn ANSWER <d> EOS; observation OK | WRONG
  summary       SUMMARY <i> = <v> <listing>  (i = last step of the committed prefix);
                a sub-agent's is SUMMARY <number of wrong answers so far>

With K <= header_ops the whole chain is listed in the header, with step-index tokens (the
format a tiny model learns: BENCHMARKS.md, "RL on the ledger task"); a longer chain keeps a sliding window of
``header_ops`` listed steps, so a compacted context stays small for any K.

Milestones are DISTINCT correct steps (re-committing a step farms nothing). A WRONG commit
stays in the context; more than ``max_wrong`` of them ends the execution as a failure. A
commit with an impossible index or value is a tool error (the harness retries it).
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np

from gyre.envs import vocab as V
from gyre.envs.base import Environment, StepResult, Task, ToolCall
from gyre.envs.grammar import NUM, parse_first

ADD, SUB_OP, MUL = 0, 1, 2


def apply_op(value: int, op: int, arg: int, modulus: int) -> int:
    if op == ADD:
        return (value + arg) % modulus
    if op == SUB_OP:
        return (value - arg) % modulus
    return (value * arg) % modulus


@dataclasses.dataclass
class LedgerState:
    """Mutable main state. ops/args/values: int[K]; values[i-1] is the true value after step i."""

    task: Task
    start: int
    ops: np.ndarray
    args: np.ndarray
    values: np.ndarray
    done: np.ndarray
    num_done: int = 0
    next_step: int = 1  # first uncommitted step
    wrong: int = 0
    rng: np.random.Generator | None = None  # tool latencies

    def value_before(self, step: int) -> int:
        return self.start if step == 1 else int(self.values[step - 2])


@dataclasses.dataclass
class SubState:
    """A delegated single operation."""

    parent: LedgerState
    step: int
    value: int
    wrong: int = 0
    answer: int | None = None


class LedgerEnv(Environment):
    """See the module docstring. latency: mean seconds of a tool call (0 = instant)."""

    vocab_size = V.VOCAB_SIZE
    stop_tokens = (V.EOS,)

    def render_tokens(self, tokens):
        return V.decode(tokens)

    def __init__(self, num_ops=8, modulus=10, header_ops=64, max_wrong=2, latency=0.0,
                 latency_dist="lognormal", tool_timeout=30.0):  # fmt: skip
        if num_ops < 1 or modulus < 2 or header_ops < 1 or max_wrong < 0:
            raise ValueError(
                f"LedgerEnv needs num_ops>=1, modulus>=2, header_ops>=1, max_wrong>=0; got "
                f"{num_ops}, {modulus}, {header_ops}, {max_wrong}"
            )
        if latency_dist not in ("lognormal", "pareto"):
            raise ValueError(f"latency_dist must be 'lognormal' or 'pareto', got {latency_dist!r}")
        self.num_ops, self.modulus, self.header_ops = num_ops, modulus, header_ops
        self.max_wrong, self.latency, self.latency_dist = max_wrong, latency, latency_dist
        self.tool_timeout = tool_timeout

    def make_tasks(self, seed: int, n: int, split: str = "train") -> list[Task]:
        del split  # held-out tasks come from held-out seeds (gyre/rl/evaluation.py)
        seeds = np.random.default_rng(seed).integers(0, 2**31 - 1, size=n)
        return [Task(f"ledger-{seed}-{j}", int(s)) for j, s in enumerate(seeds)]

    # ---- state -------------------------------------------------------------------------
    def reset(self, task: Task) -> LedgerState:
        rng = np.random.default_rng(task.seed)
        m, k = self.modulus, self.num_ops
        start = int(rng.integers(m))
        ops = rng.integers(3, size=k)
        hi = min(m, 10)  # one-digit arguments
        args = np.where(ops == MUL, rng.integers(2, hi, size=k), rng.integers(1, hi, size=k))
        values = np.empty(k, np.int64)
        v = start
        for i in range(k):
            v = apply_op(v, int(ops[i]), int(args[i]), m)
            values[i] = v
        return LedgerState(task, start, ops, args, values, np.zeros(k, bool),
                           rng=np.random.default_rng([task.seed, 1]))  # fmt: skip

    def listing(self, state: LedgerState, first: int, last: int) -> list[int]:
        toks: list[int] = []
        for j in range(first, min(last, self.num_ops) + 1):
            toks += [V.STEP, *V.number(j), V.OP_IDS[state.ops[j - 1]], *V.number(state.args[j - 1])]
        return toks

    def task_prompt(self, state):
        return np.asarray([V.BOS, V.TASK, *V.number(self.num_ops), V.START,
                           *V.number(state.start)], np.int32)  # fmt: skip

    def initial_obs(self, state):
        return np.asarray(self.listing(state, 1, self.header_ops), np.int32)

    def milestones(self, state):
        return state.num_done, self.num_ops

    # ---- grammar -----------------------------------------------------------------------
    def parse(self, completion, role):
        if role == "main":
            patterns = {"commit": (V.COMMIT, NUM, V.EQ, NUM), "delegate": (V.DELEGATE, NUM)}
        elif role == "sub-agent":
            patterns = {"answer": (V.ANSWER, NUM)}
        elif role == "main-summary":
            patterns = {"summary": (NUM, V.EQ, NUM)}
        else:  # sub-agent-summary: the number of wrong answers so far
            patterns = {"summary": (NUM,)}
        found = parse_first(completion, V.EOS, patterns)
        return None if found is None else ToolCall(*found)

    # ---- tools -------------------------------------------------------------------------
    def sample_latency(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """float64[n] tool latencies in seconds with mean ``latency`` and a heavy right tail."""
        if self.latency <= 0:
            return np.zeros(n)
        if self.latency_dist == "lognormal":  # sigma 1
            return rng.lognormal(np.log(self.latency) - 0.5, 1.0, size=n)
        return self.latency / 3.0 * (1.0 + rng.pareto(1.5, size=n))  # alpha 1.5: infinite variance

    async def _latency(self, state: LedgerState) -> None:
        if self.latency > 0:
            await asyncio.sleep(float(self.sample_latency(state.rng, 1)[0]))

    async def step(self, state, call: ToolCall, role: str) -> StepResult:
        main = state if isinstance(state, LedgerState) else state.parent
        await self._latency(main)
        if isinstance(state, SubState):
            return self._answer(state, call)
        if call.name == "commit":
            return self._commit(state, *call.args)
        if call.name == "delegate":
            (i,) = call.args
            if i != state.next_step:  # only the next uncommitted step can be delegated
                return StepResult("error", [V.ERROR])
            sub = SubState(state, i, state.value_before(i))
            prompt = [V.BOS, V.SUB, *V.number(sub.value), V.OP_IDS[state.ops[i - 1]],
                      *V.number(state.args[i - 1])]  # fmt: skip
            return StepResult("spawn", [], sub_prompt=np.asarray(prompt, np.int32), sub_state=sub)
        return StepResult("error", [V.ERROR])

    def _commit(self, state: LedgerState, i: int, d: int) -> StepResult:
        if not (1 <= i <= self.num_ops and 0 <= d < self.modulus):
            return StepResult("error", [V.ERROR])
        if d != state.values[i - 1]:
            state.wrong += 1
            return StepResult("fail" if state.wrong > self.max_wrong else "ok", [V.WRONG])
        obs = [V.OK]
        if not state.done[i - 1]:
            state.done[i - 1] = True
            state.num_done += 1
            old = state.next_step
            while state.next_step <= self.num_ops and state.done[state.next_step - 1]:
                state.next_step += 1
            h = self.header_ops  # slide the listed window to cover the new next step
            obs += self.listing(state, old + h, state.next_step + h - 1)
        return StepResult("done" if state.num_done == self.num_ops else "ok", obs)

    def _answer(self, sub: SubState, call: ToolCall) -> StepResult:
        if call.name != "answer" or not 0 <= call.args[0] < self.modulus:
            return StepResult("error", [V.ERROR])
        sub.answer = call.args[0]
        if sub.answer == sub.parent.values[sub.step - 1]:
            return StepResult("done", [V.OK])
        sub.wrong += 1
        return StepResult("fail" if sub.wrong > self.max_wrong else "ok", [V.WRONG])

    def deliver(self, state, sub_state, succeeded):
        if not succeeded or sub_state.answer is None:
            return np.asarray([V.ERROR], np.int32)
        return np.asarray([V.ANSWER, *V.number(sub_state.answer)], np.int32)

    # ---- compaction --------------------------------------------------------------------
    def summary(self, state, role):
        if isinstance(state, SubState):  # how many wrong answers so far
            return np.asarray([V.SUMMARY, *V.number(state.wrong)], np.int32)
        last = state.next_step - 1
        head = [V.SUMMARY, *V.number(last), V.EQ, *V.number(state.value_before(last + 1))]
        return np.asarray(head + self.listing(state, last + 1, last + self.header_ops), np.int32)

    def summary_request(self, role):
        return np.asarray([V.SUMMARY], np.int32)

    def resume_obs(self, state, role):
        if isinstance(state, SubState):
            return np.zeros(0, np.int32)
        return np.asarray(
            self.listing(state, state.next_step, state.next_step + self.header_ops - 1), np.int32
        )
