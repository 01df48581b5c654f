"""grpo_core.update.logprobs: per-token log-probs and entropy without the full log-softmax, the chunked LM
head, and every layout of completion_logprobs (padded, packed groups, repeated prompt KV) against plain
unpadded forward passes, values and gradients."""
from __future__ import annotations

import pytest
import torch

from grpo_core.update.logprobs import (completion_logits, completion_logprobs, head_logprobs, logprob_path, token_entropy,
                                token_logprobs)
from tests.conftest import skip_unless_cpu, use_kernels


# -- log-probs without the full log-softmax ---------------------------------------------------------

def test_token_logprobs_and_entropy_match_log_softmax():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 4, 17, generator=g)
    ids = torch.randint(0, 17, (3, 4), generator=g)
    for T in (1.0, 0.7):
        full = torch.log_softmax(logits / T, -1)
        assert torch.allclose(token_logprobs(logits, ids, T), full.gather(-1, ids[..., None])[..., 0], atol=1e-6)
        assert torch.allclose(token_entropy(logits, T), -(full.exp() * full).sum(-1), atol=1e-5)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled-sweep", "torch-sweep"])
def test_chunked_head_logprobs_value_and_gradient(compiled, monkeypatch):
    """With the compiled logit sweep (where a compiler is) and with torch ops: the same log-probs, entropy and
    gradients as the full log-softmax, through checkpointed chunks and kept ones."""
    import grpo_core.update.logprobs as lp_mod
    if compiled:
        from grpo_core.kernels import native
        if native.load() is None:
            pytest.skip("no compiled kernels here")
    else:
        monkeypatch.setattr(lp_mod, "_sweep_ops", lambda logits: None)
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(5, 6, 8, generator=g, requires_grad=True)
    head = torch.nn.Linear(8, 19, bias=False)
    w = head.weight
    with torch.no_grad():
        w.copy_(torch.randn(19, 8, generator=g))
    ids = torch.randint(0, 19, (5, 6), generator=g)
    for keep in (0, 10**9):                   # checkpointed chunks, and chunks whose logits are kept
        lp, ent = head_logprobs(hidden, head, ids, temperature=0.9, chunk=2, with_entropy=True,
                                keep_logits_bytes=keep)
        lp_full = token_logprobs(hidden @ w.T, ids, 0.9)
        assert torch.allclose(lp, lp_full, atol=1e-5)
        assert torch.allclose(ent, token_entropy(hidden @ w.T, 0.9), atol=1e-4)
        gh, gw = torch.autograd.grad((lp * torch.arange(6.)).sum(), (hidden, w))
        gh2, gw2 = torch.autograd.grad((lp_full * torch.arange(6.)).sum(), (hidden, w))
        assert torch.allclose(gh, gh2, atol=1e-5) and torch.allclose(gw, gw2, atol=1e-5)


def test_fp32_head_is_the_float32_matmul_of_the_bf16_weights():
    """cast_lm_head_to_fp32 (ScaleRL, TRL): with a bf16 head and bf16 hidden states, head_logprobs(fp32_head=True)
    is the log-softmax of float32 logits (hidden.float() @ W.float().T), value and gradient, where the plain
    head rounds its logits to bf16 first."""
    g = torch.Generator().manual_seed(3)
    hidden0 = (torch.randn(6, 32, generator=g) * 4).bfloat16()
    head = torch.nn.Linear(32, 500, bias=True).bfloat16()
    with torch.no_grad():
        head.weight.copy_(torch.randn(500, 32, generator=g))
        head.bias.copy_(torch.randn(500, generator=g))
    ids = torch.randint(0, 500, (6,), generator=g)
    hidden = hidden0.clone().requires_grad_()
    lp, ent = head_logprobs(hidden, head, ids, temperature=0.8, with_entropy=True, fp32_head=True)
    exact = hidden.float() @ head.weight.float().T + head.bias.float()
    want = token_logprobs(exact, ids, 0.8)
    assert lp.dtype == torch.float32 and torch.allclose(lp, want, atol=1e-5)
    assert torch.allclose(ent, token_entropy(exact, 0.8), atol=1e-4)
    got = torch.autograd.grad(lp.sum(), (hidden, head.weight, head.bias))
    expect = torch.autograd.grad(want.sum(), (hidden, head.weight, head.bias))
    for a, b in zip(got, expect):
        assert a.dtype == b.dtype and torch.allclose(a.float(), b.float(), atol=1e-2, rtol=1e-2)
    plain, _ = head_logprobs(hidden0, head, ids, temperature=0.8)              # bf16 logits: off by their rounding
    assert (plain - want.detach()).abs().max() > 10 * (lp - want).detach().abs().max()


