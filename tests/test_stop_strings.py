"""stop_strings: a completion also ends at the first token that completes one of them, on every sampler, is
marked as ended (not truncated), is evaluated the same way, and the export writes them for transformers
(whose generate, called directly, ends at the same token)."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from grpo_core.config import ConfigError, GRPOConfig, load_config
from grpo_core.evaluation.evaluate import eval_modes
from grpo_core.model.export import generation_settings
from grpo_core.model.loading import build_tiny_model, load_tokenizer
from grpo_core.rollout.samplers import KVCacheSampler, TorchEngine, rollout
from grpo_core.rollout.sampling import PromptFormat, SamplingParams, StopStrings, sampling_options
from grpo_core.task import Task

CPU = torch.device("cpu")
SAMPLERS = {
    "fused": lambda m, t: KVCacheSampler(m, t, CPU, batch_size=4, progress=False),
    "lean": lambda m, t: TorchEngine(m, t, CPU, batch_size=4, progress=False),
    "hf_forward": lambda m, t: TorchEngine(m, t, CPU, batch_size=4, progress=False, lean=False),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():        # varied greedy text rather than one token repeated
        model.model.embed_tokens.weight.normal_(std=2.0)
        model.model.norm.weight.mul_(0.05)
    return model, load_tokenizer(path)


def test_stop_strings_find_the_token_that_completes_one(tiny):
    _, tok = tiny
    ids = tok("12 plus 3 is <answer>15</answer> and more text")["input_ids"]
    stops = StopStrings(tok, ["</answer>"])
    cut = stops.cut(ids)
    assert tok.decode(cut).rstrip().endswith("</answer>") and "more" not in tok.decode(cut)
    assert stops.ended(cut) and not stops.ended(cut[:-1])
    assert StopStrings(tok, ["never there"]).cut(ids) == ids
    assert not StopStrings(tok).ended(ids) and not StopStrings(tok)


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_every_sampler_ends_a_completion_at_its_first_stop_string(tiny, name):
    model, tok = tiny
    prompts = [tok("12+3=")["input_ids"], tok("hello")["input_ids"], tok("a much longer prompt here")["input_ids"]]
    sampler = SAMPLERS[name](model, tok)
    free = [g[0] for g in sampler.generate(prompts, 1, SamplingParams(max_new_tokens=16, greedy=True))]
    # a stop string that row 0 writes part of the way in (the text of two of its tokens)
    stop = tok.decode(free[0][3:5])
    assert stop.strip(), "the tiny model's greedy text should give a non-blank stop string"
    stops = StopStrings(tok, [stop])
    stopped = [g[0] for g in sampler.generate(prompts, 1, SamplingParams(max_new_tokens=16, greedy=True,
                                                                          stop_strings=(stop,)))]
    assert stopped == [stops.cut(ids) for ids in free]
    assert len(stopped[0]) <= 5 and stops.ended(stopped[0])


def test_generate_called_directly_cuts_where_our_engines_cut(tiny):
    from tests.hf_reference import generate_reference
    model, tok = tiny
    prompts = [tok("12+3=")["input_ids"], tok("hello")["input_ids"]]
    free = [g[0] for g in SAMPLERS["fused"](model, tok).generate(prompts, 1, SamplingParams(16, greedy=True))]
    stop = tok.decode(free[0][3:5])
    params = SamplingParams(max_new_tokens=16, greedy=True, stop_strings=(stop,))
    assert generate_reference(model, tok, prompts, 1, params) == SAMPLERS["fused"](model, tok).generate(prompts, 1, params)


def test_a_stopped_completion_is_ended_not_truncated(tiny):
    model, tok = tiny
    sampler = SAMPLERS["fused"](model, tok)
    task = Task(id="t1", kind="math", source="arithmetic", prompt="12+3=", answer="15")
    free = rollout(sampler, tok, [task], 2, SamplingParams(max_new_tokens=12, greedy=True), PromptFormat(), 64)
    assert all(s.truncated for s in free)         # the tiny model never writes EOS in 12 tokens
    stop = tok.decode(free[0].completion_ids[2:4])
    stopped = rollout(sampler, tok, [task], 2, SamplingParams(max_new_tokens=12, greedy=True, stop_strings=(stop,)),
                      PromptFormat(), 64)
    assert all(not s.truncated and stop in tok.decode(s.completion_ids) for s in stopped)
    assert all(len(s.completion_ids) < len(f.completion_ids) for s, f in zip(stopped, free))


def test_training_and_evaluation_both_stop_there(tmp_path):
    cfg = GRPOConfig(stop_strings=["</answer>"])
    assert sampling_options(cfg)["stop_strings"] == ("</answer>",)
    assert all(params.stop_strings == ("</answer>",) for _, _, params in eval_modes(cfg, seed=0))


@pytest.mark.parametrize("override, words", [
    ({"stop_strings": ["</answer>", ""]}, "stop_strings: an empty string"),
    ({"generation_kwargs": {"stop_strings": ["x"]}}, "set the field stop_strings"),
    ({"rollout_backend": "vllm", "generation_kwargs": {"stop": ["x"]}}, "set the field stop_strings"),
    ({"stop_strings": ["x"], "tools": ["calculator"]}, "stop_strings is not supported with tools"),
])
def test_bad_stop_strings_name_the_field_and_the_fix(tmp_path, override, words):
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(override))
    with pytest.raises(ConfigError, match=words):
        load_config(path)


def test_the_export_writes_them_where_transformers_generate_applies_them(tiny, tmp_path):
    model, tok = tiny
    settings = generation_settings(1.0, 1.0, 0, 16, stop_strings=["</answer>"])
    GenerationConfig(**settings).save_pretrained(tmp_path)
    loaded = GenerationConfig.from_pretrained(tmp_path)
    assert loaded.stop_strings == ["</answer>"]
    ids = tok("hello", return_tensors="pt")["input_ids"]
    free = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.size(1):].tolist()
    stop = tok.decode(free[3:5])
    loaded.update(do_sample=False, temperature=None, top_p=None, top_k=None, stop_strings=[stop])
    out = model.generate(ids, generation_config=loaded, tokenizer=tok)[0].tolist()
    # generate ends there too (its match may also take in the prompt's last characters, ours never does)
    assert stop in tok.decode(out[-2 * len(stop):]) and len(out) - ids.size(1) <= 5
    assert "stop_strings" not in generation_settings(1.0, 1.0, 0, 16)


def test_a_multi_turn_rollout_refuses_stop_strings_rather_than_ignoring_them(tiny):
    from grpo_core.rollout.multiturn import Toolbox
    model, tok = tiny
    toolbox = Toolbox.from_config(GRPOConfig(model="tiny-random", tools=["calculator"]))
    task = Task(id="t1", kind="math", source="arithmetic", prompt="12+3=", answer="15")
    with pytest.raises(ValueError, match="stop_strings is not supported in multi-turn"):
        rollout(SAMPLERS["lean"](model, tok), tok, [task], 2, SamplingParams(max_new_tokens=4, stop_strings=("x",)),
                PromptFormat(), 64, toolbox=toolbox)
