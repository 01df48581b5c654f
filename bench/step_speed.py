"""Step speed: one GRPO step (rollout + score + update) on a fixed workload, ours vs TRL's GRPOTrainer.

Workload (identical for both): the default model (SmolLM2-135M-Instruct) in fp32 on CPU, 2 prompts x 8
completions, at most 64 new tokens (--max-new-tokens), LoRA r=16 (alpha 32) on q/k/v/o, beta 0.04, lr 1e-5, temperature 1.0,
accuracy + format rewards on 1-digit addition, no gradient checkpointing, one optimizer step per rollout.

    python bench/step_speed.py --steps 5            # ours, fp32
    python bench/step_speed.py --steps 5 --bf16     # ours, bf16 (reported separately; never compared to fp32)
    python bench/step_speed.py --steps 3 --trl      # ours and TRL 1.16 side by side (pip install -e .[bench])

Prints median seconds per step, completion tokens per second, peak RSS and (CUDA) the peak GPU memory of a step;
with --trl also the ratios (s/step, and tokens/s, which does not depend on how long the sampled answers happened
to be).
The ratio is the figure to trust on a shared machine: both run in one invocation, interleaved step by
step (TRL step k, then our step k), so both see the same load. Use --threads 1 on a busy machine: with
more threads than free cores, OpenMP barriers make every matmul several times slower, for both.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from grpo_core.config import GRPOConfig  # noqa: E402
from grpo_core.data.arithmetic import eval_tasks, train_tasks  # noqa: E402
from grpo_core.model.policy import load_policy  # noqa: E402
from grpo_core.rewards.rewards import compute_rewards  # noqa: E402
from grpo_core.rollout.sampling import SamplingParams  # noqa: E402
from grpo_core.rollout.samplers import make_backend, rollout  # noqa: E402
from grpo_core.update.step import (ScoredSample, grpo_update, make_optimizer, make_scheduler,  # noqa: E402
                                  peak_memory_gib)


# Pinned (the pipeline's default prompt format may change): the prompt the TRL anchor was measured with.
SYSTEM_PROMPT = ("Answer the question. Think briefly, then give only the final number inside <answer></answer> tags.")


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux: KiB


def cuda_peak_reset() -> None:
    """Start counting the CUDA memory peak of one step (no-op without CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def cuda_peak_gib() -> float | None:
    """The CUDA memory allocated at the peak since `cuda_peak_reset`, GiB (None without CUDA). With --trl both
    models are resident throughout, so ours and TRL's peaks share one baseline."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    return peak_memory_gib(torch.device("cuda"))


def workload_config(args) -> GRPOConfig:
    return GRPOConfig(model=args.model, device=args.device, dtype="bfloat16" if args.bf16 else "float32",
                      num_generations=8, max_completion_length=getattr(args, "max_new_tokens", 64), temperature=1.0,
                      top_p=1.0, top_k=0,
                      learning_rate=1e-5, beta=0.04, epsilon=0.2, loss_type="grpo", scale_rewards="group",
                      lora_r=16, lora_alpha=32, lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      steps_per_iteration=1, num_iterations=1, gradient_checkpointing=False,
                      pipeline_iterations=1000, rollout_backend=args.backend,
                      data=dict(prompts_per_iteration=2))


def prompts_for(step: int, cfg: GRPOConfig):
    held = eval_tasks(20, 1, 1, ["+"])          # 1-digit addition: 55 questions by content
    return train_tasks(2, 1, 1, ["+"], seed=1000 + step, exclude=held)


class Ours:
    def __init__(self, args):
        self.cfg = cfg = workload_config(args)
        self.policy = load_policy(cfg)
        self.opt = make_optimizer(self.policy, cfg)
        self.sched = make_scheduler(self.opt, cfg)
        self.backend = make_backend(cfg, self.policy, progress=False)

    def step(self, k: int) -> dict:
        cfg, pol = self.cfg, self.policy
        cuda_peak_reset()
        t0 = time.perf_counter()
        params = SamplingParams(max_new_tokens=cfg.max_completion_length, temperature=cfg.temperature,
                                top_p=cfg.top_p, top_k=cfg.top_k, seed=k)
        tasks = prompts_for(k, cfg)
        samples = rollout(self.backend, pol.tokenizer, tasks, cfg.num_generations, params,
                          SYSTEM_PROMPT, cfg.max_prompt_length)   # same prompt TRL gets
        t1 = time.perf_counter()
        by_id = {t.id: t for t in tasks}
        totals = compute_rewards([s.completion for s in samples], [by_id[s.task_id] for s in samples],
                                 cfg.reward_funcs, cfg.reward_weights).totals
        scored = [ScoredSample(group=s.group, prompt_ids=s.prompt_ids, completion_ids=s.completion_ids,
                               reward=r, truncated=s.truncated) for s, r in zip(samples, totals)]
        steps, _, _ = grpo_update(pol, self.opt, self.sched, scored, cfg, seed=k)
        t2 = time.perf_counter()
        tokens = sum(len(s.completion_ids) for s in samples)
        return {"seconds": t2 - t0, "generate_s": t1 - t0, "update_s": t2 - t1, "tokens": tokens,
                "peak_cuda_gib": cuda_peak_gib(),
                "longest": max(len(s.completion_ids) for s in samples),
                "prompt_tokens": statistics.mean(len(s.prompt_ids) for s in samples), "reward": statistics.mean(totals)}


class TRL:
    """TRL's GRPOTrainer on the same model, prompts, rewards and settings; one trainer step per call."""

    def __init__(self, args, tmp: str, extra_callbacks=()):
        from datasets import Dataset
        from peft import LoraConfig
        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
        from trl import GRPOConfig as TRLConfig, GRPOTrainer
        from grpo_core.model.loading import resolve_model
        from grpo_core.rewards.rewards import accuracy_reward, format_reward, reward_columns

        cfg = workload_config(args)
        path = resolve_model(cfg.model)
        steps = args.steps + args.warmup
        rows, self.tasks = [], {}
        for k in range(steps):
            for t in prompts_for(k, cfg):
                self.tasks[t.prompt] = t
                rows.append({"prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                                        {"role": "user", "content": t.prompt}]})
        tasks = self.tasks

        def _task(prompt):
            return tasks[prompt[-1]["content"]]

        def accuracy(prompts, completions, **kw):
            ts = [_task(p) for p in prompts]
            return accuracy_reward([t.prompt for t in ts], [c[0]["content"] for c in completions], **reward_columns(ts))

        def fmt(prompts, completions, **kw):
            ts = [_task(p) for p in prompts]
            return format_reward([t.prompt for t in ts], [c[0]["content"] for c in completions], **reward_columns(ts))

        times: list[float] = []
        tokens: list[float] = []
        peaks: list[float | None] = []

        class Timer(TrainerCallback):
            def on_step_begin(self, a, s, c, **kw):
                cuda_peak_reset()
                self.t0 = time.perf_counter()

            def on_step_end(self, a, s, c, **kw):
                times.append(time.perf_counter() - self.t0)
                peaks.append(cuda_peak_gib())

            def on_log(self, a, s, c, logs=None, **kw):
                if logs and "completions/mean_length" in logs:
                    tokens.append(logs["completions/mean_length"] * cfg.num_generations * 2)

        self.times, self.tokens, self.peaks = times, tokens, peaks
        tcfg = TRLConfig(output_dir=tmp, per_device_train_batch_size=16, num_generations=8, gradient_accumulation_steps=1,
                         max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0, learning_rate=1e-5,
                         beta=0.04,
                         epsilon=0.2, loss_type="grpo", scale_rewards="group", num_iterations=1, max_steps=steps,
                         logging_steps=1, save_strategy="no", report_to=[], bf16=args.bf16, fp16=False,
                         use_cpu=args.device == "cpu", gradient_checkpointing=False, seed=0,
                         lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, shuffle_dataset=False,
                         disable_tqdm=True)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if args.bf16 else torch.float32)
        tok = AutoTokenizer.from_pretrained(path)
        tok.padding_side = "left"
        lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                          task_type="CAUSAL_LM")
        self.trainer = GRPOTrainer(model=model, reward_funcs=[accuracy, fmt], args=tcfg,
                                   train_dataset=Dataset.from_list(rows), processing_class=tok, peft_config=lora,
                                   callbacks=[Timer(), *extra_callbacks])

    def run(self):
        self.trainer.train()
        return self.times, self.tokens


def summarise(name: str, seconds: list[float], tokens: list[float]) -> dict:
    med = statistics.median(seconds)
    tps = sum(tokens) / sum(seconds)
    print(f"{name:>14}: median {med:6.2f} s/step (min {min(seconds):.2f}, max {max(seconds):.2f}, n={len(seconds)})"
          f"  {tps:6.1f} completion tokens/s", flush=True)
    return {"median_s": med, "tokens_per_s": tps, "seconds": seconds}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5, help="timed steps (after --warmup untimed ones)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--bf16", action="store_true", help="bf16 weights for both (reported separately)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="completion length limit for both (64: the "
                                                                     "workload the recorded figures used)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads for both (0: torch default)")
    ap.add_argument("--backend", default="auto", choices=["auto", "fused", "torch", "vllm", "static"],
                    help="our rollout_backend (static: the old name of auto)")
    ap.add_argument("--trl", action="store_true", help="also run TRL GRPOTrainer on the identical workload, "
                                                       "interleaved step by step with ours")
    ap.add_argument("--json", help="write the figures here as JSON")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from learning import machine
    result: dict = {"machine": machine(), "workload": workload_config(args).model_dump(mode="json"),
                    "torch_threads": torch.get_num_threads()}
    dtype = "bf16" if args.bf16 else "fp32"
    ours = Ours(args)
    rec: list[dict] = []

    def our_step(k: int):
        r = ours.step(k)
        if k >= args.warmup:
            rec.append(r)
        print(f"  ours step {k}: {r['seconds']:.2f} s (generate {r['generate_s']:.2f}, update {r['update_s']:.2f}), "
              f"{r['tokens']} tokens, reward {r['reward']:.2f}", flush=True)

    if args.trl:
        # Interleaved: after each TRL step (timed by TRL's own callback), one step of ours, so both see
        # the same machine load over time (this CPU is shared).
        import tempfile
        from transformers import TrainerCallback

        class Interleave(TrainerCallback):
            k = 0

            def on_step_end(self, a, s, c, **kw):
                our_step(Interleave.k)
                Interleave.k += 1

        with tempfile.TemporaryDirectory() as tmp:
            trl = TRL(args, tmp, [Interleave()])
            times, tokens = trl.run()
            for t in times:
                print(f"  TRL step: {t:.2f} s", flush=True)
        times, tokens, trl_peaks = times[args.warmup:], tokens[args.warmup:len(times)], trl.peaks[args.warmup:]
    else:
        for k in range(args.warmup + args.steps):
            our_step(k)
    result["ours"] = summarise(f"ours {dtype}", [r["seconds"] for r in rec], [r["tokens"] for r in rec])
    result["ours"]["generate_s_median"] = statistics.median(r["generate_s"] for r in rec)
    result["ours"]["update_s_median"] = statistics.median(r["update_s"] for r in rec)
    result["ours"]["decode_steps_median"] = statistics.median(r["longest"] for r in rec)   # all rows decode together
    result["ours"]["prompt_tokens_mean"] = statistics.mean(r["prompt_tokens"] for r in rec)
    result["ours"]["sampler"] = getattr(ours.backend, "path", args.backend)
    print(f"our sampler: {result['ours']['sampler']}", flush=True)
    ours_peaks = [r["peak_cuda_gib"] for r in rec if r["peak_cuda_gib"] is not None]
    if ours_peaks:
        result["ours"]["peak_cuda_gib"] = max(ours_peaks)
    if args.trl:
        result["trl"] = summarise(f"TRL 1.16 {dtype}", times, tokens)
        if ours_peaks and any(p is not None for p in trl_peaks):
            result["trl"]["peak_cuda_gib"] = max(p for p in trl_peaks if p is not None)
            print(f"peak CUDA memory in a step (both models resident in both): ours {result['ours']['peak_cuda_gib']:.2f} "
                  f"GiB, TRL {result['trl']['peak_cuda_gib']:.2f} GiB", flush=True)
        result["ratio_trl_over_ours"] = result["trl"]["median_s"] / result["ours"]["median_s"]
        result["ratio_tokens_per_s"] = result["ours"]["tokens_per_s"] / result["trl"]["tokens_per_s"]
        print(f"speed-up (TRL median s/step / ours): {result['ratio_trl_over_ours']:.2f}x; in completion "
              f"tokens/s (robust to how long the sampled answers came out): {result['ratio_tokens_per_s']:.2f}x",
              flush=True)
    result["peak_rss_gb"] = peak_rss_gb()
    print(f"peak RSS of the process: {result['peak_rss_gb']:.2f} GB" + (" (both models)" if args.trl else ""),
          flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
