"""Published code sets as problem sets of the code task: HumanEval- and MBPP-style JSONL files.

``load_problem_set(path, fmt)`` reads a user's file into ``{key: CodeProblem}`` (the same
problems :class:`gyre.envs.code_chat.CodeChatEnv` trains on), chosen by the config keys
``env.problem_file`` ('' = the shipped set) and ``env.problem_format``:

  - ``gyre``: the project's JSON (``{"format": 1, "problems": [...]}``,
    :mod:`gyre.envs.code_problems`): call tests judged outside the sandbox;
  - ``humaneval``: JSONL, one object a line with ``task_id``, ``prompt`` (imports, the
    function's header and docstring), ``entry_point`` (the function) and ``test`` (a module
    that defines ``check(candidate)``); ``canonical_solution`` (the body that completes the
    prompt) is optional. Each top-level statement of ``check`` that holds an ``assert`` is one
    test (run with the other statements of ``check``, the module's own definitions and
    ``candidate`` bound to the program's function); the first one is also shown as the example;
  - ``mbpp``: JSONL with ``task_id``, ``text`` (the description), ``test_list`` (asserts, one
    test each; the first is shown as the example), optional ``test_setup_code`` (run before
    each test) and ``code`` (a reference solution). The function is the one the first assert
    calls;
  - ``auto`` (the default): ``gyre`` for a ``.json`` file, else by the first record's fields
    (``test_list`` -> mbpp, ``entry_point`` and ``test`` -> humaneval).

Published problems are ``kind == "assert"``: their tests are the set's own asserts, run inside
the sandbox and counted by the judge outside it (:meth:`CodeProblem.sandbox_call`). Every
problem records its provenance (``origin``: the file, the line and the set's id). The split is
the shipped set's hash rule on the set's id (``task_id``), so about one problem in five is held
out for evaluation whatever the file's order.
"""

from __future__ import annotations

import ast
import builtins
import json
import os

from gyre.envs.code_problems import DATA_FILE, CodeProblem, ProblemSetError, load_problems

FORMATS = ("auto", "gyre", "humaneval", "mbpp")


def load_problem_set(path: str = "", fmt: str = "auto") -> dict[str, CodeProblem]:
    """The problems in ``path`` ('' = the shipped set) read as ``fmt`` (module docstring)."""
    path = path or DATA_FILE
    if fmt not in FORMATS:
        raise ProblemSetError(f"problem format {fmt!r} is not one of {FORMATS}")
    if not os.path.isfile(path):
        raise ProblemSetError(f"problem file {path!r} does not exist")
    if fmt == "auto":
        fmt = sniff(path)
    if fmt == "gyre":
        return load_problems(os.path.abspath(path))
    records = _records(path)
    make = _humaneval if fmt == "humaneval" else _mbpp
    problems: dict[str, CodeProblem] = {}
    for line, record in records:
        where = f"{path}:{line}"
        problem = make(record, where)
        if problem.key in problems:
            raise ProblemSetError(f"{where}: duplicate task_id {problem.key!r}")
        problems[problem.key] = problem
    if not problems:
        raise ProblemSetError(f"{path}: no problems")
    return problems


def sniff(path: str) -> str:
    """The format ``auto`` reads ``path`` as."""
    if path.endswith(".json"):
        return "gyre"
    records = _records(path)
    first = records[0][1] if records else {}
    if "test_list" in first:
        return "mbpp"
    if "entry_point" in first and "test" in first:
        return "humaneval"
    raise ProblemSetError(
        f"{path}: cannot tell the format from the first record's fields {sorted(first)}; set "
        "env.problem_format to one of gyre, humaneval, mbpp"
    )


def _records(path: str) -> list[tuple[int, dict]]:
    out = []
    with open(path, encoding="utf-8") as f:
        for n, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ProblemSetError(f"{path}:{n}: not valid JSON: {exc}") from None
            if not isinstance(record, dict):
                raise ProblemSetError(f"{path}:{n}: a record must be a JSON object")
            out.append((n, record))
    return out


def _field(record: dict, name: str, where: str, kind=str, optional: bool = False):
    if name not in record:
        if optional:
            return kind()
        raise ProblemSetError(f"{where}: missing field {name!r}")
    value = record[name]
    if not isinstance(value, kind) or (kind is str and not optional and not value.strip()):
        raise ProblemSetError(f"{where}: field {name!r} must be a non-empty {kind.__name__}")
    return value


def _parse(source: str, where: str, what: str) -> ast.Module:
    try:
        return ast.parse(source)
    except SyntaxError as exc:
        raise ProblemSetError(f"{where}: {what} does not parse: {exc}") from None


