"""A model directory with random weights, for speed runs where the real weights cannot travel (bench/gpu_checks.sh).

    python bench/random_model.py SRC OUT                          # SRC's own config and files, fp32
    python bench/random_model.py SRC OUT --shapes llama-3.2-1b    # Llama-3.2-1B's shapes (bench/memory.py), bf16

SRC holds a model's config and tokenizer files without weights (`.gpu_model/`, from bench/gpu_prepare.sh). The
weights are transformers' initialisation under seed 0; OUT says so in RANDOM_WEIGHTS.txt and is written whole or not
at all. With --shapes, only SRC's tokenizer files are copied (its ids fit the larger vocabulary).
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from grpo_core.io import atomic_dir  # noqa: E402

TOKENIZER_FILES = ("special_tokens_map.json", "vocab.json", "merges.txt")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--shapes", choices=["llama-3.2-1b"], help="another model's shapes (bench/memory.py PRESETS)")
    args = ap.parse_args(argv)
    if not (args.src / "config.json").is_file():
        sys.exit(f"{args.src}: no config.json (run bench/gpu_prepare.sh and carry .gpu_model)")

    def build(tmp: Path) -> None:
        if args.shapes:
            from memory import PRESETS, build_model
            model = build_model(args.shapes, PRESETS[args.shapes][2], torch.device("cpu"), torch.bfloat16)
            what = f"{args.shapes} shapes (bench/memory.py), bf16, the tokenizer of {args.src.name}"
        else:
            from transformers import AutoConfig, AutoModelForCausalLM
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.src), dtype=torch.float32)
            what = f"config and tokenizer of {args.src.name}, fp32"
        model.save_pretrained(tmp)
        for f in args.src.iterdir():
            if f.suffix in (".safetensors", ".bin") or f.name == "model.safetensors.index.json":
                continue                                     # never a real weight over the random ones
            if not args.shapes or f.name.startswith(("tokenizer", "chat_template")) or f.name in TOKENIZER_FILES:
                shutil.copy2(f, tmp / f.name)
        (tmp / "RANDOM_WEIGHTS.txt").write_text(f"{what}; weights: transformers' init, torch.manual_seed(0); built by "
                                                "bench/random_model.py\n")
        print(f"built {args.out}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, random weights")

    atomic_dir(args.out, build, replace=True)


if __name__ == "__main__":
    main()
