"""Peak memory and seconds of one GRPO update step (LoRA) for the model sizes users train, on random weights with
each model's published shapes, next to the GPU (bf16) memory the formula of docs/speed.md gives for it.

    python bench/memory.py                      # Llama-3.2-1B shapes; CUDA if present (bf16), else CPU (fp32)
    python bench/memory.py --layers 2 4 --skip-generate   # shallower copies, then extrapolate to the full depth
    python bench/memory.py --matrix --skip-generate --dtype auto --json bench/results/memory_sizes_<cpu>.json
    python bench/memory.py --matrix --models qwen3-0.6b --layers 2 4 --append --json ...   # one model, estimated

Presets (`--model`), written from the models' published config.json files (no hub access here; random weights,
seed 0): llama-3.2-1b (the default: hidden 2048, 16 layers, 32/8 heads, MLP 8192, vocab 128256, tied = 1.24B
parameters), qwen2.5-0.5b, qwen2.5-1.5b, qwen3-0.6b, qwen3-1.7b, gemma-3-1b (PRESETS below). LoRA r=16,
alpha 32 on the attention projections (`lora_target_modules: auto`), G = 8 completions of 256 new tokens after
a 64-token prompt (configs/code.yaml's num_generations and max_completion_length), beta > 0 (the reference
pass runs), gradient checkpointing on (`--gradient-checkpointing off`), cast_lm_head_to_fp32 off
(`--cast-lm-head-to-fp32 on`). `--dtype`: bf16 on CUDA and fp32 on CPU by default; `auto` is the pipeline's
own choice (`select_dtype`: bf16 for LoRA on CPUs with native bf16 matmul).

The step is the pipeline's own: `grpo_update` (reference and policy log-probs, loss, backward, optimizer
step) on the sampled group, and the script prints which `completion_logprobs` path the batch took
(`logprob_path`: with gradient checkpointing on, the packed block-mask or the full-row path). Phases, each
with the peak so far, in GiB: weights loaded, after generation (KV cache), after the update. On CUDA the
figures are torch.cuda.max_memory_allocated; on CPU peak RSS of the process (ru_maxrss, KiB on Linux;
includes the Python/torch runtime, reported as `runtime_gib`: the RSS before the model is built).
On a CPU the whole 1B step takes a few minutes. --layers runs shallower copies of the same model (identical
width, vocabulary, batch and sequence length) and, without the full depth among them, extrapolates linearly in
the layer count (memory and seconds): weights and activations grow linearly with depth; the per-chunk LM-head
logits, the embedding and the runtime do not. The extrapolation is printed as an estimate, not a measurement.

--matrix runs every (model x gradient checkpointing x cast_lm_head_to_fp32) cell, each depth of each cell in
its own process (peak RSS is per process), prints a table with `gpu_estimate` (docs/speed.md, "Memory of the
sizes users train") next to each measurement, and writes JSON (machine, versions, commit, os.getloadavg() per
cell) after every cell; --append keeps the cells of an earlier run of the same file that this run does not redo.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from grpo_core.config import GRPOConfig  # noqa: E402
from grpo_core.kernels.cpu_linear import use_onednn_linears  # noqa: E402
from grpo_core.update.logprobs import logprob_path  # noqa: E402
from grpo_core.model.loading import attach_lora, select_dtype  # noqa: E402
from grpo_core.model.policy import Policy, lm_head_in_fp32  # noqa: E402
from grpo_core.rollout.samplers import KVCacheSampler  # noqa: E402
from grpo_core.rollout.sampling import SamplingParams  # noqa: E402
from grpo_core.update.step import ScoredSample, grpo_update, make_optimizer, make_scheduler, peak_memory_gib  # noqa: E402

# Token ids are the bench's own (_Tok: pad 0, eos 1, no bos); they change no shape.
_IDS = dict(bos_token_id=None, eos_token_id=1, pad_token_id=0)
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                num_key_value_heads=8, max_position_embeddings=4096, rope_theta=500000.0, tie_word_embeddings=True,
                **_IDS)


def _gemma3_layer_types(layers: int) -> list[str]:
    """Gemma 3's pattern: five sliding-window (512) layers, then one global, repeated (sliding_window_pattern 6)."""
    return ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]


