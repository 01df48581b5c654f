"""A PEFT LoRA linear as one autograd function: y = base(x) + s (x A^T) B^T, for the lean forward.

On a bf16 base, PEFT's own forward casts the input to fp32, runs the low-rank term in fp32, adds it to
the base output (promoting that to fp32), scales it and casts the sum back; forward and backward that is
about ten passes over [tokens, out]-sized tensors per adapted linear, which on a CPU cost more than the
base matmul's own backward. Here the low-rank products run in x's dtype, as autocast runs them on a GPU
(the fp32 factors rounded to bf16 for the product, their gradients accumulated in fp32 by the matmul and
returned as fp32), and the low-rank term is accumulated into the base output in place. In fp32 the
arithmetic is PEFT's. Sampling, reference, old and current log-probs all take this path, so they agree.

A frozen base linear that carries a packed copy of its weight (`set_packed`: a view into the sampler's
fused weights, `fused_decode.use_packed_linears`) multiplies on it with the compiled matmul in the forward
pass, and its input gradient g W on a packed copy of W^T, built on the first backward and kept while the
weight stays the same (a second copy of the weight: torch's bf16 matmul runs these shapes up to a third
slower here).

Shapes: N tokens, C in features, O out features, r the adapter's rank.
"""
from __future__ import annotations

import torch

from grpo_core.kernels.cpu_linear import PackedLinear


class Unsupported(Exception):
    """The module holds something these forwards do not reproduce (e.g. DoRA): use the module's own."""


def lora_parts(module) -> tuple[torch.nn.Module, list[tuple[torch.Tensor, torch.Tensor, float]]]:
    """(base linear, [(A [r, C], B [O, r], scale) per active adapter]) of a linear, plain or wrapped by a
    PEFT LoRA layer; a merged or disabled adapter contributes no factors. Raises Unsupported for LoRA
    variants (DoRA, lora_bias, ...)."""
    base = getattr(module, "base_layer", None)
    if base is None:
        return module, []
    if getattr(module, "merged", False) or getattr(module, "disable_adapters", False):
        return base, []
    factors = []
    for name in module.active_adapters:
        if name not in module.lora_A:
            continue
        if name in getattr(module, "lora_variant", {}) or module.use_dora.get(name) or \
                getattr(module, "lora_bias", {}).get(name):
            raise Unsupported(f"a LoRA variant (DoRA, lora_bias, ...) on adapter {name}")
        factors.append((module.lora_A[name].weight, module.lora_B[name].weight, module.scaling[name]))
    return base, factors


def set_packed(base: torch.nn.Linear, packed: torch.Tensor | None, ops) -> None:
    """Give a frozen base linear a packed copy of its weight (`native.NativeOps.pack` layout) for its forward,
    used while the weight stays the same tensor at the same version (an in-place change, or new data as
    `module.to(dtype)` gives, drops it); None takes it away."""
    w = base.weight
    base._native_packed = None if packed is None else (packed, (w.data_ptr(), w._version, w.dtype), ops)
    if packed is None:
        base._native_packed_t = None


def _packed(base, x: torch.Tensor | None = None) -> tuple | None:
    """The pack `base` multiplies on: set, still its weight's, the weight and bias frozen (and x, when
    given, of their dtype)."""
    hit = getattr(base, "_native_packed", None)
    w, b = base.weight, base.bias
    if hit is None or hit[1] != (w.data_ptr(), w._version, w.dtype) or w.requires_grad or \
            (x is not None and x.dtype != w.dtype) or (b is not None and b.requires_grad):
        return None
    return hit


def reads_packed(base) -> bool:
    """Does this frozen base linear multiply on a packed weight (`set_packed`, still valid)?"""
    return _packed(base) is not None


def base_forward(base, x: torch.Tensor) -> torch.Tensor:
    """base(x) for a frozen base linear, on its packed weight where it has one (no autograd: for the forward
    of an autograd function, or under no_grad)."""
    hit = _packed(base, x)
    if hit is None:
        return base(x)
    packed, _, ops = hit
    return ops.packed_linear(x, packed, base.bias, base.out_features)