def test_completion_logprobs_with_the_fp32_head_on_a_bf16_model(tiny_model_dir):
    """The update's log-probs on a bf16 model with fp32_head: the trunk's (bf16) hidden states through the LM
    head in float32."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [0, 12, 13, 14, 15, 16, 0]])
    attn = torch.tensor([[1] * 7, [0, 1, 1, 1, 1, 1, 0]])
    with torch.no_grad():
        lp, _ = completion_logprobs(model, ids, attn, 3, fp32_head=True)
        plain, _ = completion_logprobs(model, ids, attn, 3)
        from grpo_core.kernels.lean_decode import positions
        hidden = model.model(input_ids=ids, attention_mask=attn, position_ids=positions(attn)).last_hidden_state
        logits = hidden[:, 3:6].float() @ model.lm_head.weight.float().T                 # predicts tokens 4..6
    want = token_logprobs(logits, ids[:, 4:]) * torch.tensor([[1.0] * 3, [1.0, 1.0, 0.0]])
    assert torch.allclose(lp, want, atol=1e-4)
    assert (plain - want).abs().max() > 10 * (lp - want).abs().max()


def test_completion_logprobs_match_unpadded_forward(tiny_model_dir):
    """Left-padded prompts + right-padded completions give each sequence's own unpadded log-probs."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    seqs = [([5, 6, 7, 8], [9, 10, 11]), ([12, 13], [14, 15, 16, 17, 18]), ([20, 21, 22], [23])]
    P, C = 4, 5
    ids = torch.zeros(3, P + C, dtype=torch.long)
    attn = torch.zeros(3, P + C, dtype=torch.long)
    for r, (p, c) in enumerate(seqs):
        ids[r, P - len(p):P] = torch.tensor(list(p))
        ids[r, P:P + len(c)] = torch.tensor(c)
        attn[r, P - len(p):P + len(c)] = 1
    with torch.no_grad():
        lp, ent = completion_logprobs(model, ids, attn, C, temperature=1.0, with_entropy=True, chunk_rows=2)
        lp_logits = token_logprobs(completion_logits(model, ids, attn, C), ids[:, -C:])
        for r, (p, c) in enumerate(seqs):
            x = torch.tensor([p + c])
            own = torch.log_softmax(model(x).logits[0, len(p) - 1:-1], -1).gather(-1, torch.tensor(c)[:, None])[:, 0]
            assert torch.allclose(lp[r, :len(c)], own, atol=1e-4)
            assert torch.allclose(lp_logits[r, :len(c)], own, atol=1e-4)


def _lora_model(tiny_model_dir, dtype=torch.float32):
    """The tiny Llama with a LoRA adapter (fp32 factors) on q, k, v and o whose B is not zero."""
    from grpo_core.model.loading import attach_lora
    from transformers import AutoModelForCausalLM
    model = attach_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(dtype), 4, 8, 0.0,
                        ["q_proj", "k_proj", "v_proj", "o_proj"])
    for n, p in model.named_parameters():
        if "lora_" in n:
            p.data = p.data.float()
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.2, generator=torch.Generator().manual_seed(0))
    return model


