"""Throughput of the trajectory pipeline: call records -> trees -> selection -> packed rows.

    PYTHONPATH=. python benchmarks/pack.py [--calls 330] [--row_len 65536] [--window 56000] [--step_execs 32]

Cases: one ~700K-token branchy execution (main chain with compactions, retries, sub-agents) at
J=5 and uncapped, and a step's worth of smaller executions of several tasks. Tokens/s counts the
unique tokens of the input trees per second of ``build_batch`` wall time (records in, packed
batch out, validation included). D = flattened selected-path tokens / their unique tokens.
Padding = padding positions / all row positions; repeated = ancestors repeated in continuation
rows / all positions; fill = unique packed tokens / all positions.
The last line is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from gyre.config import default_config
from gyre.rl.builder import build_specs
from gyre.trajectory.batch import ExecutionResult, build_batch
from gyre.trajectory.records import make_record

VOCAB = 151_936


def long_execution(seed: int, n_calls: int, window: int, eid: str = "x", scale: float = 1.0):
    """A main chain compacting at ``window`` tokens, with retries, summaries and sub-agents."""
    rng = np.random.default_rng(seed)
    tok = lambda n: rng.integers(0, VOCAB, max(1, int(n * scale))).astype(np.int32)
    system, task = tok(800), tok(400)
    records = []

    def call(prompt, role, parent, n_gen):
        comp = tok(n_gen)
        rec = make_record(
            prompt, comp, -rng.exponential(0.5, comp.size).astype(np.float32),
            np.full(comp.size, 3, np.int32), role=role, execution_id=eid,
            call_id=len(records), parent_id=parent, end_reason="timeout",
        )  # fmt: skip
        records.append(rec)
        return rec

    ctx, last = np.concatenate([system, task]), None
    while len(records) < n_calls:
        r = rng.random()
        if ctx.size > window:  # compaction: the model summarises, main restarts
            s = call(np.concatenate([ctx, tok(50)]), "main-summary", last, 1000)
            ctx, last = np.concatenate([system, task, s.completion]), s.call_id
        elif r < 0.08 and last is not None:  # retry of the last call from a resume point
            old = records[last]
            cut = rng.integers(0, old.completion.size)
            rec = call(
                np.concatenate([old.prompt, old.completion[:cut]]), old.role, old.parent_id, 600
            )
            ctx, last = np.concatenate([rec.prompt, rec.completion]), rec.call_id
        elif r < 0.14 and last is not None:  # a sub-agent: own root, a few calls, a summary
            sub_ctx, parent = np.concatenate([tok(300), tok(200)]), last
            for _ in range(rng.integers(2, 6)):
                rec = call(np.concatenate([sub_ctx, tok(800)]), "sub-agent", parent, 700)
                sub_ctx, parent = np.concatenate([rec.prompt, rec.completion]), rec.call_id
            s = call(np.concatenate([sub_ctx, tok(40)]), "sub-agent-summary", parent, 300)
            ctx = np.concatenate([ctx, s.completion])  # its report comes back to main
        else:
            rec = call(
                np.concatenate([ctx, tok(rng.integers(300, 1500))]),
                "main",
                last,
                rng.integers(200, 1200),
            )
            ctx, last = np.concatenate([rec.prompt, rec.completion]), rec.call_id
    return records


def run_case(name, results, cfg, repeats: int):
    walls, cpus = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        batch, rep = build_batch(results, build_specs(cfg).trajectory, buckets=(1,))
        cpus.append(time.process_time() - c0)
        walls.append(time.perf_counter() - t0)
        assert not rep.rejected, rep.rejected[:3]
    from gyre.trajectory.tree import build_tree

    tree_tokens = sum(build_tree(r.records).num_nodes for r in results)
    sec, wall = float(np.median(cpus)), float(np.median(walls))
    repeat = float((batch.exec_index >= 0).sum() - rep.unique_tokens) / batch.w.size
    return dict(
        case=name,
        execs=len(results),
        calls=sum(len(r.records) for r in results),
        tree_tokens=tree_tokens,
        packed_unique=rep.unique_tokens,
        rows=int(batch.tokens.shape[0]),
        cpu_s=round(sec, 4),
        mtok_per_cpu_s=round(tree_tokens / sec / 1e6, 2),
        mtok_per_wall_s=round(tree_tokens / wall / 1e6, 2),
        D=round(rep.flat_tokens / rep.unique_tokens, 2),
        padding=round(rep.padding, 4),
        fill=round(rep.unique_tokens / batch.w.size, 4),
        repeated=round(repeat, 4),
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=330)
    p.add_argument("--row_len", type=int, default=65536)
    p.add_argument("--window", type=int, default=56000)
    p.add_argument("--step_execs", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    cfg = default_config()
    cfg.model.vocab_size = VOCAB
    cfg.trajectory.row_len = a.row_len
    big = [ExecutionResult(long_execution(0, a.calls, a.window, scale=1.4), "big", 0.3)]
    step = [
        ExecutionResult(
            long_execution(100 + i, a.calls // 8, a.window // 4, f"s{i}", 0.25),
            f"t{i % 8}",
            0.1 * (i % 4),
        )
        for i in range(a.step_execs)
    ]
    rows = []
    for name, results, paths in (
        ("700K J=5", big, 5),
        ("700K uncapped", big, 0),
        ("step J=5", step, 5),
    ):
        cfg.trajectory.max_paths = paths
        rows.append(run_case(name, results, cfg, a.repeats))
    keys = list(rows[0])
    print(" | ".join(f"{k:>13}" for k in keys))
    for r in rows:
        print(" | ".join(f"{r[k]!s:>13}" for k in keys))
    print(json.dumps({"row_len": a.row_len, "window": a.window, "cases": rows}))


if __name__ == "__main__":
    main()
