"""Decode throughput of the rollout engine on CPU vs a no-cache baseline and the bandwidth bound.

For batch B in (1, 8, 32): B requests of a prompt of P tokens generate N tokens each on one
engine (slots = B, one cell of one device). Throughput is completion tokens per second of
steady-state decode steps (compile excluded); prefill tokens per second count the prefill
program calls alone (``Engine.on_timing``), not the first decode loop of the same step. The
baseline runs the full forward of the padded [B, P + N] row for every new token (no KV
cache), same model, same run. The bound: bytes a decode step must read (all weights + the
valid KV of every row) over the memory bandwidth measured with a large numpy copy; we also
report the bytes our dense cached attention actually reads (the whole [L, S, M] cache).

Load sweep (the curve the simulator's cost model uses): one cell with ``slots`` = the largest
batch and ``max_len`` above the longest context; for each number of live requests B and prompt
length C, B requests of C tokens decode together and we time the engine's steady-state decode
(``Engine.step`` calls that prefill nothing and finish nothing; compile excluded by a warm-up),
as seconds per decode token step (a dispatch of ``decode_steps`` tokens counts that many).
Rows are ``{"batch": B, "context_tokens": sum of the live contexts, "step_s": median}`` (as
``benchmarks/calibrate_cpu.py`` writes them), fitted by ``gyre.elastic.calibration``'s
``step_s = base + per_seq * batch + per_ctx * context_tokens``; the output says how well.
Rows also carry ``context_max`` (the longest live context; every row of a point holds the
same), which adds a ``per_max_ctx * context_max`` term: the full sweep's cell (max_len above
1024) decodes by live KV blocks under the default ``rollout.kv_block`` (gyre/rollout/
programs.py ``kv_blocks``), and its step follows the longest live context, not the sum. ``--write-calibration PATH`` writes them as a measured calibration whose other costs come
from ``--calibration-base`` (see gyre/elastic/calibration.py).

    source .venv/bin/activate && PYTHONPATH=. python benchmarks/decode.py [--quick] \
        [--load-only] [--write-calibration PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gyre import mesh as gmesh
from gyre.config import default_config
from gyre.elastic import calibration
from gyre.model import decoder as gdec
from gyre.rl.builder import build_specs
from gyre.rollout.engine import Engine
from gyre.rollout.programs import kv_blocks
from gyre.rollout.types import GenerateRequest

# --model peer: the Qwen3 of benchmarks/vs_tunix.py (5.25M parameters, 21 MB of float32
# weights: more than a core's L2 holds; the bound uses the copy bandwidth measured in the same
# process, whatever level of the memory hierarchy serves it)
MODELS = {
    "tiny": dict(vocab_size=512, d_model=128, num_layers=2, d_ff=512, num_heads=4,
                 num_kv_heads=2, head_dim=32),
    "peer": dict(vocab_size=4096, d_model=256, num_layers=4, d_ff=768, num_heads=8,
                 num_kv_heads=4, head_dim=32),
}  # fmt: skip


def tiny_config(batch: int, max_len: int, model: str = "tiny"):
    cfg = default_config()
    m = cfg.model
    for key, value in MODELS[model].items():
        setattr(m, key, value)
    m.attn_block = 64  # the baseline row (prompt + new) is a multiple of 64
    cfg.rollout.slots, cfg.rollout.max_len, cfg.rollout.prefill_chunk = batch, max_len, 64
    return cfg


def measured_bandwidth(mib: int = 256, runs: int = 5) -> float:
    """Bytes/s of a large numpy copy (each byte is read once and written once)."""
    src = np.ones(mib * 2**20 // 8, np.float64)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best


def requests(batch, prompt_len, new, vocab, call):
    rng = np.random.default_rng(call)
    return [
        GenerateRequest(f"bench{i}", call, rng.integers(0, vocab, prompt_len).astype(np.int32), new)
        for i in range(batch)
    ]


def engine_rate(cfg, cell, state, batch, prompt_len, new):
    """-> (decode tokens/s, prefill tokens/s, decode steps) of one timed pass after a warm-up."""
    engine = Engine(build_specs(cfg).rollout, cell, state)
    prefill_calls: list[float] = []  # seconds of each prefill program call (engine.on_timing)
    engine.on_timing = lambda kind, f: (
        prefill_calls.append(f["seconds"]) if kind == "prefill" else None
    )
    for call in range(2):  # call 0 compiles, call 1 is timed
        for r in requests(batch, prompt_len, new, cfg.model.vocab_size, call):
            engine.submit(r)
        prefill_calls.clear()
        engine.step()  # admission + all prefill chunks + the first decode loop
        while any(s.live and s.length < s.live.prompt.size for s in engine.slots):
            engine.step()
        # the prefill programs alone: the first step's decode loop is not prefill
        prefill_s = sum(prefill_calls)
        steps0, start = engine.stats["decode_steps"], time.perf_counter()
        engine.run_until_done()
        decode_s = time.perf_counter() - start
        steps = engine.stats["decode_steps"] - steps0
    if not steps:
        raise SystemExit(f"batch {batch}: {new} new tokens fit in the first decode loop, which "
                         "is timed with the prefill; nothing left to time as decode")  # fmt: skip
    return batch * steps / decode_s, batch * prompt_len / prefill_s, steps


def baseline_rate(cfg, graphdef, state, batch, prompt_len, new):
    """Full forward of the padded row per generated token (greedy), tokens/s."""
    t = prompt_len + new

    @jax.jit
    def extend(state, tokens_BxT, at):
        """Writes the greedy token after position ``at`` into the row (all on device)."""
        model = nnx.merge(graphdef, state)
        pos = jnp.broadcast_to(jnp.arange(t), tokens_BxT.shape)
        hidden = model(tokens_BxT, pos, jnp.full(tokens_BxT.shape, t))
        h_Bx1xD = jax.lax.dynamic_slice_in_dim(hidden, at, 1, axis=1)
        next_B = jnp.argmax(model.logits(h_Bx1xD)[:, 0], -1).astype(jnp.int32)
        return jax.lax.dynamic_update_slice_in_dim(tokens_BxT, next_B[:, None], at + 1, axis=1)

    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.model.vocab_size, (batch, t)), jnp.int32)
    jax.block_until_ready(extend(state, tokens, jnp.int32(prompt_len - 1)))
    start = time.perf_counter()
    for i in range(prompt_len - 1, t - 1):
        tokens = extend(state, tokens, jnp.int32(i))
    jax.block_until_ready(tokens)
    return batch * (new - 1) / (time.perf_counter() - start)


def step_bytes(cfg, state, batch, prompt_len, new):
    """(ideal bytes, bytes read by the dense cached attention) of one decode step."""
    weights = sum(x.nbytes for x in jax.tree.leaves(state))
    m = cfg.model
    per_token = 2 * m.num_layers * m.num_kv_heads * m.head_dim * 4  # k and v, fp32
    mean_len = prompt_len + new / 2
    return weights + batch * mean_len * per_token, weights + batch * cfg.rollout.max_len * per_token


# Load sweep: live requests (slots = the largest) x prompt tokens each; --quick: a smaller grid.
LOAD_BATCHES, LOAD_CONTEXTS = (1, 2, 4, 8, 16, 32), (64, 256, 1024)
QUICK_BATCHES, QUICK_CONTEXTS = (1, 2, 4, 8), (32, 160)


def with_decode_steps(spec, steps: int | None):
    """``spec`` decoding ``steps`` tokens per dispatch (None: as configured). An engine whose
    RolloutSpec has no ``decode_steps`` field runs one token per dispatch."""
    if steps is None:
        return spec
    if "decode_steps" in {f.name for f in dataclasses.fields(spec)}:
        return dataclasses.replace(spec, decode_steps=steps)
    if steps != 1:
        raise SystemExit("--decode-steps: this engine's RolloutSpec has no decode_steps field")
    return spec


def tokens_per_dispatch(spec) -> int:
    """Decode tokens per dispatch of an engine of ``spec`` (1 for one without the field)."""
    steps = getattr(spec, "decode_steps", 1)
    if steps == -1:  # auto: the engine's own rule
        from gyre.rollout.programs import loop_steps

        return loop_steps(spec)
    return steps


def load_plan(spec, contexts, min_token_steps: int) -> tuple[int, int]:
    """-> (new tokens per request, max_len) so that each point times >= 3 steady dispatches and
    >= ``min_token_steps`` token steps. The first dispatch follows the prompt's prefill in the
    same ``Engine.step`` (untimed) and the last finishes the requests (untimed)."""
    n = tokens_per_dispatch(spec)
    loops = max(3, math.ceil(min_token_steps / n))
    new = 1 + n * (loops + 2)  # the prefill samples one token; then loops + 2 dispatches
    chunk = spec.prefill_chunk
    return new, chunk * math.ceil((max(contexts) + new) / chunk)


def load_point(engine, batch: int, context: int, new: int, seed: int) -> list[tuple]:
    """``batch`` requests of ``context`` random prompt tokens decode together on ``engine``
    -> their steady-state samples (seconds per token step, context_tokens, token steps).

    Only the engine's public surface is used: a step is timed when it prefilled nothing
    (``prefill_chunks`` unchanged), finished nothing, and every live request got one token per
    decode token step (``generated`` grew by batch x ``decode_steps``: no prefill sampled a
    first token in it). Its context_tokens is the mean over its token steps of the cached tokens
    the live rows hold (prompt + sampled - 1 each, one more per token step), as in
    ``calibrate_cpu.py``'s rows.
    """
    rng = np.random.default_rng(seed)
    prompts_BxC = rng.integers(1, engine.vocab_size, (batch, context)).astype(np.int32)
    for j in range(batch):
        engine.submit(GenerateRequest(f"load-{seed}-{j}", 0, prompts_BxC[j], new))
    stats, finished, samples = engine.stats, 0, []
    gen0 = stats["generated"]
    for _ in range(100_000):
        if finished == batch:
            break
        dec0, pre0, gen_before = stats["decode_steps"], stats["prefill_chunks"], stats["generated"]
        start = time.perf_counter()
        done = engine.step()
        seconds = time.perf_counter() - start
        finished += len(done)
        steps, gen = stats["decode_steps"] - dec0, stats["generated"] - gen_before
        if steps and not done and stats["prefill_chunks"] == pre0 and gen == batch * steps:
            held = batch * context + (gen_before - gen0) - batch
            samples.append((seconds / steps, held + batch * (steps - 1) / 2, steps))
    else:
        raise RuntimeError(f"load point batch {batch} context {context} did not finish")
    if len(samples) < 3:
        raise RuntimeError(
            f"load point batch {batch} context {context}: {len(samples)} steady steps, need 3"
        )
    return samples


def load_sweep(spec, cell, state, batches, contexts, new: int, repeats: int) -> list[dict]:
    """Rows of every (batch, context) point. ``repeats`` rounds over the grid, interleaved;
    a point's step_s is the median over its steady dispatches in each round, and of those the
    lowest: on a shared machine another process's burst slows whole rounds, and the least
    disturbed round is the best estimate of the program's own cost (its shape is the curve).
    One engine for all points (same shapes: one compile, excluded by ``warmup``)."""
    engine = Engine(spec, cell, state)
    engine.warmup()
    load_point(engine, max(batches), min(contexts), new, seed=10_000)  # warm the host paths
    grid = [(b, c) for c in contexts for b in batches]
    rounds = {point: [] for point in grid}  # point -> [(median step_s, context_tokens, steps)]
    for round_ in range(repeats):
        for k, (b, c) in enumerate(grid):
            got = load_point(engine, b, c, new, seed=round_ * len(grid) + k)
            step_s, ctx, steps = (np.array(x, float) for x in zip(*got))
            rounds[(b, c)].append(
                (float(np.median(step_s)), float(np.average(ctx, weights=steps)), int(steps.sum()))
            )
    rows = []
    for (b, c), got in rounds.items():
        step_s, ctx, steps = min(got)
        rows.append({"batch": b, "context_tokens": ctx, "step_s": step_s, "samples": steps,
                     # every live row holds the same context: the longest is the mean
                     "context_max": ctx / b, "context_per_seq": c, "tokens_per_s": b / step_s,
                     "round_spread": max(g[0] for g in got) / step_s - 1})  # fmt: skip
    return rows


def step_fit(cost, row: dict) -> float:
    """The cost model's decode step for a measured row."""
    return cost.decode_step_s(row["batch"], row["context_tokens"], row["context_max"])


