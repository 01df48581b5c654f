"""Trainer checkpoints: the adapter (or full weights), optimizer, LR scheduler and every random
stream, saved together so that a resumed run continues exactly where it stopped.

Layout of one checkpoint directory (written whole into a temp dir, then renamed into place):
    checkpoint/          the policy's `save_pretrained` output (LoRA adapter or full model)
    trainer_state.pt     optimizer, scheduler (grpo_core.update.step.Schedule: the learning-rate schedule and the
                         adaptive entropy coefficient with the entropy it last measured), RNG states, global step
"""
from __future__ import annotations

import random
from pathlib import Path

import torch

from grpo_core.io import atomic_dir

ADAPTER_DIR = "checkpoint"
STATE_FILE = "trainer_state.pt"


def rng_state() -> dict:
    """The Python, NumPy (if present), torch and CUDA random states."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Continue the random streams exactly where `rng_state` captured them (resume = no resume)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np
        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(policy, optimizer, scheduler, global_step: int, out: str | Path) -> Path:
    """Adapter + optimizer + scheduler + RNG into `out`, all or nothing. An existing `out` (left by a
    run killed before it recorded the checkpoint) is replaced."""
    def build(tmp: Path) -> None:
        policy.save(tmp / ADAPTER_DIR)
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                    "rng": rng_state(), "global_step": global_step}, tmp / STATE_FILE)
    return atomic_dir(out, build, replace=True)


def load_trainer_state(state_path: str | Path | None, optimizer, scheduler) -> int:
    """Restore optimizer, scheduler and RNG from a `trainer_state.pt`; return its global step (0 when
    there is none yet)."""
    if not state_path:
        return 0
    saved = torch.load(state_path, weights_only=False)
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    if "rng" in saved:
        set_rng_state(saved["rng"])
    return saved["global_step"]
