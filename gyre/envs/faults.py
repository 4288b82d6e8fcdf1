"""Fault injection: an environment whose tool calls crash or hang at a given rate.

``env.fault_rate`` > 0 wraps the configured environment (gyre/envs/registry.py). Each tool
call attempt draws from a generator keyed by (seed, task id, the state's kind, the attempt
number on that state, the call itself), so a run and its resumed copy see the same faults. A crash raises before the
real tool runs and a hang waits until the harness's tool limit (``env.tool_timeout``) cancels
it: neither touches the environment's state, so the harness's retry (gyre/agent/harness.py,
``agent.infra_retries``) continues the execution exactly as if the fault had not happened.
Only an execution whose retries run out ends as ``infra_error``, which is never trained on.
"""

from __future__ import annotations

import asyncio
import hashlib
import weakref

import numpy as np


class InjectedFault(RuntimeError):
    """A crash injected by :class:`FaultyTools` (an infrastructure error by design)."""


def _key(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


class FaultyTools:
    """Wraps ``env``; each tool call attempt crashes (half the faults) or hangs (the other
    half) with probability ``rate``. Everything else is the wrapped environment's."""

    def __init__(self, env, rate: float, seed: int):
        if not 0.0 <= rate < 1.0:
            raise ValueError(f"env.fault_rate must be in [0, 1), got {rate}")
        self.env, self.rate, self.seed = env, float(rate), int(seed)
        self.counts = {"crash": 0, "hang": 0}
        # attempts per live state (an execution's main state or a sub-agent's), by identity
        # (states are mutable, so unhashable); an entry goes when its state is collected
        self._attempts: dict[int, int] = {}

    def __getattr__(self, name):
        return getattr(self.env, name)

    def _draw(self, state, call) -> str | None:
        n = self._attempts.get(id(state), 0)
        if n == 0:
            weakref.finalize(state, self._attempts.pop, id(state), None)
        self._attempts[id(state)] = n + 1
        task = getattr(state, "task", None) or getattr(getattr(state, "parent", None), "task", None)
        # Nothing here names the sample: samples of one task that make the same call at the
        # same attempt see the same fault; their calls differ once their completions do.
        ident = (f"{self.seed}/{getattr(task, 'task_id', '')}/{type(state).__name__}/{n}/"
                 f"{call.name}/{call.args!r}")  # fmt: skip
        u = np.random.default_rng(_key(ident)).random(2)
        if u[0] >= self.rate:
            return None
        return "crash" if u[1] < 0.5 else "hang"

    async def step(self, state, call, role):
        kind = self._draw(state, call)
        if kind is not None:
            self.counts[kind] += 1
            if kind == "crash":
                raise InjectedFault(f"injected tool crash ({call.name})")
            await asyncio.Event().wait()  # hangs until the harness's tool limit cancels it
        return await self.env.step(state, call, role)