def fit_report(rows: list[dict], cost) -> dict:
    """How well ``cost.decode_step_s`` explains measured ``rows``: R^2, max and rms relative
    error, the worst row, and each term's share of the step where it is largest."""
    y = np.array([r["step_s"] for r in rows])
    pred = np.array([step_fit(cost, r) for r in rows])
    rel = np.abs(pred - y) / y
    sst = float(np.sum((y - y.mean()) ** 2))
    r2 = round(1 - float(np.sum((pred - y) ** 2)) / sst, 9) + 0.0 if sst > 0 else None  # no -0.0
    worst = int(np.argmax(rel))
    big = max(rows, key=lambda r: r["batch"])
    long = max(rows, key=lambda r: r["context_tokens"])
    return {
        "r2": r2,  # None: every row took the same time
        "max_rel_err": float(rel.max()),
        "rms_rel_err": float(np.sqrt(np.mean(rel**2))),
        "worst": {
            "batch": rows[worst]["batch"],
            "context_per_seq": rows[worst].get("context_per_seq"),
            "rel_err": float(rel[worst]),
        },
        "spread": float(y.max() / y.min() - 1),
        "per_seq_share": cost.decode_per_seq_s * big["batch"] / big["step_s"],
        "per_ctx_share": cost.decode_per_ctx_token_s * long["context_tokens"] / long["step_s"],
        "per_max_ctx_share": cost.decode_per_max_ctx_token_s * long["context_max"] / long["step_s"],
        "decode_base_s": cost.decode_base_s,
        "decode_per_seq_s": cost.decode_per_seq_s,
        "decode_per_ctx_token_s": cost.decode_per_ctx_token_s,
        "decode_per_max_ctx_token_s": cost.decode_per_max_ctx_token_s,
    }


