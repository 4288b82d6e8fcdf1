"""The rollout side of the RL loop: a step's executions, run, counted, traced and packed.

:meth:`Rollouts.dispatch` starts one coroutine per execution through the agent harness,
grouped by task (the samples of one task are one advantage group); at most
``agent.concurrency`` executions run at once; the proxy hears of each execution's end
(:meth:`gyre.rollout.proxy.Proxy.end_execution`, its admission's reservation). A finished group is packed into its step's
micro-batch queue at once (:meth:`gyre.rl.work.StepWork.finish`), so training streams
while other groups still roll out; with carry-over the step that owns the group when it
finishes packs it (a group carried over is owned by a later step).
"""

from __future__ import annotations

import asyncio
import collections
import time

from gyre.agent.harness import run_execution
from gyre.rl.evaluation import Notifying
from gyre.rl.progress import TraceWriter
from gyre.rl.work import Group, StepWork, step_tasks


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
        self.carried: list[Group] = []  # carried over to the step not yet dispatched
        self.restart: list[Group] = []  # untrained at a resume, started by open()

    def carry(self, groups: list[Group], work: StepWork | None) -> None:
        """A closed step's running ``groups`` go to ``work``, the next step (None: not yet
        dispatched; its dispatch takes them)."""
        if work is None:
            self.carried += groups
            return
        for g in groups:
            self.packed_tokens += work.own(g, self.specs.trajectory)

    def restart_untrained(self, version: int, trained: set) -> int:
        """On resume at ``version``: the groups of the last ``max_carry`` steps that no
        trained step holds (``trained``: their (step, index) keys from the ledger) were
        carried over and running at the kill; they run again from their start (at the next
        :meth:`open`), carried to step ``version``. -> how many."""
        sched, run = self.specs.scheduler, self.specs.run
        if sched.close_share >= 1:
            return 0
        self.restart = [Group(s, i, task, carried=version - s)
                        for s in range(max(0, version - sched.max_carry), version)
                        for i, task in enumerate(step_tasks(self.env, run.seed, s,
                                                            run.tasks_per_step))
                        if (s, i) not in trained]  # fmt: skip
        return len(self.restart)

    def open(self) -> None:
        """Binds to the running event loop (call at the start of each loop): a new gate; the
        groups a resume found untrained start again."""
        self.gate = asyncio.Semaphore(self.specs.agent.concurrency)
        restart, self.restart = self.restart, []
        self.start_groups(restart)
        self.carried += restart

    def tokens_per_s(self) -> float:
        """Measured rate at which rollout hands training tokens: trainable tokens packed so far
        over the seconds since the first execution started (0 until a group is packed)."""
        if self.first_start is None or not self.packed_tokens:
            return 0.0
        return self.packed_tokens / max(time.monotonic() - self.first_start, 1e-9)

    def dispatch(self, step: int, version: int) -> StepWork:
        """Starts step ``step``'s executions (its tasks keyed by the run seed and the step)
        under weights ``version`` -> the step's work, filled as its groups finish; the groups
        carried over to it from earlier steps become its own too."""
        run, sched = self.specs.run, self.specs.scheduler
        tasks = step_tasks(self.env, run.seed, step, run.tasks_per_step)
        last = step == run.steps - 1  # the last step waits for everything
        work = StepWork(step, version, len(tasks), time.time(), need=sched.close_need(len(tasks), last),
                        max_carry=0 if last else sched.max_carry,
                        count_carried=sched.close_on == "owned")  # fmt: skip
        for g in self.carried:
            self.packed_tokens += work.own(g, self.specs.trajectory)
        self.carried = []
        self.start_groups([Group(step, i, task) for i, task in enumerate(tasks)], work)
        return work

    def start_groups(self, groups: list[Group], work: StepWork | None = None) -> None:
        """Runs ``groups``' executions, owned by ``work`` (None: carried, owned later)."""
        if self.gate is None:  # dispatched outside Controller.run (tests): bind now
            self.open()
        self.counters["dispatched"] += len(groups) * self.specs.run.samples_per_task
        for g in groups:
            if work is not None:
                work.own(g, self.specs.trajectory)
            self.start(self._run_group(g))

    async def _run_group(self, g: Group) -> None:
        task = g.task

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
            self.counters["timed_out"] += res.end_reason == "timeout"
            self.trace.record(res, g.step, g.index, start, self.timeline.now())
            self.on_progress()
            return res

        results = await asyncio.gather(*(one(k) for k in range(self.specs.run.samples_per_task)))
        if g.work is None:  # carried to a step not yet dispatched: packed when it is
            g.results = list(results)
        else:
            self.packed_tokens += g.work.finish(g, list(results), self.specs.trajectory)
        self.on_progress()
