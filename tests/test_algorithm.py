"""GRPO math against hand-computed values and against a line-by-line implementation of the published
objective (DeepSeekMath GRPO with the DAPO / Dr. GRPO aggregation fixes, TRL 1.16 semantics)."""
from __future__ import annotations

import math

import pytest
import torch

from grpo_core.loss import aggregate, grpo_loss, group_advantages, kl_k3, zero_std_groups
from grpo_core.logprobs import completion_logits, completion_logprobs, head_logprobs, token_entropy, token_logprobs

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]


# -- advantages ------------------------------------------------------------------------------------

def test_group_advantages_by_hand():
    r = torch.tensor([1., 0., 0., 0., 1., 1., 0., 0.])
    # group 1: mean .25, unbiased std .5; group 2: mean .5, std sqrt(1/3)
    g = group_advantages(r, 4, "group")
    s2 = math.sqrt(1 / 3)
    expect = [.75 / (.5 + 1e-4), -.25 / (.5 + 1e-4), -.25 / (.5 + 1e-4), -.25 / (.5 + 1e-4),
              .5 / (s2 + 1e-4), .5 / (s2 + 1e-4), -.5 / (s2 + 1e-4), -.5 / (s2 + 1e-4)]
    assert torch.allclose(g, torch.tensor(expect), atol=1e-6)
    # batch: group means, one std over all 8 rewards (mean .375, var 1.875 / 7)
    b = group_advantages(r, 4, "batch")
    sb = math.sqrt(1.875 / 7)
    assert torch.allclose(b, torch.tensor([.75, -.25, -.25, -.25, .5, .5, -.5, -.5]) / (sb + 1e-4), atol=1e-6)
    # none (Dr. GRPO): centred only
    n = group_advantages(r, 4, "none")
    assert torch.allclose(n, torch.tensor([.75, -.25, -.25, -.25, .5, .5, -.5, -.5]))
    with pytest.raises(ValueError):
        group_advantages(r, 4, "zscore")


def test_zero_std_groups_and_zero_advantage():
    r = torch.tensor([1., 1., 1., 0., 0., 0., 2., 3., 2.])
    assert zero_std_groups(r, 3).tolist() == [True, True, False]
    assert group_advantages(r, 3)[:6].abs().max() == 0


# -- aggregation, by hand --------------------------------------------------------------------------

def test_aggregate_by_hand():
    per_token = torch.tensor([[1., 2., 3., 9.], [4., 9., 9., 9.]])
    mask = torch.tensor([[1., 1., 1., 0.], [1., 0., 0., 0.]])
    assert aggregate(per_token, mask, "grpo", 5).item() == pytest.approx((6 / 3 + 4 / 1) / 2)   # 3.0
    assert aggregate(per_token, mask, "bnpo", 5).item() == pytest.approx(10 / 4)
    assert aggregate(per_token, mask, "dr_grpo", 5).item() == pytest.approx(10 / (2 * 5))       # B * L_max
    assert aggregate(per_token, mask, "dapo", 5, num_tokens_in_batch=8).item() == pytest.approx(10 / 8)
    assert aggregate(per_token, mask, "dapo", 5).item() == pytest.approx(10 / 4)
    with pytest.raises(ValueError):
        aggregate(per_token, mask, "ppo", 5)


def test_clipped_surrogate_and_kl_by_hand():
    # one sequence, 4 tokens; advantage +1 on row 0, -1 on row 1
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5]]))
    old = torch.log(torch.tensor([[0.5, 0.25, 1.0, 0.5], [0.5, 0.25, 1.0, 0.5]]))   # ratios 1, 2, .5, 1
    ref = torch.log(torch.tensor([[0.25, 0.5, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5]]))
    adv = torch.tensor([1., -1.])
    mask = torch.ones(2, 4)
    loss, st = grpo_loss(logp, old, ref, adv, mask, beta=0.0, epsilon_low=0.2, epsilon_high=0.28,
                         loss_type="bnpo", max_completion_length=4)
    # A=+1: -min(r, clip(r)) = -[1, 1.28, .5, 1];  A=-1: -min(-r, -clip(r)) = [1, 2, .8, 1]
    expect = (-(1 + 1.28 + .5 + 1) + (1 + 2 + .8 + 1)) / 8
    assert loss.item() == pytest.approx(expect, abs=1e-6)
    assert st["clip_ratio/high_mean"] == pytest.approx(1 / 8)       # r=2 with A>0
    assert st["clip_ratio/low_mean"] == pytest.approx(1 / 8)        # r=.5 with A<0
    assert st["clip_ratio/region_mean"] == pytest.approx(2 / 8)
    # k3 KL: d = ref - logp = log(.5) at token 0 of row 0, else 0 -> exp(d) - d - 1
    d = math.log(0.5)
    k3 = math.exp(d) - d - 1
    assert kl_k3(logp, ref)[0, 0].item() == pytest.approx(k3, abs=1e-6)
    assert kl_k3(logp, ref)[1].abs().max() == 0
    loss_b, st_b = grpo_loss(logp, old, ref, adv, mask, beta=0.1, epsilon_low=0.2, epsilon_high=0.28,
                             loss_type="bnpo", max_completion_length=4)
    assert loss_b.item() == pytest.approx(expect + 0.1 * k3 / 8, abs=1e-6)
    assert st_b["kl"] == pytest.approx(k3 / 8, abs=1e-6)
    with pytest.raises(ValueError):
        grpo_loss(logp, old, None, adv, mask, beta=0.1, epsilon_low=.2, epsilon_high=.2, loss_type="grpo",
                  max_completion_length=4)


