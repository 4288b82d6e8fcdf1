"""Role switch, measured: weights between two cells' layouts vs a plain device_put, and the
time until the first program runs on the new role, with XLA compilations counted.

The devices are cut into cells (default 8 devices -> 2 cells of 4; fake CPU devices when the
platform is CPU). Cell 0 is the core (train layout, optimizer); the last cell switches roles
through the real path of ``Controller.apply_roles``:

- rollout->train: ``proxy.release(j)`` (hand-over of the cell's live requests -- none here --
  and ``Engine.suspend``, which frees the KV cache). That moves **no weights**: the weights
  reach the cell lazily, at its first gradient micro-batch, where ``Trainer.params_for(cell,
  'train')`` moves the core's train-layout weights into the cell's train layout (FSDP over
  'data'). Timed: release, that move (blocked), and release -> first gradient done.
- train->rollout: ``proxy.admit(j, trainer.params, version)`` = ``Engine.resume``: a new
  (zeroed) KV cache plus ``set_weights`` = ``gmesh.move`` of the core's train-layout weights
  into the cell's rollout layout (replicated over 'data'). Timed: the move alone, admit
  (move + cache allocation, blocked), and admit -> first decode step done.

Reference: a plain ``jax.device_put`` of one flat float32 array of the same bytes onto the
same destination devices, sharded the way the destination layout is (over every device for
train; over 'model', replicated over 'data' for rollout), so both write the same bytes per
destination device; from the core cell's devices either sharded over all of them (like the
train-layout weights) or already in the destination's layout (a plain copy per device). The
ratio 'vs device_put' is against the faster of the two (the stricter one). Bytes count
what lands on the destination devices (replicas included). Each figure is the median of
``--repeats`` switch cycles after one warm-up cycle; compilations (the
``/jax/core/compile/backend_compile_duration`` event) and traces are counted over the timed
cycles and must be 0.

    source .venv/bin/activate && PYTHONPATH=. python benchmarks/switch.py [--d-model 512 ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from gyre import mesh as gmesh
from gyre.config import default_config
from gyre.model import decoder as gdec
from gyre.rl.builder import build_specs
from gyre.rollout.engine import Engine
from gyre.rollout.proxy import Proxy
from gyre.rollout.types import GenerateRequest
from gyre.train.step import Trainer, split_microbatches
from gyre.trajectory import schema

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"


class CompileCounter:
    """Counts XLA backend compilations and jaxpr traces while ``active`` (process-wide)."""

    def __init__(self):
        self.active, self.compiles, self.traces = False, 0, 0
        jax.monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, event: str, duration: float, **_) -> None:
        if self.active:
            self.compiles += event == COMPILE_EVENT
            self.traces += event == TRACE_EVENT


def config(args):
    cfg = default_config()
    m = cfg.model
    m.vocab_size, m.d_model, m.num_layers, m.d_ff = args.vocab, args.d_model, args.layers, args.d_ff
    m.num_heads, m.num_kv_heads, m.head_dim = args.heads, args.kv_heads, args.head_dim
    m.hf_dir = ""
    cfg.mesh.cell_size, cfg.mesh.model_parallel = args.cell_size, args.model_parallel
    cfg.rollout.slots, cfg.rollout.max_len, cfg.rollout.prefill_chunk = args.slots, args.max_len, 32
    cfg.train.rows_per_microbatch = args.rows
    cfg.train.kl_coef = 0.0
    return cfg


def microbatch(rows: int, t: int, vocab: int, seed: int):
    """One micro-batch of random causal rows (weights 1), [rows, t] per device field of gyre/trajectory/schema.py."""
    rng = np.random.default_rng(seed)
    idx = np.broadcast_to(np.arange(t, dtype=np.int32), (rows, t))
    batch = {
        "tokens": rng.integers(0, vocab, (rows, t)).astype(np.int32),
        "pos": idx.copy(),
        "leave": np.full((rows, t), t, np.int32),
        "pred": np.concatenate([idx[:, 1:], np.full((rows, 1), -1, np.int32)], 1),
        "old_logp": np.full((rows, t), -np.log(vocab), np.float32),
        "adv_pos": np.ones((rows, t), np.float32),
        "adv_neg": np.zeros((rows, t), np.float32),
        "w": np.ones((rows, t), np.float32),
        "versions": np.zeros((rows, t), np.int32),
    }
    assert set(batch) == set(schema.device_names())
    (mb,) = split_microbatches(batch, rows)
    return mb


def dest_bytes(tree) -> int:
    """Bytes that ``tree`` occupies on its devices, replicas included."""
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards)


def flat_reference(src_cell, dst_cell, weight_bytes: int, role: str, same_layout: bool):
    """(source array, destination sharding): one flat fp32 buffer of ``weight_bytes``.

    On the destination it is sharded like the role's layout (over every device for train;
    over 'model', replicated over 'data' for rollout). On the source it is either sharded
    over every device (as the train-layout weights are) or, ``same_layout``, laid out as on
    the destination, so the put is a plain copy device to device."""
    n = src_cell.size * dst_cell.size
    count = -(-weight_bytes // 4 // n) * n
    spec = PartitionSpec(gmesh.AXES) if role == "train" else PartitionSpec("model")
    src_spec = spec if same_layout else PartitionSpec(gmesh.AXES)
    src = jax.device_put(np.ones(count, np.float32), NamedSharding(src_cell.mesh, src_spec))
    return src, NamedSharding(dst_cell.mesh, spec)


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    jax.block_until_ready(out)
    return time.perf_counter() - t0, out


def cycle(trainer, proxy, cell, mb, request):
    """One switch rollout->train->rollout of ``cell``; -> dict of seconds."""
    eng = proxy.engines[cell.index]
    out = {}
    # rollout -> train
    trainer.version += 1  # stands for an optimizer step: params_for moves the new weights
    t0 = time.perf_counter()
    proxy.release(cell.index)
    out["r2t_release_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    jax.block_until_ready(trainer.params_for(cell, "train"))
    out["r2t_move_s"] = time.perf_counter() - t1
    res = trainer.compute_grads(cell, mb)
    jax.block_until_ready((res.grads, res.metrics))
    out["r2t_first_s"] = time.perf_counter() - t0
    # train -> rollout: the move alone (what set_weights does), then the real admit
    out["t2r_move_s"], _ = timed(lambda: gmesh.move(trainer.params, eng.programs.state_sh))
    t0 = time.perf_counter()
    proxy.admit(cell.index, trainer.params, trainer.version)
    jax.block_until_ready((eng.weights, eng.cache))
    out["t2r_admit_s"] = time.perf_counter() - t0
    eng.submit(request)
    steps = eng.stats["decode_steps"]
    while eng.stats["decode_steps"] == steps:
        eng.step()  # admission + prefill of the short prompt, then the first decode step
    jax.block_until_ready(eng.cache)
    out["t2r_first_s"] = time.perf_counter() - t0
    eng.run_until_done()
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--devices", type=int, default=8, help="fake CPU devices (CPU only)")
    p.add_argument("--cell-size", type=int, default=4)
    p.add_argument("--model-parallel", type=int, default=1)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-ff", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--rows", type=int, default=4, help="rows of the first gradient micro-batch")
    p.add_argument("--seq", type=int, default=32, help="tokens per micro-batch row")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    jax.config.update("jax_num_cpu_devices", args.devices)  # only the CPU backend reads it

    specs = build_specs(config(args))
    cells = gmesh.cells_for(specs.mesh)
    if len(cells) < 2:
        raise SystemExit(f"need >= 2 cells, got {len(cells)} of {args.cell_size} devices")
    core, cell = cells[0], cells[-1]
    graphdef, params = gdec.init_sharded(specs.model, 0, core, "train")
    trainer = Trainer(specs.trainer, cells, graphdef, params)
    proxy = Proxy([Engine(specs.rollout, c, trainer.params_for(c, "rollout"), 0) for c in cells])
    proxy.latest_weights = (trainer.params, trainer.version)
    mb = microbatch(args.rows, args.seq, args.vocab, 0)
    request = GenerateRequest("bench", 0, np.arange(1, 9, dtype=np.int32) % args.vocab, 2)

    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(trainer.params))
    refs = {(role, same): flat_reference(core, cell, weight_bytes, role, same)
            for role in gmesh.ROLES for same in (False, True)}  # fmt: skip

    def reference(key):
        src, sh = refs[key]
        return timed(lambda: jax.device_put(src, sh))

    counter = CompileCounter()
    proxy.engines[cell.index].warmup()
    cycle(trainer, proxy, cell, mb, request)  # warm-up: every program compiles here
    for key in refs:
        reference(key)
    counter.active = True
    runs, ref = [], {key: [] for key in refs}
    for _ in range(args.repeats):
        runs.append(cycle(trainer, proxy, cell, mb, request))
        for key in refs:
            ref[key].append(reference(key)[0])
    counter.active = False
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    both = {key: statistics.median(v) for key, v in ref.items()}
    # The reference for each role: the faster of the two puts (the stricter comparison).
    ref_s = {role: min(both[role, False], both[role, True]) for role in gmesh.ROLES}

    eng = proxy.engines[cell.index]
    b_train = dest_bytes(trainer.params_for(cell, "train"))
    b_roll = dest_bytes(eng.weights)
    b_ref = {role: dest_bytes(jax.device_put(*refs[role, True])) for role in gmesh.ROLES}
    cache_bytes = dest_bytes(eng.cache)
    rows = [  # name, bytes, seconds, reference role
        ("r2t release (hand-over + free cache)", 0, med["r2t_release_s"], None),
        ("r2t weights core->cell train layout", b_train, med["r2t_move_s"], "train"),
        ("r2t device_put flat, sharded source", b_ref["train"], both["train", False], None),
        ("r2t device_put flat, same layout", b_ref["train"], both["train", True], None),
        ("r2t release -> first gradient done", b_train, med["r2t_first_s"], None),
        ("t2r weights core->cell rollout layout", b_roll, med["t2r_move_s"], "rollout"),
        ("t2r admit (weights + new KV cache)", b_roll, med["t2r_admit_s"], "rollout"),
        ("t2r device_put flat, sharded source", b_ref["rollout"], both["rollout", False], None),
        ("t2r device_put flat, same layout", b_ref["rollout"], both["rollout", True], None),
        ("t2r admit -> first decode step done", b_roll, med["t2r_first_s"], None),
    ]
    n_params = sum(x.size for x in jax.tree.leaves(trainer.params))
    print(
        f"role switch on {jax.devices()[0].platform}: {n_params / 1e6:.2f}M params "
        f"({weight_bytes / 2**20:.1f} MiB fp32), cells of {args.cell_size} "
        f"(model_parallel {args.model_parallel}), core cell 0 -> cell {cell.index}, "
        f"KV cache {cache_bytes / 2**20:.1f} MiB, median of {args.repeats}"
    )
    print(f"{'step':<40} {'MiB':>8} {'ms':>9} {'GB/s':>7} {'vs device_put':>14}")
    # 'vs device_put': bandwidth over that of the faster of the role's two flat puts.
    figures = {"params": int(n_params), "weight_bytes": int(weight_bytes),
               "cell_size": args.cell_size, "model_parallel": args.model_parallel,
               "repeats": args.repeats, "kv_cache_bytes": int(cache_bytes)}  # fmt: skip
    for name, nbytes, s, role in rows:
        gbps = nbytes / s / 1e9 if nbytes else 0.0
        ratio = (nbytes / s) / (b_ref[role] / ref_s[role]) if role else None
        print(f"{name:<40} {nbytes / 2**20:>8.2f} {s * 1e3:>9.2f} {gbps:>7.2f} "
              f"{'' if ratio is None else f'{ratio:.2f}':>14}")  # fmt: skip
    for key, s in med.items():
        figures[key] = round(s, 5)
    figures["r2t_bytes"], figures["t2r_bytes"] = int(b_train), int(b_roll)
    for role in gmesh.ROLES:
        figures[f"device_put_{role}_sharded_source_s"] = round(both[role, False], 5)
        figures[f"device_put_{role}_same_layout_s"] = round(both[role, True], 5)
        figures[f"device_put_{role}_bytes"] = int(b_ref[role])
    bw = lambda b, s: b / s
    figures["r2t_move_vs_device_put"] = round(
        bw(b_train, med["r2t_move_s"]) / bw(b_ref["train"], ref_s["train"]), 3
    )
    figures["t2r_move_vs_device_put"] = round(
        bw(b_roll, med["t2r_move_s"]) / bw(b_ref["rollout"], ref_s["rollout"]), 3
    )
    figures["t2r_admit_vs_device_put"] = round(
        bw(b_roll, med["t2r_admit_s"]) / bw(b_ref["rollout"], ref_s["rollout"]), 3
    )
    figures["compiles_after_warmup"] = counter.compiles
    figures["traces_after_warmup"] = counter.traces
    figures["meets_half_bandwidth"] = bool(
        min(figures["r2t_move_vs_device_put"], figures["t2r_admit_vs_device_put"]) >= 0.5
    )
    print(f"compilations after warm-up: {counter.compiles} (traces {counter.traces})")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
