"""Mutation score of the shipped code set: how many simple mutants of the reference solutions
pass every hidden test (a surviving mutant is a wrong program the tests call right).

    python benchmarks/mutants.py                     # the table; the last line is one JSON object
    python benchmarks/mutants.py --survivors         # also print every surviving mutant
    python benchmarks/mutants.py --augment           # add killing hidden tests to the set (below)
    python benchmarks/mutants.py --problems is_prime,median
    python benchmarks/mutants.py --inverses          # also: eval problems undone by train ones

Mutants (``mutants``): one change at one place of a reference solution's syntax tree: an
arithmetic or bitwise operator swapped (+ -, * +, // *, / *, % //, ** *, & |, << >>, ...; augmented
assignments too), a comparison loosened or negated (< <=, > >=, == !=, in / not in, is / is
not), ``and`` <-> ``or``, a ``not`` or unary minus dropped, an integer constant moved by +-1, a
boolean constant flipped, ``min`` <-> ``max``, ``any`` <-> ``all``. A mutant identical to the
reference after unparsing, or to another mutant, is dropped.

Every mutant of a problem runs on its hidden tests in one sandbox run (gyre/envs/sandbox.py;
each call under a 0.5 s timer, so a mutant that loops fails that test) and is judged by the
judge's rule; it survives when every hidden test passes. Survivors read and shown to compute
the reference's function (``EQUIVALENT``, each with why) are counted apart: ``survival`` is
the share of the other mutants that survive, ``raw_survival`` counts every survivor.

``--augment`` strengthens the set: for each problem with survivors it draws inputs near its
own tests' inputs (``draw_inputs``: one or two small edits of an observed input that keep its
shape, numbers within the observed range, sorted and distinct lists so), runs the
reference and the survivors on them in the sandbox, and adds, smallest first, inputs on which
a survivor's result differs from the reference's (the reference's result is the expected
value; inputs the reference raises on are never used), until no survivor the draw can kill is
left. The file is rewritten in its own layout. A survivor no drawn input kills is reported as
possibly equivalent (read it: an equivalent mutant cannot be killed by any test).
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import copy
import json
import math
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gyre.envs.code_problems import DATA_FILE, load_problems  # noqa: E402
from gyre.envs.sandbox import SandboxLimits, run_tests  # noqa: E402

BINOPS = {ast.Add: [ast.Sub], ast.Sub: [ast.Add], ast.Mult: [ast.Add], ast.FloorDiv: [ast.Mult],
          ast.Div: [ast.Mult], ast.Mod: [ast.FloorDiv], ast.Pow: [ast.Mult],
          ast.BitAnd: [ast.BitOr], ast.BitOr: [ast.BitAnd], ast.BitXor: [ast.BitOr],
          ast.LShift: [ast.RShift], ast.RShift: [ast.LShift]}  # fmt: skip
CMPOPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
          ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot,
          ast.IsNot: ast.Is}  # fmt: skip
CALLS = {"min": "max", "max": "min", "any": "all", "all": "any"}
LIMITS = SandboxLimits(cpu_seconds=120, wall_seconds=240, output_bytes=64 * 2**20,
                       total_memory_bytes=2**31)  # fmt: skip
CALL_SECONDS = 0.5

# Mutants that compute the same function as the reference on every input the problem's
# description allows (or differ only in speed within the sandbox's limits): no test can kill
# them. Each was read and is listed with why; the survival rate leaves them out, and a listed
# mutant that some test does kill is reported as a stale entry.
RANGE_START = "range starts one lower/higher at a value the body ignores"
EQUIVALENT = {
    "caesar_shift": {"7:28 ord(c) - 65 -> ord(c) + 65": "130 is 0 modulo 26"},
    "common_prefix": {"5:19 1 -> 0": "words[0] is a prefix of itself"},
    "mask_card": {
        "2:48 len(s) > 4 -> len(s) >= 4": "at length 4 both branches return s",
        "2:57 4 -> 3": "len(s) > 3: at length 4 the mask branch returns s too",
        "2:21 0 -> 1": "the branch runs only when len(s) - 4 >= 1",
        "2:21 0 -> -1": "the branch runs only when len(s) - 4 >= 1",
    },
    "merge_sorted": {"4:11 a[i] <= b[j] -> a[i] < b[j]": "equal ints are indistinguishable"},
    "count_inversions": {"2:78 1 -> 0": "j == i adds nums[i] > nums[i], always False"},
    "top_k_frequent": {
        "4:39 1 -> 2": "every count doubled: the same order",
        "4:34 0 -> 1": "every count shifted by one: the same order",
        "4:34 0 -> -1": "every count shifted by one: the same order",
    },
    "binary_search": {
        "7:11 items[mid] < target -> items[mid] <= target": "equality returned just before",
        "4:27 2 -> 1": "mid = lo + hi scans down from the top: same answers (checked on 1e5 cases)",
    },
    "factorial": {"3:19 2 -> 1": "multiplying by 1"},
    "reverse_integer": {
        "3:17 n < 0 -> n <= 0": "-0 == 0",
        "3:21 0 -> 1": "n < 1 differs from n < 0 only at 0, and -0 == 0",
    },
    "is_perfect_number": {
        "2:11 n > 1 -> n >= 1": "1 is not perfect either way (empty sum 0)",
        "2:15 1 -> 2": "2 is not perfect either way (1 != 2)",
        "2:15 1 -> 0": "n is positive; 1 is not perfect either way",
    },
    "sum_of_squares": {"2:36 1 -> 0": "adds 0 * 0"},
    "count_primes_below": {
        "2:11 3 -> 2": "n == 2 gives 0 through the sieve too",
        "6:19 2 -> 1": "sieve[1] is False: skipped",
        "6:38 1 -> 2": "sieving from i with i * i >= n changes nothing",
        "6:26 n ** 0.5 -> n * 0.5": "the same, slower (i * i >= n changes nothing)",
    },
    "binomial": {
        "5:19 min(k, n - k) -> max(k, n - k)": "C(n, k) == C(n, n - k), computed the long way",
        "5:26 n - k -> n + k": "min(k, n + k) == k: the long way, same value",
    },
    "divisors": {"2:36 1 -> 2": "n + 1 never divides n"},
    "sum_multiples_3_5": {"2:32 1 -> 2": "1 is no multiple", "2:32 1 -> 0": "adds 0"},
    "day_of_year": {
        "3:72 31 -> 32": "December's length is never summed",
        "3:72 31 -> 30": "December's length is never summed",
    },
    "reduce_fraction": {
        "6:7 den < 0 -> den <= 0": "den != 0 (domain), and den // g keeps it",
        "6:13 0 -> 1": "den < 1 is den <= 0, the same for den != 0",
    },
    "is_happy": {
        "3:15 1 -> 2": "1 maps to 1: the loop stops at the repeat",
        "3:15 1 -> 0": "1 maps to 1: the loop stops at the repeat",
    },
    "triangle_type": {
        "3:7 x <= 0 -> x < 0": "x == 0 makes z >= x + y anyway",
        "3:12 0 -> -1": "x == 0 makes z >= x + y anyway",
    },
    "pairs_to_dict": {"5:18 0 -> -1": "vs[-1] is vs[0] when len(vs) == 1"},
    "compress_ranges": {
        "3:10 i < len(nums) -> i <= len(nums)": "the extra round adds nothing",
        "2:19 0 -> -1": "starting at -1 adds nothing: nums[0] != nums[-1] + 1 when sorted",
    },
    "eval_rpn": {
        "17:17 0 -> -1": "a valid expression leaves one value",
        "14:35 a >= 0 -> a > 0": "a == 0 gives q == 0 and -0 == 0",
        "14:47 b >= 0 -> b > 0": "b == 0 divides by zero either way",
        "14:40 0 -> 1": "a >= 1 differs only at a == 0, where q == 0",
        "14:52 0 -> 1": "b >= 1 differs only at b == 0 (no division by zero in the domain)",
    },
    "strip_comments": {"2:37 1 -> 2": "only the part before the first '#' is kept"},
    "lcs_length": {"2:27 1 -> 2": "the extra cell is dropped after the first row; 0 for empty a"},
    "min_coins": {
        "4:19 1 -> 0": "amount 0: no positive coin fits",
        "6:26 best[v - c] + 1 < best[v] -> best[v - c] + 1 <= best[v]": "rewrites an equal value",
        "6:40 1 -> 0": "best[v - c] < best[v] rewrites an equal or better value: the same minimum",
    },
    "grid_shortest_path": {"4:37 0 -> -1": "rows have equal length"},
    "subsets": {"5:50 1 -> 2": "no combinations longer than the list"},
    "knapsack": {"2:29 1 -> 2": "an extra capacity cell that is never read"},
    "min_path_sum": {
        "2:37 0 -> -1": "rows have equal length",
        "3:13 0 -> 1": "every cell is written before it is read",
        "3:13 0 -> -1": "every cell is written before it is read",
        "6:20 0 -> -1": "the first cell is then computed from best[0][-1], still 0",
        "6:31 0 -> -1": "the first cell is then computed from best[-1][0], still 0",
    },
    "word_break": {
        "2:19 False -> True": "every ok[i] is recomputed before it is read",
        "4:78 0 < len(w) <= i -> 0 <= len(w) <= i": "an empty word reads ok[i], still False",
        "4:78 0 -> -1": "an empty word reads ok[i], still False",
    },
    "shortest_path_length": {
        "8:17 0 -> 1": "the source's own distance is never compared below 0",
        "17:15 d + w -> d - w": "extra heap entries; the first pop of dst is still the least",
    },
    "has_cycle": {"11:19 2 -> 3": "any state other than 0 and 1 means done"},
    "josephus": {"3:19 2 -> 1": "pos % 1 == 0 is the start"},
    "house_robber": {"2:17 0 -> -1": "the first 'take' is overwritten before it is read"},
    "balanced_split": {"3:31 1 -> 2": "the split at len(nums) + 1 is never reached"},
    "next_greater": {"4:45 1 -> 0": "x > x is False"},
}

DISPATCH = """
import signal

