"""The controller: owns the cells, runs rollout and training over them, moves cells between roles.

One asyncio loop drives everything on the host:

- the proxy's pump task steps the rollout engines of the rollout cells;
- each dispatched step runs its executions through the harness (one coroutine per execution,
  grouped by task); when a task's group finishes it goes through the trajectory processor
  (trees, selection, advantages, packing) into the step's micro-batch queue at once, so
  training streams while other executions still roll out;
- the main loop asks the scheduler policy for an allocation at every decision point, applies
  it (a cell leaving rollout hands its live requests over through the proxy; a cell joining
  rollout gets the current weights), dispatches the next step when the policy allows (its
  staleness bound), and computes one micro-batch gradient at a time on a train cell;
- when a step's groups are all packed and trained, the gradients are rescaled to the step's
  loss normaliser (``normaliser_count``: exact, see tests/test_stream.py), summed on the core
  cell, applied, published to the rollout engines, checkpointed and logged.

On one CPU all of this interleaves on two cores, so wall-clock overlap between cells cannot
show here; the simulator measures it with the same policy functions.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import signal
import time

import jax
import numpy as np

from gyre import mesh
from gyre.agent.harness import run_executions
from gyre.config import ConfigError
from gyre.elastic import policy as policies
from gyre.elastic.progress import RoleTimeline, RunLedger, TraceWriter
from gyre.envs.base import Task
from gyre.model import decoder
from gyre.rollout.engine import Engine
from gyre.rollout.proxy import Proxy
from gyre.train.checkpoint import Checkpointer
from gyre.train.step import GradResult, Trainer, split_microbatches
from gyre.trajectory import ExecutionResult as TrajResult
from gyre.trajectory import build_batch
from gyre.trajectory.advantages import execution_score

log = logging.getLogger(__name__)

# Metric sums that are not linear in the loss coefficients (left unscaled when streaming).
_UNSCALED = ("version_lag_max", "tokens")


def signal_fraction(results, reward: str = "partial") -> float:
    """Fraction of task groups whose trained rewards differ (those that carry a signal).

    Samples of one task have ids '<task>/<k>'; ``reward`` is trajectory.reward (binary counts
    success only); infrastructure errors are never trained on and are left out.
    """
    groups = collections.defaultdict(set)
    for r in results:
        score = execution_score(r.end_reason, r.score or 0.0, reward=reward)
        group = groups[r.task.task_id.rsplit("/", 1)[0]]
        if score is not None:
            group.add(round(score, 9))
    return float(np.mean([len(v) > 1 for v in groups.values()])) if groups else 0.0


@dataclasses.dataclass
class StepWork:
    """One optimizer step's executions and training, from dispatch to update."""

    step: int
    version_at_dispatch: int
    groups_left: int
    dispatched_at: float
    results: list = dataclasses.field(default_factory=list)  # harness ExecutionResults
    reports: list = dataclasses.field(default_factory=list)  # trajectory BatchReports
    queue: collections.deque = dataclasses.field(default_factory=collections.deque)
    grads: list = dataclasses.field(default_factory=list)  # (part, GradResult)
    part_counts: list = dataclasses.field(default_factory=list)  # normaliser per part

    @property
    def ready(self) -> bool:
        return self.groups_left == 0 and not self.queue


class Notifying:
    """A generate client that wakes the controller after every model call (a decision point:
    live load changed)."""

    def __init__(self, client, controller):
        self.client, self.controller = client, controller

    async def generate(self, request):
        out = await self.client.generate(request)
        self.controller.wake.set()
        return out


class Temperature:
    """A generate client that overrides the sampling temperature (greedy evaluation)."""

    def __init__(self, client, temperature: float):
        self.client, self.temperature = client, temperature

    async def generate(self, request):
        return await self.client.generate(
            dataclasses.replace(request, temperature=self.temperature)
        )


def make_env(cfg):
    if cfg.env.name != "ledger":
        raise ConfigError(
            f"config key 'env.name' is {cfg.env.name!r}; the controller knows 'ledger'"
        )
    from gyre.envs.ledger import LedgerEnv

    env = LedgerEnv.from_config(cfg)
    if env.vocab_size != cfg.model.vocab_size:
        # A larger model vocabulary would sample ids the environment cannot read.
        raise ConfigError(
            f"config key 'model.vocab_size' ({cfg.model.vocab_size}) must equal the "
            f"{cfg.env.name} vocabulary ({env.vocab_size})"
        )
    return env