def _grouped_batch(prompts=((5, 6, 7), (8, 9, 10, 11)), G=3, C=4):
    """Each prompt with G answers of 1-C tokens: rows [left-padded prompt | right-padded answer]."""
    P = max(map(len, prompts))
    ids = torch.zeros(len(prompts) * G, P + C, dtype=torch.long)
    attn = torch.zeros_like(ids)
    g = torch.Generator().manual_seed(3)
    for r in range(ids.size(0)):
        p = prompts[r // G]
        n = int(torch.randint(1, C + 1, (1,), generator=g))
        ids[r, P - len(p):P] = torch.tensor(list(p))
        ids[r, P:P + n] = torch.randint(12, 90, (n,), generator=g)
        attn[r, P - len(p):P + n] = 1
    return ids, attn, G, P, C


@pytest.mark.parametrize("layout", ["lean_segments", "lean_segments_split", "packed_mask", "repeated_kv",
                                    "packed_checkpointed"])
def test_shared_prompt_path_equals_full_pass_value_and_gradient(tiny_model_dir, monkeypatch, layout):
    """Groups of rows with one prompt: running the prompt once (each group packed into one row of
    unpadded completions, through the lean trunk, its completions' queries in one block or in several by
    length, or through a block mask, or the prompt's KV repeated) == the full padded pass, values and
    gradients."""
    import grpo_core.update.logprobs as alg
    from grpo_core.update.logprobs import _groups_share_prompt
    if layout == "lean_segments_split":           # three query blocks by length, whatever the saving
        monkeypatch.setattr(alg, "_length_split", lambda lengths, P: list(lengths.argsort().chunk(3)))
    elif layout != "lean_segments":
        monkeypatch.setattr(alg.LeanDecoder, "of", classmethod(lambda cls, model: None))
    monkeypatch.setattr(alg, "_pack_is_cheaper", lambda *a: layout != "repeated_kv")
    model = _lora_model(tiny_model_dir)
    ids, attn, G, P, C = _grouped_batch()
    assert _groups_share_prompt(ids, attn, P, G) and not _groups_share_prompt(ids, attn, P, 2)
    mask = attn[:, P:].float()
    params = [p for p in model.parameters() if p.requires_grad]
    if layout == "packed_checkpointed":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
        model.train()
    expected_path = {"lean_segments": "packed-lean", "lean_segments_split": "packed-lean", "packed_mask": "packed-mask",
                     "repeated_kv": "shared-kv", "packed_checkpointed": "packed-mask"}[layout]
    assert logprob_path(model, ids, attn, C, G) == expected_path and logprob_path(model, ids, attn, C, 1) == "rows"
    out = []
    for gs in (1, G):
        lp, ent = completion_logprobs(model, ids, attn, C, with_entropy=True, group_size=gs)
        grads = torch.autograd.grad((lp * mask).sum(), params)
        out.append((lp * mask, ent * mask, grads))
    assert torch.allclose(out[0][0], out[1][0], atol=1e-5)
    assert torch.allclose(out[0][1], out[1][1], atol=1e-4)
    for a, b in zip(out[0][2], out[1][2]):
        assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("group_size", [1, 3])
def test_rows_without_a_completion_token_give_zeros_and_a_gradient(tiny_model_dir, group_size):
    """A micro-batch whose completions are all empty (an agent loop that never asked the model: rollout_func)
    has no token for the LM head: log-probs and entropy are zeros [B, Lc], and backward runs (a zero loss)."""
    with torch.random.fork_rng():             # LoRA's init draws from the global stream: later tests' draws unchanged
        model = _lora_model(tiny_model_dir)
    ids = torch.tensor([[0, 5, 6, 7, 0]] * 3)                          # [B, P + Lc]: Lc = 1, padding only
    attn = torch.tensor([[0, 1, 1, 1, 0]] * 3)
    lp, ent = completion_logprobs(model, ids, attn, 1, with_entropy=True, group_size=group_size, entropy_grad=True)
    assert lp.shape == ent.shape == (3, 1) and not lp.any() and not ent.any()
    (lp.sum() + ent.sum()).backward()


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_the_packed_lean_path_in_bf16_on_the_device(tiny_model_dir, device):
    """The update's bf16 forward takes the packed-lean path on every device (on CUDA, through SDPA: part of
    bench/gpu_checks.sh), and its log-probs and LoRA gradients are those of the padded pass of every row, within
    bf16 rounding."""
    model = _lora_model(tiny_model_dir, torch.bfloat16).to(device)
    ids, attn, G, P, C = _grouped_batch()
    ids, attn = ids.to(device), attn.to(device)
    mask = attn[:, P:].float()
    assert logprob_path(model, ids, attn, C, G) == "packed-lean" and logprob_path(model, ids, attn, C, 1) == "rows"
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for gs in (1, G):
        lp, _ = completion_logprobs(model, ids, attn, C, group_size=gs)
        grads = torch.autograd.grad((lp.float() * mask).sum(), params)
        out.append((lp.float() * mask, grads))
    assert torch.allclose(out[0][0], out[1][0], atol=0.03), (out[0][0] - out[1][0]).abs().max()
    for a, b in zip(out[0][1], out[1][1]):              # bf16 sums in another order: a few percent of the norm
        assert (a.float() - b.float()).norm() <= 0.05 * a.float().norm() + 1e-6


@pytest.mark.parametrize("layout", ["lean_segments", "packed_mask"])
def test_packed_gradients_are_the_same_bits_on_every_run(tiny_model_dir, monkeypatch, layout):
    """A group's answers all read their prompt's last hidden state, so the packed paths pick some rows
    several times. The backward of that pick must add the repeats in a fixed order: a kill-and-resume run
    differed from the uninterrupted one in the 8th digit when a parallel kernel added them in whatever order
    its threads finished (enough rows here, over 32k values, for that kernel to run in parallel). Runs agree
    at each thread count; across thread counts they need not: the BLAS may split a weight gradient's sum over
    tokens between threads (on an Intel Xeon with AMX, torch 2.13, a plain matmul's weight gradient differs in
    the last bits between 1 and 2 threads), so a resumed run keeps its thread count."""
    import grpo_core.update.logprobs as alg
    if layout == "packed_mask":
        monkeypatch.setattr(alg.LeanDecoder, "of", classmethod(lambda cls, model: None))
    monkeypatch.setattr(alg, "_pack_is_cheaper", lambda *a: True)
    model = _lora_model(tiny_model_dir)
    prompts = tuple(tuple(range(5 + k, 9 + k)) for k in range(8))
    ids, attn, G, P, C = _grouped_batch(prompts, G=8, C=24)
    assert int(attn[:, P:].sum()) * model.config.hidden_size > 2**15
    params = [p for p in model.parameters() if p.requires_grad]

    def grads():
        lp, _ = completion_logprobs(model, ids, attn, C, group_size=G)
        return torch.autograd.grad((lp * attn[:, P:]).sum(), params)

    threads = torch.get_num_threads()
    try:
        for n, runs in ((1, 2), (max(2, threads), 5)):
            torch.set_num_threads(n)
            first = grads()
            for _ in range(runs - 1):
                assert all(torch.equal(a, b) for a, b in zip(grads(), first)), f"{n} threads"
    finally:
        torch.set_num_threads(threads)


def test_pack_is_chosen_only_when_it_saves_work(tiny_model_dir):
    from grpo_core.update.logprobs import _pack_is_cheaper
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(tiny_model_dir)
    config._attn_implementation = "sdpa"                   # what loading the model resolves it to
    G, P, C = 8, 6, 40
    ids = torch.zeros(2 * G, P + C, dtype=torch.long)
    short = torch.zeros_like(ids)
    short[:, :P + 3] = 1                                   # answers of 3 tokens padded to 40: pack them
    assert _pack_is_cheaper(config, ids, short, C, G)
    full = torch.ones_like(ids)                            # every answer full length: nothing to unpad
    assert not _pack_is_cheaper(config, ids, full, C, G)
    config._attn_implementation = "flash_attention_2"      # ignores custom masks: never packed
    assert not _pack_is_cheaper(config, ids, short, C, G)


def test_flat_packing_lays_the_group_rows_end_to_end_without_padding():
    """The lean update trunk runs the group rows [prompt | c1 | ... | cG] end to end in one sequence: its
    length is the sum of the rows' own lengths, not groups x the longest row."""
    from grpo_core.update.logprobs import _packed_groups
    P, C, G = 3, 4, 2
    ids = torch.tensor([[1, 2, 3, 10, 11, 0, 0], [1, 2, 3, 12, 0, 0, 0],             # group 0: answers of 2 and 1
                        [0, 4, 5, 20, 21, 22, 23], [0, 4, 5, 24, 25, 26, 0]])         # group 1: 4 and 3, prompt padded
    attn = (torch.arange(P + C)[None] < torch.tensor([[5], [4], [7], [6]])).long()
    attn[2:, 0] = 0
    flat_ids, flat_pos, mask, src = _packed_groups(ids, attn, C, G, None, flat=True)
    assert mask is None and flat_ids.tolist() == [[1, 2, 3, 10, 11, 12, 0, 4, 5, 20, 21, 22, 23, 24, 25, 26]]
    assert flat_pos.tolist() == [[0, 1, 2, 3, 4, 3, 0, 0, 1, 2, 3, 4, 5, 2, 3, 4]]
    padded_ids = _packed_groups(ids, attn, C, G, None)[0]
    assert padded_ids.shape == (2, 10) and padded_ids[0, 6:].tolist() == [0, 0, 0, 0]
    # each completion token is predicted by the position before it (its prompt's last token for the first)
    assert src.tolist() == [2, 3, 2, 8, 9, 10, 11, 8, 13, 14]


def test_completions_split_into_two_query_blocks_only_where_that_saves_work():
    from grpo_core.update.logprobs import _length_split
    lengths = torch.tensor([30, 2, 31, 1])
    assert [b.tolist() for b in _length_split(lengths, 5)] == [[3, 1], [0, 2]]
    assert [b.tolist() for b in _length_split(torch.tensor([30, 28, 31, 29]), 5)] == [[1, 3, 0, 2]]
    assert [b.tolist() for b in _length_split(torch.tensor([7]), 5)] == [[0]]


def test_the_update_forward_multiplies_on_the_samplers_packed_weights(tiny_model_dir, monkeypatch):
    """Where the compiled matmul runs, a bf16 base's linears multiply on the sampler's packed weights in the
    forward (views into its fused buffer): the same log-probs and LoRA gradients as torch's matmul, every
    matmul of the forward on them, and a weight changed in place is not read from its stale pack. An fp32
    base keeps oneDNN's packed weights."""
    from grpo_core.kernels import fused_decode, kernel_probes, lora_linear, native
    dtype = torch.bfloat16
    skip_unless_cpu("compiled_matmul", dtype)
    assert kernel_probes.native_gemm(dtype, [(64, 64)]) is not None
    use_kernels(decode_linear="native", update_linear="native")
    assert fused_decode.use_packed_linears(_lora_model(tiny_model_dir, torch.float32)) == 0
    model = _lora_model(tiny_model_dir, dtype)
    ids, attn, G, P, C = _grouped_batch()
    mask = attn[:, P:].float()
    params = [p for p in model.parameters() if p.requires_grad]
    calls = []
    packed_linear = native.NativeOps.packed_linear
    monkeypatch.setattr(native.NativeOps, "packed_linear",
                        lambda self, *a: calls.append(a[2]) or packed_linear(self, *a))

    def run(setting):
        use_kernels(update_linear=setting)
        calls.clear()
        lp, _ = completion_logprobs(model, ids, attn, C, group_size=G)
        n_forward = len(calls)
        grads = torch.autograd.grad((lp * mask).sum(), params)
        return lp * mask, grads, (n_forward, len(calls) - n_forward)

    lp_torch, grads_torch, n_torch = run("torch")
    assert fused_decode.update_linears(model) == "torch (15 of 15 base linears; kernels.update_linear: torch)"
    lp_packed, grads_packed, n_packed = run("native")
    assert fused_decode.update_linears(model) == "native (15 of 15 base linears; kernels.update_linear: native)"
    # forward: 7 linears per layer and the head; backward (input gradients on packed W^T): the same but layer
    # 0's q, k, v (the embeddings need no gradient)
    assert n_torch == (0, 0) and n_packed == (2 * 7 + 1, 2 * 7 - 3 + 1)
    assert fused_decode.use_packed_linears(model) == 15
    assert torch.allclose(lp_torch, lp_packed, atol=0.05)
    for a, b in zip(grads_torch, grads_packed):
        assert torch.allclose(a, b, atol=0.05 * max(1.0, float(a.abs().max())))
    up = model.get_base_model().model.layers[1].mlp.up_proj
    assert lora_linear._packed(up) is not None
    with torch.no_grad():
        up.weight.mul_(2.0)                                                 # e.g. full fine-tuning's step
    assert lora_linear._packed(up) is None                                  # the stale pack is not read
    assert fused_decode.use_packed_linears(model) == 15 and lora_linear._packed(up) is not None   # repacked
    use_kernels(update_linear="torch")
    assert fused_decode.use_packed_linears(model) == 0 and lora_linear._packed(up) is None
    # auto: the probe's timings decide, and the record says so (two runs can decide differently under load)
    use_kernels(update_linear="auto")
    n = fused_decode.use_packed_linears(model)
    said = fused_decode.update_linears(model)
    assert said.startswith(f"{'native' if n else 'torch'} ({n or 15} of 15 base linears; probe: torch "), said
    assert " native " in said and said.endswith(" ms)")


@pytest.mark.parametrize("heads", [4, 6], ids=["rep2", "rep3"])
def test_the_compiled_segment_attention_at_head_dim_64(heads):
    """The update's attention as compiled calls (16 key slots at a time at head dim 64, the vector path),
    with prompts of 17 and 21 tokens (left padding, a 16-slot block straddling the prompt's end) and answers
    of up to 20 tokens: log-probs and LoRA gradients equal the plain forward's, and in bf16 stay near the
    written-out attention's."""
    import grpo_core.update.logprobs as alg
    from grpo_core.kernels import native
    from grpo_core.model.loading import attach_lora
    from transformers import LlamaConfig, LlamaForCausalLM
    if native.load() is None:
        pytest.skip("no compiled kernels here")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64 * heads, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=2, max_position_embeddings=256)
    model = attach_lora(LlamaForCausalLM(cfg).eval(), 4, 8, 0.0, ["q_proj", "k_proj", "v_proj", "o_proj"])
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.2, generator=torch.Generator().manual_seed(0))
    ids, attn, G, P, C = _grouped_batch(prompts=(tuple(range(3, 20)), tuple(range(30, 51))), G=3, C=20)
    mask = attn[:, P:].float()
    params = [p for p in model.parameters() if p.requires_grad]
    calls = []
    apply = alg._NativeSegmentAttention.apply

    def run(group_size):
        calls.clear()
        lp, _ = completion_logprobs(model, ids, attn, C, group_size=group_size)
        return lp * mask, torch.autograd.grad((lp * mask).sum(), params)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(alg._NativeSegmentAttention, "apply", lambda *a: calls.append(1) or apply(*a))
        lp, grads = run(G)
        assert len(calls) == 2 and logprob_path(model, ids, attn, C, G) == "packed-lean"
        lp_rows, grads_rows = run(1)                                    # the plain forward, row by row
        assert not calls
    assert torch.allclose(lp, lp_rows, atol=1e-5)
    for a, b in zip(grads, grads_rows):
        assert torch.allclose(a, b, atol=1e-5)
    model.to(torch.bfloat16)
    for n, p in model.named_parameters():
        if "lora_" in n:
            p.data = p.data.float()
    lp, grads = run(G)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(alg, "_native_attention_ops", lambda q: None)
        lp_torch, grads_torch = run(G)
    assert (lp - lp_torch).abs().max() < 0.05
    for a, b in zip(grads, grads_torch):
        assert (a - b).abs().max() < 0.05 * a.abs().max()
