"""The controller: schedules rollout and training over the cells, and hands finished steps on.

One asyncio loop drives everything on the host:

- the proxy's pump task steps the rollout engines of the rollout cells;
- each dispatched step runs its executions through the harness (one coroutine per execution,
  grouped by task); a finished group is packed into the step's micro-batch queue at once
  (gyre/rl/work.py), so training streams while other executions still roll out;
- at every decision point the loop asks the scheduler policy for an allocation and applies it
  (a cell leaving rollout hands its live requests over through the proxy; a cell joining
  rollout gets the current weights), dispatches the next step when the policy allows (its
  staleness bound), and computes one micro-batch gradient at a time on a train cell;
- when a step's groups are all packed and trained, the trainer applies the update, the new
  weights are published to the engines, and the step's :class:`StepRecord` goes to
  ``on_step`` (metrics, evaluation, checkpoints and the ledger are the caller's business).

On one CPU all of this interleaves on two cores, so wall-clock overlap between cells cannot
show here; the simulator measures it with the same policy functions.
"""

from __future__ import annotations

import asyncio
import collections
import time

import jax
import numpy as np

from gyre.agent.harness import run_execution
from gyre.elastic import policy as policies
from gyre.errors import CellLost
from gyre.rl import evaluation
from gyre.rl.evaluation import Notifying
from gyre.rl.measure import PoolCounters, RunFigures
from gyre.rl.progress import RoleTimeline, TraceWriter
from gyre.rl.work import StepRecord, StepWork, step_tasks


