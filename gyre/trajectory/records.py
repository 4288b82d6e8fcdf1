"""Token-in/token-out call records: the exact tokens of every model call of an execution.

The harness produces one :class:`CallRecord` per model call; the tree builder consumes all
records of one execution. Validation raises :class:`RecordError` with a one-line message
that names the field and the call, so one bad execution can be dropped without losing the
rest of a batch.
"""

from __future__ import annotations

import dataclasses

import numpy as np

ROLES = ("main", "main-summary", "sub-agent", "sub-agent-summary")
END_REASONS = ("success", "failure", "timeout", "context_overflow", "infra_error")


class RecordError(ValueError):
    """A malformed call record; the message names the execution, call and field."""


@dataclasses.dataclass(frozen=True)
class CallRecord:
    """One model call.

    prompt: int32[P] token ids the model was given (context only unless generated earlier).
    completion: int32[C] token ids the model generated (C >= 1).
    logprobs: float32[C] behaviour logprob of each completion token.
    versions: int32[C] weight version that produced each completion token.
    role: one of ROLES.
    execution_id, call_id: identify the call; parent_id is the call that spawned or
      preceded it (None for the first call of an execution).
    end_reason: how the whole execution ended (one of END_REASONS), copied onto every call.
    """

    prompt: np.ndarray
    completion: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    role: str
    execution_id: str
    call_id: int
    parent_id: int | None = None
    end_reason: str = "success"

    @property
    def tokens(self) -> np.ndarray:
        """int32[P + C]: prompt followed by completion."""
        return np.concatenate([self.prompt, self.completion])


def _fail(rec: CallRecord, field: str, problem: str) -> None:
    raise RecordError(
        f"execution {rec.execution_id!r} call {rec.call_id}: field '{field}' {problem}"
    )


def validate_record(rec: CallRecord, vocab_size: int, check_prompt_ids: bool = True) -> None:
    """Checks one record in isolation (parent ids are checked by validate_execution).

    check_prompt_ids=False skips the id range scan of the prompt (the dominant cost, since
    prompts repeat earlier tokens); the tree builder then checks the unique tokens instead.
    """
    _structure(rec)
    for field in ("prompt", "completion"):
        ids = getattr(rec, field)
        if field == "prompt" and not check_prompt_ids:
            continue
        if ids.size and ids.min() < 0:
            _fail(rec, field, f"holds a negative token id ({int(ids.min())})")
        if ids.size and ids.max() >= vocab_size:
            _fail(
                rec,
                field,
                f"holds token id {int(ids.max())} outside the vocabulary of {vocab_size}",
            )
    if not np.all(np.isfinite(rec.logprobs)):
        _fail(rec, "logprobs", "holds a non-finite value")
    if np.any(rec.logprobs > 1e-4):
        _fail(rec, "logprobs", f"holds a positive logprob ({float(rec.logprobs.max()):.3g})")


def _structure(rec: CallRecord) -> None:
    """The cheap per-record checks (no scan over token values)."""
    for field in ("prompt", "completion", "logprobs", "versions"):
        arr = getattr(rec, field)
        if not isinstance(arr, np.ndarray) or arr.ndim != 1:
            _fail(rec, field, f"must be a 1-D numpy array, got {type(arr).__name__}")
    for field in ("prompt", "completion"):
        ids = getattr(rec, field)
        if ids.size and ids.dtype.kind not in "iu":
            _fail(rec, field, f"must hold integer token ids, got dtype {ids.dtype}")
    n = rec.completion.size
    if n == 0:
        _fail(rec, "completion", "is empty")
    for field in ("logprobs", "versions"):
        if getattr(rec, field).size != n:
            _fail(rec, field, f"has length {getattr(rec, field).size} but completion has {n}")
    if rec.role not in ROLES:
        _fail(rec, "role", f"is {rec.role!r}, not one of {ROLES}")
    if rec.end_reason not in END_REASONS:
        _fail(rec, "end_reason", f"is {rec.end_reason!r}, not one of {END_REASONS}")


def validate_execution(
    records: list[CallRecord], vocab_size: int, check_prompt_ids: bool = True
) -> None:
    """Checks every record of one execution, unique call ids and that parents exist.

    Value checks run once over all completions (and prompts) together; only when they fail
    are the records checked one by one, to name the offending call.
    """
    if not records:
        raise RecordError("execution has no call records")
    ids = set()
    for rec in records:
        _structure(rec)
        if rec.execution_id != records[0].execution_id:
            _fail(rec, "execution_id", f"differs from the execution's {records[0].execution_id!r}")
        if rec.call_id in ids:
            _fail(rec, "call_id", "is not unique within the execution")
        ids.add(rec.call_id)
    for rec in records:
        if rec.parent_id is not None and rec.parent_id not in ids:
            _fail(rec, "parent_id", f"names call {rec.parent_id}, which does not exist")
    tokens = [rec.completion for rec in records]
    if check_prompt_ids:
        tokens += [rec.prompt for rec in records if rec.prompt.size]
    tokens = np.concatenate(tokens)
    logp = np.concatenate([rec.logprobs for rec in records])
    if tokens.min() < 0 or tokens.max() >= vocab_size or not np.all(logp <= 1e-4):
        for rec in records:  # not all(<=) also catches NaN
            validate_record(rec, vocab_size, check_prompt_ids)


def make_record(prompt, completion, logprobs=None, versions=None, **kw) -> CallRecord:
    """Builds a record from lists, filling logprobs with 0 and versions with 0 if omitted."""
    completion = np.asarray(completion, np.int32)
    if logprobs is None:
        logprobs = np.zeros(completion.shape, np.float32)
    if versions is None:
        versions = np.zeros(completion.shape, np.int32)
    return CallRecord(
        prompt=np.asarray(prompt, np.int32),
        completion=completion,
        logprobs=np.asarray(logprobs, np.float32),
        versions=np.asarray(versions, np.int32),
        **kw,
    )
