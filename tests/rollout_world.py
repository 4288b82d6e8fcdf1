"""The tiny rollout model every engine, proxy and KV-pool test shares, so its per-cell programs
compile once per test process."""

import jax

from gyre import mesh as gmesh
from gyre.config import default_config
from gyre.model import decoder as gdec
from gyre.rl.builder import build_specs
from gyre.rollout.programs import RolloutSpec


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
