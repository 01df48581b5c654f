"""Peak memory of one GRPO step for a randomly initialised ~1B Llama-style model (Llama-3.2-1B shapes:
hidden 2048, 16 layers, 32/8 heads, MLP 8192, vocab 128256, tied embeddings = 1.24B parameters), LoRA
r=16 on q/k/v/o, G = 8 completions of 256 new tokens, gradient checkpointing on, beta > 0 (the
reference pass runs), bf16 on CUDA.

    python bench/memory.py                      # CUDA if present (bf16), else CPU (fp32), whole model
    python bench/memory.py --layers 2 4 --skip-generate   # shallower copies, then extrapolate to 16 layers

The step is the pipeline's own: `grpo_update` (reference and policy log-probs, loss, backward, optimizer
step) on the sampled group, and the script prints which `completion_logprobs` path the batch took
(`logprob_path`: with gradient checkpointing on, the packed block-mask or the full-row path). Phases, each
with the peak so far, in GiB: weights loaded, after generation (KV cache), after the update. On CUDA the
figures are torch.cuda.max_memory_allocated; on CPU peak RSS of the process (ru_maxrss, KiB on Linux;
includes the Python/torch runtime).
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
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from grpo_core.config import GRPOConfig  # noqa: E402
from grpo_core.kernels.cpu_linear import use_onednn_linears  # noqa: E402
from grpo_core.logprobs import logprob_path  # noqa: E402
from grpo_core.models import attach_lora  # noqa: E402
from grpo_core.policy import Policy  # noqa: E402
from grpo_core.rollout import KVCacheSampler  # noqa: E402
from grpo_core.sampling import SamplingParams  # noqa: E402
from grpo_core.update import ScoredSample, grpo_update, make_optimizer, make_scheduler, peak_memory_gib  # noqa: E402

LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                num_key_value_heads=8, max_position_embeddings=4096, rope_theta=500000.0, tie_word_embeddings=True,
                bos_token_id=None, eos_token_id=1, pad_token_id=0)


class _Tok:
    pad_token_id, eos_token_id = 0, 1


def step_config(args) -> GRPOConfig:
    """The update settings of the measured step (the pipeline's defaults otherwise)."""
    return GRPOConfig(model="tiny-random", num_generations=args.group_size, max_completion_length=args.new_tokens,
                      beta=0.04, loss_type="grpo", logit_chunk_rows=args.chunk_rows, gradient_checkpointing=True,
                      learning_rate=1e-5, max_grad_norm=1.0)


def one_step(layers: int, args, device, dtype) -> dict:
    """Load the model, sample G completions (unless --skip-generate), run one real `grpo_update` step."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = step_config(args)
    mcfg = LlamaConfig(num_hidden_layers=layers, **LLAMA_1B)
    with torch.device(device):
        base = LlamaForCausalLM(mcfg).to(dtype)
    n_params = sum(p.numel() for p in base.parameters())
    model = attach_lora(base, 16, 32, 0.0, ["q_proj", "k_proj", "v_proj", "o_proj"])
    if device.type == "cpu" and args.onednn != "off":
        use_onednn_linears(model, pack=args.onednn == "packed")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    policy = Policy(model, _Tok(), device, use_peft=True)
    out = {"layers": layers, "params_b": n_params / 1e9, "phases": {}}
    t0 = time.perf_counter()
    out["phases"]["weights"] = peak_memory_gib(device)
    G, P, L = args.group_size, args.prompt_tokens, args.new_tokens
    prompt = torch.randint(2, mcfg.vocab_size, (P,)).tolist()
    if args.skip_generate:
        completions = [torch.randint(2, mcfg.vocab_size, (L,)).tolist() for _ in range(G)]
    else:
        be = KVCacheSampler(model, _Tok(), device, batch_size=G, progress=False, merge_lora=False)
        completions = be.generate([prompt], G, SamplingParams(max_new_tokens=L, seed=0))[0]
        completions = [c + torch.randint(2, mcfg.vocab_size, (L - len(c),)).tolist() for c in completions]  # full length
        out["phases"]["generation"] = peak_memory_gib(device)
    samples = [ScoredSample(0, prompt, c, float(i), False) for i, c in enumerate(completions)]
    ids = torch.tensor([prompt + completions[0]], device=device)
    model.train()
    out["logprob_path"] = logprob_path(model, ids.expand(G, -1), torch.ones_like(ids).expand(G, -1), L, G)
    optimizer = make_optimizer(policy, cfg)
    scheduler = make_scheduler(optimizer, cfg)
    steps, _ = grpo_update(policy, optimizer, scheduler, samples, cfg, seed=0)
    out["phases"]["update"] = peak_memory_gib(device)
    out["peak_gib"] = peak_memory_gib(device)
    out["update_seconds"] = steps[-1]["step_seconds"] if steps and "step_seconds" in steps[-1] else None
    out["seconds"] = time.perf_counter() - t0
    del model, base, optimizer, policy
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
        print(f"layers={n} params={r['params_b']:.2f}B  log-prob path {r['logprob_path']}  peak {r['peak_gib']:.2f} GiB  phases: " +
              ", ".join(f"{k} {v:.2f}" for k, v in r["phases"].items()) + f"  ({r['seconds']:.0f} s)", flush=True)
    if len(layers) >= 2 and 16 not in layers:
        (a, ra), (b, rb) = (layers[0], res["runs"][0]), (layers[-1], res["runs"][-1])
        slope = (rb["peak_gib"] - ra["peak_gib"]) / (b - a)
        est = rb["peak_gib"] + slope * (16 - b)
        res["extrapolated_16_layers_gib"] = est
        print(f"ESTIMATE (linear in depth from {a} and {b} layers, {dtype}): 16 layers ~ {est:.1f} GiB peak "
              f"({slope:.2f} GiB per layer); in bf16 weights and activations halve", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