# name -> (transformers model class, config class, published depth, config kwargs but the depth). Written from the
# published config.json of meta-llama/Llama-3.2-1B, Qwen/Qwen2.5-0.5B, Qwen/Qwen2.5-1.5B, Qwen/Qwen3-0.6B,
# Qwen/Qwen3-1.7B and google/gemma-3-1b-pt (shapes; rope scaling and max positions do not change the step's memory).
_QWEN = dict(vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, use_sliding_window=False, **_IDS)
PRESETS = {
    "llama-3.2-1b": ("LlamaForCausalLM", "LlamaConfig", 16, LLAMA_1B),
    "qwen2.5-0.5b": ("Qwen2ForCausalLM", "Qwen2Config", 24, dict(
        hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2, **_QWEN)),
    "qwen2.5-1.5b": ("Qwen2ForCausalLM", "Qwen2Config", 28, dict(
        hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2, **_QWEN)),
    "qwen3-0.6b": ("Qwen3ForCausalLM", "Qwen3Config", 28, dict(
        hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        attention_bias=False, **_QWEN)),
    "qwen3-1.7b": ("Qwen3ForCausalLM", "Qwen3Config", 28, dict(
        hidden_size=2048, intermediate_size=6144, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        attention_bias=False, **_QWEN)),
    "gemma-3-1b": ("Gemma3ForCausalLM", "Gemma3TextConfig", 26, dict(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_attention_heads=4, num_key_value_heads=1,
        head_dim=256, query_pre_attn_scalar=256, sliding_window=512, max_position_embeddings=32768,
        rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None,
        attn_logit_softcapping=None, tie_word_embeddings=True,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}, **_IDS)),
}


def model_config(name: str, layers: int):
    """The transformers config of preset `name` with `layers` decoder layers."""
    import transformers
    _, cfg_cls, _, kwargs = PRESETS[name]
    extra = {"layer_types": _gemma3_layer_types(layers)} if cfg_cls == "Gemma3TextConfig" else {}
    return getattr(transformers, cfg_cls)(num_hidden_layers=layers, **kwargs, **extra)


def build_model(name: str, layers: int, device: torch.device, dtype: torch.dtype):
    """Preset `name` at depth `layers` with random weights (seed 0), built directly in `dtype` (no fp32 copy)."""
    import transformers
    torch.manual_seed(0)
    mcfg = model_config(name, layers)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return getattr(transformers, PRESETS[name][0])(mcfg).to(dtype)
    finally:
        torch.set_default_dtype(before)


class _Tok:
    pad_token_id, eos_token_id = 0, 1


def step_config(args) -> GRPOConfig:
    """The update settings of the measured step (the pipeline's defaults otherwise)."""
    return GRPOConfig(model="tiny-random", num_generations=args.group_size, max_completion_length=args.new_tokens,
                      beta=0.04, loss_type="grpo", logit_chunk_rows=args.chunk_rows,
                      gradient_checkpointing=args.gradient_checkpointing == "on",
                      cast_lm_head_to_fp32=args.cast_lm_head_to_fp32 == "on", lora_target_modules=["auto"],
                      learning_rate=1e-5, max_grad_norm=1.0)


