"""What the score stage adds to an iteration, with and without scoring during the rollout.

    GRPO_HOME=... python bench/score_overlap.py --config configs/code.yaml [--rounds 2] [--json out.json]

Curates one iteration's prompts, then samples and scores them in two run directories that differ only in
`stages.score.during_rollout` (same prompts, seed and model, so the same samples): `late` scores after the
rollout (the score stage does the work), `early` scores each group on a helper thread as soon as it is
sampled (the score stage adopts the result). The two alternate, `--rounds` times each (a fresh iteration
number per round), and the medians are printed: rollout stage, score stage, both, and what the rewards took.
The first rollout of the process also loads the model: a warm-up pair is run first and not counted.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.learning import machine  # noqa: E402

MODES = {"late": False, "early": True}


def timed(fn, *args) -> tuple[dict, float]:
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def one_pair(configs: dict, dirs: dict, k: int, prompts: str, order: list[str]) -> dict:
    """Rollout + score of iteration k in each mode's run directory -> {mode: figures}."""
    from tasks.rollout import rollout
    from tasks.score import score
    out = {}
    for mode in order:
        rolled, rollout_s = timed(rollout.fn, configs[mode], str(dirs[mode]), k, prompts, None)
        scored, score_s = timed(score.fn, configs[mode], str(dirs[mode]), k, prompts, rolled["samples"])
        assert scored["scored_during_rollout"] == MODES[mode], (mode, scored)
        reward_s = sum(v for key, v in scored["metrics"].items() if key.startswith("sys/reward_seconds/"))
        out[mode] = {"rollout_s": rollout_s, "sampling_s": rolled["sampling_seconds"], "score_s": score_s,
                     "total_s": rollout_s + score_s, "reward_s": reward_s, "samples": rolled["samples"],
                     "tokens": rolled["completion_tokens"]}
    same = [Path(out[m]["samples"]).read_bytes() for m in MODES]
    assert same[0] == same[1], "the two modes sampled different completions: the comparison would not be fair"
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/code.yaml")
    p.add_argument("--rounds", type=int, default=2, help="measured pairs (after one warm-up pair)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    p.add_argument("--out", type=Path, default=None, help="run directories (default: a temp dir)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args(argv)
    from grpo_core.config import load_config
    from tasks import tracking
    from tasks.curate import curate
    out = args.out or Path(tempfile.mkdtemp(prefix="score-overlap-"))
    cfg = load_config(args.config, args.set + [f"output_dir={out}", "eval.enabled=false"])
    configs, dirs = {}, {}
    for mode, early in MODES.items():
        c = cfg.model_copy(update={"run_name": f"overlap-{mode}"}).model_dump(mode="json")
        c["stages"]["score"]["during_rollout"] = early
        configs[mode], dirs[mode] = c, out / f"overlap-{mode}"
        dirs[mode].mkdir(parents=True, exist_ok=True)
        tracking.start_or_resume_run(type(cfg).model_validate(c), dirs[mode], None)
    curated = curate.fn(configs["late"], str(dirs["late"]), 1)
    print(f"config {args.config}: {cfg.data.prompts_per_iteration} prompts x {cfg.num_generations} answers, "
          f"reward_funcs {cfg.reward_funcs}; runs in {out}", flush=True)
    rounds = []
    for r in range(args.rounds + 1):
        order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
        pair = one_pair(configs, dirs, 1 + r, curated["prompts"], order)
        print(f"{'warm-up' if r == 0 else f'round {r}'}: " + "; ".join(
            f"{m}: rollout {f['rollout_s']:.1f} s + score {f['score_s']:.2f} s = {f['total_s']:.1f} s "
            f"(rewards {f['reward_s']:.2f} s)" for m, f in pair.items()), flush=True)
        if r:
            rounds.append(pair)
    med = {m: {key: statistics.median(p[m][key] for p in rounds) for key in
               ("rollout_s", "sampling_s", "score_s", "total_s", "reward_s")} for m in MODES}
    late, early = med["late"], med["early"]
    print(f"median over {len(rounds)} round(s):")
    for m in MODES:
        f = med[m]
        print(f"  {m:5s}  rollout {f['rollout_s']:7.2f} s  score stage {f['score_s']:6.2f} s  both {f['total_s']:7.2f} s"
              f"  (rewards took {f['reward_s']:.2f} s)")
    print(f"  score stage: {late['score_s']:.2f} s -> {early['score_s']:.2f} s; rollout + score: "
          f"{late['total_s']:.2f} s -> {early['total_s']:.2f} s ({early['total_s'] / late['total_s']:.3f}x)")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "config": args.config, "sets": args.set,
                                         "rounds": rounds, "median": med}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