def step_tasks(env, cfg, step: int) -> list[Task]:
    """The tasks of one RL step: keyed by (seed, step) so a resumed run draws the same ones."""
    seed = int(np.random.default_rng([cfg.seed, step]).integers(2**31 - 1))
    return env.make_tasks(seed, cfg.run.tasks_per_step)


class Controller:
    """Runs ``cfg.run.steps`` RL steps under ``cfg.run.scheduler``; resumes from the workdir."""

    def __init__(self, cfg, workdir: str, params=None, policy_fn=None, keep_results=False):
        self.cfg, self.workdir = cfg, workdir
        self.history: list | None = [] if keep_results else None  # per step, for tests
        # Test hook: SIGKILL this process after N micro-batches (a kill at an arbitrary point).
        self._kill_after = int(os.environ.get("GYRE_KILL_AFTER_MICROBATCHES", "0"))
        self.cells = mesh.cells_from_config(cfg)
        self.env = make_env(cfg)
        self.policy = policy_fn or policies.POLICIES[cfg.run.scheduler]
        self.policy_params = policies.PolicyParams.from_run(cfg.run)
        self.graphdef, init_params = decoder.init_sharded(
            cfg.model, cfg.seed, self.cells[0], "train"
        )
        self.ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), cfg.train.keep_checkpoints)
        self.ledger = RunLedger(workdir)
        if self.ckpt.latest_step() is not None:
            self.trainer, meta = Trainer.restore(cfg, self.cells, self.graphdef, self.ckpt)
            self.ledger.truncate(self.trainer.version)
            log.info("resumed at version %d from %s", self.trainer.version, self.ckpt.directory)
        else:
            self.trainer = Trainer(
                cfg, self.cells, self.graphdef, init_params if params is None else params
            )
        self.engines = [
            Engine(cfg, cell, self.trainer.params_for(cell, "rollout"), self.trainer.version)
            for cell in self.cells
        ]
        self.proxy = Proxy(self.engines)
        self.proxy.latest_weights = (self.trainer.params, self.trainer.version)
        self.roles = ["rollout"] * len(self.cells)
        self.timeline = RoleTimeline(len(self.cells))
        self.trace = TraceWriter(os.path.join(workdir, "trace.jsonl"), cfg.agent.max_seconds)
        self.counters = collections.Counter()  # dispatched, started, finished
        self.steps: dict[int, StepWork] = {}
        self.next_step = self.trainer.version  # one optimizer step per RL step
        self.wake: asyncio.Event | None = None  # made inside the running loop
        self.handovers = collections.Counter()
        self._rr = 0

    # ------------------------------------------------------------------ policy and roles

    def snapshot(self) -> policies.LoadSnapshot:
        # Only the oldest step's micro-batches are trainable now (see train_one).
        oldest = self.steps[min(self.steps)].queue if self.steps else ()
        queue_tokens = sum(float(np.sum(mb.arrays["w"] > 0)) for _, mb in oldest)
        k = len(self.cells)
        live = tuple(
            self.engines[i].num_live if self.roles[i] == "rollout" else 0 for i in range(k)
        )
        return policies.LoadSnapshot(
            roles=tuple(self.roles),
            dispatched=self.counters["dispatched"],
            started=self.counters["dispatched"],
            finished=self.counters["finished"],
            live_requests=live,
            train_queue_tokens=queue_tokens,
            rollout_capacity=(float(self.cfg.rollout.slots),) * k,
            train_throughput=(1.0,) * k,
            switch_r2t_s=self.cfg.run.switch_cost_s,
            switch_t2r_s=self.cfg.run.switch_cost_s,
            step=self.next_step,
            weight_version=self.trainer.version,
            total_steps=self.cfg.run.steps,
            next_batch=self.cfg.run.tasks_per_step * self.cfg.run.samples_per_task,
        )

    def apply_roles(self, roles) -> None:
        for i, role in enumerate(roles):
            if role == self.roles[i]:
                continue
            if role == "train":
                moved = self.proxy.release(i, self.cfg.run.handover)
                self.handovers.update(moved)
            else:
                self.proxy.admit(i, self.trainer.params, self.trainer.version)
            self.roles[i] = role
            self.timeline.switch(i, role)

    # ------------------------------------------------------------------ rollout side

    def dispatch(self, step: int) -> None:
        tasks = step_tasks(self.env, self.cfg, step)
        n = self.cfg.run.samples_per_task
        work = StepWork(step, self.trainer.version, len(tasks), time.time())
        self.steps[step] = work
        self.counters["dispatched"] += len(tasks) * n
        for group, task in enumerate(tasks):
            asyncio.create_task(self._run_group(work, task, n, group))
        self.next_step = step + 1

    async def _run_group(self, work: StepWork, task: Task, n: int, group: int) -> None:
        async def one(k: int):
            # One execution per sample; ids '<task>/<k>#0' stay unique and keyed by identity.
            sample = dataclasses.replace(task, task_id=f"{task.task_id}/{k}")
            client = Notifying(self.proxy, self)
            start = self.timeline.now()
            (res,) = await run_executions(self.env, [sample], client, self.cfg)
            self.counters["finished"] += 1
            self.trace.record(res, work.step, group, start, self.timeline.now())
            self.wake.set()
            return res

        results = list(await asyncio.gather(*(one(k) for k in range(n))))
        work.results += results
        traj = [
            TrajResult(res.records, task.task_id, 0.0 if res.score is None else res.score)
            for res in results
            if res.records
        ]
        if traj:
            batch, report = build_batch(traj, self.cfg)
            work.reports.append(report)
            if report.used:
                part = len(work.part_counts)
                work.part_counts.append(report.normaliser)
                for mb in split_microbatches(batch, self.cfg.train.rows_per_microbatch):
                    work.queue.append((part, mb))
        work.groups_left -= 1
        self.wake.set()

    # ------------------------------------------------------------------ train side

    def train_one(self) -> bool:
        """Computes one queued micro-batch on the next train cell; False if nothing to do."""
        train_cells = [c for c in self.cells if self.roles[c.index] == "train"]
        if not train_cells:
            return False
        # Only the oldest step trains: a later step's gradient must be taken at the weights
        # its update is applied to, which exist once the older step's update lands.
        if self.steps:
            work = self.steps[min(self.steps)]
            if work.queue:
                part, mb = work.queue.popleft()
                cell = train_cells[self._rr % len(train_cells)]
                self._rr += 1
                t0 = time.time()
                res = self.trainer.compute_grads(cell, mb)
                self.timeline.busy(cell.index, time.time() - t0)
                if self._kill_after and self.trainer.microbatches_done >= self._kill_after:
                    os.kill(os.getpid(), signal.SIGKILL)
                work.grads.append((part, res))
                return True
        return False

    def finish_step(self, work: StepWork) -> dict:
        """Rescales part gradients to the step normaliser, updates on the core, publishes."""
        total = sum(work.part_counts)
        results = []
        for part, res in work.grads:
            s = work.part_counts[part] / total
            grads = jax.tree.map(lambda g, s=s: g * s, res.grads)
            metrics = {k: (v if k in _UNSCALED else v * s) for k, v in res.metrics.items()}
            results.append(GradResult(grads, metrics, res.cell_index, res.exec_ids))
        if results:
            outcome = self.trainer.apply_step(results)
        else:  # nothing trainable (e.g. all infra errors): same weights, next version
            outcome = None
            self.trainer.step += 1
            self.trainer.version += 1
        self.proxy.set_weights(self.trainer.params, self.trainer.version)
        del self.steps[work.step]
        if self.history is not None:
            self.history.append(work.results)
        return self._step_metrics(work, outcome)

    def _step_metrics(self, work: StepWork, outcome) -> dict:
        res = work.results
        scores = [r.score for r in res if r.score is not None]
        partial = [r.score for r in res if r.score is not None and r.end_reason != "success"]
        reasons = collections.Counter(r.end_reason for r in res)
        m = {
            "reward": float(np.mean(scores)) if scores else 0.0,
            "success": float(np.mean([r.end_reason == "success" for r in res])) if res else 0.0,
            "partial": float(np.mean(partial)) if partial else 0.0,
            "milestones": float(np.mean([r.milestones / max(1, r.num_milestones) for r in res])),
            "signal_groups": signal_fraction(res, self.cfg.trajectory.reward),
            "executions": len(res),
            "unique_tokens": sum(r.unique_tokens for r in work.reports),
            "flat_tokens": sum(r.flat_tokens for r in work.reports),
            "rejected": sum(len(r.rejected) for r in work.reports),
            "step_seconds": round(time.time() - work.dispatched_at, 3),
            "step": work.step,
            "version": self.trainer.version,
            "staleness": self.trainer.version - 1 - work.version_at_dispatch,
        }
        m.update({f"end_{k}": v for k, v in reasons.items()})
        m["dup_ratio"] = m["flat_tokens"] / max(1, m["unique_tokens"])
        m["generated_tokens"] = sum(int(r.completion.size) for x in res for r in x.records)
        m["generated_tokens_per_s"] = m["generated_tokens"] / max(m["step_seconds"], 1e-9)
        if outcome is not None:
            m.update({k: v for k, v in outcome.metrics.items() if np.isscalar(v)})
            m["applied"] = outcome.applied
        m.update(self.timeline.fractions(prefix="role_"))
        m.update({f"handover_{k}": v for k, v in self.handovers.items()})
        m["prefix_hit_rate"] = self.proxy.prefix_hit_rate()
        self.ledger.record_step(work.step, sorted(r.execution_id for r in res))
        return m

    # ------------------------------------------------------------------ evaluation

    async def evaluate(self, num_tasks: int, seed: int) -> dict:
        """Greedy success on held-out tasks (seeds disjoint from training's by construction)."""
        if "rollout" not in self.roles:
            self.apply_roles(["rollout"] + self.roles[1:])
        tasks = self.env.make_tasks(10**6 + seed, num_tasks)
        res = await run_executions(self.env, tasks, Temperature(self.proxy, 0.0), self.cfg)
        return {
            "eval_success": float(np.mean([r.end_reason == "success" for r in res])),
            "eval_milestones": float(
                np.mean([r.milestones / max(1, r.num_milestones) for r in res])
            ),
        }

    def evaluate_sync(self, params, num_tasks: int, seed: int) -> dict:
        """Greedy evaluation of ``params`` outside the RL loop (e.g. during the warm start)."""

        async def go():
            pump = asyncio.create_task(self.proxy.run())
            try:
                return await self.evaluate(num_tasks, seed)
            finally:
                pump.cancel()

        self.proxy.set_weights(params, self.trainer.version)
        return asyncio.run(go())

    def install(self, params) -> None:
        """Starts RL from ``params`` (e.g. the warm start) at version 0."""
        self.trainer = Trainer(self.cfg, self.cells, self.graphdef, params)
        self.proxy.set_weights(self.trainer.params, self.trainer.version)

    # ------------------------------------------------------------------ main loop

    async def run(self, on_step=None) -> list[dict]:
        """Runs until cfg.run.steps optimizer steps exist; ``on_step(metrics)`` after each."""
        self.wake = asyncio.Event()
        pump = asyncio.create_task(self.proxy.run())
        rows = []
        try:
            while self.trainer.version < self.cfg.run.steps:
                alloc = self.policy(self.snapshot(), self.policy_params)
                self.apply_roles(alloc.roles)
                if alloc.dispatch and self.next_step < self.cfg.run.steps:
                    self.dispatch(self.next_step)
                    continue
                ready = [w for w in self.steps.values() if w.ready]
                if ready:
                    metrics = self.finish_step(min(ready, key=lambda w: w.step))
                    every = self.cfg.run.eval_every
                    last = self.trainer.version == self.cfg.run.steps
                    if self.cfg.run.eval_tasks and (
                        last or (every and self.trainer.version % every == 0)
                    ):
                        metrics.update(await self.evaluate(self.cfg.run.eval_tasks, self.cfg.seed))
                    if last or self.trainer.version % self.cfg.train.checkpoint_every == 0:
                        t0 = time.time()
                        self.save()
                        metrics["checkpoint_seconds"] = round(time.time() - t0, 4)
                    rows.append(metrics)
                    if on_step is not None:
                        on_step(metrics)
                    continue
                if self.train_one():
                    await asyncio.sleep(0)  # let rollout progress between micro-batches
                    continue
                if not self.steps:
                    raise RuntimeError(
                        f"scheduler {self.cfg.run.scheduler!r} made no progress: roles "
                        f"{self.roles}, reason {alloc.reason!r}"
                    )
                self.wake.clear()
                await self.wake.wait()
        finally:
            pump.cancel()
        return rows

    def save(self) -> None:
        self.trainer.save(self.ckpt, {"next_step": self.trainer.version})
        self.ckpt.wait()
