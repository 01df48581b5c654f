"""fp32 linear layers on the CPU through oneDNN, with each weight packed once.

PyTorch sends fp32 matmuls on the CPU to MKL. On AMD CPUs MKL takes a slow generic path, and for
the skinny matrices of token-by-token sampling it is slow everywhere; oneDNN, with the weight
reordered once into its blocked layout, runs the same fp32 arithmetic faster (docs/speed.md; bench/step_speed.py).
The result is fp32 (no reduced-precision accumulation), equal to F.linear up to summation order.

A packed copy costs the weight's memory again (the input gradient uses the plain weight, no copy),
so only weights that do not train in this forward pass use it: the base model under LoRA, a frozen
reference, the tied LM head, and any weight under no_grad (sampling, reference and old log-probs).
A pack is rebuilt when its weight changes in place (its version counter moves), e.g. after an
optimizer step in full fine-tuning.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn.functional as F

from grpo_core.kernels import cpu_features


def onednn_pack(weight: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """[out, in] weight -> oneDNN blocked layout for `_linear_pointwise` (laid out for about `rows`
    input rows when given)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class _PackedLinearFn(torch.autograd.Function):
    """y = x W^T + b with W frozen: the forward on the packed weight, the input gradient on oneDNN too."""

    @staticmethod
    def forward(ctx, x, layer: "PackedLinear", slot: str, weight):
        ctx.layer = layer
        return onednn_linear(x, layer.packed(slot, weight), layer.bias)

    @staticmethod
    def backward(ctx, grad_out):
        return ctx.layer.input_grad(grad_out) if ctx.needs_input_grad[0] else None, None, None, None


class PackedLinear(torch.nn.Linear):
    """An nn.Linear (same parameters, same state dict) whose frozen fp32 CPU weight goes through oneDNN.

    `sampling_weight`, when set, replaces the weight in no-grad forwards (e.g. base + LoRA merged for
    sampling) without touching the parameter, so nothing drifts when the merge is undone."""

    sampling_weight: torch.Tensor | None = None
    pack: bool = True                   # False: oneDNN reads the plain weight (no extra copy, slower at small batch)
    _packs: dict | None = None          # slot -> (source weakref, source version, packed); slots: "w" the
                                        # weight, "s" the sampling weight

    def _cached(self, slot: str, weight: torch.Tensor, make) -> torch.Tensor:
        version = -1 if weight.is_inference() else weight._version    # inference tensors keep no counter
        if self._packs is None:
            self._packs = {}
        hit = self._packs.get(slot)
        if hit is None or hit[0]() is not weight or hit[1] != version:
            hit = self._packs[slot] = (weakref.ref(weight), version, make(weight))
        return hit[2]

    def packed(self, slot: str, weight: torch.Tensor) -> torch.Tensor:
        return self._cached(slot, weight, onednn_pack) if self.pack else weight.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grad = torch.is_grad_enabled()
        sampling = self.sampling_weight is not None and not grad
        weight = self.sampling_weight if sampling else self.weight
        trains = grad and (self.weight.requires_grad or (self.bias is not None and self.bias.requires_grad))
        if trains or x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32:
            return F.linear(x, weight, self.bias)
        slot = "s" if sampling else "w"
        if not (grad and x.requires_grad):                 # nothing to differentiate: skip autograd's wrapper
            return onednn_linear(x, self.packed(slot, weight), self.bias)
        return _PackedLinearFn.apply(x, self, slot, weight)

    def input_grad(self, grad_out: torch.Tensor) -> torch.Tensor:
        """grad_x = grad_y W; oneDNN takes the transposed view as it is (as fast as a pack at these sizes)."""
        return onednn_linear(grad_out, self.weight.detach().t(), None)

    def drop_pack(self, slot: str) -> None:
        if self._packs:
            self._packs.pop(slot, None)


def use_onednn_linears(model: torch.nn.Module, pack: bool = True) -> int:
    """Turn the model's plain fp32 CPU nn.Linear layers (not LoRA's own A/B) into PackedLinear, in place.

    Parameters and state-dict keys are unchanged. pack=False skips the packed copies (no extra
    memory; sampling is slower). Returns how many layers were converted (0 when oneDNN is not usable here:
    `cpu_features` says why, once, in the log)."""
    reason = cpu_features.declines("onednn_linear", torch.float32)
    if reason is not None:
        cpu_features.note_declined("oneDNN fp32 linears", reason)
        return 0
    n = 0
    for name, module in model.named_modules():
        if (type(module) is torch.nn.Linear and "lora_" not in name and module.weight.device.type == "cpu"
                and module.weight.dtype == torch.float32):
            module.__class__ = PackedLinear
            module.pack = pack
            n += 1
    return n


@contextlib.contextmanager
def sampling_weights(layers_and_weights):
    """Within the block, each PackedLinear uses the given weight for no-grad forwards."""
    layers = []
    try:
        for layer, weight in layers_and_weights:
            layer.sampling_weight = weight
            layers.append(layer)
        yield
    finally:
        for layer in layers:
            layer.sampling_weight = None
            layer.drop_pack("s")
