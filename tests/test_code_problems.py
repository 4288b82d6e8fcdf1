"""The shipped code problem set: its size and shape, the stable split, every reference solution
passing its own tests in the real sandbox (one batched run), and clear errors for bad entries."""

import asyncio
import copy
import hashlib
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.envs.code_problems import (
    DATA_FILE,
    ProblemSetError,
    load_problems,
    parse_problems,
    split_names,
    split_of,
)
from gyre.envs.sandbox import SandboxLimits, run_tests

PROBLEMS = load_problems()
with open(DATA_FILE, encoding="utf-8") as _f:
    RAW = json.load(_f)
VALID = RAW["problems"][0]  # a well-formed entry the malformed cases start from


def test_the_set_is_large_varied_and_well_formed():
    assert len(PROBLEMS) >= 120
    for p in PROBLEMS.values():
        assert p.signature.startswith(p.name + "(") and len(p.description) > 20
        assert 1 <= len(p.examples) <= 2 and len(p.tests) >= 4
        # A constant function must fail some hidden test: the tests tell answers apart.
        assert len({json.dumps(e, sort_keys=True) for _, e in p.tests}) > 1, p.name
        # Hidden inputs are not the visible ones (the prompt would give them away).
        assert not {json.dumps(a) for a, _ in p.examples} & {json.dumps(a) for a, _ in p.tests}
    kinds = {type(e).__name__ for p in PROBLEMS.values() for _, e in p.tests}
    assert kinds >= {"str", "int", "bool", "list", "dict", "float", "NoneType"}


def test_split_is_the_documented_hash_rule_disjoint_and_big_enough():
    def rule(name):  # the module docstring's rule, written out independently
        return int(hashlib.sha256(f"gyre-code-split/{name}".encode()).hexdigest()[:8], 16) % 5 == 0

    train, held_out = split_names(PROBLEMS, "train"), split_names(PROBLEMS, "eval")
    assert held_out == sorted(n for n in PROBLEMS if rule(n))
    assert train == sorted(n for n in PROBLEMS if not rule(n))
    assert not set(train) & set(held_out) and set(train) | set(held_out) == set(PROBLEMS)
    assert len(held_out) >= 20 and 0.1 <= len(held_out) / len(PROBLEMS) <= 0.3
    # Pinned: a change to the rule (which would leak eval problems into training) fails here.
    assert [split_of(n) for n in ("reverse_words", "is_prime", "gcd", "flatten", "chunk")] == [
        "eval", "eval", "train", "eval", "train"
    ]  # fmt: skip
    assert all(PROBLEMS[n].split == "eval" for n in held_out)
    with pytest.raises(ValueError, match="split must be one of"):
        split_names(PROBLEMS, "test")


# One module holding every reference solution, each executed in a namespace of its own (their
# helpers and imports cannot collide), and a dispatcher: one sandbox run judges them all.
DISPATCH = """
SOURCES = {sources}
FUNCTIONS = {{}}
for _name, _source in SOURCES.items():
    _namespace = {{"__name__": "solution_" + _name}}
    exec(compile(_source, _name, "exec"), _namespace)
    FUNCTIONS[_name] = _namespace[_name]

def dispatch(mode, name, args):
    if mode == "constant":  # a wrong solution: always the first hidden test's answer
        return CONSTANTS[name]
    return FUNCTIONS[name](*args)

CONSTANTS = {constants}
"""


@pytest.mark.sandbox
def test_every_reference_solution_passes_its_tests_in_the_sandbox_and_a_wrong_one_fails():
    sources = {n: p.solution for n, p in PROBLEMS.items()}
    constants = {n: p.tests[0][1] for n, p in PROBLEMS.items()}
    source = DISPATCH.format(sources=repr(sources), constants=repr(constants))
    cases = [("reference", n, list(args), want) for n, p in PROBLEMS.items()
             for args, want in (*p.examples, *p.tests)]  # fmt: skip
    cases += [
        ("constant", n, list(args), want) for n, p in PROBLEMS.items() for args, want in p.tests
    ]
    tests = [((mode, n, args), want) for mode, n, args, want in cases]
    limits = SandboxLimits(cpu_seconds=30, wall_seconds=60, output_bytes=16 * 2**20)
    result = asyncio.run(run_tests(source, "dispatch", tests, limits))
    assert result.status == "ok", result.detail
    failed = {
        n
        for (mode, n, _, _), v in zip(cases, result.results)
        if mode == "reference" and v != "pass"
    }
    assert not failed, sorted(failed)
    caught = {
        n for (mode, n, _, _), v in zip(cases, result.results) if mode == "constant" and v != "pass"
    }
    assert caught == set(PROBLEMS)