def _rss_gib() -> float:
    """Resident set size now (CPU), GiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def one_step(layers: int, args, device, dtype) -> dict:
    """Load the model, sample G completions (unless --skip-generate), run one real `grpo_update` step."""
    cfg = step_config(args)
    # The runtime: the CPU process's RSS, or on CUDA what an earlier cell left allocated (should be ~0)
    runtime = _rss_gib() if device.type == "cpu" else torch.cuda.memory_allocated(device) / 2**30
    base = build_model(args.model, layers, device, dtype)
    mcfg = base.config
    n_params = sum(p.numel() for p in base.parameters())
    model = attach_lora(base, cfg.lora_r, cfg.lora_alpha, 0.0, cfg.lora_target_modules)
    n_lora = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if device.type == "cpu" and args.onednn != "off":
        use_onednn_linears(model, pack=args.onednn == "packed")          # fp32 only; a no-op in bf16
    if cfg.gradient_checkpointing:                                        # as load_policy does
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    lm_head_in_fp32(model, cfg.cast_lm_head_to_fp32)                      # as load_policy's _prepare does
    policy = Policy(model, _Tok(), device, use_peft=True)
    out = {"model": args.model, "layers": layers, "params_b": n_params / 1e9, "lora_params": n_lora,
           "dtype": str(dtype).removeprefix("torch."), "runtime_gib": runtime, "phases": {}}
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
    t_update = time.perf_counter()
    steps, _, _ = grpo_update(policy, optimizer, scheduler, samples, cfg, seed=0)
    out["update_seconds"] = time.perf_counter() - t_update
    out["phases"]["update"] = peak_memory_gib(device)
    out["peak_gib"] = peak_memory_gib(device)
    out["seconds"] = time.perf_counter() - t0
    out["estimate"] = memory_estimate(mcfg, n_params, n_lora, args, dtype)
    del model, base, optimizer, policy
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def attention_widths(mcfg) -> tuple[int, int]:
    """(query width, key/value width) of one layer: heads x head_dim."""
    hd = getattr(mcfg, "head_dim", None) or mcfg.hidden_size // mcfg.num_attention_heads
    return mcfg.num_attention_heads * hd, mcfg.num_key_value_heads * hd


def memory_estimate(mcfg, n_params: int, n_lora: int, args, dtype: torch.dtype) -> dict:
    """The formula of docs/speed.md ("Memory of the sizes users train"), GiB by part, for this model and step at
    `dtype` (weights and activations in it; LoRA, its grads and Adam state, and the loss in fp32). The runtime
    (the CPU process's RSS before the model, CUDA's context) is not in it."""
    b = torch.finfo(dtype).bits // 8
    ckpt, cast = args.gradient_checkpointing == "on", args.cast_lm_head_to_fp32 == "on" and b < 4
    G, P, L, rows = args.group_size, args.prompt_tokens, args.new_tokens, args.chunk_rows
    H, I, V, n = mcfg.hidden_size, mcfg.intermediate_size, mcfg.vocab_size, mcfg.num_hidden_layers
    q, kv = attention_widths(mcfg)
    T = G * (P + L)                                   # tokens of the group's padded rows
    layer = T * (4 * H + 2 * q + 2 * kv + 4 * I) * b  # what autograd keeps of one decoder layer for its backward
    parts = {
        "weights": n_params * b,
        "lora_train": n_lora * 16,                    # fp32 parameter, gradient, Adam m and v
        # checkpointing: each layer's input, plus one layer recomputed during the backward; else every layer
        "activations": (n * T * H * b + layer) if ckpt else n * layer,
        # one chunk of `rows` sequences: its logits in the head's dtype (fp32 with the cast) and their fp32
        # gradient; with the cast, the head weight's fp32 copy
        "lm_head": rows * L * V * ((4 if cast else b) + 4) + (V * H * 4 if cast else 0),
    }
    parts = {k: v / 2**30 for k, v in parts.items()}
    parts["total"] = sum(parts.values())
    return parts


def _single(n: int, args) -> dict:
    """One depth in a fresh process (peak RSS is per process); returns its result."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, __file__, "--single", str(n), "--device", "cpu", "--json", f.name,
               "--model", args.model, "--dtype", args.dtype, "--group-size", str(args.group_size),
               "--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens),
               "--chunk-rows", str(args.chunk_rows), "--onednn", args.onednn,
               "--gradient-checkpointing", args.gradient_checkpointing,
               "--cast-lm-head-to-fp32", args.cast_lm_head_to_fp32]
        subprocess.run(cmd + (["--skip-generate"] if args.skip_generate else []), check=True)
        return json.loads(Path(f.name).read_text())


