"""oneDNN-packed linear layers: same fp32 values and input gradients as nn.Linear, packs follow weight
changes, sampling weights never touch the parameters, and a converted LoRA model trains exactly as
before (sampling with merged weights on packed layers: test_rollout.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from grpo_core.kernels.cpu_linear import PackedLinear, sampling_weights, use_onednn_linears
from grpo_core.model.loading import attach_lora
from tests.conftest import needs_cpu

pytestmark = needs_cpu("onednn_linear")


def packed_copy(layer: torch.nn.Linear) -> PackedLinear:
    out = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
    out.load_state_dict(layer.state_dict())
    use_onednn_linears(out)
    assert type(out) is PackedLinear
    return out


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("shape", [(7, 40), (3, 5, 40), (1, 40)])
def test_values_and_input_gradient_match_nn_linear(shape, pack):
    torch.manual_seed(0)
    plain = torch.nn.Linear(40, 24).requires_grad_(False)
    fast = packed_copy(plain).requires_grad_(False)
    fast.pack = pack
    x = torch.randn(*shape, requires_grad=True)
    y_plain, y_fast = plain(x), fast(x)
    assert torch.allclose(y_fast, y_plain, atol=1e-5) and y_fast.dtype == torch.float32
    g = torch.randn_like(y_plain)
    (gx_plain,) = torch.autograd.grad(y_plain, x, g)
    (gx_fast,) = torch.autograd.grad(y_fast, x, g)
    assert torch.allclose(gx_fast, gx_plain, atol=1e-5)
    assert (fast._packs is not None) == pack                   # unpacked: no copy of the weight is kept


def test_trainable_weight_falls_back_and_gets_its_gradient():
    torch.manual_seed(1)
    plain = torch.nn.Linear(16, 8)
    fast = packed_copy(plain)
    x = torch.randn(4, 16)
    fast(x).sum().backward()
    plain(x).sum().backward()
    assert fast.weight.grad is not None and torch.allclose(fast.weight.grad, plain.weight.grad, atol=1e-6)
    assert fast._packs is None                                  # the trainable path never packed


def test_pack_follows_in_place_weight_change():
    torch.manual_seed(2)
    fast = packed_copy(torch.nn.Linear(16, 8)).requires_grad_(False)
    x = torch.randn(3, 16)
    before = fast(x)
    with torch.no_grad():
        fast.weight.mul_(2.0)                                   # an optimizer step or a load does this
    assert torch.allclose(fast(x), F.linear(x, fast.weight, fast.bias), atol=1e-5)
    assert not torch.allclose(fast(x), before)


def test_sampling_weight_only_in_no_grad_and_only_inside_the_block():
    torch.manual_seed(3)
    fast = packed_copy(torch.nn.Linear(16, 8)).requires_grad_(False)
    other = torch.randn(8, 16)
    x = torch.randn(2, 16, requires_grad=True)
    with sampling_weights([(fast, other)]):
        with torch.no_grad():
            assert torch.allclose(fast(x), F.linear(x, other, fast.bias), atol=1e-5)
        assert torch.allclose(fast(x), F.linear(x, fast.weight, fast.bias), atol=1e-5)   # grad mode: own weight
    with torch.no_grad():
        assert torch.allclose(fast(x), F.linear(x, fast.weight, fast.bias), atol=1e-5)
    assert fast.sampling_weight is None


def lora_model(tiny_model_dir, convert: bool):
    torch.manual_seed(0)
    model = attach_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), 4, 8, 0.0,
                        ["q_proj", "k_proj", "v_proj", "o_proj"])
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.3, generator=torch.Generator().manual_seed(1))
    n = use_onednn_linears(model) if convert else 0
    return model, n


def test_converted_lora_model_equals_the_original_in_loss_gradients_and_state_dict(tiny_model_dir):
    plain, _ = lora_model(tiny_model_dir, convert=False)
    fast, n = lora_model(tiny_model_dir, convert=True)
    layers = fast.base_model.model.model.layers
    assert n == len(layers) * 7 + 1                            # q k v o gate up down per layer + LM head
    assert not any(isinstance(m, PackedLinear) for name, m in fast.named_modules() if "lora_" in name)
    assert list(fast.state_dict()) == list(plain.state_dict())
    x = torch.tensor([[10, 11, 12, 13, 14, 15]])
    losses = []
    for model in (plain, fast):
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        losses.append((out.loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
    assert losses[0][0] == pytest.approx(losses[1][0], abs=1e-5)
    for name, g in losses[0][1].items():
        assert torch.allclose(losses[1][1][name], g, atol=1e-5), name
