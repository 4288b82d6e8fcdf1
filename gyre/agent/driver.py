"""Runs the harness on the ledger task with a mix of scripted policies and reports endings
and tree statistics (the experiment ``experiments/harness_ledger.py``)."""

from __future__ import annotations

import asyncio
import collections
import json
import time

import numpy as np

from gyre.agent.context import AgentSettings
from gyre.agent.harness import run_executions
from gyre.agent.scripted import FaultyEnv, GarbagePolicy, LedgerExpert, StallPolicy, WrongPolicy
from gyre.envs.base import Task
from gyre.envs.ledger import LedgerEnv
from gyre.trajectory.tree import build_tree

# The scripted mix, by execution index modulo 10: what each slot exercises.
MIX = ("expert", "expert", "expert", "expert", "delegate", "delegate", "parse-errors", "stall",
       "wrong", "env-crash")  # fmt: skip


class RoutedClient:
    """Sends each execution's calls to the policy of its slot in MIX."""

    def __init__(self, policies: dict[str, object], slots: dict[str, str]):
        self.policies, self.slots = policies, slots

    async def generate(self, request):
        return await self.policies[self.slots[request.execution_id]].generate(request)


def tree_stats(records) -> dict:
    """Paths, unique (trie) tokens and flattened (every root-to-leaf path) tokens."""
    tree = build_tree(records)
    lengths = [int(tree.depth[tree.call_end[c]]) + 1 for c in tree.leaf_calls]
    return dict(paths=len(lengths), unique_tokens=tree.num_nodes, flat_tokens=int(sum(lengths)))


def run_scripted_harness(env: LedgerEnv, settings: AgentSettings, seed: int, num_tasks: int,
                         samples_per_task: int) -> dict:  # fmt: skip
    """Runs num_tasks x samples_per_task executions; prints a table, returns the figures."""
    m = env.modulus
    slip = min(0.05, 1.0 / env.num_ops)  # about one near miss per execution
    policies = {
        "expert": LedgerExpert(m, mistake_prob=slip, seed=seed),
        "delegate": LedgerExpert(m, mistake_prob=slip, delegate_prob=0.2, seed=seed),
        "parse-errors": GarbagePolicy(LedgerExpert(m, seed=seed), period=4),
        "stall": StallPolicy(stop_after=max(1, env.num_ops // 2), modulus=m),
        "wrong": WrongPolicy(m),
        "env-crash": LedgerExpert(m, seed=seed),
    }
    tasks = [t for t in env.make_tasks(seed, num_tasks) for _ in range(samples_per_task)]
    slots, counts = {}, collections.Counter()
    for j, task in enumerate(tasks):
        slot = MIX[j % len(MIX)]
        if slot == "env-crash":  # a copy of the task whose tool crashes persistently at step 2
            tasks[j] = task = Task(f"{task.task_id}-crash", task.seed)
        eid = f"{task.task_id}#{counts[task.task_id]}"
        counts[task.task_id] += 1
        slots[eid] = slot
    faulty = FaultyEnv(
        env, lambda tid, n: "crash" if tid.endswith("-crash") and n == 2 else None, 99
    )
    t0 = time.perf_counter()
    results = asyncio.run(run_executions(faulty, tasks, RoutedClient(policies, slots), settings))
    seconds = time.perf_counter() - t0

    reasons = collections.Counter(r.end_reason for r in results)
    totals = collections.Counter()
    for res in results:
        if res.records:
            totals.update(tree_stats(res.records))
        totals.update({k: res.stats[k] for k in ("calls", "retries", "compactions", "sub_agents",
                                                   "infra_retries")})  # fmt: skip
    scored = [r.score for r in results if r.score is not None]
    summary = dict(
        executions=len(results),
        end_reasons=dict(sorted(reasons.items())),
        mean_score=float(np.mean(scored)) if scored else 0.0,
        milestone_fraction=float(
            np.mean([r.milestones / max(r.num_milestones, 1) for r in results])
        ),
        **dict(totals),
        flat_over_unique=totals["flat_tokens"] / max(totals["unique_tokens"], 1),
        max_context=max(r.stats["max_context"] for r in results),
        seconds=round(seconds, 3),
    )
    print(f"harness on ledger K={env.num_ops}: {len(results)} executions in {seconds:.2f} s")
    for reason, n in summary["end_reasons"].items():
        print(f"  {reason:<18} {n:>5}  {n / len(results):6.1%}")
    for key in ("paths", "unique_tokens", "flat_tokens", "flat_over_unique", "calls", "retries",
                "compactions", "sub_agents", "infra_retries", "mean_score", "max_context"):  # fmt: skip
        print(f"  {key:<18} {summary.get(key, 0):>10.4g}")
    print(json.dumps(summary))
    return summary
