"""`grpo eval`: the standalone command gives the same numbers as the evaluate stage for the same adapter,
whether the adapter is given as a path or read (with config and held-out split) from the MLflow run."""
from __future__ import annotations

import argparse
import json

import pytest

from flows.cli.eval import register
from grpo_core.io import read_jsonl
from tasks import tracking
from test_evaluation import evaluated_run  # noqa: F401 - fixture (tests/ is on sys.path under pytest)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="grpo")
    register(p.add_subparsers(dest="command", required=True))
    return p


def _comparable(metrics: dict) -> dict:
    """Everything except the trend monitors, which need the run's history (the stage has it)."""
    return {k: v for k, v in metrics.items() if not k.startswith("monitor/")}


def test_standalone_eval_gives_the_stage_numbers(evaluated_run, tmp_path, capsys):  # noqa: F811
    run_dir, adapter, run_id = evaluated_run["run_dir"], evaluated_run["adapter"], evaluated_run["run_id"]
    stage1, stage0 = evaluated_run["rec1"]["metrics"], evaluated_run["rec0"]["metrics"]
    out = tmp_path / "out"
    args = _parser().parse_args(["eval", "--adapter", str(adapter), "--config", str(run_dir / "config.yaml"),
                                 "--dataset", str(run_dir / "data" / "eval.jsonl"), "--output-dir", str(out),
                                 "--mlflow"])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "eval/sampled/pass_at_3" in printed and "value" in printed
    metrics = json.loads((out / "metrics.json").read_text())
    assert _comparable(metrics) == {k: stage1[k] for k in _comparable(metrics)}
    assert set(_comparable(metrics)) == {k for k in stage1 if k in _comparable(metrics) or
                                         not k.startswith("eval/monitor/")}
    assert list(read_jsonl(out / "eval_samples.jsonl")) == list(read_jsonl(run_dir / "iter-1" / "eval_samples.jsonl"))
    assert (out / "accuracy.png").stat().st_size > 0 and (out / "lengths.png").exists()
    # --mlflow: a separate eval run in the experiment, with the metrics at step 0, the table and the plots
    from mlflow.tracking import MlflowClient
    c = MlflowClient(tracking.tracking_uri(evaluated_run["cfg"]))
    [ev] = c.search_runs([c.get_run(run_id).info.experiment_id], "tags.`grpo.kind` = 'eval'")
    assert ev.data.metrics["eval/sampled/pass_at_3"] == stage1["eval/sampled/pass_at_3"]
    assert {"eval_samples/iter-000.json", "plots/accuracy.png"} <= \
        {f.path for d in ("eval_samples", "plots") for f in c.list_artifacts(ev.info.run_id, d)}

    # --run: config, held-out split and the last adapter come from the MLflow run
    tracking.log_artifacts(evaluated_run["cfg"], run_id, adapter, "adapters/iter-1")
    args = _parser().parse_args(["eval", "--run", run_id, "--json"])
    assert args.func(args) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert _comparable(metrics) == {k: stage1[k] for k in _comparable(metrics)}
    # iteration 0 of a run is the base model
    args = _parser().parse_args(["eval", "--run", run_id, "--iteration", "0", "--json"])
    assert args.func(args) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert _comparable(metrics) == {k: stage0[k] for k in _comparable(metrics)}


def test_eval_command_explains_bad_arguments(tmp_path, grpo_home, mlflow_uri):
    from grpo_core.config import ConfigError
    from grpo_core.model.loading import ModelError
    p = _parser()
    with pytest.raises(ConfigError, match="--dataset is required"):
        args = p.parse_args(["eval", "--model", "tiny-random"])
        args.func(args)
    with pytest.raises(ConfigError, match="neither 'arithmetic' nor an existing JSONL"):
        args = p.parse_args(["eval", "--model", "tiny-random", "--dataset", str(tmp_path / "missing.jsonl")])
        args.func(args)
    with pytest.raises(ConfigError, match="no MLflow run '0123456789abcdef0123456789abcdef': there is no MLflow "
                                          "tracking store at"):      # and none is created to say so
        args = p.parse_args(["eval", "--run", "0123456789abcdef0123456789abcdef"])
        args.func(args)
    from mlflow.tracking import MlflowClient
    MlflowClient(tracking_uri=mlflow_uri).search_experiments()          # the store, without that run
    with pytest.raises(ModelError, match="check the run id"):
        args.func(args)
    with pytest.raises(SystemExit):
        p.parse_args(["eval", "--adapter", "x", "--run", "y"])
    for limit in ("0", "-3", "two"):                 # 0 meant all tasks, -3 all but the last 3
        with pytest.raises(SystemExit):
            p.parse_args(["eval", "--limit", limit])
    assert p.parse_args(["eval", "--limit", "2"]).limit == 2


