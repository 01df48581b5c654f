"""Model: resolving and loading the base model, the policy (base + LoRA, reference = adapter off), export."""