# -- gradient == gradient of the published objective, written out line by line ---------------------

def reference_objective(logp, old, ref, adv, mask, beta, eps_low, eps_high, loss_type, L_max, n_tokens):
    """The published per-token objective, summed with Python loops over sequences and tokens.

    J_i,t = min(rho A_i, clip(rho, 1-eps_low, 1+eps_high) A_i) - beta * (pi_ref/pi - log(pi_ref/pi) - 1)
    grpo (DeepSeekMath): 1/B sum_i 1/|o_i| sum_t J;  bnpo: sum J / sum |o_i| (this batch);
    dr_grpo: sum J / (B * L_max);  dapo: sum J / (tokens in the whole generation batch). Loss = -J.
    """
    B, L = logp.shape
    total = 0.0
    seq_means = []
    for i in range(B):
        s, n = 0.0, 0
        for t in range(L):
            if mask[i, t] == 0:
                continue
            rho = torch.exp(logp[i, t] - old[i, t])
            surrogate = torch.minimum(rho * adv[i], torch.clamp(rho, 1 - eps_low, 1 + eps_high) * adv[i])
            kl = torch.exp(ref[i, t] - logp[i, t]) - (ref[i, t] - logp[i, t]) - 1 if beta else 0.0
            s = s + surrogate - beta * kl
            n += 1
        total = total + s
        seq_means.append(s / max(n, 1))
    if loss_type == "grpo":
        return -sum(seq_means) / B
    if loss_type == "bnpo":
        return -total / mask.sum()
    if loss_type == "dr_grpo":
        return -total / (B * L_max)
    return -total / n_tokens


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("mu", [1, 3])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_gradient_matches_published_objective(loss_type, mu, beta):
    g = torch.Generator().manual_seed(hash((loss_type, mu, beta)) % 1000)
    B, L, L_max = 6, 7, 9
    mask = (torch.rand(B, L, generator=g) > 0.3).float()
    mask[:, 0] = 1
    logits = torch.randn(B, L, 11, generator=g, requires_grad=True)
    ids = torch.randint(0, 11, (B, L), generator=g)
    adv = torch.randn(B, generator=g)
    ref = token_logprobs(torch.randn(B, L, 11, generator=g), ids)
    # mu = 1: the rollout policy is the current one (ratio exactly 1, old = logp.detach()).
    # mu > 1: a later pass over the same rollout; old log-probs differ, so both clip sides are active.
    logp = token_logprobs(logits, ids)
    old = logp.detach() if mu == 1 else logp.detach() + 0.4 * torch.randn(B, L, generator=g)
    n_tokens = mask.sum().item() + 5          # dapo: the generation batch holds more than this micro-batch
    loss, _ = grpo_loss(logp, old, ref, adv, mask, beta=beta, epsilon_low=0.2, epsilon_high=0.28,
                        loss_type=loss_type, max_completion_length=L_max, num_tokens_in_batch=n_tokens)
    (grad,) = torch.autograd.grad(loss, logits)
    logp2 = token_logprobs(logits, ids)
    expect = reference_objective(logp2, old, ref, adv, mask, beta, 0.2, 0.28, loss_type, L_max, n_tokens)
    (grad_ref,) = torch.autograd.grad(expect, logits)
    assert loss.item() == pytest.approx(expect.item(), rel=1e-5, abs=1e-6)
    assert torch.allclose(grad, grad_ref, atol=1e-6, rtol=1e-4)
    if mu > 1:
        assert (torch.exp(logp - old) * mask).max() > 1.28    # clipping was really exercised