def test_eval_outputs_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """--output-dir's metrics.json goes through a temp file: a write that fails keeps the previous one."""
    from flows.cli.eval import _write_outputs
    from grpo_core.config import GRPOConfig
    cfg = GRPOConfig(eval={"plots": False})
    _write_outputs(tmp_path, cfg, {"eval/greedy/pass_at_1": 0.5}, [{"length": 3}])
    def disk_full(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr("grpo_core.io.os.fsync", disk_full)
    with pytest.raises(OSError):
        _write_outputs(tmp_path, cfg, {"eval/greedy/pass_at_1": 0.75}, [{"length": 3}])
    assert json.loads((tmp_path / "metrics.json").read_text()) == {"eval/greedy/pass_at_1": 0.5}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval_samples.jsonl", "metrics.json"]


def test_eval_command_on_the_arithmetic_set(tmp_path, grpo_home, capsys):
    args = _parser().parse_args(["eval", "--model", "tiny-random", "--dataset", "arithmetic", "--limit", "2",
                                 "--set", "max_completion_length=4", "--set", "eval.num_samples=2", "--json"])
    assert args.func(args) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["eval/num_questions"] == 2
    assert {"eval/greedy/pass_at_1", "eval/sampled/pass_at_2", "eval/sampled/pass_at_1"} <= set(metrics)


def test_eval_command_with_tools(tmp_path, grpo_home, capsys):
    """--tools: each mode with the tools the model may call and again without; a bad name fails in seconds."""
    from grpo_core.config import ConfigError
    args = _parser().parse_args(["eval", "--model", "tiny-random", "--dataset", "arithmetic", "--limit", "2",
                                 "--set", "max_completion_length=4", "--tools", "calculator", "--json"])
    assert args.func(args) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert {"eval/greedy/pass_at_1", "eval/without_tools/greedy/pass_at_1"} <= set(metrics)
    args = _parser().parse_args(["eval", "--model", "tiny-random", "--dataset", "arithmetic", "--tools", "none",
                                 "--limit", "2", "--set", "max_completion_length=4", "--json"])
    assert args.func(args) == 0
    assert not any("without_tools" in k for k in json.loads(capsys.readouterr().out))
    with pytest.raises(ConfigError, match='tools\\[0\\] = "calculater": unknown name'):
        args = _parser().parse_args(["eval", "--model", "tiny-random", "--dataset", "arithmetic", "--tools",
                                     "calculater"])
        args.func(args)


@pytest.mark.parametrize("row, says", [
    ('{"id": "b", "kind": "math", "source": "s", "prompt": "", "answer": "2"}', "task 'b': field 'prompt'"),
    ('{"id": "b", "kind": "maths", "source": "s", "prompt": "1+1", "answer": "2"}', "task 'b': field 'kind'"),
    ('{"id": "b", "kind": "math", "source": "s", "prompt": "1+1", "answer": "2", "meta": [1]}', "field 'meta'"),
    ('{"id": "b", "kind": "math", "source": "s", "prompt": "1+1", "answer": "2", "difficulty": NaN}',
     "field 'difficulty' must be a finite number or null, got nan"),
    ('{"id": "b", "kind": "math", "source": "s", "prompt": "1+1"}', "task 'b': math tasks need a non-empty 'answer'"),
    ('["b", "math"]', "a row must be a JSON object"),
])
def test_a_bad_dataset_row_names_the_file_line_and_field(tmp_path, row, says):
    from grpo_core.task import TaskValidationError
    from flows.cli.eval import load_eval_tasks
    good = '{"id": "a", "kind": "math", "source": "s", "prompt": "1+1", "answer": "2"}'
    dataset = tmp_path / "held_out.jsonl"
    dataset.write_text(f"{good}\n\n{row}\n")                  # the blank line counts: the row is line 3
    with pytest.raises(TaskValidationError) as e:
        load_eval_tasks(str(dataset), None)
    assert str(e.value).startswith(f"{dataset}:3: ") and says in str(e.value)
