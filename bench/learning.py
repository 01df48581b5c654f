"""Learning proof: train with the real pipeline (`grpo train`: Prefect stages, curation, sandbox,
MLflow) on a config, once per seed, and print held-out accuracy before and after.

    python bench/learning.py --config configs/math.yaml --seeds 0 1 --iterations 40
    python bench/learning.py --config configs/default.yaml --seeds 0 1 --parallel
    python bench/learning.py --config configs/code.yaml --seeds 0 --iterations 12

Each seed is one `grpo train` process (`--parallel`: all seeds at once, one torch thread each). The
held-out split is the run's own `data/eval.jsonl`; the script re-checks that no training prompt of any
iteration asks an eval question (`canonical_question`), and reports the eval at iteration 0 (the base
model) and at the last iteration, greedy and sampled at the training temperature: pass@1, the strict
pass@1 (correct and in the required format) and the format rate. Each run's CPU time (user + system,
all threads) and wall time are measured; `--max-cpu-minutes` marks a run that went over budget.
Results, with the CPU model, versions and git commit, go to `--out` (JSON); the held-out answers before and
after, to bench/results/answers/ (gzipped JSONL); which monitors tripped, if any, and which kernels the rollouts
and updates took (probed per process where `kernels:` is auto), into the JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpo_core.data.curation import canonical_question  # noqa: E402
from grpo_core.task import read_tasks  # noqa: E402

ANSWERS = ROOT / "bench" / "results" / "answers"
KEYS = {"greedy": "eval/greedy/pass_at_1", "sampled": "eval/sampled/pass_at_1",
        "strict_greedy": "eval/greedy/strict_pass_at_1", "strict_sampled": "eval/sampled/strict_pass_at_1",
        "format_greedy": "eval/greedy/format_rate", "format_sampled": "eval/sampled/format_rate",
        # the held-out questions in wordings training never uses (eval.foreign_*), where the config has them
        "foreign_greedy": "eval/greedy/foreign/pass_at_1", "foreign_strict_sampled":
            "eval/sampled/foreign/strict_pass_at_1", "foreign_format_sampled": "eval/sampled/foreign/format_rate",
        # as a user asks the exported model: its default system prompt, no examples, the user's words (and tools)
        "exported_greedy": "eval/greedy/exported/pass_at_1", "exported_strict_greedy":
            "eval/greedy/exported/strict_pass_at_1", "exported_strict_sampled": "eval/sampled/exported/strict_pass_at_1",
        "exported_format_sampled": "eval/sampled/exported/format_rate",
        "exported_tool_call_rate_sampled": "eval/sampled/exported/tool_call_rate",
        # with tools (a config with `tools:`): how many answers called one, and the same questions without them
        "tool_call_rate_sampled": "eval/sampled/tool_call_rate", "without_tools_sampled":
            "eval/without_tools/sampled/pass_at_1", "without_tools_greedy": "eval/without_tools/greedy/pass_at_1"}


def machine() -> dict:
    """CPU model, core count, versions and commit, recorded with every figure."""
    import torch
    import transformers
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    # The caller's word first: a copy of the tree (a snapshot, a device machine) may carry no git or a stale one
    caller = os.environ.get("GRPO_COMMIT")
    commit = caller or _git("rev-parse", "--short", "HEAD")
    if commit and not caller:
        commit += "-dirty" if _git("status", "--porcelain", "--untracked-files=no") else ""
    commit = commit or "unknown"
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
            "trl": _version("trl"), "prefect": _version("prefect"), "python": platform.python_version(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "commit": commit}


def _git(*args: str) -> str:
    """git's output in the repository, or "" where git or the repository is missing."""
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    except OSError:
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def _version(package: str) -> str | None:
    """The installed version of `package`, or None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def launch(config: str, seed: int, iterations: int | None, sets: list[str], out_dir: Path, threads: int | None):
    """Start one `grpo train` run; returns (process, run name, log path)."""
    name = f"learn-{Path(config).stem}-s{seed}"
    out_dir = out_dir / name               # its own MLflow store: parallel runs never share a fresh SQLite DB
    cmd = [sys.executable, "-m", "flows.cli", "train", "--config", config, "--output-dir", str(out_dir),
           "--run-name", name, "--set", f"seed={seed}"]
    if iterations:
        cmd += ["--set", f"pipeline_iterations={iterations}", "--set", f"eval.every={iterations}"]
    for s in sets:
        cmd += ["--set", s]
    env = dict(os.environ)
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    log = out_dir / f"{name}.log"
    out_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    return proc, name, log


def wait_with_cpu(proc: subprocess.Popen) -> tuple[int, float]:
    """Wait for one child; (exit code, its CPU seconds: user + system over all its threads)."""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_utime + usage.ru_stime


def content_overlap(run_dir: Path) -> int:
    """Training prompts (any iteration, dynamic-sampling rounds included) that ask an eval question."""
    held_out = {canonical_question(t.prompt) for t in read_tasks(run_dir / "data" / "eval.jsonl")}
    seen = set()
    for p in run_dir.glob("iter-*/**/prompts.jsonl"):
        seen |= {canonical_question(t.prompt) for t in read_tasks(p)}
    return len(seen & held_out)


def keep_answers(run_dir: Path, iterations: list[int], stem: str) -> list[str]:
    """Copy the held-out answers of `iterations` (eval_samples.jsonl, gzipped) to bench/results/answers/, so that a
    later change to the answer check can score them again (bench/rescore_eval.py) instead of re-running."""
    import gzip
    kept = []
    for k in iterations:
        src = run_dir / f"iter-{k}" / "eval_samples.jsonl"
        if src.is_file():
            dst = ANSWERS / f"{stem}_iter{k}.jsonl.gz"
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(gzip.compress(src.read_bytes(), mtime=0))
            kept.append(str(dst.relative_to(ROOT)))
    return kept


def kernels_taken(run_dir: Path) -> dict[str, list[str]]:
    """The kernels each iteration's rollout and update took (their records, the probes' timings left out), each
    choice once: where `kernels:` is auto a probe picks per process, and two runs that took different kernels
    round differently, so they can differ however alike their configs."""
    import re
    records = {"sampler": ("rollout.json", "sampler", r" \(probe: [^)]*\)"),
               "update": ("update.json", "linears", r"; probe: [^)]*")}
    taken = {kind: set() for kind in records}
    for kind, (name, key, probe) in records.items():
        for record in run_dir.glob(f"iter-*/{name}"):
            said = json.loads(record.read_text()).get(key)
            if said:
                taken[kind].add(re.sub(probe, "", said))
    return {k: sorted(v) for k, v in taken.items()}


def summarise(run_dir: Path, answers_stem: str | None = None) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    state = json.loads((run_dir / "run.json").read_text())
    evals = {int(k): v for k, v in summary["evals"].items()}
    first, last = evals[min(evals)], evals[max(evals)]
    before = {k: first.get(m) for k, m in KEYS.items()}
    after = {k: last.get(m) for k, m in KEYS.items()}
    gain = {k: round(100 * (after[k] - before[k]), 1) for k in KEYS if before[k] is not None and after[k] is not None}
    out = {"iterations": max(evals), "eval_questions": len(read_tasks(run_dir / "data" / "eval.jsonl")),
           "train_eval_content_overlap": content_overlap(run_dir), "before": before, "after": after,
           "gain_points": gain, "mlflow_run_id": summary.get("mlflow_run_id"),
           # the monitors' marks (grpo_core/evaluation/monitors.py): a healthy run has none
           "monitors_tripped": [f"{m['monitor']}@{m['iteration']}" for m in state.get("suspect", [])],
           "kernels": kernels_taken(run_dir)}
    if answers_stem:
        out["answers"] = keep_answers(run_dir, [min(evals), max(evals)], answers_stem)
    return out


def table(runs: list[dict]) -> str:
    cols = [c for c in KEYS if c in ("greedy", "sampled", "strict_sampled", "format_sampled")
            or any(r["before"].get(c) is not None for r in runs)]
    lines = [f"{'seed':>4} {'iters':>5} {'cpu min':>8} {'wall min':>8}  " +
             "  ".join(f"{c:>22}" for c in cols)]
    for r in runs:
        cells = []
        for c in cols:
            b, a = r["before"].get(c), r["after"].get(c)
            cells.append(f"{b:.3f} -> {a:.3f}".rjust(22) if b is not None and a is not None else "-".rjust(22))
        lines.append(f"{r['seed']:>4} {r['iterations']:>5} {r['cpu_minutes']:>8.1f} {r['wall_minutes']:>8.1f}  "
                     + "  ".join(cells))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--iterations", type=int, help="pipeline_iterations (default: the config's); eval at 0 and the end")
    ap.add_argument("--set", action="append", default=[], help="extra config override, key=value (repeatable)")
    ap.add_argument("--parallel", action="store_true", help="run all seeds at once, one torch thread each")
    ap.add_argument("--max-cpu-minutes", type=float, default=30.0, help="budget per run (reported, not enforced)")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "out" / "learning"))
    ap.add_argument("--out", help="result JSON (default: bench/results/learning_<config>.json)")
    args = ap.parse_args()
    out_dir = Path(args.out_dir)
    host = machine()                      # the commit the runs start from (HEAD may move while they run)
    started = []
    for seed in args.seeds:
        started.append((seed, time.perf_counter(), *launch(args.config, seed, args.iterations, args.set, out_dir,
                                                              1 if args.parallel else None)))
        if not args.parallel:
            started[-1] = (*started[-1], *wait_with_cpu(started[-1][2]), time.perf_counter())
    runs = []
    for item in started:
        seed, t0, proc, name, log = item[:5]
        rc, cpu, t1 = item[5:] if len(item) > 5 else (*wait_with_cpu(proc), time.perf_counter())
        if rc != 0:
            print(f"seed {seed}: grpo train failed (exit {rc}); see {log}", file=sys.stderr)
            return 1
        out_stem = Path(args.out).stem if args.out else f"learning_{Path(args.config).stem}"
        run = {"seed": seed, "run": name, "cpu_minutes": round(cpu / 60, 2), "wall_minutes": round((t1 - t0) / 60, 2),
               **summarise(out_dir / name / name, f"{out_stem}_s{seed}")}
        run["within_budget"] = run["cpu_minutes"] <= args.max_cpu_minutes
        runs.append(run)
    result = {"config": args.config, "overrides": args.set, "parallel": args.parallel, "machine": host,
              "runs": runs}
    out = Path(args.out or ROOT / "bench" / "results" / f"learning_{Path(args.config).stem}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result["machine"]))
    print(table(runs))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
