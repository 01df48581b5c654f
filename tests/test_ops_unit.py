"""Operations logic without an engine: which errors retry, stage keys and the stage decorator, the
test-only fault switch, run status, CLI, compose file structure."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from grpo_core.config import ConfigError, GRPOConfig, StageRetryConfig
from grpo_core.task import TaskValidationError
from grpo_core.io import write_json
from grpo_core.model.loading import ModelError
from tasks import layout, run_state
from tasks.retry import TransientError, is_transient
from tests import faults

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("exc, transient", [
    (OSError("disk hiccup"), True),
    (ConnectionError("reset by peer"), True),
    (TimeoutError(), True),
    (subprocess.TimeoutExpired("cargo", 5), True),
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (TransientError("retry me"), True),
    (FileNotFoundError("no such file"), False),
    (ConfigError("bad field"), False),
    (TaskValidationError("malformed task"), False),
    (ModelError("not a model"), False),
    (ValueError("bad"), False),
    (KeyError("k"), False),
    (RuntimeError("some logic bug"), False),
])
def test_is_transient(exc, transient):
    assert is_transient(exc) is transient


def test_is_transient_follows_cause_but_bad_input_wins():
    try:
        try:
            raise ConnectionError("engine down")
        except ConnectionError as e:
            raise RuntimeError("scoring failed") from e
    except RuntimeError as wrapped:
        assert is_transient(wrapped)
    try:
        try:
            raise OSError("x")
        except OSError as e:
            raise ValueError("malformed row") from e
    except ValueError as wrapped:
        assert not is_transient(wrapped)


def test_docker_errors_classified():
    docker = pytest.importorskip("docker")
    assert is_transient(docker.errors.APIError("500 Server Error"))
    assert not is_transient(docker.errors.ImageNotFound("no image"))


def test_retry_delays_back_off():
    assert StageRetryConfig(retries=3, retry_delay_seconds=1, backoff_factor=2).delays() == [1, 2, 4]
    assert StageRetryConfig(retries=0).delays() == []
    with pytest.raises(ValueError):
        StageRetryConfig(retries=-1)


def test_input_key_ignores_operational_fields():
    a = GRPOConfig(model="tiny-random").model_dump(mode="json")
    b = GRPOConfig(model="tiny-random", output_dir="/elsewhere", run_name="x",
                   stages={"update": {"retries": 5}}, tracking={"experiment_name": "e2"}).model_dump(mode="json")
    c = GRPOConfig(model="tiny-random", learning_rate=1e-3).model_dump(mode="json")
    assert layout.input_key(config=a, x=1) == layout.input_key(config=b, x=1)
    assert layout.input_key(config=a, x=1) != layout.input_key(config=c, x=1)


def test_fault_point_fires_the_configured_number_of_times(tmp_path, monkeypatch):
    f = tmp_path / "faults.json"
    f.write_text(json.dumps([{"point": "rollout", "iteration": 1, "times": 1, "error": "OSError"}]))
    monkeypatch.setenv(faults.FAULT_ENV, str(f))
    faults.fault_point("rollout", 2)           # other iteration: nothing
    faults.fault_point("score", 1)             # other stage: nothing
    with pytest.raises(OSError, match="injected fault"):
        faults.fault_point("rollout", 1)
    faults.fault_point("rollout", 1)           # spent
    assert json.loads(f.read_text())[0]["times"] == 0
    monkeypatch.delenv(faults.FAULT_ENV)
    faults.fault_point("rollout", 1)


def test_stage_decorator_skips_completed_work_and_fault_points_fire_where_named(tmp_path, monkeypatch):
    """The record is the resume point: same key -> body skipped; a changed key input -> body re-runs.
    The fault points sit at "about to work" and "outputs written, record not yet"."""
    from tasks.stage import stage
    calls = []

    @stage("toy", key=lambda config, upstream, **_: {"config": config, "upstream": upstream})
    def toy(config: dict, run_dir: str, iteration: int, upstream: str, note: str) -> dict:
        calls.append(note)
        return {"out": upstream + note}

    config, run = GRPOConfig(model="tiny-random").model_dump(mode="json"), str(tmp_path / "r")
    rec = toy.fn(config, run, 1, "a", "x")
    assert rec["out"] == "ax" and rec["stage"] == "toy" and rec["iteration"] == 1
    assert rec["key"] == layout.input_key(config=config, upstream="a")
    assert toy.fn(config, run, 1, "a", "y") == rec and calls == ["x"]          # not a key input: skipped
    assert toy.fn(config, run, 1, "b", "y")["out"] == "by" and calls == ["x", "y"]

    f = tmp_path / "faults.json"
    f.write_text(json.dumps([{"point": "toy", "iteration": 2, "error": "ValueError"},
                             {"point": "toy:saved", "iteration": 3, "error": "OSError"}]))
    monkeypatch.setenv(faults.FAULT_ENV, str(f))
    faults.install(monkeypatch)
    toy.fn(config, run, 1, "b", "z")                                          # complete: no fault point
    with pytest.raises(ValueError, match="injected fault at toy"):
        toy.fn(config, run, 2, "a", "z")
    with pytest.raises(OSError, match="injected fault at toy:saved"):
        toy.fn(config, run, 3, "a", "z")
    assert calls == ["x", "y", "z"]                                           # iteration 3 worked ...
    assert not layout.record_path(run, 3, "toy").exists()                      # ... but left no record


def test_an_unreadable_stage_record_is_run_again_not_a_crash(tmp_path):
    """A record cut short or edited by hand (not JSON, or not an object) marks nothing done: the stage runs again
    and writes it afresh, where the resume died on a JSONDecodeError naming no file, every time."""
    from tasks.stage import stage
    calls = []

    @stage("toy", key=lambda config, **_: {"config": config})
    def toy(config: dict, run_dir: str, iteration: int) -> dict:
        calls.append(iteration)
        return {"out": 1}

    config, run = GRPOConfig(model="tiny-random").model_dump(mode="json"), str(tmp_path / "r")
    rec = toy.fn(config, run, 1)
    path = layout.record_path(run, 1, "toy")
    for broken in (path.read_text()[:20], "[1, 2]"):
        path.write_text(broken)
        with pytest.warns(UserWarning, match=f"{path}: unreadable stage record"):
            assert toy.fn(config, run, 1) == rec
        assert json.loads(path.read_text()) == rec
    assert calls == [1, 1, 1]


def test_an_unreadable_run_json_is_named_and_hides_no_other_run(tmp_path):
    """`grpo runs` lists every run when one run.json is cut short (it crashed on it); reading that run's state
    (a resume) is one InputError naming the file and the fix."""
    from flows.cli.ops import list_runs
    from grpo_core.io import InputError
    for name in ("good", "cut"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.yaml").write_text("pipeline_iterations: 1\n")
        run_state.update_run_state(tmp_path / name, status="finished", mlflow_run_id="abc")
    (tmp_path / "cut" / "run.json").write_text('{"status": "fini')
    for name, text in (("yaml-cut", "pipeline_iterations: [2\n"), ("yaml-list", "- a\n")):   # config.yaml too
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.yaml").write_text(text)
    rows = {r["run"]: r for r in list_runs(tmp_path)}
    assert rows["yaml-cut"]["iterations"] == rows["yaml-list"]["iterations"] == "0/?"
    assert rows["good"]["status"] == "finished"
    assert rows["cut"]["status"] == "unreadable" and str(tmp_path / "cut" / "run.json") in rows["cut"]["error"]
    with pytest.raises(InputError, match="run.json: not a JSON object .*Fix:"):
        run_state.read_run_state(tmp_path / "cut")
    from flows.cli.ops import compare_runs
    with pytest.raises(InputError, match="cut/run.json: not a JSON object"):      # was a JSONDecodeError
        compare_runs([str(tmp_path / "cut")])


def test_run_status_and_last_stage(tmp_path):
    run = tmp_path / "r"
    (run / "iter-0").mkdir(parents=True)
    (run / "config.yaml").write_text("pipeline_iterations: 3\n")
    assert run_state.run_status(run)["status"] == "created"
    write_json(run / "iter-0" / "evaluate.json", {})
    for st in ("curate", "rollout", "score"):
        layout.finish_stage(run, 1, st, "k", {})
    run_state.update_run_state(run, status="running", pid=2 ** 22 + 12345, host=__import__("socket").gethostname(),
                               mlflow_run_id="abc")
    st = run_state.run_status(run)
    assert st["status"] == "killed"            # "running" but its process is gone
    assert st["last_completed"] == "iter-1/score"
    assert st["iterations"] == "0/3"
    assert st["mlflow_run_id"] == "abc"


def test_same_config_check(tmp_path):
    from tasks.run import check_same_config
    cfg = GRPOConfig(model="tiny-random", run_name="r", output_dir=str(tmp_path))
    run = tmp_path / "r"
    run.mkdir()
    (run / "config.yaml").write_text(cfg.to_yaml())
    check_same_config(GRPOConfig(model="tiny-random", run_name="r", output_dir=str(tmp_path),
                                  stages={"rollout": {"retries": 4}}), run)       # operational: fine
    with pytest.raises(ConfigError, match="learning_rate"):
        check_same_config(GRPOConfig(model="tiny-random", run_name="r", output_dir=str(tmp_path),
                                      learning_rate=1.0), run)


def test_a_run_config_edited_after_the_start_is_refused_on_resume(tmp_path, capsys):
    """`grpo resume` reads the run's own config.yaml: edited by hand (learning_rate) after the run started, the
    resume re-ran every stage with the new value under the same run name and MLflow run (whose params still said
    the old one). It is refused now, naming the field and the fix; an operational edit still resumes."""
    from flows.cli.main import main
    from tasks.run import check_same_config, remember_started_config
    cfg = GRPOConfig(model="tiny-random", run_name="r", output_dir=str(tmp_path))
    run = tmp_path / "r"
    run.mkdir()
    (run / "config.yaml").write_text(cfg.to_yaml())
    remember_started_config(cfg.model_dump(mode="json"), run)
    ops_edit = GRPOConfig(model="tiny-random", run_name="r", output_dir=str(tmp_path),
                          stages={"rollout": {"retries": 4}})
    (run / "config.yaml").write_text(ops_edit.to_yaml())
    check_same_config(ops_edit, run)                                    # operational: fine
    (run / "config.yaml").write_text(cfg.to_yaml().replace("learning_rate: 0.0002", "learning_rate: 0.5"))
    assert main(["resume", "r", "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"error: {run / 'config.yaml'} was edited since run 'r' started (learning_rate: 0.0002 -> 0.5)" in err
    assert "Fix:" in err
    (run / "config.yaml").write_text(cfg.to_yaml() + "seed: 7\n")             # a key given twice: one clear line
    with pytest.raises(ConfigError, match=r"the run's config .*config.yaml': line \d+, column 1: duplicate key 'seed'"):
        check_same_config(cfg, run)


def test_invalid_config_fails_fast_with_nothing_written(tmp_path):
    """`grpo train` with an invalid field: exit 2, a message naming the field, no run directory."""
    from flows.cli.main import main
    out = tmp_path / "runs"
    rc = main(["train", "--set", "model=tiny-random", "--set", "learning_rate=-1", "--output-dir", str(out),
               "--run-name", "bad"])
    assert rc == 2
    assert not out.exists()
    with pytest.raises(ConfigError, match="stages.update.retries"):
        from grpo_core.config import load_config
        load_config(None, ["stages.update.retries=-3"])


def test_ops_parser():
    from flows.cli.main import build_parser
    p = build_parser()
    a = p.parse_args(["schedule", "--cron", "0 3 * * *", "--config", "x.yaml", "--init-from-previous"])
    assert a.cron == "0 3 * * *" and a.init_from_previous and a.work_pool is None and a.action == "start"
    a = p.parse_args(["schedule", "--interval", "90s", "--config", "x.yaml"])
    assert a.interval == "90s" and a.cron is None
    a = p.parse_args(["schedule", "pause", "every-6h"])
    assert (a.action, a.target) == ("pause", "every-6h")
    assert p.parse_args(["schedule", "list", "--json"]).json
    with pytest.raises(SystemExit):                                   # one of --cron / --interval, not both
        p.parse_args(["schedule", "--cron", "0 3 * * *", "--interval", "1h", "--config", "x.yaml"])
    a = p.parse_args(["compare", "r1", "r2", "--csv"])
    assert a.csv and not a.json
    a = p.parse_args(["compare", "r1", "r2", "--png", "o.png"])
    assert a.runs == ["r1", "r2"] and a.png == "o.png"
    a = p.parse_args(["resume", "r1", "--set", "stages.update.retries=3"])
    assert a.run == "r1" and a.set == ["stages.update.retries=3"]
    assert p.parse_args(["runs"]).output_dir == "runs"


def test_schedule_deployment_object(tmp_path):
    """The scheduled deployment: cron or interval schedule, at most one run at a time, no run name (each run
    its own), absolute output dir."""
    from datetime import timedelta
    from flows.schedule import make_schedule, to_deployment
    cfg = GRPOConfig(model="tiny-random", run_name="fixed", output_dir="rel/runs")
    dep = to_deployment(cfg, make_schedule(cron="0 3 * * *"), name="nightly", init_from_previous=True)
    assert dep.name == "nightly"
    assert dep.schedules[0].schedule.cron == "0 3 * * *"
    assert dep.concurrency_limit == 1
    conf = dep.parameters["config"]
    assert conf["run_name"] is None and Path(conf["output_dir"]).is_absolute()
    assert conf["init_adapter"] == "previous"
    dep = to_deployment(cfg, make_schedule(interval="1h30m"), name="often")
    assert dep.schedules[0].schedule.interval == timedelta(hours=1, minutes=30)


@pytest.mark.parametrize("text, seconds", [("90s", 90), ("15m", 900), ("6h", 21600), ("1d", 86400),
                                           ("1h30m", 5400), (" 2M ", 120)])
def test_interval_durations(text, seconds):
    from flows.schedule import parse_interval
    assert parse_interval(text).total_seconds() == seconds


@pytest.mark.parametrize("text", ["", "90", "1.5h", "h", "0s", "1w", "every hour", "99999999999d"])
def test_a_bad_interval_names_the_option_and_the_form(text):
    from flows.schedule import parse_interval
    with pytest.raises(ConfigError, match=r"--interval .* e\.g\. 90s"):
        parse_interval(text)


@pytest.mark.parametrize("kwargs, says", [
    ({"cron": "0 3 * *"}, r"--cron '0 3 \* \*' is not a cron expression; write five fields"),
    ({"cron": "61 * * * *"}, r"--cron '61 \* \* \* \*' is not a cron expression"),
    ({"cron": "0 3 * * * *"}, r"--cron '0 3 \* \* \* \*' is not a cron expression; write five fields"),  # 6th: seconds
    ({"interval": "6h", "timezone": "Mars/Olympus"}, r"--timezone 'Mars/Olympus' is not a time zone; use an IANA"),
])
def test_a_bad_cron_or_timezone_names_the_option_and_the_form(kwargs, says):
    from flows.schedule import make_schedule
    with pytest.raises(ConfigError, match=says):
        make_schedule(**kwargs)


def test_a_schedule_needs_exactly_one_of_cron_and_interval():
    from flows.schedule import make_schedule
    for kwargs in ({}, {"cron": "0 3 * * *", "interval": "1h"}):
        with pytest.raises(ConfigError, match="exactly one of --cron"):
            make_schedule(**kwargs)


def test_compare_prints_the_differences_of_two_runs_as_table_csv_and_json(tmp_path, capsys):
    """Two MLflow runs (SQLite) with different configs and metrics: the config difference and the metrics side
    by side, in each output form, read back."""
    import csv
    import io
    import mlflow
    from flows.cli.main import main
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("cmp")
    ids = []
    for name, lr, acc in (("lr-low", "1e-05", 0.25), ("lr-high", "0.0002", 0.5)):
        with mlflow.start_run(run_name=name) as run:
            mlflow.log_params({"learning_rate": lr, "beta": "0.04", "run_name": name})
            mlflow.log_metric("eval/greedy/pass_at_1", 0.1, step=0)
            mlflow.log_metric("eval/greedy/pass_at_1", acc, step=2)
            ids.append(run.info.run_id)
    mlflow.set_tracking_uri(None)
    base = ["compare", *ids, "--tracking-uri", uri, "--metrics", "eval/"]
    assert main(base) == 0
    table = capsys.readouterr().out
    assert "learning_rate" in table and "beta" not in table and "0.25" in table and "0.5" in table
    assert main([*base, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["labels"] == ["lr-low", "lr-high"] and got["statuses"] == ["FINISHED", "FINISHED"]
    assert got["config_diff"] == {"learning_rate": ["1e-05", "0.0002"]}      # run_name is not a difference
    assert got["final_metrics"] == {"eval/greedy/pass_at_1": [0.25, 0.5]}
    assert main([*base, "--csv"]) == 0
    rows = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    assert rows[0] == ["section", "name", "lr-low", "lr-high"]
    assert ["config", "learning_rate", "1e-05", "0.0002"] in rows
    assert ["metric", "eval/greedy/pass_at_1", "0.25", "0.5"] in rows


def test_read_only_commands_create_no_tracking_store(tmp_path, monkeypatch, capsys):
    """compare, eval --run, adapter fetch and gate show where nothing has logged yet: each created the SQLite store
    (runs/mlflow.db, or MLflow's own ./mlflow.db) to answer "not found"; now the error names what is missing and how
    to list the runs, and nothing is written (gate show: no gate set)."""
    from flows.cli.main import main
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for argv, missing in ((["compare", "nosuch", "other"], "no run directory or MLflow run 'nosuch'"),
                          (["eval", "--run", "abc123"], "no MLflow run 'abc123'"),
                          (["adapter", "fetch", "models:/foo@champion", "--dest", "d"],
                           "no adapter models:/foo@champion")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {missing}: there is no MLflow tracking store at "
                                                   f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"), err
        assert "grpo runs --output-dir DIR" in err[0] and "--tracking-uri" in err[0]
    assert main(["gate", "show", "--config", str(REPO / "configs" / "tiny.yaml")]) == 0
    assert "no gate set yet" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.rglob("*")) == [], "a read-only command wrote here"


def test_compare_names_a_missing_run_in_an_existing_store(tmp_path, capsys):
    """A store that exists but holds no such run: the run is named, with how to list runs."""
    from flows.cli.main import main
    from mlflow.tracking import MlflowClient
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(tracking_uri=uri).search_experiments()          # creates the store
    assert main(["compare", "nosuch", "--tracking-uri", uri]) == 2
    err = capsys.readouterr().err
    assert "error: no run directory or MLflow run 'nosuch' (no run with that id or name in" in err
    assert "grpo runs --output-dir DIR" in err


def test_adapter_fetch_defaults_to_the_store_grpo_train_logs_to(tmp_path, monkeypatch, capsys):
    """`grpo adapter fetch` with neither --tracking-uri nor MLFLOW_TRACKING_URI reads runs/mlflow.db, where a
    `grpo train` with defaults logs (it read MLflow's own default, ./mlflow.db, and never found the adapter); a
    fetch that finds nothing leaves no --dest directory."""
    from flows.cli.main import main
    monkeypatch.setattr("mlflow.tracking._tracking_service.utils._tracking_uri", None)
    monkeypatch.setattr("mlflow.tracking._model_registry.utils._registry_uri", None)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "runs").mkdir()
    from mlflow.tracking import MlflowClient
    MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}").search_experiments()
    assert main(["adapter", "fetch", "models:/nope@champion", "--dest", "d"]) == 2
    err = capsys.readouterr().err
    assert f"no such adapter in MLflow at sqlite:///{tmp_path / 'runs' / 'mlflow.db'}" in err
    assert not (tmp_path / "d").exists() and not (tmp_path / "mlflow.db").exists()


def test_load_adapter_reads_the_store_grpo_train_logs_to(tmp_path, monkeypatch):
    """The call `grpo train` prints (`Load it with: load_adapter(...)`), made without tracking= and without
    MLFLOW_TRACKING_URI, reads runs/mlflow.db as the run logged (it read MLflow's default ./mlflow.db, creating it
    to say "not found"); where that store is missing it says so and writes nothing."""
    from tasks.registry import load_adapter
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ConfigError, match=f"no adapter models:/m@champion: there is no MLflow tracking store at "
                                          f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"):
        load_adapter("models:/m@champion")
    assert list(tmp_path.iterdir()) == []


def test_a_schedule_name_taken_by_another_config_is_not_replaced_in_silence(prefect_engine, tmp_path, capsys):
    """`grpo schedule --name NAME` where NAME is already on the server with another config or schedule replaced it
    without a word (a process serving NAME then ran the new config); now refused naming it and the fix. The same
    command again still goes through."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from flows.cli.main import main
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name="clash-pool", type="process"))
    start = ["schedule", "--config", str(REPO / "configs" / "tiny.yaml"), "--set", f"output_dir={tmp_path}",
             "--work-pool", "clash-pool", "--name", "clash"]
    assert main([*start, "--interval", "6h"]) == 0
    assert main([*start, "--interval", "6h"]) == 0                               # the same: fine
    with get_client(sync_client=True) as client:      # stored by an older version: without a field added since
        from prefect.client.schemas.actions import DeploymentUpdate
        there = client.read_deployment_by_name("grpo-training-run/clash")
        older = {"config": {k: v for k, v in there.parameters["config"].items() if k != "rollout_timeout"}}
        client.update_deployment(there.id, DeploymentUpdate(parameters=older))
    assert main([*start, "--interval", "6h"]) == 0                               # still the same command
    capsys.readouterr()
    for other, what in ((["--interval", "6h", "--set", "learning_rate=0.5"], "config"),
                        (["--interval", "1h"], "schedule"),
                        (["--interval", "6h", "--timezone", "America/New_York"], "schedule")):
        assert main([*start, *other]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"error: a schedule named 'clash' is already on the server with another {what} (every 6:00:00 "
                       f"UTC, clash-pool); give this one another --name, or replace it: grpo schedule delete clash, "
                       f"then this command again"], err


