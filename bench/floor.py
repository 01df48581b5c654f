"""The hardware floor of one GRPO step on this machine, and how far a measured step is above it.

    python bench/floor.py                                  # measure, then the floor of the step_speed workload
    python bench/floor.py --step-json step.json            # ... and ours/floor, ours/TRL from a step_speed.py result

Measured here, each the median of --repeats runs: the copy bandwidth (a large tensor copied, bytes read +
written per second) and the matmul rate (a square matmul of --matmul-size) in fp32 and bf16. The floor of a
step is what the weights and arithmetic alone force on this machine:

  sampling   decode_steps x weight bytes / bandwidth      every decode step reads all the weights once
  update     6 x params x tokens / matmul rate           reference forward (2N), policy forward (2N) and
                                                          backward to the activations (2N) per token; the
                                                          LoRA weight gradients are negligible

with decode_steps = the longest completion (all rows decode together) and tokens = prompt + completion
tokens of all rows, as the speed issue (#13) defines it. Our update packs each group's prompt once with its
answers, so it computes fewer tokens than that: the "packed floor" counts each prompt once per group (rows /
--generations groups), the floor of the work our update really does. The "roofline floor" lets a decode
step cost the larger of its weight reading and its arithmetic (2 x params x rows at the matmul rate): on a
CPU whose matmul rate is low next to its bandwidth, sampling is bound by arithmetic, not memory. The workload defaults are
bench/step_speed.py's (2 prompts x 8 completions, 64 new tokens, the default model); --step-json takes the
tokens that step really generated (its prompt length and longest completion too, where it records them).
Every result records the CPU model, core count, versions and the git commit. Also measured: the rate at
which decode-shaped matmuls (16 rows) read their weights from memory, on ordinary 4 KiB pages and on 2 MiB
pages (on virtual machines the page walks of 4 KiB pages can cost most of the bandwidth; the fused sampler
uses 2 MiB).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learning import machine  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _median_seconds(fn, repeats: int) -> float:
    fn()                                         # warm-up: page faults, kernel selection
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(mib: int, repeats: int, device: torch.device | str = "cpu") -> float:
    """Bytes read + written per second by a large tensor copy on `device` (on CUDA, timed to its end)."""
    src = torch.ones(mib * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    done = torch.cuda.synchronize if src.is_cuda else (lambda: None)

    def copy():
        dst.copy_(src)
        done()
    done()
    return 2 * src.numel() * 4 / _median_seconds(copy, repeats)


def matmul_rate(n: int, dtype: torch.dtype, repeats: int) -> float:
    """FLOP/s of an n x n x n matmul."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / _median_seconds(lambda: a @ b, repeats)


def weight_stream_rate(dtype: torch.dtype, huge_pages: bool, rows: int = 16, mib: int = 192, repeats: int = 3) -> float:
    """Bytes per second at which [rows, 576] x [576, out] matmuls read ~`mib` MiB of distinct weights (the
    shapes of a fused decode layer of the default model), on 2 MiB pages or on ordinary (4 KiB) ones."""
    import torch.nn.functional as F
    from grpo_core.kernels.kernel_probes import streaming_weights
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    flat, weights = streaming_weights(shapes, mib, dtype, huge_pages)
    x = {i: torch.randn(rows, i).to(dtype) for _, i in shapes}
    seconds = _median_seconds(lambda: [F.linear(x[w.size(1)], w) for w in weights], repeats)
    return flat.numel() * flat.element_size() / seconds


def step_floor(params: float, weight_bytes: int, decode_steps: int, tokens: int, bandwidth: float,
               matmul: float, rows: int) -> dict:
    """Seconds the weights (sampling) and the arithmetic (update) alone need for one step; and the
    roofline floor, whose decode step takes the larger of reading the weights and its own arithmetic
    (2 x params x rows), whichever bounds it on this machine."""
    sampling = decode_steps * params * weight_bytes / bandwidth
    roofline = decode_steps * max(params * weight_bytes / bandwidth, 2 * params * rows / matmul)
    update = 6 * params * tokens / matmul
    return {"sampling_s": sampling, "update_s": update, "step_s": sampling + update,
            "sampling_roofline_s": roofline, "roofline_step_s": roofline + update}


