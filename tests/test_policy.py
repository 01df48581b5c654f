"""Policy and reference: LoRA reference = base with the adapter disabled, or the starting adapter frozen
(`reference: init`); full fine-tuning keeps a frozen copy; gradient checkpointing changes memory, not
gradients."""
from __future__ import annotations

import os

import pytest
import torch

from grpo_core.config import GRPOConfig
from grpo_core.model.loading import resolve_model
from grpo_core.model.policy import load_policy
from grpo_core.update.step import ScoredSample, grpo_update, make_optimizer, make_scheduler


def cfg_of(**over) -> GRPOConfig:
    return GRPOConfig(**{**dict(model="tiny-random", device="cpu", dtype="float32", num_generations=2,
                                max_completion_length=4, learning_rate=0.05), **over})


def samples():
    return [ScoredSample(0, [10, 11, 12], [20, 21], 1.0, False), ScoredSample(0, [10, 11, 12], [22, 23, 24], 0.0, False),
            ScoredSample(1, [13, 14], [25], 0.0, False), ScoredSample(1, [13, 14], [26, 27], 1.0, False)]


def logits(model):
    with torch.no_grad():
        return model(input_ids=torch.tensor([[10, 11, 12, 20]])).logits


def test_lora_reference_is_base_with_adapter_off(grpo_home):
    cfg = cfg_of(beta=0.04)
    pol = load_policy(cfg)
    assert pol.ref_model is None
    base = logits(pol.model)
    opt = make_optimizer(pol, cfg)
    grpo_update(pol, opt, make_scheduler(opt, cfg), samples(), cfg, seed=0)
    with pol.model.disable_adapter():
        peft_off = logits(pol.model)
    with pol.reference() as ref:
        assert torch.allclose(logits(ref), base, atol=1e-6)       # reference unchanged
        assert torch.equal(logits(ref), peft_off)                 # as PEFT's own switch computes it
        assert all(m.disable_adapters for m in ref.modules() if hasattr(m, "lora_A"))
    assert not any(m.disable_adapters for m in pol.model.modules() if hasattr(m, "lora_A"))   # switched back on
    assert not torch.allclose(logits(pol.model), base)            # policy moved
    assert all("lora" in n for n, p in pol.model.named_parameters() if p.requires_grad)


def test_full_finetuning_has_frozen_reference_copy(grpo_home):
    cfg = cfg_of(use_peft=False, beta=0.04)
    pol = load_policy(cfg)
    assert pol.ref_model is not None and pol.ref_model is not pol.model
    assert not any(p.requires_grad for p in pol.ref_model.parameters())
    base = logits(pol.ref_model)
    opt = make_optimizer(pol, cfg)
    n_trainable = sum(p.numel() for p in pol.trainable_parameters())
    assert n_trainable == sum(p.numel() for p in pol.model.parameters())
    metrics, _, _ = grpo_update(pol, opt, make_scheduler(opt, cfg), samples(), cfg, seed=0)
    with pol.reference() as ref:
        assert torch.allclose(logits(ref), base)
    assert not torch.allclose(logits(pol.model), base)
    metrics2, _, _ = grpo_update(pol, opt, make_scheduler(opt, cfg), samples(), cfg, seed=0)
    assert metrics2[0]["kl"] > 0                                   # the frozen copy really is the reference


def test_full_finetuning_beta0_loads_no_reference(grpo_home):
    assert load_policy(cfg_of(use_peft=False, beta=0.0)).ref_model is None


@pytest.mark.parametrize("use_peft", [True, False])
def test_gradient_checkpointing_same_gradients(grpo_home, use_peft):
    grads = []
    for gc in (False, True):
        cfg = cfg_of(use_peft=use_peft, gradient_checkpointing=gc, beta=0.0, max_grad_norm=0.0)
        torch.manual_seed(0)
        pol = load_policy(cfg)
        for n, p in pol.model.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(1))
        opt = torch.optim.SGD(pol.trainable_parameters(), lr=0.0)
        grpo_update(pol, opt, make_scheduler(opt, cfg), samples(), cfg, seed=0)
        grads.append([p.grad.clone() for p in pol.trainable_parameters()])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-6)


def non_trivial_adapter(out_dir, seed: int = 1):
    """A saved LoRA adapter whose B is not zero (it changes the model's output)."""
    pol = load_policy(cfg_of(beta=0.0), need_reference=False)
    for n, p in pol.model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.3, generator=torch.Generator().manual_seed(seed))
    pol.save(out_dir)
    return out_dir


