"""Run bookkeeping that must survive a kill: which executions each trained step used, the time
line of cell roles (for metrics and the Gantt chart), and the call trace."""

from __future__ import annotations

import json
import os
import time

from gyre.elastic import workload
from gyre.metrics import write_atomic, write_json
from gyre.rollout.engine import common_prefix


class RunLedger:
    """<workdir>/ledger.jsonl: one line per optimizer step with the execution ids it trained.

    On resume from version v, ledger and trace lines of step indices >= v (0-based) and
    metrics rows after step v (rows count from 1) are dropped: those steps are re-run from
    their seeds, so no execution is trained twice or lost.
    """

    def __init__(self, workdir: str):
        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, "ledger.jsonl")
        self.metrics_path = os.path.join(workdir, "metrics.jsonl")
        self.trace_path = os.path.join(workdir, "trace.jsonl")

    def record_step(self, step: int, execution_ids: list[str], groups=()) -> None:
        """One trained step: its execution ids and its task groups as (dispatch step, index)
        (with carry-over a step trains groups dispatched with earlier steps)."""
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "executions": execution_ids,
                                "groups": [list(g) for g in groups]}) + "\n")  # fmt: skip

    def trained_groups(self) -> set[tuple[int, int]]:
        """(dispatch step, index) of every group a recorded step trained."""
        return {tuple(g) for row in self.read() for g in row.get("groups", ())}

    def read(self) -> list[dict]:
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def truncate(self, version: int) -> None:
        """Keeps only the first ``version`` steps in the ledger, the metrics and the trace."""
        for path, keep_below in ((self.path, version), (self.metrics_path, version + 1),
                                 (self.trace_path, version)):  # fmt: skip
            if not os.path.exists(path):
                continue
            with open(path) as f:
                old = f.read()
            kept = []
            for line in old.splitlines():
                try:
                    if json.loads(line)["step"] < keep_below:
                        kept.append(line + "\n")
                except (json.JSONDecodeError, KeyError, TypeError):
                    pass  # a line cut short by the kill
            if "".join(kept) != old:
                write_atomic(path, "".join(kept))  # a kill here leaves the old file whole


class RoleTimeline:
    """Per-cell role spans over the whole run (wall seconds) and busy time.

    Roles: 'rollout' and 'train' (what the scheduler allocates), 'switch' (a cell handing its
    requests over or loading weights), 'eval' (greedy evaluation), 'warmstart' (supervised
    steps before RL) and 'lost' (its process died: gyre/cluster/remote.py). ``history``: the spans an earlier part of this run wrote to
    timeline.json; the new spans continue after them, so a resumed run has one time line.
    """

    SCHEDULED = ("rollout", "train")

    def __init__(self, num_cells: int, role: str = "rollout", history=()):
        self.spans = [(h["cell"], h["role"], h["start"], h["end"]) for h in history]
        offset = max((h["end"] for h in history), default=0.0)
        self.t0 = time.time() - offset
        last = {c: r for c, r, _, _ in sorted(self.spans, key=lambda x: x[3])}
        self.current = [(last.get(cell, role), offset) for cell in range(num_cells)]
        self.busy_s = [0.0] * num_cells
        self.switches = 0  # changes between the scheduled roles (a 'switch' span is not one)
        self._scheduled = [role if role in self.SCHEDULED else None] * num_cells
        for cell in range(num_cells):
            for _, r, _, _ in sorted((x for x in self.spans if x[0] == cell), key=lambda x: x[2]):
                self._count(cell, r)

    def _count(self, cell: int, role: str) -> None:
        if role in self.SCHEDULED:
            if self._scheduled[cell] not in (None, role):
                self.switches += 1
            self._scheduled[cell] = role

    def now(self) -> float:
        return time.time() - self.t0

    def switch(self, cell: int, role: str) -> None:
        old, start = self.current[cell]
        if old == role:
            return
        t = self.now()
        self.spans.append((cell, old, start, t))
        self.current[cell] = (role, t)
        self._count(cell, role)

    def set_all(self, role: str) -> list[str]:
        """Every cell to ``role`` (a phase of the run); -> the roles they had."""
        before = [r for r, _ in self.current]
        for cell in range(len(self.current)):
            self.switch(cell, role)
        return before

    def busy(self, cell: int, seconds: float) -> None:
        self.busy_s[cell] += seconds

    def all_spans(self) -> list[tuple[int, str, float, float]]:
        t = self.now()
        return self.spans + [(i, r, s, t) for i, (r, s) in enumerate(self.current)]

    def fractions(self, prefix: str = "") -> dict:
        """Share of cell-time in each role since RL began (warm start left out), and the
        number of switches between rollout and train."""
        total = {"rollout": 0.0, "train": 0.0}
        for _, role, start, end in self.all_spans():
            if role != "warmstart":
                total[role] = total.get(role, 0.0) + end - start
        whole = sum(total.values()) or 1.0
        out = {f"{prefix}{role}_frac": v / whole for role, v in total.items()}
        out[f"{prefix}switches"] = self.switches
        return out

    def to_json(self) -> list[dict]:
        return [
            {"cell": c, "role": r, "start": round(s, 4), "end": round(e, 4)}
            for c, r, s, e in self.all_spans()
        ]

    def save(self, path: str) -> None:
        """Writes timeline.json (atomically: a kill leaves the previous one)."""
        write_json(path, self.to_json())

    @classmethod
    def load(cls, path: str, num_cells: int) -> RoleTimeline:
        """The time line saved at ``path`` continued (a fresh one if there is none)."""
        history = []
        if os.path.exists(path):
            with open(path) as f:
                history = [h for h in json.load(f) if h["cell"] < num_cells]
        return cls(num_cells, history=history)


class TraceWriter:
    """<workdir>/trace.jsonl in the simulator's trace format (gyre/elastic/workload.py), so a
    real run can be replayed by the simulator and the two compared."""

    def __init__(self, path: str, timeout_s: float):
        self.path, self.timeout_s = path, timeout_s

    def record(self, result, step: int, group: int, start_s: float, end_s: float) -> None:
        calls, seen = [], []
        for rec in result.records:
            cached = max((common_prefix(rec.prompt, t) for t in seen), default=0)
            calls.append(workload.Call(
                prompt_tokens=int(rec.prompt.size),
                completion_tokens=int(rec.completion.size),
                tool_latency_s=0.0,
                new_prompt_tokens=int(rec.prompt.size) - cached,
                role=rec.role,
            ))  # fmt: skip
            seen.append(rec.tokens)
        if not calls:
            return
        ex = workload.Execution(
            result.execution_id, step, tuple(calls), self.timeout_s, group,
            {"start_s": round(start_s, 4), "end_s": round(end_s, 4),
             "end_reason": result.end_reason},
        )  # fmt: skip
        with open(self.path, "a") as f:
            f.write(workload.to_json(ex) + "\n")
