"""The cost of the path cap J_max, measured as the paper measures it: forward-backward time of
one step's tree-packed batch with at most J paths per execution, as a fraction of uncapped.

Agent-shaped executions (benchmarks/tree_vs_flat.py's generator: a shared prefix, a main line
of calls, retries resuming inside the last call, compactions and sub-agents; here 9-12 leaf
paths each). The cap keeps the J highest-priority paths of each execution
(gyre/trajectory/select.py); the batch holds the union of their tokens, packed as trees into
rows of ``--row_len``. Timed: the gradient program over every micro-batch of the batch
(forward + backward, no optimizer update), median of ``--runs``, each J interleaved with the
others so all see the same background load.

    source .venv/bin/activate && python benchmarks/path_cap.py [--runs 3] [--quick]

Paper (J_max = 1 and 5): 41.4% and 74.8% of the uncapped time. Prints a table and, as its
last line, one JSON object.
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
from gyre.train.step import Trainer, split_microbatches
from gyre.trajectory.batch import ExecutionResult, build_batch

PAPER = {1: 0.414, 5: 0.748}
# (prefix, main calls, retries, compactions, sub-agents): 9-12 leaf paths per execution
SHAPE = {"full": (1024, 4, 4, 2, 4), "quick": (256, 2, 3, 1, 3)}


def step_seconds(trainer, cell, mbs) -> float:
    start = time.perf_counter()
    grads = [trainer.compute_grads(cell, mb).grads for mb in mbs]
    jax.block_until_ready(grads)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--executions", type=int, default=4)
    parser.add_argument("--row_len", type=int, default=4096, help="multiple of 128")
    parser.add_argument("--caps", default="1,3,5")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a small model and short executions")
    args = parser.parse_args()

    cfg = default_config()
    size = "quick" if args.quick else "full"
    if args.quick:
        cfg.model.update(vocab_size=128, d_model=64, num_layers=1, num_heads=2, num_kv_heads=1,
                         head_dim=32, d_ff=128, attn_block=128)  # fmt: skip
        args.row_len = min(args.row_len, 1024)
    else:
        cfg.model.update(vocab_size=256, d_model=128, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=32, d_ff=384, attn_block=128)  # fmt: skip
    cfg.trajectory.row_len = args.row_len
    cfg.train.rows_per_microbatch = 1
    specs = build_specs(cfg)
    cells = make_cells(1)[:1]
    graphdef, params = decoder.init_sharded(specs.model, args.seed, cells[0], "train")
    rng = np.random.default_rng(args.seed)
    execs = [ExecutionResult(agent_execution(rng, f"e{i}", cfg.model.vocab_size, *SHAPE[size],
                                             end_reason="success" if i % 2 else "failure"),
                             "task", score=0.3 + 0.1 * i) for i in range(args.executions)]  # fmt: skip

    caps = [int(c) for c in args.caps.split(",")] + [0]
    trainer = Trainer(specs.trainer, cells, graphdef, params)
    mbs, info = {}, {}
    for j in caps:
        spec = dataclasses.replace(specs.trajectory, max_paths=j)
        batch, report = build_batch(execs, spec, buckets=(1,))
        assert not report.rejected, report.rejected
        mbs[j] = split_microbatches(batch, 1)
        info[j] = {"rows": len(mbs[j]), "unique_tokens": report.unique_tokens,
                   "paths": int(sum(report.kept_paths))}  # fmt: skip
        step_seconds(trainer, cells[0], mbs[j])  # compile (one program: the same row shape)
    times = {j: [] for j in caps}
    for _ in range(args.runs):
        for j in caps:
            times[j].append(step_seconds(trainer, cells[0], mbs[j]))
    med = {j: statistics.median(t) for j, t in times.items()}

    print(
        f"path cap: {args.executions} agent executions, rows of {args.row_len} tokens, "
        f"{cfg.model.num_layers}-layer d={cfg.model.d_model} model, {jax.devices()[0].platform}"
    )
    print(f"{'J_max':>7} {'paths':>6} {'tokens':>8} {'rows':>5} {'fwd+bwd s':>10} "
          f"{'of uncapped':>12} {'paper':>7}")  # fmt: skip
    out = {"platform": jax.devices()[0].platform, "row_len": args.row_len, "caps": {}}
    for j in caps:
        frac = med[j] / med[0]
        name = str(j) if j else "uncapped"
        paper = f"{PAPER[j]:.1%}" if j in PAPER else ""
        print(f"{name:>7} {info[j]['paths']:>6} {info[j]['unique_tokens']:>8} {info[j]['rows']:>5} "
              f"{med[j]:>10.3f} {frac:>12.1%} {paper:>7}")  # fmt: skip
        out["caps"][name] = {**info[j], "seconds": round(med[j], 4), "fraction": round(frac, 4),
                             "token_fraction": round(info[j]["unique_tokens"]
                                                     / info[0]["unique_tokens"], 4),
                             "paper_fraction": PAPER.get(j)}  # fmt: skip
    print(json.dumps(out))


if __name__ == "__main__":
    main()
