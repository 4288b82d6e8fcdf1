"""Run files survive kills: a rewrite goes through a temporary file and os.replace, and an
unreadable checkpoint is moved aside so the re-trained step is saved again."""

import builtins
import json
import os

import jax
import numpy as np
import pytest
from test_train_step import step_batch
from worlds import small_config

from gyre.mesh import make_cells
from gyre.model import decoder
from gyre.rl.builder import build_specs
from gyre.rl.progress import RunLedger
from gyre.train.checkpoint import Checkpointer
from gyre.train.step import Trainer

pytestmark = pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")


class Killed(BaseException):
    """Stands for a SIGKILL arriving in the middle of a write."""


def _killing_open(real_open):
    """open() whose files opened for writing die after their first few bytes."""

    def fake(path, mode="r", *args, **kw):
        f = real_open(path, mode, *args, **kw)
        if "w" not in mode:
            return f
        write = f.write

        def dying(text):
            write(text[:5])
            f.flush()
            raise Killed

        f.write = dying
        f.writelines = lambda lines: dying("".join(lines))
        return f

    return fake


def test_a_kill_during_the_resume_rewrite_loses_no_row(tmp_path, monkeypatch):
    rows = {"ledger.jsonl": range(3), "trace.jsonl": range(3), "metrics.jsonl": (1, 2, 3)}
    for name, steps in rows.items():
        (tmp_path / name).write_text("".join(json.dumps({"step": s}) + "\n" for s in steps))
    before = {name: (tmp_path / name).read_text() for name in rows}
    monkeypatch.setattr(builtins, "open", _killing_open(builtins.open))
    with pytest.raises(Killed):
        RunLedger(str(tmp_path)).truncate(2)
    monkeypatch.undo()
    for name in rows:  # each file is the old one whole (or, had it finished, the new one)
        assert (tmp_path / name).read_text() == before[name], name
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    RunLedger(str(tmp_path)).truncate(2)  # the relaunch then truncates as it should
    for name, want in (("ledger.jsonl", [0, 1]), ("trace.jsonl", [0, 1]),
                       ("metrics.jsonl", [1, 2])):  # fmt: skip
        got = [json.loads(x)["step"] for x in (tmp_path / name).read_text().splitlines()]
        assert got == want, name


def test_a_kept_line_without_its_newline_gets_one(tmp_path):
    # A kill between a row's text and its newline: the next appended row must not join it.
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}')
    ledger = RunLedger(str(tmp_path))
    ledger.truncate(5)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3}\n')
    got = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert got == [1, 2, 3]


