"""RL of a local Qwen3 checkpoint on reasoning-gym's procedural tasks (their own verifiers; the
fractional score is the partial credit of a wrong answer). Any task names, comma-separated:
--config.env.tasks=basic_arithmetic,chain_sum (gyre/envs/reasoning_gym_env.py).

On an 8-GPU host (see experiments/chat_common.py for the memory each device needs):
    python launch.py --config=experiments/reasoning_gym.py --workdir=workdirs/rg \
        --config.model.hf_dir=/path/to/Qwen3-1.7B

On CPU in minutes (a tiny random-init Qwen3 and a local tokenizer, 2 steps):
    python launch.py --config=experiments/reasoning_gym.py:tiny --workdir=workdirs/rg_tiny
"""

from experiments import chat_common


def get_config(arg=None):
    c = chat_common.base("reasoning_gym", "reasoning_gym")
    c.env.tasks = "basic_arithmetic,chain_sum"
    c.agent.max_calls = 1  # one answer per task
    if arg == "tiny":
        chat_common.tiny(c, context=1024, new_tokens=48)
        c.agent.max_calls = 1
    elif arg:
        raise ValueError(f"unknown reasoning_gym variant {arg!r}; expected '' or 'tiny'")
    else:
        chat_common.host8(c, context=4096, new_tokens=2048)
    return c
