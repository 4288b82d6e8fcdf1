"""The tiny training world several test modules share: a one-layer model on 2-device cells."""

from __future__ import annotations

from gyre.config import default_config
from gyre.mesh import make_cells
from gyre.model import decoder
from gyre.rl.builder import build_specs


def small_config(lr: float = 1e-2):
    """A config of a one-layer, 16-token model, rows of 128 tokens, 2 rows per micro-batch."""
    cfg = default_config()
    cfg.model.update(vocab_size=16, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1,
                     head_dim=16, d_ff=64, attn_block=128)  # fmt: skip
    cfg.trajectory.row_len = 128
    cfg.train.rows_per_microbatch = 2
    cfg.train.lr = lr
    return cfg


def train_world(cfg):
    """(specs, cells, graphdef, params): 4 cells of 2 devices, weights on the core cell."""
    specs = build_specs(cfg)
    cells = make_cells(2)
    graphdef, params = decoder.init_sharded(specs.model, 0, cells[0], "train")
    return specs, cells, graphdef, params
