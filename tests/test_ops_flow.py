"""Retry, fail-fast, kill-and-resume, registry and compare through the real engines: Prefect (the
session's test server) and MLflow on SQLite in a temp dir, on the tiny random model.

Faults are injected by tests/faults.py (patched into the stage decorator's seams, armed by a rules file
in GRPO_FAULT_FILE): the stage code runs unmodified and the failure comes through Prefect's real retry
machinery. A CLI run in a child process goes through tests/fault_runner.py to get the same patches."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests import faults
from tests.conftest import tiny_config

REPO = Path(__file__).resolve().parent.parent


def _arm(tmp_path: Path, monkeypatch, *rules: dict) -> Path:
    f = tmp_path / "faults.json"
    f.write_text(json.dumps(list(rules)))
    monkeypatch.setenv(faults.FAULT_ENV, str(f))
    faults.install(monkeypatch)
    return f


def _task_run_count(state) -> int:
    from prefect.client.orchestration import get_client
    with get_client(sync_client=True) as c:
        return c.read_task_run(state.state_details.task_run_id).run_count


def _mlflow_run(uri: str, run_id: str):
    from mlflow.tracking import MlflowClient
    c = MlflowClient(tracking_uri=uri)
    return c, c.get_run(run_id)


def _assert_no_duplicate_steps(uri: str, run_id: str) -> int:
    c, run = _mlflow_run(uri, run_id)
    n = 0
    for key in run.data.metrics:
        steps = [m.step for m in c.get_metric_history(run_id, key)]
        assert len(steps) == len(set(steps)), f"{key} logged twice at a step: {sorted(steps)}"
        n += len(steps)
    return n


def test_transient_failure_is_retried_and_run_completes(prefect_engine, grpo_home, mlflow_uri, tmp_path, monkeypatch):
    from flows.train import training_run
    rules = _arm(tmp_path, monkeypatch, {"point": "rollout", "iteration": 1, "times": 1, "error": "OSError"})
    cfg = tiny_config(tmp_path, pipeline_iterations=1, eval={"enabled": False},
                      stages={"rollout": {"retries": 2, "retry_delay_seconds": 0}})
    summary = training_run(cfg)
    assert json.loads(rules.read_text())[0]["times"] == 0           # the first attempt did fail ...
    run_dir = Path(summary["run_dir"])
    assert (run_dir / "iter-1" / "rollout.json").exists()            # ... and the retry completed the run
    state = json.loads((run_dir / "run.json").read_text())
    assert state["status"] == "finished"
    assert state["started_config"]["learning_rate"] == cfg["learning_rate"]   # what an edited config.yaml is held to
    _, run = _mlflow_run(mlflow_uri, summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert {"git_commit", "config_hash", "dataset_hash", "prefect_flow_run_id"} <= set(run.data.tags)
    assert run.data.params["stages.rollout.retries"] == "2"           # params = the flattened config


def test_bad_input_is_not_retried(prefect_engine, grpo_home, mlflow_uri, tmp_path, monkeypatch):
    """A permanent error (ValueError: bad input) fails at once even with retries configured."""
    from flows.train import training_run
    from tasks.run_state import run_status
    rules = _arm(tmp_path, monkeypatch, {"point": "score", "iteration": 1, "times": 5, "error": "ValueError"})
    cfg = tiny_config(tmp_path, pipeline_iterations=1, eval={"enabled": False},
                      stages={"score": {"retries": 3, "retry_delay_seconds": 0}})
    t0 = time.perf_counter()
    with pytest.raises(Exception, match="injected fault"):
        training_run(cfg)
    assert json.loads(rules.read_text())[0]["times"] == 4             # one attempt only
    run_dir = Path(cfg["output_dir"]) / cfg["run_name"]
    assert not (run_dir / "iter-1" / "score.json").exists()
    st = run_status(run_dir)
    assert st["status"] == "failed" and "ValueError" in st["error"] and st["last_completed"] == "iter-1/rollout"
    print(f"\nbad input failed after {time.perf_counter() - t0:.1f} s")


def test_malformed_data_fails_fast_nothing_written(prefect_engine, grpo_home, mlflow_uri, tmp_path):
    """A malformed prompts file: the rollout stage fails on its first attempt (no retry), writes nothing."""
    from prefect import flow
    from tasks.stage import with_policy
    from grpo_core.config import GRPOConfig
    from tasks.rollout import rollout
    cfg = tiny_config(tmp_path, stages={"rollout": {"retries": 3, "retry_delay_seconds": 5}})
    run_dir = tmp_path / "runs" / "t"
    (run_dir / "iter-1").mkdir(parents=True)
    bad = run_dir / "iter-1" / "prompts.jsonl"
    bad.write_text('{"id": "x", "prompt": \n')

    @flow
    def one_stage():
        return {"state": with_policy(rollout, GRPOConfig.model_validate(cfg), "rollout")(
            cfg, str(run_dir), 1, str(bad), None, return_state=True)}     # in a dict: the flow itself succeeds

    t0 = time.perf_counter()
    state = one_stage()["state"]
    took = time.perf_counter() - t0
    assert state.is_failed()
    assert _task_run_count(state) == 1
    assert took < 5, took                                            # no retry delay was waited
    assert sorted(p.name for p in (run_dir / "iter-1").iterdir()) == ["prompts.jsonl"]


def _adapter_tensors(ckpt: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(ckpt / "adapter_model.safetensors"))


@pytest.mark.slow
def test_sigkill_during_update_then_resume(prefect_engine, grpo_home, mlflow_uri, tmp_path, monkeypatch):
    """`grpo train` killed with SIGKILL inside the iteration-1 update (after its checkpoint and metrics
    were written, before its record), then resumed: completed stages are not re-run, the final adapter
    equals an uninterrupted run's bit for bit, and MLflow holds no step twice."""
    import torch
    from prefect.settings import PREFECT_API_URL
    from flows.cli.ops import compare_runs
    from flows.train import training_run
    from grpo_core.io import read_json
    from tasks.run_state import run_status
    from tasks.registry import load_adapter

    # The tiny random model never earns accuracy/format rewards; the DAPO length penalty varies with the
    # completion length (some stop early), so groups carry signal and the update really moves the adapter.
    signal_opts = dict(reward_funcs=["accuracy", "format", "overlong"], max_completion_length=12,
                       overlong_buffer_length=10)
    cfg = tiny_config(tmp_path, run_name="k", output_dir=str(tmp_path / "runs"), pipeline_iterations=2, **signal_opts)
    cfg_file = tmp_path / "k.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg))
    faults.kill_at(["train", "--config", str(cfg_file)], {"point": "update:saved", "iteration": 1}, tmp_path,
                   env={"PREFECT_API_URL": PREFECT_API_URL.value()})

    run_dir = tmp_path / "runs" / "k"
    st = run_status(run_dir)
    assert st["status"] == "killed" and st["last_completed"] == "iter-1/score"
    assert (run_dir / "iter-1" / "update" / "checkpoint").exists()      # outputs written ...
    assert not (run_dir / "iter-1" / "update.json").exists()            # ... but the stage never completed
    run_id = read_json(run_dir / "run.json")["mlflow_run_id"]
    assert _mlflow_run(mlflow_uri, run_id)[1].info.status == "RUNNING"
    done = ["iter-0/evaluate.json", "iter-1/curate.json", "iter-1/rollout.json", "iter-1/score.json",
            "iter-1/samples.jsonl", "iter-1/scores.jsonl"]
    before = {p: (run_dir / p).stat().st_mtime_ns for p in done}

    monkeypatch.delenv(faults.FAULT_ENV, raising=False)
    t0 = time.perf_counter()
    summary = training_run(cfg)                                         # what `grpo resume k` calls
    resume_s = time.perf_counter() - t0
    assert {p: (run_dir / p).stat().st_mtime_ns for p in done} == before   # completed stages not re-run
    assert summary["mlflow_run_id"] == run_id                           # the same MLflow run, reopened
    assert run_status(run_dir)["status"] == "finished"
    assert read_json(run_dir / "run.json")["attempts"] == 2
    n_points = _assert_no_duplicate_steps(mlflow_uri, run_id)
    assert _mlflow_run(mlflow_uri, run_id)[1].info.status == "FINISHED"

    # Skipping everything: re-run the finished run.
    t0 = time.perf_counter()
    training_run(cfg)
    skip_s = time.perf_counter() - t0
    _assert_no_duplicate_steps(mlflow_uri, run_id)

    # The same run, never interrupted.
    ref_cfg = tiny_config(tmp_path, run_name="k", output_dir=str(tmp_path / "ref"), pipeline_iterations=2,
                          **signal_opts)
    t0 = time.perf_counter()
    ref = training_run(ref_cfg)
    full_s = time.perf_counter() - t0
    for k in (1, 2):
        a = _adapter_tensors(run_dir / f"iter-{k}" / "update" / "checkpoint")
        b = _adapter_tensors(Path(ref["run_dir"]) / f"iter-{k}" / "update" / "checkpoint")
        assert a.keys() == b.keys()
        assert all(torch.equal(a[n], b[n]) for n in a), f"iter-{k} adapter differs after resume"
        assert any(a[n].abs().sum() > 0 for n in a if "lora_B" in n), "the update did not train (no signal)"
    sa = torch.load(run_dir / "iter-2/update/trainer_state.pt", weights_only=False)
    sb = torch.load(Path(ref["run_dir"]) / "iter-2/update/trainer_state.pt", weights_only=False)
    assert sa["global_step"] == sb["global_step"] and torch.equal(sa["rng"]["torch"], sb["rng"]["torch"])
    ca, rb = _mlflow_run(mlflow_uri, run_id)[0], _mlflow_run(mlflow_uri, ref["mlflow_run_id"])[1]
    ra = ca.get_run(run_id)
    for key in ("train/loss", "reward/mean"):
        assert [m.value for m in sorted(ca.get_metric_history(run_id, key), key=lambda m: m.step)] == \
            [m.value for m in sorted(ca.get_metric_history(rb.info.run_id, key), key=lambda m: m.step)]
    assert ra.data.tags["dataset_hash"] == rb.data.tags["dataset_hash"]

    # Registry: the registered adapter loads back with one call and equals the run's file.
    reg = summary["registered_model"]
    assert reg and reg["uri"].startswith("models:/grpo-arithmetic-1d-add-sub/")
    model, tok = load_adapter(reg["uri"], tracking=mlflow_uri)
    it = int(ca.get_model_version(reg["name"], reg["version"]).tags["iteration"])
    want = _adapter_tensors(run_dir / f"iter-{it}" / "update" / "checkpoint")
    got = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert len(got) == len(want) and tok is not None

    # Compare: table + PNG.
    png = tmp_path / "cmp.png"
    res = compare_runs([str(run_dir), str(ref["run_dir"])], png=str(png))
    assert "final metrics" in res["table"] and "train/loss" in res["final_metrics"]
    assert res["config_diff"] == {}                                    # same config (paths aside)
    assert png.stat().st_size > 5000

    print(f"\nresume after kill (re-runs iter-1 update, iter-1 eval, iter 2): {resume_s:.1f} s; "
          f"full uninterrupted run: {full_s:.1f} s; re-run of a finished run (all skipped): {skip_s:.1f} s; "
          f"{n_points} metric points, no duplicates")


