"""Workloads for the simulator: a seeded generator and replay of recorded traces.

Trace format (JSON lines, one execution per line; the controller records the same format):

    {"execution_id": "s3-q1-e2", "step": 3, "group": 1, "timeout_s": 14400.0,
     "calls": [{"prompt_tokens": 2048, "new_prompt_tokens": 2048, "completion_tokens": 310,
                "tool_latency_s": 12.5, "role": "main"}, ...],
     "measured": {"start_s": 0.0, "end_s": 6950.2, "end_reason": "success"}}

- calls run one after another; ``tool_latency_s`` is the wait after the call's completion
  (tool or environment time) before the next call is issued.
- ``prompt_tokens`` is the full context given to the model, ``new_prompt_tokens`` the part
  not already cached from the execution's earlier calls (what must be prefilled).
- ``group`` is the query (task) index within the step; one query's samples share a group.
- ``measured`` is optional: what the real run observed, so a replay can be compared with it.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from gyre.trajectory.records import ROLES


@dataclasses.dataclass(frozen=True)
class Call:
    prompt_tokens: int
    completion_tokens: int
    tool_latency_s: float
    new_prompt_tokens: int
    role: str = "main"


_CALL_KEYS = {f.name for f in dataclasses.fields(Call)}


@dataclasses.dataclass(frozen=True)
class Execution:
    execution_id: str
    step: int
    calls: tuple[Call, ...]
    timeout_s: float
    group: int = 0
    measured: dict | None = None

    @property
    def train_tokens(self) -> int:
        """Unique tokens of the execution's tree: each call adds its new prompt + completion."""
        return sum(c.new_prompt_tokens + c.completion_tokens for c in self.calls)


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    """A synthetic workload. Lognormal sigmas set the heavy tails; *_rate are per-call odds.

    retry_rate: a call is repeated from the same prompt (a retry branch).
    compaction: when the context passes ``context_window`` a summary call (main-summary)
      runs and the context restarts from system + summary tokens.
    subagent_rate: a call spawns a sub-agent chain of ``subagent_calls`` calls on a fresh
      context (run inline, as the harness awaits it).
    """

    steps: int = 4
    queries_per_step: int = 8
    samples_per_query: int = 4
    mean_calls: float = 30.0
    calls_sigma: float = 0.8
    mean_completion_tokens: float = 400.0
    completion_sigma: float = 0.6
    mean_observation_tokens: float = 800.0
    observation_sigma: float = 0.8
    mean_tool_latency_s: float = 30.0
    tool_sigma: float = 1.0
    system_tokens: int = 2000
    context_window: int = 128_000
    summary_tokens: int = 2000
    timeout_s: float = 4 * 3600.0
    retry_rate: float = 0.0
    subagent_rate: float = 0.0
    subagent_calls: int = 5
    max_calls: int = 2000
    seed: int = 0

    @property
    def executions_per_step(self) -> int:
        return self.queries_per_step * self.samples_per_query


def _lognormal(rng, mean: float, sigma: float) -> float:
    # Parametrised by its mean, so changing sigma changes the tail, not the average load.
    return float(rng.lognormal(np.log(mean) - sigma**2 / 2, sigma)) if mean > 0 else 0.0


def _chain(rng, spec: WorkloadSpec, n_calls: int, role: str, sub_role: str | None) -> list[Call]:
    calls, ctx = [], spec.system_tokens
    new = spec.system_tokens
    i = 0
    while i < n_calls and len(calls) < spec.max_calls:
        completion = max(
            1, round(_lognormal(rng, spec.mean_completion_tokens, spec.completion_sigma))
        )
        tool = _lognormal(rng, spec.mean_tool_latency_s, spec.tool_sigma)
        obs = round(_lognormal(rng, spec.mean_observation_tokens, spec.observation_sigma))
        if rng.random() < spec.retry_rate:  # the failed attempt: same prompt, discarded reply
            calls.append(Call(ctx, completion, tool, new, role))
            new = 0
        calls.append(Call(ctx, completion, tool, new, role))
        if sub_role is not None and rng.random() < spec.subagent_rate:
            calls.extend(_chain(rng, spec, spec.subagent_calls, sub_role, None))
        ctx += completion + obs
        new = obs
        if ctx > spec.context_window:
            summary = spec.summary_tokens
            calls.append(Call(ctx, summary, 0.0, new, f"{role}-summary"))
            ctx, new = spec.system_tokens + summary, spec.system_tokens + summary
        i += 1
    return calls[: spec.max_calls]


def generate(spec: WorkloadSpec) -> list[list[Execution]]:
    """Executions per step: ``steps`` lists of ``executions_per_step``, keyed from spec.seed."""
    if spec.steps < 1 or spec.executions_per_step < 1:
        raise ValueError(f"WorkloadSpec needs steps >= 1 and executions per step >= 1, got {spec}")
    out = []
    for s in range(spec.steps):
        batch = []
        for q in range(spec.queries_per_step):
            # A query's difficulty scales all its samples' lengths (samples are correlated).
            difficulty = _lognormal(np.random.default_rng([spec.seed, s, q]), 1.0, spec.calls_sigma)
            for e in range(spec.samples_per_query):
                rng = np.random.default_rng([spec.seed, s, q, e + 1])
                n = max(1, round(spec.mean_calls * difficulty * _lognormal(rng, 1.0, 0.3)))
                calls = _chain(rng, spec, n, "main", "sub-agent")
                batch.append(Execution(f"s{s}-q{q}-e{e}", s, tuple(calls), spec.timeout_s, q))
        out.append(batch)
    return out