def test_write_atomic_replaces_whole_or_not_at_all(tmp_path, monkeypatch):
    from gyre.metrics import write_atomic

    path = tmp_path / "summary.json"
    write_atomic(str(path), "old")
    monkeypatch.setattr(builtins, "open", _killing_open(builtins.open))
    with pytest.raises(Killed):
        write_atomic(str(path), "new contents")
    monkeypatch.undo()
    assert path.read_text() == "old"
    write_atomic(str(path), "new contents")
    assert path.read_text() == "new contents"


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.slow
def test_an_unreadable_checkpoint_moves_aside_and_its_step_is_saved_again(tmp_path, caplog):
    specs = build_specs(small_config())
    cells = make_cells(2)[:1]
    graphdef, params = decoder.init_sharded(specs.model, 2, cells[0], "train")
    trainer = Trainer(specs.trainer, cells, graphdef, params)
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=3)
    for s in range(2):
        trainer.train_step(cells, *step_batch(specs, s))
        trainer.save(ckpt, wait=True)
    for p in (tmp_path / "ckpt" / "2").rglob("*"):  # every array file of step 2 cut short
        if p.is_file() and "params" in p.parts and p.stat().st_size:
            p.write_bytes(p.read_bytes()[: p.stat().st_size // 3])
    ckpt.close()

    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=3)
    with caplog.at_level("WARNING", logger="gyre.train.checkpoint"):
        resumed, _ = Trainer.restore(specs.trainer, cells, graphdef, ckpt)
    assert resumed.step == 1
    (line,) = [r.getMessage() for r in caplog.records if r.name == "gyre.train.checkpoint"]
    aside = str(tmp_path / "ckpt.unreadable" / "2")
    assert "checkpoint 2" in line and "resuming from step 1" in line and aside in line
    assert os.path.isdir(aside) and ckpt.all_steps() == [1]
    resumed.train_step(cells, *step_batch(specs, 1))  # step 2 re-trained ...
    resumed.save(ckpt, wait=True)
    want = _leaves(resumed.params)
    ckpt.close()

    again = Checkpointer(str(tmp_path / "ckpt"), keep=3)  # ... and saved: a relaunch finds it
    assert again.latest_step() == 2
    restored, _ = Trainer.restore(specs.trainer, cells, graphdef, again)
    assert restored.step == 2
    for a, b in zip(_leaves(restored.params), want):
        np.testing.assert_array_equal(a, b)
    again.close()


def _execution(reasons, execution_id="x"):
    from gyre.trajectory.records import make_record

    return [make_record([1, 2], [3], role="main", execution_id=execution_id, call_id=i,
                        parent_id=i - 1 if i else None, end_reason=r)
            for i, r in enumerate(reasons)]  # fmt: skip


def test_records_that_disagree_on_the_ending_are_refused_naming_the_call():
    from gyre.trajectory.records import RecordError, validate_execution

    with pytest.raises(RecordError, match=r"call 1: field 'end_reason' is 'success'.*'failure'"):
        validate_execution(_execution(["failure", "success"]), 8)
    validate_execution(_execution(["failure", "failure"]), 8, end_reason="failure")
    with pytest.raises(RecordError, match="end_reason"):  # the result says otherwise
        validate_execution(_execution(["failure", "failure"]), 8, end_reason="success")


def test_an_execution_whose_result_and_records_disagree_is_rejected_not_trained():
    from gyre.rl.builder import build_specs as specs_of
    from gyre.trajectory.batch import ExecutionResult, build_batch

    spec = specs_of(small_config()).trajectory
    good = [ExecutionResult(_execution(["failure"], f"g{i}"), "t", 0.5 * i) for i in range(2)]
    # records say failure (scored 0.5 of the partial credit), the result says success
    bad = ExecutionResult(_execution(["failure"], "b"), "t", 1.0, end_reason="success")
    _, report = build_batch([*good, bad], spec, buckets=(4,))
    assert [i for i, _ in report.rejected] == [2] and "end_reason" in report.rejected[0][1]


def test_a_checkpoint_tensor_of_another_dtype_names_file_and_tensor(tmp_path):
    import shutil

    from gyre.model import hf_dir
    from gyre.model.safetensors_io import CheckpointError

    src = os.path.join(os.path.dirname(__file__), "..", "experiments", "assets", "ledger4_warm")
    shutil.copytree(src, tmp_path / "ck")
    path = tmp_path / "ck" / "model.safetensors"
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header["model.norm.weight"]["dtype"] = "I32"  # same bytes: it loaded as integers
    text = json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(raw[:8] + text + b" " * (n - len(text)) + raw[8 + n :])
    import experiments.quickstart as quickstart

    spec = build_specs(quickstart.get_config()).model
    with pytest.raises(CheckpointError) as e:
        hf_dir.load_params(hf_dir.read(str(path.parent), spec))
    assert str(path) in str(e.value) and "model.norm.weight" in str(e.value)
    assert "I32" in str(e.value) or "int32" in str(e.value)


def test_a_truncated_weights_file_is_refused_when_read_naming_the_tensor(tmp_path):
    import shutil

    from gyre.model import hf_dir
    from gyre.model.safetensors_io import CheckpointError

    src = os.path.join(os.path.dirname(__file__), "..", "experiments", "assets", "ledger4_warm")
    shutil.copytree(src, tmp_path / "ck")
    path = tmp_path / "ck" / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    import experiments.quickstart as quickstart

    spec = build_specs(quickstart.get_config()).model
    with pytest.raises(CheckpointError, match="truncated") as e:
        hf_dir.read(str(path.parent), spec)  # before anything is written into a workdir
    assert str(path) in str(e.value) and "tensor 'model." in str(e.value)


@pytest.mark.slow
def test_a_run_that_fell_back_from_a_damaged_checkpoint_then_holds_every_step(tmp_path, xla_cache):
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    workdir = tmp_path / "run"
    args = [sys.executable, "launch.py", "--config=experiments/quickstart.py:tiny",
            f"--workdir={workdir}", "--config.run.steps=2", "--config.mesh.cell_size=4",
            "--config.sft.steps=0", "--config.eval.tasks=0", "--config.run.tasks_per_step=2",
            "--config.train.checkpoint_every=1",
            f"--config.mesh.cache_dir={xla_cache}"]  # fmt: skip
    launch = lambda: subprocess.run(args, cwd=root, capture_output=True, text=True, timeout=600)
    first = launch()
    assert first.returncode == 0, first.stderr[-2000:]
    for p in (workdir / "checkpoints" / "2").rglob("*"):  # a kill mid-copy, say
        if p.is_file() and "params" in p.parts and p.stat().st_size:
            p.write_bytes(p.read_bytes()[: p.stat().st_size // 3])
    again = launch()
    assert again.returncode == 0, again.stderr[-2000:]
    assert "unreadable" in again.stderr and "resuming from step 1" in again.stderr
    assert (workdir / "checkpoints.unreadable" / "2").is_dir()
    last = launch()  # the re-trained step 2 was saved: nothing is left to do
    assert last.returncode == 0 and "already holds all 2 steps" in last.stdout, last.stderr
    rows = [json.loads(x)["step"] for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    ledger = [json.loads(x)["step"] for x in (workdir / "ledger.jsonl").read_text().splitlines()]
    assert rows == [1, 2] and ledger == [0, 1]
