"""The controller: schedules rollout and training over the cells, and hands finished steps on.

One asyncio loop drives everything on the host:

- the proxy's pump task steps the rollout engines of the rollout cells (a background task,
  gyre/rl/tasks.py: its error ends the run at once);
- each dispatched step runs its executions through the harness (gyre/rl/rollouts.py: one
  coroutine per execution, grouped by task); a finished group is packed into the step's
  micro-batch queue at once (gyre/rl/work.py), so training streams while other executions
  still roll out;
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

from gyre.elastic.policy import POLICIES, LoadSnapshot
from gyre.errors import CellLost
from gyre.rl import evaluation
from gyre.rl.evaluation import Notifying
from gyre.rl.measure import PoolCounters, RunFigures
from gyre.rl.progress import RoleTimeline
from gyre.rl.rollouts import Rollouts
from gyre.rl.tasks import Supervised
from gyre.rl.work import StepRecord, StepWork

_COUNTED = ("dispatched", "started", "finished", "timed_out")  # the snapshot's execution counts


class Controller:
    """Runs ``rt.specs.run.steps`` RL steps of the runtime ``rt`` (gyre/rl/builder.py),
    seeing its proxy and trainer only through their declared interfaces (gyre/rl/interfaces.py).

    scheduler_policy: shares the cells out (default: the configured one); timeline: the role
    time line; after_microbatch(count): called after every gradient (tests kill the run with it);
    should_stop(): asked after each step, True ends the loop there; on_progress(): called
    whenever something finishes (the watchdog's beat, gyre/watchdog.py).
    """

    def __init__(self, rt, scheduler_policy=None, timeline=None, after_microbatch=None,
                 should_stop=None, on_progress=None):  # fmt: skip
        self.rt, self.specs, self.trainer, self.proxy = rt, rt.specs, rt.trainer, rt.proxy
        self.scheduler_policy = scheduler_policy or POLICIES[self.specs.run.scheduler_policy]
        self.after_microbatch, self.should_stop = after_microbatch, should_stop or (lambda: False)
        self.on_progress = on_progress or (lambda: None)
        self.roles = ["rollout"] * len(rt.cells)
        self.timeline = timeline or RoleTimeline(len(rt.cells))
        self.timeline.set_all("rollout")
        self.wake = asyncio.Event()
        self.tasks = Supervised(lambda: self.wake.set())
        self.rollouts = Rollouts(rt, self.timeline, self.progress, self.tasks.start)
        self.handovers = collections.Counter()  # by path; and what lost cells cost
        self.steps: dict[int, StepWork] = {}
        self.next_step = self.trainer.version  # one optimizer step per RL step
        self._rr = 0  # round robin over the train cells
        self.figures = RunFigures(len(rt.cells), self.specs.run.seed_train_tps,
                                  self.specs.run.switch_cost_s)  # fmt: skip
        self.pools = PoolCounters(self.proxy.kv_stats())

    def progress(self) -> None:
        """Something finished: a decision point for the loop, a beat for the watchdog."""
        self.on_progress()
        self.wake.set()

    # ------------------------------------------------------------------ scheduling and roles

    def alive(self) -> list[int]:
        """Cell indices still in the run (a lost cell's process is gone: gyre/cluster/)."""
        return [i for i in range(len(self.roles)) if i not in self.proxy.lost]

    def oldest(self) -> StepWork | None:
        """The step being trained (a later step's gradients need the weights its update lands)."""
        return self.steps[min(self.steps)] if self.steps else None

    def snapshot(self) -> LoadSnapshot:
        """The scheduler policy's view of the cells still alive, every figure measured
        (gyre/rl/measure.py, the KV pools)."""
        run, alive, oldest = self.specs.run, self.alive(), self.oldest()
        pick = lambda xs: tuple(xs[i] for i in alive)
        live = self.proxy.live_requests()
        queued = oldest.queued_tokens if oldest else 0.0  # all trainable now: a part per group
        return LoadSnapshot(
            roles=pick(self.roles),
            **{k: self.rollouts.counters[k] for k in _COUNTED},
            live_requests=pick([n if r == "rollout" else 0 for n, r in zip(live, self.roles)]),
            train_queue_tokens=queued,
            trainable_tokens=queued,
            rolled_out=bool(oldest) and oldest.closable,
            rollout_tokens_per_s=self.rollouts.tokens_per_s(),
            rollout_capacity=pick(self.proxy.capacity_contexts()),
            train_throughput=pick(self.figures.train_throughput()),
            switch_r2t_s=self.figures.switch_r2t_s,
            switch_t2r_s=self.figures.switch_t2r_s,
            step=self.next_step,
            weight_version=self.trainer.version,
            total_steps=run.steps,
            next_batch=run.executions_per_step,
            **self.proxy.kv_room(alive),
        )

    def apply_roles(self, roles) -> None:
        """Switches cells to ``roles`` (one per cell still alive, in index order): a cell
        leaving rollout hands its live requests over, one joining gets the newest weights."""
        for i, role in zip(self.alive(), roles):
            if role == self.roles[i]:
                continue
            self.timeline.switch(i, "switch")
            t0 = time.perf_counter()  # a switch is timed until its rows or weights have landed
            if role == "train":
                self.handovers.update(self.proxy.release(i, self.specs.run.handover))
            else:
                self.proxy.admit(i, self.trainer.params, self.trainer.version)
            self.proxy.wait_ready(None if role == "train" else [i])  # moved rows, or weights
            seconds = time.perf_counter() - t0
            self.figures.record_switch("r2t" if role == "train" else "t2r", seconds)
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

    def dispatch(self, step: int) -> None:
        self.steps[step] = self.rollouts.dispatch(step, self.trainer.version)
        self.next_step = step + 1

    # ------------------------------------------------------------------ train side

    def train_one(self) -> bool:
        """Computes one queued micro-batch of the oldest step on the next train cell; False if
        there is nothing to do."""
        self._forget_lost()
        cells = [c for c in self.rt.cells if self.roles[c.index] == "train"]
        work = self.oldest()
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
        self.figures.time_microbatch(cell.index, mb.trainable_tokens, res.metrics, tick)
        self.timeline.busy(cell.index, time.time() - t0)
        self.progress()
        if self.after_microbatch is not None:
            self.after_microbatch(self.trainer.microbatches_done)
        return True

    def finish_step(self, work: StepWork) -> StepRecord:
        """Applies the step's update, publishes the new weights, returns the step's record."""
        outcome = self.trainer.apply_parts(work.grads, work.part_counts)
        self._forget_lost()
        self.handovers["lost_retried"] += self.proxy.take_lost_retried()
        self.proxy.set_weights(self.trainer.params, self.trainer.version)
        self.rollouts.carry(work.close(), self.steps.get(work.step + 1))
        del self.steps[work.step]
        return work.record(self.trainer.version, outcome, self.timeline.fractions(),
                           dict(self.handovers), self.proxy.prefix_hit_rate(),
                           self.pools.since_last(self.proxy.kv_stats()) | self.figures.as_metrics())  # fmt: skip

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
        self.wake, self.tasks.failure = asyncio.Event(), None  # a new loop: nothing carried over
        self.rollouts.open()
        self.tasks.start(self.proxy.run())
        steps = self.specs.run.steps
        try:
            while self.trainer.version < steps:
                self.tasks.check()
                alloc = self.scheduler_policy(self.snapshot(), self.specs.scheduler)
                self.apply_roles(alloc.roles)
                if alloc.dispatch and self.next_step < steps:
                    self.dispatch(self.next_step)
                    continue
                if self.oldest() is not None and self.oldest().ready:  # steps update in order
                    record = self.finish_step(self.oldest())
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
                    raise RuntimeError(f"scheduler {self.specs.run.scheduler_policy!r} made no progress: "
                                       f"roles {self.roles}, reason {alloc.reason!r}")  # fmt: skip
                self.wake.clear()
                await self.wake.wait()
        finally:
            self.figures.close()
            self.tasks.cancel()
        return True
