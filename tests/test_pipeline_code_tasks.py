"""A run on a curated mix of math, Python and Rust tasks: code completions are scored in Docker."""
from pathlib import Path

import pytest

from conftest import tiny_config
from grpo_core.io import read_jsonl
from grpo_core.task import read_tasks, write_tasks
from sandbox_support import need_docker

pytestmark = [pytest.mark.docker, pytest.mark.slow]


def test_mixed_math_python_rust_run_scores_code_in_docker(tmp_path, grpo_home, mlflow_uri, prefect_engine):
    need_docker()            # skip without an engine; a failure when REQUIRE_DOCKER=1
    from flows.train import training_run
    from grpo_core.data import arithmetic
    from grpo_core.data.sources import gen_python, gen_rust
    tasks = (arithmetic.train_tasks(6, 1, 1, ["+"], seed=0, exclude=set())
             + [t for t in gen_python.load(n=8, seed=0) if hasattr(t, "kind")]
             + [t for t in gen_rust.load(n=6, seed=0) if hasattr(t, "kind")])
    assert {t.kind for t in tasks} == {"math", "python", "rust"}
    data = write_tasks(tmp_path / "mix.jsonl", tasks)
    config = tiny_config(tmp_path, pipeline_iterations=1, max_completion_length=6,
                         data=dict(curated=str(data), prompts_per_iteration=9, eval_size=3),
                         sandbox=dict(backend="docker"))
    summary = training_run(config=config)

    run_dir = Path(summary["run_dir"])
    prompts = {t.id: t for t in read_tasks(run_dir / "iter-1/prompts.jsonl")}
    scores = list(read_jsonl(run_dir / "iter-1/scores.jsonl"))
    kinds = {prompts[s["task_id"]].kind for s in scores}
    assert {"python", "rust"} & kinds, kinds
    code_scores = [s for s in scores if prompts[s["task_id"]].kind != "math"]
    # A tiny random model writes no working code: each verdict is a real fail (0.0), never an
    # unscored None (which would mean the sandbox did not run).
    assert code_scores and all(s["correct"] == 0.0 for s in code_scores)
    assert (run_dir / "iter-1/update/checkpoint/adapter_model.safetensors").exists()
