"""Train step (forward + backward + update) on tree-packed vs flattened batches of agent runs.

Executions have a long shared prefix (system + task), a main line of calls, retries that resume
deep inside the last call, a compaction branch (shares only the system prompt) and sub-agents.
Both batches go through the same Trainer and the same block-sparse attention kernel (on a causal
row it skips the upper triangle), micro-batches of the same shape, so one program serves both.

    source .venv/bin/activate && PYTHONPATH=. python benchmarks/tree_vs_flat.py [--runs 3]

Row fill (real tokens / row positions) is printed for both sides: padding costs time but no
ideal FLOPs, so unequal fill moves the measured/ideal figure.

D = flattened tokens / unique tokens. Ideal ratio = flattened FLOPs / tree FLOPs, counting the
linear layers per real token and attention per visible query-key pair. Goal: measured speedup
>= 0.85 x ideal ratio, with the same gradient (relative difference printed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax
import numpy as np

from gyre.config import default_config
from gyre.mesh import make_cells
from gyre.model import decoder
from gyre.rl.builder import build_specs
from gyre.train.step import Trainer, split_microbatches
from gyre.trajectory.batch import ExecutionResult, build_batch
from gyre.trajectory.records import make_record

# name: (prefix, main calls, retries, compactions, sub-agents)
SHAPES = {"agent-a": (1024, 3, 2, 1, 2), "agent-b": (1536, 2, 4, 1, 1)}


def agent_execution(rng, eid, vocab, prefix, n_main, retries, compactions, subs, gen=128, obs=64,
                    end_reason="success"):  # fmt: skip
    def tok(n):
        return rng.integers(0, vocab, n)

    system, task = tok(prefix // 2), tok(prefix - prefix // 2)
    ctx, recs = np.concatenate([system, task]), []

    def add(prompt, completion, role):
        # behaviour logprobs near a fresh model's (-log V), so ratios straddle the clip range
        logp = np.minimum(-np.log(vocab) + rng.normal(0, 0.3, completion.size), 0.0)
        recs.append(make_record(prompt, completion, logprobs=logp, role=role, execution_id=eid,
                                call_id=len(recs), end_reason=end_reason))  # fmt: skip
        return recs[-1]

    last = None
    for i in range(n_main):
        prompt = ctx if i == 0 else np.concatenate([ctx, tok(obs)])
        last = add(prompt, tok(gen), "main")
        ctx = np.concatenate([prompt, last.completion])
    for _ in range(retries):  # resume deep inside the last main call
        cut = int(rng.integers(gen // 2, gen))
        add(np.concatenate([last.prompt, last.completion[:cut]]), tok(gen // 2), "main")
    for _ in range(compactions):
        add(np.concatenate([system, tok(gen)]), tok(gen), "main")
    for _ in range(subs):
        add(np.concatenate([system, tok(obs)]), tok(gen), "sub-agent")
    return recs


def flops(batch, cfg) -> float:
    """Linear-layer FLOPs per real token + attention FLOPs per visible query-key pair (fwd)."""
    m = cfg.model
    lin = 2 * (m.d_model * (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
               + m.num_heads * m.head_dim * m.d_model + 3 * m.d_model * m.d_ff)  # fmt: skip
    per_token = m.num_layers * lin + 2 * m.d_model * m.vocab_size
    att = m.num_layers * 4 * m.num_heads * m.head_dim
    real = batch.exec_index >= 0
    idx = np.arange(batch.leave.shape[1])
    pairs = float(np.sum(np.where(real, np.maximum(batch.leave - idx, 0), 0)))
    return float(real.sum()) * per_token + pairs * att


def time_steps(trainers, cells, batches, runs):
    """Median seconds per train step for each mode; modes interleaved so both see the same
    background load."""
    for mode, trainer in trainers.items():
        trainer.train_step(cells, batches[mode])  # compile + warm up
    times = {mode: [] for mode in trainers}
    for _ in range(runs):
        for mode, trainer in trainers.items():
            start = time.perf_counter()
            out = trainer.train_step(cells, batches[mode])
            jax.block_until_ready(trainer.params)
            times[mode].append(time.perf_counter() - start)
            assert out.applied
    return {mode: statistics.median(t) for mode, t in times.items()}


def grads_of(trainer, cell, batch, rows):
    return trainer.sum_grads(
        [trainer.compute_grads(cell, mb) for mb in split_microbatches(batch, rows)]
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--executions", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--row_len", type=int, default=2560, help="multiple of 128")
    args = parser.parse_args()

    cfg = default_config()
    cfg.model.update(vocab_size=256, d_model=128, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=32, d_ff=384, attn_block=128)  # fmt: skip
    cfg.trajectory.row_len = args.row_len
    cfg.trajectory.max_paths = 8
    cfg.train.rows_per_microbatch = 1
    cells = make_cells(1)[:1]
    specs = build_specs(cfg)
    graphdef, params = decoder.init_sharded(specs.model, args.seed, cells[0], "train")
    rng = np.random.default_rng(args.seed)

    print(f"{'shape':9} {'D':>5} {'rows t/f':>9} {'tree s':>8} {'flat s':>8} {'speedup':>8} "
          f"{'ideal':>6} {'ratio':>6} {'fill t/f':>9} {'grad diff':>9}")  # fmt: skip
    results = {}
    for name, shape in SHAPES.items():
        execs = [
            ExecutionResult(
                agent_execution(rng, f"{name}{i}", cfg.model.vocab_size, *shape,
                                end_reason="success" if i % 2 else "failure"),
                "task", score=0.3,
            )
            for i in range(args.executions)
        ]  # fmt: skip
        batches = {}
        for mode in ("tree", "flat"):
            spec = dataclasses.replace(specs.trajectory, packing=mode)
            batches[mode], report = build_batch(execs, spec, buckets=(1,))
            assert not report.rejected, report.rejected
        d = report.flat_tokens / report.unique_tokens
        ideal = flops(batches["flat"], cfg) / flops(batches["tree"], cfg)
        trainers = {mode: Trainer(specs.trainer, cells, graphdef, params) for mode in batches}
        grads = {mode: grads_of(trainers[mode], cells[0], b, 1) for mode, b in batches.items()}
        secs = time_steps(trainers, cells, batches, args.runs)
        gt, gf = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(grads[m])]) for m in grads)
        diff = float(np.linalg.norm(gt - gf) / np.linalg.norm(gf))
        speedup = secs["flat"] / secs["tree"]
        rows = f"{batches['tree'].tokens.shape[0]}/{batches['flat'].tokens.shape[0]}"
        fill = {m: float((b.exec_index >= 0).mean()) for m, b in batches.items()}
        print(f"{name:9} {d:5.2f} {rows:>9} {secs['tree']:8.3f} {secs['flat']:8.3f} "
              f"{speedup:8.2f} {ideal:6.2f} {speedup / ideal:6.2f} "
              f"{fill['tree']:4.2f}/{fill['flat']:4.2f} {diff:9.1e}")  # fmt: skip
        results[name] = {"D": round(d, 3), "ideal_ratio": round(ideal, 3),
                         "speedup": round(speedup, 3), "speedup_over_ideal": round(speedup / ideal, 3),
                         "tree_s": round(secs["tree"], 4), "flat_s": round(secs["flat"], 4),
                         "grad_rel_diff": diff,
                         "row_fill_tree": round(fill["tree"], 3), "row_fill_flat": round(fill["flat"], 3)}  # fmt: skip
    print(json.dumps(results))


if __name__ == "__main__":
    main()
