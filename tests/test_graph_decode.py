"""The fixed-shape decode step (`graph_decode`, the CUDA-graph path) gives the logits of the model's own forward:
eagerly on any machine, and replayed as CUDA graphs where a GPU is present (part of bench/gpu_checks.sh). Covered:
left-padded prompts, a shared prompt's cache copied to its group, rows dropped (row buckets shrinking), steps
crossing a slot bucket, a cache that grows, a reused cache on the next prefill, idle rows and multi-turn chunks,
LoRA unmerged (and an adapter updated in place seen by the next step), and the sampler's completions."""
from __future__ import annotations

import pytest
import torch

from grpo_core.kernels import graph_decode
from grpo_core.kernels.graph_decode import GraphDecoder, rows_bucket, slots_bucket
from grpo_core.rollout.samplers import ModelForward, left_pad
from tests.test_lean_decode import llama, qwen2, run

CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])


def lora_llama(tiny_model_dir, device="cpu"):
    from grpo_core.model.loading import attach_lora
    model = attach_lora(llama(tiny_model_dir), 4, 8, 0.0, ["q_proj", "v_proj", "down_proj"])
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.3, generator=torch.Generator().manual_seed(1))
    return model.to(device)


def close(ours, theirs, atol=1e-4):
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=atol), (a - b).abs().max()


def test_buckets():
    assert [rows_bucket(n, 16) for n in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    assert rows_bucket(13, 12) == 12
    assert [slots_bucket(n, 1000) for n in (1, 128, 129, 999)] == [128, 128, 256, 1000]


@pytest.mark.parametrize("device", DEVICES)
def test_fixed_step_equals_the_models_own_forward(tiny_model_dir, device, monkeypatch):
    monkeypatch.setattr(graph_decode, "SLOT_BUCKET", 8)          # 20 steps cross several slot buckets
    model = lora_llama(tiny_model_dir, device)
    prompts = [[10, 11, 12, 13], [14], [15, 16]]
    ours = GraphDecoder.of(model)
    assert ours is not None and ours.graphs == (device == "cuda")
    drops = ((5, [0, 2, 3]), (12, [2, 0]), (15, [1]))
    with torch.inference_mode():
        a = run(ours, prompts, 20, drops=drops)
        b = run(ModelForward(model), prompts, 20, drops=drops)
        close(a, b)
        again = run(ours, prompts, 20, drops=drops)               # the same cache and (on CUDA) its graphs, replayed
        close(again, b)
    if device == "cuda":
        assert ours.captured > 0 and ours.replays > 0


def test_qwen2_with_biases_and_a_cache_that_grows(monkeypatch):
    monkeypatch.setattr(graph_decode, "SLOT_BUCKET", 4)
    model = qwen2()
    prompts = [[5, 6, 7, 8, 9], [12, 13], [20, 21, 22]]
    with torch.inference_mode():
        close(run(GraphDecoder.of(model), prompts, 6), run(ModelForward(model), prompts, 6))
        out = {}
        for name, fwd in (("graph", GraphDecoder.of(model)), ("model", ModelForward(model))):
            ids, attn = left_pad(prompts, 0, torch.device("cpu"))
            logits = [fwd.prefill(ids, attn, 1)]                  # room for one new token: the steps grow it
            tok = logits[0].argmax(-1)
            for _ in range(9):
                logits.append(fwd.step(tok))
                tok = logits[-1].argmax(-1)
            out[name] = logits
            if name == "graph":
                assert fwd.slots >= 5 + 9
    close(out["graph"], out["model"])


def test_idle_rows_and_turn_chunks_as_the_lean_forward(tiny_model_dir):
    """Multi-turn use: rows that pass a step leave no trace; a chunk of tool-turn tokens continues some rows."""
    from grpo_core.kernels.lean_decode import LeanDecoder
    model = lora_llama(tiny_model_dir)
    out = {}
    with torch.inference_mode():
        for name, fwd in (("graph", GraphDecoder.of(model)), ("lean", LeanDecoder.of(model)),
                          ("model", ModelForward(model))):
            ids, attn = left_pad([[10, 11, 12], [14, 15], [16]], 0, torch.device("cpu"))
            logits = [fwd.prefill(ids, attn, 4)]
            logits.append(fwd.step(torch.tensor([3, 4, 5]), idle=torch.tensor([False, True, False])))
            chunk = torch.tensor([[0, 7, 8], [6, 7, 8], [0, 0, 9]])
            active = torch.tensor([[False, True, True], [True, True, True], [False, False, True]])
            logits.append(fwd.extend(chunk, active))
            fwd.select(torch.tensor([2, 0]))
            logits.append(fwd.step(torch.tensor([1, 2])))
            out[name] = logits
    close(out["graph"], out["model"])
    close(out["graph"], out["lean"], atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_an_adapter_updated_in_place_is_seen_by_the_next_step(tiny_model_dir, device):
    """The step reads the policy's own adapter tensors (no copy): an optimizer step between rollouts changes the
    next rollout's logits, as it changes the model's."""
    model = lora_llama(tiny_model_dir, device)
    ours = GraphDecoder.of(model)
    prompts = [[10, 11, 12, 13], [14], [15, 16]]
    with torch.inference_mode():
        run(ours, prompts, 6)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(-2.0)
        close(run(ours, prompts, 6), run(ModelForward(model), prompts, 6))


@pytest.mark.parametrize("device", DEVICES)
def test_the_torch_engine_samples_the_same_completions_on_the_fixed_shape_step(tiny_model_dir, device):
    from transformers import AutoTokenizer

    from grpo_core.rollout.samplers import TorchEngine
    from grpo_core.rollout.sampling import SamplingParams
    model = lora_llama(tiny_model_dir, device).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [tok.encode("ab"), tok.encode("hello there"), tok.encode("x")]
    params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=3)
    out = {}
    for fixed in (False, True):
        engine = TorchEngine(model, tok, torch.device(device), batch_size=8, progress=False, merge_lora=False,
                             fixed_shapes=fixed)
        assert engine.path == (("graphs" if device == "cuda" else "fixed") if fixed else "lean")
        out[fixed] = engine.generate(prompts, 4, params)
    assert out[True] == out[False]
