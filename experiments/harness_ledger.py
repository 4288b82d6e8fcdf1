"""The agent harness on the ledger task with a mix of scripted policies (no model).

Prints the distribution of ending reasons and tree statistics (paths, unique and flattened
tokens). Run:
  python launch.py --config=experiments/harness_ledger.py --workdir=/tmp/harness_ledger
  python launch.py --config=experiments/harness_ledger.py:10000 --workdir=/tmp/harness_ledger
(the optional argument is K, the number of ledger steps). The launcher calls
``gyre.agent.driver.run(cfg, workdir)``.
"""

from gyre.config import default_config


def get_config(arg=None):
    cfg = default_config()
    cfg.name = "harness_ledger"
    cfg.run.entry = "harness"
    cfg.env.name = "ledger"
    cfg.env.num_ops = int(arg) if arg else 64
    cfg.env.modulus = 10
    cfg.env.tool_latency = 0.0
    k = cfg.env.num_ops
    cfg.agent.context_window = 256
    cfg.agent.max_calls = 2 * k + 32
    cfg.agent.max_tokens = 20 * k + 1000
    cfg.agent.max_seconds = 600.0
    cfg.agent.max_retries = 2
    cfg.agent.model_summary = False
    cfg.rollout.max_new_tokens = 12
    cfg.run.tasks_per_step = 8 if k <= 1000 else 1
    cfg.run.samples_per_task = 4 if k <= 1000 else 10
    return cfg
