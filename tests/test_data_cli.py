"""`grpo data build|stats|sources` through `register()` on our own parser, and the curate-stage wiring."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml

from flows.cli.data import register
from grpo_core.task import read_tasks
from grpo_core.io import write_jsonl


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="grpo")
    register(p.add_subparsers(dest="command", required=True))
    return p


def run(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    return args.func(args)


def write_config(tmp_path: Path) -> Path:
    cfg = {"name": "cli", "out_dir": str(tmp_path / "built"), "eval_fraction": 0.25,
           "sources": [{"name": "arithmetic", "n": 40, "max_digits": 2}, {"name": "gen_python", "n": 8}],
           "weights": {"arithmetic": 0.5, "gen_python": 0.5}, "total": 20}
    p = tmp_path / "data.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def test_build_and_stats_commands(tmp_path, capsys):
    cfg = write_config(tmp_path)
    assert run(["data", "build", "--config", str(cfg), "--backend", "local", "--no-progress"]) == 0
    out = capsys.readouterr().out
    built = next((tmp_path / "built").iterdir())
    assert str(built) in out and "gen_python" in out and "rejections:" in out
    assert run(["data", "stats", str(built)]) == 0
    out = capsys.readouterr().out
    assert "train:" in out and "grpo.dataset_hash" in out
    assert run(["data", "stats", str(built), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["train"]["tasks"] <= 20 and st["train"]["sources"].keys() <= {"arithmetic", "gen_python"}


def test_build_errors_are_reported_not_raised(tmp_path, capsys):
    assert run(["data", "build", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("sources: [{name: unknown_source}]\n")
    assert run(["data", "build", "--config", str(bad)]) == 2
    assert "unknown" in capsys.readouterr().err


def test_a_build_that_leaves_no_training_task_fails_and_says_why(tmp_path, capsys):
    """Every row rejected: the report is written for reading, but the command fails (a scheduled build is not
    handed an empty dataset as a success)."""
    rows = tmp_path / "rows.jsonl"
    write_jsonl(rows, [{"prompt": "no answer here"}, {"prompt": "nor here"}])
    cfg = tmp_path / "empty.yaml"
    cfg.write_text(yaml.safe_dump({"out_dir": str(tmp_path / "built"), "sources": [{"name": "jsonl", "path": str(rows)}]}))
    assert run(["data", "build", "--config", str(cfg), "--no-progress"]) == 1
    out, err = capsys.readouterr()
    assert "train 0" in out and "not_verifiable=2" in out
    assert err.startswith("error: no training task is left") and "rejections.jsonl" in err


@pytest.mark.parametrize("content, says", [
    (b"name: x\n  sources: [\n", "bad.yaml' is not valid YAML: line 2, column 10: mapping values are not allowed here"),
    (b"- {name: jsonl}\n", "bad.yaml' must hold a mapping (name:, sources:, ...)"),
    (b"name: caf\xe9\n", "bad.yaml' is not UTF-8 text (0xe9 at byte 9); save it as UTF-8"),
    (b"sources: [{name: jsonl}]\n", "sources[0] (jsonl): missing a required argument: 'path'; fix its options"),
    (b"sources: [{name: jsonl, path: q.jsonl, limt: 5}]\n",
     "sources[0] (jsonl): unknown option(s) limt; it takes path, source, kind"),
    (b"name: x\nsources: [{name: arithmetic, n: 5}]\nname: y\n",
     "bad.yaml': line 3, column 1: duplicate key 'name' (first given at line 1); keep one of the two"),
    (b"sources:\n  - {name: arithmetic, n: 5, n: 6}\n", "line 2, column 30: duplicate key 'n' (first given at line 2)"),
    (b"sources: [{name: arithmetic, n: -5}]\n", "sources[0] (arithmetic): option 'n' must be a whole number >= 0, got -5"),
    (b"sources: [{name: gen_python, n: 1.5}]\n", "sources[0] (gen_python): option 'n' must be a whole number >= 0"),
    (b"sources: [{name: tool_problems, n: {product: -1}}]\n",
     "sources[0] (tool_problems): option 'n' must be a whole number >= 0 for each kind"),
    (b"sources: [{name: arithmetic, n: 5}]\nweights: {arithmetic: .nan}\n", "weights must be finite numbers >= 0"),
    (b"sources: [{name: arithmetic, n: 5}]\nweights: {arithmetic: .inf}\n", "weights must be finite numbers >= 0"),
    (b"sources: [{name: arithmetic, n: 5}]\nweights: {synthetc: 1}\n",
     "weights: 'synthetc' names no group or loaded source; use one of arithmetic, community, synthetic, user"),
    (b"sources: [{name: arithmetic, n: 5, operations: [/]}]\n", "arithmetic source: operations ['/'] are unknown"),
    (b"sources: [{name: arithmetic, n: 5, max_digits: 0}]\n", "arithmetic source: min_digits=1, max_digits=0"),
    (b"sources: [{name: arithmetic, n: 99999, max_digits: 1}]\n",
     "arithmetic source: n=99999 exceeds the 55 distinct questions"),
])
def test_a_bad_data_config_is_one_error_not_a_traceback(tmp_path, capsys, monkeypatch, content, says):
    monkeypatch.chdir(tmp_path)                                  # the default out_dir, data/built, is relative
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(content)
    assert run(["data", "build", "--config", str(bad), "--no-progress"]) == 2
    assert says in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["bad.yaml"]  # nothing built


def test_sources_command_and_help(capsys):
    assert run(["data", "sources"]) == 0
    out = capsys.readouterr().out
    assert "stackexchange" in out and "not_verifiable" in out
    with pytest.raises(SystemExit):
        parser().parse_args(["data", "build", "--help"])
    assert "weights" in capsys.readouterr().out


def test_curate_stage_uses_curated_data_and_recalibrates(tmp_path):
    pytest.importorskip("prefect")
    from grpo_core.config import GRPOConfig
    from grpo_core.data.build import build, load_build_config
    from tasks.curate import curate
    built = build(load_build_config(write_config(tmp_path), {"validation": {"backend": "local"}, "total": None}))
    cfg = GRPOConfig.model_validate({"data": {"curated": str(built.path), "prompts_per_iteration": 4, "eval_size": 5,
                                              "weights": {"synthetic": 1.0}}})
    run_dir = tmp_path / "run"
    rec = curate.fn(cfg.model_dump(mode="json"), str(run_dir), 1)
    prompts = read_tasks(rec["prompts"])
    assert len(prompts) == 4 and rec["metrics"]["measured"] == 0
    assert len(read_tasks(rec["eval"])) == 5
    assert not {t.id for t in prompts} & {t.id for t in read_tasks(rec["eval"])}
    # iteration 1 found every prompt solved: iteration 2 must not draw them again
    write_jsonl(run_dir / "iter-1" / "scores.jsonl",
                [{"task_id": t.id, "group": i, "reward": 1.0, "correct": 1.0} for i, t in enumerate(prompts) for _ in range(4)])
    rec2 = curate.fn(cfg.model_dump(mode="json"), str(run_dir), 2)
    assert rec2["metrics"]["out_of_band"] == 4
    assert not {t.id for t in read_tasks(rec2["prompts"])} & {t.id for t in prompts}
    assert json.loads(Path(rec2["report"]).read_text())["pass_rate_histogram"]["0.9-1.0"] == 4


def test_curate_stage_default_stays_arithmetic(tmp_path):
    pytest.importorskip("prefect")
    from grpo_core.config import GRPOConfig
    from tasks.curate import curate
    cfg = GRPOConfig()
    rec = curate.fn(cfg.model_dump(mode="json"), str(tmp_path / "run"), 1)
    assert rec["sources"] == {"arithmetic": cfg.data.prompts_per_iteration}


def test_data_config_band_is_validated():
    from grpo_core.config import GRPOConfig
    with pytest.raises(Exception, match="pass_rate_band"):
        GRPOConfig.model_validate({"data": {"pass_rate_band": [0.9, 0.2]}})


def test_curation_is_logged_to_mlflow(tmp_path):
    pytest.importorskip("mlflow")
    from grpo_core.config import GRPOConfig
    from grpo_core.data.build import build, load_build_config
    from tasks import tracking
    from tasks.curate import curate
    from tasks.data_logging import log_curation
    built = build(load_build_config(write_config(tmp_path), {"validation": {"backend": "none"}}))
    cfg = GRPOConfig.model_validate({"data": {"curated": str(built.path), "prompts_per_iteration": 2, "eval_size": 2},
                                     "tracking": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}})
    rec = curate.fn(cfg.model_dump(mode="json"), str(tmp_path / "run"), 1)
    c = tracking.client(cfg)
    run_id = c.create_run(c.create_experiment("data-test")).info.run_id
    log_curation(cfg, run_id, rec, 1)
    run = c.get_run(run_id)
    assert run.inputs.dataset_inputs[0].dataset.digest == built.report["dataset_hash"][:36]
    paths = {f.path for f in c.list_artifacts(run_id, "data")}
    assert "data/report.json" in paths and "data/iter-1" in paths


def test_an_arithmetic_source_asked_for_no_questions_loads_none(tmp_path):
    """n: 0 once looped forever, waiting for the 0th distinct question."""
    from grpo_core.data.sources import load_source
    assert load_source("arithmetic", n=0) == []


def test_a_count_per_kind_is_a_count(tmp_path):
    """tool_problems takes `n` as one count or a count per kind; both pass the count check."""
    from grpo_core.data.build import load_build_config
    cfg = tmp_path / "per_kind.yaml"
    cfg.write_text("sources: [{name: tool_problems, n: {product: 5, two_step: 2}}]\n")
    assert load_build_config(cfg).sources[0]["n"] == {"product": 5, "two_step": 2}
