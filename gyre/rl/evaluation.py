"""Held-out evaluation: which roles it needs, and the evaluation itself.

Evaluation runs on rollout cells. :func:`required_roles` says which roles a cell layout must
change to for it (the controller applies them like any allocation, so the timeline shows them);
:func:`evaluate` then runs the tasks through the harness, greedy or sampled.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from gyre.agent.context import AgentSettings
from gyre.agent.harness import run_executions
from gyre.envs.chat_env import tool_metrics
from gyre.metrics import standard_error

# Held-out tasks come from the task seed HELD_OUT_BASE + seed; training draws one task seed per
# step at random from (seed, step), so the two streams differ (a collision is possible in
# principle, with probability ~steps / 2**31).
HELD_OUT_BASE = 10**6


class Temperature:
    """A generate client that overrides the sampling temperature (greedy evaluation)."""

    def __init__(self, client, temperature: float):
        self.client, self.temperature = client, temperature

    async def generate(self, request):
        return await self.client.generate(
            dataclasses.replace(request, temperature=self.temperature)
        )

    def end_execution(self, execution_id: str) -> None:
        end_execution(self.client, execution_id)


def end_execution(client, execution_id: str) -> None:
    """Tells ``client`` (the proxy, through any wrappers here) that an execution ended; a
    client without ``end_execution`` (a test double) needs nothing."""
    end = getattr(client, "end_execution", None)
    if end is not None:
        end(execution_id)


async def run_ended(env, tasks: list, client, settings: AgentSettings) -> list:
    """:func:`gyre.agent.harness.run_executions`, telling the client as each execution ends,
    so the proxy's admission releases its reservation then."""
    return await run_executions(env, tasks, client, settings,
                                on_end=lambda eid: end_execution(client, eid))  # fmt: skip


def required_roles(roles: tuple[str, ...]) -> tuple[str, ...]:
    """``roles`` with at least one rollout cell (the core's neighbours stay as they are)."""
    if "rollout" in roles:
        return tuple(roles)
    return ("rollout",) + tuple(roles[1:])


async def evaluate(env, client, settings: AgentSettings, num_tasks: int, seed: int,
                   temperature: float = 0.0) -> dict:  # fmt: skip
    """Success and milestone rate on ``num_tasks`` held-out tasks keyed by ``seed``, greedy
    (temperature 0) or sampled. Sampling is keyed by execution, so every evaluation of one
    run draws the same random numbers: before/after differences are not sampling luck."""
    # held-out twice over: seeds no training step draws, and the environment's eval split
    # (disjoint problems, where it has them)
    tasks = env.make_tasks(HELD_OUT_BASE + seed, num_tasks, split="eval")
    res = await run_ended(env, tasks, Temperature(client, temperature), settings)
    success = np.asarray([r.end_reason == "success" for r in res], np.float64)
    milestones = np.asarray([r.milestones / max(1, r.num_milestones) for r in res])
    return {
        "eval_success": float(success.mean()),
        "eval_success_se": standard_error(success),
        "eval_milestones": float(milestones.mean()),
        "eval_milestones_se": standard_error(milestones),
        "eval_tasks": len(res),
        **tool_metrics(res, "eval_"),  # a chat task's tool use
        # per task, in task order: two evaluations of one run compare task by task
        "eval_outcomes": {"eval_success": success.tolist(), "eval_milestones": milestones.tolist()},
    }


class Notifying:
    """A generate client that calls ``notify()`` after every model call (the controller's
    decision point, the watchdog's beat)."""

    def __init__(self, client, notify):
        self.client, self.notify = client, notify

    async def generate(self, request):
        out = await self.client.generate(request)
        self.notify()
        return out

    def end_execution(self, execution_id: str) -> None:
        end_execution(self.client, execution_id)