def _signature(fn: ast.FunctionDef) -> str:
    returns = f" -> {ast.unparse(fn.returns)}" if fn.returns is not None else ""
    return f"{fn.name}({ast.unparse(fn.args)}){returns}"


def _function(tree: ast.Module, name: str) -> ast.FunctionDef | None:
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    return found[-1] if found else None


def _has_assert(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Assert) for n in ast.walk(node))


class _Rename(ast.NodeTransformer):
    def __init__(self, old: str, new: str):
        self.old, self.new = old, new

    def visit_Name(self, node: ast.Name) -> ast.Name:
        return ast.Name(self.new, node.ctx) if node.id == self.old else node


def _humaneval(record: dict, where: str) -> CodeProblem:
    task_id = str(_field(record, "task_id", where, object))
    where = f"{where} ({task_id})"
    prompt = _field(record, "prompt", where)
    entry = _field(record, "entry_point", where)
    test = _field(record, "test", where)
    body = _field(record, "canonical_solution", where, optional=True)
    if not entry.isidentifier():
        raise ProblemSetError(f"{where}: field 'entry_point' must be an identifier, got {entry!r}")
    header = _parse(prompt + "    pass\n", where, "prompt + 'pass'")
    fn = _function(header, entry)
    if fn is None:
        raise ProblemSetError(f"{where}: the prompt does not define {entry!r}")
    module = _parse(test, where, "field 'test'")
    check = _function(module, "check")
    if check is None or len(check.args.args) != 1:
        raise ProblemSetError(f"{where}: field 'test' must define check(candidate)")
    param = check.args.args[0].arg
    rest = [n for n in module.body if n is not check]
    units = [i for i, node in enumerate(check.body) if _has_assert(node)]
    if not units:
        raise ProblemSetError(f"{where}: check() holds no assert")
    setup = ast.unparse(ast.Module(rest, []))
    tests, shown = [], []
    for k in units:
        keep = [node for i, node in enumerate(check.body) if i == k or i not in units]
        one = ast.FunctionDef(name=check.name, args=check.args, body=keep, decorator_list=[])
        code = ast.unparse(ast.fix_missing_locations(ast.Module([one], [])))
        tests.append(f"{code}\ncheck({entry})\n")
        renamed = _Rename(param, entry).visit(ast.parse(ast.unparse(check.body[k])))
        shown.append(ast.unparse(renamed))
    solution = prompt + body if body.strip() else ""
    return CodeProblem(
        name=entry, signature=_signature(fn), description=ast.get_docstring(fn) or "",
        examples=(tests[0],), tests=tuple(tests), solution=solution, kind="assert",
        setup=setup, key=task_id, origin=f"humaneval {where}", prompt=prompt,
        shown=(shown[0],),
    )  # fmt: skip


def _called(assert_source: str) -> str | None:
    """The first function an assert calls by a plain name (MBPP: the function under test)."""
    for node in ast.walk(ast.parse(assert_source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id not in vars(builtins):
                return node.func.id
    return None


def _mbpp(record: dict, where: str) -> CodeProblem:
    task_id = str(_field(record, "task_id", where, object))
    where = f"{where} ({task_id})"
    text = _field(record, "text", where) if "text" in record else _field(record, "prompt", where)
    asserts = _field(record, "test_list", where, list)
    setup = _field(record, "test_setup_code", where, optional=True)
    code = _field(record, "code", where, optional=True)
    if not asserts or not all(isinstance(a, str) and a.strip() for a in asserts):
        raise ProblemSetError(f"{where}: field 'test_list' must be a non-empty list of asserts")
    for i, a in enumerate(asserts):
        if not _has_assert(_parse(a, where, f"test_list[{i}]")):
            raise ProblemSetError(f"{where}: test_list[{i}] is not an assert: {a[:80]!r}")
    entry = _called(asserts[0])
    if entry is None:
        raise ProblemSetError(f"{where}: test_list[0] calls no function by name")
    fn = _function(_parse(code, where, "field 'code'"), entry) if code.strip() else None
    signature = _signature(fn) if fn is not None else f"{entry}(...)"
    tests = tuple(a.strip() + "\n" for a in asserts)
    return CodeProblem(
        name=entry, signature=signature, description=" ".join(text.split()),
        examples=(tests[0],), tests=tests, solution=code, kind="assert", setup=setup,
        key=task_id, origin=f"mbpp {where}", shown=(asserts[0].strip(),),
    )  # fmt: skip
