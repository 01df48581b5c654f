"""Stages on their own workers (issue #16, part 3): `stages.<name>.work_pool` sends a stage to a Prefect
work pool (tasks/remote.py). The slow test runs it for real: a `prefect server start`, two process work
pools with a `prefect worker` each, the `gpu` tag limit of 1, and two tiny training runs started together
with score on cpu-pool and rollout/update/evaluate on gpu-pool. It asserts from the Prefect API where each
stage ran and that the server never let two GPU stages run at once."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

import pytest
import yaml

from grpo_core.stages import accelerator_stages
from grpo_core.io import stop_process_group

from tests.conftest import tiny_config

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
POOLS = {"curate": None, "score": "cpu-pool", "rollout": "gpu-pool", "update": "gpu-pool", "evaluate": "gpu-pool"}
RUNS = ("pools-a", "pools-b")


# -- without a server -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("limited", [True, False])
def test_no_work_pool_is_the_in_process_task(tmp_path, monkeypatch, limited):
    """No work_pool: the flow calls the very Prefect task it always did, with its retry policy, and the GPU tag
    where the server limits it (asking for a slot of an unlimited tag is two round trips per stage for nothing;
    the pool test below runs against a server with the limit)."""
    from prefect import Task
    from grpo_core.config import GRPOConfig
    from tasks import stage
    from tasks.remote import stage_runner
    from tasks.rollout import rollout
    asked = []
    monkeypatch.setattr(stage, "tag_is_limited", lambda tag: asked.append(tag) or limited)
    cfg = GRPOConfig.model_validate(tiny_config(tmp_path, stages={"rollout": {"retries": 3}}))
    runner = stage_runner(rollout, cfg, "rollout")
    assert isinstance(runner, Task) and runner.fn is rollout.fn
    assert runner.retries == 3 and runner.tags == ({"gpu"} if limited else set()) and asked == ["gpu"]


def test_work_pool_without_prefect_server_is_one_clear_error(tmp_path, grpo_home, capsys, monkeypatch):
    """`grpo train` with a stage on a work pool and no PREFECT_API_URL: exit 2, one `error:` line naming the
    field and the fix, nothing written under runs/."""
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from flows.cli.main import main
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tmp_path, pipeline_iterations=1)))
    with temporary_settings({PREFECT_API_URL: None}):
        code = main(["train", "--config", str(config), "--output-dir", str(tmp_path / "runs"),
                     "--set", "stages.score.work_pool=cpu-pool"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: stages on work pools (stages.score.work_pool=cpu-pool) need a Prefect server")
    assert "PREFECT_API_URL" in err[0] and "prefect server start" in err[0]
    assert not (tmp_path / "runs").exists()


# -- against a real server, two pools, two workers ----------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate, timeout: float, what: str, procs: dict[str, subprocess.Popen] | None = None):
    """Poll `predicate` once a second until it returns a truthy value; fail after `timeout` s, or at once
    when one of `procs` exits (its name says which)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for name, proc in (procs or {}).items():
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited ({proc.returncode}) while waiting for {what}")
        if (value := predicate()):
            return value
        time.sleep(1)
    raise AssertionError(f"no {what} after {timeout:.0f} s")


def _healthy(api: str) -> bool:
    try:
        urllib.request.urlopen(api + "/health", timeout=2)
        return True
    except OSError:
        return False


def _start(argv: list[str], log: Path, env: dict, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(argv, env=env, cwd=cwd, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        stop_process_group(proc)


def _stage_flow_runs(client) -> list:
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    return client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["grpo-stage"])), limit=200)


def _task_runs(client, flow_run_ids: list, **task_filter) -> list:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, TaskRunFilter
    return client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=flow_run_ids)),
                                 task_run_filter=TaskRunFilter(**task_filter), limit=200)


def _assert_logged_to_the_runs_mlflow(output_dir: Path) -> None:
    """The workers' update and evaluate stages logged into the run's own MLflow store (the caller's)."""
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=f"sqlite:///{output_dir / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("grpo-pipeline").experiment_id])
    assert run.info.status == "FINISHED"
    assert {m.step for m in client.get_metric_history(run.info.run_id, "eval/greedy/pass_at_1")} == {0, 1}
    assert client.get_metric_history(run.info.run_id, "train/loss")
    assert [a.path for a in client.list_artifacts(run.info.run_id, "adapters")] == ["adapters/iter-1"]


