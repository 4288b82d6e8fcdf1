"""Times the real programs on this CPU and fits the simulator's cost model from them.

    python benchmarks/calibrate_cpu.py            # writes gyre/elastic/calibrations/cpu_measured.json
    python benchmarks/calibrate_cpu.py --out /tmp/cpu.json --repeats 3

The setting is the one ``benchmarks/sim_vs_real.py`` runs: experiments/quickstart.py:tiny on
cells of ``--cell_size`` fake CPU devices. Everything is timed through the objects the
controller itself uses (a Controller is built in a temporary workdir):

- engine: chunked prefill and batched decode (steps or device loops), timed per program call
  through ``Engine.on_timing`` while batches of B requests of P prompt tokens run to
  completion; decode rows are (active batch, sum of contexts, median seconds per token step),
  the rows ``benchmarks/decode.py``'s load sweep writes;
- train: ``Trainer.compute_grads`` on micro-batches holding 1..R real rows (fixed shape);
- step: ``apply_step`` (optimizer on the core), publication to the rollout engines and the
  checkpoint the controller saves after every step;
- switch: a cell leaving rollout and coming back (``Controller.apply_roles``).

Medians everywhere: the machine is shared, and a median ignores another process's bursts.
Prints a table; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_OUT = "gyre/elastic/calibrations/cpu_measured.json"


def tiny_config(cell_size: int, cache_dir: str):
    """experiments/quickstart.py:tiny on cells of ``cell_size`` devices (what sim_vs_real runs)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "experiments", "quickstart.py")  # fmt: skip
    spec = importlib.util.spec_from_file_location("quickstart", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = mod.get_config("tiny")
    cfg.mesh.cell_size, cfg.mesh.cache_dir = cell_size, cache_dir
    return cfg


def setup(cfg, workdir: str) -> None:
    """Fake devices and the persistent compile cache, before anything touches a backend."""
    from gyre import mesh, run
    from gyre.config import validate

    validate(cfg)
    run.setup_devices(cfg.mesh.cpu_devices)
    from gyre.cache import cache_dir

    mesh.enable_compilation_cache(cache_dir("xla", cfg.mesh.cache_dir))


def time_engine(engine, batches, prompts, new_tokens: int, repeats: int, seed: int = 0):
    """Runs requests through ``engine``; -> (prefill rows, decode rows).

    Timed through the engine's ``on_timing`` hook (each program call, waited for). Prefill
    rows come from single requests: the sum over the request's prefill calls, with nothing
    else running. Decode rows are per token step, as ``benchmarks/decode.py`` writes them: a
    call running ``steps`` tokens (a device loop) counts seconds / steps, at the mean of the
    live rows' cached tokens over its steps (their sum at the call + rows x (steps - 1) / 2).
    """
    from gyre.rollout.types import GenerateRequest

    prefill_s = collections.defaultdict(float)  # key -> prefill seconds
    dec = collections.defaultdict(list)  # (B, P, batch) -> [(ctx, s per step, steps)]
    key = None

    def on_timing(kind: str, t: dict) -> None:
        if kind == "prefill":
            prefill_s[key] += t["seconds"]
        elif kind == "decode" and t["steps"]:
            n, rows = t["steps"], t["rows"]
            ctx = t["context_tokens"] + rows * (n - 1) / 2
            dec[key + (rows,)].append((ctx, t["seconds"] / n, n))

    rng = np.random.default_rng(seed)

    def submit(b: int, p: int, tag: str) -> list[int]:
        prompts_BxP = rng.integers(1, engine.vocab_size, (b, p)).astype(np.int32)
        return [engine.submit(GenerateRequest(f"cal-{tag}-{j}", 0, prompts_BxP[j], new_tokens))
                for j in range(b)]  # fmt: skip

    engine.warmup()  # every program compiled or loaded before anything is timed
    engine.on_timing = on_timing
    prefill_rows = []
    try:
        for p in prompts:
            chunks, one = -(-p // engine.chunk), []
            for r in range(3 * repeats + 1):
                key = ("prefill", p, r)
                submit(1, p, f"p{p}-{r}")
                engine.run_until_done()
                one.append(prefill_s[key])
            prefill_rows.append({"tokens": chunks * engine.chunk, "prompt_tokens": p,
                                 "seconds": float(np.median(one[1:]))})  # fmt: skip
        dec.clear()
        for p in prompts:
            for b in batches:
                key = (b, p)
                for r in range(max(repeats, 3 * new_tokens)):  # >= 3 calls of the full batch
                    if r >= repeats and len(dec[key + (b,)]) >= 3:
                        break
                    submit(b, p, f"d{b}-{p}-{r}")
                    engine.run_until_done()
    finally:
        engine.on_timing = None
    decode_rows = [
        {"batch": k[2], "context_tokens": float(np.average([c for c, _, _ in v],
                                                           weights=[n for _, _, n in v])),
         "step_s": float(np.median([s for _, s, _ in v])), "samples": sum(n for _, _, n in v)}
        for k, v in sorted(dec.items()) if len(v) >= 3
    ]  # fmt: skip
    return prefill_rows, decode_rows


def synthetic_microbatch(cfg, real_rows: int, seed: int):
    """A [rows_per_microbatch, row_len] micro-batch: ``real_rows`` causal rows, the rest padding."""
    from gyre.train.step import Microbatch
    from gyre.trajectory import schema

    t, rows = cfg.trajectory.row_len, cfg.train.rows_per_microbatch
    rng = np.random.default_rng(seed)
    idx = np.arange(t, dtype=np.int32)
    out = []
    for _ in range(real_rows):
        row = {
            "tokens": rng.integers(1, cfg.model.vocab_size, t).astype(np.int32),
            "pos": idx, "leave": np.full(t, t, np.int32), "pred": idx - 1,
            "old_logp": np.full(t, -3.0, np.float32), "adv_pos": np.full(t, 0.1, np.float32),
            "adv_neg": np.zeros(t, np.float32), "w": np.full(t, 1.0 / t, np.float32),
            "versions": np.zeros(t, np.int32),
        }  # fmt: skip
        out.append(row)
    pad = {k: v[0] for k, v in schema.empty(1, t, schema.device_names()).items()}
    out += [pad] * (rows - real_rows)
    arrays = {k: np.stack([r[k] for r in out]) for k in out[0]}
    return Microbatch(arrays, [])


def time_train(ctrl, cfg, repeats: int):
    """compute_grads per micro-batch fill; -> (train rows, a full micro-batch)."""
    import jax

    cell, rows = ctrl.rt.cells[0], []
    for real in range(1, cfg.train.rows_per_microbatch + 1):
        mb = synthetic_microbatch(cfg, real, seed=real)
        jax.block_until_ready(ctrl.trainer.compute_grads(cell, mb).grads)  # warm
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            res = ctrl.trainer.compute_grads(cell, mb)
            jax.block_until_ready(res.grads)
            times.append(time.perf_counter() - t)
        rows.append({"tokens": real * cfg.trajectory.row_len, "seconds": float(np.median(times))})
    return rows, mb


def time_step(ctrl, mb, repeats: int):
    """apply_step, publication to every rollout engine, checkpoint: one row per repeat."""
    import jax

    rows = []
    for r in range(repeats + 1):
        res = ctrl.trainer.compute_grads(ctrl.rt.cells[0], mb)  # apply_step donates its gradients
        jax.block_until_ready(res.grads)
        t0 = time.perf_counter()
        jax.block_until_ready(ctrl.trainer.apply_step([res]).metrics)
        jax.block_until_ready(ctrl.trainer.params)
        t1 = time.perf_counter()
        ctrl.proxy.set_weights(ctrl.trainer.params, ctrl.trainer.version)
        ctrl.proxy.wait_ready(ctrl.proxy.engines)
        t2 = time.perf_counter()
        ctrl.trainer.save(ctrl.rt.checkpointer, {"next_step": ctrl.trainer.version}, wait=True)
        t3 = time.perf_counter()
        if r:  # the first repeat compiles the update program
            rows.append({"optimizer_s": t1 - t0, "publish_s": t2 - t1, "checkpoint_s": t3 - t2})
    return rows


def time_switch(ctrl, repeats: int):

    rows, k = [], len(ctrl.rt.cells)
    for _ in range(repeats):
        for roles in (["train"] + ["rollout"] * (k - 1), ["rollout"] * k):
            t = time.perf_counter()
            ctrl.apply_roles(roles)
            ctrl.proxy.wait_ready(ctrl.proxy.engines)
            rows.append({"seconds": time.perf_counter() - t, "to": roles[0]})
    return rows


def calibrate(cell_size: int = 4, repeats: int = 3, cache_dir: str = "/tmp/xcache") -> dict:
    """Times everything and returns the calibration (``kind: measured``) as a dict."""
    cfg = tiny_config(cell_size, cache_dir)
    workdir = tempfile.mkdtemp(prefix="gyre_calibrate_")
    setup(cfg, workdir)
    from gyre.rl.builder import build_runtime, build_specs
    from gyre.rl.controller import Controller

    ctrl = Controller(build_runtime(build_specs(cfg), workdir))
    r = cfg.rollout
    prefill, decode = time_engine(
        ctrl.proxy.engines[0], batches=(1, 2, 4, r.slots), prompts=(20, r.prefill_chunk + 8, 2 * r.prefill_chunk + 8),
        new_tokens=r.max_new_tokens, repeats=repeats,
    )  # fmt: skip
    train, mb = time_train(ctrl, cfg, 3 * repeats)
    step = time_step(ctrl, mb, 3 * repeats)
    switch = time_switch(ctrl, 2 * repeats)
    ctrl.rt.checkpointer.close()
    m = cfg.model
    return {
        "source": "python benchmarks/calibrate_cpu.py --cell_size "
        f"{cell_size} --repeats {repeats} (this 2-core CPU, shared with other jobs)",
        "kind": "measured",
        "setting": {
            "config": "experiments/quickstart.py:tiny",
            "cell_size": cell_size,
            "cells": len(ctrl.rt.cells),
            "model": {k: m[k] for k in ("d_model", "num_layers", "d_ff", "vocab_size")},
            "slots": r.slots,
            "max_len": r.max_len,
            "prefill_chunk": r.prefill_chunk,
            "row_len": cfg.trajectory.row_len,
            "rows_per_microbatch": cfg.train.rows_per_microbatch,
        },  # fmt: skip
        "intercepts": True,
        "decode": decode,
        "prefill": prefill,
        "train": train,
        "step": step,
        "switch": switch,
        "fixed": {
            "slots": r.slots,
            "prefill_chunk": r.prefill_chunk,
            "microbatch_tokens": cfg.train.rows_per_microbatch * cfg.trajectory.row_len,
            "handover_reprefill": cfg.scheduler.handover == "retry",
            "shared_cores": True,  # every cell of this CPU runs on the same two cores
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--cell_size", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache_dir", default="/tmp/xcache")
    args = ap.parse_args()
    spec = calibrate(args.cell_size, args.repeats, args.cache_dir)
    from gyre.elastic import calibration

    cost = calibration.from_dict(spec)
    with open(args.out, "w") as f:
        json.dump(spec, f, indent=1)
    print(f"{'decode batch':>12} {'ctx':>8} {'step ms':>9} {'fit ms':>9}")
    for row in spec["decode"]:
        fit = cost.decode_step_s(row["batch"], row["context_tokens"])
        print(f"{row['batch']:>12} {row['context_tokens']:>8.0f} {row['step_s'] * 1e3:>9.2f} "
              f"{fit * 1e3:>9.2f}")  # fmt: skip
    for row in spec["prefill"]:
        print(f"prefill {row['prompt_tokens']:>4} prompt tokens: {row['seconds'] * 1e3:.2f} ms "
              f"(fit {cost.prefill_s(row['prompt_tokens']) * 1e3:.2f})")  # fmt: skip
    for row in spec["train"]:
        fit = cost.microbatch_s + cost.train_per_token_s * row["tokens"]
        print(f"train micro-batch, {row['tokens']:>5} real tokens: {row['seconds'] * 1e3:.2f} ms "
              f"(fit {fit * 1e3:.2f})")  # fmt: skip
    figures = {
        k: getattr(cost, k)
        for k in ("decode_base_s", "decode_per_seq_s", "decode_per_ctx_token_s",
                  "prefill_call_s", "prefill_per_token_s", "microbatch_s", "train_per_token_s", "optimizer_s",
                  "publish_s", "checkpoint_s", "switch_r2t_s")
    }  # fmt: skip
    for k, v in figures.items():
        print(f"{k:>24}: {v * 1e3:.4f} ms")
    print(f"wrote {args.out}")
    print(json.dumps({k: round(v, 9) for k, v in figures.items()}))


if __name__ == "__main__":
    main()
