"""The rollout side of the RL loop: a step's executions, run, counted, traced and packed.

:meth:`Rollouts.dispatch` starts one coroutine per execution through the agent harness,
grouped by task (the samples of one task are one advantage group); at most
``agent.concurrency`` executions run at once. A finished group is packed into its step's
micro-batch queue at once (:meth:`gyre.rl.work.StepWork.add_group`), so training streams
while other groups still roll out.
"""

from __future__ import annotations

import asyncio
import collections
import time

from gyre.agent.harness import run_execution
from gyre.rl.evaluation import Notifying
from gyre.rl.progress import TraceWriter
from gyre.rl.work import StepWork, step_tasks


class Rollouts:
    """Executions of the run ``specs`` over ``proxy``; ``counters`` holds dispatched,
    started and finished (the policy's view of the rollout work). on_progress() after every
    model call, execution and group; start(coro) runs a background task (gyre/rl/tasks.py)."""

    def __init__(self, specs, env, proxy, timeline, trace_path: str, on_progress, start):
        self.specs, self.env, self.timeline = specs, env, timeline
        self.client = Notifying(proxy, on_progress)
        self.on_progress, self.start = on_progress, start
        self.trace = TraceWriter(trace_path, specs.agent.max_seconds)
        self.counters = collections.Counter()
        self.gate: asyncio.Semaphore | None = None

    def dispatch(self, step: int, version: int) -> StepWork:
        """Starts step ``step``'s executions (its tasks keyed by the run seed and the step)
        under weights ``version`` -> the step's work, filled as its groups finish."""
        run = self.specs.run
        if self.gate is None:  # made inside the running event loop
            self.gate = asyncio.Semaphore(self.specs.agent.concurrency)
        tasks = step_tasks(self.env, run.seed, step, run.tasks_per_step)
        work = StepWork(step, version, len(tasks), time.time())
        self.counters["dispatched"] += len(tasks) * run.samples_per_task
        for group, task in enumerate(tasks):
            self.start(self._run_group(work, task, group))
        return work

    async def _run_group(self, work: StepWork, task, group: int) -> None:
        async def one(k: int):
            async with self.gate:
                self.counters["started"] += 1
                start = self.timeline.now()
                # Sample k's id '<task>/<k>#0' keys its sampling: unique, and the same on resume.
                res = await run_execution(self.env, task, self.client, self.specs.agent,
                                          f"{task.task_id}/{k}#0")  # fmt: skip
            self.counters["finished"] += 1
            self.trace.record(res, work.step, group, start, self.timeline.now())
            self.on_progress()
            return res

        results = await asyncio.gather(*(one(k) for k in range(self.specs.run.samples_per_task)))
        work.add_group(list(results), self.specs.trajectory)
        self.on_progress()