def to_json(ex: Execution) -> str:
    d = dataclasses.asdict(ex)
    if d["measured"] is None:
        del d["measured"]
    return json.dumps(d, separators=(",", ":"))


_REQUIRED = object()
_BIG = 2**53  # beyond any count or time, and exact as a float (1e400 would overflow float())


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _int(d: dict, key: str, lo: int, default=_REQUIRED) -> int:
    """An integer field in [lo, 2^53]; bools and floats (3.0 included) are not integers here."""
    v = d.get(key, default)
    if v is _REQUIRED:
        raise ValueError(f"lacks {key!r}")
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= _BIG:
        raise ValueError(f"{key} must be an integer in [{lo}, 2^53], got {_show(v)}")
    return v


def _num(d: dict, key: str, lo: float, default=_REQUIRED) -> float:
    """A number in [lo, 2^53]: json reads 1e999 as inf, and NaN fails the comparison."""
    v = d.get(key, default)
    if v is _REQUIRED:
        raise ValueError(f"lacks {key!r}")
    if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= _BIG:
        raise ValueError(f"{key} must be a finite number >= {lo:g}, got {_show(v)}")
    return float(v)


def _no_constants(name: str):
    raise ValueError(f"{name} is not a number (counts and times must be finite)")


def _call(i: int, c) -> Call:
    if not isinstance(c, dict):
        raise ValueError(f"call {i} is not an object")
    if set(c) - _CALL_KEYS:
        raise ValueError(f"call {i} has unknown keys {sorted(set(c) - _CALL_KEYS)}")
    role = c.get("role", "main")
    if not isinstance(role, str) or role not in ROLES:
        raise ValueError(f"call {i} role {_show(role)} is not one of {ROLES}")
    try:
        call = Call(_int(c, "prompt_tokens", 0), _int(c, "completion_tokens", 1),
                    _num(c, "tool_latency_s", 0.0), _int(c, "new_prompt_tokens", 0), role)  # fmt: skip
    except ValueError as e:
        raise ValueError(f"call {i}: {e}") from None
    if call.new_prompt_tokens > call.prompt_tokens:
        raise ValueError(f"call {i} has more new prompt tokens than prompt tokens")
    return call


def from_json(line: str) -> Execution:
    """One trace line -> Execution; anything else is a one-line ValueError naming the field.

    The fields read nest 3 deep (line > calls > call; ``measured`` is flat); a line nested
    past json's recursion limit (e.g. 100k '[') is refused here, not a RecursionError.
    """
    try:
        d = json.loads(line, parse_constant=_no_constants)
    except RecursionError:
        raise ValueError("nesting is too deep for a trace line") from None
    except ValueError as e:  # JSONDecodeError included
        raise ValueError(f"not a JSON trace line ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"trace line is a {type(d).__name__}, not an object")
    eid = d.get("execution_id")
    if not isinstance(eid, str) or not eid:
        raise ValueError(f"execution_id must be a non-empty string, got {_show(eid)}")
    calls = d.get("calls")
    if not isinstance(calls, list) or not calls:
        raise ValueError("calls must be a non-empty list")
    measured = d.get("measured")
    if measured is not None:
        if not isinstance(measured, dict) or any(
            isinstance(v, dict | list) for v in measured.values()
        ):
            raise ValueError("measured must be a flat object")
        for key in ("start_s", "end_s"):  # what the analysis subtracts
            if key in measured:
                _num(measured, key, -_BIG)
    timeout = _num(d, "timeout_s", 0.0)
    if timeout == 0:
        raise ValueError("timeout_s must be > 0")
    return Execution(eid, _int(d, "step", 0), tuple(_call(i, c) for i, c in enumerate(calls)),
                     timeout, _int(d, "group", 0, default=0), measured)  # fmt: skip


def write_trace(path: str, steps: list[list[Execution]]) -> None:
    with open(path, "w") as f:
        for batch in steps:
            for ex in batch:
                f.write(to_json(ex) + "\n")


def read_trace(path: str) -> list[list[Execution]]:
    """Executions grouped by their ``step`` field, in step order (steps must be 0..S-1).

    A bad line is a ValueError naming the file and line; execution ids are unique per file
    (the simulator keys its outcomes by them).
    """
    by_step: dict[int, list[Execution]] = {}
    first_line: dict[str, int] = {}
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode()
                if not line.strip():
                    continue
                ex = from_json(line)
            except ValueError as e:  # UnicodeDecodeError included
                raise ValueError(f"{path}:{n}: {e}") from None
            if ex.execution_id in first_line:
                raise ValueError(f"{path}:{n}: execution id {_show(ex.execution_id)} repeats "
                                 f"line {first_line[ex.execution_id]}")  # fmt: skip
            first_line[ex.execution_id] = n
            by_step.setdefault(ex.step, []).append(ex)
    if sorted(by_step) != list(range(len(by_step))):
        raise ValueError(f"{path}: steps must be 0..S-1, got {sorted(by_step)}")
    return [by_step[s] for s in range(len(by_step))]
