"""A stage is one registration (grpo_core/stages.py). A toy stage `tally`, added to the registry here and
nowhere else, runs in the iteration flow between score and update as its own Prefect task run, writes its
record and its output under iter-<k>/, has its own config section `stages.tally` (whose retries apply), and
carries the GPU tag because its entry says it uses the accelerator."""
from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import Field

from grpo_core import stages
from grpo_core.config import ConfigError, GRPOConfig, load_config
from grpo_core.io import read_jsonl
from tasks.stage import stage
from tests.conftest import tiny_config


class TallyStageConfig(stages.StageRetryConfig):
    """The toy stage's own setting, beside the usual retries and work pool."""
    label: str = Field("tally", description="what the toy stage writes in front of its count")


_attempts: list[int] = []


@stage("tally", key=lambda samples, scores, **_: {"samples": samples, "scores": scores})
def tally(config: dict, run_dir: str, iteration: int, samples: str, scores: str) -> dict:
    """Count the scored samples; the first attempt fails with a transient error, so the retries show."""
    _attempts.append(iteration)
    if len(_attempts) == 1:
        raise ConnectionError("a transient hiccup: retried by the stage's policy")
    label = GRPOConfig.model_validate(config).stages.tally.label
    counted = sum(1 for _ in read_jsonl(scores))
    out = Path(run_dir) / f"iter-{iteration}" / "tally.txt"
    out.write_text(f"{label}: {counted} of {sum(1 for _ in read_jsonl(samples))}\n")
    return {"tally": str(out), "counted": counted}


TALLY = stages.Stage("tally", f"{__name__}:tally", inputs={"samples": "rollout.samples", "scores": "score.scores"},
                     outputs=("tally.txt",), settings=TallyStageConfig, defaults={"retries": 1}, accelerator=True)


@pytest.fixture()
def tally_registered(monkeypatch):
    """The registry with `tally` between score and update: the only change made."""
    at = stages.names().index("score") + 1
    monkeypatch.setattr(stages, "STAGES", (*stages.STAGES[:at], TALLY, *stages.STAGES[at:]))
    _attempts.clear()


def test_a_registered_stage_has_a_config_section(tally_registered):
    cfg = GRPOConfig()
    assert cfg.stages.tally == TallyStageConfig(retries=1) and "stages.tally.label" in cfg.flat()
    assert load_config(None, ["stages.tally.label=n"]).stages.tally.label == "n"
    with pytest.raises(ConfigError, match="stages.tallly: no such stage; the stages are warmstart, curate, rollout, score, "
                                          "tally, update, evaluate"):
        load_config(None, ["stages.tallly.retries=1"])


def test_without_the_registration_there_is_no_such_stage():
    with pytest.raises(ConfigError, match="the stages are warmstart, curate, rollout, score, update, evaluate "):
        load_config(None, ["stages.tally.retries=1"])


def test_a_registered_stage_runs_in_its_place_as_its_own_task_run(tmp_path, grpo_home, prefect_engine, mlflow_uri,
                                                                  tally_registered, monkeypatch):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from flows.train import iteration_flow
    from tasks import stage as stage_module, tracking
    monkeypatch.setattr(stage_module, "tag_is_limited", lambda tag: True)      # the GPU tag goes on
    config = tiny_config(tmp_path, pipeline_iterations=1,
                         stages={"tally": {"retries": 1, "retry_delay_seconds": 0, "label": "scored"}})
    run_dir = tmp_path / "runs" / "t"
    run_dir.mkdir(parents=True)
    tracking.start_or_resume_run(GRPOConfig.model_validate(config), run_dir, None)     # the update logs to it
    state = iteration_flow(config, str(run_dir), 1, None, None, return_state=True)
    records = state.result()
    # 1) its record and its output, under iter-1/, like any stage's
    assert records["tally"]["counted"] == 2 * config["num_generations"] and _attempts == [1, 1]
    assert (run_dir / "iter-1" / "tally.json").is_file()
    assert Path(records["tally"]["tally"]).read_text() == f"scored: {records['tally']['counted']} of 8\n"
    # 2) its own task run, between score and update, retried once by its policy, with the GPU tag
    with get_client(sync_client=True) as client:
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(
            id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
    ordered = sorted(task_runs, key=lambda run: run.start_time)
    cfg = GRPOConfig.model_validate(config)
    due = [s.name for s in stages.STAGES if s.when is None or s.when(cfg, 1)]          # no warm start unless asked
    assert [run.name.split("-")[0] for run in ordered] == due and "warmstart" not in due
    (tally_run,) = [run for run in task_runs if run.name.startswith("tally")]
    assert tally_run.run_count == 2 and tally_run.state.is_completed() and "gpu" in tally_run.tags
    # 3) the stages after it still get what they always got: evaluate ran on the adapter this update wrote
    from tasks.evaluate import evaluate
    assert evaluate.fn.completed(dict(config=config, run_dir=str(run_dir), iteration=1,
                                      checkpoint=records["update"]["checkpoint"])) == records["evaluate"]