def input_grad(base, g: torch.Tensor) -> torch.Tensor:
    """g W [N, C] for g [N, O]: the input gradient of a frozen base linear, on a packed W^T where the base has
    a forward pack (W^T packed on first use, kept while the pack's weight is the same)."""
    if isinstance(base, PackedLinear):
        return base.input_grad(g)
    hit = _packed(base, g)
    if hit is None or base.out_features % 2:                    # a bf16 pack pairs the inner (here: out) dim
        return g @ base.weight.detach()
    _, key, ops = hit
    cached = getattr(base, "_native_packed_t", None)
    if cached is None or cached[1] != key:
        w_t = base.weight.detach().T                                         # [C, O]
        cached = base._native_packed_t = (ops.pack(w_t, w_t.new_empty(ops.packed_numel(*w_t.shape))), key)
    return ops.packed_linear(g, cached[0], None, base.in_features)


class _FrozenLinear(torch.autograd.Function):
    """y = x W^T + b with W frozen: the forward on the packed weight, the input gradient g W."""

    @staticmethod
    def forward(ctx, x, base):
        ctx.base = base
        return base_forward(base, x)

    @staticmethod
    def backward(ctx, grad_y):
        return input_grad(ctx.base, grad_y), None


def _dropout_active(module) -> bool:
    return any(isinstance(d, torch.nn.Dropout) and d.p > 0 and d.training for d in module.lora_dropout.values())


class _LoraLinear(torch.autograd.Function):
    """y = base(x) + s (x A^T) B^T with the base frozen; the low-rank products in x's dtype."""

    @staticmethod
    def forward(ctx, x, base, A, B, scale: float):
        a, bs = A.to(x.dtype), (B * scale).to(x.dtype)                      # [r, C], [O, r]
        x2 = x.reshape(-1, x.size(-1))                                       # [N, C]
        t = x2 @ a.T                                                         # [N, r]
        y = base_forward(base, x2).addmm_(t, bs.T)                           # [N, O]
        ctx.save_for_backward(x2, a, bs, t)
        ctx.base, ctx.scale, ctx.shape, ctx.factor_dtype = base, scale, x.shape, A.dtype
        return y.view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad_y):
        x2, a, bs, t = ctx.saved_tensors
        g = grad_y.reshape(-1, grad_y.size(-1))                              # [N, O]
        gt = g @ bs                                                          # [N, r] = dL/dt
        dx = dA = dB = None
        if ctx.needs_input_grad[0]:
            dx = input_grad(ctx.base, g).addmm_(gt, a).view(ctx.shape)         # [N, C]
        if ctx.needs_input_grad[2]:
            dA = (gt.T @ x2).to(ctx.factor_dtype)                            # [r, C]
        if ctx.needs_input_grad[3]:
            dB = (g.T @ t).to(ctx.factor_dtype).mul_(ctx.scale)              # [O, r]
        return dx, None, dA, dB, None


def _frozen(base, x: torch.Tensor) -> torch.Tensor:
    """base(x), on its packed weight where it has one."""
    if torch.is_grad_enabled() and x.requires_grad and _packed(base, x) is not None:
        return _FrozenLinear.apply(x, base)
    return base_forward(base, x)


def linear(module, x: torch.Tensor) -> torch.Tensor:
    """module(x) for a plain or PEFT LoRA linear; one active standard adapter on a frozen fp32 or bf16
    nn.Linear runs as `_LoraLinear`, anything else (dropout in training, several adapters, variants, fp16,
    an input of another dtype) through PEFT."""
    if getattr(module, "base_layer", None) is None:
        return _frozen(module, x)
    try:
        base, factors = lora_parts(module)
    except Unsupported:
        return module(x)
    if not factors:
        return _frozen(base, x)
    frozen = not base.weight.requires_grad and (base.bias is None or not base.bias.requires_grad)
    plain = isinstance(base, torch.nn.Linear) and x.dtype == base.weight.dtype in (torch.float32, torch.bfloat16)
    if len(factors) > 1 or not plain or not frozen or _dropout_active(module):
        return module(x)
    A, B, scale = factors[0]
    return _LoraLinear.apply(x, base, A, B, scale)