def run_depths(args, device, dtype) -> dict:
    """Every depth of `args.layers` (default: the preset's full depth), extrapolated to the full depth when it is
    not among them. Returns {"runs", "full_layers", "measured", "peak_gib", "update_seconds", "estimate", ...}."""
    full = PRESETS[args.model][2]
    layers = args.layers or [full]
    res = {"model": args.model, "gradient_checkpointing": args.gradient_checkpointing == "on",
           "cast_lm_head_to_fp32": args.cast_lm_head_to_fp32 == "on", "full_layers": full, "runs": []}
    for n in layers:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            r = one_step(n, args, device, dtype)
        else:
            r = _single(n, args)
        res["runs"].append(r)
        print(f"{args.model} layers={n} ckpt={args.gradient_checkpointing} cast={args.cast_lm_head_to_fp32} "
              f"{r['dtype']} params={r['params_b']:.2f}B  log-prob path {r['logprob_path']}  peak "
              f"{r['peak_gib']:.2f} GiB (formula {r['estimate']['total'] + r['runtime_gib']:.2f} incl. runtime "
              f"{r['runtime_gib']:.2f})  update {r['update_seconds']:.1f} s  phases: "
              + ", ".join(f"{k} {v:.2f}" for k, v in r["phases"].items()), flush=True)
    summarize(res, args)
    return res