class _Slow(BaseException):
    pass

def _alarm(signum, frame):
    raise _Slow()

signal.signal(signal.SIGALRM, _alarm)
FUNCTIONS = {{}}
for _k, _source in {sources!r}.items():
    _ns = {{"__name__": "mutant_%d" % _k}}
    try:
        exec(compile(_source, "mutant_%d" % _k, "exec"), _ns)
        FUNCTIONS[_k] = _ns[{name!r}]
    except BaseException:
        pass

def dispatch(k, args):
    signal.setitimer(signal.ITIMER_REAL, {seconds})
    try:
        return FUNCTIONS[k](*args)
    except _Slow:
        raise TimeoutError("slow") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
"""


# ----------------------------------------------------------------------------------- mutants
def _changes(node: ast.AST) -> list:
    """The one-place changes of this node, as functions that apply one to a copy of it."""
    out = []
    if isinstance(node, (ast.BinOp, ast.AugAssign)):
        for new in BINOPS.get(type(node.op), []):
            out.append(lambda n, new=new: setattr(n, "op", new()))
    elif isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            if type(op) in CMPOPS:
                out.append(lambda n, i=i: n.ops.__setitem__(i, CMPOPS[type(n.ops[i])]()))
    elif isinstance(node, ast.BoolOp):
        out.append(lambda n: setattr(n, "op", ast.Or() if isinstance(n.op, ast.And) else ast.And()))
    elif isinstance(node, ast.Constant) and type(node.value) is bool:
        out.append(lambda n: setattr(n, "value", not n.value))
    elif isinstance(node, ast.Constant) and type(node.value) is int:
        out.append(lambda n: setattr(n, "value", n.value + 1))
        out.append(lambda n: setattr(n, "value", n.value - 1))
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in CALLS:
        out.append(lambda n: setattr(n.func, "id", CALLS[n.func.id]))
    return out


class _DropUnary(ast.NodeTransformer):
    def __init__(self, target: int):
        self.target, self.seen = target, -1

    def visit_UnaryOp(self, node):
        self.generic_visit(node)
        if isinstance(node.op, (ast.Not, ast.USub)):
            self.seen += 1
            if self.seen == self.target:
                return node.operand
        return node


def mutants(solution: str) -> list[tuple[str, str]]:
    """[(what changed, mutant source)] of one reference solution (module docstring)."""
    tree = ast.parse(solution)
    base = ast.unparse(tree)
    found: dict[str, str] = {}
    nodes = list(ast.walk(tree))
    for index, node in enumerate(nodes):
        for change in _changes(node):
            copied = copy.deepcopy(tree)
            target = list(ast.walk(copied))[index]
            before = ast.unparse(target)
            change(target)
            source = ast.unparse(copied)
            if source != base and source not in found:
                at = f"{getattr(node, 'lineno', '?')}:{getattr(node, 'col_offset', '?')}"
                found[source] = f"{at} {before} -> {ast.unparse(target)}"
    unary = sum(isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.Not, ast.USub)) for n in nodes)
    for k in range(unary):
        copied = _DropUnary(k).visit(copy.deepcopy(tree))
        source = ast.unparse(copied)
        if source != base and source not in found:
            found[source] = f"unary operator {k} dropped"
    return [(what, source) for source, what in found.items()]


# ----------------------------------------------------------------------------------- running
def _same(got, expected) -> bool:
    """The judge's rule (gyre/envs/sandbox.py), on values that came through JSON."""
    try:
        return type(got) is type(expected) and bool(got == expected)
    except Exception:
        return False


