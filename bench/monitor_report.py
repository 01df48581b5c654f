"""How close finished runs came to tripping each monitor: judge every iteration of each run again from its own
records (tasks/monitoring.py, the config's thresholds or `--set monitors.<field>=...`), and print per run the
monitors that tripped and the extreme value of each figure a monitor reads. No model runs; a healthy run of a
shipped config should trip none.

    python bench/monitor_report.py RUN_DIR [RUN_DIR ...] [--set monitors.max_restated_frac=0.05] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpo_core.config import load_config  # noqa: E402
from tasks.evaluate import eval_history  # noqa: E402
from tasks.monitoring import check_iteration, training_history  # noqa: E402

SHARES = ("empty_answer", "restated_question", "copied_answer", "fabricated_tool_output")


def _streak_max(flags: list[bool]) -> int:
    best = run = 0
    for f in flags:
        run = run + 1 if f else 0
        best = max(best, run)
    return best


def report(run_dir: Path, overrides: list[str]) -> dict:
    """The run's monitors, judged after every iteration as the flow judges them."""
    cfg = load_config(run_dir / "config.yaml", overrides)
    evals = eval_history(run_dir)
    last = max(int(p.parent.name.split("-")[1]) for p in run_dir.glob("iter-*/update.json"))
    tripped, ratios, rises = set(), [], []
    for k in range(1, last + 1):
        metrics, alerts = check_iteration(cfg, run_dir, k, {i: m for i, m in evals.items() if i <= k})
        tripped |= {f"{a.name}@{k}" for a in alerts}
        if "monitor/length_ratio" in metrics:
            ratios.append(metrics["monitor/length_ratio"])
        if "monitor/train_reward_rise" in metrics:
            rises.append((metrics["monitor/train_reward_rise"], metrics["monitor/heldout_strict_drop"]))
    history = training_history(run_dir, last)
    m = cfg.monitors
    return {
        "run": run_dir.name, "iterations": last, "evaluations": sorted(evals), "tripped": sorted(tripped),
        **{f"max_{s}_frac": max((e.get(f"eval/monitor/{s}_frac", 0.0) for i, e in evals.items() if i > 0),
                                default=None) for s in SHARES},
        "tokens_per_turn_ratio": [min(ratios), max(ratios)] if ratios else None,
        "reward_rise_with_heldout_drop": max(rises, key=lambda r: min(r[0] / m.reward_rise, r[1] / m.heldout_drop),
                                             default=None),
        "longest_stalled_streak": _streak_max([(h["stalled_frac"] or 0) > m.max_stalled_frac for h in history]),
        "longest_frozen_streak": _streak_max([h["lora_change"] is not None and (h["zero_std_frac"] or 0) < 1
                                              and h["lora_change"] < m.min_lora_change for h in history]),
        "min_lora_change": min((h["lora_change"] for h in history if h["lora_change"] is not None), default=None),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (runs/<name>)")
    ap.add_argument("--set", action="append", default=[], help="a monitors.<field>=value to judge by instead")
    ap.add_argument("--json", type=Path, help="also write the reports here")
    args = ap.parse_args()
    reports = [report(run, args.set) for run in args.runs]
    for r in reports:
        print(f"{r['run']}: {r['iterations']} iterations, evaluated at {r['evaluations']}; "
              f"tripped: {', '.join(r['tripped']) or 'none'}")
        for key, value in r.items():
            if key not in ("run", "iterations", "evaluations", "tripped"):
                print(f"  {key:<32} {value}")
    if args.json:
        args.json.write_text(json.dumps(reports, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
