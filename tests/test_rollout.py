"""Sampling engines on a real tiny model: our KV-cache loop (fused and torch engines) agrees with transformers'
generate (called directly, tests/hf_reference.py),
drops finished rows correctly, honours temperature/top-k/top-p, leaves a LoRA model unchanged, and (when
asked) records the log-prob of each sampled token under the distribution it was drawn from."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_core.kernels.cpu_linear import use_onednn_linears
from grpo_core.model.loading import attach_lora, load_tokenizer
from grpo_core.rollout.samplers import KVCacheSampler, TorchEngine, draw, merged_lora, sample_next
from grpo_core.rollout.sampling import Completion, SamplingParams
from tests.conftest import needs_cpu
from tests.hf_reference import generate_reference

CPU = torch.device("cpu")


@pytest.fixture()
def tiny(tiny_model_dir):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():                       # a random model that is not stuck on one character
        model.model.embed_tokens.weight.normal_(std=2.0)
    return model, load_tokenizer(tiny_model_dir)


def prompts_of(tok):
    return [tok("12+3=")["input_ids"], tok("hello")["input_ids"], tok("a much longer prompt here")["input_ids"]]


@pytest.mark.parametrize("lean", [True, False])
def test_our_engines_greedy_equal_hf_generate(tiny, lean):
    """Both forwards of our sampler (the lean Llama one and the model's own call), with each group's
    prompt prefilled once, give transformers' generate's greedy answers."""
    from grpo_core.kernels.lean_decode import LeanDecoder
    model, tok = tiny
    params = SamplingParams(max_new_tokens=12, greedy=True)
    hf = generate_reference(model, tok, prompts_of(tok), 2, params, batch_size=2)
    backend = KVCacheSampler(model, tok, CPU, batch_size=4, progress=False, lean=lean)
    assert isinstance(backend.forward, LeanDecoder) == lean
    ours = backend.generate(prompts_of(tok), 2, params)
    assert ours == hf
    assert len({tuple(g[0]) for g in ours}) > 1            # prompts really give different answers


def test_finished_rows_are_dropped_without_disturbing_others(tiny):
    """Declare as EOS a token one row emits early and another never does: the early row is dropped from
    the batch (and the KV cache) mid-way; every row must still equal its own single-row greedy decode."""
    model, tok = tiny
    params = SamplingParams(max_new_tokens=10, greedy=True)
    prompts = prompts_of(tok)
    free = KVCacheSampler(model, tok, CPU, progress=False).generate(prompts, 1, params)
    rows = [g[0] for g in free]
    eos_id = next(t for r in rows for t in r[1:5] if any(t not in other for other in rows))
    tok.eos_token = tok.convert_ids_to_tokens(eos_id)
    batched = KVCacheSampler(model, tok, CPU, progress=False).generate(prompts, 1, params)
    single = [KVCacheSampler(model, tok, CPU, progress=False).generate([p], 1, params)[0] for p in prompts]
    assert batched == single
    lens = [len(g[0]) for g in batched]
    assert any(g[0][-1] == eos_id for g in batched) and len(set(lens)) > 1   # some stopped early, some did not
    assert all(eos_id not in g[0][:-1] for g in batched)                     # nothing after EOS
    for r, g in zip(rows, batched):                                          # same tokens up to the stop
        assert r[:len(g[0])] == g[0]


def test_sampling_is_seeded_and_truncation_flags(tiny_model_dir):
    model, tok = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), load_tokenizer(tiny_model_dir)
    be = KVCacheSampler(model, tok, CPU, progress=False)
    a = be.generate(prompts_of(tok), 4, SamplingParams(max_new_tokens=6, seed=7))
    b = be.generate(prompts_of(tok), 4, SamplingParams(max_new_tokens=6, seed=7))
    c = be.generate(prompts_of(tok), 4, SamplingParams(max_new_tokens=6, seed=8))
    assert a == b and a != c
    assert all(len(x) <= 6 for g in a for x in g)


def test_sample_next_topk_topp_temperature():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4000, 1)
    g = torch.Generator().manual_seed(0)
    top1 = sample_next(logits, 1.0, 1, 1.0, False, g)
    assert (top1 == 0).all()
    k2 = sample_next(logits, 1.0, 2, 1.0, False, g)
    assert set(k2.tolist()) == {0, 1} and (k2 == 0).float().mean().item() == pytest.approx(0.5 / 0.8, abs=0.03)
    p = sample_next(logits, 1.0, 0, 0.7, False, g)          # smallest set with mass >= .7: {0, 1}
    assert set(p.tolist()) == {0, 1}
    p2 = sample_next(logits, 1.0, 0, 0.85, False, g)        # .5 + .3 < .85 -> {0, 1, 2}
    assert set(p2.tolist()) == {0, 1, 2}
    cold = sample_next(logits, 0.05, 0, 1.0, False, g)      # T -> 0: argmax
    assert (cold == 0).float().mean() > 0.99
    full = sample_next(logits, 1.0, 0, 1.0, False, g)
    assert (full == 3).float().mean().item() == pytest.approx(0.05, abs=0.015)
    assert (sample_next(logits[:2], 1.0, 0, 1.0, True, None) == 0).all()


@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=needs_cpu("onednn_linear"))])
def test_merged_lora_is_exact_and_restored(tiny_model_dir, packed):
    """Both ways of sampling with the adapter merged: PEFT's in-place merge/unmerge (restored up to
    rounding) and, on oneDNN-packed layers, separate merged tensors (weights bit-identical after)."""
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = attach_lora(base, 4, 8, 0.0, ["q_proj", "v_proj"])
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.3)
    if packed:
        use_onednn_linears(model)
    x = torch.tensor([[10, 11, 12, 13]])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.inference_mode() if packed else torch.no_grad():       # the sampler runs in inference mode
        ref = model(x).logits
        with merged_lora(model):
            merged = model(x).logits
        after = model(x).logits
    assert torch.allclose(ref, merged, atol=1e-5)
    if packed:                                                          # no merge/unmerge rounding drift
        assert torch.equal(ref, after)
        for n, p in model.named_parameters():
            assert torch.equal(p, before[n]), n
    else:
        assert torch.allclose(ref, after, atol=1e-6)
        for n, p in model.named_parameters():
            assert torch.allclose(p, before[n], atol=1e-6), n


def test_draw_matches_the_distribution_and_never_picks_zero_probability():
    """Two-level inverse-CDF sampling over a vocabulary wider than one block: frequencies follow the
    probabilities (chi-square), zero-probability entries (top-k / top-p masked) never come out."""
    g = torch.Generator().manual_seed(0)
    V = 1000
    probs = torch.zeros(V)
    support = torch.tensor([0, 255, 256, 511, 700, 999])           # block edges of 256 included
    probs[support] = torch.tensor([0.05, 0.1, 0.2, 0.3, 0.15, 0.2])
    n = 40000
    picks = draw(probs.repeat(n, 1), g)
    counts = torch.bincount(picks, minlength=V).float()
    assert counts[probs == 0].sum() == 0
    expected = probs[support] * n
    chi2 = ((counts[support] - expected) ** 2 / expected).sum().item()
    assert chi2 < 20.5                                              # p = 0.001 at 5 degrees of freedom
    assert draw(probs.repeat(3, 1), torch.Generator().manual_seed(5)).tolist() == \
        draw(probs.repeat(3, 1), torch.Generator().manual_seed(5)).tolist()


# -- the sampler's own log-probs (for the trainer's importance correction) ---------------------------------

def hand_logprob(logits: torch.Tensor, token: int, temperature: float, top_k: int, top_p: float) -> float:
    """log-prob of `token` under softmax(logits / T) restricted to the top-k, then to the smallest set of
    most likely tokens whose mass reaches top_p, renormalised (what the sampler draws from)."""
    z = logits.double() / temperature
    order = torch.argsort(z, descending=True).tolist()
    keep = order[:top_k] if top_k else order
    probs = torch.softmax(z[keep], -1).tolist()
    kept, mass = [], 0.0
    for tok, p in zip(keep, probs):
        if mass >= top_p:
            break
        kept.append(tok)
        mass += p
    assert token in kept
    return (z[token] - torch.logsumexp(z[kept], -1)).item()


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (6, 0.8)])
def test_static_sampler_records_the_logprobs_it_sampled_from(tiny, top_k, top_p):
    model, tok = tiny
    prompts = prompts_of(tok)
    params = SamplingParams(max_new_tokens=6, temperature=0.8, top_k=top_k, top_p=top_p, seed=3, logprobs=True)
    groups = KVCacheSampler(model, tok, CPU, batch_size=4, progress=False).generate(prompts, 3, params)
    checked = 0
    with torch.no_grad():
        for p, group in zip(prompts, groups):
            for c in group:
                assert isinstance(c, Completion) and len(c.logprobs) == len(c)
                logits = model(input_ids=torch.tensor([p + list(c)])).logits[0, len(p) - 1:-1]
                for t, token in enumerate(c):
                    assert c.logprobs[t] == pytest.approx(hand_logprob(logits[t], token, 0.8, top_k, top_p), abs=1e-4)
                    checked += 1
    assert checked > 20
    plain = KVCacheSampler(model, tok, CPU, batch_size=4, progress=False).generate(
        prompts, 3, SamplingParams(max_new_tokens=6, temperature=0.8, top_k=top_k, top_p=top_p, seed=3))
    assert plain == groups and not isinstance(plain[0][0], Completion)    # the flag changes nothing else


@pytest.mark.parametrize("engine", ["fused", "torch", "torch_model_forward"])
def test_our_engines_logprobs_equal_hf_generates_scores(tiny, engine):
    """Greedy: the tokens and log-probs of every engine of ours are generate's (its processed scores); sampled:
    generate's log-probs are the model's, as ours are (test_static_sampler_records_the_logprobs_it_sampled_from)."""
    model, tok = tiny
    prompts = prompts_of(tok)
    greedy = SamplingParams(max_new_tokens=8, greedy=True, logprobs=True)
    hf = generate_reference(model, tok, prompts, 1, greedy, batch_size=2)
    backend = {"fused": lambda: KVCacheSampler(model, tok, CPU, progress=False),
               "torch": lambda: TorchEngine(model, tok, CPU, progress=False),
               "torch_model_forward": lambda: TorchEngine(model, tok, CPU, progress=False, lean=False)}[engine]()
    ours = backend.generate(prompts, 1, greedy)
    assert backend.engine == ("fused" if engine == "fused" else "torch")
    assert hf == ours
    for a, b in zip(hf, ours):
        assert a[0].logprobs == pytest.approx(b[0].logprobs, abs=1e-4)
    sampled = generate_reference(model, tok, prompts, 2, SamplingParams(max_new_tokens=5, seed=1, logprobs=True), 2)
    with torch.no_grad():
        for p, group in zip(prompts, sampled):
            for c in group:
                logits = model(input_ids=torch.tensor([p + list(c)])).logits[0, len(p) - 1:-1]
                expect = [hand_logprob(logits[t], token, 1.0, 0, 1.0) for t, token in enumerate(c)]
                assert c.logprobs == pytest.approx(expect, abs=1e-4)


def test_rollout_puts_the_sampler_logprobs_on_each_sample(tiny):
    from grpo_core.rollout.samplers import rollout
    from grpo_core.task import Task
    model, tok = tiny
    tasks = [Task(id="t0", kind="math", source="test", prompt="1+1?"), Task(id="t1", kind="math", source="test",
                                                                           prompt="2+2?")]
    backend = KVCacheSampler(model, tok, CPU, progress=False)
    with_lp = rollout(backend, tok, tasks, 2, SamplingParams(max_new_tokens=4, seed=0, logprobs=True), "", 64)
    without = rollout(backend, tok, tasks, 2, SamplingParams(max_new_tokens=4, seed=0), "", 64)
    assert all(len(s.sampler_logprobs) == len(s.completion_ids) for s in with_lp)
    assert all(type(s.completion_ids) is list for s in with_lp)
    assert all(s.sampler_logprobs is None for s in without)
    assert [s.completion_ids for s in with_lp] == [s.completion_ids for s in without]
    assert with_lp[0].to_dict()["sampler_logprobs"] == with_lp[0].sampler_logprobs


def test_rollout_numbers_each_group_with_the_id_it_is_given(tiny):
    """group_ids (a data-parallel share's batch positions) number the groups, handed over and returned alike; the
    completions are those of the default numbering; one id per task or a clear error."""
    from grpo_core.rollout.samplers import rollout
    from grpo_core.task import Task
    model, tok = tiny
    tasks = [Task(id=f"t{i}", kind="math", source="test", prompt=p, answer="0") for i, p in enumerate(["1+1?", "2+2?"])]
    backend = KVCacheSampler(model, tok, CPU, progress=False)
    params = SamplingParams(max_new_tokens=4, seed=0)
    handed = []
    ours = rollout(backend, tok, tasks, 2, params, "", 64, on_group=lambda g: handed.append(g[0].group),
                   group_ids=[5, 9])
    plain = rollout(backend, tok, tasks, 2, params, "", 64)
    assert [s.group for s in ours] == [5, 5, 9, 9] and sorted(handed) == [5, 9]
    assert [s.group for s in plain] == [0, 0, 1, 1]
    assert [s.completion_ids for s in ours] == [s.completion_ids for s in plain]
    with pytest.raises(ValueError, match="group_ids"):
        rollout(backend, tok, tasks, 2, params, "", 64, group_ids=[3])


@pytest.mark.parametrize("cls", [KVCacheSampler, TorchEngine])
def test_each_group_is_handed_over_as_soon_as_it_is_sampled(tiny, cls):
    """rollout(on_group=...): every group once, with the Samples rollout returns for it; with 2 rows per batch and
    3 answers per prompt, the first groups are handed over while later batches are still to be sampled."""
    from grpo_core.rollout.samplers import rollout
    from grpo_core.task import Task
    model, tok = tiny
    tasks = [Task(id=f"t{i}", kind="math", source="test", prompt=p, answer="0") for i, p in
             enumerate(["12+3=", "hello", "a much longer prompt here", "7*8"])]
    backend = cls(model, tok, CPU, batch_size=2, progress=False)
    batches, handed = [], []
    real = backend._generate_batch
    backend._generate_batch = lambda rows, *a: batches.append(len(rows)) or real(rows, *a)
    samples = rollout(backend, tok, tasks, 3, SamplingParams(max_new_tokens=6, seed=1), "", 64,
                      on_group=lambda group: handed.append((len(batches), group)))
    assert sorted(g[0].group for _, g in handed) == [0, 1, 2, 3]
    for _, group in handed:
        assert group == [s for s in samples if s.group == group[0].group]
    assert handed[0][0] < len(batches) == 6            # the first group came before the last of 6 batches


def test_the_fused_snapshot_is_taken_for_the_rows_a_batch_decodes(tiny, monkeypatch):
    """The linear-kernel probe runs at the row count the batches really have (3 prompts x 2 answers = 6
    rows, under a batch size of 64), capped by the batch size when the rollout is larger."""
    from grpo_core.kernels import fused_decode
    model, tok = tiny
    seen, real = [], fused_decode.FusedDecoder.snapshot
    monkeypatch.setattr(fused_decode.FusedDecoder, "snapshot",
                        classmethod(lambda cls, m, rows=16: seen.append(rows) or real(m, rows)))
    params = SamplingParams(max_new_tokens=3, seed=0)
    KVCacheSampler(model, tok, CPU, batch_size=64, progress=False).generate(prompts_of(tok), 2, params)
    KVCacheSampler(model, tok, CPU, batch_size=4, progress=False).generate(prompts_of(tok), 2, params)
    assert seen == [6, 4]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_draw_matches_the_distribution_and_the_log_probs(dtype):
    """sample_next without top-k / top-p (the compiled draw where it loads, else `draw`): frequencies follow
    softmax(logits / T) (chi-square) over a vocabulary of several blocks plus a part, masked (-inf) entries
    never come out, and the log-probs are those of the drawn tokens under that softmax."""
    V, n, T = 1000, 40000, 0.7
    logits = torch.full((V,), float("-inf"))
    support = torch.tensor([0, 255, 256, 511, 700, 999])
    logits[support] = torch.tensor([0.05, 0.1, 0.2, 0.3, 0.15, 0.2]).log() * T
    rows = logits.to(dtype).repeat(n, 1)
    tok, logp = sample_next(rows, T, 0, 1.0, False, torch.Generator().manual_seed(0), with_logprobs=True)
    want = torch.log_softmax(rows[0].float() / T, -1)
    assert torch.allclose(logp, want[tok], atol=1e-5)
    counts = torch.bincount(tok, minlength=V).float()
    assert counts.sum() == n and counts[~torch.isin(torch.arange(V), support)].sum() == 0
    expected = want[support].exp() * n
    chi2 = ((counts[support] - expected) ** 2 / expected).sum()
    assert chi2 < 20.5, chi2                                   # 5 degrees of freedom, p = 0.001
    again = sample_next(rows[:5], T, 0, 1.0, False, torch.Generator().manual_seed(0))
    assert torch.equal(again, tok[:5])                         # the generator decides the draw
