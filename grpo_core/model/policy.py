"""The policy being trained and its frozen reference.

With LoRA the reference is, by default, the base model with the adapter disabled (no second copy in
memory). When the run starts from an adapter (`reference: init`), or when the reference moves toward
the policy (`sync_ref_model`), it is a second, frozen LoRA adapter named "reference" on the same base:
the reference pass switches to it. With full fine-tuning the reference is a frozen copy of the
starting weights.

One process often loads the same base several times in an iteration (rollout, update, evaluate): with LoRA, a
policy's model goes back to a pool when the policy is garbage-collected, and the next `load_policy` of the same
base and LoRA settings with a checkpoint takes it from there and loads the checkpoint's adapter weights into it
(no weight file read, no LoRA injection; the fused sampler keeps its packed base). Its tokenizer goes with it
(while the tokenizer's files are unchanged): copying a parsed tokenizer beats parsing it again. The config's
`kernels.reuse_model: false` turns this off (nothing is pooled or taken from the pool).
`cfg` is the run's GRPOConfig (grpo_core/config.py), read by field: the config sits above this room."""
from __future__ import annotations

import contextlib
import copy
import functools
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from grpo_core.kernels import settings as kernel_settings
from grpo_core.kernels.cpu_linear import use_onednn_linears
from grpo_core.model.loading import (ModelError, attach_lora, file_versions, load_base_model, load_tokenizer,
                              resolve_model, select_device, select_dtype, tokenizer_version)

POLICY_ADAPTER = "default"           # PEFT's name for the adapter a PeftModel is created with
REFERENCE_ADAPTER = "reference"      # also the subdirectory a saved moving reference lives in


@dataclass
class Policy:
    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    use_peft: bool
    ref_model: torch.nn.Module | None = None   # only for full fine-tuning
    reference_adapter: str | None = None       # LoRA: the frozen adapter that is the reference (None: base)
    save_reference: bool = False               # the reference moves (sync_ref_model): checkpoints keep it
    base_dir: Path | None = None               # the base model's directory (what an outside engine such as vLLM loads)

    @contextlib.contextmanager
    def reference(self):
        """Yields the module that computes reference log-probs."""
        if not self.use_peft:
            yield self.ref_model
        elif self.reference_adapter is None:
            with _adapters_disabled(self.model):
                yield self.model
        else:
            with _active_adapter(self.model, self.reference_adapter):
                yield self.model

    def trainable_parameters(self):
        return [p for p in self.model.parameters() if p.requires_grad]

    @torch.no_grad()
    def sync_reference(self, alpha: float) -> None:
        """ref <- alpha * policy + (1 - alpha) * ref, parameter by parameter (TRL's sync_ref_model).

        Full fine-tuning mixes the weights themselves. With LoRA it mixes the reference adapter's
        factors A and B with the policy's: exact for alpha = 1 (a copy); for alpha < 1 the reference's
        weight delta B_ref A_ref is the product of the mixed factors, not the mix of the two products
        (that would need a growing rank)."""
        for ref, live in self._reference_pairs():
            ref.mul_(1.0 - alpha).add_(live.detach().to(ref.dtype), alpha=alpha)

    def _reference_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if not self.use_peft:
            if self.ref_model is None:
                raise ValueError("sync_ref_model needs a reference (beta > 0)")
            return list(zip(self.ref_model.parameters(), self.model.parameters()))
        if self.reference_adapter is None:
            raise ValueError("sync_ref_model with LoRA needs a reference adapter (load_policy creates it)")
        params = dict(self.model.named_parameters())
        ref_key, live_key = f".{self.reference_adapter}.", f".{POLICY_ADAPTER}."
        return [(p, params[name.replace(ref_key, live_key)]) for name, p in params.items() if ref_key in name]

    def save(self, out_dir: Path) -> Path:
        """Adapter (LoRA) or full weights; a moving reference into out_dir/reference. The tokenizer only with full
        weights (a model directory on its own): training never changes it, so an adapter's readers take the base
        model's rather than a copy per iteration (Gemma 3's is 32 MB)."""
        if self.use_peft:
            adapters = [POLICY_ADAPTER] + ([self.reference_adapter] if self.save_reference else [])
            self.model.save_pretrained(out_dir, selected_adapters=adapters)   # others into out_dir/<name>/
        else:
            self.model.save_pretrained(out_dir)
            if self.save_reference and self.ref_model is not None:
                self.ref_model.save_pretrained(Path(out_dir) / REFERENCE_ADAPTER)
            self.tokenizer.save_pretrained(out_dir)
        return out_dir


