"""A run killed at random points loses nothing: issue 36's done-when, as a script.

    python scripts/kill_run.py --steps=40 --kills=10 --seed=0 --base=/tmp/kill_run

1. An uninterrupted reference run (the tiny quickstart model, a 120-step warm start shared by
   both runs, a checkpoint every ``--checkpoint_every`` steps so that resumes cut rows back).
2. The same run launched again and again, each launch SIGKILLed at a seeded random point, until
   one finishes: after a random wall-clock delay (start-up, compiles, loading, a step, a
   checkpoint write), after a random number of this launch's micro-batches, right after the
   checkpoint restore of a resume, inside the atomic rewrite that cuts the run files back on
   resume, or just after a checkpoint save started (tests/killable_launch.py).
3. The newest checkpoint of the finished run damaged; relaunches (the first of them killed
   right after its restore) until one finishes; then one more, which must say that the workdir
   already holds every step.
4. metrics.jsonl, ledger.jsonl and trace.jsonl of the killed run checked against the
   reference's: every step present once, no line lost or duplicated, every execution traced
   once, and the ledger and every field that does not measure time equal bit for bit
   (:func:`compare`). Prints the figures as one JSON object (and --out writes it).

The checker is tested in tests/test_kill_run.py (a short run too, marked slow).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Fields of a metrics row that measure time or depend on the wall clock through the
# scheduler's choices (which cell served what, role fractions, pool occupancy): not compared.
# Everything else (rewards, tokens, losses, gradient norms, versions, ...) must be bit-equal.
TIMED = re.compile(r"^(time|step_seconds|eval_seconds|timeline_s|last_checkpoint_seconds)$"
                   r"|_s$|_per_s$|^role_|^kv_|^policy_|^handover_|^prefix_hit_rate$")  # fmt: skip
# Fields of a trace line that measure time.
TRACE_TIMED = ("measured",)
CALL_TIMED = ("tool_latency_s",)

KINDS = ("wall", "microbatch", "restore", "rewrite", "save")


def _lines(path: str) -> list[dict]:
    """The JSON lines of ``path``; a line that does not parse is a finding, not skipped."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                out.append({"__broken__": f"{os.path.basename(path)} line {n}"})
    return out


def _untimed_row(row: dict) -> dict:
    return {k: v for k, v in row.items() if not TIMED.search(k)}


def _untimed_trace(line: dict) -> dict:
    out = {k: v for k, v in line.items() if k not in TRACE_TIMED}
    if "calls" in out:
        out["calls"] = [{k: v for k, v in c.items() if k not in CALL_TIMED} for c in out["calls"]]
    return out


def _steps_once(name: str, steps: list, want: list) -> list[str]:
    """Problems with a file's step numbers: each of ``want`` exactly once, in order."""
    problems = []
    seen = set()
    dup = sorted({s for s in steps if s in seen or seen.add(s)})
    if dup:
        problems.append(f"{name}: steps {dup} written more than once")
    lost = sorted(set(want) - set(steps))
    if lost:
        problems.append(f"{name}: steps {lost} lost")
    extra = sorted(set(steps) - set(want))
    if extra:
        problems.append(f"{name}: steps {extra} not in the run")
    if not problems and steps != want:
        problems.append(f"{name}: steps out of order")
    return problems