class Controller:
    """Runs ``rt.specs.run.steps`` RL steps of the runtime ``rt`` (gyre/rl/builder.py).

    policy_fn: an allocation policy (default: the configured one); timeline: the run's role
    time line (default: a new one); after_microbatch: a hook called after every micro-batch
    gradient (tests use it to kill the run at a chosen point); should_stop: asked after each
    finished step, True ends the loop there (a requested stop); on_progress: called whenever
    something finishes (a model call, an execution, a micro-batch, a step: the run's watchdog
    beat, gyre/watchdog.py).
    """

    def __init__(self, rt, policy_fn=None, timeline=None, after_microbatch=None,
                 should_stop=None, on_progress=None):  # fmt: skip
        self.rt, self.specs, self.trainer, self.proxy = rt, rt.specs, rt.trainer, rt.proxy
        self.policy = policy_fn or policies.POLICIES[self.specs.run.policy]
        self.after_microbatch = after_microbatch
        self.should_stop = should_stop or (lambda: False)
        self.roles = ["rollout"] * len(rt.cells)
        self.timeline = timeline or RoleTimeline(len(rt.cells))
        self.timeline.set_all("rollout")
        self.trace = TraceWriter(rt.path("trace.jsonl"), self.specs.agent.max_seconds)
        self.counters = collections.Counter()  # dispatched, started, finished
        self.handovers = collections.Counter()  # by path; and what lost cells cost
        self._lost_retried = 0
        self.steps: dict[int, StepWork] = {}
        self.next_step = self.trainer.version  # one optimizer step per RL step
        self.wake = asyncio.Event()
        self.failure: BaseException | None = None  # the first error of a background task
        self._tasks: set[asyncio.Task] = set()
        self._rr = 0
        self.on_progress = on_progress or (lambda: None)
        run = self.specs.run
        self.figures = RunFigures(len(rt.cells), run.seed_train_tps, run.switch_cost_s)
        self.gate: asyncio.Semaphore | None = None  # agent.concurrency executions at a time
        self.pools = PoolCounters(self.proxy.kv_stats())

    def progress(self) -> None:
        """Something finished: a decision point for the loop, a beat for the watchdog."""
        self.on_progress()
        self.wake.set()

    def where(self) -> str:
        """Where the run stands, for the watchdog's message."""
        live = sum(e.num_live for e in self.proxy.engines.values())
        return (f"weights at version {self.trainer.version}, steps in flight {sorted(self.steps)}, "
                f"executions finished {self.counters['finished']} of "
                f"{self.counters['dispatched']} dispatched, {live} live model requests, "
                f"roles {self.roles}")  # fmt: skip

    # ------------------------------------------------------------------ policy and roles

    def alive(self) -> list[int]:
        """Cell indices still in the run (a lost cell's process is gone: gyre/cluster/)."""
        return [i for i in range(len(self.roles)) if i not in self.proxy.lost]

    def snapshot(self) -> policies.LoadSnapshot:
        """The policy's view of the cells still alive, every figure measured
        (gyre/rl/measure.py, the KV pools)."""
        # Only the oldest step's micro-batches are trainable now (see train_one).
        oldest = self.steps[min(self.steps)] if self.steps else None
        run = self.specs.run
        engines = self.proxy.engines  # by cell index
        alive = self.alive()
        pick = lambda xs: tuple(xs[i] for i in alive)
        live = tuple(engines[i].num_live if self.roles[i] == "rollout" else 0 for i in alive)
        return policies.LoadSnapshot(
            roles=pick(self.roles),
            dispatched=self.counters["dispatched"],
            started=self.counters["started"],
            finished=self.counters["finished"],
            live_requests=live,
            train_queue_tokens=oldest.queued_tokens if oldest else 0.0,
            rollout_capacity=pick(self.proxy.capacity_contexts()),
            train_throughput=pick(self.figures.train_throughput()),
            switch_r2t_s=self.figures.switch_r2t_s,
            switch_t2r_s=self.figures.switch_t2r_s,
            step=self.next_step,
            weight_version=self.trainer.version,
            total_steps=run.steps,
            next_batch=run.executions_per_step,
        )

    def apply_roles(self, roles) -> None:
        """Switches cells to ``roles`` (one per cell still alive, in index order)."""
        for i, role in zip(self.alive(), roles):
            if role == self.roles[i]:
                continue
            self.timeline.switch(i, "switch")
            t0 = time.perf_counter()
            if role == "train":
                self.handovers.update(self.proxy.release(i, self.specs.run.handover))
                jax.block_until_ready([e.cache for e in self.proxy.engines.values()])
                self.figures.record_switch("r2t", time.perf_counter() - t0)
            else:
                self.proxy.admit(i, self.trainer.params, self.trainer.version)
                engine = self.proxy.engines[i]
                jax.block_until_ready((engine.weights, engine.cache))  # the weights are loaded
                self.figures.record_switch("t2r", time.perf_counter() - t0)
            self.roles[i] = role
            self.timeline.switch(i, role)
        self._forget_lost()

    def _forget_lost(self) -> None:
        """Cells lost since the last look leave the time line (their work is redone)."""
        for i in self.proxy.lost:
            if self.roles[i] != "lost":
                self.roles[i] = "lost"
                self.timeline.switch(i, "lost")
                self.handovers["cells_lost"] += 1

    # ------------------------------------------------------------------ rollout side

    def dispatch(self, step: int) -> None:
        run = self.specs.run
        tasks = step_tasks(self.rt.env, run.seed, step, run.tasks_per_step)
        work = StepWork(step, self.trainer.version, len(tasks), time.time())
        self.steps[step] = work
        self.counters["dispatched"] += len(tasks) * run.samples_per_task
        for group, task in enumerate(tasks):
            self._start(self._run_group(work, task, group))
        self.next_step = step + 1

    def _start(self, coro) -> asyncio.Task:
        """A background task whose error ends the run at once (never a silent hang)."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self.failure is None:
            self.failure = task.exception()
            self.wake.set()

    async def _run_group(self, work: StepWork, task, group: int) -> None:
        client = Notifying(self.proxy, self.progress)

        async def one(k: int):
            async with self.gate:  # at most agent.concurrency executions run at once
                self.counters["started"] += 1
                start = self.timeline.now()
                # Sample k's id '<task>/<k>#0' keys its sampling: unique, and the same on resume.
                res = await run_execution(self.rt.env, task, client, self.specs.agent,
                                          f"{task.task_id}/{k}#0")  # fmt: skip
            self.counters["finished"] += 1
            self.trace.record(res, work.step, group, start, self.timeline.now())
            self.progress()
            return res

        results = await asyncio.gather(*(one(k) for k in range(self.specs.run.samples_per_task)))
        work.add_group(list(results), self.specs.trajectory)
        self.progress()

    # ------------------------------------------------------------------ train side

    def train_one(self) -> bool:
        """Computes one queued micro-batch on the next train cell; False if nothing to do."""
        self._forget_lost()
        cells = [c for c in self.rt.cells if self.roles[c.index] == "train"]
        # Only the oldest step trains: a later step's gradient must be taken at the weights
        # its update is applied to, which exist once the older step's update lands.
        work = self.steps[min(self.steps)] if self.steps else None
        if not cells or work is None or not work.queue:
            return False
        part, mb = work.queue.popleft()
        cell = cells[self._rr % len(cells)]
        self._rr += 1
        t0, tick = time.time(), self.figures.clock()
        try:
            res = self.trainer.compute_grads(cell, mb)
        except CellLost as e:
            if e.cell == 0:
                raise
            work.queue.appendleft((part, mb))  # computed again on a cell still alive
            self.handovers["microbatches_redone"] += 1
            self.proxy.lose(cell.index)
            self.progress()
            return True
        work.grads.append((part, res))
        self.figures.time_microbatch(cell.index, float(np.sum(mb.arrays["w"] > 0)), res.metrics,
                                     tick)  # fmt: skip
        self.timeline.busy(cell.index, time.time() - t0)
        self.progress()
        if self.after_microbatch is not None:
            self.after_microbatch(self.trainer.microbatches_done)
        return True

    def finish_step(self, work: StepWork) -> StepRecord:
        """Applies the step's update, publishes the new weights, returns the step's record."""
        outcome = self.trainer.apply_parts(work.grads, work.part_counts)
        self._forget_lost()
        retried = self.proxy.stats["lost_retried"]  # calls of lost cells, retried elsewhere
        if retried > self._lost_retried:
            self.handovers["lost_retried"] += retried - self._lost_retried
            self._lost_retried = retried
        self.proxy.set_weights(self.trainer.params, self.trainer.version)
        del self.steps[work.step]
        return StepRecord(
            work.step, self.trainer.version, work.version_at_dispatch,
            time.time() - work.dispatched_at, work.results, work.reports, outcome,
            self.timeline.fractions(), dict(self.handovers), self.proxy.prefix_hit_rate(),
            self.pools.since_last(self.proxy.kv_stats()) | self.figures.as_metrics(),
        )  # fmt: skip

    # ------------------------------------------------------------------ evaluation

    async def evaluate(self, num_tasks: int, seed: int, temperature: float = 0.0) -> dict:
        """Held-out evaluation, on the roles it declares (gyre/rl/evaluation.py)."""
        self.apply_roles(evaluation.required_roles(tuple(self.roles[i] for i in self.alive())))
        roles = self.timeline.set_all("eval")
        try:
            client = Notifying(self.proxy, self.progress)
            return await evaluation.evaluate(self.rt.env, client, self.specs.agent,
                                             num_tasks, seed, temperature)  # fmt: skip
        finally:
            for i, role in enumerate(roles):
                self.timeline.switch(i, role)

    # ------------------------------------------------------------------ main loop

    async def run(self, on_step=None) -> bool:
        """Runs until run.steps optimizer steps exist, or a requested stop after a step;
        ``await on_step(record)`` after each step. -> whether every step ran."""
        self.wake = asyncio.Event()
        self.gate = asyncio.Semaphore(self.specs.agent.concurrency)
        pump = self._start(self.proxy.run())
        steps = self.specs.run.steps
        try:
            while self.trainer.version < steps:
                if self.failure is not None:
                    raise self.failure
                alloc = self.policy(self.snapshot(), self.specs.policy)
                self.apply_roles(alloc.roles)
                if alloc.dispatch and self.next_step < steps:
                    self.dispatch(self.next_step)
                    continue
                ready = [w for w in self.steps.values() if w.ready]
                if ready:
                    record = self.finish_step(min(ready, key=lambda w: w.step))
                    self.progress()
                    if on_step is not None:
                        await on_step(record)
                    if self.should_stop() and self.trainer.version < steps:
                        return False
                    continue
                if self.train_one():
                    await asyncio.sleep(0)  # let rollout progress between micro-batches
                    continue
                if not self.steps:
                    raise RuntimeError(
                        f"scheduler {self.specs.run.policy!r} made no progress: roles "
                        f"{self.roles}, reason {alloc.reason!r}"
                    )
                self.wake.clear()
                await self.wake.wait()
        finally:
            self.figures.close()
            for task in [pump, *self._tasks]:
                task.cancel()
        return True
