"""Pure helpers for the analysis notebooks (notebooks/): read a run's workdir, summarise its
metrics, role time line and trace, and measure token trees built by scripted executions.

The notebooks only call these and plot; everything computed lives here, with tests in
tests/test_analysis.py.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import json
import os
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from gyre.metrics import read_metrics

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKDIR_ENV = "GYRE_WORKDIR"


# ---------------------------------------------------------------- workdirs


def resolve_workdir(default: str = "workdirs/quickstart") -> str:
    """$GYRE_WORKDIR, else ``default``; a relative path is taken from the repository root."""
    path = os.environ.get(WORKDIR_ENV) or default
    return path if os.path.isabs(path) else os.path.join(REPO_ROOT, path)


def workdir_problem(workdir: str, needs: Sequence[str] = ("metrics.jsonl",)) -> str | None:
    """None when ``workdir`` holds every file in ``needs``, else one line saying what to do."""
    if not os.path.isdir(workdir):
        return (
            f"no workdir at {workdir}: run `python launch.py --config=experiments/quickstart.py"
            f" --workdir={workdir}` or set {WORKDIR_ENV} to a run's workdir"
        )
    missing = [n for n in needs if not os.path.exists(os.path.join(workdir, n))]
    if missing:
        return f"workdir {workdir} lacks {', '.join(missing)} (an older or unfinished run?)"
    return None


def load_rows(workdir: str) -> list[dict]:
    """metrics.jsonl rows of a workdir, in step order."""
    return sorted(read_metrics(workdir), key=lambda r: r["step"])


# ---------------------------------------------------------------- metrics


def series(rows: Sequence[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps int[S], values float[S]) of the rows that have a numeric ``key``."""
    pts = [(r["step"], r[key]) for r in rows
           if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]  # fmt: skip
    steps = np.asarray([p[0] for p in pts], np.int64)
    return steps, np.asarray([p[1] for p in pts], np.float64)