def compare(reference: str, killed: str, steps: int) -> dict:
    """Checks the killed run's files against the reference's -> {"problems": [one line each],
    "metrics_rows", "ledger_lines", "trace_lines", "fields_compared", "fields_skipped"}."""
    problems: list[str] = []
    files = {}
    for name in ("metrics.jsonl", "ledger.jsonl", "trace.jsonl"):
        files[name] = (_lines(os.path.join(reference, name)), _lines(os.path.join(killed, name)))
        for which, rows in zip(("reference", "killed"), files[name]):
            problems += [f"{which} {r['__broken__']} is not JSON" for r in rows
                         if "__broken__" in r]  # fmt: skip
    if problems:
        return {"problems": problems}
    (ref_m, got_m), (ref_l, got_l), (ref_t, got_t) = files.values()
    rows_want, ledger_want = list(range(1, steps + 1)), list(range(steps))
    for which, m, ledger in (("reference", ref_m, ref_l), ("killed", got_m, got_l)):
        problems += _steps_once(f"{which} metrics.jsonl", [r.get("step") for r in m], rows_want)
        problems += _steps_once(f"{which} ledger.jsonl", [r.get("step") for r in ledger],
                                ledger_want)  # fmt: skip
    if not any(r.get("grad_norm") for r in ref_m):
        problems.append("reference metrics.jsonl: every grad_norm is 0 (nothing trained: the "
                        "comparison would be vacuous)")  # fmt: skip
    # the ledger: bit for bit (every execution trained by the same step, once)
    for a, b in zip(ref_l, got_l):
        if a != b:
            problems.append(f"ledger.jsonl step {b.get('step')}: differs from the reference")
    ids = [i for row in got_l for i in row.get("executions", ())]
    if len(ids) != len(set(ids)):
        problems.append("ledger.jsonl: an execution trained twice")
    # metrics: every field that does not measure time, bit for bit
    compared, skipped = set(), set()
    for a, b in zip(ref_m, got_m):
        ua, ub = _untimed_row(a), _untimed_row(b)
        compared |= ua.keys() | ub.keys()
        skipped |= (a.keys() | b.keys()) - compared
        diff = sorted(k for k in ua.keys() | ub.keys() if ua.get(k, "?") != ub.get(k, "?"))
        if diff:
            problems.append(f"metrics.jsonl step {b.get('step')}: {diff[:5]} differ "
                            f"({', '.join(f'{k}={ua.get(k)!r}/{ub.get(k)!r}' for k in diff[:2])})")  # fmt: skip
    # the trace: one line per trained execution, each once, equal but for its times
    for which, trace, ledger in (("reference", ref_t, ref_l), ("killed", got_t, got_l)):
        tids = [t.get("execution_id") for t in trace]
        dup = sorted({i for i in tids if tids.count(i) > 1})
        if dup:
            problems.append(f"{which} trace.jsonl: {len(dup)} executions traced more than once "
                            f"(e.g. {dup[0]})")  # fmt: skip
        trained = {i for row in ledger for i in row.get("executions", ())}
        lost = sorted(trained - set(tids))
        if lost:
            problems.append(f"{which} trace.jsonl: {len(lost)} trained executions not traced "
                            f"(e.g. {lost[0]})")  # fmt: skip
    key = lambda t: (t.get("step", -1), str(t.get("execution_id")))  # noqa: E731
    ref_by = {key(t): _untimed_trace(t) for t in ref_t}
    got_by = {key(t): _untimed_trace(t) for t in got_t}
    if ref_by.keys() != got_by.keys():
        missing, extra = len(ref_by.keys() - got_by.keys()), len(got_by.keys() - ref_by.keys())
        problems.append(f"trace.jsonl: {missing} lines of the reference missing, {extra} extra")
    for k in sorted(ref_by.keys() & got_by.keys()):
        if ref_by[k] != got_by[k]:
            problems.append(f"trace.jsonl step {k[0]} {k[1]}: differs from the reference")
            break
    return {"problems": problems, "metrics_rows": len(got_m), "ledger_lines": len(got_l),
            "trace_lines": len(got_t), "fields_compared": len(compared),
            "fields_skipped": sorted(skipped)}  # fmt: skip


