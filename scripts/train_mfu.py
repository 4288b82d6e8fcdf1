"""A train cell's gradient step at Qwen3-0.6B shapes (random weights): tokens/s and MFU.

    python scripts/train_mfu.py [--rows 1] [--row_len 8192] [--dry-run]

MFU = 6 x parameters x tokens / seconds / peak FLOP/s (attention FLOPs not counted; the
peak is GPU_PEAK_TFLOPS, default 989, an H100 SXM's dense bf16). One cell of all local
devices, bf16 activations, train.remat=full, chunked logits; a causal row per micro-batch
row. --dry-run: a tiny model on CPU (checks the script). Last line: one JSON object.
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

from gyre.config import default_config  # noqa: E402
from gyre.mesh import make_cells  # noqa: E402
from gyre.model import decoder  # noqa: E402
from gyre.rl.builder import build_specs  # noqa: E402
from gyre.run import SHAPES  # noqa: E402
from gyre.train.step import Microbatch, Trainer  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--row_len", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args()
    cfg = default_config()
    if args.dry_run:
        cfg.model.update(vocab_size=512, d_model=64, num_layers=2, d_ff=128, num_heads=4,
                         num_kv_heads=2, head_dim=16)  # fmt: skip
        args.row_len, args.repeats = 256, 1
    else:
        cfg.model.update(SHAPES["qwen3-0.6b"])
        cfg.model.dtype = "bfloat16"
    cfg.train.remat = "full"
    cfg.trajectory.row_len = args.row_len
    cfg.train.rows_per_microbatch = args.rows
    specs = build_specs(cfg)
    n = len(jax.devices())
    cells = make_cells(n, 1, jax.devices()[:n])[:1]
    graphdef, params = decoder.init_sharded(specs.model, 0, cells[0], "train")
    trainer = Trainer(specs.trainer, cells, graphdef, params)
    r, t, v = args.rows * cells[0].mesh.shape["data"], args.row_len, specs.model.vocab_size
    rng = np.random.default_rng(0)
    pos = np.broadcast_to(np.arange(t, dtype=np.int32), (r, t)).copy()
    arrays = {"tokens": rng.integers(0, v, (r, t)).astype(np.int32), "pos": pos,
              "leave": np.full((r, t), t, np.int32), "pred": (pos - 1).astype(np.int32),
              "old_logp": np.full((r, t), -np.log(v), np.float32),
              "adv_pos": np.full((r, t), 0.5, np.float32), "adv_neg": np.zeros((r, t), np.float32),
              "w": np.ones((r, t), np.float32), "versions": np.zeros((r, t), np.int32)}  # fmt: skip
    mb = Microbatch(arrays, ["x"])
    jax.block_until_ready(trainer.compute_grads(cells[0], mb).grads)  # compile
    secs = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        jax.block_until_ready(trainer.compute_grads(cells[0], mb).grads)
        secs.append(time.perf_counter() - start)
    s = statistics.median(secs)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    peak = float(os.environ.get("GPU_PEAK_TFLOPS", "989")) * 1e12 * n
    mfu = 6 * n_params * r * t / s / peak
    print(f"gradient step: {r} x {t} tokens, {n_params / 1e6:.0f}M parameters, {s:.3f} s, "
          f"{r * t / s:,.0f} tokens/s, MFU {mfu:.1%} of {peak / 1e12:.0f} TFLOP/s "
          f"({jax.devices()[0].device_kind})")  # fmt: skip
    print(json.dumps({"seconds": round(s, 4), "tokens_per_s": round(r * t / s, 1),
                      "mfu": round(mfu, 4), "params_m": round(n_params / 1e6, 1),
                      "device": jax.devices()[0].device_kind, "rows": r, "row_len": t}))  # fmt: skip


if __name__ == "__main__":
    main()