# The fields of a written decode row: the calibration's four, then what tells them apart.
ROW_KEYS = ("batch", "context_tokens", "context_max", "step_s", "samples", "context_per_seq",
            "round_spread")  # fmt: skip


def calibration_spec(rows, setting: dict, base: str, command: str) -> dict:
    """A ``kind: measured`` calibration of the decode rows; everything else from ``base``."""
    return {
        "source": f"{command} (decode load sweep on this {setting['platform']}; prefill, "
        f"train, step and switch costs from the base calibration {base!r})",
        "kind": "measured",
        "base": base,
        "setting": setting,
        "decode": [{k: r[k] for k in ROW_KEYS} for r in rows],
        "fixed": {"slots": setting["slots"]},  # the measured cell's slots
    }


def print_load(rows, report, setting, shape_check) -> None:
    batches = sorted({r["batch"] for r in rows})
    contexts = sorted({r["context_per_seq"] for r in rows})
    at = {(r["batch"], r["context_per_seq"]): r for r in rows}
    print(
        f"\nload sweep: one cell, {setting['slots']} slots x max_len {setting['max_len']}, "
        f"{setting['decode_steps']} decode tokens per dispatch; a point's step time: the "
        f"least disturbed of {setting['rounds']} interleaved rounds (median over >= "
        f"{min(r['samples'] for r in rows)} steady token steps each)"
    )
    head = "".join(f"{f'ctx {c}':>21}" for c in contexts)
    print(f"{'live':>5}{head}    (decode tok/s per cell | step ms | fit ms)")
    for b in batches:
        cells = ""
        for c in contexts:
            r = at[(b, c)]
            cells += f"{r['tokens_per_s']:>9.0f} {r['step_s'] * 1e3:>5.2f} {r['fit_s'] * 1e3:>5.2f}"
        print(f"{b:>5}{cells}")
    f = report
    r2 = "n/a (all equal)" if f["r2"] is None else f"{f['r2']:.3f}"
    print(
        f"linear fit step_s = {f['decode_base_s'] * 1e3:.4f} ms + {f['decode_per_seq_s'] * 1e6:.3f} "
        f"us x batch + {f['decode_per_ctx_token_s'] * 1e9:.3f} ns x context_tokens + "
        f"{f['decode_per_max_ctx_token_s'] * 1e9:.3f} ns x longest context: R^2 {r2}, "
        f"max relative error {f['max_rel_err']:.1%} (batch {f['worst']['batch']}, ctx "
        f"{f['worst']['context_per_seq']}), rms {f['rms_rel_err']:.1%}"
    )
    print(
        f"step time spread over the sweep {f['spread']:.0%}; batch term {f['per_seq_share']:.1%} "
        f"of the step at batch {max(batches)}, context terms {f['per_ctx_share']:.1%} (sum) "
        f"and {f['per_max_ctx_share']:.1%} (longest) of the step at the longest contexts"
    )
    if setting["kv_block"]:
        print(
            f"what the fit's terms stand for: the decode program runs all {setting['slots']} "
            "slots (idle ones computed and discarded) and its attention (gyre/model/"
            f"attention.py live_decode_attention) reads every slot's cache in blocks of "
            f"{setting['kv_block']} up to the longest live context, so a step costs what the "
            "longest context needs for every slot (the longest-context term), not the sum "
            "of the contexts; the fitted terms hold for this cell's slot count"
        )
    else:
        print(
            f"where the linear model does not hold: the decode program runs all "
            f"{setting['slots']} slots (idle ones computed and discarded) and its attention "
            f"(gyre/model/attention.py cached_attention) is dense over all {setting['max_len']} "
            f"cache positions of each, so every step reads the same "
            f"{setting['kv_bytes_read_per_step'] / 2**20:.1f} MiB of KV whatever the load. Its "
            "cost is set by the cell's shape (slots x max_len): the fitted base holds for this "
            "shape only."
        )
    flat = max(f["per_seq_share"], f["per_ctx_share"], f["per_max_ctx_share"]) < 0.1
    if flat:
        print(
            "measured: the live requests and their lengths barely move the step (terms above), "
            "so tokens/s grows about linearly with live requests and not with context; the "
            "per-context coefficient is not attention cost per live token"
        )
    spreads = [r["round_spread"] for r in rows]
    print(
        f"noise: a point's slowest round is {np.median(spreads):.0%} (median over points), up "
        f"to {max(spreads):.0%}, slower than its fastest (this machine is shared)"
    )
    if f["r2"] is not None and f["r2"] < 0.5:
        print(
            f"R^2 {f['r2']:.2f} is low: "
            + (
                "the step barely depends on batch or context, so what varies is mostly noise; "
                "the relative error is the figure to use"
                if flat
                else "the linear model misses the shape of this curve (compare the fit column)"
            )
        )
    if shape_check:
        s = shape_check
        print(
            f"shape check, same load (batch {s['batch']}, ctx {s['context_per_seq']}): step "
            f"{s['step_s'] * 1e3:.2f} ms at max_len {setting['max_len']} vs "
            f"{s['small_step_s'] * 1e3:.2f} ms at max_len {s['small_max_len']} "
            f"({s['step_s'] / s['small_step_s']:.2f}x the time for "
            f"{setting['max_len'] / s['small_max_len']:.1f}x the cache positions)"
        )