@pytest.mark.parametrize("reference", ["init", "base"])
def test_reference_init_is_the_starting_adapter(grpo_home, tmp_path, reference):
    """Training from an adapter: `reference: init` (the default) makes that adapter, frozen, the KL reference,
    so the KL is zero at the first step; `reference: base` measures it against the base model."""
    init = non_trivial_adapter(tmp_path / "init")
    cfg = cfg_of(beta=0.04, reference=reference, init_adapter=str(init))
    pol = load_policy(cfg, init, init_adapter=init)
    opt = make_optimizer(pol, cfg)
    metrics, _, _ = grpo_update(pol, opt, make_scheduler(opt, cfg), samples(), cfg, seed=0)
    if reference == "init":
        assert pol.reference_adapter == "reference"
        assert metrics[0]["kl"] == pytest.approx(0.0, abs=1e-7)
        assert all(p.requires_grad is False for n, p in pol.model.named_parameters() if ".reference." in n)
        assert not any(".reference." in n for n, p in pol.model.named_parameters() if p.requires_grad)
    else:
        assert pol.reference_adapter is None and metrics[0]["kl"] > 1e-4
    # a later iteration: the checkpoint is another adapter, the reference stays the starting one (or the base)
    later = non_trivial_adapter(tmp_path / "later", seed=2)
    pol = load_policy(cfg, later, init_adapter=init)
    with pol.reference() as ref:
        got = logits(ref)
    start = load_policy(cfg_of(beta=0.0), init, need_reference=False)
    if reference == "base":
        with start.model.disable_adapter():
            expect = logits(start.model)
    else:
        expect = logits(start.model)
    assert torch.allclose(got, expect, atol=1e-6)
    assert not torch.allclose(logits(pol.model), expect, atol=1e-4)          # the policy is the later adapter


def test_reference_init_without_init_adapter_is_the_base(grpo_home):
    pol = load_policy(cfg_of(beta=0.04, reference="init"))
    assert pol.reference_adapter is None                  # the base, with the adapter disabled, as before


def _trained(cfg: GRPOConfig, out):
    """A policy one update away from its fresh adapter, saved to `out`: (the policy, its adapter tensors)."""
    pol = load_policy(cfg, need_reference=False)
    opt = make_optimizer(pol, cfg)
    grpo_update(pol, opt, make_scheduler(opt, cfg), samples(), cfg, seed=0)
    pol.save(out)
    return pol, {n: p.detach().clone() for n, p in pol.model.named_parameters() if "lora" in n}


def test_a_released_model_is_reused_with_the_checkpoint_loaded_into_it(grpo_home, tmp_path):
    """After a policy is dropped, loading a checkpoint of the same base and LoRA settings takes its model from
    the pool: the checkpoint's adapter weights, the fresh load's flags and logits, no gradient left.
    kernels.reuse_model: false, a checkpoint of another LoRA rank, or a reference adapter build (and keep) their
    own."""
    import gc
    from grpo_core.model import policy as policy_module
    pooled = lambda: [e.model for e in policy_module._pool.values()]  # noqa: E731
    cfg = cfg_of(beta=0.0)
    _trained(cfg_of(beta=0.0, lora_r=4), tmp_path / "r4")
    gc.collect()          # the r=4 policy released now, not by a later collection after `pol` (the pool keeps the last)
    pol, trained = _trained(cfg, tmp_path / "a")
    model, tokenizer = pol.model, pol.tokenizer
    del pol
    gc.collect()
    assert pooled() == [model]
    second = load_policy(cfg, tmp_path / "a", need_reference=False)
    assert second.model is model and pooled() == []                    # taken out: no one else gets it
    assert second.tokenizer is tokenizer                               # and its tokenizer with it
    for n, p in second.model.named_parameters():
        assert p.grad is None
        if "lora" in n:
            assert torch.equal(p, trained[n]), n
    fresh = load_policy(cfg_of(beta=0.0, kernels={"reuse_model": False}), tmp_path / "a", need_reference=False)
    assert fresh.model is not model
    assert {n: p.requires_grad for n, p in fresh.model.named_parameters()} == \
        {n: p.requires_grad for n, p in second.model.named_parameters()}
    assert torch.equal(logits(fresh.model), logits(second.model))
    del second, fresh
    gc.collect()
    assert len(pooled()) == 1                                          # the last one released stays
    model = pooled()[0]
    config = resolve_model(cfg.model) / "tokenizer_config.json"        # tokenizer files changed: read again
    config.write_text(config.read_text())
    os.utime(config, ns=(config.stat().st_atime_ns, config.stat().st_mtime_ns + 10**9))
    third = load_policy(cfg, tmp_path / "a", need_reference=False)
    assert third.model is model and third.tokenizer is not tokenizer
    assert third.tokenizer("1+2=")["input_ids"] == tokenizer("1+2=")["input_ids"]
    del third
    gc.collect()
    rank4 = load_policy(cfg, tmp_path / "r4", need_reference=False)     # an r=4 adapter: not into the r=16 model
    assert rank4.model is not model
    assert {p.shape[0] for n, p in rank4.model.named_parameters() if "lora_A" in n} == {4}
    del rank4
    gc.collect()
    with_reference = load_policy(cfg_of(beta=0.04, reference="init"), tmp_path / "a", init_adapter=tmp_path / "a")
    assert with_reference.reference_adapter is not None
    kept = with_reference.model
    del with_reference
    gc.collect()
    assert all(m is not kept for m in pooled())


