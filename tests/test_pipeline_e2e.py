"""The real flow end to end: Prefect engine, MLflow on SQLite, a tiny random Llama model, 2 iterations."""
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_config


def digit_fraction(prompts, completions, **columns):
    """A dense toy reward (share of digits) so a random model's groups are never all-equal."""
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


@pytest.fixture()
def finished_run(tmp_path, grpo_home, mlflow_uri, prefect_engine, monkeypatch):
    from flows.train import training_run
    from grpo_core.rewards import rewards
    monkeypatch.setitem(rewards.REWARD_FUNCS, "digit_fraction", digit_fraction)
    config = tiny_config(tmp_path, reward_funcs=["accuracy", "format", "digit_fraction"], keep_trainer_states=1)
    return config, training_run(config=config)


def test_two_iterations_log_metrics_adapters_and_change_weights(finished_run, mlflow_uri):
    from mlflow.tracking import MlflowClient
    config, summary = finished_run
    run_dir = Path(summary["run_dir"])
    c = MlflowClient(mlflow_uri)
    run = c.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["beta"] == str(config["beta"])
    assert run.data.params["data.prompts_per_iteration"] == "2"
    assert "config_hash" in run.data.tags and "prefect_flow_run_id" in run.data.tags

    for key in ["train/loss", "train/kl", "train/clip_ratio/region_mean", "train/grad_norm", "reward/mean",
                "reward/accuracy", "reward/format", "reward/digit_fraction", "train/frac_reward_zero_std", "train/completion_length_mean",
                "train/step_seconds", "train/tokens_per_second"]:
        hist = c.get_metric_history(run.info.run_id, key)
        assert [m.step for m in hist] == [1, 2], key
    evals = c.get_metric_history(run.info.run_id, "eval/greedy/accuracy")
    assert sorted(m.step for m in evals) == [0, 1, 2]

    for k in (1, 2):
        names = {Path(f.path).name for f in c.list_artifacts(run.info.run_id, f"adapters/iter-{k}")}
        assert {"adapter_model.safetensors", "adapter_config.json"} <= names

    # The adapter moved: LoRA B starts at zero, so any non-zero B means the update changed the weights,
    # and iteration 2 differs from iteration 1.
    w1 = load_file(run_dir / "iter-1/update/checkpoint/adapter_model.safetensors")
    w2 = load_file(run_dir / "iter-2/update/checkpoint/adapter_model.safetensors")
    lora_b = [k for k in w1 if "lora_B" in k]
    assert lora_b and any(w1[k].abs().sum() > 0 for k in lora_b)
    assert any(not torch.equal(w1[k], w2[k]) for k in w1)

    # Stages exchanged files, all written completely.
    for k in (1, 2):
        for stage in ("curate", "rollout", "score", "update", "evaluate"):
            assert (run_dir / f"iter-{k}/{stage}.json").exists()
    assert not list(run_dir.rglob(".*.tmp"))
    assert set(summary["evals"]) == {0, 1, 2}
    # Which kernels made the numbers (a probe may pick another under load): the rollout's sampler, the update's linears
    from grpo_core.io import read_json
    for k in (1, 2):
        assert read_json(run_dir / f"iter-{k}/rollout.json")["sampler"]
        assert read_json(run_dir / f"iter-{k}/update.json")["linears"].split(" (")[0] in ("native", "onednn", "torch")

    # keep_trainer_states: 1 keeps the newest optimizer state alone; every adapter stays, without a tokenizer copy.
    assert not (run_dir / "iter-1/update/trainer_state.pt").exists()
    assert (run_dir / "iter-2/update/trainer_state.pt").exists()
    for k in (1, 2):
        files = {p.name for p in (run_dir / f"iter-{k}/update/checkpoint").iterdir()}
        assert "adapter_model.safetensors" in files and not any(f.startswith("tokenizer") for f in files), files


def test_rerun_same_name_skips_completed_stages(finished_run, mlflow_uri):
    from flows.train import training_run
    from mlflow.tracking import MlflowClient
    config, summary = finished_run
    run_dir = Path(summary["run_dir"])
    mtimes = {p: p.stat().st_mtime_ns for p in run_dir.glob("iter-*/*.json")}
    again = training_run(config=config)
    assert again["mlflow_run_id"] == summary["mlflow_run_id"]
    assert {p: p.stat().st_mtime_ns for p in run_dir.glob("iter-*/*.json")} == mtimes
    hist = MlflowClient(mlflow_uri).get_metric_history(summary["mlflow_run_id"], "train/loss")
    assert [m.step for m in hist] == [1, 2]          # nothing logged twice
