"""One RL step's work from dispatch to update, and the step's metrics as a pure function.

A step's executions finish group by group (the samples of one task); each finished group goes
through the packing pipeline at once (:meth:`StepWork.add_group`), so training streams while
other groups still roll out. Every group is one *part* of the step with its own loss
normaliser; the trainer rescales the parts' gradients to the whole step's normaliser
(:meth:`gyre.train.step.Trainer.apply_parts`).

Carry-over (``PolicyParams.close_share`` < 1): a step may close once that share of its own
groups has finished (close_on "owned": as many of the groups it trains, carried-in ones
included); its groups still running are handed to the next step
(:meth:`StepWork.close`) and packed there when they finish, so every group is trained by
exactly one step, the one that owns it when it finishes (the ledger names each step's
groups: a resumed run re-runs the groups it finds untrained).
"""

from __future__ import annotations

import collections
import dataclasses
import time

import numpy as np

from gyre.envs.base import Task
from gyre.metrics import standard_error
from gyre.train.step import StepOutcome, split_microbatches
from gyre.trajectory.advantages import execution_score
from gyre.trajectory.batch import ExecutionResult, TrajectorySpec, build_batch


def step_tasks(env, seed: int, step: int, num_tasks: int) -> list[Task]:
    """The tasks of one RL step: keyed by (seed, step) so a resumed run draws the same ones."""
    task_seed = int(np.random.default_rng([seed, step]).integers(2**31 - 1))
    return env.make_tasks(task_seed, num_tasks)


@dataclasses.dataclass(eq=False)
class Group:
    """One task's samples (an advantage group), dispatched with step ``step`` as its
    ``index``-th task; ``work``: the step that will train it (None while carried to a step
    not yet dispatched); ``carried``: steps it was carried over; ``results``: its executions
    once finished, kept here while it has no owner."""

    step: int
    index: int
    task: Task
    work: StepWork | None = None
    carried: int = 0
    results: list | None = None

    @property
    def key(self) -> tuple[int, int]:
        return (self.step, self.index)


