"""Chat text <-> tokens for checkpoints with a tokenizer and chat template: the template
rendered as transformers renders it, turns appended as tokens (format.py), and Qwen3 tool
calls parsed from generated text (toolcalls.py). Depends on nothing else in gyre, so the
model loader and the environments both build on it."""