def test_beta0_ratio1_is_advantage_weighted_logprob_gradient():
    """beta = 0, ratio 1: grad of the loss == -grad of sum_i A_i/|o_i| sum_t log pi / B (grpo)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 5, 13, generator=g, requires_grad=True)
    ids = torch.randint(0, 13, (4, 5), generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]).float()
    adv = torch.tensor([1.5, -0.5, 0.2, -1.2])
    logp = token_logprobs(logits, ids)
    loss, _ = grpo_loss(logp, logp.detach(), None, adv, mask, beta=0.0, epsilon_low=.2, epsilon_high=.2,
                        loss_type="grpo", max_completion_length=5)
    (grad,) = torch.autograd.grad(loss, logits)
    logp = token_logprobs(logits, ids)
    pg = -(adv[:, None] * logp * mask / mask.sum(-1, keepdim=True)).sum() / 4        # REINFORCE with baseline
    (grad_pg,) = torch.autograd.grad(pg, logits)
    assert torch.allclose(grad, grad_pg, atol=1e-7)


# -- log-probs without the full log-softmax ---------------------------------------------------------

def test_token_logprobs_and_entropy_match_log_softmax():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 4, 17, generator=g)
    ids = torch.randint(0, 17, (3, 4), generator=g)
    for T in (1.0, 0.7):
        full = torch.log_softmax(logits / T, -1)
        assert torch.allclose(token_logprobs(logits, ids, T), full.gather(-1, ids[..., None])[..., 0], atol=1e-6)
        assert torch.allclose(token_entropy(logits, T), -(full.exp() * full).sum(-1), atol=1e-5)


def test_chunked_head_logprobs_value_and_gradient():
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


def test_completion_logprobs_match_unpadded_forward(tiny_model_dir):
    """Left-padded prompts + right-padded completions give each sequence's own unpadded log-probs."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    seqs = [([5, 6, 7, 8], [9, 10, 11]), ([12, 13], [14, 15, 16, 17, 18]), ([20, 21, 22], [23])]
    P, C = 4, 5
    ids = torch.zeros(3, P + C, dtype=torch.long)
    attn = torch.zeros(3, P + C, dtype=torch.long)
    for r, (p, c) in enumerate(seqs):
        ids[r, P - len(p):P] = torch.tensor(p)
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


@pytest.mark.parametrize("layout", ["lean_segments", "packed_mask", "repeated_kv", "packed_checkpointed"])
def test_shared_prompt_path_equals_full_pass_value_and_gradient(tiny_model_dir, monkeypatch, layout):
    """Groups of rows with one prompt: running the prompt once (each group packed into one row of
    unpadded completions, through the lean trunk or a block mask, or the prompt's KV repeated) == the
    full padded pass, values and gradients."""
    import grpo_core.logprobs as alg
    from grpo_core.logprobs import _groups_share_prompt
    if layout != "lean_segments":
        monkeypatch.setattr(alg.LeanDecoder, "of", classmethod(lambda cls, model: None))
    monkeypatch.setattr(alg, "_pack_is_cheaper", lambda *a: layout != "repeated_kv")
    from grpo_core.models import attach_lora
    from transformers import AutoModelForCausalLM
    model = attach_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), 4, 8, 0.0, ["q_proj", "k_proj", "v_proj", "o_proj"])
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.2, generator=torch.Generator().manual_seed(0))
    prompts, G, P, C = [[5, 6, 7], [8, 9, 10, 11]], 3, 4, 4
    ids = torch.zeros(len(prompts) * G, P + C, dtype=torch.long)
    attn = torch.zeros_like(ids)
    g = torch.Generator().manual_seed(3)
    for r in range(ids.size(0)):
        p = prompts[r // G]
        n = int(torch.randint(1, C + 1, (1,), generator=g))
        ids[r, P - len(p):P] = torch.tensor(p)
        ids[r, P:P + n] = torch.randint(12, 90, (n,), generator=g)
        attn[r, P - len(p):P + n] = 1
    assert _groups_share_prompt(ids, attn, P, G) and not _groups_share_prompt(ids, attn, P, 2)
    mask = attn[:, P:].float()
    params = [p for p in model.parameters() if p.requires_grad]
    if layout == "packed_checkpointed":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
        model.train()
    out = []
    for gs in (1, G):
        lp, ent = completion_logprobs(model, ids, attn, C, with_entropy=True, group_size=gs)
        grads = torch.autograd.grad((lp * mask).sum(), params)
        out.append((lp * mask, ent * mask, grads))
    assert torch.allclose(out[0][0], out[1][0], atol=1e-5)
    assert torch.allclose(out[0][1], out[1][1], atol=1e-4)
    for a, b in zip(out[0][2], out[1][2]):
        assert torch.allclose(a, b, atol=1e-5)


def test_pack_is_chosen_only_when_it_saves_work(tiny_model_dir):
    from grpo_core.logprobs import _pack_is_cheaper
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
