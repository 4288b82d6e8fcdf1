"""Bad trace lines and bad checkpoint files fail in one line that names the file and the fault."""

import json
import os
import tempfile

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from gyre.elastic.workload import Call, Execution, read_trace, to_json, write_trace
from gyre.model.safetensors_io import CheckpointError, read_file, read_folder

# ---------------------------------------------------------------- trace lines

GOOD = Execution(
    "s0-q0-e0",
    0,
    (Call(100, 5, 1.5, 100, "main"), Call(120, 7, 0.0, 15, "main-summary")),
    600.0,
    0,
    {"start_s": 0.0, "end_s": 9.5, "end_reason": "success"},
)


def line(**changes) -> str:
    """GOOD as a trace line with top-level fields (or call 0's, as call_<key>) changed."""
    d = json.loads(to_json(GOOD))
    d["execution_id"] = "s0-q0-e1"
    for key, value in changes.items():
        if key.startswith("call_"):
            d["calls"][0][key[5:]] = value
        else:
            d[key] = value
    return json.dumps(d)


BAD_LINES = [
    (line(step=float("inf")), "Infinity is not a number"),  # json.dumps writes Infinity
    (line(step=float("nan")), "NaN is not a number"),
    (line(step=1).replace('"step": 1', '"step": 1e999'), "step must be an integer"),
    (line(step=True), "step must be an integer in [0, 2^53], got True"),
    (line(step=1.0), "step must be an integer in [0, 2^53], got 1.0"),
    (line(step=-1), "step must be an integer in [0, 2^53], got -1"),
    (line(step="0"), "step must be an integer"),
    (line(step=2**60), "step must be an integer"),
    (line(group=-1), "group must be an integer"),
    (line(timeout_s=0), "timeout_s must be > 0"),
    (line(timeout_s=float("inf")), "Infinity is not a number"),
    (line(timeout_s="600"), "timeout_s must be a finite number"),
    (line(call_prompt_tokens=-5), "call 0: prompt_tokens must be an integer in [0, 2^53], got -5"),
    (line(call_completion_tokens=0), "call 0: completion_tokens must be an integer in [1, 2^53]"),
    (line(call_completion_tokens=float("nan")), "NaN is not a number"),
    (line(call_new_prompt_tokens=2.5), "call 0: new_prompt_tokens must be an integer"),
    (line(call_new_prompt_tokens=101), "call 0 has more new prompt tokens than prompt tokens"),
    (line(call_tool_latency_s=-1.0), "call 0: tool_latency_s must be a finite number >= 0"),
    (
        line(call_tool_latency_s=1.0).replace("1.0,", "1e999,", 1),
        "call 0: tool_latency_s must be a finite number",
    ),
    (line(call_role="critic"), "call 0 role 'critic' is not one of"),
    (line(call_tokens=3), "call 0 has unknown keys ['tokens']"),
    (line(calls=[]), "calls must be a non-empty list"),
    (line(calls=[5]), "call 0 is not an object"),
    (line(calls={"0": {}}), "calls must be a non-empty list"),
    (line(execution_id=7), "execution_id must be a non-empty string, got 7"),
    (line(execution_id=""), "execution_id must be a non-empty string"),
    (line(execution_id=None), "execution_id must be a non-empty string, got None"),
    (line(measured={"start_s": {"nested": 1}}), "measured must be a flat object"),
    (line(measured=[1]), "measured must be a flat object"),
    (line(measured={"end_s": float("-inf")}), "-Infinity is not a number"),
    (line(measured={"end_s": "late"}), "end_s must be a finite number"),
    (line(execution_id="s0-q0-e0"), "execution id 's0-q0-e0' repeats line 1"),
    ("[1, 2]", "trace line is a list, not an object"),
    ('{"execution_id": ', "not a JSON trace line"),
    ("[" * 100_000, "nesting is too deep for a trace line"),
    ('{"a": ' * 100_000, "nesting is too deep for a trace line"),
]


@pytest.mark.parametrize("text,message", BAD_LINES, ids=[m[:40] for _, m in BAD_LINES])
def test_bad_trace_line_names_file_line_and_fault(tmp_path, text, message):
    path = tmp_path / "trace.jsonl"
    path.write_text(to_json(GOOD) + "\n" + text + "\n")
    with pytest.raises(ValueError) as err:
        read_trace(str(path))
    assert str(err.value).startswith(f"{path}:2: ") and message in str(err.value)
    assert "\n" not in str(err.value) and len(str(err.value)) < 300 + len(str(path))