def _with(change):
    entry = copy.deepcopy(VALID)
    change(entry)
    return {"format": 1, "problems": [entry, copy.deepcopy(RAW["problems"][1])]}


MALFORMED = [  # (change to the first entry, what the error must say)
    (lambda e: e.pop("tests"), "missing fields ['tests']"),
    (lambda e: e.update(extra=1), "unknown fields ['extra']"),
    (
        lambda e: e.update(tests=e["tests"][:3]),
        "field 'tests' must be a list of at least 4 tests, got 3",
    ),
    (lambda e: e.update(examples=[]), "field 'examples' must be a list of 1 to 2 tests, got 0"),
    (lambda e: e.update(examples=e["tests"][:3]), "field 'examples' must be a list of 1 to 2"),
    (lambda e: e["tests"][2].pop("expected"), "field 'tests'[2] must be an object with keys"),
    (lambda e: e["tests"][1].update(args="abc"), "field 'tests'[1].args must be a list"),
    (
        lambda e: e.update(name="not a name", signature="not a name(x)"),
        "must be a Python identifier",
    ),
    (lambda e: e.update(name="class"), "must be a Python identifier"),
    (lambda e: e.update(signature="other(s)"), "field 'signature' must start with"),
    (lambda e: e.update(description="  "), "field 'description' must be a non-empty string"),
    (lambda e: e.update(solution=7), "field 'solution' must be a non-empty string"),
    (lambda e: e.update(solution="def broken(:\n"), "field 'solution' does not compile"),
    (lambda e: e.update(solution="def other(s):\n    return s\n"), "field 'solution' must define"),
]


@pytest.mark.parametrize("change, message", MALFORMED)
def test_malformed_entries_name_the_problem_and_the_field(change, message):
    with pytest.raises(ProblemSetError) as info:
        parse_problems(_with(change), "problems.json")
    text = str(info.value)
    assert message in text and text.startswith("problems.json: problem 0")
    if VALID["name"] in text:
        assert f"problem 0 ({VALID['name']!r})" in text


def test_malformed_files_are_clear(tmp_path):
    dup = {"format": 1, "problems": [VALID, RAW["problems"][1], VALID]}
    with pytest.raises(ProblemSetError, match=f"problem 2: duplicate name {VALID['name']!r}"):
        parse_problems(dup)
    for data in ({"format": 2, "problems": []}, [], {"format": 1, "problems": []}):
        with pytest.raises(ProblemSetError, match="code_problems.json: "):
            parse_problems(data)
    with pytest.raises(ProblemSetError, match="problem 0 must be an object"):
        parse_problems({"format": 1, "problems": ["x"]})
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(ProblemSetError, match=f"{path}: not valid JSON"):
        load_problems(str(path))
    path = tmp_path / "one.json"
    path.write_text(json.dumps({"format": 1, "problems": [VALID]}))
    assert list(load_problems(str(path))) == [VALID["name"]]
    assert load_problems(str(path)) is load_problems(str(path))  # cached per path


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    field=st.sampled_from([*VALID, "tests.0", "tests.0.args", "examples.0", "extra"]), value=JSON
)
def test_any_corrupted_field_is_accepted_or_a_problem_set_error(field, value):
    """Whatever a field is replaced with, the loader never fails with anything but its own error."""
    entry = copy.deepcopy(VALID)
    *path, last = field.split(".")
    target = entry
    for key in path:
        target = target[int(key)] if isinstance(target, list) else target[key]
    target[int(last) if isinstance(target, list) else last] = value
    try:
        parse_problems({"format": 1, "problems": [entry]})
    except ProblemSetError as exc:
        assert str(exc).startswith("code_problems.json: problem 0")
