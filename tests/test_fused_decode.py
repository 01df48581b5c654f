"""The fused sampling forward gives the logits of the model's own forward (left padding, grouped-query
attention, a shared prompt (kept once, or copied to each row), rows dropped (run alone, or lazily and
compacted), Qwen2 biases, LoRA merged in fp32 and kept as factors in bf16); its snapshot is taken at sampling time, so it sees the adapter as it is then;
The checks run with the step's small ops compiled
(grpo_core/kernels/native.py) and as torch ops."""
from __future__ import annotations

import re

import pytest
import torch

from grpo_core.kernels import cpu_features
from grpo_core.kernels.fused_decode import _BASES, FusedDecoder
from grpo_core.model.loading import attach_lora
from grpo_core.rollout.samplers import KVCacheSampler, ModelForward, left_pad
from tests.conftest import needs_cpu, skip_unless_cpu, use_kernels
from tests.test_lean_decode import llama, qwen2, run as lean_run
from tests.test_native import needs_compiler


def run(forward, prompts, steps):
    """Decode with rows dropped twice (3 of 4 stay, then 2 of 3): the native step runs the live rows on their
    cache rows; the torch step keeps them in the batch, then compacts the cache."""
    return lean_run(forward, prompts, steps, drops=((3, [0, 2, 3]), (5, [0, 2])))


def _with_lora(model, targets, seed=1):
    model = attach_lora(model, 4, 8, 0.0, targets)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.3, generator=torch.Generator().manual_seed(seed))
    return model.eval()


PROMPTS = [[10, 11, 12, 13], [14], [15, 16]]


NATIVE = [pytest.param(True, marks=needs_compiler, id="native-ops"), pytest.param(False, id="torch-ops")]


def _use_kernel(kernel: str, dtype: torch.dtype) -> str:
    """Force the fused forward's linear kernel (kernels.decode_linear), or skip where this CPU cannot run it for
    `dtype`."""
    path = cpu_features.DECODE_LINEARS[kernel]
    if path:
        skip_unless_cpu(path, dtype)
    use_kernels(decode_linear=kernel)
    return kernel


@pytest.fixture(params=list(cpu_features.DECODE_LINEARS))
def kernel(request):
    """Each linear kernel of the fused forward in turn, fp32 (as the probe would pick it on some CPU)."""
    return _use_kernel(request.param, torch.float32)


@pytest.fixture(params=list(cpu_features.DECODE_LINEARS))
def bf16_kernel(request):
    """Each linear kernel of the fused forward in turn, bf16."""
    return _use_kernel(request.param, torch.bfloat16)


def _assert_same(model, atol=1e-4, rtol=1e-5, prompts=PROMPTS, steps=8, native=False):
    """The fused forward's logits == the model's own, with the step's small ops compiled (`native`) or
    as torch ops."""
    with torch.inference_mode():
        fused = FusedDecoder.snapshot(model)
        assert fused is not None
        if native:
            assert fused.ops is not None and fused.path.endswith("native step ops")
        fused.ops = fused.ops if native else None
        ours, theirs = run(fused, prompts, steps), run(ModelForward(model), prompts, steps)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape
        assert torch.allclose(a.float(), b.float(), atol=atol, rtol=rtol), (a - b).abs().max()
    return fused


@pytest.mark.parametrize("native", NATIVE)
def test_fused_forward_equals_the_models_own_on_qwen2_with_biases(native, kernel):
    fused = _assert_same(qwen2(), prompts=[[5, 6, 7, 8, 9], [12, 13], [20, 21, 22]], steps=7, native=native)
    assert fused.layers[0].qkv.bias is not None and "fused float32 decode" in fused.path
    assert fused.kernel == kernel and f"{kernel} linears" in fused.path


@pytest.mark.parametrize("native", NATIVE)
def test_fused_forward_on_the_tiny_llama_with_lora(tiny_model_dir, native, kernel):
    model = _with_lora(llama(tiny_model_dir), ["q_proj", "v_proj", "down_proj", "lm_head"])
    fused = _assert_same(model, native=native)
    base = _BASES[model.get_base_model().model.embed_tokens].weights[0]          # [(weight, bias)] per group
    if kernel != "onednn":                         # fp32 in the buffer: merged into copies of the touched groups only
        assert all(layer.qkv.lora_a is None for layer in fused.layers)
        assert fused.layers[0].o.weight.data_ptr() == base[1][0].data_ptr()     # untouched: the cached base
        assert fused.layers[0].qkv.weight.data_ptr() != base[0][0].data_ptr()
    else:
        assert fused.layers[0].qkv.lora_a.shape[0] == 8 and fused.layers[0].o.lora_a is None


def _llama_head_dim_64(dtype=torch.float32):
    """Head dim 64 (the compiled attention's vector path), 4 query heads over 2 key/value heads."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=256, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval().to(dtype)


SHARED_PROMPTS = [list(range(3, 24)), list(range(30, 43))]


def _decode_shared(forward, prompts=SHARED_PROMPTS, steps=24):
    """Four rows from the first prompt and two from the second, rows dropped, and a second copy of a row
    after sharing; greedy. -> the logits of the prefill and of every step."""
    ids, attn = left_pad(prompts, 0, torch.device("cpu"))
    out = [forward.prefill(ids, attn, steps)]
    rows = torch.tensor([0, 0, 1, 0, 1, 0])
    forward.select(rows)
    tok = out[0][rows].argmax(-1)
    for t in range(steps):
        keep = {5: [0, 1, 2, 4, 5], 9: [0, 2, 3], 14: [0, 1, 2, 2]}.get(t)
        if keep is not None:
            forward.select(torch.tensor(keep))
            tok = tok[torch.tensor(keep)]
        out.append(forward.step(tok))
        tok = out[-1].argmax(-1)
    return out


@pytest.mark.parametrize("native", NATIVE)
def test_groups_share_their_prompt_in_the_cache_at_head_dim_64(native):
    """Prompts of 21 and 13 tokens (a shared prompt's end falls inside a 16-key block), shared, dropped and
    copied again (`_decode_shared`; the copy makes the prompt's slots part of the row's own cache row): the
    logits equal the model's own."""
    model = _llama_head_dim_64()
    with torch.inference_mode():
        fused = FusedDecoder.snapshot(model)
        fused.ops = fused.ops if native else None
        ours = _decode_shared(fused)
        if native:
            assert fused.prefix is None and fused.kv.size(2) == 4          # the copy at step 14 made rows whole
        theirs = _decode_shared(ModelForward(model))
    for a, b in zip(ours, theirs):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-5), (a - b).abs().max()


