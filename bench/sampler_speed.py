"""Sampler speed: the fused sampling forward against the lean one it replaced, on step_speed.py's workload.

    python bench/sampler_speed.py [--bf16] [--rounds 4] [--json out.json]

Both samplers share one loaded policy and take turns (fused, lean, fused, lean, ...) on the same prompts
and seeds, so machine noise hits both alike; the first round is a warm-up (the fused base is built and the
linear kernel probed there). Prints the median seconds per rollout of each and their ratio, with the
completion tokens (equal for both: same seeds, same model), the machine, versions and commit.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_speed as S  # noqa: E402

from grpo_core.rollout.samplers import KVCacheSampler, rollout  # noqa: E402
from grpo_core.rollout.sampling import SamplingParams  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--rounds", type=int, default=4, help="rounds after the warm-up one")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    args.device, args.backend = "cpu", "static"
    from learning import machine
    ours = S.Ours(args)
    cfg, pol = ours.cfg, ours.policy
    samplers = {"fused": ours.backend,
                "lean": KVCacheSampler(pol.model, pol.tokenizer, pol.device, progress=False, fused=False)}
    seconds: dict[str, list[float]] = {k: [] for k in samplers}
    tokens: dict[str, list[int]] = {k: [] for k in samplers}
    for r in range(args.rounds + 1):
        for name, sampler in samplers.items():
            params = SamplingParams(max_new_tokens=cfg.max_completion_length, temperature=cfg.temperature,
                                    top_p=cfg.top_p, top_k=cfg.top_k, seed=r)
            t0 = time.perf_counter()
            out = rollout(sampler, pol.tokenizer, S.prompts_for(r, cfg), cfg.num_generations, params,
                          S.SYSTEM_PROMPT, cfg.max_prompt_length)
            dt = time.perf_counter() - t0
            n = sum(len(s.completion_ids) for s in out)
            print(f"  round {r} {name:>5}: {dt:6.2f} s, {n} tokens", flush=True)
            if r:
                seconds[name].append(dt)
                tokens[name].append(n)
    med = {k: statistics.median(v) for k, v in seconds.items()}
    res = {"machine": machine(), "dtype": cfg.dtype, "sampler": samplers["fused"].path, "median_s": med,
           "seconds": seconds, "tokens": tokens, "ratio_lean_over_fused": med["lean"] / med["fused"]}
    print(f"{cfg.dtype}: fused {med['fused']:.2f} s, lean {med['lean']:.2f} s per rollout (median of "
          f"{args.rounds}): {res['ratio_lean_over_fused']:.2f}x; {res['sampler']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
