"""Tree schedule vs tree mask vs flattened paths: peak memory (XLA's compiled memory analysis)
and forward+backward time of one tree row, on wide agent-shaped trees.

Each tree is one agent execution (benchmarks/tree_vs_flat.py's generator): a system prompt
shared by everything, the task and a main line of calls, retries resuming inside the last
main call, compactions and sub-agents branching off the system prompt; sub-agents are added
until the tree holds about ``--sizes`` tokens, so the longest root-to-leaf path stays the
same while the tree widens. Uncapped (every path selected).

- mask: the tree-packed row through the gradient program (train.step._objective: block-
  sparse tree attention), one row of the tree's length.
- schedule: gyre.train.tree_schedule.row_grads on the same row (prefix once, branches in a
  scan, prefix backward once).
- path: one causal row of the longest root-to-leaf path (memory only): what the schedule's
  peak is compared with.
- flat: every path as its own causal row (packing='flat'), rows of the longest path's
  length, one program call per row (time; its peak is the path's).

Memory: XLA's ``memory_analysis()`` of each compiled program: temporaries + outputs (the
parameter arguments are the same for all and left out; the batch is counted). Time: median
of ``--runs`` after a compile, interleaved.

    python benchmarks/tree_schedule.py [--sizes 8192,16384,32768] [--runs 3] [--quick]

Prints a table and, as its last line, one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax
import numpy as np
from tree_vs_flat import agent_execution

from gyre.config import default_config
from gyre.mesh import make_cells
from gyre.model import decoder
from gyre.rl.builder import build_specs
from gyre.train import step as tstep
from gyre.train import tree_schedule as ts
from gyre.trajectory import schema
from gyre.trajectory.batch import ExecutionResult, build_batch

MB = 1e6
# (system+task prefix, main calls, retries, compactions, gen, obs): the longest path is
# prefix + main * gen + (main - 1) * obs
SHAPE = {"full": (1024, 4, 2, 2, 512, 256), "quick": (256, 2, 2, 1, 128, 64)}


def wide_tree(rng, vocab, size, shape, eid="e0", end_reason="success"):
    """An agent execution with sub-agents added until it holds about ``size`` tokens."""
    prefix, main, retries, compactions, gen, obs = shape
    base = prefix + main * gen + (main - 1) * obs + retries * gen // 2 + compactions * 2 * gen
    subs = max(0, (size - base) // (obs + gen))
    return agent_execution(rng, eid, vocab, prefix, main, retries, compactions, subs, gen=gen,
                           obs=obs, end_reason=end_reason)  # fmt: skip


def rows_of(execs, spec, row_len, packing):
    batch, report = build_batch(execs, dataclasses.replace(spec, row_len=row_len,
                                packing=packing, max_paths=0), buckets=(1,))  # fmt: skip
    assert not report.rejected, report.rejected
    return {k: np.asarray(batch[k]) for k in schema.device_names()}, report


def footprint(compiled, params_bytes) -> float:
    """Bytes a program needs beyond the parameters: temporaries, outputs and its batch."""
    m = compiled.memory_analysis()
    return float(m.temp_size_in_bytes + m.output_size_in_bytes
                 + m.argument_size_in_bytes - params_bytes)  # fmt: skip


def seconds(fn, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def _round(n, k=128):
    return -(-n // k) * k


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="8192,16384,32768")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--remat", default="full")
    parser.add_argument("--quick", action="store_true", help="a small model and short trees")
    args = parser.parse_args()

    cfg = default_config()
    size = "quick" if args.quick else "full"
    if args.quick:
        cfg.model.update(vocab_size=128, d_model=64, num_layers=1, num_heads=2, num_kv_heads=1,
                         head_dim=32, d_ff=128, attn_block=128)  # fmt: skip
        sizes = [2048, 4096]
    else:
        cfg.model.update(vocab_size=256, d_model=128, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=32, d_ff=384, attn_block=128)  # fmt: skip
        sizes = [int(s) for s in args.sizes.split(",")]
    specs = build_specs(cfg)
    cell = make_cells(1)[0]
    graphdef, params = decoder.init_sharded(specs.model, args.seed, cell, "train")
    pbytes = float(sum(x.nbytes for x in jax.tree.leaves(params)))
    ls, block, remat = specs.trainer.loss, specs.model.attn_block, args.remat
    mask = jax.jit(lambda p, b: tstep._objective(graphdef, "ppo", ls, False, p, None, b, 0,
                                                 remat))  # fmt: skip
    sched_fn = jax.jit(lambda p, s: ts.row_grads(graphdef, p, s, ls, 0, remat=remat))

    results = []
    for n in sizes:
        rng = np.random.default_rng(args.seed)
        # two executions of one task, so advantages are not zero; the first is measured
        execs = [ExecutionResult(wide_tree(rng, cfg.model.vocab_size, n, SHAPE[size], f"e{i}",
                                           r), "t", score=0.0)
                 for i, r in enumerate(("success", "failure"))]  # fmt: skip
        # a row as long as the larger tree: each tree gets a row of its own; row 0 is measured
        sizes_ = [rows_of([e], specs.trajectory, _round(4 * n), "tree")[1].unique_tokens
                  for e in execs]  # fmt: skip
        tree_rows, _ = rows_of(execs, specs.trajectory, _round(max(sizes_)), "tree")
        row = {k: v[0] for k, v in tree_rows.items()}
        leave = row["leave"]
        length = int(np.flatnonzero((row["pred"] >= 0) | (leave > np.arange(leave.size) + 1)
                                    ).max()) + 1  # fmt: skip
        tree_tokens = length
        row1 = {k: v[:1] for k, v in tree_rows.items()}
        path = int(row["pos"][:length].max()) + 1
        flat_rows, _ = rows_of(execs[:1], specs.trajectory, _round(path), "flat")
        sched = ts.split_row(leave, block=block)
        srow = ts.schedule_row(row, sched)
        path_row = {k: v[:1] for k, v in flat_rows.items()}

        c_mask = mask.lower(params, row1).compile()
        c_sched = sched_fn.lower(params, srow).compile()
        c_path = mask.lower(params, path_row).compile()
        mem = {"mask": footprint(c_mask, pbytes), "schedule": footprint(c_sched, pbytes),
               "path": footprint(c_path, pbytes)}  # fmt: skip

        def flat_all(p, rows=flat_rows):
            return [mask(p, {k: v[i : i + 1] for k, v in rows.items()})
                    for i in range(rows["tokens"].shape[0])]  # fmt: skip

        progs = {"mask": lambda r=row1: mask(params, r),
                 "schedule": lambda s=srow: sched_fn(params, s),
                 "flat": lambda: flat_all(params)}  # fmt: skip
        for f in progs.values():
            jax.block_until_ready(f())  # compile / warm
        times = {k: [] for k in progs}
        for _ in range(args.runs):
            for k, f in progs.items():
                times[k].append(seconds(f))
        med = {k: statistics.median(v) for k, v in times.items()}
        results.append({
            "tree_tokens": tree_tokens, "row_len": int(leave.size), "longest_path": path,
            "paths": int(flat_rows["tokens"].shape[0]), "prefix": sched.prefix,
            "branches": len(sched.branches), "branch_pad": sched.branch_pad,
            "prefix_pad": sched.prefix_pad,
            "mem_mb": {k: round(v / MB, 1) for k, v in mem.items()},
            "schedule_minus_path_mb": round((mem["schedule"] - mem["path"]) / MB, 1),
            "seconds": {k: round(v, 3) for k, v in med.items()},
            "schedule_over_mask_time": round(med["schedule"] / med["mask"], 3),
        })  # fmt: skip

    m = cfg.model
    print(f"tree schedule vs tree mask: {m.num_layers}-layer d={m.d_model} model "
          f"(params {pbytes / MB:.1f} MB float32), remat={remat}, {jax.devices()[0].platform}, "
          "uncapped wide agent trees")  # fmt: skip
    print(f"{'tree':>7} {'path':>6} {'paths':>5} {'P':>5} {'N':>3} {'B':>6} | {'mask MB':>8} "
          f"{'sched MB':>9} {'path MB':>8} {'s-p MB':>7} | {'mask s':>7} {'sched s':>8} "
          f"{'flat s':>7} {'s/m':>5}")  # fmt: skip
    for r in results:
        mm, s = r["mem_mb"], r["seconds"]
        print(f"{r['tree_tokens']:>7} {r['longest_path']:>6} {r['paths']:>5} {r['prefix']:>5} "
              f"{r['branches']:>3} {r['branch_pad']:>6} | {mm['mask']:>8.1f} "
              f"{mm['schedule']:>9.1f} {mm['path']:>8.1f} {r['schedule_minus_path_mb']:>7.1f} | "
              f"{s['mask']:>7.3f} {s['schedule']:>8.3f} {s['flat']:>7.3f} "
              f"{r['schedule_over_mask_time']:>5.2f}")  # fmt: skip
    print(json.dumps({"platform": jax.devices()[0].platform, "remat": remat,
                      "params_mb": round(pbytes / MB, 2), "trees": results}))  # fmt: skip


if __name__ == "__main__":
    main()