async def _outcomes(name: str, sources: list[str], inputs: list[list], sem) -> list[list]:
    """[source][input] -> ('value', v) or ('error', verdict), from one sandbox run."""
    source = DISPATCH.format(sources=dict(enumerate(sources)), name=name, seconds=CALL_SECONDS)
    cases = [((k, list(args)), None) for k in range(len(sources)) for args in inputs]
    async with sem:
        result = await run_tests(source, "dispatch", cases, LIMITS)
    if len(result.results) != len(cases):  # a MemoryError in one call still reports them all
        raise RuntimeError(f"{name}: the batch did not finish ({result.status}: {result.detail})")
    out, i = [], 0
    for _ in sources:
        row = []
        for _ in inputs:
            verdict, value = result.results[i], result.outputs[i]
            row.append(("error", verdict) if verdict.startswith("error") else ("value", value))
            i += 1
        out.append(row)
    return out


def _killed(row, tests) -> bool:
    return any(o[0] != "value" or not _same(o[1], want) for o, (_, want) in zip(row, tests))


async def score(problems, jobs: int = 2) -> dict:
    """{name: (mutants [(what, source)], survivors [(what, source)])}."""
    sem = asyncio.Semaphore(jobs)

    async def one(p):
        ms = mutants(p.solution)
        if not ms:
            return p.name, (ms, [])
        rows = await _outcomes(p.name, [s for _, s in ms], [list(a) for a, _ in p.tests], sem)
        return p.name, (ms, [m for m, row in zip(ms, rows) if not _killed(row, p.tests)])

    return dict(await asyncio.gather(*(one(p) for p in problems)))


