"""Bad call records are refused with one-line messages; the rest of the step is kept."""

import dataclasses

import numpy as np
import pytest
from strategies import branchy_execution

from gyre.trajectory.batch import ExecutionResult, TrajectorySpec, build_batch
from gyre.trajectory.records import RecordError, make_record, validate_execution

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


@pytest.mark.parametrize("fn,message", BAD)
def test_bad_record_message_names_field_and_call(fn, message):
    with pytest.raises(RecordError) as err:
        validate_execution(broken(fn), VOCAB)
    text = str(err.value)
    assert message in text and "execution 'x' call" in text and "\n" not in text


def test_good_records_pass():
    validate_execution(good(), VOCAB)
    with pytest.raises(RecordError, match="no call records"):
        validate_execution([], VOCAB)


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
