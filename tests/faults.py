"""Test-only fault injection: break a run on purpose, through the real engine, with the stage code
unmodified. Production code knows nothing of it.

`install()` patches these seams (each a function the production code already calls):
  "<stage>"           the stage decorator's `completed_record` found no record: the stage is about to do
                      real work (tasks/stage.py);
  "<stage>:saved"     its body returned (outputs and metrics written), `finish_stage` has not yet written
                      the record; e.g. "update:saved";
  "checkpoint:write"  inside grpo_core.update.checkpoint.save_checkpoint: the adapter and trainer state are written
                      into the temp directory, not yet renamed into place (io.atomic_dir);
  "data:write"        the same inside `grpo data build` (grpo_core.data.build.write_dataset);
  "dynamic:merge"     DAPO dynamic sampling: the first merged file (samples.dynamic.jsonl) is written, the
                      second and the merge's MLflow metrics are not (tasks/run.py: merge_dynamic_rounds).
Once installed, each point consults the JSON list of rules in the file named by $GRPO_FAULT_FILE. A rule:
{"point": "rollout", "iteration": 1, "dir": "dynamic-1", "times": 1, "action": "raise" | "hang",
 "error": "OSError" | "ValueError" | ..., "marker": "/path/touched/on/hit"}.
"iteration" and "dir" (the name of the stage's run_dir: a DAPO refill round runs its stages in
iter-<k>/dynamic-<r>/) narrow the rule when given. `times` is decremented in the file, so "fail once"
survives Prefect retries and process restarts. For a run in a child process, start it with `spawn_cli`
(tests/fault_runner.py installs the patches there); `kill_at` waits for a hang rule's marker and SIGKILLs it.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from grpo_core.update import checkpoint as checkpoint_module
from grpo_core.data import build as build_module
from grpo_core.io import atomic_dir, atomic_write_text, read_json, write_json, write_jsonl
from tasks import layout, run as run_module, stage as stage_module
from tasks.retry import TransientError

FAULT_ENV = "GRPO_FAULT_FILE"
REPO = Path(__file__).resolve().parent.parent
ERRORS = {"OSError": OSError, "ConnectionError": ConnectionError, "TimeoutError": TimeoutError,
          "ValueError": ValueError, "RuntimeError": RuntimeError, "TransientError": TransientError}


def _matches(rule: dict, point: str, iteration: int | None, where: str | None) -> bool:
    return (rule.get("point") == point and rule.get("iteration", iteration) == iteration
            and rule.get("dir", where) == where and rule.get("times", 1) > 0)


def fault_point(point: str, iteration: int | None = None, where: str | None = None) -> None:
    """Fire the first armed rule for (point, iteration, where), if any: raise its error, or hang until killed."""
    path = os.environ.get(FAULT_ENV)
    if not path or not Path(path).exists():
        return
    rules = read_json(path)
    for rule in rules:
        if not _matches(rule, point, iteration, where):
            continue
        rule["times"] = rule.get("times", 1) - 1
        write_json(path, rules)
        if rule.get("marker"):
            atomic_write_text(rule["marker"], f"{point} {iteration} {os.getpid()}\n")
        if rule.get("action", "raise") == "hang":
            while True:            # wait to be killed (the test sends SIGKILL)
                time.sleep(0.5)
        raise ERRORS[rule.get("error", "OSError")](f"injected fault at {point} (iteration {iteration})")


def _completed_record(run_dir, k: int, stage: str, key: str) -> dict | None:
    done = layout.completed_record(run_dir, k, stage, key)
    if done is None:
        fault_point(stage, k, Path(run_dir).name)
    return done


def _finish_stage(run_dir, k: int, stage: str, key: str, record: dict) -> dict:
    fault_point(f"{stage}:saved", k, Path(run_dir).name)
    return layout.finish_stage(run_dir, k, stage, key, record)


def _atomic_dir_with(point: str):
    """io.atomic_dir whose directory, once built in its temp place, passes `point` before the rename."""
    def patched(final, build, replace: bool = False):
        def build_then_fault(tmp: Path) -> None:
            build(tmp)
            fault_point(point, where=Path(final).name)
        return atomic_dir(final, build_then_fault, replace=replace)
    return patched


def _merge_write(path, rows):
    out = write_jsonl(path, rows)
    if Path(path).name == "samples.dynamic.jsonl":
        fault_point("dynamic:merge", where=Path(path).parent.name)
    return out


def install(monkeypatch=None) -> None:
    """Route every seam through its fault point (undone with the test when given `monkeypatch`)."""
    setattr_ = monkeypatch.setattr if monkeypatch is not None else setattr
    setattr_(stage_module, "completed_record", _completed_record)
    setattr_(stage_module, "finish_stage", _finish_stage)
    setattr_(checkpoint_module, "atomic_dir", _atomic_dir_with("checkpoint:write"))
    setattr_(build_module, "atomic_dir", _atomic_dir_with("data:write"))
    setattr_(run_module, "write_jsonl", _merge_write)


# -- a CLI run in a child process, killed where a rule hangs ---------------------------------------------

def spawn_cli(args: list[str], rules: list[dict], tmp: Path, env: dict | None = None,
              launcher: Sequence[str] = (sys.executable,)) -> subprocess.Popen:
    """`grpo ARGS` in a child process (its own process group) with the fault points armed by `rules`;
    its output goes to tmp/child.log. `launcher` runs the module: the Python interpreter, or e.g. an
    `accelerate launch ...` command (tasks/distributed.py: accelerate_launch)."""
    rules_file = tmp / "faults.json"
    rules_file.write_text(json.dumps(rules))
    env = {**os.environ, **(env or {}), FAULT_ENV: str(rules_file), "PYTHONPATH": str(REPO)}
    with open(tmp / "child.log", "w") as out:
        return subprocess.Popen([*launcher, "-m", "tests.fault_runner", *args], cwd=REPO, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(path: Path, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    """Until `path` exists; fails (and kills the child) if the child exits first or time runs out."""
    deadline = time.time() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"child exited early ({proc.returncode}):\n{log.read_text()[-4000:]}")
        if time.time() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"marker {path} not reached in {timeout}s:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)


def kill_at(args: list[str], rule: dict, tmp: Path, env: dict | None = None, timeout: float = 300,
            launcher: Sequence[str] = (sys.executable,)) -> None:
    """Run `grpo ARGS` in a child (started by `launcher`, see spawn_cli) until it hangs at `rule` (made a
    hang rule with a marker), then SIGKILL its whole process group and reap it."""
    marker = tmp / "fault-reached"
    proc = spawn_cli(args, [{**rule, "action": "hang", "marker": str(marker)}], tmp, env, launcher)
    wait_for(marker, proc, timeout, tmp / "child.log")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


def leftovers(root: Path) -> list[str]:
    """Temp files and half-built directories (io.atomic_write_text / io.atomic_dir) under `root`."""
    return sorted(str(p.relative_to(root)) for p in Path(root).rglob(".*")
                  if p.name.endswith(".tmp") or (p.is_dir() and not p.is_symlink()))


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly (the built-in calculator, through the fault point `tool:call`).

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. '12*(3+4)/5'.
    """
    fault_point("tool:call")
    from grpo_core.rollout.tools import calculate
    return calculate(expression)
