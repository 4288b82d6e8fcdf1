"""Readable transcripts of finished executions: what the agent did, call by call.

    text = render_execution(result, env.render_tokens)          # one execution
    write_step_transcripts(path, step, results, env.render_tokens)  # appends to executions.txt
    steps = read_transcripts(path)                               # {step: text}, complete blocks
    first = split_executions(steps[max(steps)])[0]

Prompts grow by appending, so each call shows only the prompt tokens that are new after its
parent's prompt + completion (the call before it in the same agent); a call whose prompt is
not such an extension (a retry, a compaction, a sub-agent's fresh context) says so and shows
the part that differs. Token text is indented by four spaces, so the only lines that start at
column 0 are the transcript's own headers: a model cannot forge a step marker, and a reader
can split the file on them.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
from collections.abc import Callable, Sequence

import numpy as np

from gyre.trajectory.batch import ExecutionResult
from gyre.trajectory.records import CallRecord

RELATIONS = ("first", "extends", "retry", "new-agent", "restart", "orphan")
EXECUTION_HEADER = "### execution "
INDENT = "    "
_BEGIN = re.compile(r"^=== step (\d+) ===$")
_END = re.compile(r"^=== end of step (\d+) ===$")


@dataclasses.dataclass(frozen=True)
class CallView:
    """One call as a transcript shows it.

    relation: how the prompt relates to the parent's prompt + completion (one of RELATIONS);
    shared: leading prompt tokens equal to the parent's context (0 without a parent);
    new_prompt: int32[P - shared], the prompt tokens shown (all of them for a first call).
    """

    record: CallRecord
    relation: str
    shared: int
    new_prompt: np.ndarray


def _agent(role: str) -> str:
    """The agent a role belongs to ('main-summary' is the main agent's summary call)."""
    return role.removesuffix("-summary")


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def call_views(records: Sequence[CallRecord]) -> list[CallView]:
    """Each record with the prompt tokens that are new relative to its parent, in order."""
    by_id = {r.call_id: r for r in records}
    views = []
    for rec in records:
        prompt = np.asarray(rec.prompt)
        parent = by_id.get(rec.parent_id) if rec.parent_id is not None else None
        if parent is None:  # a root call, or a parent missing from malformed records
            relation = "first" if rec.parent_id is None else "orphan"
            views.append(CallView(rec, relation, 0, prompt))
            continue
        context = np.concatenate([parent.prompt, parent.completion])
        shared = _common_prefix(prompt, context)
        if shared == context.size:
            relation = "extends"
        elif np.array_equal(prompt, parent.prompt):
            relation = "retry"  # the parent's completion was dropped; the call is redone
        elif _agent(rec.role) != _agent(parent.role):
            relation = "new-agent"
        else:
            relation = "restart"
        views.append(CallView(rec, relation, shared, prompt[shared:]))
    return views


def clip(text: str, keep: int) -> str:
    """``text`` with its middle cut so that ``keep`` characters remain, and a marker line
    saying how many were cut; unchanged when it is no longer than ``keep``."""
    if len(text) <= keep:
        return text
    head, tail = (keep + 1) // 2, keep // 2
    cut = len(text) - head - tail
    return f"{text[:head]}\n[... {cut} characters cut ...]\n{text[len(text) - tail :]}"


def _budgets(a: int, b: int, total: int) -> tuple[int, int]:
    """Characters kept of two texts of lengths a and b within ``total``: each gets at least
    half, and what one does not need goes to the other."""
    if a + b <= total:
        return a, b
    half = total // 2
    if a <= half:
        return a, total - a
    if b <= total - half:
        return total - b, b
    return half, total - half


def _indent(text: str) -> str:
    # Split on '\n' only (as read_transcripts does), so no other line break in token text
    # can put a line at column 0.
    return "\n".join(INDENT + line for line in text.split("\n"))


def _versions(versions: np.ndarray) -> str:
    if not versions.size:
        return "no version"
    lo, hi = int(versions.min()), int(versions.max())
    return f"version {lo}" if lo == hi else f"versions {lo}-{hi}"


def _prompt_label(view: CallView) -> str:
    rec, n = view.record, view.new_prompt.size
    size, parent = rec.prompt.size, rec.parent_id
    if view.relation == "first":
        return f"prompt ({size} tokens):"
    if view.relation == "orphan":
        return f"prompt ({size} tokens; parent call {parent} is not among the records):"
    if view.relation == "extends":
        return f"prompt: +{n} tokens after call {parent}'s context:"
    if view.relation == "retry":
        return (f"RETRY of call {parent}: the same prompt ({size} tokens); call {parent}'s "
                f"completion was dropped")  # fmt: skip
    if view.relation == "new-agent":
        return (f"NEW CONTEXT ({rec.role}, started by call {parent}): {size} tokens, the first "
                f"{view.shared} as in call {parent}'s context; the other {n}:")  # fmt: skip
    return (f"RESTART (not an extension of call {parent}'s context, e.g. a compaction): "
            f"{size} tokens, the first {view.shared} shared; the {n} that differ:")  # fmt: skip


def _score(score) -> str:
    return "score none (infrastructure error)" if score is None else f"score {score:.3f}"


def render_execution(
    result: ExecutionResult,
    render_tokens: Callable[[np.ndarray], str],
    max_chars: int = 2000,
    max_calls: int = 64,
    label: str = "",
) -> str:
    """Readable text of one finished execution (no trailing newline).

    render_tokens: the environment's detokenizer (``Environment.render_tokens``), int32[T] ->
      text. max_chars: characters of token text kept per call (new prompt + completion; a
      longer text loses its middle, with a marker). max_calls: calls shown (the first and the
      last halves; a marker counts the rest). label: why this execution was picked, if any.
    """
    if not isinstance(result, ExecutionResult):
        raise TypeError(f"render_execution takes an ExecutionResult, got {type(result).__name__}")
    if max_chars < 2 or max_calls < 1:
        raise ValueError(f"max_chars must be >= 2 and max_calls >= 1, got {max_chars}, {max_calls}")
    recs = result.records
    generated = sum(int(r.completion.size) for r in recs)
    tag = f" [{label}]" if label else ""
    lines = [
        f"{EXECUTION_HEADER}{result.execution_id or '?'}{tag} | task {result.task_id} | "
        f"{result.end_reason or '?'} | {_score(result.score)} | milestones "
        f"{result.milestones}/{result.num_milestones} | {len(recs)} calls | "
        f"{generated} tokens generated"
    ]
    stats = result.stats or {}
    counts = [f"{k.replace('_', '-')} {stats[k]}" for k in ("retries", "compactions", "sub_agents")
              if stats.get(k)]  # fmt: skip
    if counts:
        lines.append("branches: " + ", ".join(counts))
    if "tool_calls" in stats:  # a chat task's (gyre/envs/chat_env.py execution_stats)
        lines.append(f"tool calls: {stats['tool_calls']} run, "
                     f"{stats.get('malformed_calls', 0)} malformed")  # fmt: skip
    detail = str(stats.get("detail") or "")
    if "\n" in detail or len(detail) > 100:  # e.g. a harness traceback: an indented block
        lines += ["ending detail:", _indent(clip(detail, max_chars))]
    elif detail:
        lines.append(f"ending detail: {detail}")
    if not recs:
        lines.append("(no model calls)")
    views = call_views(recs)
    first = (max_calls + 1) // 2
    hidden = range(first, len(views) - max_calls // 2) if len(views) > max_calls else range(0)
    for i, view in enumerate(views):
        if i in hidden:
            if i == hidden.start:
                lines.append(f"[... {len(hidden)} calls not shown ...]")
            continue
        rec = view.record
        parent = "-" if rec.parent_id is None else rec.parent_id
        prompt_text = render_tokens(view.new_prompt) if view.new_prompt.size else ""
        completion_text = render_tokens(rec.completion)
        keep_p, keep_c = _budgets(len(prompt_text), len(completion_text), max_chars)
        lines.append(f"--- call {rec.call_id} | {rec.role} | parent {parent} | "
                     f"{_versions(rec.versions)}")  # fmt: skip
        lines.append(_prompt_label(view))
        if view.new_prompt.size:
            lines.append(_indent(clip(prompt_text, keep_p)))
        lines.append(f"completion ({rec.completion.size} tokens):")
        lines.append(_indent(clip(completion_text, keep_c)))
    return "\n".join(lines)


def choose_executions(results: Sequence[ExecutionResult], n: int) -> list[tuple[int, str]]:
    """Up to n (index into results, why) pairs, the same for the same results in any order:
    the highest score, the lowest score (another execution), then the rest by execution id.
    Ties go to the smaller execution id; unscored executions (infrastructure errors) are
    only ever among the rest."""
    if n < 1:
        raise ValueError(f"max_executions must be >= 1, got {n}")
    order = sorted(range(len(results)), key=lambda i: (results[i].execution_id, i))
    scored = [i for i in order if results[i].score is not None]
    chosen: list[tuple[int, str]] = []
    if scored:
        best = min(scored, key=lambda i: -results[i].score)  # min keeps the id order on ties
        chosen.append((best, "highest score"))
        rest = [i for i in scored if i != best]
        if rest and n > 1:
            chosen.append((min(rest, key=lambda i: results[i].score), "lowest score"))
    picked = {i for i, _ in chosen}
    chosen += [(i, "first by execution id") for i in order if i not in picked]
    return chosen[:n]


def _ending_counts(results: Sequence[ExecutionResult]) -> str:
    counts = collections.Counter(r.end_reason or "?" for r in results)
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


def render_step(
    step: int,
    results: Sequence[ExecutionResult],
    render_tokens: Callable[[np.ndarray], str],
    max_executions: int = 4,
    max_chars: int = 2000,
    max_calls: int = 64,
) -> str:
    """One step's block of executions.txt (begin marker to end marker, newline-terminated)."""
    if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    results = list(results)
    for i, r in enumerate(results):
        if not isinstance(r, ExecutionResult):
            raise TypeError(f"results[{i}] is a {type(r).__name__}, not an ExecutionResult")
    chosen = choose_executions(results, max_executions)
    picks = ", ".join(f"{results[i].execution_id} ({why})" for i, why in chosen)
    lines = [f"=== step {int(step)} ==="]
    if results:
        lines.append(f"{len(results)} executions ({_ending_counts(results)}); showing "
                     f"{len(chosen)}: {picks}")  # fmt: skip
    else:
        lines.append("0 executions")
    for i, why in chosen:
        lines += ["", render_execution(results[i], render_tokens, max_chars, max_calls, why)]
    lines += ["", f"=== end of step {int(step)} ==="]
    return "\n".join(lines) + "\n"


def write_step_transcripts(
    path: str,
    step: int,
    results: Sequence[ExecutionResult],
    render_tokens: Callable[[np.ndarray], str],
    max_executions: int = 4,
    max_chars: int = 2000,
    max_calls: int = 64,
) -> None:
    """Appends the step's block (see render_step) to ``path``, e.g. <workdir>/executions.txt.

    The block is rendered before the file is opened and written in one call, so a kill can
    only leave a partial last block, which read_transcripts skips; a block always starts on a
    new line, even after such a partial one.
    """
    block = render_step(step, results, render_tokens, max_executions, max_chars, max_calls)
    with open(path, "a+b") as f:  # appends go to the end whatever the read position
        if f.seek(0, os.SEEK_END) > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                block = "\n" + block
        f.write(block.encode("utf-8", errors="replace"))


def read_transcripts(path: str) -> dict[int, str]:
    """{step: its text} of every complete block in ``path``, in step order.

    The text lies between the step's markers. A block without its end marker (a write cut
    by a kill) is skipped; when a step appears twice (a resumed run redoes it), the later
    block wins.
    """
    with open(path, "rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    steps: dict[int, str] = {}
    step, body = None, []
    for line in text.split("\n"):
        begin, end = _BEGIN.match(line), _END.match(line)
        if begin:
            step, body = int(begin.group(1)), []
        elif end:
            if step is not None and int(end.group(1)) == step:
                steps[step] = "\n".join(body).strip("\n")
            step = None
        elif step is not None:
            body.append(line)
    return dict(sorted(steps.items()))


def split_executions(step_text: str) -> list[str]:
    """The rendered executions of one step's text (as read_transcripts returns it)."""
    blocks: list[list[str]] = []
    for line in step_text.split("\n"):
        if line.startswith(EXECUTION_HEADER):
            blocks.append([])
        if blocks:
            blocks[-1].append(line)
    return ["\n".join(b).rstrip("\n") for b in blocks]
