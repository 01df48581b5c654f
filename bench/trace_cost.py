"""What MLflow tracing (tasks/traces.py, tracking.trace_rollouts) costs a run: seconds per traced evaluation answer
and per traced tool rollout, logged to a fresh SQLite store, as the score stage and the evaluation log them.

    .venv/bin/python bench/trace_cost.py [--answers 120]

Prints the CPU, versions, commit and the seconds per trace; multiply by a config's traced rollouts per iteration
(trace_rollouts) and its evaluation answers per evaluation to get what tracing adds to its wall time."""
from __future__ import annotations

import argparse
import platform
import subprocess
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

from grpo_core.config import GRPOConfig
from tasks import tracking, traces


def rows(n: int) -> list[dict]:
    """n evaluation answers of a tool run: a calculator call, its result, the answer (the shape evaluate writes)."""
    messages = [{"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": '
                                                 '{"expression": "214*37"}}</tool_call>'},
                {"role": "tool", "name": "calculator", "content": "7918", "error": False, "seconds": 0.001},
                {"role": "assistant", "content": "<answer>7918</answer>"}]
    return [{"mode": "greedy", "task_id": f"q{i % 40}", "sample": i // 40, "prompt": "What is 214 * 37?",
             "completion": "<answer>7918</answer>", "rewards": {"accuracy": 1.0, "format": 1.0}, "reward_total": 1.2,
             "correct": True, "verdict": "right", "truncated": False, "messages": messages, "tool_calls": 1}
            for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--answers", type=int, default=120, help="evaluation answers to trace")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = GRPOConfig(output_dir=str(Path(tmp) / "runs"), run_name="trace-cost")
        run_id = tracking.start_or_resume_run(cfg, Path(tmp) / "runs" / "r", None)
        t0 = time.perf_counter()
        logged = traces.log_eval_traces(cfg, run_id, 0, rows(args.answers))
        seconds = time.perf_counter() - t0
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"cpu: {cpu}; mlflow {version('mlflow')}; commit {commit}")
    print(f"traced {logged} evaluation answers (4 spans, 4 feedback values each) in {seconds:.1f} s: "
          f"{seconds / max(logged, 1):.3f} s per trace")


if __name__ == "__main__":
    main()
