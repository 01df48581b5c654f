"""tasks/registry.py. `init_adapter: previous` falls back to the most recent finished run of the *same task and base model*: the
default experiment (grpo-pipeline) is shared by every task, each with its own registered model and champion."""
from grpo_core.config import GRPOConfig


def _finished_run(c, cfg, base_model: str) -> str:
    from tasks import registry, tracking
    run_id = c.create_run(tracking.experiment_id(cfg), tags={"base_model": base_model}).info.run_id
    c.set_tag(run_id, "registered_model", f"models:/{registry.registered_model_name(cfg)}/1")
    c.set_tag(run_id, "best_adapter_uri", f"runs:/{run_id}/adapters/iter-1")
    c.set_terminated(run_id, "FINISHED")
    return run_id


def test_previous_skips_runs_of_another_task_or_base_model(tmp_path, mlflow_uri, grpo_home):
    from tasks import registry, tracking
    cfgs = [GRPOConfig(output_dir=str(tmp_path / "runs"), tracking={"tracking_uri": mlflow_uri}, data={"max_digits": d})
            for d in (1, 2, 3)]
    one, two, fresh = cfgs
    c = tracking.client(one)
    mine = _finished_run(c, one, one.model)
    _finished_run(c, two, two.model)                       # another task, finished later
    _finished_run(c, one, one.model + "-other")       # this task on another base model, finished later
    assert registry.previous_best_adapter(one) == f"runs:/{mine}/adapters/iter-1"
    assert registry.previous_best_adapter(fresh) is None   # a task's first run starts from the base model


def test_fetching_an_adapter_that_does_not_exist_is_one_line(tmp_path, capsys, monkeypatch):
    """`grpo adapter fetch models:/nope/1` (and an init_adapter naming it): one error line and status 2."""
    from flows.cli.main import main
    # the command sets MLflow's process-wide URIs (as a CLI may): put them back for the tests that follow
    monkeypatch.setattr("mlflow.tracking._tracking_service.utils._tracking_uri", None)
    monkeypatch.setattr("mlflow.tracking._model_registry.utils._registry_uri", None)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    from mlflow.tracking import MlflowClient
    MlflowClient(tracking_uri=uri).search_experiments()     # a store that exists (without one: the store is named)
    for missing in ("models:/nope/1", "models:/nope@champion"):
        assert main(["adapter", "fetch", missing, "--dest", str(tmp_path / "d"), "--tracking-uri", uri]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if "mlflow.store.db" not in line]  # DB setup log
        assert len(err) == 1 and err[0].startswith(f"error: {missing}: no such adapter") and "Fix:" in err[0]
