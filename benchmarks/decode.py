"""Decode throughput of the rollout engine on CPU vs a no-cache baseline and the bandwidth bound.

For batch B in (1, 8, 32): B requests of a prompt of P tokens generate N tokens each on one
engine (slots = B, one cell of one device). Throughput is completion tokens per second of
steady-state decode steps (compile excluded; prefill timed separately). The baseline runs the
full forward of the padded [B, P + N] row for every new token (no KV cache), same model, same
run. The bound: bytes a decode step must read (all weights + the valid KV of every row) over
the memory bandwidth measured with a large numpy copy; we also report the bytes our dense
cached attention actually reads (the whole [L, S, M] cache).

    source .venv/bin/activate && PYTHONPATH=. python benchmarks/decode.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gyre import mesh as gmesh
from gyre.config import default_config
from gyre.model import decoder as gdec
from gyre.rl.builder import build_specs
from gyre.rollout.engine import Engine
from gyre.rollout.types import GenerateRequest


def tiny_config(batch: int, max_len: int):
    cfg = default_config()
    m = cfg.model
    m.vocab_size, m.d_model, m.num_layers, m.d_ff = 512, 128, 2, 512
    m.num_heads, m.num_kv_heads, m.head_dim = 4, 2, 32
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
    for call in range(2):  # call 0 compiles, call 1 is timed
        for r in requests(batch, prompt_len, new, cfg.model.vocab_size, call):
            engine.submit(r)
        start = time.perf_counter()
        engine.step()  # admission + all prefill chunks + the first decode
        while any(s.live and s.length < s.live.prompt.size for s in engine.slots):
            engine.step()
        prefill_s = time.perf_counter() - start
        steps0, start = engine.stats["decode_steps"], time.perf_counter()
        engine.run_until_done()
        decode_s = time.perf_counter() - start
        steps = engine.stats["decode_steps"] - steps0
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


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer tokens, batches 1 and 8")
    args = parser.parse_args()
    prompt_len, new = (32, 32) if args.quick else (64, 64)
    batches = (1, 8) if args.quick else (1, 8, 32)
    max_len = 128 if args.quick else 256
    (cell,) = gmesh.make_cells(1, devices=jax.devices()[:1])
    bandwidth = measured_bandwidth()
    rows, figures = [], {"bandwidth_GBps": round(bandwidth / 1e9, 2), "prompt": prompt_len}
    figures["new_tokens"] = new
    for b in batches:
        cfg = tiny_config(b, max_len)
        graphdef, state = gdec.init_sharded(build_specs(cfg).model, 0, cell, "rollout")
        decode_tps, prefill_tps, _ = engine_rate(cfg, cell, state, b, prompt_len, new)
        base_tps = baseline_rate(cfg, graphdef, state, b, prompt_len, new)
        ideal, actual = step_bytes(cfg, state, b, prompt_len, new)
        bound_tps = b * bandwidth / ideal
        rows.append((b, decode_tps, prefill_tps, base_tps, bound_tps, actual / ideal))
        figures[f"b{b}"] = {
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
        f"{new} new tokens, measured bandwidth {bandwidth / 1e9:.1f} GB/s"
    )
    print(
        f"{'batch':>5} {'engine tok/s':>13} {'prefill tok/s':>14} {'no-cache tok/s':>15} "
        f"{'speedup':>8} {'bound tok/s':>12} {'of bound':>9}"
    )
    for b, dec, pre, base, bound, _ in rows:
        print(
            f"{b:>5} {dec:>13.1f} {pre:>14.1f} {base:>15.1f} {dec / base:>8.2f} "
            f"{bound:>12.0f} {dec / bound:>9.4f}"
        )
    figures["params"] = int(params)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
