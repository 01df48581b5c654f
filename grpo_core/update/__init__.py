"""Update: the GRPO loss, log-probs, the optimizer step, the warm start, dynamic sampling, trainer checkpoints."""