def ending_counts(rows: Sequence[dict]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Ending reasons per step from the rows' ``end_<reason>`` counts.

    Returns (reasons R, steps int[S], counts int[S, R]); a reason absent in a step counts 0.
    """
    reasons = sorted({k[4:] for r in rows for k in r if k.startswith("end_")})
    steps = np.asarray([r["step"] for r in rows], np.int64)
    counts = np.asarray([[int(r.get(f"end_{x}", 0)) for x in reasons] for r in rows], np.int64)
    return reasons, steps, counts.reshape(len(rows), len(reasons))


def trace_table(steps) -> list[dict]:
    """One row per traced execution (from ``workload.read_trace``): step, id, calls, generated
    and prompt tokens, measured seconds and ending (None when the trace has no measurement)."""
    out = []
    for step in steps:
        for ex in step:
            m = ex.measured or {}
            out.append(dict(
                step=ex.step, execution_id=ex.execution_id, calls=len(ex.calls),
                completion_tokens=sum(c.completion_tokens for c in ex.calls),
                train_tokens=ex.train_tokens,
                seconds=(m["end_s"] - m["start_s"]) if "end_s" in m else None,
                end_reason=m.get("end_reason"),
            ))  # fmt: skip
    return out


# ---------------------------------------------------------------- role time line


class Span(NamedTuple):
    cell: int
    role: str
    start: float
    end: float


def read_timeline(workdir: str) -> list[Span]:
    """<workdir>/timeline.json as spans sorted by (cell, start); zero-length spans dropped."""
    with open(os.path.join(workdir, "timeline.json")) as f:
        raw = json.load(f)
    spans = [Span(int(s["cell"]), s["role"], float(s["start"]), float(s["end"])) for s in raw]
    return sorted((s for s in spans if s.end > s.start), key=lambda s: (s.cell, s.start))


def role_fractions(spans: Sequence[Span]) -> dict[str, float]:
    """Share of all cell-seconds spent in each role."""
    total = collections.Counter()
    for s in spans:
        total[s.role] += s.end - s.start
    whole = sum(total.values())
    if whole <= 0:
        return {}
    return {role: v / whole for role, v in sorted(total.items())}


def live_executions(intervals: Sequence[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
    """Step function of executions in flight: (times float[E], count int[E]) where count[i]
    holds from times[i] until times[i + 1]. intervals: (start_s, end_s) per execution."""
    if not len(intervals):
        return np.zeros(0), np.zeros(0, np.int64)
    iv = np.asarray(intervals, np.float64)
    times = np.concatenate([iv[:, 0], iv[:, 1]])
    delta = np.concatenate([np.ones(len(iv), np.int64), -np.ones(len(iv), np.int64)])
    order = np.lexsort((delta, times))  # at equal times an end comes before a start
    t, n = times[order], np.cumsum(delta[order])
    last = np.r_[t[1:] != t[:-1], True]  # one value per distinct time
    return t[last], n[last]


def measured_intervals(steps) -> list[tuple[float, float]]:
    """(start_s, end_s) of every traced execution that carries a measurement, on the clock of
    the run's timeline.json (both count from the controller's start)."""
    return [(ex.measured["start_s"], ex.measured["end_s"])
            for step in steps for ex in step if ex.measured and "end_s" in ex.measured]  # fmt: skip


def rollout_busy_fraction(spans: Sequence[Span], intervals: Sequence[tuple[float, float]]) -> float:
    """Share of rollout cell-seconds during which at least one execution was in flight: the
    real run's stand-in for the simulator's busy time (the trace does not name cells)."""
    times, count = live_executions(intervals)
    busy = list(zip(times[:-1], times[1:], count[:-1]))
    total = covered = 0.0
    for s in spans:
        if s.role != "rollout":
            continue
        total += s.end - s.start
        for t0, t1, n in busy:
            if n > 0:
                covered += max(0.0, min(t1, s.end) - max(t0, s.start))
    return covered / total if total > 0 else 0.0


def replay_workdir(workdir: str, calibration: str = "cpu_measured"):
    """Simulates a run's own trace.jsonl with its scheduler, policy parameters and number of
    cells on a calibration's cost model, all cells sharing this CPU's cores (as the real run
    did). Returns the simulator's SimResult; compare it with the run's timeline.json."""
    from gyre.elastic import calibration as calib
    from gyre.elastic import sim, workload
    from gyre.rl.specs import from_json

    with open(os.path.join(workdir, "specs.json")) as f:
        specs = from_json(f.read())
    cells = len({s.cell for s in read_timeline(workdir)})
    # the controller packs micro-batches per finished task group
    cost = dataclasses.replace(calib.load(calibration), shared_cores=True, pack_by_group=True)
    steps = workload.read_trace(os.path.join(workdir, "trace.jsonl"))
    return sim.simulate(steps, cells, specs.run.scheduler_policy, cost, specs.scheduler)


# ---------------------------------------------------------------- trees


def scripted_executions(
    num_ops: int = 12,
    tasks: int = 2,
    samples: int = 4,
    seed: int = 0,
    context_window: int = 160,
    mistake_prob: float = 0.15,
    delegate_prob: float = 0.15,
    garbage_period: int = 3,
) -> list:
    """Runs the harness on the ledger with a scripted expert that slips (near misses),
    delegates (sub-agents) and sometimes emits garbage (retries); a small context window forces
    compactions (main-summary). Returns the harness's ExecutionResults, in task order."""
    from gyre.agent.context import AgentSettings
    from gyre.agent.harness import run_executions
    from gyre.agent.scripted import GarbagePolicy, LedgerExpert
    from gyre.envs.ledger import LedgerEnv

    env = LedgerEnv(num_ops=num_ops, header_ops=min(num_ops, 16), max_wrong=2)
    expert = LedgerExpert(env.modulus, mistake_prob=mistake_prob, delegate_prob=delegate_prob,
                          sub_mistakes=1, seed=seed)  # fmt: skip
    policy = GarbagePolicy(expert, period=garbage_period) if garbage_period else expert
    settings = AgentSettings(max_calls=8 * num_ops, context_window=context_window,
                             model_summary=True, max_new_tokens=12)  # fmt: skip
    todo = [t for t in env.make_tasks(seed, tasks) for _ in range(samples)]
    return _run_sync(run_executions(env, todo, policy, settings))