def plan(seed: int, kills: int, steps: int, every: int) -> list[tuple[str, float]]:
    """The kills, in order: (kind, where) with where a delay in seconds (wall: up to about a
    whole launch, so start-up, compiles and loading are hit as well as steps), a count of this
    launch's micro-batches (microbatch), a checkpoint save's occurrence (save) or 1 (restore,
    rewrite: the first of a resume). Every third kill from the second on is a resume kill."""
    rng = random.Random(seed)
    out = []
    for i in range(kills):
        kind = rng.choice(("restore", "rewrite")) if i % 3 == 1 else rng.choice(
            ("wall", "wall", "microbatch", "save"))  # fmt: skip
        where = {"wall": lambda: round(rng.uniform(0.5, 8.0 + 0.5 * steps), 2),
                 "microbatch": lambda: rng.randint(1, max(2, steps)),
                 "save": lambda: rng.randint(1, max(1, steps // every // 2))}.get(
                     kind, lambda: 1)()  # fmt: skip
        out.append((kind, where))
    return out


def _args(workdir: str, base: str, steps: int, checkpoint_every: int, kill=None) -> list[str]:
    script = "launch.py"
    hooks = []
    if kill is not None:
        kind, where = kill
        script = "tests/killable_launch.py"
        if kind == "microbatch":
            hooks = [f"--kill_after_new_microbatches={where}"]
        elif kind in ("restore", "rewrite", "save"):
            hooks = [f"--kill_at={kind}", f"--kill_at_count={where}"]
    return [sys.executable, script, *hooks, "--config=experiments/quickstart.py:tiny",
            f"--workdir={workdir}", f"--config.run.steps={steps}", "--config.mesh.cell_size=4",
            f"--config.mesh.cache_dir={os.path.join(base, 'xla')}",
            f"--config.sft.dir={os.path.join(base, 'warm')}", "--config.sft.steps=120",
            "--config.sft.lr=3e-3", "--config.sft.eval_every=120", "--config.eval.tasks=0",
            f"--config.train.checkpoint_every={checkpoint_every}"]  # fmt: skip


def launch(args: list[str], delay: float | None = None) -> tuple[int, str, str, bool]:
    """Runs ``args``; SIGKILLs it after ``delay`` seconds if given -> (returncode, stdout,
    stderr, killed from outside)."""
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    killed = False
    try:
        out, err = proc.communicate(timeout=delay if delay is not None else 900)
    except subprocess.TimeoutExpired:
        proc.kill()  # SIGKILL
        killed = delay is not None
        out, err = proc.communicate()
    return proc.returncode, out, err, killed


def _stage(line: str) -> str:
    """What a killed launch had got to, from its last output line."""
    m = re.search(r"step (\d+)/(\d+)", line)
    return f"after step {m.group(1)}" if m else "before its first step"


def killed_run(workdir: str, base: str, steps: int, every: int, kills, log) -> dict:
    """Launches until a launch finishes, killing the first ``len(kills)`` ones as planned."""
    figures = {"launches": 0, "kills": 0, "kills_by_kind": {}, "unfired": 0, "resumes": 0}
    for i in range(len(kills) + 5):  # a planned kill may not fire (the run ended first)
        kill = kills[i] if i < len(kills) else None
        delay = kill[1] if kill and kill[0] == "wall" else None
        args = _args(workdir, base, steps, every, kill if kill and kill[0] != "wall" else None)
        ckdir = os.path.join(workdir, "checkpoints")
        figures["resumes"] += os.path.isdir(ckdir) and any(n.isdigit() for n in os.listdir(ckdir))
        rc, out, err, _ = launch(args, delay)
        figures["launches"] += 1
        last = (out.strip().splitlines() or [""])[-1]
        if rc == -9:
            figures["kills"] += 1
            kinds = figures["kills_by_kind"]
            kinds[kill[0]] = kinds.get(kill[0], 0) + 1
            log(f"launch {i + 1}: killed ({kill[0]} {kill[1]}) {_stage(last)}")
            continue
        if rc != 0:
            raise SystemExit(f"launch {i + 1} failed (exit {rc}): {err.strip()[-1500:]}")
        if kill is not None:
            figures["unfired"] += 1
        log(f"launch {i + 1}: finished ({last[:80]})")
        return figures
    raise SystemExit(f"no launch of {len(kills) + 5} finished")


def damage_newest(workdir: str) -> int:
    """Cuts the newest checkpoint's parameter files to a third (a kill mid-copy) -> its step."""
    ckdir = os.path.join(workdir, "checkpoints")
    step = max(int(n) for n in os.listdir(ckdir) if n.isdigit())
    for dirpath, _, names in os.walk(os.path.join(ckdir, str(step))):
        if "params" in dirpath.split(os.sep):
            for n in names:
                p = os.path.join(dirpath, n)
                size = os.path.getsize(p)
                if size:
                    with open(p, "r+b") as f:
                        f.truncate(size // 3)
    return step


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint_every", type=int, default=3)
    ap.add_argument("--base", default="/tmp/gyre_kill_run")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    shutil.rmtree(os.path.join(a.base, "reference"), ignore_errors=True)
    shutil.rmtree(os.path.join(a.base, "killed"), ignore_errors=True)
    os.makedirs(a.base, exist_ok=True)
    log = lambda s: print(s, flush=True)  # noqa: E731
    t0 = time.time()
    ref = os.path.join(a.base, "reference")
    rc, _, err, _ = launch(_args(ref, a.base, a.steps, a.checkpoint_every))
    if rc != 0:
        raise SystemExit(f"the reference run failed: {err.strip()[-1500:]}")
    log(f"reference: {a.steps} steps in {time.time() - t0:.0f} s")
    kills = plan(a.seed, a.kills, a.steps, a.checkpoint_every)
    got = os.path.join(a.base, "killed")
    t1 = time.time()
    figures = killed_run(got, a.base, a.steps, a.checkpoint_every, kills, log)
    # a damaged newest checkpoint: the relaunch falls back (killed once right after its
    # restore), re-trains the lost steps, saves them; the next relaunch has nothing to do
    step = damage_newest(got)
    after = killed_run(got, a.base, a.steps, a.checkpoint_every, [("restore", 1)], log)
    aside = os.path.isdir(os.path.join(got, "checkpoints.unreadable", str(step)))
    rc, out, err, _ = launch(_args(got, a.base, a.steps, a.checkpoint_every))
    holds = rc == 0 and f"already holds all {a.steps} steps" in out
    result = compare(ref, got, a.steps)
    if not aside:
        result["problems"].append(f"the damaged checkpoint {step} was not moved aside")
    if not holds:
        result["problems"].append(f"the last relaunch did not say it holds every step: {out}")
    result.update(plan=kills, seed=a.seed, steps=a.steps, checkpoint_every=a.checkpoint_every,
                  killed_run=figures, damaged_checkpoint=step, after_damage=after,
                  final_relaunch_says=(out.strip().splitlines() or [""])[-1],
                  seconds=round(time.time() - t1), reference_seconds=round(t1 - t0))  # fmt: skip
    print(json.dumps(result, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    if result["problems"]:
        raise SystemExit(f"{len(result['problems'])} problems: {result['problems'][0]}")
    return result


if __name__ == "__main__":
    main()
