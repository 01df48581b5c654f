"""The example plugin package (examples/grpo-units-plugin), installed as a user installs it and run through
the real `grpo` command: its reward and its source found by entry-point name, its metric in MLflow.

It is installed with `pip install --target` into a temp dir (put on PYTHONPATH), so the shared virtual
environment is never modified; the entry points are found through the dist-info pip writes there."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_core.io import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "grpo-units-plugin"


@pytest.fixture(scope="module")
def example_site(tmp_path_factory) -> Path:
    """The example installed (not editable) into a temp dir, from a clean copy of its source."""
    tmp = tmp_path_factory.mktemp("example")
    src = tmp / "src"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = tmp / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
                        "--no-build-isolation", "--no-index", "--target", str(site), str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (site / "grpo_units" / "questions.csv").is_file()          # the package data came along
    return site


@pytest.fixture()
def on_path(example_site, monkeypatch):
    monkeypatch.syspath_prepend(str(example_site))
    yield example_site
    for name in [m for m in sys.modules if m == "grpo_units" or m.startswith("grpo_units.")]:
        del sys.modules[name]


def _env(site: Path, **extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def test_the_reward_is_unit_aware_and_found_by_entry_point(on_path):
    from grpo_core.rewards.rewards import compute_rewards, resolve_reward
    from grpo_core.task import Task
    func = resolve_reward("unit_match", "reward_funcs[0]")
    assert func.origin == "grpo-units-plugin 0.1.0 (grpo_units.rewards:unit_match)"
    task = Task(id="u", kind="math", source="units_csv", prompt="How far?", answer="7 km")
    completions = ["<answer>7 km</answer>", "<answer>7000 metres</answer>", "<answer>7</answer>",
                   "<answer>7 kg</answer>", "<answer>8 km</answer>", "7 km"]
    scores = compute_rewards(completions, [task] * 6, ["unit_match"], [1.0])
    assert scores.per_func["unit_match"] == [1.0, 1.0, 0.5, 0.0, 0.0, 0.0]
    no_unit = Task(id="n", kind="math", source="s", prompt="What is 1 + 1?", answer="2")
    assert compute_rewards(["<answer>2</answer>"], [no_unit], ["unit_match"], [1.0]).totals == [None]   # cannot score


def test_the_source_reads_the_bundled_or_your_csv(on_path, tmp_path):
    from grpo_core.data.sources import get_loader, load_source
    tasks = load_source("units_csv", seed=0)
    assert len(tasks) == 60 and {t.kind for t in tasks} == {"math"} and get_loader("units_csv")[1] == "user"
    assert tasks[0].id == "units-000" and tasks[0].answer.endswith(" km")
    mine = tmp_path / "mine.csv"
    mine.write_text("question,answer\nA cat walks 2 m and then 3 m. How far?,5 m\n")
    [task] = load_source("units_csv", path=str(mine))
    assert (task.id, task.prompt, task.answer) == ("units-000", "A cat walks 2 m and then 3 m. How far?", "5 m")
    mine.write_text("question,answer\nHow far?,5 parsecs\n")
    with pytest.raises(ValueError, match="row 2: answer '5 parsecs' is not a number with a unit"):
        load_source("units_csv", path=str(mine))


def test_data_sources_lists_the_installed_plugin(example_site):
    r = subprocess.run([sys.executable, "-m", "flows.cli", "data", "sources"], cwd=ROOT, env=_env(example_site),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    line = next(s for s in r.stdout.splitlines() if s.strip().startswith("units_csv"))
    assert "user" in line and "grpo-units-plugin 0.1.0 (grpo_units.sources:units_csv)" in line


@pytest.mark.slow
def test_train_with_the_example_config_logs_the_plugin_reward(example_site, tmp_path, grpo_home, mlflow_uri,
                                                              prefect_engine):
    """`grpo train --config examples/grpo-units-plugin/config.yaml` on the tiny model, as the README runs it
    on the real one: prompts from the plugin source, reward/unit_match and its timing in MLflow."""
    from mlflow.tracking import MlflowClient
    from prefect.settings import PREFECT_API_URL
    cmd = [sys.executable, "-m", "flows.cli", "train", "--config", "examples/grpo-units-plugin/config.yaml",
           "--output-dir", str(tmp_path / "runs"), "--run-name", "units",
           "--set", "model=tiny-random", "--set", "pipeline_iterations=2", "--set", "num_generations=2",
           "--set", "max_completion_length=8", "--set", "data.prompts_per_iteration=2", "--set", "data.eval_size=2",
           "--set", "eval.num_samples=1", "--set", "eval.every=2"]
    r = subprocess.run(cmd, cwd=ROOT, env=_env(example_site, PREFECT_API_URL=PREFECT_API_URL.value()),
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    run_id = re.search(r"MLflow run id:\s+(\w+)", r.stdout).group(1)

    client = MlflowClient(mlflow_uri)
    assert [m.step for m in client.get_metric_history(run_id, "reward/unit_match")] == [1, 2]
    assert len(client.get_metric_history(run_id, "sys/reward_seconds/unit_match")) == 2
    assert {"eval/greedy/reward/unit_match", "eval/greedy/format_rate", "eval/greedy/strict_pass_at_1"} <= set(
        client.get_run(run_id).data.metrics)

    run_dir = tmp_path / "runs" / "units"
    bundled = {row["prompt"] for row in _bundled_rows(example_site)}
    for path in (run_dir / "iter-1/prompts.jsonl", run_dir / "iter-2/prompts.jsonl", run_dir / "data/eval.jsonl"):
        rows = list(read_jsonl(path))
        assert rows and all(t["source"] == "units_csv" and t["prompt"] in bundled for t in rows), path
    scored = list(read_jsonl(run_dir / "iter-1" / "scores.jsonl"))
    assert all(set(s["rewards"]) == {"unit_match", "format"} for s in scored)


def _bundled_rows(site: Path) -> list[dict]:
    import csv
    with (site / "grpo_units" / "questions.csv").open(newline="") as f:
        return [{"prompt": row["question"]} for row in csv.DictReader(f)]
