"""The tiny rollout model every engine, proxy and KV-pool test shares, so its per-cell programs
compile once per test process."""

import jax
import numpy as np

from gyre import mesh as gmesh
from gyre.config import default_config
from gyre.model import decoder as gdec
from gyre.rl.builder import build_specs
from gyre.rollout.programs import RolloutSpec
from gyre.rollout.types import GenerateRequest


def tiny_spec() -> RolloutSpec:
    cfg = default_config()
    m = cfg.model
    m.d_model, m.num_layers, m.d_ff, m.num_heads, m.num_kv_heads, m.head_dim = 32, 2, 64, 2, 2, 16
    m.attention = "dense"  # the trainer-style reference forward of test_engine; engines ignore it
    cfg.rollout.slots, cfg.rollout.max_len, cfg.rollout.prefill_chunk = 4, 64, 16
    # Short device loops: the tests stop, migrate and reweigh requests mid-generation.
    cfg.rollout.decode_steps = 2
    return build_specs(cfg).rollout


def peaked(state):
    """Scales the tied embedding so logits are O(1): greedy ties cannot flip on rounding."""
    scale = lambda path, x: x * 30.0 if "embed" in jax.tree_util.keystr(path) else x
    return jax.tree_util.tree_map_with_path(scale, state)


SPEC = tiny_spec()
CELLS = gmesh.make_cells(2)  # 4 cells of 2 devices: slots split over 'data'
GRAPHDEF, STATE = gdec.init_sharded(SPEC.model, 0, CELLS[0], "rollout")
STATE = peaked(STATE)


def request(name, prompt, new, temperature=1.0, stop=(), call=0):
    return GenerateRequest(name, call, np.asarray(prompt, np.int32), new, tuple(stop), temperature)


def prompt(seed, n):
    return np.random.default_rng(seed).integers(0, 64, n).astype(np.int32)


def compiles_under_varied_load(engine, then=None) -> int:
    """Compilations after ``engine.warmup()`` while 1, 3, 4, 6 and 2 requests of mixed lengths,
    temperatures and stop tokens run, then three samples of one shared prompt, then
    ``then(engine)`` if given (the engine's programs must not retrace for any of it)."""
    from benchmarks.switch import CompileCounter

    engine.warmup()
    counter = CompileCounter()
    counter.active = True
    try:
        for n in (1, 3, 4, 6, 2):
            for i in range(n):
                engine.submit(request(f"n{n}-{i}", prompt(n * 10 + i, 2 + 7 * i), 1 + 3 * i,
                                      0.0 if i % 2 else 1.0, stop=(5,) * (i % 3)))  # fmt: skip
            engine.run_until_done()
        shared = prompt(99, 30)
        for i in range(3):
            engine.submit(request(f"g{i}", shared, 5))
        engine.run_until_done()
        if then is not None:
            then(engine)
    finally:
        counter.active = False
    return counter.compiles
