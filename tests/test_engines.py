"""The sampling engines' registry (grpo_core/rollout/engines.py: ENGINES) is what docs/architecture.md's table says,
what the config accepts, what make_backend builds, and what the generation_kwargs check reads."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import torch

from grpo_core.config import ConfigError, load_config
from grpo_core.rollout.engines import CHOICES, ENGINES, TABLE_HEADER, engine_options
from grpo_core.rollout.sampling import check_generation_kwargs

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def doc_table() -> list[list[str]]:
    """The rows of the table in the section "## Sampling engines" (header first)."""
    text = DOC.read_text()
    section = text.split("\n## Sampling engines\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    rows = [[cell.strip() for cell in line.strip().strip("|").split(" | ")] for line in lines]
    return [r for r in rows if not all(re.fullmatch(r"-+", c.strip("|-") or "-") for c in r)]


def test_the_engine_table_in_the_architecture_doc_is_the_registry():
    header, *rows = doc_table()
    assert header == TABLE_HEADER
    assert rows == [e.row() for e in ENGINES.values()], "regenerate the table from grpo_core.rollout.engines.ENGINES"
    assert len(ENGINES) <= 3


def test_every_engine_names_its_sampler_class_and_the_config_takes_its_name():
    for name, engine in ENGINES.items():
        module, attr = engine.sampler.split(":")
        if name != "vllm":                                   # vllm_backend imports vllm only when it samples
            cls = getattr(importlib.import_module(module), attr)
            assert hasattr(cls, "generate") and hasattr(cls, "streams_turns")
        else:
            source = (Path(__file__).resolve().parents[1] / (module.replace(".", "/") + ".py")).read_text()
            assert f"class {attr}" in source and "streams_turns" not in source      # re-encodes its turns
        assert load_config(None, [f"rollout_backend={name}"]).rollout_backend == name
    assert CHOICES == ("auto", "fused", "torch", "vllm")


def test_static_is_the_old_name_of_auto_and_hf_is_refused_naming_torch():
    assert load_config(None, []).rollout_backend == "auto"
    assert load_config(None, ["rollout_backend=static"]).rollout_backend == "auto"
    with pytest.raises(ConfigError, match="hf.*was removed.*use torch"):
        load_config(None, ["rollout_backend=hf"])
    with pytest.raises(ConfigError, match="rollout_backend"):
        load_config(None, ["rollout_backend=generate"])


@pytest.mark.parametrize("name", list(ENGINES))
def test_generation_kwargs_map_onto_the_engine_or_are_refused_by_name(name):
    check_generation_kwargs({"top_k": 5, "min_p": 0.1}, name)             # our own fields: every engine
    if engine_options(name):
        check_generation_kwargs({"presence_penalty": 0.5}, name)
    else:
        with pytest.raises(ValueError, match="'presence_penalty'.*rollout_backend vllm accepts it"):
            check_generation_kwargs({"presence_penalty": 0.5}, name)
    with pytest.raises(ValueError, match="'no_repeat_ngram_size'.*no rollout engine.*hf.*removed"):
        check_generation_kwargs({"no_repeat_ngram_size": 3}, name)
    with pytest.raises(ValueError, match="'seed' is set by the pipeline"):
        check_generation_kwargs({"seed": 3}, name)


def test_make_backend_builds_the_named_engine_and_auto_takes_fused_where_it_applies(grpo_home):
    from grpo_core.model.policy import load_policy
    from grpo_core.rollout.samplers import FusedEngine, KVCacheSampler, TorchEngine, make_backend, rollout
    from grpo_core.rollout.sampling import SamplingParams
    from grpo_core.task import Task
    tasks = [Task(id="t0", kind="math", source="test", prompt="What is 2+2?", answer="4")]
    params = SamplingParams(max_new_tokens=6, seed=3)
    out = {}
    for name, cls in (("auto", KVCacheSampler), ("fused", FusedEngine), ("torch", TorchEngine)):
        cfg = load_config(None, ["model=tiny-random", "device=cpu", "dtype=float32", f"rollout_backend={name}"])
        policy = load_policy(cfg, need_reference=False)
        backend = make_backend(cfg, policy, progress=False)
        assert type(backend) is cls
        out[name] = [s.completion_ids for s in rollout(backend, policy.tokenizer, tasks, 2, params, "", 64)]
        assert backend.engine == ("torch" if name == "torch" else "fused"), name
        assert backend.path.startswith("fused") == (name != "torch")
    assert out["auto"] == out["fused"]


def test_the_fused_engine_refuses_a_model_it_does_not_apply_to_where_auto_takes_torch(grpo_home, monkeypatch):
    from grpo_core.kernels.fused_decode import FusedDecoder
    from grpo_core.model.policy import load_policy
    from grpo_core.rollout.samplers import FusedEngine, KVCacheSampler
    from grpo_core.rollout.sampling import SamplingParams
    cfg = load_config(None, ["model=tiny-random", "device=cpu", "dtype=float32"])
    policy = load_policy(cfg, need_reference=False)
    monkeypatch.setattr(FusedDecoder, "snapshot", classmethod(lambda cls, *a, **k: None))   # as for CUDA, Gemma...
    auto = KVCacheSampler(policy.model, policy.tokenizer, torch.device("cpu"), progress=False)
    auto.generate([[5, 6, 7]], 1, SamplingParams(4))
    assert auto.engine == "torch" and auto.path == "lean"
    fused = FusedEngine(policy.model, policy.tokenizer, torch.device("cpu"), progress=False)
    with pytest.raises(RuntimeError, match="rollout_backend: fused does not apply.*auto or torch"):
        fused.generate([[5, 6, 7]], 1, SamplingParams(4))
