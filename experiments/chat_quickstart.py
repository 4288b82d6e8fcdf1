"""The chat quick start: RL of a tiny Qwen3-shaped model (its own 1,024-token tokenizer, Qwen3's
chat template, tool calls in Qwen3's <tool_call> JSON) on arithmetic with a calculator tool
(gyre/envs/calc_chat.py), from a shipped supervised warm start, under the elastic scheduler over
4 cells of 2 fake CPU devices: the controller, scheduler and hand-over of the ledger quick start.

    python launch.py --config=experiments/chat_quickstart.py --workdir=workdirs/chat_quickstart

The warm start (experiments/assets/chat_calc_warm, 2.9 MB) learned from demonstrations that call
the calculator half the time and answer from memory the other half (right answers a
0.7M-parameter model cannot compute): it knows the tool-call format but not that the tool is
worth calling. 700 supervised steps of 16 demonstrations (~12 CPU-minutes, cached like the
ledger's); greedy held-out success 0.33 on 64 tasks (the tool called in 98% of them), the
copies of expression and result being what it still gets wrong.
RL raises held-out success (sampled at temperature 1, the policy RL trains, on the same 256
tasks and sampling keys before and after) by learning to call it; tool calls are counted in
metrics.jsonl (tool_calls, tool_use, eval_tool_use) and shown in executions.txt.

Variants (``:arg``, comma-separated):
    :colocate :async :elastic    scheduler
    :binary :partial             reward (the task has no partial credit: the same here)
    :J1 :J3 :uncapped            path cap J (default 5)
    :tiny                        a two-step pulse for tests, from the warm start
    :warm                        remake the shipped warm start (``sft`` entry, one device):
        python launch.py --config=experiments/chat_quickstart.py:warm --workdir=workdirs/chat_warm
        cp -r workdirs/chat_warm/hf experiments/assets/chat_calc_warm
"""

import os

from experiments import quickstart
from gyre.config import default_config

WARM_START = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "chat_calc_warm")


def get_config(arg=None):
    c = default_config()
    c.name = "chat_quickstart"
    c.run.entry = "rl"
    c.env.name = "calc"
    c.env.partial_scale = 0.5
    # ~0.7M parameters (0.13M of them the tied 1,024 x 128 embedding)
    c.model.hf_dir = WARM_START
    c.model.vocab_size = 1024
    c.model.d_model, c.model.num_layers, c.model.d_ff = 128, 3, 384
    c.model.num_heads, c.model.num_kv_heads, c.model.head_dim = 4, 2, 32
    c.model.tie_embeddings = True
    c.mesh.cell_size = 2
    c.agent.context_window = 512
    c.agent.max_calls = 4
    c.agent.concurrency = 128
    c.rollout.max_len = 512
    c.rollout.slots = 32
    c.rollout.max_new_tokens = 48
    c.rollout.temperature = 1.0
    c.trajectory.row_len = 512
    c.trajectory.loss_mode = "two-level"
    c.train.grad_clip = 1.0
    c.train.rows_per_microbatch = 4
    c.train.lr = 5e-4
    c.scheduler.policy = "elastic"
    # On-policy, and every step waits for all its groups (no carry-over): a resumed run
    # repeats the uninterrupted one exactly (docs/exactness.md).
    c.scheduler.max_staleness = 0
    c.scheduler.close_share = 1.0
    c.run.steps = 10
    c.run.tasks_per_step = 16
    c.run.samples_per_task = 8
    c.eval.tasks = 256
    c.eval.every = 0
    c.eval.temperature = 1.0
    # The warm start's recipe (:warm): demonstrations answer without the tool this often.
    c.sft.mistake_prob = 0.5
    c.sft.batch = 16
    c.sft.lr = 2e-3
    c.sft.eval_every = 50
    for variant in (arg or "").split(","):
        apply_variant(c, variant)
    return c


def init_dir(c) -> str:
    """The warm start's starting checkpoint: random weights of the config's architecture and a
    1,024-token tokenizer trained on the task's text (gyre/envs/calc_chat.py), made once in
    the cache."""
    import dataclasses

    from gyre.cache import cache_path
    from gyre.envs.calc_chat import init_checkpoint
    from gyre.model.decoder import ModelSpec

    keys = {f.name: c.model[f.name] for f in dataclasses.fields(ModelSpec) if f.name in c.model}
    return init_checkpoint(cache_path("calc_init"), ModelSpec(**keys), c.seed)


def apply_variant(c, variant: str) -> None:
    if not variant:
        return
    if variant == "warm":
        c.run.entry = "sft"
        c.model.hf_dir = init_dir(c)  # a random init with the task's tokenizer (in the cache)
        c.sft.steps, c.sft.target_accuracy, c.sft.seed = 700, 0.0, 0
        c.eval.tasks = 64
        c.mesh.cpu_devices, c.mesh.cell_size = 1, 1
    elif variant == "tiny":
        c.run.steps, c.run.tasks_per_step, c.run.samples_per_task = 2, 4, 4
        c.eval.tasks = 4
    else:
        quickstart.apply_variant(c, variant)  # scheduler, reward, path cap
