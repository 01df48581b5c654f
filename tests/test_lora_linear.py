"""The lean forward's LoRA linear (grpo_core/kernels/lora_linear.py): in fp32 the same values and gradients
(input, A, B) as PEFT's own forward, on plain and oneDNN-packed bases, with a bias; in bf16 within bf16
rounding of PEFT's, with fp32 gradients for the fp32 factors; disabled and merged adapters give the base;
dropout in training, fp16, two active adapters and DoRA go through PEFT."""
from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from grpo_core.kernels import lora_linear
from grpo_core.kernels.cpu_linear import PackedLinear, use_onednn_linears
from tests.conftest import needs_cpu, skip_unless_cpu


def peft_linear(dtype=torch.float32, bias=False, dropout=0.0, dora=False, pack=False):
    torch.manual_seed(0)
    net = torch.nn.ModuleDict({"q": torch.nn.Linear(40, 24, bias=bias)}).to(dtype)
    if pack:
        assert use_onednn_linears(net) == 1
    model = get_peft_model(net, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=["q"],
                                           use_dora=dora))
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = torch.randn(p.shape) * 0.3                         # B != 0; fp32 factors as we keep them
    return model, model.base_model.model["q"]


def grads(layer, x, out):
    """(y, dL/dx, dL/dA, dL/dB) for L = sum(y * out)."""
    A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    x = x.detach().requires_grad_()
    y = out(x)
    gx, gA, gB = torch.autograd.grad((y.float() * torch.linspace(-1, 1, y.size(-1))).sum(), (x, A, B))
    return y, gx, gA, gB


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


ONEDNN = pytest.param(True, marks=needs_cpu("onednn_linear"))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("pack", [False, ONEDNN], ids=["plain-base", "onednn-base"])
def test_fp32_equals_peft_in_values_and_gradients(bias, pack):
    model, layer = peft_linear(bias=bias, pack=pack)
    assert isinstance(layer.base_layer, PackedLinear) == pack
    x = torch.randn(2, 7, 40)
    want, got = grads(layer, x, layer), grads(layer, x, lambda v: lora_linear.linear(layer, v))
    for w, g in zip(want, got):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.allclose(g, w, atol=1e-5, rtol=1e-5)


def test_bf16_base_is_within_bf16_rounding_of_peft_and_factor_gradients_are_fp32():
    model, layer = peft_linear(torch.bfloat16)
    x = torch.randn(5, 40).to(torch.bfloat16)
    want, got = grads(layer, x, layer), grads(layer, x, lambda v: lora_linear.linear(layer, v))
    assert got[0].dtype == torch.bfloat16 and got[2].dtype == got[3].dtype == torch.float32
    for w, g in zip(want, got):
        assert rel(g, w) < 1e-2


def test_disabled_and_merged_adapters_give_the_base():
    model, layer = peft_linear()
    x = torch.randn(3, 40)
    with model.disable_adapter():
        assert torch.equal(lora_linear.linear(layer, x), layer.base_layer(x))
    adapted = lora_linear.linear(layer, x)
    layer.merge()
    assert torch.equal(lora_linear.linear(layer, x), layer.base_layer(x))
    assert torch.allclose(layer.base_layer(x), adapted, atol=1e-5)


def test_dropout_in_training_fp16_two_adapters_and_dora_go_through_peft(monkeypatch):
    calls = []
    monkeypatch.setattr(lora_linear._LoraLinear, "apply", lambda *a: calls.append(a))
    x = torch.randn(3, 40)
    model, layer = peft_linear(dropout=0.5)
    model.train()
    torch.manual_seed(1)
    want = layer(x)
    torch.manual_seed(1)
    assert torch.equal(lora_linear.linear(layer, x), want)              # PEFT's dropout, same draws
    model.eval()
    lora_linear.linear(layer, x)
    assert len(calls) == 1                                              # dropout is off in eval mode
    model, layer = peft_linear(dora=True)
    assert torch.equal(lora_linear.linear(layer, x), layer(x))
    model, layer = peft_linear(torch.float16)
    assert torch.equal(lora_linear.linear(layer, x.half()), layer(x.half()))     # fp16: PEFT's fp32 low-rank term
    model, layer = peft_linear()
    model.add_adapter("second", LoraConfig(r=2, target_modules=["q"]))
    model.base_model.set_adapter(["default", "second"])
    assert torch.equal(lora_linear.linear(layer, x), layer(x))
    assert len(calls) == 1


def test_input_gradient_on_a_packed_base_multiplies_on_a_packed_transpose_kept_while_the_weight_is():
    """A base with a forward pack takes its input gradient g W from a packed W^T, built once and rebuilt when
    the weight changes; an odd out width (bf16 packs pair it) stays torch's."""
    from grpo_core.kernels import native
    skip_unless_cpu("compiled_matmul", torch.bfloat16)
    ops = native.load()
    assert ops is not None and ops.packed_linear_supported(torch.bfloat16)
    torch.manual_seed(0)
    base = torch.nn.Linear(48, 40, bias=False).to(torch.bfloat16).requires_grad_(False)

    def pack(linear):
        w = linear.weight
        lora_linear.set_packed(linear, ops.pack(w, w.new_empty(ops.packed_numel(*w.shape))), ops)

    pack(base)
    g = torch.randn(19, 40).to(torch.bfloat16)
    want = (g.float() @ base.weight.float()).to(torch.bfloat16)
    got = lora_linear.input_grad(base, g)
    assert base._native_packed_t is not None and torch.allclose(got.float(), want.float(), atol=0.05, rtol=0.02)
    kept = base._native_packed_t[0]
    lora_linear.input_grad(base, g)
    assert base._native_packed_t[0] is kept                              # built once
    with torch.no_grad():
        base.weight.mul_(-1.0)
    pack(base)                                                           # a new forward pack: a new transpose
    got = lora_linear.input_grad(base, g)
    assert base._native_packed_t[0] is not kept and torch.allclose(got.float(), -want.float(), atol=0.05, rtol=0.02)
    lora_linear.set_packed(base, None, None)
    assert base._native_packed_t is None                                 # dropped with the forward pack
    odd = torch.nn.Linear(48, 41, bias=False).to(torch.bfloat16).requires_grad_(False)
    pack(odd)
    g = torch.randn(3, 41).to(torch.bfloat16)
    assert torch.equal(lora_linear.input_grad(odd, g), g @ odd.weight)
    assert getattr(odd, "_native_packed_t", None) is None
