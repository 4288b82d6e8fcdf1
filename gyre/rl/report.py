"""What a run tells its user: the line that says what runs where, the live status line, and
the end-of-run table (pure functions of counters and summaries)."""

from __future__ import annotations

import math

import numpy as np

from gyre.metrics import RunClock, clock, standard_error


def where_line(rt, workdir: str) -> str:
    """One line: what runs where (devices, cells, scheduler, the work)."""
    s, cells = rt.specs, rt.cells
    n = sum(c.size for c in cells)
    actors = f" in {s.cluster.actors} Ray actors" if s.cluster.backend == "ray" else ""
    return (f"{s.name}: {n} {cells[0].platform} device(s) as {len(cells)} cell(s) of "
            f"{cells[0].size}{actors}, "
            f"{s.run.scheduler_policy} scheduler, {s.run.steps} RL steps of {s.run.tasks_per_step} tasks x "
            f"{s.run.samples_per_task} samples, env {s.env.name}; workdir {workdir}")  # fmt: skip


def where_now(ctrl) -> str:
    """Where the RL loop stands, for the watchdog's message."""
    return (f"weights at version {ctrl.trainer.version}, steps in flight {sorted(ctrl.steps)}, "
            f"executions finished {ctrl.rollouts.counters['finished']} of "
            f"{ctrl.rollouts.counters['dispatched']} dispatched, {sum(ctrl.proxy.live_requests())} live "
            f"model requests, roles {ctrl.roles}")  # fmt: skip


def rl_status(ctrl, rc: RunClock) -> str:
    """The live line of the RL loop, naming its phase: the first step (no ETA until one step
    has been measured), RL step k (counters of that step), or an evaluation after step k."""
    steps = ctrl.specs.run.steps
    if rc.eval_t0 is not None:
        which = "final evaluation" if rc.done >= steps else "evaluation"
        return (f"{which} after step {rc.done}/{steps}: {ctrl.specs.eval.tasks} held-out tasks, "
                f"{clock(rc.clock() - rc.eval_t0)} in; {rc.eta()}")  # fmt: skip
    roles = {r: ctrl.roles.count(r) for r in ("rollout", "train") if r in ctrl.roles}
    cells = ", ".join(f"{k} {n}" for k, n in roles.items())
    works = [ctrl.steps[k] for k in sorted(ctrl.steps)]
    per_step = ctrl.specs.run.executions_per_step
    if works:
        w = works[0]
        trained, packed = len(w.grads), len(w.grads) + len(w.queue)
        now = (f"this step: {len(w.results)}/{per_step} executions finished, {trained} of "
               f"{packed} micro-batches packed so far trained")  # fmt: skip
        for later in works[1:]:
            now += f"; step {later.step + 1} rolling out: {len(later.results)}/{per_step}"
    else:
        now = "between steps"
    k = min(rc.done + 1, steps)
    if rc.step_seconds() is None:
        head = (
            f"RL step {k}/{steps} (the first in this process: compiles included; ETA once it ends)"
        )
        return f"{head}: {now}; cells {cells}"
    return (f"RL step {k}/{steps}: {now}; cells {cells}; {rc.eta()} "
            f"({clock(rc.step_seconds())} a step)")  # fmt: skip


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def change_se(start: dict, end: dict, key: str, outcomes=(None, None)) -> float:
    """Standard error of end[key] - start[key]: from the per-task differences when both
    evaluations' outcomes are given (the same tasks, paired), else from the two SEs."""
    a, b = ((o or {}).get(key) for o in outcomes)
    if a is not None and b is not None and len(a) == len(b):
        return standard_error(np.subtract(b, a))
    return math.sqrt(start.get(f"{key}_se", 0.0) ** 2 + end.get(f"{key}_se", 0.0) ** 2)


def change_line(name: str, start: dict, end: dict, key: str, outcomes=(None, None)) -> str | None:
    """'name: before ± se -> after ± se (change ± se, z)' for an evaluated mean, or None."""
    if key not in start or key not in end:
        return None
    a, b = start[key], end[key]
    sa, sb = start.get(f"{key}_se", 0.0), end.get(f"{key}_se", 0.0)
    se = change_se(start, end, key, outcomes)
    z = f", {(b - a) / se:+.1f} SE" if se > 0 else ""
    return (f"{name:<20} {_pct(a)} ± {_pct(sa)} -> {_pct(b)} ± {_pct(sb)}  "
            f"(change {100 * (b - a):+.1f} ± {100 * se:.1f} points{z})")  # fmt: skip


def held_out_lines(summary: dict) -> list[str]:
    """The table's held-out lines: success and milestones before -> after RL with their
    standard errors (the after alone when there is no before), and how they were measured."""
    start, end = summary.get("eval_start", {}), summary.get("eval_end", {})
    n = end.get("eval_tasks", start.get("eval_tasks"))
    lines = []
    for name, key in (("held-out success", "eval_success"),
                      ("held-out milestones", "eval_milestones")):  # fmt: skip
        outcomes = (summary.get("eval_start_outcomes"), summary.get("eval_end_outcomes"))
        line = change_line(name, start, end, key, outcomes)
        if line:
            lines.append(line)
        elif key in end:
            lines.append(f"{name:<20} {_pct(end[key])} ± {_pct(end.get(f'{key}_se', 0.0))}")
    temp = summary.get("eval_temperature", 0.0)
    how = "greedy" if not temp else f"sampled at temperature {temp:g}"
    if n and start:
        lines.append(f"{'evaluation':<20} {how}, the same {n} held-out tasks before and after "
                     "RL (change SE from per-task differences)")  # fmt: skip
    elif n:
        lines.append(f"{'evaluation':<20} {how}, {n} held-out tasks")
    return lines


def eval_table(summary: dict) -> str:
    """The table of ``launch.py --mode=eval``: what was evaluated, then the end-of-run table's
    held-out lines (before RL: the run's own evaluation, from its summary.json)."""
    return "\n".join([f"== {summary.get('name', 'run')}: evaluation of {summary.get('evaluated')} =="]
                     + held_out_lines(summary)
                     + [f"{'time':<20} {clock(summary.get('wall_seconds', 0))}"])  # fmt: skip


def summary_table(summary: dict) -> str:
    """The short end-of-run table: held-out success and milestones before/after with their
    standard errors, steps, switches, hand-overs, time."""
    lines = [f"== {summary.get('name', 'run')}: {summary.get('steps', 0)} RL steps, "
             f"{summary.get('scheduler', '?')} scheduler =="]  # fmt: skip
    lines += held_out_lines(summary)
    hand = summary.get("handovers", {})
    lines.append(f"{'role switches':<20} {summary.get('switches', 0)}; live requests handed over: "
                 + (", ".join(f"{k} {v}" for k, v in sorted(hand.items()) if v) or "none"))  # fmt: skip
    ws = summary.get("warm_start", {})
    if ws:
        state = "cached" if ws.get("cached") else f"{clock(ws.get('seconds', 0))}"
        lines.append(f"{'warm start':<20} {ws.get('steps', 0)} steps, per-step accuracy "
                     f"{ws.get('accuracy', 0):.3f} ({state})")  # fmt: skip
    lines.append(f"{'time':<20} {clock(summary.get('wall_seconds', 0))}")
    return "\n".join(lines)
