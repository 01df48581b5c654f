"""bench/memory.py: the model presets have the published shapes, and --matrix runs end to end (#31)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import memory  # noqa: E402

# Total parameters (tied embeddings counted once) and depth of the published models.
PUBLISHED = {"llama-3.2-1b": (1.236e9, 16), "qwen2.5-0.5b": (0.494e9, 24), "qwen2.5-1.5b": (1.544e9, 28),
             "qwen3-0.6b": (0.596e9, 28), "qwen3-1.7b": (1.721e9, 28), "gemma-3-1b": (1.000e9, 26)}


@pytest.mark.parametrize("name", list(memory.PRESETS))
def test_preset_has_the_published_shapes(name):
    import transformers
    total, depth = PUBLISHED[name]
    assert memory.PRESETS[name][2] == depth
    with torch.device("meta"):
        model = getattr(transformers, memory.PRESETS[name][0])(memory.model_config(name, depth))
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(total, rel=2e-3)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight      # tied
    if name == "gemma-3-1b":
        types = model.config.layer_types
        assert types.count("full_attention") == 4 and types[5] == "full_attention" and model.config.sliding_window == 512


def _step(**kw):
    return argparse.Namespace(**{"group_size": 8, "prompt_tokens": 64, "new_tokens": 256, "chunk_rows": 4,
                                 "gradient_checkpointing": "on", "cast_lm_head_to_fp32": "off", **kw})


def test_estimate_grows_without_checkpointing_and_with_the_cast():
    mcfg, n, lora = memory.model_config("llama-3.2-1b", 16), 1_235_814_400, 3_407_872
    base = memory.memory_estimate(mcfg, n, lora, _step(), torch.bfloat16)
    assert base["weights"] == pytest.approx(n * 2 / 2**30) and base["lora_train"] == pytest.approx(lora * 16 / 2**30)
    off = memory.memory_estimate(mcfg, n, lora, _step(gradient_checkpointing="off"), torch.bfloat16)
    cast = memory.memory_estimate(mcfg, n, lora, _step(cast_lm_head_to_fp32="on"), torch.bfloat16)
    assert off["activations"] > 5 * base["activations"] and cast["lm_head"] > base["lm_head"]
    fp32 = memory.memory_estimate(mcfg, n, lora, _step(cast_lm_head_to_fp32="on"), torch.float32)
    assert fp32["lm_head"] == memory.memory_estimate(mcfg, n, lora, _step(), torch.float32)["lm_head"]  # a no-op
    assert base["total"] == pytest.approx(sum(v for k, v in base.items() if k != "total"))


@pytest.mark.slow    # two fresh processes (torch and transformers imports, a 1-layer 150M model each): ~30 s
def test_matrix_runs_end_to_end(tmp_path):
    out = tmp_path / "sizes.json"
    memory.main(["--matrix", "--device", "cpu", "--models", "qwen3-0.6b", "--layers", "1", "--skip-generate",
                 "--checkpointing-values", "on", "--cast-values", "off", "on", "--group-size", "2",
                 "--prompt-tokens", "4", "--new-tokens", "8", "--dtype", "bfloat16", "--json", str(out)])
    res = json.loads(out.read_text())
    assert {"cpu", "torch", "transformers", "commit"} <= set(res["machine"])
    cells = res["cells"]
    assert [(c["model"], c["gradient_checkpointing"], c["cast_lm_head_to_fp32"]) for c in cells] == \
        [("qwen3-0.6b", True, False), ("qwen3-0.6b", True, True)]
    for c in cells:
        assert c["peak_gib"] > 0 and c["update_seconds"] > 0 and len(c["loadavg_start"]) == 3
        assert c["runs"][0]["dtype"] == "bfloat16" and not c["measured"]          # 1 of 28 layers: not the model
        assert c["gpu_estimate_bf16"]["weights"] == pytest.approx(0.596e9 * 2 / 2**30, rel=2e-3)


@pytest.mark.parametrize("name", ["qwen3-0.6b", "gemma-3-1b"])
def test_estimate_only_counts_the_lora_parameters_peft_makes(name):
    """--estimate-only counts LoRA's parameters from the shapes; peft's own count on a 2-layer copy agrees."""
    from grpo_core.model.loading import attach_lora
    with torch.device("meta"):
        base = memory.build_model(name, 2, torch.device("meta"), torch.float32)
    model = attach_lora(base, 16, 32, 0.0, ["auto"])
    made = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert memory.lora_attention_params(memory.model_config(name, 2)) == made
