"""Peak memory of one GRPO step for a randomly initialised ~1B Llama-style model (Llama-3.2-1B shapes:
hidden 2048, 16 layers, 32/8 heads, MLP 8192, vocab 128256, tied embeddings = 1.24B parameters), LoRA
r=16 on q/k/v/o, G = 8 completions of 256 new tokens, gradient checkpointing on, beta > 0 (the
reference pass runs), bf16 on CUDA.

    python bench/memory.py                      # CUDA if present (bf16), else CPU (fp32), whole model
    python bench/memory.py --layers 2 4 --skip-generate   # shallower copies, then extrapolate to 16 layers

Phases, each with the peak so far: weights loaded, after generation (KV cache), after the reference and
policy forward/backward of the update, after the optimizer step. On CUDA the figures are
torch.cuda.max_memory_allocated; on CPU peak RSS of the process (includes the Python/torch runtime).
On a CPU the whole 1B step takes a few minutes with the fp32 linears on oneDNN (--onednn). --layers
runs shallower copies of the same model (identical width, vocabulary, batch and sequence length) and,
without 16 among them, extrapolates linearly in the layer count to 16 layers: weights and checkpointed
activations grow linearly with depth; the per-chunk LM-head logits, the embedding and the runtime do
not. The extrapolation is printed as an estimate, not a measurement.
"""
from __future__ import annotations

import argparse
import gc
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from grpo_core.logprobs import completion_logprobs  # noqa: E402
from grpo_core.loss import grpo_loss, group_advantages  # noqa: E402
from grpo_core.kernels.cpu_linear import use_onednn_linears  # noqa: E402
from grpo_core.models import attach_lora  # noqa: E402
from grpo_core.sampling import SamplingParams  # noqa: E402
from grpo_core.rollout import KVCacheSampler  # noqa: E402

LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                num_key_value_heads=8, max_position_embeddings=4096, rope_theta=500000.0, tie_word_embeddings=True,
                bos_token_id=None, eos_token_id=1, pad_token_id=0)


def peak_gb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


class _Tok:
    pad_token_id, eos_token_id = 0, 1


def one_step(layers: int, args, device, dtype) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=layers, **LLAMA_1B)
    with torch.device(device):
        base = LlamaForCausalLM(cfg).to(dtype)
    n_params = sum(p.numel() for p in base.parameters())
    model = attach_lora(base, 16, 32, 0.0, ["q_proj", "k_proj", "v_proj", "o_proj"])
    if device.type == "cpu" and args.onednn != "off":
        use_onednn_linears(model, pack=args.onednn == "packed")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    out = {"layers": layers, "params_b": n_params / 1e9, "phases": {}}
    t0 = time.perf_counter()
    out["phases"]["weights"] = peak_gb(device)
    G, P, L = args.group_size, args.prompt_tokens, args.new_tokens
    prompt = torch.randint(2, cfg.vocab_size, (P,)).tolist()
    if args.skip_generate:
        completions = [torch.randint(2, cfg.vocab_size, (L,)).tolist() for _ in range(G)]
    else:
        be = KVCacheSampler(model, _Tok(), device, batch_size=G, progress=False, merge_lora=False)
        completions = be.generate([prompt], G, SamplingParams(max_new_tokens=L, seed=0))[0]
        completions = [c + torch.randint(2, cfg.vocab_size, (L - len(c),)).tolist() for c in completions]  # full length
        out["phases"]["generation"] = peak_gb(device)
    ids = torch.tensor([prompt + c for c in completions], device=device)            # [G, P+L]
    attn = torch.ones_like(ids)
    mask = torch.ones(G, L, device=device)
    adv = group_advantages(torch.arange(G, dtype=torch.float32), G).to(device)
    with torch.no_grad(), model.disable_adapter():
        ref = completion_logprobs(model, ids, attn, L, chunk_rows=args.chunk_rows)[0]
    out["phases"]["reference"] = peak_gb(device)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    logp, _ = completion_logprobs(model, ids, attn, L, chunk_rows=args.chunk_rows)
    loss, _ = grpo_loss(logp, logp.detach(), ref, adv, mask, beta=0.04, epsilon_low=0.2, epsilon_high=0.2,
                        loss_type="grpo", max_completion_length=L)
    loss.backward()
    out["phases"]["backward"] = peak_gb(device)
    opt.step()
    out["phases"]["optimizer"] = peak_gb(device)
    out["peak_gb"] = peak_gb(device)
    out["seconds"] = time.perf_counter() - t0
    del model, base, opt, logp, loss, ref
    gc.collect()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--layers", type=int, nargs="+", default=None, help="depths to run (default: 16, the whole model)")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--chunk-rows", type=int, default=2)
    ap.add_argument("--skip-generate", action="store_true", help="random completions instead of sampling them")
    ap.add_argument("--onednn", default="plain", choices=["plain", "packed", "off"],
                    help="CPU only: fp32 linears through oneDNN reading the plain weights (default: fast, no extra "
                         "memory), with packed copies (the pipeline's default: +1 copy of the frozen weights), or "
                         "PyTorch's default MKL path")
    ap.add_argument("--json")
    ap.add_argument("--single", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.single is not None:
        dev = torch.device(args.device if args.device != "auto" else "cpu")
        r = one_step(args.single, args, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
        Path(args.json).write_text(json.dumps(r))
        return r
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    layers = args.layers or [16]
    res = {"device": str(device), "dtype": str(dtype), "group_size": args.group_size, "new_tokens": args.new_tokens,
           "runs": []}
    for n in layers:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            r = one_step(n, args, device, dtype)
        else:        # peak RSS is per process: one fresh process per depth
            import subprocess
            import tempfile
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                cmd = [sys.executable, __file__, "--single", str(n), "--device", "cpu", "--json", f.name,
                       "--group-size", str(args.group_size), "--prompt-tokens", str(args.prompt_tokens),
                       "--new-tokens", str(args.new_tokens), "--chunk-rows", str(args.chunk_rows),
                       "--onednn", args.onednn]
                subprocess.run(cmd + (["--skip-generate"] if args.skip_generate else []), check=True)
                r = json.loads(Path(f.name).read_text())
        res["runs"].append(r)
        print(f"layers={n} params={r['params_b']:.2f}B  peak {r['peak_gb']:.2f} GB  phases: " +
              ", ".join(f"{k} {v:.2f}" for k, v in r["phases"].items()) + f"  ({r['seconds']:.0f} s)", flush=True)
    if len(layers) >= 2 and 16 not in layers:
        (a, ra), (b, rb) = (layers[0], res["runs"][0]), (layers[-1], res["runs"][-1])
        slope = (rb["peak_gb"] - ra["peak_gb"]) / (b - a)
        est = rb["peak_gb"] + slope * (16 - b)
        res["extrapolated_16_layers_gb"] = est
        print(f"ESTIMATE (linear in depth from {a} and {b} layers, {dtype}): 16 layers ~ {est:.1f} GB peak "
              f"({slope:.2f} GB per layer); in bf16 weights and activations halve", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
