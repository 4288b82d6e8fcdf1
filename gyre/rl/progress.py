"""Run bookkeeping that must survive a kill: which executions each trained step used, and the
time line of cell roles (for metrics and the Gantt chart)."""

from __future__ import annotations

import json
import os
import time

from gyre.elastic import workload
from gyre.rollout.engine import common_prefix


class RunLedger:
    """<workdir>/ledger.jsonl: one line per optimizer step with the execution ids it trained.

    On resume from version v, lines (and metrics rows) of steps >= v are dropped: those steps
    are re-run from their seeds, so no execution is trained twice or lost.
    """

    def __init__(self, workdir: str):
        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, "ledger.jsonl")
        self.metrics_path = os.path.join(workdir, "metrics.jsonl")
        self.trace_path = os.path.join(workdir, "trace.jsonl")

    def record_step(self, step: int, execution_ids: list[str]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "executions": execution_ids}) + "\n")

    def read(self) -> list[dict]:
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def truncate(self, version: int) -> None:
        """Keeps only steps < version in the ledger, the metrics and the trace."""
        for path in (self.path, self.metrics_path, self.trace_path):
            if not os.path.exists(path):
                continue
            with open(path) as f:
                rows = [line for line in f if line.strip()]
            kept = []
            for line in rows:
                try:
                    if json.loads(line)["step"] < version:
                        kept.append(line)
                except (json.JSONDecodeError, KeyError):
                    pass  # a line cut short by the kill
            with open(path, "w") as f:
                f.writelines(kept)


class RoleTimeline:
    """Per-cell role spans since the start of the run (wall seconds) and busy time."""

    def __init__(self, num_cells: int, role: str = "rollout"):
        self.t0 = time.time()
        self.current = [(role, 0.0)] * num_cells
        self.spans: list[tuple[int, str, float, float]] = []
        self.busy_s = [0.0] * num_cells
        self.switches = 0

    def now(self) -> float:
        return time.time() - self.t0

    def switch(self, cell: int, role: str) -> None:
        old, start = self.current[cell]
        t = self.now()
        self.spans.append((cell, old, start, t))
        self.current[cell] = (role, t)
        self.switches += 1

    def busy(self, cell: int, seconds: float) -> None:
        self.busy_s[cell] += seconds

    def all_spans(self) -> list[tuple[int, str, float, float]]:
        t = self.now()
        return self.spans + [(i, r, s, t) for i, (r, s) in enumerate(self.current)]

    def fractions(self, prefix: str = "") -> dict:
        """Share of cell-time in each role so far, and the number of switches."""
        total = {"rollout": 0.0, "train": 0.0}
        for _, role, start, end in self.all_spans():
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
