"""Bad call records are refused with one-line messages; the rest of the step is kept."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import branchy_execution, executions

from gyre.trajectory.batch import ExecutionResult, TrajectorySpec, build_batch
from gyre.trajectory.records import (
    LOGP_FLOOR,
    RecordError,
    make_record,
    validate_execution,
    validate_record,
)

VOCAB = 64


def good(eid="x"):
    kw = dict(role="main", execution_id=eid)
    return [
        make_record([1, 2], [3, 4], logprobs=[-0.1, -0.2], call_id=0, **kw),
        make_record([1, 2, 3, 4, 5], [6], logprobs=[-0.3], call_id=1, parent_id=0, **kw),
    ]


def broken(field_fn):
    recs = good()
    recs[1] = field_fn(recs[1])
    return recs


BAD = [
    (lambda r: dataclasses.replace(r, logprobs=np.zeros(3, np.float32)), "'logprobs' has length 3"),
    (lambda r: dataclasses.replace(r, versions=np.zeros(2, np.int32)), "'versions' has length 2"),
    (
        lambda r: dataclasses.replace(r, prompt=np.asarray([1, -2], np.int32)),
        "'prompt' holds a negative",
    ),
    (
        lambda r: dataclasses.replace(r, completion=np.asarray([64], np.int32)),
        "'completion' holds token id 64",
    ),
    (
        lambda r: dataclasses.replace(r, prompt=np.asarray([1, 99], np.int32)),
        "'prompt' holds token id 99",
    ),
    (
        lambda r: dataclasses.replace(r, logprobs=np.asarray([np.nan], np.float32)),
        "'logprobs' holds a non-finite",
    ),
    (
        lambda r: dataclasses.replace(r, logprobs=np.asarray([np.inf], np.float32)),
        "'logprobs' holds a non-finite",
    ),
    (lambda r: dataclasses.replace(r, role="critic"), "'role' is 'critic'"),
    (
        lambda r: dataclasses.replace(
            r,
            completion=np.zeros(0, np.int32),
            logprobs=np.zeros(0, np.float32),
            versions=np.zeros(0, np.int32),
        ),
        "'completion' is empty",
    ),
    (
        lambda r: dataclasses.replace(r, parent_id=7),
        "'parent_id' names call 7, which does not exist",
    ),
    (lambda r: dataclasses.replace(r, call_id=0, parent_id=None), "'call_id' is not unique"),
    (lambda r: dataclasses.replace(r, prompt=[1, 2]), "'prompt' must be a 1-D numpy array"),
    (lambda r: dataclasses.replace(r, prompt=np.asarray([1.0, 2.0])), "'prompt' must hold integer"),
]


def replace(**kw):
    return lambda r: dataclasses.replace(r, **kw)


def arr(values, dtype):
    return np.asarray(values, dtype)


def nan_versions(r):
    with np.errstate(invalid="ignore"):  # make_record casts a NaN version to -2^31
        return make_record(r.prompt, r.completion, r.logprobs, np.asarray([np.nan]), role="main",
                           execution_id="x", call_id=1, parent_id=0)  # fmt: skip


# Bad in the record itself (validate_record refuses them too), none of them an int32 prompt id
# (those only the full scan or the tree check sees), all caught by the fast path.
BAD_VALUES = [
    (replace(logprobs=arr([-np.inf], np.float32)), "'logprobs' holds a non-finite"),
    (
        replace(logprobs=arr([-3e38], np.float32)),
        "'logprobs' holds logprob -3e+38, below the floor",
    ),
    (replace(logprobs=arr([LOGP_FLOOR - 1], np.float32)), "below the floor -80"),
    (replace(logprobs=arr([1e300], np.float64)), "'logprobs' holds a positive logprob"),
    (replace(logprobs=arr([0.01], np.float32)), "'logprobs' holds a positive logprob (0.01)"),
    (
        replace(logprobs=arr([-0.5], object)),
        "'logprobs' must hold real floating logprobs, got dtype object",
    ),
    (
        replace(logprobs=arr([-1], np.int32)),
        "'logprobs' must hold real floating logprobs, got dtype int32",
    ),
    (replace(logprobs=arr([-0.5j], complex)), "got dtype complex128"),
    (replace(logprobs=arr([False], bool)), "got dtype bool"),
    (
        replace(versions=arr([np.nan], np.float32)),
        "'versions' must hold integer versions, got dtype float32",
    ),
    (replace(versions=arr([1.0], np.float64)), "'versions' must hold integer versions"),
    (replace(versions=arr([-1], np.int32)), "'versions' holds a negative version (-1)"),
    (nan_versions, "'versions' holds a negative version (-2147483648)"),
    (replace(call_id=None), "'call_id' must be an int >= 0, got None"),
    (replace(call_id=[1]), "'call_id' must be an int >= 0, got [1]"),
    (replace(call_id=True), "'call_id' must be an int >= 0, got True"),
    (replace(call_id=-1), "'call_id' must be an int >= 0, got -1"),
    (replace(call_id="1"), "'call_id' must be an int >= 0, got '1'"),
    (replace(call_id=1.0), "'call_id' must be an int >= 0, got 1.0"),
    (replace(parent_id=[0]), "'parent_id' must be None or an int >= 0, got [0]"),
    (replace(parent_id=0.0), "'parent_id' must be None or an int >= 0, got 0.0"),
    (replace(role=["main"]), "'role' is ['main']"),
    (replace(role=np.asarray(["main"])), "'role' is array(['main']"),
    (replace(end_reason=None), "'end_reason' is None"),
    (replace(completion=arr([2**32 + 3], np.uint64)), "'completion' holds token id 4294967299"),
    (replace(completion=arr([True], bool)), "'completion' must hold integer token ids"),
    (replace(prompt=arr([1, 2], object)), "'prompt' must hold integer token ids, got dtype object"),
    # a wider prompt could wrap into the vocabulary as the tree's int32, so even the fast path
    # scans it
    (replace(prompt=arr([1, 2**32 + 1], np.int64)), "'prompt' holds token id 4294967297"),
    (
        replace(prompt=arr([1, 2], np.int32)[None]),
        "'prompt' must be a 1-D numpy array, got ndarray",
    ),
]
BAD_IDS = [f"{i}-{m[:40]}" for i, (_, m) in enumerate(BAD + BAD_VALUES)]


@pytest.mark.parametrize("fn,message", BAD + BAD_VALUES, ids=BAD_IDS)
def test_bad_record_message_names_field_and_call(fn, message):
    with pytest.raises(RecordError) as err:
        validate_execution(broken(fn), VOCAB)
    text = str(err.value)
    assert message in text and "execution 'x' call" in text and "\n" not in text


@pytest.mark.parametrize("fn,message", BAD_VALUES, ids=BAD_IDS[len(BAD) :])
def test_bad_values_are_caught_alone_and_by_the_fast_path(fn, message):
    rec = fn(good()[1])
    with pytest.raises(RecordError) as err:
        validate_record(rec, VOCAB, check_prompt_ids=False)
    assert message in str(err.value) and "call" in str(err.value)
    with pytest.raises(RecordError) as err:
        validate_execution(broken(fn), VOCAB, check_prompt_ids=False)
    assert message in str(err.value) and "execution 'x' call" in str(err.value)


@pytest.mark.parametrize("fn,message", BAD + BAD_VALUES, ids=BAD_IDS)
def test_build_batch_rejects_only_the_bad_execution(fn, message):
    results = [ExecutionResult(good("a"), "t", 0.5), ExecutionResult(broken(fn), "t", 0.1),
               ExecutionResult(good("b"), "t", 0.2)]  # fmt: skip
    batch, rep = build_batch(results, spec())
    assert rep.used == (0, 2) and [i for i, _ in rep.rejected] == [1]
    assert message in rep.rejected[0][1] and "\n" not in rep.rejected[0][1]
    assert np.isfinite(batch.old_logp).all()


@pytest.mark.parametrize("execution_id", [None, 5, "", ["x"], b"x"])
def test_execution_id_must_be_a_nonempty_string(execution_id):
    recs = [dataclasses.replace(r, execution_id=execution_id) for r in good()]
    with pytest.raises(RecordError, match="'execution_id' must be a non-empty string"):
        validate_execution(recs, VOCAB, check_prompt_ids=False)
    _, rep = build_batch([ExecutionResult(recs, "t", 0.5, execution_id="given")], spec())
    assert rep.used == () and "'execution_id' must be" in rep.rejected[0][1]


def test_a_record_that_is_not_a_call_record():
    with pytest.raises(RecordError, match="execution record 1 is a dict, not a CallRecord"):
        validate_execution([good()[0], vars(good()[1])], VOCAB)


def test_good_records_pass():
    validate_execution(good(), VOCAB)
    with pytest.raises(RecordError, match="no call records"):
        validate_execution([], VOCAB)
    # the edges: the floor itself, rounding above 0, numpy ids, narrow and wide dtypes, and an
    # empty float64 prompt (np.asarray([]) has no integer dtype, and holds no ids)
    edge = dataclasses.replace(
        good()[1],
        prompt=np.asarray([1, 2, 3, 4, 5], np.int64),
        completion=np.asarray([6], np.uint16),
        logprobs=np.asarray([LOGP_FLOOR], np.float16),
        versions=np.asarray([2**31 - 1], np.int64),
        call_id=np.int64(1),
        parent_id=np.int32(0),
    )
    root = dataclasses.replace(good()[0], prompt=np.asarray([]), logprobs=np.asarray([5e-5, 0.0]))
    for check in (True, False):
        validate_execution([root, edge], VOCAB, check_prompt_ids=check)
    _, rep = build_batch([ExecutionResult([root, edge], "t", 0.5)], spec())
    assert rep.used == (0,)


def test_the_floor_keeps_the_loss_finite():
    """Why LOGP_FLOOR is -80, not e.g. -1e4: the loss's float32 exp(logp - old_logp) overflows
    past 88.7 nats, and an inf ratio times a zero advantage side is NaN."""
    import jax.numpy as jnp

    from gyre.train.loss import LossSpec, policy_loss

    def loss(old):
        batch = dict(old_logp=np.asarray([[old]], np.float32), adv_pos=np.full((1, 1), 0.5, np.float32),
                     adv_neg=np.zeros((1, 1), np.float32), w=np.full((1, 1), 0.5, np.float32),
                     versions=np.zeros((1, 1), np.int32))  # fmt: skip
        return float(policy_loss(jnp.zeros((1, 1)), jnp.zeros((1, 1)), batch, LossSpec(), 0)[0])

    assert np.isfinite(loss(LOGP_FLOOR)) and np.isnan(loss(-100.0))


def corrupt(rec, kind: str, j: int, vocab: int):
    """``rec`` with one field made invalid (j picks the position within the completion)."""
    j %= rec.completion.size
    put = lambda a, v, dtype=None: np.asarray([*a[:j], v, *a[j + 1 :]], dtype or a.dtype)
    return {
        "logp_nan": lambda: dataclasses.replace(rec, logprobs=put(rec.logprobs, np.nan)),
        "logp_-inf": lambda: dataclasses.replace(rec, logprobs=put(rec.logprobs, -np.inf)),
        "logp_low": lambda: dataclasses.replace(rec, logprobs=put(rec.logprobs, -1e4)),
        "logp_pos": lambda: dataclasses.replace(rec, logprobs=put(rec.logprobs, 0.5)),
        "logp_dtype": lambda: dataclasses.replace(rec, logprobs=rec.logprobs.astype(object)),
        "version_neg": lambda: dataclasses.replace(rec, versions=put(rec.versions, -3)),
        "version_wide": lambda: dataclasses.replace(
            rec, versions=put(rec.versions, 2**33, np.int64)
        ),
        "version_float": lambda: dataclasses.replace(rec, versions=rec.versions.astype(float)),
        "token_high": lambda: dataclasses.replace(rec, completion=put(rec.completion, vocab)),
        "token_neg": lambda: dataclasses.replace(rec, completion=put(rec.completion, -1)),
        "prompt_wrap": lambda: dataclasses.replace(
            rec, prompt=np.append(rec.prompt, 2**32).astype(np.int64)
        ),
        "call_id": lambda: dataclasses.replace(rec, call_id=str(rec.call_id)),
        "parent_id": lambda: dataclasses.replace(rec, parent_id=[rec.parent_id]),
    }[kind]()


KINDS = ["logp_nan", "logp_-inf", "logp_low", "logp_pos", "logp_dtype", "version_neg",
         "version_wide", "version_float", "token_high", "token_neg", "prompt_wrap", "call_id",
         "parent_id"]  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(records=executions(max_calls=6), data=st.data())
def test_random_executions_pass_and_any_one_corruption_is_named(records, data):
    vocab = 64  # the strategy's vocabularies are at most 64
    validate_execution(records, vocab)
    validate_execution(records, vocab, check_prompt_ids=False)
    i = data.draw(st.integers(0, len(records) - 1))
    kind = data.draw(st.sampled_from(KINDS))
    bad = list(records)
    bad[i] = corrupt(records[i], kind, data.draw(st.integers(0, 99)), vocab)
    with pytest.raises(RecordError) as err:
        validate_execution(bad, vocab, check_prompt_ids=False)
    assert f"execution {records[0].execution_id!r} call " in str(err.value)
    with pytest.raises(RecordError):
        validate_record(bad[i], vocab, check_prompt_ids=False)


def spec(**traj):
    return TrajectorySpec(VOCAB, rows_per_microbatch=2, **traj)


@pytest.mark.parametrize("packing", ["tree", "flat"])
def test_bad_executions_are_rejected_and_the_rest_kept(packing):
    results = [
        ExecutionResult(branchy_execution(s, n_calls=6, execution_id=f"e{s}"), "t", 0.2 * (s % 3))
        for s in range(5)
    ]
    results[1] = ExecutionResult(broken(BAD[4][0]), "t", 0.1)  # bad prompt id: found after the tree
    results[3] = ExecutionResult(
        [dataclasses.replace(r, end_reason="infra_error") for r in results[3].records], "t"
    )
    batch, rep = build_batch(results, spec(packing=packing, max_paths=2))
    assert rep.used == (0, 2, 4) and rep.excluded == (3,)
    assert [i for i, _ in rep.rejected] == [1] and "'prompt' holds token id 99" in rep.rejected[0][
        1
    ]
    assert set(np.unique(batch.exec_index)) - {-1} == {0, 1, 2}
    assert batch.tokens.shape[0] % 2 == 0 and batch.tokens.shape[1] == 1024
    assert all(k <= 2 for k in rep.kept_paths)
    assert np.isclose(np.sum(rep.advantages), 0.0)  # one task: mean-centred over the survivors
    assert np.isclose(
        batch.w.astype(np.float64).sum(), 1.0, atol=1e-5
    )  # two-level: sums to 1 per token


def test_path_longer_than_a_row_rejects_only_its_execution():
    long_exec = [
        make_record(
            np.arange(60) % VOCAB,
            np.arange(80) % VOCAB,
            role="main",
            execution_id="long",
            call_id=0,
        )
    ]
    results = [ExecutionResult(long_exec, "t"), ExecutionResult(good("ok"), "t")]
    batch, rep = build_batch(results, spec(row_len=128))
    assert rep.used == (1,) and "a path of 140 tokens exceeds row_len 128" in rep.rejected[0][1]
    assert batch.tokens.shape[1] == 128
    assert np.allclose(batch.w[batch.w > 0], 1 / 3) and batch.tokens[batch.w > 0].tolist() == [
        3,
        4,
        6,
    ]
