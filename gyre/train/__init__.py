"""Training: tree-packed policy loss (loss), per-cell gradient programs and the optimizer on the
core cell (step, optimizer), checkpoints (checkpoint), supervised fine-tuning (sft)."""