# -- disable_dropout, cast_lm_head_to_fp32 (TRL options that act on the modules) -------------------------------

def _train_logits(model, ids=torch.tensor([[10, 11, 12, 20, 21, 22]])):
    model.train()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_disable_dropout_zeroes_every_dropout_of_policy_and_reference(grpo_home, tmp_path):
    """TRL's disable_dropout: p = 0 in every nn.Dropout, and transformers' attention dropout (a float on the
    attention modules) 0, in the policy and a separate reference; a pooled model keeps its own setting."""
    import gc
    import json
    from grpo_core.model.policy import disable_dropout
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Dropout(0.3), torch.nn.Sequential(torch.nn.Dropout(0.1)))
    disable_dropout(net)
    assert [m.p for m in net.modules() if isinstance(m, torch.nn.Dropout)] == [0.0, 0.0]
    config = resolve_model("tiny-random") / "config.json"             # a model with attention dropout
    config.write_text(json.dumps({**json.loads(config.read_text()), "attention_dropout": 0.5}))
    plain = load_policy(cfg_of(use_peft=False, beta=0.04))
    assert not torch.equal(_train_logits(plain.model), _train_logits(plain.model))    # dropout on in training
    for use_peft in (False, True):
        pol = load_policy(cfg_of(use_peft=use_peft, beta=0.04, disable_dropout=True))
        for model in filter(None, (pol.model, pol.ref_model)):
            assert all(m.p == 0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
            assert {m.attention_dropout for m in model.modules() if hasattr(m, "attention_dropout")} == {0.0}
        assert torch.equal(_train_logits(pol.model), _train_logits(pol.model))
    pol.save(tmp_path / "a")
    del pol
    gc.collect()
    again = load_policy(cfg_of(beta=0.0), tmp_path / "a", need_reference=False)   # not the pooled, dropout-free one
    assert {m.attention_dropout for m in again.model.modules() if hasattr(m, "attention_dropout")} == {0.5}


def test_cast_lm_head_to_fp32_runs_the_head_module_in_float32(grpo_home):
    """cast_lm_head_to_fp32 on a bf16 policy: the LM head module (what transformers' forward, hence the hf
    sampler and evaluation, and the lean sampler call) returns float32 logits of the bf16 weights; the
    weights stay bf16; switched off, the module's own forward is back."""
    from grpo_core.kernels.lean_decode import LeanDecoder
    from grpo_core.model.policy import lm_head_in_fp32
    pol = load_policy(cfg_of(dtype="bfloat16", beta=0.0, cast_lm_head_to_fp32=True))
    base = pol.model.get_base_model()
    ids = torch.tensor([[10, 11, 12, 20]])
    with torch.no_grad():
        logits = pol.model(input_ids=ids).logits
        hidden = base.model(input_ids=ids).last_hidden_state
        lean = LeanDecoder.of(pol.model).prefill(ids, torch.ones_like(ids), 2)
    assert base.lm_head.weight.dtype == torch.bfloat16 and logits.dtype == lean.dtype == torch.float32
    assert torch.allclose(logits, hidden.float() @ base.lm_head.weight.float().T, atol=1e-5)
    assert torch.allclose(lean, logits[:, -1], atol=1e-2)                  # its own bf16 trunk
    lm_head_in_fp32(pol.model, False)
    with torch.no_grad():
        assert pol.model(input_ids=ids).logits.dtype == torch.bfloat16


def test_a_bfloat16_head_does_not_copy_its_weight_per_row_on_a_strided_input():
    """transformers hands the LM head the last position as a strided slice; torch's CPU bfloat16 linear would
    then copy a frozen weight once per batch row (Gemma 3: 2.3 GB at 8 rows). The head's forward that
    `lm_head_in_fp32` installs for a bfloat16 head takes a contiguous copy of the input instead: same logits,
    no allocation the size of the weight."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import LlamaConfig, LlamaForCausalLM
    from grpo_core.model.policy import lm_head_in_fp32
    model = LlamaForCausalLM(LlamaConfig(vocab_size=65536, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2)).to(torch.bfloat16)
    model.requires_grad_(False)
    lm_head_in_fp32(model, enabled=False)
    head = model.get_output_embeddings()
    hidden = torch.randn(8, 30, 64, dtype=torch.bfloat16)[:, -1:, :]                 # strided, as transformers slices
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        logits = head(hidden)
    assert torch.equal(logits, torch.nn.functional.linear(hidden.contiguous(), head.weight))
    biggest = max(e.cpu_memory_usage for e in prof.events())
    assert biggest < head.weight.numel() * 2, biggest              # the weight is 8 MB; a per-row copy, 67 MB
