"""Learning proof: train the default model (SmolLM2-135M-Instruct, LoRA) with GRPO on the arithmetic
curriculum and print held-out accuracy before and after, sampled at the training temperature and greedy.

    python bench/learning.py --minutes 30 --seeds 0 1          # the target: +20 points sampled, 2 seeds
    python bench/learning.py --minutes 5 --seeds 0 --eval-size 20   # a quick look

Uses grpo_core directly (no Prefect/MLflow: the benchmark measures learning, not orchestration).
Training stops at the first step that would start after the time budget; evaluation is not counted
in the budget. Prints the config, the wall time and the before/after accuracies per seed as JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from grpo_core.config import GRPOConfig  # noqa: E402
from grpo_core.data.arithmetic import eval_tasks, train_tasks  # noqa: E402
from grpo_core.policy import load_policy  # noqa: E402
from grpo_core.rewards import compute_rewards  # noqa: E402
from grpo_core.sampling import SamplingParams  # noqa: E402
from grpo_core.rollout import make_backend, rollout  # noqa: E402
from grpo_core.update import ScoredSample, grpo_update, make_optimizer, make_scheduler  # noqa: E402


def accuracy(policy, backend, cfg, tasks, greedy: bool, n: int, seed: int) -> float:
    params = SamplingParams(max_new_tokens=cfg.max_completion_length, temperature=cfg.temperature, top_p=cfg.top_p,
                            top_k=cfg.top_k, greedy=greedy, seed=seed)
    samples = rollout(backend, policy.tokenizer, tasks, n, params, cfg.data.prompt_format, cfg.max_prompt_length)
    by_id = {t.id: t for t in tasks}
    _, per = compute_rewards([s.completion for s in samples], [by_id[s.task_id] for s in samples], ["accuracy"], [1.0])
    return statistics.mean(v or 0.0 for v in per["accuracy"])


def run(cfg: GRPOConfig, minutes: float, eval_size: int, eval_samples: int) -> dict:
    torch.manual_seed(cfg.seed)
    d = cfg.data
    held = eval_tasks(eval_size, d.min_digits, d.max_digits, d.operations)
    exclude = {t.id for t in held}
    policy = load_policy(cfg)
    backend = make_backend(cfg, policy, progress=False)
    opt = make_optimizer(policy, cfg)
    sched = make_scheduler(opt, cfg)
    before = {"sampled": accuracy(policy, backend, cfg, held, False, eval_samples, 123),
              "greedy": accuracy(policy, backend, cfg, held, True, 1, 123)}
    print(f"seed {cfg.seed} before: {before}", flush=True)
    t0, step, rewards = time.perf_counter(), 0, []
    while time.perf_counter() - t0 < minutes * 60 and step < cfg.pipeline_iterations:
        tasks = train_tasks(d.prompts_per_iteration, d.min_digits, d.max_digits, d.operations,
                            seed=cfg.seed * 100_003 + step, exclude=exclude)
        params = SamplingParams(max_new_tokens=cfg.max_completion_length, temperature=cfg.temperature,
                                top_p=cfg.top_p, top_k=cfg.top_k, seed=cfg.seed * 7919 + step)
        samples = rollout(backend, policy.tokenizer, tasks, cfg.num_generations, params, d.prompt_format,
                          cfg.max_prompt_length)
        by_id = {t.id: t for t in tasks}
        totals, per = compute_rewards([s.completion for s in samples], [by_id[s.task_id] for s in samples],
                                      cfg.reward_funcs, cfg.weights)
        batch = [ScoredSample(s.group, s.prompt_ids, s.completion_ids, r, s.truncated) if r is not None else None
                 for s, r in zip(samples, totals)]
        metrics, stats = grpo_update(policy, opt, sched, batch, cfg, seed=cfg.seed + step)
        acc = statistics.mean(v or 0.0 for v in per["accuracy"])
        rewards.append(acc)
        step += 1
        print(f"  step {step} ({time.perf_counter() - t0:.0f} s): train accuracy {acc:.2f}, "
              f"zero-std groups {stats.get('frac_reward_zero_std', 0):.2f}, kl {metrics[-1]['kl'] if metrics else 0:.4f}",
              flush=True)
    train_s = time.perf_counter() - t0
    after = {"sampled": accuracy(policy, backend, cfg, held, False, eval_samples, 123),
             "greedy": accuracy(policy, backend, cfg, held, True, 1, 123)}
    out = {"seed": cfg.seed, "steps": step, "train_seconds": train_s, "before": before, "after": after,
           "gain_sampled_points": 100 * (after["sampled"] - before["sampled"]),
           "gain_greedy_points": 100 * (after["greedy"] - before["greedy"]), "train_accuracy": rewards}
    print(f"seed {cfg.seed} after {step} steps / {train_s:.0f} s: {after}  "
          f"(sampled {out['gain_sampled_points']:+.1f} points, greedy {out['gain_greedy_points']:+.1f})", flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0, help="training time budget per seed")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--eval-size", type=int, default=40)
    ap.add_argument("--eval-samples", type=int, default=2, help="sampled answers per held-out question")
    ap.add_argument("--set", nargs="*", default=[], help="config overrides key=value")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from grpo_core.config import load_config
    base = dict(model=args.model, num_generations=8, max_completion_length=48, temperature=1.0, learning_rate=2e-4,
                beta=0.04, loss_type="dapo", epsilon_high=0.28, scale_rewards="group", lora_r=16, lora_alpha=32,
                pipeline_iterations=10_000, reward_funcs=["accuracy", "format"], reward_weights=[1.0, 0.2],
                data=dict(prompts_per_iteration=4, min_digits=1, max_digits=1, operations=["+"]))
    cfg0 = GRPOConfig.model_validate(base)
    results = []
    for seed in args.seeds:
        cfg = load_config(None, [f"{k}={json.dumps(v)}" for k, v in cfg0.flat().items() if "." not in k] +
                          [f"data.{k}={json.dumps(v)}" for k, v in base["data"].items()] + list(args.set) + [f"seed={seed}"])
        if seed == args.seeds[0]:
            print("config:", json.dumps({k: v for k, v in cfg.flat().items() if not k.startswith(("eval.", "stages.",
                  "tracking.", "sandbox."))}), flush=True)
        results.append(run(cfg, args.minutes, args.eval_size, args.eval_samples))
    summary = {"threads": torch.get_num_threads(), "minutes_budget": args.minutes, "runs": results,
               "mean_gain_sampled_points": statistics.mean(r["gain_sampled_points"] for r in results)}
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