def test_schedule_refuses_without_server(monkeypatch):
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from flows.schedule import check_server
    with temporary_settings({PREFECT_API_URL: None}):
        with pytest.raises(ConfigError, match="Prefect server"):
            check_server()


COMPOSE = REPO / "infra" / "docker-compose.yml"


def test_compose_file_structure():
    """Parsed and checked here; `docker compose config` runs too when the compose plugin exists."""
    spec = yaml.safe_load(COMPOSE.read_text())
    svc = spec["services"]
    assert {"postgres", "prefect-server", "mlflow", "worker"} <= set(svc)
    assert "postgresql" in " ".join(map(str, svc["mlflow"]["command"]))          # a real DB backend
    assert "--artifacts-destination" in " ".join(map(str, svc["mlflow"]["command"]))
    assert "PREFECT_API_DATABASE_CONNECTION_URL" in svc["prefect-server"]["environment"]
    env = svc["worker"]["environment"]
    assert env["PREFECT_API_URL"].startswith("http://prefect-server:4200")
    assert env["MLFLOW_TRACKING_URI"].startswith("http://mlflow:")
    assert (REPO / "infra" / svc["worker"]["build"]["dockerfile"]).exists() or \
        (COMPOSE.parent / svc["worker"]["build"]["context"] / svc["worker"]["build"]["dockerfile"]).exists()
    for name, s in svc.items():
        for dep in s.get("depends_on", {}):
            assert dep in svc, f"{name} depends on unknown service {dep}"
    for vol in (v.split(":")[0] for s in svc.values() for v in s.get("volumes", []) if isinstance(v, str)):
        assert vol.startswith((".", "/")) or vol in spec.get("volumes", {}), vol
    assert "concurrency-limit create gpu 1" in " ".join(map(str, svc["worker"]["command"]))