@contextlib.contextmanager
def _adapters_disabled(model):
    """PEFT's `disable_adapter()` for a LoRA model (each adapter layer and wrapper switched off with its own
    `enable_adapters`, and back on after if the model had them on), without the survey of every layer's
    status that PEFT takes first (tens of milliseconds a call, one per update; docs/speed.md)."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper
    layers = [m for m in model.modules() if isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper))]
    if not hasattr(model, "_adapters_disabled") or any(getattr(c, "is_prompt_learning", False) or
                                                      getattr(c, "is_adaption_prompt", False)
                                                      for c in model.peft_config.values()):
        with model.disable_adapter():
            yield model
        return
    was_on, was_disabled = any(not m.disable_adapters for m in layers), model._adapters_disabled
    try:
        for m in layers:
            m.enable_adapters(False)
        model._adapters_disabled = True
        yield model
    finally:
        if was_on:
            for m in layers:
                m.enable_adapters(True)
        model._adapters_disabled = was_disabled


@contextlib.contextmanager
def _active_adapter(model, name: str):
    """Run `model` with adapter `name` instead of the policy's; every requires_grad flag is restored
    after (PEFT's set_adapter marks the active adapter trainable)."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    model.base_model.set_adapter(name)
    try:
        yield model
    finally:
        model.base_model.set_adapter(POLICY_ADAPTER)
        for p, flag in flags:
            p.requires_grad_(flag)


def contiguous_head_logits(head: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head on a contiguous copy of its input. transformers hands the head a strided slice (the last
    position, `logits_to_keep`), and torch's CPU bfloat16 linear then copies a frozen weight once per batch row
    (gigabytes for a large vocabulary; docs/speed.md), where copying the input costs next to nothing."""
    return F.linear(hidden.contiguous(), head.weight, head.bias)


def fp32_head_logits(head: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head's matmul in float32 (TRL's `cast_lm_head_to_fp32`, ScaleRL): the hidden states, weight and
    bias cast up, autocast off; differentiable in all three. hidden [..., H] -> logits [..., V] float32."""
    with torch.autocast(hidden.device.type, enabled=False):
        bias = None if head.bias is None else head.bias.float()
        return F.linear(hidden.float(), head.weight.float(), bias)


def disable_dropout(model: torch.nn.Module) -> None:
    """TRL's `disable_dropout`: p = 0 in every torch.nn.Dropout of the model (LoRA's included), and the attention
    dropout transformers' attention modules apply as a float (`attention_dropout`), which no module holds."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def lm_head_in_fp32(model: torch.nn.Module, enabled: bool) -> None:
    """TRL's `cast_lm_head_to_fp32` for everything that calls the LM head module (transformers' forward, so the
    hf sampler and evaluation, and the lean sampler): its forward multiplies in float32 (`fp32_head_logits`)
    and returns float32 logits; its weights stay in the model's dtype (checkpoints and the sampler's weight
    snapshot keep their format). Nothing to do for a head already in float32. `enabled` False restores the
    module's own forward (a pooled model may come from a run that had it on), or, for a bfloat16 head, one that
    makes its input contiguous first (`contiguous_head_logits`)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        return
    head.__dict__.pop("forward", None)
    if enabled and head.weight.dtype != torch.float32:
        head.forward = functools.partial(fp32_head_logits, head)
    elif head.weight.dtype == torch.bfloat16:
        head.forward = functools.partial(contiguous_head_logits, head)


def _prepare(cfg, *models: torch.nn.Module | None) -> None:
    """The config's switches that act on the modules: disable_dropout, cast_lm_head_to_fp32."""
    for model in models:
        if model is not None:
            if cfg.disable_dropout:
                disable_dropout(model)
            lm_head_in_fp32(model, cfg.cast_lm_head_to_fp32)


def _saved_reference(checkpoint: str | Path | None) -> Path | None:
    """The moving reference an earlier update saved next to its checkpoint, if any."""
    if checkpoint is None:
        return None
    path = Path(checkpoint) / REFERENCE_ADAPTER
    return path if (path / "adapter_config.json").exists() or (path / "config.json").exists() else None


