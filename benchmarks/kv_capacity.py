"""KV capacity at fixed KV memory: the paged cache (rollout.kv_page) vs today's slots.

Both layouts get the same KV memory, ``--memory`` tokens (default 4 x 2048: the slot layout's
4 slots of max_len 2048). The slot layout holds at most ``memory / max_len`` contexts; the
paged one has ``--paged-slots`` rows (default 32: slots bound concurrency, not memory) and
holds pages of ``kv_page`` tokens up to the same memory.

Capacity: ``--executions`` agent executions run through the proxy (admission 'none'), as the
real rollout loop drives them: each makes ``--turns`` calls of ``--new`` completion tokens;
its first prompt is a task prompt (``--task-prompt`` tokens, shared by the execution's group
of ``--group`` samples) plus a private part, and every later prompt appends the completion and
a tool observation; between calls it waits on a tool (a random number of proxy pumps). The
lengths are long-tailed, stated here: the private part and every observation are lognormal
(median 64 and 96 tokens, sigma 1.0), capped so the final context fits max_len; a context
averages a few hundred tokens, a tail reaches max_len. Figures: mean and peak resident
contexts (live + idle contexts in the pool, sampled after every pump), evictions, re-prefilled
tokens, prefilled tokens, the wall time, and the peak KV the paged pool used.

Decode tok/s at equal batch, the page-size sweep side by side: ``--batch`` requests with
contexts of 300-1500 tokens decode ``--decode-new`` tokens greedily on one engine of ``slots``
= batch in each layout (the slot layout reading its cache in live blocks of 128, as auto does
at max_len 2048; the paged ones in blocks of 128 entries too, 128 / page pages gathered a
block, gyre/rollout/programs.py paged_kv_block), alternating, ``--runs`` times after a
warm-up; tok/s = decode tokens / seconds of the decode loops (``Engine.on_timing``), the
fastest run (a shared machine only slows runs down) and the median. Every layout's tokens and
logprobs are checked equal to the slot layout's, bit for bit ("exact" column).

Tiny random model (hidden 64, 2 layers, 4 heads / 2 KV heads of 32, vocab 512, float32), one
CPU device per cell. Prints a table and one final JSON line.

    source .venv/bin/activate && PYTHONPATH=. python benchmarks/kv_capacity.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import time

import jax
import numpy as np

from gyre import mesh as gmesh
from gyre.config import default_config
from gyre.model import decoder as gdec
from gyre.rl.builder import build_specs
from gyre.rollout.engine import Engine
from gyre.rollout.proxy import Proxy
from gyre.rollout.types import GenerateRequest

VOCAB = 512


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer executions and runs")
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--memory", type=int, default=4 * 2048, help="KV tokens of both layouts")
    p.add_argument("--paged-slots", type=int, default=32)
    p.add_argument("--pages", default="16,32,64,128,256", help="page sizes swept")
    p.add_argument("--executions", type=int, default=48)
    p.add_argument("--group", type=int, default=4, help="samples sharing a task prompt")
    p.add_argument("--task-prompt", type=int, default=128)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--decode-new", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.quick:
        a.executions, a.turns, a.runs, a.pages = 16, 3, 2, "32,64,128"
    return a


def rollout_spec(slots, max_len, kv_page=0, kv_tokens=0, kv_block=-1):
    cfg = default_config()
    m = cfg.model
    m.vocab_size, m.d_model, m.num_layers, m.d_ff = VOCAB, 64, 2, 128
    m.num_heads, m.num_kv_heads, m.head_dim, m.hf_dir = 4, 2, 32, ""
    r = cfg.rollout
    r.slots, r.max_len, r.prefill_chunk, r.decode_steps = slots, max_len, 64, 8
    r.kv_tokens, r.kv_block = kv_tokens, kv_block
    spec = build_specs(cfg).rollout
    return dataclasses.replace(spec, kv_page=kv_page)


def workload(a):
    """Per execution: (task prompt + private part, [observation per later turn])."""
    rng = np.random.default_rng(a.seed)
    out = []
    room = a.max_len - a.turns * a.new - 8
    for e in range(a.executions):
        task = np.random.default_rng([a.seed, e // a.group]).integers(0, VOCAB, a.task_prompt)
        private = int(min(room // 2, rng.lognormal(np.log(64), 1.0)))
        obs = [int(rng.lognormal(np.log(96), 1.0)) for _ in range(a.turns - 1)]
        left = room - a.task_prompt - private  # cap the tail so the context fits max_len
        obs = [max(1, min(o, left // max(1, a.turns - 1))) for o in obs]
        first = np.concatenate([task, rng.integers(0, VOCAB, max(1, private))]).astype(np.int32)
        out.append((first, [rng.integers(0, VOCAB, o).astype(np.int32) for o in obs]))
    return out


def capacity_run(spec, cell, state, a, work):
    proxy = Proxy([Engine(spec, cell, state)])
    engine = proxy.engines[cell.index]
    resident, pages_used = [], []
    rng = np.random.default_rng(a.seed + 1)
    waits = rng.integers(1, 6, (len(work), a.turns))

    async def agent(i):
        prompt, obs = work[i]
        for t in range(a.turns):
            req = GenerateRequest(f"x{i}", t, prompt, a.new, (), 1.0)
            out = await proxy.generate(req)
            for _ in range(int(waits[i, t])):  # the tool: the proxy keeps pumping meanwhile
                await asyncio.sleep(0)
            if t + 1 < a.turns:
                prompt = np.concatenate([prompt, out.tokens, obs[t]]).astype(np.int32)
        proxy.end_execution(f"x{i}")

    async def main():
        tasks = [asyncio.create_task(agent(i)) for i in range(len(work))]
        await asyncio.sleep(0)
        while not all(t.done() for t in tasks):
            proxy.pump()
            pool = engine.pool()
            resident.append(pool["resident_contexts"])
            pages_used.append(pool["reserved_tokens"])
            await asyncio.sleep(0)
        for t in tasks:
            t.result()

    t0 = time.perf_counter()
    asyncio.run(main())
    wall = time.perf_counter() - t0
    st = engine.stats
    return {
        "resident_mean": float(np.mean(resident)),
        "resident_max": int(np.max(resident)),
        "evictions": int(st["evictions"]),
        "reprefilled_tokens": int(st["reprefilled_tokens"]),
        "prefilled_tokens": int(st["prompt_tokens"] - st["reused_tokens"]),
        "shared_tokens": int(st["shared_tokens"]),
        "kv_peak_tokens": int(np.max(pages_used)),
        "wall_s": round(wall, 2),
    }


def decode_tps(specs: dict, cell, state, a) -> dict:
    """{name: (best tok/s, median tok/s, exact)} of the decode loops at equal batch,
    alternating; exact: the tokens and logprobs equal the first layout's bit for bit."""
    rng = np.random.default_rng(a.seed + 2)
    lens = np.linspace(300, 1500, a.batch).astype(int)
    prompts = [rng.integers(0, VOCAB, n).astype(np.int32) for n in lens]
    rates = {name: [] for name in specs}
    outs = {}
    engines = {name: Engine(spec, cell, state) for name, spec in specs.items()}
    for e in engines.values():
        e.warmup()
    for run in range(a.runs + 1):  # run 0 warms up
        for name, e in engines.items():
            e.resume()  # an empty pool: every run prefills and decodes the same
            timing = {"s": 0.0, "tok": 0}

            def on(kind, f, timing=timing):
                if kind == "decode":
                    timing["s"] += f["seconds"]
                    timing["tok"] += f["rows"] * f["steps"]

            e.on_timing = on
            rids = [e.submit(GenerateRequest(f"d{run}-{i}", 0, p, a.decode_new, (), 0.0))
                    for i, p in enumerate(prompts)]  # fmt: skip
            got = e.run_until_done()
            outs.setdefault(name, [(got[r].tokens, got[r].logprobs) for r in rids])
            if run:
                rates[name].append(timing["tok"] / timing["s"])
    first = next(iter(outs.values()))
    exact = {n: all(np.array_equal(t, u) and np.array_equal(lp, lq)
                    for (t, lp), (u, lq) in zip(o, first)) for n, o in outs.items()}  # fmt: skip
    return {n: (max(r), statistics.median(r), exact[n]) for n, r in rates.items()}