def test_compose_config_with_docker_plugin():
    """`docker compose config` (v2 plugin) or `docker-compose config` (v1) validates the file."""
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]) and subprocess.run([*cmd, "version"], capture_output=True).returncode == 0:
            # The file requires the password `grpo infra up` generates (no default); any value validates it.
            r = subprocess.run([*cmd, "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True,
                               env={**os.environ, "POSTGRES_PASSWORD": "validate-only"})
            assert r.returncode == 0, r.stderr
            return
    pytest.skip("neither `docker compose` nor `docker-compose` installed (the structure test covers the file)")


def test_registered_adapter_line_names_aliases_and_the_call_that_loads_it():
    from flows.cli.format import format_registered
    reg = {"name": "grpo-adapter", "version": "3", "uri": "models:/grpo-adapter/3",
           "aliases": ["run-exp1", "champion"]}
    assert format_registered(reg) == ('models:/grpo-adapter/3 (aliases: run-exp1, champion)\n'
                                      'Load it with:    load_adapter("models:/grpo-adapter@champion")')
    assert format_registered(reg, "sqlite:////w/runs/mlflow.db").endswith(   # the run's store: the call's default
        'load_adapter("models:/grpo-adapter@champion", tracking="sqlite:////w/runs/mlflow.db")')   # may be another
    assert format_registered({**reg, "aliases": []}) == "models:/grpo-adapter/3"
    assert format_registered(None) is None
