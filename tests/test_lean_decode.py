"""The lean Llama-family sampling forward gives the logits of the model's own forward: left-padded
prompts, grouped-query attention, shared-prompt cache copies, dropped rows, and a Qwen2 model with
q/k/v biases; unsupported architectures fall back to the model's own call. (Its update trunk is checked
against the full padded pass in test_logprobs.py.)"""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from grpo_core.kernels.lean_decode import LeanDecoder
from grpo_core.rollout.samplers import ModelForward, left_pad


def llama(tiny_model_dir):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(std=2.0)
    return model


def qwen2():
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg).eval()


def run(forward, prompts, steps, pad=0, drops=None):
    """Prefill, copy row 0's cache to a new row, then decode `steps` tokens keeping only the rows `drops`
    names at its steps (default: dropping row 1 halfway)."""
    ids, attn = left_pad(prompts, pad, torch.device("cpu"))
    out = [forward.prefill(ids, attn, steps)]
    rows = torch.tensor([0, 1, 2, 0])
    forward.select(rows)
    tok = out[0][rows].argmax(-1)
    for t in range(steps):
        for at, keep in (drops or ((steps // 2, [0, 2, 3]),)):
            if t == at:
                keep = torch.tensor(keep)[:len(tok)]
                forward.select(keep)
                tok = tok[keep]
        logits = forward.step(tok)
        out.append(logits)
        tok = logits.argmax(-1)
    return out


def test_lean_forward_equals_the_models_own_forward_on_qwen2():
    prompts = [[5, 6, 7, 8, 9], [12, 13], [20, 21, 22]]
    model = qwen2()
    lean = LeanDecoder.of(model)
    assert lean is not None
    with torch.inference_mode():
        ours, theirs = run(lean, prompts, 6), run(ModelForward(model), prompts, 6)
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-4)


def test_lean_forward_on_the_tiny_llama_with_lora(tiny_model_dir):
    from grpo_core.model.loading import attach_lora
    model = attach_lora(llama(tiny_model_dir), 4, 8, 0.0, ["q_proj", "v_proj"])
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.3, generator=torch.Generator().manual_seed(1))
    lean = LeanDecoder.of(model)
    assert lean is not None
    with torch.inference_mode():
        ours, theirs = run(lean, [[10, 11, 12, 13], [14], [15, 16]], 8), run(ModelForward(model), [[10, 11, 12, 13], [14], [15, 16]], 8)
    for a, b in zip(ours, theirs):
        assert torch.allclose(a, b, atol=1e-4)


def test_other_architectures_use_the_models_own_forward():
    from transformers import GPT2Config, GPT2LMHeadModel
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=64))
    assert LeanDecoder.of(gpt2) is None
    windowed = qwen2()
    windowed.config.use_sliding_window = True
    assert LeanDecoder.of(windowed) is None
    dropout = qwen2()
    dropout.config.attention_dropout = 0.1
    assert LeanDecoder.of(dropout) is None
