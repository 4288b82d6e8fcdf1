"""RL of a local Qwen3 checkpoint on the code task: write a Python function against hidden tests,
with tools (write_file, run_tests, read_file) in the bubblewrap sandbox; 189 shipped problems,
35 held out for evaluation (gyre/envs/code_chat.py, gyre/envs/data/code_problems.json).

On an 8-GPU host (see experiments/chat_common.py for the memory each device needs):
    python launch.py --config=experiments/qwen3_code.py --workdir=workdirs/qwen3_code \
        --config.model.hf_dir=/path/to/Qwen3-1.7B

Memory per device (python -m gyre.plan --config=experiments/qwen3_code.py --device_memory=80GB
--shapes=qwen3-0.6b; XLA:CPU's analysis of a cell of 2 devices, model parallel 2, rows of 8,192,
4 per micro-batch): a train device holds 1.2 GB of float32 weights, 2.4 GB of AdamW state, a
1.2 GB gradient sum and the gradient program's 1.2 GB output plus its temporaries: 134 GB with
logits in one piece and no remat (does not fit), 89 GB with chunked logits, 7.9 GB with
chunked logits and --config.train.remat=full (13.8 GB in all: fits). A rollout device: 1.2 GB
of weights, 15 GB of KV (32 slots x 8,192) and the decode step's temporaries (31 GB on
XLA:CPU, which copies the donated cache). Run the plan for another checkpoint or setting.

On CPU in minutes (a tiny random-init Qwen3 and a local tokenizer, 2 steps):
    python launch.py --config=experiments/qwen3_code.py:tiny --workdir=workdirs/qwen3_code_tiny
"""

from experiments import chat_common


def get_config(arg=None):
    c = chat_common.base("qwen3_code", "code")
    c.env.max_runs = 8
    c.agent.max_calls = 16
    if arg == "tiny":
        chat_common.tiny(c)
    elif arg:
        raise ValueError(f"unknown qwen3_code variant {arg!r}; expected '' or 'tiny'")
    else:
        chat_common.host8(c, context=8192, new_tokens=1024)
    return c
