"""The memory plan of an experiment per device (gyre/rl/memory_plan.py), from the command line.

    python -m gyre.plan --config=experiments/qwen3_code.py --device_memory=80GB
    python -m gyre.plan --config=experiments/qwen3_code.py --device_memory=80GB \
        --shapes=qwen3-0.6b --config.train.remat=full --json
    # one tree row of 128K tokens: the tree mask, or the tree schedule (8K prefix, 8K branches)
    python -m gyre.plan --config=experiments/qwen3_code.py --shapes=qwen3-0.6b \
        --config.train.remat=full --tree_row=131072 [--tree_prefix=8192 --tree_branch=8192]
    # and the largest train.rows_per_microbatch that fits (a few more compiles)
    python -m gyre.plan --config=experiments/qwen3_code.py --shapes=qwen3-0.6b --auto_rows

Compiles the gradient, update and rollout programs of one cell abstractly (nothing is
allocated, nothing is written, no checkpoint is read when ``--shapes`` gives the architecture)
and prints weights, optimizer state, temporaries and KV per device, then the one line a run
that does not fit stops with, and as its last line one JSON object. Exit status 0 when it
fits, 1 when it does not. Without an accelerator it compiles on CPU with ``mesh.cell_size``
fake devices (XLA:CPU's temporaries: an estimate of a GPU's).
"""

from __future__ import annotations

import sys

from gyre.run import plan_main

if __name__ == "__main__":
    sys.exit(plan_main())