def summarize(res: dict, args) -> None:
    """The cell's figures from its runs: the full-depth run's, or extrapolated linearly in depth from the first and
    last; the formula for each run and for bf16 at the full depth (`gpu_estimate_bf16`)."""
    full, layers = res["full_layers"], [r["layers"] for r in res["runs"]]
    a = argparse.Namespace(**{**vars(args), "gradient_checkpointing": "on" if res["gradient_checkpointing"] else "off",
                              "cast_lm_head_to_fp32": "on" if res["cast_lm_head_to_fp32"] else "off"})
    for r in res["runs"]:
        r["estimate"] = memory_estimate(model_config(res["model"], r["layers"]), round(r["params_b"] * 1e9),
                                        r["lora_params"], a, getattr(torch, r["dtype"]))
    last = res["runs"][-1]
    res["dtype"], res["measured"] = last["dtype"], full in layers
    res["runtime_gib"], res["logprob_path"] = last["runtime_gib"], last["logprob_path"]
    if full in layers:
        r = res["runs"][layers.index(full)]
        res["peak_gib"], res["update_seconds"], res["estimate"] = r["peak_gib"], r["update_seconds"], r["estimate"]
        res["runtime_gib"] = r["runtime_gib"]
    else:                        # one depth: its own figures (not the model's); two or more: linear in depth
        ra, rb = res["runs"][0], last
        span = (rb["layers"] - ra["layers"]) or 1
        def ext(get):
            return get(rb) + (get(rb) - get(ra)) / span * (full - rb["layers"]) if len(layers) > 1 else get(rb)
        res["peak_gib"], res["update_seconds"] = ext(lambda r: r["peak_gib"]), ext(lambda r: r["update_seconds"])
        res["estimate"] = {k: ext(lambda r: r["estimate"][k]) for k in rb["estimate"]}
        if len(layers) > 1:
            print(f"ESTIMATE (linear in depth from {ra['layers']} and {rb['layers']} layers, {res['dtype']}): "
                  f"{full} layers ~ {res['peak_gib']:.2f} GiB peak, {res['update_seconds']:.0f} s per update",
                  flush=True)
    res["gpu_estimate_bf16"] = memory_estimate(model_config(res["model"], full), _full_params(res["model"], res),
                                               last["lora_params"] // last["layers"] * full, a, torch.bfloat16)


def reestimate(path: Path, args) -> dict:
    """Recompute the formula's figures of every cell of a --matrix JSON (after a change to memory_estimate)."""
    res = json.loads(path.read_text())
    s = res["settings"]
    a = argparse.Namespace(group_size=s["group_size"], prompt_tokens=s["prompt_tokens"], new_tokens=s["new_tokens"],
                           chunk_rows=s["logit_chunk_rows"])
    for cell in res["cells"]:
        summarize(cell, a)
    path.write_text(json.dumps(res, indent=1))
    print_table(res["cells"])
    return res


def _full_params(name: str, res: dict) -> int:
    """Parameters of the preset at its full depth (built on the meta device: no memory)."""
    import transformers
    with torch.device("meta"):
        model = getattr(transformers, PRESETS[name][0])(model_config(name, res["full_layers"]))
    return sum(p.numel() for p in model.parameters())


def lora_attention_params(mcfg, r: int = 16) -> int:
    """LoRA r on q, k, v and o of every layer (`lora_target_modules: auto`): r * (in + out) per projection."""
    H, (q, kv) = mcfg.hidden_size, attention_widths(mcfg)
    return mcfg.num_hidden_layers * r * ((H + q) + 2 * (H + kv) + (q + H))


def estimate_table(args) -> list[dict]:
    """--estimate-only: the formula's GPU (bf16) figures for every cell of --models, nothing run."""
    rows = []
    print(f"{'model':14} {'params':>7} {'ckpt':>4} {'cast':>4} {'weights':>8} {'activ.':>7} {'lm_head':>8} "
          f"{'total GiB':>9}")
    for model in args.models:
        mcfg = model_config(model, PRESETS[model][2])
        n = _full_params(model, {"full_layers": PRESETS[model][2]})
        for ckpt in args.checkpointing_values:
            for cast in args.cast_values:
                a = argparse.Namespace(**{**vars(args), "gradient_checkpointing": ckpt, "cast_lm_head_to_fp32": cast})
                e = memory_estimate(mcfg, n, lora_attention_params(mcfg), a, torch.bfloat16)
                rows.append({"model": model, "params_b": n / 1e9, "gradient_checkpointing": ckpt == "on",
                             "cast_lm_head_to_fp32": cast == "on", "gpu_estimate_bf16": e})
                print(f"{model:14} {n / 1e9:6.2f}B {ckpt:>4} {cast:>4} {e['weights']:8.2f} {e['activations']:7.2f} "
                      f"{e['lm_head']:8.2f} {e['total']:9.2f}", flush=True)
    return rows


def _cell_key(c: dict) -> tuple:
    return c["model"], c["gradient_checkpointing"], c["cast_lm_head_to_fp32"]


def print_table(cells: list[dict]) -> None:
    print(f"{'model':14} {'ckpt':>4} {'cast':>4} {'dtype':>8} {'peak GiB':>9} {'formula':>8} {'s/step':>7} "
          f"{'load':>5} {'GPU bf16 est.':>13}  how")
    for c in cells:
        formula = c["estimate"]["total"] + c["runtime_gib"]
        how = "measured" if c["measured"] else "ESTIMATE from " + "+".join(str(r["layers"]) for r in c["runs"])
        print(f"{c['model']:14} {'on' if c['gradient_checkpointing'] else 'off':>4} "
              f"{'on' if c['cast_lm_head_to_fp32'] else 'off':>4} {c['dtype']:>8} {c['peak_gib']:9.2f} {formula:8.2f} "
              f"{c['update_seconds']:7.1f} {c['loadavg_start'][0]:5.2f} {c['gpu_estimate_bf16']['total']:13.2f}  {how}",
              flush=True)


def run_matrix(args, device, dtype) -> dict:
    """Every (model x checkpointing x cast) cell; the JSON is rewritten after each cell."""
    sys.path.insert(0, str(ROOT / "bench"))
    from learning import machine
    out = Path(args.json) if args.json else None
    old = json.loads(out.read_text()) if out and args.append and out.exists() else {}
    res = {"machine": machine(), "device": str(device), "dtype": str(dtype).removeprefix("torch."),
           "settings": {"group_size": args.group_size, "prompt_tokens": args.prompt_tokens,
                        "new_tokens": args.new_tokens, "logit_chunk_rows": args.chunk_rows, "lora_r": 16,
                        "lora_target_modules": "auto", "skip_generate": args.skip_generate, "onednn": args.onednn},
           "cells": old.get("cells", [])}
    for model in args.models:
        for ckpt in args.checkpointing_values:
            for cast in args.cast_values:
                a = argparse.Namespace(**{**vars(args), "model": model, "gradient_checkpointing": ckpt,
                                          "cast_lm_head_to_fp32": cast})
                load0 = os.getloadavg()
                cell = run_depths(a, device, dtype)
                cell.update(loadavg_start=load0, loadavg_end=os.getloadavg(), commit=res["machine"]["commit"])
                res["cells"] = [c for c in res["cells"] if _cell_key(c) != _cell_key(cell)] + [cell]
                order = {m: i for i, m in enumerate(PRESETS)}
                res["cells"].sort(key=lambda c: (order[c["model"]], not c["gradient_checkpointing"],
                                                 c["cast_lm_head_to_fp32"]))
                if out:
                    out.write_text(json.dumps(res, indent=1))
    print_table(res["cells"])
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--model", default="llama-3.2-1b", choices=list(PRESETS))
    ap.add_argument("--models", nargs="+", default=list(PRESETS), choices=list(PRESETS), help="--matrix: these")
    ap.add_argument("--matrix", action="store_true", help="every model x checkpointing x cast cell")
    ap.add_argument("--checkpointing-values", nargs="+", default=["on", "off"], choices=["on", "off"],
                    help="--matrix: these gradient checkpointing settings")
    ap.add_argument("--cast-values", nargs="+", default=["off", "on"], choices=["on", "off"],
                    help="--matrix: these cast_lm_head_to_fp32 settings")
    ap.add_argument("--append", action="store_true", help="--matrix: keep the other cells of an existing --json")
    ap.add_argument("--layers", type=int, nargs="+", default=None, help="depths to run (default: the full depth)")
    ap.add_argument("--gradient-checkpointing", default="on", choices=["on", "off"])
    ap.add_argument("--cast-lm-head-to-fp32", default="off", choices=["on", "off"])
    ap.add_argument("--dtype", default="default", choices=["default", "auto", "float32", "bfloat16"],
                    help="default: bf16 on CUDA, fp32 on CPU; auto: the pipeline's select_dtype (LoRA)")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--chunk-rows", type=int, default=4, help="logit_chunk_rows (the pipeline's default: 4)")
    ap.add_argument("--skip-generate", action="store_true", help="random completions instead of sampling them")
    ap.add_argument("--onednn", default="plain", choices=["plain", "packed", "off"],
                    help="CPU only: fp32 linears through oneDNN reading the plain weights (default: fast, no extra "
                         "memory), with packed copies (the pipeline's default: +1 copy of the frozen weights), or "
                         "PyTorch's default MKL path")
    ap.add_argument("--json")
    ap.add_argument("--reestimate", action="store_true", help="recompute the formula's figures of the --json matrix")
    ap.add_argument("--estimate-only", action="store_true",
                    help="print the formula's GPU (bf16) memory for every --models x checkpointing x cast cell; runs "
                         "nothing (seconds)")
    ap.add_argument("--single", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    dtype = {"default": torch.bfloat16 if device.type == "cuda" else torch.float32,
             "float32": torch.float32, "bfloat16": torch.bfloat16}.get(args.dtype) or select_dtype("auto", device)
    if args.single is not None:
        r = one_step(args.single, args, device, dtype)
        Path(args.json).write_text(json.dumps(r))
        return r
    if args.reestimate:
        return reestimate(Path(args.json), args)
    if args.estimate_only:
        rows = estimate_table(args)
        if args.json:
            Path(args.json).write_text(json.dumps({"settings": vars(args), "cells": rows}, indent=1))
        return rows
    if args.matrix:
        return run_matrix(args, device, dtype)
    res = {"device": str(device), "dtype": str(dtype), "group_size": args.group_size, "new_tokens": args.new_tokens,
           **run_depths(args, device, dtype)}
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
