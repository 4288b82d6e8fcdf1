"""The rollout side of the RL loop: a step's executions, run, counted, traced and packed.

:meth:`Rollouts.dispatch` starts one coroutine per execution through the agent harness,
grouped by task (the samples of one task are one advantage group); at most
``agent.concurrency`` executions run at once; the proxy hears of each execution's end
(:meth:`gyre.rollout.proxy.Proxy.end_execution`, its admission's reservation). A finished group is packed into its step's
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
    """Executions of the runtime ``rt`` (specs, environment, proxy); ``counters`` holds
    dispatched, started and finished (the scheduler policy's view of the rollout work).
    on_progress() after every model call, execution and group; start(coro) runs a
    background task (gyre/rl/tasks.py)."""

    def __init__(self, rt, timeline, on_progress, start):
        self.specs, self.env, self.timeline = rt.specs, rt.env, timeline
        self.client = Notifying(rt.proxy, on_progress)
        self.on_progress, self.start = on_progress, start
        self.trace = TraceWriter(rt.path("trace.jsonl"), rt.specs.agent.max_seconds)
        self.counters = collections.Counter()
        self.packed_tokens = 0.0  # trainable tokens of every group packed so far
        self.first_start: float | None = None  # when the first execution started
        self.gate: asyncio.Semaphore | None = None

    def open(self) -> None:
        """Binds to the running event loop (call at the start of each loop): a new gate."""
        self.gate = asyncio.Semaphore(self.specs.agent.concurrency)

    def tokens_per_s(self) -> float:
        """Measured rate at which rollout hands training tokens: trainable tokens packed so far
        over the seconds since the first execution started (0 until a group is packed)."""
        if self.first_start is None or not self.packed_tokens:
            return 0.0
        return self.packed_tokens / max(time.monotonic() - self.first_start, 1e-9)

    def dispatch(self, step: int, version: int) -> StepWork:
        """Starts step ``step``'s executions (its tasks keyed by the run seed and the step)
        under weights ``version`` -> the step's work, filled as its groups finish."""
        run = self.specs.run
        if self.gate is None:  # dispatched outside Controller.run (tests): bind now
            self.open()
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
                if self.first_start is None:
                    self.first_start = time.monotonic()
                start = self.timeline.now()
                # Sample k's id '<task>/<k>#0' keys its sampling: unique, and the same on resume.
                eid = f"{task.task_id}/{k}#0"
                try:
                    res = await run_execution(self.env, task, self.client, self.specs.agent, eid)
                finally:  # ended, failed or cancelled: its KV reservation goes
                    self.client.end_execution(eid)
            self.counters["finished"] += 1
            self.trace.record(res, work.step, group, start, self.timeline.now())
            self.on_progress()
            return res

        results = await asyncio.gather(*(one(k) for k in range(self.specs.run.samples_per_task)))
        self.packed_tokens += work.add_group(list(results), self.specs.trajectory)
        self.on_progress()
