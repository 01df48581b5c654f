"""One decode step at a few rows: the lean forward (eager) against the fixed-shape step (`graph_decode`: replayed as
CUDA graphs on a GPU, eager on a CPU), and the weight-streaming floor (issue #51, part 1).

    python bench/decode_step.py [--device cuda] [--models smollm2-135m llama-3.2-1b] [--rows 16] [--json out.json]

Random weights of the real shapes (SmolLM2-135M's config; Llama-3.2-1B's, as bench/memory.py), LoRA r=16 on every
linear, unmerged, as the sampler runs it. Per model and round: each forward prefills `--prompt` tokens per row and
runs `--steps` one-token steps (a fixed token each, so only the step is timed), the two forwards taking turns; the
first round is a warm-up (the graphs are captured there). Reported: the median over rounds of ms per step. The floor:
the bytes of every weight a step reads once, over the device's copy bandwidth (a 1 GiB copy, bytes read + written
per second). Prints both, the ratios, the graphs captured, the machine, versions and commit.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from floor import copy_bandwidth  # noqa: E402
from grpo_core.kernels.graph_decode import GraphDecoder  # noqa: E402
from grpo_core.kernels.lean_decode import LeanDecoder  # noqa: E402

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
                    tie_word_embeddings=True, bos_token_id=None, eos_token_id=1, pad_token_id=0)


def build(name: str, device: torch.device, dtype: torch.dtype, lora_r: int):
    """Model `name` with random weights (seed 0) in `dtype` on `device`, LoRA r=`lora_r` on every linear (B random,
    so the adapter's term is not zero)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpo_core.model.loading import attach_lora
    if name == "smollm2-135m":
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).to(device=device, dtype=dtype)
    else:
        from memory import PRESETS, build_model
        model = build_model(name, PRESETS[name][2], device, dtype)
    model = attach_lora(model, lora_r, 2 * lora_r, 0.0, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj"]).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.normal_(std=0.01)
    return model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def step_seconds(forward, rows: int, prompt: int, steps: int, device: torch.device) -> float:
    """Seconds per step of `steps` one-token steps after a prefill of `prompt` tokens per row."""
    ids = torch.randint(2, 1000, (rows, prompt), device=device, generator=torch.Generator(device).manual_seed(0))
    forward.prefill(ids, torch.ones_like(ids), steps)
    token = torch.full((rows,), 7, device=device)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        forward.step(token)
    sync(device)
    return (time.perf_counter() - t0) / steps


def measure(name: str, args, device: torch.device, dtype: torch.dtype, bandwidth: float) -> dict:
    model = build(name, device, dtype, args.lora_r)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    forwards = {"lean": LeanDecoder.of(model), "fixed": GraphDecoder.of(model, graphs=not args.no_graphs)}
    times: dict[str, list[float]] = {k: [] for k in forwards}
    with torch.inference_mode():
        for r in range(args.rounds + 1):
            for k, fwd in forwards.items():
                s = step_seconds(fwd, args.rows, args.prompt, args.steps, device)
                if r:
                    times[k].append(s)
    ms = {k: 1000 * statistics.median(v) for k, v in times.items()}
    floor_ms = 1000 * weight_bytes / bandwidth
    fixed = forwards["fixed"]
    out = {"model": name, "weights_gb": weight_bytes / 1e9, "floor_ms": floor_ms, "lean_ms": ms["lean"],
           "fixed_ms": ms["fixed"], "fixed_path": "cuda_graphs" if fixed.graphs else "eager",
           "graphs_captured": fixed.captured, "fixed_over_floor": ms["fixed"] / floor_ms,
           "lean_over_fixed": ms["lean"] / ms["fixed"], "per_round_ms": {k: [1000 * t for t in v] for k, v in times.items()}}
    print(f"{name:14s} weights {out['weights_gb']:.2f} GB  floor {floor_ms:7.2f} ms | lean {ms['lean']:7.2f} ms | "
          f"fixed ({out['fixed_path']}) {ms['fixed']:7.2f} ms = {out['fixed_over_floor']:.2f}x floor, "
          f"{out['lean_over_fixed']:.2f}x faster than lean | graphs captured {fixed.captured}", flush=True)
    del model, forwards
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "llama-3.2-1b"],
                    choices=["smollm2-135m", "llama-3.2-1b"])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per row")
    ap.add_argument("--steps", type=int, default=128, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (after one warm-up round)")
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--no-graphs", action="store_true", help="the fixed-shape step eagerly on CUDA too")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    from learning import machine
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA device")
    bandwidth = copy_bandwidth(1024, 5, device)
    print(f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}), {args.dtype}, "
          f"{args.rows} rows, prompt {args.prompt}, {args.steps} steps x {args.rounds} rounds; copy bandwidth "
          f"{bandwidth / 1e9:.0f} GB/s (read + write)", flush=True)
    result = {"device": args.device, "dtype": args.dtype, "rows": args.rows, "prompt": args.prompt,
              "steps": args.steps, "rounds": args.rounds, "lora_r": args.lora_r, "copy_gb_s": bandwidth / 1e9,
              "models": [measure(m, args, device, dtype, bandwidth) for m in args.models], "machine": machine()}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