def add_reference_adapter(model, source: str | Path | None) -> str:
    """A frozen copy of the policy adapter's configuration named "reference", with the weights of the
    adapter saved at `source`, or (source None) the policy adapter's with B = 0, i.e. exactly the base."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from peft.utils import load_peft_weights
    config = copy.deepcopy(model.peft_config[POLICY_ADAPTER])
    config.inference_mode = True
    model.add_adapter(REFERENCE_ADAPTER, config)
    if source is None:
        weights = {k: (torch.zeros_like(v) if "lora_B" in k else v.clone())
                   for k, v in get_peft_model_state_dict(model, adapter_name=POLICY_ADAPTER).items()}
    else:
        weights = load_peft_weights(str(source), device=str(next(model.parameters()).device))
    result = set_peft_model_state_dict(model, weights, adapter_name=REFERENCE_ADAPTER)
    missing = [k for k in getattr(result, "missing_keys", []) if f".{REFERENCE_ADAPTER}." in k]
    if missing:
        raise ModelError(f"reference adapter {source} does not match the policy adapter (missing {missing[:3]})")
    for name, p in model.named_parameters():
        if f".{REFERENCE_ADAPTER}." in name:
            p.requires_grad_(False)
    return REFERENCE_ADAPTER


def _lora_reference(cfg, model, checkpoint, init_adapter) -> str | None:
    """Which frozen adapter is the reference, created on `model`; None: the base (adapter disabled)."""
    saved = _saved_reference(checkpoint)
    if saved is not None:                                   # a moving reference, where the last update left it
        return add_reference_adapter(model, saved)
    if cfg.reference == "init" and init_adapter is not None:
        return add_reference_adapter(model, init_adapter)
    if cfg.sync_ref_model:                                  # the base, as an adapter that can move
        return add_reference_adapter(model, None)
    return None


@dataclass
class _Pooled:
    """A LoRA model no policy holds, with the requires_grad flags and modes it was built with, and the tokenizer
    its last policy had (keyed by models.tokenizer_version)."""
    model: torch.nn.Module
    flags: list[tuple[torch.nn.Parameter, bool]]
    modes: list[tuple[torch.nn.Module, bool]]
    tokenizer: object = None
    tokenizer_version: tuple = ()

    def tokenizer_of(self, base_dir: Path):
        """The pooled tokenizer while `base_dir`'s tokenizer files are those it was read from, else a fresh one."""
        version = tokenizer_version(base_dir)
        if self.tokenizer is None or self.tokenizer_version != version:
            self.tokenizer, self.tokenizer_version = load_tokenizer(base_dir), version
        return self.tokenizer

    @classmethod
    def of(cls, model: torch.nn.Module) -> "_Pooled":
        return cls(model, [(p, p.requires_grad) for p in model.parameters()],
                   [(m, m.training) for m in model.modules()])

    def restore(self) -> torch.nn.Module:
        for p, flag in self.flags:
            p.requires_grad_(flag)
            p.grad = None
        for m, mode in self.modes:
            m.training = mode
        return self.model


_pool: dict[tuple, _Pooled] = {}           # at most one idle model: the last one released
_pool_lock = threading.RLock()            # reentrant: a release may run from garbage collection inside a take


def _pool_key(cfg, base_dir: Path, device: torch.device, dtype: torch.dtype) -> tuple:
    """What a pooled model was built from: the base's weight files (path, size, mtime), device, dtype and the
    LoRA and layer settings that change the modules."""
    files = file_versions(base_dir, lambda f: f.suffix == ".safetensors")
    return (str(Path(base_dir).resolve()), files, str(device), str(dtype), cfg.lora_r, cfg.lora_alpha,
            cfg.lora_dropout, tuple(cfg.lora_target_modules), cfg.cpu_onednn_linear, cfg.gradient_checkpointing,
            cfg.disable_dropout)


def _same_lora(model, checkpoint: Path) -> bool:
    """Whether the adapter saved at `checkpoint` has the shape and scaling of the model's policy adapter."""
    from peft import LoraConfig
    saved, live = LoraConfig.from_pretrained(str(checkpoint)), model.peft_config[POLICY_ADAPTER]
    fields = ("r", "lora_alpha", "lora_dropout", "use_rslora", "use_dora", "bias", "fan_in_fan_out",
              "modules_to_save", "rank_pattern", "alpha_pattern")
    return set(saved.target_modules or ()) == set(live.target_modules or ()) and \
        all(getattr(saved, f, None) == getattr(live, f, None) for f in fields)