@pytest.mark.slow
@pytest.mark.slow
def test_a_run_is_refused_while_another_process_runs_it_and_a_kill_leaves_no_stale_lock(
        prefect_engine, grpo_home, mlflow_uri, tmp_path, capsys):
    """`grpo train` of the same run name, or `grpo resume`, while a live process runs that run is refused with one
    line naming it (both would run the same stages, log each metric twice and register two versions); once that
    process is SIGKILLed, nothing it left blocks the resume, which finishes the run."""
    import signal
    from prefect.settings import PREFECT_API_URL
    from flows.cli.main import main
    from flows.train import training_run
    from grpo_core.config import ConfigError
    from grpo_core.io import read_json
    cfg = tiny_config(tmp_path, pipeline_iterations=1, eval={"enabled": False})
    cfg_file = tmp_path / "t.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg))
    marker = tmp_path / "hung"
    proc = faults.spawn_cli(["train", "--config", str(cfg_file)], [{"point": "rollout", "iteration": 1,
                            "action": "hang", "marker": str(marker)}], tmp_path,
                            env={"PREFECT_API_URL": PREFECT_API_URL.value()})
    try:
        faults.wait_for(marker, proc, 300, tmp_path / "child.log")
        with pytest.raises(ConfigError, match=rf"run 't' is already running \(pid {proc.pid} on "):
            training_run(cfg)
        capsys.readouterr()
        assert main(["resume", "t", "--output-dir", cfg["output_dir"]]) == 2
        assert "error: run 't' is already running" in capsys.readouterr().err
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    summary = training_run(cfg)
    state = read_json(Path(summary["run_dir"]) / "run.json")
    assert state["status"] == "finished" and state["attempts"] == 2
    _assert_no_duplicate_steps(mlflow_uri, summary["mlflow_run_id"])