def test_non_utf8_trace_line(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_bytes(to_json(GOOD).encode() + b"\n\xff\xfe{}\n")
    with pytest.raises(ValueError, match=r"trace.jsonl:2: .*can't decode byte 0xff"):
        read_trace(str(path))


def test_good_trace_still_reads(tmp_path):
    path = tmp_path / "trace.jsonl"
    other = Execution("s1-q0-e0", 1, (Call(3, 1, 0, 3),), 1.0)  # role defaults; ints as times
    write_trace(str(path), [[GOOD], [other]])
    with open(path, "a") as f:
        f.write("\n" + line(step=0, group=2, call_new_prompt_tokens=0, measured=None) + "\n")
    steps = read_trace(str(path))
    assert steps[0][0] == GOOD and steps[1] == [other]
    assert steps[0][1].group == 2 and steps[0][1].measured is None


# ---------------------------------------------------------------- checkpoints


def checkpoint(folder) -> str:
    path = os.path.join(folder, "model.safetensors")
    save_file({"w": np.arange(6, dtype=np.float32).reshape(2, 3),
               "b": np.arange(4).astype(ml_dtypes.bfloat16)}, path)  # fmt: skip
    return path


def with_header(data: bytes, header) -> bytes:
    """``data`` (a safetensors file) with its header replaced by ``header`` (bytes or a dict)."""
    n = int.from_bytes(data[:8], "little")
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data[8 + n :]


def header_of(data: bytes) -> dict:
    return json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])


def test_good_checkpoint_reads(tmp_path):
    checkpoint(tmp_path)
    got = read_folder(str(tmp_path))
    assert got["w"].tolist() == [[0, 1, 2], [3, 4, 5]] and got["b"].dtype == ml_dtypes.bfloat16


def _past_end(data):
    h = header_of(data)
    h["w"]["data_offsets"] = [0, 10_000]
    return with_header(data, h)


def _bf16_too_long(data):
    h = header_of(data)
    h["b"]["shape"] = [400]
    return with_header(data, h)


BAD_FILES = [
    (lambda d: b"", "header length 0 does not fit the file's 0 bytes"),
    (lambda d: d[:5], "does not fit the file's 5 bytes"),
    (lambda d: d[:40], "does not fit the file's 40 bytes (truncated, or not a safetensors file)"),
    (lambda d: d[:-3], "ends at byte 32 of data, past the file's 29 (truncated)"),  # cut short
    (lambda d: (2**40).to_bytes(8, "little") + d[8:], "header length 1099511627776 does not fit"),
    (lambda d: (2**64 - 1).to_bytes(8, "little") + d[8:], "does not fit"),
    (lambda d: with_header(d, b'{"w": '), "header is not JSON"),
    (lambda d: with_header(d, b'{"w": "\xff\xfe"}'), "header is not UTF-8"),
    (lambda d: with_header(d, b"[" * 10_000), "not a valid safetensors file"),
    (lambda d: with_header(d, b"[1, 2]"), "not a valid safetensors file"),
    (_past_end, "not a valid safetensors file"),
    (_bf16_too_long, "not a valid safetensors file"),
]


@pytest.mark.parametrize("fn,message", BAD_FILES, ids=[m[:40] for _, m in BAD_FILES])
def test_bad_checkpoint_is_one_error_naming_the_file(tmp_path, fn, message):
    path = checkpoint(tmp_path)
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(fn(data))
    with pytest.raises(CheckpointError) as err:
        read_folder(str(tmp_path))
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value)
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize("text", ['{"weight_map": ', "[]", '{"weight_map": [1]}'])
def test_bad_index_names_the_index(tmp_path, text):
    checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(CheckpointError, match="model.safetensors.index.json: not a safetensors"):
        read_folder(str(tmp_path))


@settings(max_examples=40, deadline=None)
@given(cut=st.integers(0, 10_000), pos=st.integers(0, 10_000), byte=st.integers(0, 255))
def test_any_truncation_or_header_byte_is_read_or_refused_cleanly(cut, pos, byte):
    """A cut file, or one header byte changed, reads or is a CheckpointError; nothing else."""
    with tempfile.TemporaryDirectory() as folder:
        path = checkpoint(folder)
        with open(path, "rb") as f:
            data = f.read()
        n = 8 + int.from_bytes(data[:8], "little")
        for blob in (
            data[: cut % len(data)],
            data[: pos % n] + bytes([byte]) + data[pos % n + 1 :],
        ):
            with open(path, "wb") as f:
                f.write(blob)
            try:
                read_file(path)
            except CheckpointError as err:
                assert str(err).startswith(path)
