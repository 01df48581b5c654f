"""The lean trunk's RMSNorm, SiLU gate and rotary embedding as autograd functions over compiled kernels
(`trunk_ops.cpp`, loaded by `native.load()`): each one pass forward and one backward, where as torch ops
on bf16 each is a chain of casts and products. Where they do not apply (no compiler, not a CPU, not
float32 / bfloat16, a norm weight that trains) the same arithmetic runs as the model's own torch ops.

Shapes: b rows, n tokens, H heads, d head dim, C width.
"""
from __future__ import annotations

import torch

from grpo_core.kernels import native


def _ops(x: torch.Tensor):
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    return native.load()


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float, ops):
        x2 = x.reshape(-1, x.size(-1)).contiguous()                          # [N, C]
        y, rstd = ops.rms_norm(x2, weight, eps)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.ops = ops
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        x2, weight, rstd = ctx.saved_tensors
        dx = ctx.ops.rms_norm_backward(x2, weight, rstd, grad.reshape(x2.shape).contiguous())
        return dx.view(grad.shape), None, None, None


class _GatedSilu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, ops):
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        ctx.ops = ops
        return ops.gated_silu(gate, up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        return *ctx.ops.gated_silu_backward(gate, up, grad.contiguous()), None


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, ops):
        b, n, H, d = x.shape
        ctx.save_for_backward(cos, sin)
        ctx.ops = ops
        return ops.rope(x.contiguous().view(b * n, H, d), cos, sin).view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        b, n, H, d = grad.shape
        dx = ctx.ops.rope(grad.contiguous().view(b * n, H, d), cos, sin, backward=True)
        return dx.view(grad.shape), None, None, None


def rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """norm(x) for a Llama / Qwen2 RMSNorm module (x / rms(x), rounded, times its weight)."""
    w, ops = norm.weight, _ops(x)
    if ops is None or w.requires_grad or w.dtype != x.dtype or not w.is_contiguous():
        return norm(x)
    return _RMSNorm.apply(x, w, norm.variance_epsilon, ops)


def gated_silu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up."""
    ops = _ops(gate) if gate.dtype == up.dtype else None
    return torch.nn.functional.silu(gate) * up if ops is None else _GatedSilu.apply(gate, up, ops)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama's rotary embedding x cos + rotate_half(x) sin. x [b, n, H, d], cos, sin [b, n, d] -> [b, H, n, d]."""
    ops = _ops(x) if cos.dtype == x.dtype else None
    if ops is None:
        x = x.transpose(1, 2)
        half = x.size(-1) // 2
        return x * cos[:, None] + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin[:, None]
    d = x.size(-1)
    return _Rope.apply(x, cos.contiguous().view(-1, d), sin.contiguous().view(-1, d), ops).transpose(1, 2)