@needs_compiler
@pytest.mark.parametrize("dtype", [pytest.param(dtype, marks=needs_cpu("compiled_matmul", dtype))
                                   for dtype in (torch.float32, torch.bfloat16)])
def test_the_one_call_step_computes_what_the_per_operation_step_does(dtype):
    """`decode_layers` runs every layer in one compiled call; the same step as one call per operation gives
    the same logits bit for bit (LoRA factors on q, k, v, o and up in bf16; shared, dropped and copied rows)."""
    use_kernels(decode_linear="native")
    model = _with_lora(_llama_head_dim_64(dtype), ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"])
    with torch.inference_mode():
        fused = FusedDecoder.snapshot(model)
        assert fused.table is not None and fused.table.shape == (2, 4 * 8 + 2)
        one_call = _decode_shared(fused)
        fused.table = None
        per_op = _decode_shared(fused)
    for a, b in zip(one_call, per_op):
        assert torch.equal(a, b)


def test_the_fused_base_is_built_once_and_rebuilt_when_a_base_weight_changes(tiny_model_dir):
    # plain rows, so the buffers have data pointers to compare: the probe (a timing) may pick oneDNN's opaque packs
    use_kernels(decode_linear="plain")
    model = _with_lora(llama(tiny_model_dir), ["q_proj"])
    with torch.inference_mode():
        first, again = FusedDecoder.snapshot(model), FusedDecoder.snapshot(model)
    assert again.layers[1].gate_up.weight.data_ptr() == first.layers[1].gate_up.weight.data_ptr()
    with torch.no_grad():
        model.get_base_model().model.layers[1].mlp.up_proj.weight.mul_(0.5)     # full fine-tuning moves the base
    fused = _assert_same(model)
    assert fused.layers[1].gate_up.weight.data_ptr() != first.layers[1].gate_up.weight.data_ptr()


def test_the_fused_base_is_rebuilt_when_the_model_changes_dtype(tiny_model_dir):
    """`model.to(dtype)` keeps the parameters (and their version counters) but gives them new data: the
    snapshot must not reuse the weights it packed before."""
    model = _with_lora(llama(tiny_model_dir), ["q_proj"])
    with torch.inference_mode():
        first = FusedDecoder.snapshot(model)
    model.to(torch.bfloat16)
    for n, p in model.named_parameters():
        if "lora_" in n:
            p.data = p.data.float()
    fused = _assert_same(model, atol=0.1, rtol=0.02)
    assert first.layers[0].gate_up.weight.dtype == torch.float32
    assert fused.layers[0].gate_up.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("native", NATIVE)
def test_bf16_keeps_the_adapter_as_factors_so_a_small_delta_is_not_rounded_away(tiny_model_dir, native, bf16_kernel):
    model = _with_lora(llama(tiny_model_dir).to(torch.bfloat16), ["q_proj", "k_proj", "v_proj", "up_proj"])
    for n, p in model.named_parameters():
        if "lora_" in n:
            p.data = p.data.float()                                  # PEFT's fp32 adapter on a bf16 base
            if "lora_B" in n:
                p.data *= 1e-3                                       # a young adapter: delta far below bf16's ulp
    fused = _assert_same(model, atol=0.1, rtol=0.02, native=native)  # bf16: an ulp of a logit near 30 is 0.125
    assert fused.layers[0].qkv.lora_a.shape == (12, model.config.hidden_size)   # q, k, v: 3 x r=4 stacked
    with torch.inference_mode():
        ids, attn = left_pad(PROMPTS, 0, torch.device("cpu"))
        with_adapter = fused.prefill(ids, attn, 2)
        with model.disable_adapter():
            base = FusedDecoder.snapshot(model).prefill(ids, attn, 2)
    assert not torch.equal(with_adapter, base)                       # the delta survives in bf16


def test_snapshot_follows_the_adapter_and_the_sampler_uses_it(tiny_model_dir):
    from transformers import AutoTokenizer
    from grpo_core.rollout.sampling import SamplingParams
    model = _with_lora(llama(tiny_model_dir), ["q_proj", "o_proj"])
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    greedy = SamplingParams(max_new_tokens=6, temperature=1.0, greedy=True, seed=0)
    fast = KVCacheSampler(model, tok, torch.device("cpu"), progress=False)
    plain = KVCacheSampler(model, tok, torch.device("cpu"), progress=False, fused=False)
    prompts = [[3, 4, 5, 6], [7, 8]]
    assert fast.generate(prompts, 3, greedy) == plain.generate(prompts, 3, greedy)
    assert fast.path.startswith("fused") and plain.path.startswith("lean")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(-3.0)                                         # the policy moved: the next snapshot sees it
    assert fast.generate(prompts, 3, greedy) == plain.generate(prompts, 3, greedy)


def test_dora_falls_back_to_the_lean_forward(tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(llama(tiny_model_dir), LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    with torch.inference_mode():
        assert FusedDecoder.snapshot(model) is None
