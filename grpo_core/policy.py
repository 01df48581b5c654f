"""The policy being trained and its frozen reference.

With LoRA the reference is the base model with the adapter disabled (no second copy in memory);
with full fine-tuning it is a frozen copy of the starting weights.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch

from grpo_core.config import GRPOConfig
from grpo_core.kernels.cpu_linear import use_onednn_linears
from grpo_core.models import (ModelError, attach_lora, load_base_model, load_tokenizer, resolve_model,
                              select_device, select_dtype)


@dataclass
class Policy:
    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    use_peft: bool
    ref_model: torch.nn.Module | None = None   # only for full fine-tuning

    @contextlib.contextmanager
    def reference(self):
        """Yields the module that computes reference log-probs."""
        if self.use_peft:
            with self.model.disable_adapter():
                yield self.model
        else:
            yield self.ref_model

    def trainable_parameters(self):
        return [p for p in self.model.parameters() if p.requires_grad]

    def save(self, out_dir: Path) -> Path:
        """Adapter (LoRA) or full weights, plus the tokenizer."""
        self.model.save_pretrained(out_dir)
        self.tokenizer.save_pretrained(out_dir)
        return out_dir


def load_policy(cfg: GRPOConfig, checkpoint: str | Path | None = None, need_reference: bool = True) -> Policy:
    """Base model (+ LoRA, fresh or from `checkpoint`), on the configured device and dtype."""
    base_dir = resolve_model(cfg.model)
    device = select_device(cfg.device)
    dtype = select_dtype(cfg.dtype, device)
    tokenizer = load_tokenizer(base_dir)
    if cfg.use_peft:
        base = load_base_model(base_dir, device, dtype)
        if checkpoint is None:
            model = attach_lora(base, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules)
        else:
            from peft import PeftModel
            if not (Path(checkpoint) / "adapter_config.json").exists():
                raise ModelError(f"{checkpoint} holds no LoRA adapter (adapter_config.json missing)")
            model = PeftModel.from_pretrained(base, str(checkpoint), is_trainable=True).to(device)
        ref = None
    else:
        model = load_base_model(Path(checkpoint) if checkpoint else base_dir, device, dtype)
        ref = None
        if need_reference and cfg.beta != 0.0:
            ref = load_base_model(base_dir, device, dtype)
            ref.requires_grad_(False).eval()
    if cfg.cpu_onednn_linear:
        for m in (model, ref):
            if m is not None:
                use_onednn_linears(m)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if cfg.use_peft:
            model.enable_input_require_grads()
    return Policy(model=model, tokenizer=tokenizer, device=device, use_peft=cfg.use_peft, ref_model=ref)