# ----------------------------------------------------------------------------------- inverses
async def inverse_pairs(problems, jobs: int = 2, min_tests: int = 3) -> list[tuple[str, str]]:
    """[(a, b)]: problems in different splits where b undoes a: for every test of ``a`` with one
    argument (at least ``min_tests``), b's reference maps a's expected value back to the input.
    Such a pair leaks an eval problem's answers through training on its inverse."""
    sem = asyncio.Semaphore(jobs)
    unary = {p.name: [(a[0], want) for a, want in p.tests if len(a) == 1] for p in problems}
    unary = {n: t for n, t in unary.items() if len(t) >= min_tests}
    split = {p.name: p.split for p in problems}

    def kinds(values) -> set:
        return {type(_expected(v)).__name__ for v in values}

    takes = {p.name: kinds(a[0] for a, _ in p.tests) for p in problems if p.name in unary}

    async def undoes(b):
        # only a whose outputs are of the types b takes: b's reference never sees odd inputs
        sources = [a for a in unary if split[a] != split[b.name]
                   and kinds(w for _, w in unary[a]) <= takes[b.name]]  # fmt: skip
        # Two rounds: each a's first test, then the other tests of the a that passed it (an
        # inverse passes them all). Most a fail at once, so b's reference runs on far fewer
        # inputs: collatz_steps on every other output timed out 55 times, 27 s of the 41.
        for tests in (lambda t: t[:1], lambda t: t[1:]):
            inputs = [[want] for a in sources for _, want in tests(unary[a])]
            if not inputs:
                break
            try:
                (row,) = await _outcomes(b.name, [b.solution], inputs, sem)
            except RuntimeError as exc:  # b's reference cannot run on some: not an inverse
                print(f"inverse check: {exc}", file=sys.stderr)
                return []
            kept, i = [], 0
            for a in sources:
                these = tests(unary[a])
                if all(o[0] == "value" and _same(o[1], _expected(x))
                       for o, (x, _) in zip(row[i : i + len(these)], these)):  # fmt: skip
                    kept.append(a)
                i += len(these)
            sources = kept
        return [(a, b.name) for a in sources]

    ones = [p for p in problems if p.name in unary]
    return sorted(
        pair for pairs in await asyncio.gather(*(undoes(b) for b in ones)) for pair in pairs
    )