def run_load(args, cell) -> dict:
    """The load sweep: prints its tables; -> its figures (and writes the calibration)."""
    batches = QUICK_BATCHES if args.quick else LOAD_BATCHES
    contexts = QUICK_CONTEXTS if args.quick else LOAD_CONTEXTS
    cfg = tiny_config(max(batches), 64)
    spec = with_decode_steps(build_specs(cfg).rollout, args.decode_steps)
    new, max_len = load_plan(spec, contexts, 48)
    spec = dataclasses.replace(spec, max_len=max_len)
    _, state = gdec.init_sharded(spec.model, 0, cell, "rollout")
    rounds = 3
    rows = load_sweep(spec, cell, state, batches, contexts, new, repeats=rounds)
    m = spec.model
    kv_per_token = 2 * m.num_layers * m.num_kv_heads * m.head_dim * jnp.dtype(m.dtype).itemsize
    setting = {
        "platform": jax.devices()[0].platform,
        "model": {
            "d_model": m.d_model,
            "num_layers": m.num_layers,
            "num_heads": m.num_heads,
            "num_kv_heads": m.num_kv_heads,
            "head_dim": m.head_dim,
            "vocab_size": m.vocab_size,
        },
        "slots": spec.slots,
        "max_len": spec.max_len,
        "decode_steps": tokens_per_dispatch(spec),
        "new_tokens": new,
        "rounds": rounds,
        "kv_bytes_read_per_step": int(spec.slots * spec.max_len * kv_per_token),
        "kv_block": kv_blocks(spec)[1],  # decode; 0: dense attention over max_len
    }
    command = "python benchmarks/decode.py" + (" --quick" if args.quick else "")
    if args.decode_steps is not None:
        command += f" --decode-steps {args.decode_steps}"
    cal = calibration_spec(rows, setting, args.calibration_base, command)
    cost = calibration.from_dict(cal)  # the loader the simulator uses
    report = fit_report(rows, cost)
    for r in rows:
        r["fit_s"] = step_fit(cost, r)
    shape_check = None
    if not args.quick:  # the same load on a cell of a quarter the max_len
        # same attention as the big cell (auto would pick dense decode below max_len 1024)
        small = dataclasses.replace(spec, max_len=max(spec.max_len // 4, 64 + new),
                                    kv_block=kv_blocks(spec)[1])  # fmt: skip
        b, c = min(batches), min(contexts)
        (row,) = load_sweep(small, cell, state, [b], [c], new, repeats=3)
        ref = next(r for r in rows if r["batch"] == b and r["context_per_seq"] == c)
        shape_check = {"batch": b, "context_per_seq": c, "step_s": ref["step_s"],
                       "small_max_len": small.max_len, "small_step_s": row["step_s"]}  # fmt: skip
    print_load(rows, report, setting, shape_check)
    if args.write_calibration:
        cal["fit"] = {k: v for k, v in report.items() if k != "worst"}
        with open(args.write_calibration, "w") as f:
            json.dump(cal, f, indent=1)
        print(f"wrote {args.write_calibration} (loads with gyre.elastic.calibration.load)")
    return {
        "slots": spec.slots,
        "max_len": spec.max_len,
        "decode_steps": tokens_per_dispatch(spec),
        "tok_s": {
            f"b{r['batch']}_c{r['context_per_seq']}": round(r["tokens_per_s"], 1) for r in rows
        },
        "fit": {k: (round(v, 12) if isinstance(v, float) else v) for k, v in report.items()},
        "shape_check": shape_check,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens, batches, contexts")
    parser.add_argument("--load-only", action="store_true", help="only the load sweep")
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny",
                        help="tiny (0.56M parameters) or peer (vs_tunix.py's 5.25M Qwen3)")  # fmt: skip
    parser.add_argument("--no-load", action="store_true", help="only the batch table")
    parser.add_argument("--batches", type=lambda s: tuple(int(b) for b in s.split(",")),
                        help="the batch table's batch sizes, e.g. 1,8 (default: 1,8,32; "
                        "--quick: 1,8)")  # fmt: skip
    parser.add_argument("--write-calibration", metavar="PATH", help="the load sweep's rows as a "
                        "measured calibration (gyre/elastic/calibration.py)")  # fmt: skip
    parser.add_argument("--calibration-base", default="cpu_measured",
                        help="calibration supplying the costs the sweep does not measure")  # fmt: skip
    parser.add_argument("--decode-steps", type=int, default=None,
                        help="decode tokens per dispatch in the sweep (default: as configured)")  # fmt: skip
    args = parser.parse_args()
    if args.decode_steps is not None and args.decode_steps < 1:
        parser.error(f"--decode-steps must be >= 1, got {args.decode_steps}")
    (cell,) = gmesh.make_cells(1, devices=jax.devices()[:1])
    figures = {} if args.load_only else batch_table(args, cell)
    if not args.no_load:
        figures["load"] = run_load(args, cell)
    print(json.dumps(figures))


def batch_table(args, cell) -> dict:
    """The batch table (engine vs no-cache baseline vs bandwidth bound); -> its figures."""
    prompt_len, new = (32, 32) if args.quick else (64, 64)
    batches = args.batches or ((1, 8) if args.quick else (1, 8, 32))
    max_len = 128 if args.quick else 256
    bandwidth = measured_bandwidth()
    rows, figures = [], {"bandwidth_GBps": round(bandwidth / 1e9, 2), "prompt": prompt_len}
    figures["new_tokens"] = new
    for b in batches:
        cfg = tiny_config(b, max_len, args.model)
        # The timed window starts after the first engine step (prefill and the first decode
        # loop), so a row needs >= 2 more loops: where a loop runs more tokens (auto: 64 on
        # one slot) the row decodes more, in whole 64s (prompt + new stays a multiple of 64).
        loop, row_new = tokens_per_dispatch(build_specs(cfg).rollout), new
        while row_new - 1 < 2 * loop:
            row_new += 64
        if prompt_len + row_new > max_len:
            cfg = tiny_config(b, prompt_len + row_new, args.model)
        graphdef, state = gdec.init_sharded(build_specs(cfg).model, 0, cell, "rollout")
        decode_tps, prefill_tps, _ = engine_rate(cfg, cell, state, b, prompt_len, row_new)
        base_tps = baseline_rate(cfg, graphdef, state, b, prompt_len, row_new)
        ideal, actual = step_bytes(cfg, state, b, prompt_len, row_new)
        bound_tps = b * bandwidth / ideal
        rows.append((b, decode_tps, prefill_tps, base_tps, bound_tps, actual / ideal, row_new))
        figures[f"b{b}"] = {
            "new_tokens": row_new,
            "engine_decode_tok_s": round(decode_tps, 1),
            "engine_prefill_tok_s": round(prefill_tps, 1),
            "no_cache_tok_s": round(base_tps, 1),
            "speedup_vs_no_cache": round(decode_tps / base_tps, 2),
            "bandwidth_bound_tok_s": round(bound_tps, 1),
            "fraction_of_bound": round(decode_tps / bound_tps, 4),
            "bytes_per_step": int(ideal),
            "bytes_read_dense_attention": int(actual),
        }
    params = sum(x.size for x in jax.tree.leaves(state))
    print(
        f"decode on {jax.devices()[0].platform}, {params / 1e6:.2f}M params, prompt {prompt_len}, "
        f"new tokens per row as listed, measured bandwidth {bandwidth / 1e9:.1f} GB/s"
    )
    print(
        f"{'batch':>5} {'new':>4} {'engine tok/s':>13} {'prefill tok/s':>14} "
        f"{'no-cache tok/s':>15} {'speedup':>8} {'bound tok/s':>12} {'of bound':>9}"
    )
    for b, dec, pre, base, bound, _, row_new in rows:
        print(
            f"{b:>5} {row_new:>4} {dec:>13.1f} {pre:>14.1f} {base:>15.1f} {dec / base:>8.2f} "
            f"{bound:>12.0f} {dec / bound:>9.4f}"
        )
    figures["params"] = int(params)
    return figures


if __name__ == "__main__":
    main()
