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


# Fields that describe the whole execution and are copied onto each of its records.
EXECUTION_FIELDS = ("execution_id", "end_reason")


class RecordError(ValueError):
    """A malformed call record; the message names the execution, call and field."""


# A logprob may exceed 0 by the rounding of a near-certain token, never by more.
LOGP_TOL = 1e-4
# The loss takes exp(logp - old_logp) in float32, which overflows (inf ratio, NaN loss) once
# the difference passes 88.7; with logp <= 0 an old logp >= -80 keeps the ratio finite. No
# sampled token comes near it: float32 Gumbel-max (jax.random.categorical) picks tokens within
# ~21 nats of the top logit, so a behaviour logprob is above -21 - ln(vocab) (~ -33 at 150k).
LOGP_FLOOR = -80.0
MAX_VERSION = np.iinfo(np.int32).max  # the tree stores versions as int32


@dataclasses.dataclass(frozen=True)
class CallRecord:
    """One model call.

    prompt: int32[P] token ids the model was given (context only unless generated earlier).
    completion: int32[C] token ids the model generated (C >= 1).
    logprobs: float32[C] behaviour logprob of each completion token, in [LOGP_FLOOR, LOGP_TOL].
    versions: int32[C] weight version (>= 0) that produced each completion token.
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


def _is_id(value) -> bool:
    """A call id: a non-negative int (numpy ints too; bools are not ids)."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool) and value >= 0


def _value_problem(field: str, arr: np.ndarray, vocab_size: int) -> str | None:
    """What is wrong with the values of one array field (or of several records' concatenated),
    or None. One function for both paths, so the fast check and the per-call one agree."""
    if field in ("prompt", "completion"):
        if arr.size and arr.min() < 0:
            return f"holds a negative token id ({int(arr.min())})"
        if arr.size and arr.max() >= vocab_size:
            return f"holds token id {int(arr.max())} outside the vocabulary of {vocab_size}"
    elif field == "logprobs":
        if not np.all(np.isfinite(arr)):
            return "holds a non-finite value"
        if np.any(arr > LOGP_TOL):
            return f"holds a positive logprob ({float(arr.max()):.3g})"
        if np.any(arr < LOGP_FLOOR):
            return f"holds logprob {float(arr.min()):.3g}, below the floor {LOGP_FLOOR:g}"
    elif field == "versions":
        if arr.min() < 0:
            return f"holds a negative version ({int(arr.min())})"
        if arr.max() > MAX_VERSION:
            return f"holds version {int(arr.max())}, beyond int32"
    return None


def validate_record(rec: CallRecord, vocab_size: int, check_prompt_ids: bool = True) -> None:
    """Checks one record in isolation (parent ids are checked by validate_execution).

    check_prompt_ids=False skips the id range scan of an int32-sized prompt (the dominant
    cost, since prompts repeat earlier tokens); the tree builder then checks the unique tokens
    instead.
    """
    _structure(rec)
    for field in ("prompt", "completion", "logprobs", "versions"):
        arr = getattr(rec, field)
        if field == "prompt" and not check_prompt_ids and np.can_cast(arr.dtype, np.int32):
            continue
        problem = _value_problem(field, arr, vocab_size)
        if problem:
            _fail(rec, field, problem)


def _structure(rec: CallRecord) -> None:
    """The cheap per-record checks (types, dtypes, lengths, ids; no scan over values)."""
    if not isinstance(rec.execution_id, str) or not rec.execution_id:
        _fail(rec, "execution_id", f"must be a non-empty string, got {rec.execution_id!r}")
    if not _is_id(rec.call_id):
        _fail(rec, "call_id", f"must be an int >= 0, got {rec.call_id!r}")
    if rec.parent_id is not None and not _is_id(rec.parent_id):
        _fail(rec, "parent_id", f"must be None or an int >= 0, got {rec.parent_id!r}")
    for field in ("prompt", "completion", "logprobs", "versions"):
        arr = getattr(rec, field)
        if not isinstance(arr, np.ndarray) or arr.ndim != 1:
            _fail(rec, field, f"must be a 1-D numpy array, got {type(arr).__name__}")
    n = rec.completion.size
    if n == 0:
        _fail(rec, "completion", "is empty")
    for field in ("logprobs", "versions"):
        if getattr(rec, field).size != n:
            _fail(rec, field, f"has length {getattr(rec, field).size} but completion has {n}")
    # An empty prompt may carry any dtype (np.asarray([]) is float64); it holds no ids.
    for field, kinds, what in (("prompt", "iu", "integer token ids"),
                               ("completion", "iu", "integer token ids"),
                               ("logprobs", "f", "real floating logprobs"),
                               ("versions", "iu", "integer versions")):  # fmt: skip
        arr = getattr(rec, field)
        if arr.size and arr.dtype.kind not in kinds:
            _fail(rec, field, f"must hold {what}, got dtype {arr.dtype}")
    if not isinstance(rec.role, str) or rec.role not in ROLES:
        _fail(rec, "role", f"is {rec.role!r}, not one of {ROLES}")
    if not isinstance(rec.end_reason, str) or rec.end_reason not in END_REASONS:
        _fail(rec, "end_reason", f"is {rec.end_reason!r}, not one of {END_REASONS}")


def validate_execution(
    records: list[CallRecord], vocab_size: int, check_prompt_ids: bool = True, **result
) -> None:
    """Checks every record of one execution, unique call ids and that parents exist.

    The per-execution fields (execution_id, end_reason) must agree across the records, and
    with ``result``'s (the ExecutionResult's own, e.g. ``end_reason="success"``) when given:
    an execution is scored from its records and reported from its result.

    Value checks run once per field over all records' arrays concatenated; only when one
    fails are the records checked one by one, to name the offending call.
    """
    if not records:
        raise RecordError("execution has no call records")
    for i, rec in enumerate(records):
        if not isinstance(rec, CallRecord):
            raise RecordError(f"execution record {i} is a {type(rec).__name__}, not a CallRecord")
    ids = set()
    for rec in records:
        _structure(rec)
        for field in EXECUTION_FIELDS:
            want = result.get(field) or getattr(records[0], field)
            if getattr(rec, field) != want:
                _fail(rec, field, f"is {getattr(rec, field)!r}, but the execution's is {want!r}")
        if rec.call_id in ids:
            _fail(rec, "call_id", "is not unique within the execution")
        ids.add(rec.call_id)
    for rec in records:
        if rec.parent_id is not None and rec.parent_id not in ids:
            _fail(rec, "parent_id", f"names call {rec.parent_id}, which does not exist")
    # The tree stores tokens as int32: a wider prompt could wrap into the vocabulary unseen,
    # so only int32-sized prompts may skip the scan.
    scan = lambda p: p.size and (check_prompt_ids or not np.can_cast(p.dtype, np.int32))
    arrays = {
        "completion": [r.completion for r in records],
        "prompt": [r.prompt for r in records if scan(r.prompt)],
        "logprobs": [r.logprobs for r in records],
        "versions": [r.versions for r in records],
    }
    for field, parts in arrays.items():
        if parts and _value_problem(field, np.concatenate(parts), vocab_size):
            for rec in records:
                validate_record(rec, vocab_size, check_prompt_ids)
            # Unreachable while both paths share _value_problem; never let a bad batch pass.
            raise RecordError(f"execution {records[0].execution_id!r}: field '{field}' is invalid")


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
