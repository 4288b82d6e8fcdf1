"""KV attention over the live blocks vs dense over max_len, alternating in one process.

The rollout engine's attention either reads every slot's whole cache (``kv_block`` 0, dense
over max_len) or reads it in blocks up to the live context (``kv_block`` > 0: decode up to
the longest running row, gyre/model/attention.py ``live_decode_attention``; prefill up to
the row's own length, ``live_prefill_attention``). Same engine, same random-init model as
``benchmarks/vs_tunix.py`` (hidden 256, 4 layers, 8/4 heads of 32, vocab 4096, float32), one
CPU device, greedy, B requests of P prompt tokens generating ``--new`` tokens each, on a cell
of ``slots`` = B and the given max_len. Per row both settings run alternately ``--runs``
times after a warm-up; decode tok/s = B * (new - 1) / (whole call - 1-token call), from the
medians and from the fastest calls (best; a shared machine's other tenants only slow runs
down; "-" where a 1-token call took longer than the whole one); first ms = the median
1-token call (prefill of the prompts and the first token).
match = leading greedy tokens equal between the two (they sum in different orders, so a
near tie may flip; every row printed says how many agree); auto dec = the decode block
auto (kv_block -1) picks at that max_len (0: dense; auto always prefills by live blocks).

    python benchmarks/live_attention.py [--quick] [--runs 5] [--block 128]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.vs_tunix import base_config, make_prompts, match_length  # noqa: E402
from gyre import mesh as gmesh  # noqa: E402
from gyre.model import decoder as gdec  # noqa: E402
from gyre.rl.builder import build_specs  # noqa: E402
from gyre.rollout.engine import Engine  # noqa: E402
from gyre.rollout.programs import AUTO_KV_BLOCK, kv_blocks  # noqa: E402
from gyre.rollout.types import GenerateRequest  # noqa: E402

# (batch, prompt, max_len): short contexts in a tight, a mid and a long cache; then contexts
# that fill the cache (where live blocks can only cost).
ROWS = [(1, 64, 192), (8, 64, 192), (1, 64, 512), (8, 64, 512), (1, 64, 2048), (8, 64, 2048),
        (1, 896, 1024), (8, 896, 1024)]  # fmt: skip
QUICK_ROWS = [(1, 16, 48), (4, 16, 256), (4, 200, 256)]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, small rows")
    parser.add_argument("--runs", type=int, default=5, help="timed calls per setting and row")
    parser.add_argument("--new", type=int, default=128, help="new tokens per request")
    parser.add_argument(
        "--block",
        type=int,
        default=None,
        help=f"live kv_block (default {AUTO_KV_BLOCK}; 32 with --quick)",
    )
    args = parser.parse_args(argv)
    if args.block is None:
        args.block = 32 if args.quick else AUTO_KV_BLOCK
    if args.runs < 1 or args.new < 2 or args.block < 1:
        parser.error("--runs >= 1, --new >= 2 and --block >= 1")
    return args


def rollout_spec(quick: bool, batch: int, max_len: int, kv_block: int):
    cfg = base_config(quick)  # vs_tunix.py's architecture
    cfg.rollout.slots, cfg.rollout.max_len, cfg.rollout.kv_block = batch, max_len, kv_block
    return build_specs(cfg).rollout


def timed(spec, cell, state, prompts_BxP: np.ndarray, new: int, call: int):
    """One call on a fresh engine (no KV left from before) -> (seconds, tokens int32[B, new])."""
    engine = Engine(spec, cell, state)
    engine.warmup()
    reqs = [GenerateRequest(f"live{i}", call, p, new, temperature=0.0)
            for i, p in enumerate(prompts_BxP)]  # fmt: skip
    start = time.perf_counter()
    rids = [engine.submit(r) for r in reqs]
    out = engine.run_until_done()
    return time.perf_counter() - start, np.stack([np.asarray(out[r].tokens) for r in rids])


def compare(quick, cell, state, batch, prompt, max_len, new, runs, block) -> dict:
    prompts = make_prompts(batch, prompt, rollout_spec(quick, 1, 8, 0).model.vocab_size, 5)
    specs = {"dense": rollout_spec(quick, batch, max_len, 0),
             "live": rollout_spec(quick, batch, max_len, block)}  # fmt: skip
    whole = {k: [] for k in specs}
    first = {k: [] for k in specs}
    tokens = {}
    for i in range(runs + 1):  # round 0 warms up (compiles) and is not timed
        for name, spec in specs.items():
            seconds, tokens[name] = timed(spec, cell, state, prompts, new, 2 * i)
            one, _ = timed(spec, cell, state, prompts, 1, 2 * i + 1)
            if i:
                whole[name].append(seconds)
                first[name].append(one)

    def rate(pick) -> dict:  # None where noise makes a call with 1 token the slower one
        d = {k: pick(whole[k]) - pick(first[k]) for k in specs}
        return {k: batch * (new - 1) / d[k] if d[k] > 0 else None for k in specs}

    ratio = lambda r: None if None in r.values() else round(r["live"] / r["dense"], 3)  # noqa: E731
    r1 = lambda v: None if v is None else round(v, 1)  # noqa: E731
    med, best = rate(statistics.median), rate(min)
    return {
        "batch": batch, "prompt": prompt, "max_len": max_len,
        "dense_tok_s": r1(med["dense"]), "live_tok_s": r1(med["live"]),
        "ratio": ratio(med), "best_ratio": ratio(best),
        "match": match_length(tokens["dense"], tokens["live"]),
        # the 1-token call: prefill of the prompts and the first token (median)
        "dense_first_ms": round(1e3 * statistics.median(first["dense"]), 2),
        "live_first_ms": round(1e3 * statistics.median(first["live"]), 2),
        "auto_kv_block": kv_blocks(rollout_spec(quick, batch, max_len, -1))[1],
    }  # fmt: skip


def main(argv=None) -> dict:
    args = parse_args(argv)
    (cell,) = gmesh.make_cells(1, devices=jax.devices()[:1])
    spec = rollout_spec(args.quick, 1, 8, 0)
    _, state = gdec.init_sharded(spec.model, 0, cell, "rollout")
    new = min(args.new, 16) if args.quick else args.new
    rows = []
    print(f"live kv blocks of {args.block} vs dense attention; decode tok/s, median of "
          f"{args.runs} alternating calls; best = ratio of the fastest calls; {new} new tokens")  # fmt: skip
    print(f"{'batch':>5} {'prompt':>6} {'max_len':>7} {'dense':>9} {'live':>9} {'ratio':>6} "
          f"{'best':>6} {'match':>5} {'auto dec':>8} {'first ms dense':>14} {'live':>8}")  # fmt: skip
    for batch, prompt, max_len in QUICK_ROWS if args.quick else ROWS:
        r = compare(args.quick, cell, state, batch, prompt, max_len, new, args.runs, args.block)
        rows.append(r)
        f = lambda v, w, p: f"{'-':>{w}}" if v is None else f"{v:>{w}.{p}f}"  # noqa: E731
        print(f"{batch:>5} {prompt:>6} {max_len:>7} {f(r['dense_tok_s'], 9, 1)} "
              f"{f(r['live_tok_s'], 9, 1)} {f(r['ratio'], 6, 2)} {f(r['best_ratio'], 6, 2)} "
              f"{r['match']:>5} {r['auto_kv_block']:>8} {r['dense_first_ms']:>14.1f} "
              f"{r['live_first_ms']:>8.1f}", flush=True)  # fmt: skip
    result = {"benchmark": "live_attention", "block": args.block, "new": new, "runs": args.runs,
              "quick": args.quick, "rows": rows}  # fmt: skip
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