def test_prefect_flow_run_retry_reruns_failed_stage_onward(prefect_engine, grpo_home, mlflow_uri, tmp_path,
                                                            monkeypatch):
    """A run fails in score; `prefect flow-run retry <id>` re-runs the same flow run: curate and rollout
    are not redone (records untouched), score onward runs, and the run finishes in the same MLflow run."""
    from prefect.settings import PREFECT_API_URL
    from flows.train import training_run
    from grpo_core.io import read_json
    from tasks.run_state import run_status
    _arm(tmp_path, monkeypatch, {"point": "score", "iteration": 1, "times": 1, "error": "ValueError"})
    cfg = tiny_config(tmp_path, pipeline_iterations=1, eval={"enabled": False})
    with pytest.raises(Exception, match="injected fault"):
        training_run(cfg)
    run_dir = Path(cfg["output_dir"]) / cfg["run_name"]
    state = read_json(run_dir / "run.json")
    done = {p: (run_dir / "iter-1" / p).stat().st_mtime_ns for p in ("curate.json", "rollout.json")}
    env = {k: v for k, v in os.environ.items() if k != faults.FAULT_ENV}
    env.update(PREFECT_API_URL=PREFECT_API_URL.value(), PYTHONPATH=str(REPO))
    t0 = time.perf_counter()
    r = subprocess.run([str(Path(sys.executable).parent / "prefect"), "flow-run", "retry", state["flow_run_id"],
                        "--entrypoint", "flows/train.py:training_run"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert {p: (run_dir / "iter-1" / p).stat().st_mtime_ns for p in done} == done
    assert (run_dir / "iter-1" / "update.json").exists()
    st = run_status(run_dir)
    assert st["status"] == "finished" and st["mlflow_run_id"] == state["mlflow_run_id"]
    assert read_json(run_dir / "run.json")["flow_run_ids"][-1] == state["flow_run_id"]    # the same flow run
    _assert_no_duplicate_steps(mlflow_uri, state["mlflow_run_id"])
    print(f"\nprefect flow-run retry (new process, score + update + bookkeeping): {time.perf_counter() - t0:.1f} s")


@pytest.mark.slow
def test_next_run_starts_from_previous_best_adapter(prefect_engine, grpo_home, mlflow_uri, tmp_path):
    """What a scheduled run with --init-from-previous does: a new run (new MLflow run, same experiment)
    whose first rollout/update start from the adapter the previous finished run registered as best."""
    import torch
    from flows.train import training_run
    from grpo_core.io import read_json
    first = training_run(tiny_config(tmp_path, run_name="day-1", pipeline_iterations=1, eval={"enabled": False},
                                     tracking={"register_adapter": "final"}))
    second = training_run(tiny_config(tmp_path, run_name="day-2", pipeline_iterations=1, eval={"enabled": False},
                                      init_adapter="previous"))
    assert second["mlflow_run_id"] != first["mlflow_run_id"]
    _, r1 = _mlflow_run(mlflow_uri, first["mlflow_run_id"])
    _, r2 = _mlflow_run(mlflow_uri, second["mlflow_run_id"])
    assert r1.info.experiment_id == r2.info.experiment_id
    state = read_json(Path(second["run_dir"]) / "run.json")
    assert state["init_adapter_uri"] == r1.data.tags["best_adapter_uri"] == r2.data.tags["init_adapter"]
    init = Path(state["init_adapter_path"])
    a = _adapter_tensors(init)
    b = _adapter_tensors(Path(first["final_checkpoint"]))
    assert all(torch.equal(a[n], b[n]) for n in a)                  # the previous run's final adapter ...
    rollout_rec = read_json(Path(second["run_dir"]) / "iter-1" / "rollout.json")
    assert rollout_rec["key"]                                        # ... is what iteration 1 started from
    upd = read_json(Path(second["run_dir"]) / "iter-1" / "update.json")
    from tasks.layout import input_key
    samples, scores = (str(Path(second["run_dir"]) / "iter-1" / f) for f in ("samples.jsonl", "scores.jsonl"))
    cfg2 = tiny_config(tmp_path, run_name="day-2", pipeline_iterations=1, eval={"enabled": False},
                       init_adapter="previous")
    assert upd["key"] == input_key(config=cfg2, samples=samples, scores=scores, checkpoint=str(init), state=None)


@pytest.mark.slow
def test_reusing_the_model_across_stages_changes_no_result(prefect_engine, grpo_home, mlflow_uri, tmp_path,
                                                           monkeypatch):
    """A 3-iteration run whose stages take the policy's model from the pool (grpo_core.model.policy: no base load
    once the first checkpoint exists) ends with the adapter and eval metrics of the same run with every
    stage loading its own (kernels.reuse_model: false)."""
    from flows.train import training_run
    from grpo_core.model import policy
    loads = []
    real = policy.load_base_model
    monkeypatch.setattr(policy, "load_base_model", lambda *a, **k: loads.append(a[0]) or real(*a, **k))
    runs = {}
    for reuse in ("1", "0"):
        loads.clear()
        summary = training_run(tiny_config(tmp_path, run_name=f"reuse-{reuse}", pipeline_iterations=3,
                                           kernels=dict(reuse_model=reuse == "1"),
                                           eval=dict(every=1, num_samples=1),
                                           gate=dict(enabled=False)))     # no champion comparison's loads
        run_dir = Path(summary["run_dir"])
        _, run = _mlflow_run(mlflow_uri, summary["mlflow_run_id"])
        assert run.data.params["kernels.reuse_model"] == str(reuse == "1")     # the choice is a logged param
        runs[reuse] = (len(loads), _adapter_tensors(run_dir / "iter-3" / "update" / "checkpoint"),
                       json.loads((run_dir / "iter-3" / "evaluate.json").read_text())["metrics"])
    (reused_loads, reused, reused_eval), (fresh_loads, fresh, fresh_eval) = runs["1"], runs["0"]
    assert fresh_loads == 1 + 3 * 3            # eval 0; rollout, update and eval in each iteration
    assert reused_loads == 3                   # the stages without a checkpoint yet: eval 0, rollout 1, update 1
    assert reused.keys() == fresh.keys() and all((reused[k] == fresh[k]).all() for k in reused)
    assert {k: v for k, v in reused_eval.items() if "seconds" not in k} == \
        {k: v for k, v in fresh_eval.items() if "seconds" not in k}


def test_a_temporary_server_records_task_runs_in_batches_and_no_other_server_is_touched(monkeypatch):
    """engine_settings(): the server a command starts for itself (no PREFECT_API_URL) gets the task-run
    recorder's batch size (passed to its subprocess with the current settings); a configured server, or a
    value the user set, is left alone."""
    from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings
    from flows.train import RECORDER_BATCH, engine_settings
    monkeypatch.delenv(RECORDER_BATCH, raising=False)
    passed = lambda: get_current_settings().to_environment_variables(exclude_unset=True)  # noqa: E731
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        with engine_settings():
            assert passed().get(RECORDER_BATCH) == "50"
        assert RECORDER_BATCH not in passed()
        monkeypatch.setenv(RECORDER_BATCH, "7")
        with engine_settings():
            assert RECORDER_BATCH not in passed()
        monkeypatch.delenv(RECORDER_BATCH)
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:4200/api"}), engine_settings():
        assert RECORDER_BATCH not in passed()