@dataclasses.dataclass
class StepWork:
    """One optimizer step's executions and training, from dispatch to update.

    need: own groups that must finish before the step may close (all of them, or
    ceil(close_share x groups) with carry-over); count_carried: carried-in groups that finish
    here count towards ``need`` too (close_on "owned"); max_carry: steps a group may be
    carried (a group that reached it must finish here)."""

    step: int
    version_at_dispatch: int
    num_groups: int
    dispatched_at: float
    need: int = -1  # -1: every own group
    max_carry: int = 1
    count_carried: bool = False
    results: list = dataclasses.field(default_factory=list)  # ExecutionResults
    reports: list = dataclasses.field(default_factory=list)  # BatchReports, one per group
    queue: collections.deque = dataclasses.field(default_factory=collections.deque)
    grads: list = dataclasses.field(default_factory=list)  # (part, GradResult)
    part_counts: list = dataclasses.field(default_factory=list)  # normaliser per part
    open_groups: set = dataclasses.field(default_factory=set)  # owned, still running
    own_done: int = 0  # groups finished that count towards ``need``
    groups: list = dataclasses.field(default_factory=list)  # keys of the groups trained here
    carried_in: int = 0  # groups carried into this step

    def __post_init__(self):
        if self.need < 0:
            self.need = self.num_groups

    @property
    def closable(self) -> bool:
        """Every group the step waits for has finished: ``need`` of its own, and every open
        group may still be carried (none when nothing is carried over)."""
        if self.own_done < self.need:
            return False
        return all(g.carried < self.max_carry for g in self.open_groups)

    @property
    def ready(self) -> bool:
        return self.closable and not self.queue

    def own(self, group: Group, spec: TrajectorySpec) -> float:
        """Takes ``group`` over (dispatched here, or carried in) -> trainable tokens queued
        (a carried group that already finished is packed at once)."""
        group.work = self
        if group.step != self.step:
            self.carried_in += 1
        self.open_groups.add(group)
        if group.results is not None:
            return self.finish(group, group.results, spec)
        return 0.0

    def finish(self, group: Group, results: list[ExecutionResult], spec) -> float:
        """A group this step owns has finished: pack it here -> trainable tokens queued."""
        self.open_groups.discard(group)
        self.groups.append(group.key)
        if group.step == self.step or self.count_carried:
            self.own_done += 1
        return self.add_group(results, spec)

    def record(self, version: int, outcome, role_fractions, handovers, prefix_hit_rate,
               kv) -> StepRecord:  # fmt: skip
        """The step's record once its update (``outcome``, weights ``version``) has landed,
        with the run-level counters sampled then."""
        return StepRecord(self.step, version, self.version_at_dispatch,
                          time.time() - self.dispatched_at, self.results, self.reports, outcome,
                          role_fractions, handovers, prefix_hit_rate, kv, sorted(self.groups),
                          self.carried_in)  # fmt: skip

    def close(self) -> list[Group]:
        """The step closes: its groups still running leave it, carried once more."""
        left = sorted(self.open_groups, key=lambda g: g.key)
        for g in left:
            g.work, g.carried = None, g.carried + 1
        self.open_groups.clear()
        return left

    @property
    def queued_tokens(self) -> float:
        """Trainable tokens waiting in the queue (the policy's train load)."""
        return sum(mb.trainable_tokens for _, mb in self.queue)

    def add_group(self, results: list[ExecutionResult], spec: TrajectorySpec) -> float:
        """Packs one finished group and queues its micro-batches as a new part -> the
        trainable tokens it queued."""
        queued = 0.0
        self.results += results
        packable = [r for r in results if r.records]
        if packable:
            batch, report = build_batch(packable, spec)
            self.reports.append(report)
            if report.used:
                part = len(self.part_counts)
                self.part_counts.append(report.normaliser)
                for mb in split_microbatches(batch, spec.rows_per_microbatch):
                    self.queue.append((part, mb))
                    queued += mb.trainable_tokens
        return queued


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What one finished step hands on: its executions, packing reports and update outcome,
    and the run-level counters sampled when it finished."""

    step: int
    version: int  # weight version after the step
    version_at_dispatch: int
    seconds: float  # dispatch to update
    results: list
    reports: list
    outcome: StepOutcome | None  # None: nothing was trainable (the weights stayed)
    role_fractions: dict
    handovers: dict
    prefix_hit_rate: float
    kv: dict = dataclasses.field(default_factory=dict)  # the step's KV-pool figures (kv_*)
    groups: list = dataclasses.field(default_factory=list)  # (dispatch step, index) trained
    carried_in: int = 0  # groups carried into the step from earlier ones

    @property
    def execution_ids(self) -> list[str]:
        return sorted(r.execution_id for r in self.results)


def signal_fraction(results, reward: str = "partial") -> float:
    """Fraction of task groups whose trained rewards differ (those that carry a signal).

    ``reward`` is trajectory.reward (binary counts success only); infrastructure errors are
    never trained on and are left out.
    """
    groups = collections.defaultdict(set)
    for r in results:
        score = execution_score(r.end_reason, r.score or 0.0, reward=reward)
        group = groups[r.task_id]
        if score is not None:
            group.add(round(score, 9))
    return float(np.mean([len(v) > 1 for v in groups.values()])) if groups else 0.0


def step_metrics(record: StepRecord, reward: str = "partial") -> dict:
    """The metrics row of one step (a pure function of its record)."""
    res, reports = record.results, record.reports
    scores = [r.score for r in res if r.score is not None]
    partial = [r.score for r in res if r.score is not None and r.end_reason != "success"]
    reasons = collections.Counter(r.end_reason for r in res)
    success = [float(r.end_reason == "success") for r in res]
    m = {
        "reward": float(np.mean(scores)) if scores else 0.0,
        "reward_se": standard_error(scores),
        "success": float(np.mean(success)) if res else 0.0,
        "success_se": standard_error(success),
        "partial": float(np.mean(partial)) if partial else 0.0,
        "milestones": float(np.mean([r.milestones / max(1, r.num_milestones) for r in res]))
        if res
        else 0.0,
        "signal_groups": signal_fraction(res, reward),
        "executions": len(res),
        "unique_tokens": sum(r.unique_tokens for r in reports),
        "flat_tokens": sum(r.flat_tokens for r in reports),
        "rejected": sum(len(r.rejected) for r in reports),
        "step_seconds": round(record.seconds, 3),
        "step": record.step,
        "version": record.version,
        "staleness": record.version - 1 - record.version_at_dispatch,
        "carried_in": record.carried_in,
    }
    m.update({f"end_{k}": v for k, v in reasons.items()})
    # tool or model calls that crashed or hung and were retried (infrastructure, not policy)
    m["infra_retries"] = sum(int(r.stats.get("infra_retries", 0)) for r in res)
    m["dup_ratio"] = m["flat_tokens"] / max(1, m["unique_tokens"])
    m["generated_tokens"] = sum(int(r.completion.size) for x in res for r in x.records)
    m["generated_tokens_per_s"] = m["generated_tokens"] / max(m["step_seconds"], 1e-9)
    if record.outcome is not None:
        m.update({k: v for k, v in record.outcome.metrics.items() if np.isscalar(v)})
        m["applied"] = record.outcome.applied
    m.update({f"role_{k}": v for k, v in record.role_fractions.items()})
    m.update({f"handover_{k}": v for k, v in record.handovers.items()})
    m["prefix_hit_rate"] = record.prefix_hit_rate
    m.update(record.kv)
    return m
