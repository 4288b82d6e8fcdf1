"""RL of a local Qwen3 checkpoint on the code task: write a Python function against hidden tests,
with tools (write_file, run_tests, read_file) in the bubblewrap sandbox; 189 shipped problems,
35 held out for evaluation (gyre/envs/code_chat.py, gyre/envs/data/code_problems.json).

On an 8-GPU host (see experiments/chat_common.py for the memory each device needs):
    python launch.py --config=experiments/qwen3_code.py --workdir=workdirs/qwen3_code \
        --config.model.hf_dir=/path/to/Qwen3-1.7B

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
