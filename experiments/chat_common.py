"""Settings shared by the chat-task experiments (qwen3_code.py, reasoning_gym.py).

``host8`` is RL of a local Qwen3 checkpoint on one 8-GPU host; ``tiny`` is the same pipeline
on CPU in minutes: a random-init model of the same architecture family with a locally trained
tokenizer and Qwen3's chat template (``model.hf_dir = "tiny"``, gyre/model/tiny_checkpoint.py),
so every file format, the chat layer and the environment run exactly as they do on a GPU host.
From random weights a ``tiny`` run exercises the plumbing only (no tool call, reward 0); the
chat task that learns on CPU, from a shipped warm start, is experiments/chat_quickstart.py.
"""

from gyre.config import default_config


def host8(c, context: int, new_tokens: int) -> None:
    """An 8-GPU host: 4 cells of 2 devices, weights sharded 2 ways inside a cell.

    Memory per device for a Qwen3-1.7B checkpoint (parameters and optimizer in float32, 16 B
    per parameter while training: 27 GB per training cell, halved by the 2-way 'model' axis),
    bfloat16 activations, and a KV cache of 28 layers x 8 kv heads x 128 x 2 (k, v) x 2 B =
    115 kB per token: 32 slots x ``context`` tokens per rollout cell (30 GB at 8,192, halved
    by the 'model' axis). Larger checkpoints: raise mesh.model_parallel or lower slots.
    """
    c.mesh.num_devices = 8
    c.mesh.cell_size = 2
    c.mesh.model_parallel = 2
    c.model.dtype = "bfloat16"
    c.model.hf_dir = ""  # required: --config.model.hf_dir=/path/to/Qwen3-1.7B
    c.rollout.slots = 32
    c.rollout.max_len = context
    c.rollout.max_new_tokens = new_tokens
    c.rollout.prefill_chunk = 512
    c.rollout.decode_steps = 32
    c.agent.context_window = context
    c.agent.concurrency = 256
    c.trajectory.row_len = context
    # Each decoder block recomputes its activations in the backward pass: without it the
    # gradient program's temporaries at 0.6B shapes and rows of 8,192 tokens are 134 GB per
    # device (`python -m gyre.plan --config=experiments/qwen3_code.py --device_memory=80GB`).
    c.train.remat = "full"
    c.train.lr = 1e-6
    c.train.grad_clip = 1.0
    c.run.steps = 200
    c.run.tasks_per_step = 32
    c.run.samples_per_task = 8
    c.eval.tasks = 128
    c.eval.every = 20


def tiny(c, context: int = 2048, new_tokens: int = 48) -> None:
    """CPU, minutes: a tiny random-init Qwen3 with a local tokenizer, 2 steps."""
    c.model.hf_dir = "tiny"
    c.model.vocab_size = 1024  # the local tokenizer's 1,024 tokens
    c.model.d_model, c.model.num_layers, c.model.d_ff = 64, 2, 128
    c.model.num_heads, c.model.num_kv_heads, c.model.head_dim = 4, 2, 16
    c.model.tie_embeddings = True
    c.mesh.cell_size = 4  # 2 cells of the 8 fake CPU devices
    c.rollout.slots = 8
    c.rollout.max_len = context
    c.rollout.max_new_tokens = new_tokens
    c.rollout.decode_steps = 16
    c.agent.context_window = context
    c.agent.max_calls = 4
    c.agent.concurrency = 16
    c.trajectory.row_len = 2 * context
    c.run.steps, c.run.tasks_per_step, c.run.samples_per_task = 2, 2, 2
    c.eval.tasks, c.eval.every = 4, 0


def base(name: str, env: str):
    c = default_config()
    c.name = name
    c.run.entry = "rl"
    c.env.name = env
    c.env.partial_scale = 0.5
    c.sft.steps = 0  # demonstrations exist for the ledger and calc tasks only
    c.rollout.temperature = 1.0
    c.eval.temperature = 1.0
    c.scheduler.policy = "elastic"
    return c