def _expected(value):
    return json.loads(json.dumps(value))


# ---------------------------------------------------------------------------------- augmenting
def _pool(values: list, out: dict) -> dict:
    """Every observed scalar by type, and every observed string's characters, recursively."""
    for v in values:
        out.setdefault(type(v), []).append(v)
        if isinstance(v, str):
            out.setdefault("chars", set()).update(v)
        elif isinstance(v, list):
            _pool(v, out)
        elif isinstance(v, dict):
            _pool(list(v.values()), out)
    return out


def _perturb(v, pool: dict, rng: random.Random, lo=None, hi=None):
    """One small edit of an observed value that keeps its shape: a number moved within the
    observed range, one character of a string replaced / inserted / deleted (a string among
    equal-length strings keeps its length), one list element edited, replaced from the pool,
    dropped or duplicated (sortedness and distinctness kept), one dict value edited."""
    if isinstance(v, bool):
        return not v
    if isinstance(v, (int, float)):
        nums = [x for x in pool.get(type(v), []) if not isinstance(x, bool)]
        lo = min(nums, default=v) if lo is None else lo
        hi = max(nums, default=v) if hi is None else hi
        new = rng.choice(nums) if nums and rng.random() < 0.3 else v + rng.choice([-2, -1, 1, 2])
        new = min(max(new, lo), hi)
        return round(float(new), 2) if isinstance(v, float) else int(new)
    if isinstance(v, str):
        alphabet = sorted(pool.get("chars", set()) or set("ab"))
        s = list(v)
        edit = rng.choice(["replace", "insert", "delete"]) if not pool.get("rect") else "replace"
        if edit == "insert" or not s:
            s.insert(rng.randint(0, len(s)), rng.choice(alphabet))
        elif edit == "delete":
            del s[rng.randrange(len(s))]
        else:
            s[rng.randrange(len(s))] = rng.choice(alphabet)
        return "".join(s)
    if isinstance(v, list):
        out = copy.deepcopy(v)
        rect = bool(out) and all(isinstance(x, (str, list)) for x in out) and len(
            {len(x) for x in out}) == 1 and len(out) > 1  # fmt: skip
        sub = dict(pool, rect=rect)
        edit = rng.choice(["edit", "edit", "drop", "dup"]) if out else "dup"
        if edit == "edit":
            i = rng.randrange(len(out))
            out[i] = _perturb(out[i], sub, rng)
        elif edit == "drop" and not rect:
            del out[rng.randrange(len(out))]
        elif edit == "dup" and out and not rect:
            out.insert(rng.randrange(len(out) + 1), copy.deepcopy(rng.choice(out)))
        if len(v) > 1 and _sorted(v):
            try:
                out = sorted(out)
            except TypeError:
                pass
        if len(v) > 1 and _distinct(v) and not _distinct(out):
            return copy.deepcopy(v)
        return out
    if isinstance(v, dict) and v:
        out = copy.deepcopy(v)
        key = rng.choice(sorted(out, key=str))
        out[key] = _perturb(out[key], pool, rng)
        return out
    return v


