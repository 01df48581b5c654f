"""The lean trunk's compiled RMSNorm, SiLU gate and rotary embedding (grpo_core/kernels/trunk_ops.py): values
and input gradients equal the model's own torch ops (transformers' Llama RMSNorm, SiLU, rotate_half) at the
default model's shapes, in fp32 and within bf16 rounding in bf16; a norm weight that trains, or no compiled
kernels, takes the torch ops and still gets its gradient."""
from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from grpo_core.kernels import native, trunk_ops
from tests.test_native import needs_compiler

N, C, I, H, d = 37, 576, 1536, 9, 64       # tokens, SmolLM2-135M's hidden and MLP widths, heads, head dim


def _close(got, want, dtype):
    tol = 1e-5 if dtype == torch.float32 else 2e-2                      # bf16: about an ulp of each element
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol), (got.float() - want.float()).abs().max()


def _both(fn, inputs, grad):
    """(output, input gradients) of fn through the compiled ops and through torch ops."""
    out = []
    for compiled in (True, False):
        xs = [x.detach().clone().requires_grad_() for x in inputs]
        saved = trunk_ops._ops
        trunk_ops._ops = saved if compiled else (lambda x: None)
        try:
            y = fn(*xs)
        finally:
            trunk_ops._ops = saved
        y.backward(grad)
        out.append((y.detach(), [x.grad for x in xs]))
    return out


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_op_and_its_gradient_equal_the_models_torch_ops(dtype):
    assert native.load() is not None
    g = torch.Generator().manual_seed(0)

    def rand(*shape, std=1.0):
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    norm = LlamaRMSNorm(C, eps=1e-5).to(dtype).requires_grad_(False)
    norm.weight.copy_(rand(C, std=0.3) + 1)
    (y, (dx,)), (want, (want_dx,)) = _both(lambda x: trunk_ops.rms_norm(norm, x), [rand(2, N, C, std=3)], rand(2, N, C))
    _close(y, want, dtype)
    _close(dx, want_dx, dtype)

    for rows, width in ((N, I), (5, 19)):              # 19 x 5: the vector loops' partial last 16 values
        (y, grads), (want, want_grads) = _both(trunk_ops.gated_silu, [rand(rows, width, std=2), rand(rows, width)],
                                               rand(rows, width))
        _close(y, want, dtype)
        for got, ref in zip(grads, want_grads):
            _close(got, ref, dtype)

    angles = torch.rand(2, N, 1, generator=g) * 40 * torch.linspace(1, 1e-3, d // 2)       # [b, n, d/2]
    cos, sin = angles.cos().repeat(1, 1, 2).to(dtype), angles.sin().repeat(1, 1, 2).to(dtype)
    (y, (dq,)), (want, (want_dq,)) = _both(lambda x: trunk_ops.rope(x, cos, sin), [rand(2, N, H, d)],
                                           rand(2, H, N, d))
    _close(y, want, dtype)
    q = rand(2, N, H, d)
    hf, _ = apply_rotary_pos_emb(q.transpose(1, 2), q.transpose(1, 2), cos, sin)           # transformers' own
    _close(trunk_ops.rope(q, cos, sin), hf, dtype)
    _close(dq, want_dq, dtype)


def test_a_norm_weight_that_trains_takes_the_torch_ops_and_gets_its_gradient():
    norm = LlamaRMSNorm(8)
    x = torch.randn(3, 8)
    trunk_ops.rms_norm(norm, x).sum().backward()
    assert norm.weight.grad is not None and norm.weight.grad.abs().sum() > 0