def model_params(model: str) -> float:
    from transformers import AutoConfig, AutoModelForCausalLM
    from grpo_core.model.loading import resolve_model
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(resolve_model(model)))
    return float(sum(p.numel() for p in net.parameters()))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="whose parameter count sets the floor")
    ap.add_argument("--rows", type=int, default=16, help="completions per step (prompts x num_generations)")
    ap.add_argument("--prompt-tokens", type=float, default=43,
                    help="tokens of one prompt, chat template included (43: step_speed.py's prompts)")
    ap.add_argument("--new-tokens", type=int, default=64, help="completion tokens per row (and decode steps)")
    ap.add_argument("--generations", type=int, default=8, help="rows per group, which share one prompt")
    ap.add_argument("--step-json", help="a bench/step_speed.py --json result: its measured step and tokens")
    ap.add_argument("--copy-mib", type=int, default=512)
    ap.add_argument("--matmul-size", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    res = {"machine": machine(), "threads": torch.get_num_threads()}
    res["copy_gb_s"] = copy_bandwidth(args.copy_mib, args.repeats) / 1e9
    res["matmul_gflop_s"] = {k: matmul_rate(args.matmul_size, d, args.repeats) / 1e9 for k, d in DTYPES.items()}
    print(f"{res['machine']['cpu']}, {res['machine']['cores']} cores, {res['threads']} torch threads: copy "
          f"{res['copy_gb_s']:.1f} GB/s; matmul {args.matmul_size}^3 " +
          ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in res["matmul_gflop_s"].items()), flush=True)
    res["weight_stream_gb_s"] = {f"{k} {'2MiB' if huge else '4KiB'} pages": weight_stream_rate(d, huge) / 1e9
                                 for k, d in DTYPES.items() for huge in (False, True)}
    print("decode-shaped matmuls streaming their weights (16 rows): " +
          ", ".join(f"{k} {v:.1f} GB/s" for k, v in res["weight_stream_gb_s"].items()), flush=True)
    step = json.loads(Path(args.step_json).read_text()) if args.step_json else None
    step_dtype = {"float32": "fp32", "bfloat16": "bf16"}.get((step or {}).get("workload", {}).get("dtype"), "fp32")
    new_tokens, decode_steps = args.new_tokens, args.new_tokens
    if step:                     # the completion tokens that step really generated: per row, and the longest row
        new_tokens = step["ours"]["tokens_per_s"] * step["ours"]["median_s"] / args.rows
        decode_steps = step["ours"].get("decode_steps_median")
        if decode_steps is None:
            decode_steps = new_tokens
            print("note: this step result does not record its longest completion; decode steps = the mean "
                  "completion length, which puts the sampling floor too low", flush=True)
        args.generations = step["workload"].get("num_generations", args.generations)
        args.prompt_tokens = step["ours"].get("prompt_tokens_mean", args.prompt_tokens)
    params = model_params(args.model)
    tokens = args.rows * (args.prompt_tokens + new_tokens)
    packed_tokens = args.rows // args.generations * args.prompt_tokens + args.rows * new_tokens
    res.update(params=params, rows=args.rows, prompt_tokens=args.prompt_tokens, new_tokens=new_tokens,
               decode_steps=decode_steps, packed_tokens=packed_tokens, floor={}, packed_floor={})
    for name, dtype in DTYPES.items():
        at = dict(params=params, weight_bytes=torch.finfo(dtype).bits // 8, decode_steps=round(decode_steps),
                  bandwidth=res["copy_gb_s"] * 1e9, matmul=res["matmul_gflop_s"][name] * 1e9, rows=args.rows)
        f = res["floor"][name] = step_floor(tokens=tokens, **at)
        packed = res["packed_floor"][name] = step_floor(tokens=packed_tokens, **at)
        line = (f"floor {name}: {f['step_s']:.2f} s/step (sampling {f['sampling_s']:.2f} s, update "
                f"{f['update_s']:.2f} s); packed floor {packed['step_s']:.2f} s; roofline floor "
                f"{f['roofline_step_s']:.2f} s (sampling {f['sampling_roofline_s']:.2f} s)")
        if step and step_dtype == name:
            ours = step["ours"]["median_s"]
            res["ours_over_floor"] = ours / f["step_s"]
            res["ours_over_packed_floor"] = ours / packed["step_s"]
            res["ours_over_roofline_floor"] = ours / f["roofline_step_s"]
            line += (f"; ours {ours:.2f} s = {res['ours_over_floor']:.2f}x the floor, "
                     f"{res['ours_over_packed_floor']:.2f}x the packed floor, "
                     f"{res['ours_over_roofline_floor']:.2f}x the roofline floor")
            if step.get("ratio_trl_over_ours"):
                line += f"; TRL / ours = {step['ratio_trl_over_ours']:.2f}x"
        print(line, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