def main(argv=None):
    a = parse_args(argv)
    (cell,) = gmesh.make_cells(1, devices=jax.devices()[:1])
    spec0 = rollout_spec(1, a.max_len)
    _, state = gdec.init_sharded(spec0.model, a.seed, cell, "rollout")
    work = workload(a)
    ctx = [w[0].size + sum(o.size for o in w[1]) + a.turns * a.new for w in work]
    slot_slots = a.memory // a.max_len
    pages = [int(p) for p in a.pages.split(",")]
    print(f"KV memory {a.memory} tokens; max_len {a.max_len}; {a.executions} executions x "
          f"{a.turns} calls (groups of {a.group}); final context mean {np.mean(ctx):.0f}, "
          f"median {np.median(ctx):.0f}, max {max(ctx)} tokens", flush=True)  # fmt: skip
    rows = {}
    layouts = [("slots", rollout_spec(slot_slots, a.max_len))]
    layouts += [(f"paged {p}", rollout_spec(a.paged_slots, a.max_len, p, a.memory)) for p in pages]
    for name, spec in layouts:
        rows[name] = capacity_run(spec, cell, state, a, work)
        print(f"  {name}: {rows[name]}", flush=True)
    dec_specs = {"slots": rollout_spec(a.batch, a.max_len)}
    dec_specs.update({f"paged {p}": rollout_spec(a.batch, a.max_len, p, a.memory) for p in pages})
    tps = decode_tps(dec_specs, cell, state, a)
    base = rows["slots"]
    head = (f"{'layout':<10} {'slots':>5} {'resident mean':>13} {'max':>4} {'x slots':>7} "
            f"{'evictions':>9} {'re-prefilled':>12} {'prefilled':>9} {'KV peak':>8} "
            f"{'wall s':>7} {'decode tok/s':>12} {'median':>7} {'x slots':>7} {'exact':>5}")  # fmt: skip
    print("\n" + head)
    result = {"memory_tokens": a.memory, "max_len": a.max_len, "batch": a.batch, "layouts": {}}
    for name, spec in layouts:
        r = rows[name]
        best, med, exact = tps[name]
        ratio = r["resident_mean"] / base["resident_mean"]
        dratio = best / tps["slots"][0]
        print(f"{name:<10} {spec.slots:>5} {r['resident_mean']:>13.2f} {r['resident_max']:>4} "
              f"{ratio:>7.2f} {r['evictions']:>9} {r['reprefilled_tokens']:>12} "
              f"{r['prefilled_tokens']:>9} {r['kv_peak_tokens']:>8} {r['wall_s']:>7.1f} "
              f"{best:>12.0f} {med:>7.0f} {dratio:>7.2f} {exact!s:>5}")  # fmt: skip
        result["layouts"][name] = {**r, "slots": spec.slots, "capacity_ratio": round(ratio, 3),
                                   "decode_tok_s_best": round(best, 1),
                                   "decode_tok_s_median": round(med, 1),
                                   "decode_ratio": round(dratio, 3),
                                   "decode_exact": exact}  # fmt: skip
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(main() and 0)