def _sorted(v) -> bool:
    try:
        return all(a <= b for a, b in zip(v, v[1:]))
    except TypeError:
        return False


def _distinct(v) -> bool:
    return all(not _same(a, b) for i, a in enumerate(v) for b in v[i + 1 :])


def draw_inputs(p, n: int, seed: int = 0) -> list[list]:
    """``n`` distinct inputs near ``p``'s own: one or two small edits (``_perturb``) of an
    observed input, each argument kept within what its position shows (numbers within the
    observed range), so an input stays inside the problem's domain."""
    rng = random.Random(f"{seed}/{p.name}")
    observed = [list(a) for a, _ in (*p.examples, *p.tests)]
    columns = list(zip(*observed))
    pools = [_pool(list(col), {}) for col in columns]
    ranges = [(min(c), max(c)) if all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                      for x in c) else (None, None) for c in columns]  # fmt: skip
    seen = {json.dumps(a) for a in observed}
    out = []
    for _ in range(n * 6):
        args = copy.deepcopy(rng.choice(observed))
        for _ in range(rng.choice([1, 1, 2])):
            i = rng.randrange(len(args)) if args else 0
            if args:
                args[i] = _perturb(args[i], pools[i], rng, *ranges[i])
        key = json.dumps(args)
        if key not in seen and len(key) <= 160:
            seen.add(key)
            out.append(args)
        if len(out) == n:
            break
    return out


def _readable(value) -> bool:
    text = json.dumps(value)
    return len(text) <= 200 and not (isinstance(value, float) and not math.isfinite(value))


async def augment(problems, survivors: dict, jobs: int = 2, draws: int = 400,
                  per_problem: int = 8) -> dict:  # fmt: skip
    """{name: ([new (args, expected)], [survivors left])}: tests that kill what the draw can
    of each problem's survivors."""
    sem = asyncio.Semaphore(jobs)

    async def one(p):
        alive = survivors[p.name][1]
        if not alive:
            return p.name, [], []
        inputs = draw_inputs(p, draws)
        if not inputs:
            return p.name, [], [w for w, _ in alive]
        rows = await _outcomes(p.name, [p.solution] + [s for _, s in alive], inputs, sem)
        ref = rows[0]
        usable = [i for i, o in enumerate(ref) if o[0] == "value" and _readable(o[1])]
        kills = {i: {k for k in range(len(alive))
                     if rows[k + 1][i][0] != "value" or not _same(rows[k + 1][i][1], ref[i][1])}
                 for i in usable}  # fmt: skip
        left, added = set(range(len(alive))), []
        while left and len(added) < per_problem:
            best = max(usable, key=lambda i: (len(kills[i] & left), -len(json.dumps(inputs[i]))))
            if not kills[best] & left:
                break
            left -= kills[best]
            added.append((inputs[best], ref[best][1]))
        return p.name, added, [alive[k][0] for k in sorted(left)]

    results = await asyncio.gather(*(one(p) for p in problems))
    return {name: (added, left) for name, added, left in results}