def _reuse(key: tuple, checkpoint: str | Path | None) -> _Pooled | None:
    """The pooled model for `key` with the adapter at `checkpoint` loaded into it, or None (build anew)."""
    if checkpoint is None:
        return None
    with _pool_lock:
        pooled = _pool.pop(key, None)
    if pooled is None or not _same_lora(pooled.model, Path(checkpoint)):
        return None
    from peft import set_peft_model_state_dict
    from peft.utils import load_peft_weights
    model = pooled.restore()
    weights = load_peft_weights(str(checkpoint), device=str(next(model.parameters()).device))
    result = set_peft_model_state_dict(model, weights, adapter_name=POLICY_ADAPTER)
    if [k for k in result.missing_keys if f".{POLICY_ADAPTER}." in k] or result.unexpected_keys:
        return None
    return pooled


def _release(key: tuple, pooled: _Pooled) -> None:
    with _pool_lock:
        _pool.clear()
        _pool[key] = pooled


def _lora_model(cfg, base_dir: Path, device: torch.device, dtype: torch.dtype,
                checkpoint: str | Path | None) -> tuple[_Pooled, tuple]:
    """(the LoRA model with the checkpoint's adapter, or a fresh one, with its built state; its pool key)."""
    if checkpoint is not None and not (Path(checkpoint) / "adapter_config.json").exists():
        raise ModelError(f"{checkpoint} holds no LoRA adapter (adapter_config.json missing)")
    key = _pool_key(cfg, base_dir, device, dtype)
    pooled = _reuse(key, checkpoint) if cfg.kernels.reuse_model else None
    if pooled is not None:
        return pooled, key
    base = load_base_model(base_dir, device, dtype)
    if checkpoint is None:
        model = attach_lora(base, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules)
    else:
        from peft import PeftModel
        model = PeftModel.from_pretrained(base, str(checkpoint), is_trainable=True).to(device)
    if cfg.cpu_onednn_linear:
        use_onednn_linears(model)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    return _Pooled.of(model), key


def load_policy(cfg, checkpoint: str | Path | None = None, need_reference: bool = True,
                init_adapter: str | Path | None = None) -> Policy:
    """Base model (+ LoRA, fresh or from `checkpoint`), on the configured device and dtype.

    `init_adapter` is the adapter the run started from (the resolved `init_adapter` of the config; the
    same directory as `checkpoint` at the first iteration): with `reference: init` it is the reference.
    A reference saved inside `checkpoint` (sync_ref_model) takes precedence. No reference is built
    when `need_reference` is False or beta = 0. With LoRA the model may come from the pool (module docstring).
    The config's kernel choices (`kernels:`) become this process's first (grpo_core/kernels/settings.py).
    """
    kernel_settings.apply(cfg.kernels)
    base_dir = resolve_model(cfg.model)
    device = select_device(cfg.device)
    dtype = select_dtype(cfg.dtype, device, cfg.use_peft)
    with_reference = need_reference and cfg.beta != 0.0
    if not cfg.use_peft:
        tokenizer = load_tokenizer(base_dir)
        model = load_base_model(Path(checkpoint) if checkpoint else base_dir, device, dtype)
        ref = None
        if with_reference:
            ref = load_base_model(_saved_reference(checkpoint) or base_dir, device, dtype)
            ref.requires_grad_(False).eval()
        for m in (model, ref):
            if m is not None and cfg.cpu_onednn_linear:
                use_onednn_linears(m)
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        _prepare(cfg, model, ref)
        return Policy(model=model, tokenizer=tokenizer, device=device, use_peft=False, ref_model=ref,
                      save_reference=with_reference and cfg.sync_ref_model, base_dir=base_dir)
    pooled, key = _lora_model(cfg, base_dir, device, dtype, checkpoint)
    tokenizer = pooled.tokenizer_of(base_dir)
    reference_adapter = _lora_reference(cfg, pooled.model, checkpoint, init_adapter) if with_reference else None
    _prepare(cfg, pooled.model)
    policy = Policy(model=pooled.model, tokenizer=tokenizer, device=device, use_peft=True,
                    reference_adapter=reference_adapter, save_reference=with_reference and cfg.sync_ref_model,
                    base_dir=base_dir)
    if reference_adapter is None and cfg.kernels.reuse_model:   # a model with a second adapter is not pooled
        weakref.finalize(policy, _release, key, pooled).atexit = False
    return policy