def _tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_stages_run_on_their_pools_and_share_one_gpu_slot(tmp_path, tiny_model_dir):
    import shutil
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName, TaskRunFilterTags
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from grpo_core.config import ConfigError, GRPOConfig
    from tasks.remote import check_work_pools

    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    home = tmp_path / "grpo_home"
    shutil.copytree(tiny_model_dir, home / "models" / "tiny-random")
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": api,
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "GRPO_HOME": str(home), "PYTHONPATH": str(REPO),
           "PREFECT_WORKER_QUERY_SECONDS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           # a stage refused the GPU slot asks again after 1 s (the server's default, 10 s, is idle time here)
           "PREFECT_SERVER_TASKS_TAG_CONCURRENCY_SLOT_WAIT_SECONDS": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    stages = {name: {"retries": 0, "work_pool": pool} for name, pool in POOLS.items()}
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump({
        "model": "tiny-random", "pipeline_iterations": 1, "num_generations": 4, "max_completion_length": 8,
        "data": {"prompts_per_iteration": 2, "eval_size": 4}, "eval": {"num_samples": 1}, "stages": stages}))
    procs: dict[str, subprocess.Popen] = {}
    try:
        # 1) the server, then its pools, the `gpu` tag limit and one worker per pool
        procs["server"] = _start([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                                 tmp_path / "server.log", env, tmp_path)
        t0 = time.time()
        _wait(lambda: _healthy(api), 180, "healthy Prefect server", procs)
        print(f"\nserver healthy after {time.time() - t0:.0f} s")
        with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
            cfg = GRPOConfig.model_validate(yaml.safe_load(config.read_text()))
            with pytest.raises(ConfigError) as missing:
                check_work_pools(cfg)
            assert str(missing.value).startswith("stages.rollout.work_pool, stages.score.work_pool, stages.update."
                                                 "work_pool, stages.evaluate.work_pool: no work pool 'cpu-pool', "
                                                 "'gpu-pool' on the Prefect server")
            assert "`prefect work-pool create cpu-pool --type process`; `prefect work-pool create gpu-pool" in \
                str(missing.value)
            for pool in ("cpu-pool", "gpu-pool"):
                client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
            client.create_concurrency_limit(tag="gpu", concurrency_limit=1)   # `prefect concurrency-limit create gpu 1`
            check_work_pools(cfg)
            for pool in ("cpu-pool", "gpu-pool"):
                procs[f"worker {pool}"] = _start([str(BIN / "prefect"), "worker", "start", "--pool", pool],
                                                 tmp_path / f"worker-{pool}.log", env, tmp_path)

            # 2) two runs started together while the GPU slot is taken: both reach their first GPU stage
            #    (evaluate of iteration 0) on gpu-pool and wait there; freed, the server hands the slot out one
            #    stage at a time
            # the slot is taken through this client, not prefect.concurrency's process-wide service, which keeps
            # the API of whichever server first used `tag:gpu` in this pytest process
            held_slot = client.increment_concurrency_slots_with_lease(
                names=["tag:gpu"], slots=1, mode="concurrency", lease_duration=900).json()
            assert [limit["name"] for limit in held_slot["limits"]] == ["tag:gpu"], held_slot
            try:
                t_start = datetime.now(timezone.utc)
                for run in RUNS:
                    procs[f"run {run}"] = _start(
                        [str(BIN / "grpo"), "train", "--config", str(config), "--run-name", run,
                         "--output-dir", str(tmp_path / f"runs-{run}")], tmp_path / f"run-{run}.log", env, tmp_path)
                waiting = lambda: [fr for fr in _stage_flow_runs(client) if fr.state.is_running()]
                blocked = _wait(lambda: len(waiting()) == 2 and waiting(), 420,
                                "two evaluate stages running on gpu-pool", procs)
                assert {fr.name for fr in blocked} == {f"{run}/iter-0/evaluate" for run in RUNS}
                blocked_ids = [fr.id for fr in blocked]
                _wait(lambda: len(_task_runs(client, blocked_ids)) == 2, 60, "their evaluate task runs", procs)
                time.sleep(3)
                held = _task_runs(client, blocked_ids)
                assert all(tr.state.is_pending() and not tr.start_time for tr in held), \
                    f"a GPU stage started while the slot was taken: {[(tr.name, tr.state) for tr in held]}"
                t_release = datetime.now(timezone.utc)
            finally:
                client.release_concurrency_slots_with_lease(held_slot["lease_id"])

            for run in RUNS:
                proc = procs[f"run {run}"]
                _wait(lambda: proc.poll() is not None, 600, f"run {run} finished",
                      {k: p for k, p in procs.items() if not k.startswith("run")})
                assert proc.returncode == 0, _tail(tmp_path / f"run-{run}.log")
                assert (tmp_path / f"runs-{run}" / run / "summary.json").exists()
                _assert_logged_to_the_runs_mlflow(tmp_path / f"runs-{run}")

            # 3) each stage ran on the pool it was sent to: one flow run of grpo-stage/<pool> per stage call,
            #    holding that stage's task run; curate (no pool) ran inside the training runs' own flows
            stage_runs = _stage_flow_runs(client)
            assert all(fr.state.is_completed() for fr in stage_runs)
            ids = [fr.id for fr in stage_runs]       # task-run states reach the server as events: let them land
            _wait(lambda: all(tr.state.is_completed() for tr in _task_runs(client, ids)), 60, "task runs recorded")
            expected = {f"{run}/iter-{k}/{name}" for run in RUNS for k, name in
                        [(0, "evaluate"), (1, "rollout"), (1, "score"), (1, "update"), (1, "evaluate")]}
            assert sorted(fr.name for fr in stage_runs) == sorted(expected)
            for fr in stage_runs:
                name = fr.parameters["stage"]
                assert (fr.work_pool_name, fr.work_queue_name) == (POOLS[name], "default"), fr.name
                (task_run,) = _task_runs(client, [fr.id])
                assert task_run.name.startswith(name) and task_run.state.is_completed()
                assert ("gpu" in task_run.tags) == (name in accelerator_stages()), (fr.name, task_run.tags)
            curated = client.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_="curate")))
            # at least one completed curate per run (a third record was seen once, cause not yet known)
            assert sum(tr.state.is_completed() for tr in curated) >= 2, [(tr.name, tr.state.type) for tr in curated]
            parents = {tr.flow_run_id for tr in curated}
            assert all(client.read_flow_run(i).deployment_id is None for i in parents)   # the runs' own flows

            # 4) the server kept the GPU stages apart: across both runs, each started after the previous ended
            gpu = _task_runs(client, [fr.id for fr in stage_runs], tags=TaskRunFilterTags(all_=["gpu"]))
            assert len(gpu) == 8
            gpu.sort(key=lambda tr: tr.start_time)
            for before, after in zip(gpu, gpu[1:]):
                assert after.start_time >= before.end_time, f"{before.name} and {after.name} overlap"
            # the two evaluate stages that waited: neither started before the release; the first GPU stage after
            # it is one of them (nothing else was in flight), the other started only once that one had ended.
            # Waiters are not served in order (each retries on its own clock), so a stage of the first run's next
            # iteration may take the slot between them.
            first = gpu[0]
            assert first.flow_run_id in blocked_ids
            (second,) = [tr for tr in gpu if tr.flow_run_id in blocked_ids and tr.id != first.id]
            assert t_release <= first.start_time and second.start_time >= first.end_time
            runs_overlap = max(fr.start_time for fr in stage_runs if fr.name.endswith("iter-0/evaluate")) < \
                min(fr.end_time for fr in stage_runs if fr.name.endswith("iter-1/evaluate"))
            assert runs_overlap                     # the two runs were in flight together throughout
            busy = sum((tr.end_time - tr.start_time).total_seconds() for tr in gpu)
            # 5) the same command again: every stage is complete, none is sent to a pool
            rerun = subprocess.run([str(BIN / "grpo"), "train", "--config", str(config), "--run-name", RUNS[0],
                                    "--output-dir", str(tmp_path / f"runs-{RUNS[0]}")], env=env, cwd=tmp_path,
                                   capture_output=True, text=True, timeout=300)
            assert rerun.returncode == 0, (rerun.stdout + rerun.stderr)[-3000:]
            assert len(_stage_flow_runs(client)) == len(stage_runs)
            print(f"two runs: {(gpu[-1].end_time - t_start).total_seconds():.0f} s from start to the last GPU stage; "
                  f"{len(gpu)} GPU stages one at a time ({busy:.1f} s busy), second evaluate waited "
                  f"{(second.start_time - t_release).total_seconds():.1f} s after the release")
    finally:
        for name in reversed(list(procs)):
            _stop(procs[name])