def write_set(path: str, data: dict) -> None:
    """The problem file in its own layout: one test per line."""
    lines = ["{", f'  "format": {data["format"]},', '  "problems": [']
    for j, p in enumerate(data["problems"]):
        lines.append("    {")
        fields = list(p)
        for k, field in enumerate(fields):
            comma = "," if k < len(fields) - 1 else ""
            if field in ("examples", "tests"):
                lines.append(f'      "{field}": [')
                for t, test in enumerate(p[field]):
                    sep = "," if t < len(p[field]) - 1 else ""
                    lines.append(f"        {json.dumps(test, ensure_ascii=False)}{sep}")
                lines.append(f"      ]{comma}")
            else:
                lines.append(f'      "{field}": {json.dumps(p[field], ensure_ascii=False)}{comma}')
        lines.append("    }" + ("," if j < len(data["problems"]) - 1 else ""))
    lines += ["  ]", "}"]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


# -------------------------------------------------------------------------------------- main
def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--file", default=DATA_FILE)
    ap.add_argument("--problems", default="", help="comma-separated names (default: all)")
    ap.add_argument("--survivors", action="store_true", help="print every surviving mutant")
    ap.add_argument("--augment", action="store_true", help="add killing tests to --file")
    ap.add_argument("--jobs", type=int, default=2, help="sandbox runs at once")
    ap.add_argument(
        "--inverses",
        action="store_true",
        help="also list train/eval pairs where one problem undoes the other",
    )
    args = ap.parse_args(argv)
    problems = list(load_problems(os.path.abspath(args.file)).values())
    if args.problems:
        wanted = set(args.problems.split(","))
        problems = [p for p in problems if p.name in wanted]
    scored = asyncio.run(score(problems, args.jobs))
    summary = {"problems": len(problems)}
    if args.augment:
        added = asyncio.run(augment(problems, scored, args.jobs))
        with open(args.file, encoding="utf-8") as f:
            data = json.load(f)
        for entry in data["problems"]:
            for inp, want in added.get(entry["name"], ([], []))[0]:
                entry["tests"].append({"args": inp, "expected": want})
                print(f"added: {entry['name']}{tuple(inp)!r} -> {want!r}")
        write_set(args.file, data)
        summary["tests_added"] = sum(len(a) for a, _ in added.values())
        load_problems.cache_clear()
        problems = [load_problems(os.path.abspath(args.file))[p.name] for p in problems]
        scored = asyncio.run(score(problems, args.jobs))
    total = sum(len(m) for m, _ in scored.values())
    equivalent, alive, stale = 0, 0, []
    print(f"{'problem':28s} {'tests':>5s} {'mutants':>7s} {'equiv.':>7s} {'survive':>7s}")
    for p in problems:
        ms, surv = scored[p.name]
        listed = EQUIVALENT.get(p.name, {})
        eq = [w for w, _ in surv if w in listed]
        left = [w for w, _ in surv if w not in listed]
        stale += [f"{p.name}: {w}" for w in listed if w not in eq]
        equivalent, alive = equivalent + len(eq), alive + len(left)
        if left or args.survivors:
            print(f"{p.name:28s} {len(p.tests):5d} {len(ms):7d} {len(eq):7d} {len(left):7d}")
        for what in left:
            print(f"    survives: {what}")
        if args.survivors:
            for what in eq:
                print(f"    equivalent: {what}  ({listed[what]})")
    hidden = sum(len(p.tests) for p in problems)
    print(f"{'all':28s} {hidden:5d} {total:7d} {equivalent:7d} {alive:7d}")
    for entry in stale:
        print(f"stale EQUIVALENT entry (killed, or no longer a mutant): {entry}")
    summary.update(mutants=total, equivalent=equivalent, survivors=alive,
                   survival=round(alive / max(total - equivalent, 1), 4),
                   raw_survival=round((alive + equivalent) / max(total, 1), 4),
                   stale_equivalent=len(stale), hidden_tests=hidden)  # fmt: skip
    if args.inverses:
        pairs = asyncio.run(inverse_pairs(problems, args.jobs))
        for a, b in pairs:
            print(f"inverse pair across the split: {b} undoes {a}")
        summary["inverse_pairs"] = len(pairs)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
