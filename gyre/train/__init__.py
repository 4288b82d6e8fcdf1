"""Training: tree-packed losses (loss: policy and supervised objectives), per-cell gradient
programs and the optimizer on the core cell (step, optimizer), checkpoints (checkpoint)."""