def _run_sync(coro):
    """asyncio.run, also from inside a running loop (a Jupyter kernel has one): there the
    coroutine runs to completion on a worker thread with its own loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def tree_shape(tree) -> dict:
    """Size and shape of one execution's tree: nodes (unique tokens), calls, paths (leaves),
    deepest path, branch nodes (more than one child), trainable share, flattened tokens
    (every root-to-leaf path on its own) and the duplication ratio flat / unique."""
    children = np.bincount(tree.parent[tree.parent >= 0], minlength=tree.num_nodes)
    lengths = tree.depth[tree.call_end[tree.leaf_calls]] + 1
    roles = collections.Counter(tree.call_roles[c] for c in tree.leaf_calls)
    return dict(
        execution_id=tree.execution_id, end_reason=tree.end_reason, nodes=tree.num_nodes,
        calls=len(tree.call_ids), paths=len(lengths), max_depth=int(lengths.max()),
        branch_nodes=int((children > 1).sum()), trainable=float(tree.trainable.mean()),
        flat_tokens=int(lengths.sum()), dup_ratio=float(lengths.sum() / tree.num_nodes),
        **{f"paths_{r}": n for r, n in sorted(roles.items())},
    )  # fmt: skip


class Segment(NamedTuple):
    """A leaf path drawn as the part it does not share with the paths listed before it."""

    call: int  # call index owning the leaf
    role: str
    branch_depth: int  # tokens shared with an earlier path
    end_depth: int  # path length in tokens


def path_segments(tree) -> list[Segment]:
    """Leaf paths in DFS order (sorted by their token ids' path), each with the depth where it
    leaves the earlier ones: an icicle view of the trie."""
    paths = {int(c): tree.path_nodes(int(c)) for c in tree.leaf_calls}
    order = sorted(paths, key=lambda c: tuple(paths[c]))
    out = []
    for i, c in enumerate(order):
        p = paths[c]
        shared = 0
        for q in (paths[d] for d in order[:i]):
            n = min(p.size, q.size)
            diff = np.flatnonzero(p[:n] != q[:n])
            shared = max(shared, int(diff[0]) if diff.size else n)
        out.append(Segment(c, tree.call_roles[c], shared, int(p.size)))
    return out


def cap_effects(trees: Sequence, caps: Sequence[int] = (1, 2, 3, 5, 0)) -> list[dict]:
    """Per path cap J (0 = uncapped), summed over ``trees``: kept and dropped paths, unique and
    flattened tokens of the kept paths, their ratio, and the share of the uncapped union's
    trainable tokens that the kept paths still train."""
    from gyre.trajectory.pack import union_size
    from gyre.trajectory.select import select_paths

    def trainable_union(tree, calls):
        nodes = np.unique(np.concatenate([tree.path_nodes(c) for c in calls]))
        return int(tree.trainable[nodes].sum())

    full = sum(trainable_union(t, select_paths(t, 0).kept) for t in trees)
    out = []
    for cap in caps:
        sels = [select_paths(t, cap) for t in trees]
        unique = sum(union_size(t, s.kept) for t, s in zip(trees, sels))
        flat = sum(int((t.depth[t.call_end[list(s.kept)]] + 1).sum()) for t, s in zip(trees, sels))
        out.append(dict(
            cap=cap, kept=sum(len(s.kept) for s in sels), dropped=sum(len(s.dropped) for s in sels),
            unique_tokens=unique, flat_tokens=flat, dup_ratio=flat / max(unique, 1),
            trained_share=sum(trainable_union(t, s.kept) for t, s in zip(trees, sels)) / max(full, 1),
        ))  # fmt: skip
    return out


def packing_sweep(results: Sequence, row_lens: Sequence[int] = (128, 256, 512),
                  max_paths: int = 5, rows_per_microbatch: int = 1) -> list[dict]:  # fmt: skip
    """Packs harness results with ``build_batch`` for tree and flat packing at each row length:
    rows, real and padded positions, padding share and loss-bearing tokens per row."""
    from gyre.envs.vocab import VOCAB_SIZE
    from gyre.trajectory.batch import PACKINGS, TrajectorySpec, build_batch

    out = []
    for row_len in row_lens:
        for packing in PACKINGS:
            spec = TrajectorySpec(VOCAB_SIZE, max_paths=max_paths, row_len=row_len,
                                  packing=packing, rows_per_microbatch=rows_per_microbatch)  # fmt: skip
            batch, report = build_batch(results, spec)
            rows = batch.tokens.shape[0]
            out.append(dict(
                row_len=row_len, packing=packing, rows=rows, rejected=len(report.rejected),
                positions=int((batch.exec_index >= 0).sum()), padding=report.padding,
                loss_tokens=int((batch.w > 0).sum()),
            ))  # fmt: skip
    return out
