"""The training-run flow: evaluate the base model, then N iterations of the registered stages
(grpo_core/stages.py: curate -> rollout -> score -> update -> evaluate), each stage a retryable Prefect task
(run in this process, or on the work pool `stages.<name>.work_pool` names: tasks/remote.py)."""
from __future__ import annotations

import time
from pathlib import Path

from prefect import flow
from prefect.runtime import deployment, flow_run

from grpo_core.model import loading as models

from grpo_core import stages
from grpo_core.config import GRPOConfig
from grpo_core.data import iteration as data_iteration
from grpo_core.io import atomic_write_text, check_writable, read_json, write_json
from grpo_core.kernels import settings as kernel_settings
from tasks import gate, monitoring, remote, run as run_steps, tracking
from tasks.run_state import (check_not_running, claim_run, mark_ended_by, mark_running, mark_stopped, release_run,
                             suspect_reasons, update_run_state)
from tasks.splits import curated_cache
from tasks.data_logging import fetch_parent_questions


# The temporary Prefect server a run starts when no PREFECT_API_URL is set records task runs from their events one
# database write at a time; back-to-back task runs then waited seconds for it (a resume skipped each finished
# iteration several times slower; docs/speed.md). In batches (written every 5 s, when 50 have come, and at shutdown)
# they do not. A server the user runs keeps its own settings, and so does a value set in the environment.
RECORDER_BATCH = "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE"


def engine_settings():
    """Settings for the temporary server a command may start (see RECORDER_BATCH)."""
    import contextlib
    import os
    from prefect.settings import PREFECT_API_URL, temporary_settings
    if PREFECT_API_URL.value() or os.environ.get(RECORDER_BATCH):
        return contextlib.nullcontext()
    return temporary_settings(updates={"server.services.task_run_recorder.batch_size": 50})


_subflow_settings: list = [None, None]         # [the settings they were derived from, the subflow's settings]


def subflow_settings():
    """Settings for a subflow that runs in this flow's process: no heartbeat thread of its own (this flow's
    heartbeats already say the process is alive), since stopping one waits up to a second of its sleep.
    Derived once per settings object (a derivation re-reads the environment, which is slow)."""
    import prefect.context
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY
    context = prefect.context.get_settings_context()
    if _subflow_settings[0] is not context.settings:
        _subflow_settings[:] = [context.settings, context.settings.copy_with_update(
            updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})]
    return prefect.context.SettingsContext(profile=context.profile, settings=_subflow_settings[1])


def run_dir_of(cfg: GRPOConfig) -> Path:
    return Path(cfg.output_dir) / cfg.run_name


# A dynamic-sampling round repeats these stages with fresh prompts; the flow merges the rounds once they have run.
DYNAMIC_ROUND = ("curate", "rollout", "score")


def _run_stage(spec: stages.Stage, cfg: GRPOConfig, config: dict, run_dir: str, iteration: int,
               upstream: dict) -> dict:
    """Run one registered stage, its inputs looked up in `upstream` ("checkpoint", "state", "<stage>.<field>")."""
    def lookup(source: str):
        name, _, field = source.partition(".")
        return upstream[name][field] if field else upstream[name]
    arguments = {parameter: lookup(source) for parameter, source in spec.inputs.items()}
    return remote.registered_runner(spec.name, cfg)(config, run_dir, iteration, **arguments)


def _dynamic_sampling(cfg: GRPOConfig, config: dict, run_dir: str, iteration: int,
                      upstream: dict) -> tuple[str, str, dict]:
    """DAPO dynamic sampling: while fewer than data.prompts_per_iteration groups have mixed raw correctness,
    run up to max_extra_rollouts extra curate -> rollout -> score rounds (fresh prompts, fresh seed) in
    iter-<k>/dynamic-<r>/, then merge the informative groups into iter-<k>/{samples,scores}.dynamic.jsonl.
    Each round is made of the ordinary stage tasks, so it is retried and resumed like them."""
    from grpo_core.update import dynamic_sampling as dsamp
    from grpo_core.io import read_jsonl
    target = cfg.data.prompts_per_iteration
    rounds = [(list(read_jsonl(upstream["rollout"]["samples"])), list(read_jsonl(upstream["score"]["scores"])))]
    informative = dsamp.count_informative(rounds)
    it_dir = Path(run_dir) / f"iter-{iteration}"
    for r in range(1, cfg.max_extra_rollouts + 1):
        if informative >= target:
            break
        round_dir = it_dir / f"dynamic-{r}"
        round_dir.mkdir(parents=True, exist_ok=True)
        if not (round_dir / "data").exists() and (Path(run_dir) / "data").exists():
            (round_dir / "data").symlink_to((Path(run_dir) / "data").resolve(), target_is_directory=True)
        round_config = {**config, "seed": dsamp.extra_round_seed(cfg.seed, iteration, r)}
        done = {"checkpoint": upstream["checkpoint"], "state": upstream["state"]}
        for name in DYNAMIC_ROUND:
            done[name] = _run_stage(stages.named(name), cfg, round_config, str(round_dir), iteration, done)
        rounds.append((list(read_jsonl(done["rollout"]["samples"])), list(read_jsonl(done["score"]["scores"]))))
        informative = dsamp.count_informative(rounds)           # each task once, as the merge keeps them
    return run_steps.merge_dynamic_rounds(cfg, run_dir, iteration, rounds)


@flow(name="grpo-iteration")
def iteration_flow(config: dict, run_dir: str, iteration: int, checkpoint: str | None, state: str | None) -> dict:
    """One iteration: the registered stages in order (grpo_core/stages.py), each when due; returns their records
    (paths and metrics) by stage name (None for a stage that did not run), and the dynamic-sampling summary."""
    cfg = GRPOConfig.model_validate(config)
    upstream = {"checkpoint": checkpoint, "state": state}      # what the next stage reads: inputs, then records
    records, dynamic_sampling = dict.fromkeys(stages.names()), None
    for spec in stages.STAGES:
        if spec.when is None or spec.when(cfg, iteration):
            records[spec.name] = upstream[spec.name] = _run_stage(spec, cfg, config, run_dir, iteration, upstream)
            if spec.moves_checkpoint:               # e.g. the warm start: later stages go on from its adapter
                upstream["checkpoint"] = records[spec.name]["checkpoint"]
        if spec.name == DYNAMIC_ROUND[-1] and cfg.dynamic_sampling:    # later stages read the merged rounds
            samples, scores, dynamic_sampling = _dynamic_sampling(cfg, config, run_dir, iteration, upstream)
            upstream["rollout"] = {**upstream["rollout"], "samples": samples}
            upstream["score"] = {**upstream["score"], "scores": scores}
    return {**records, "dynamic_sampling": dynamic_sampling}


def _default_run_name() -> str:
    """Scheduled/deployed runs get a name from their flow run, stable across `prefect flow-run retry`."""
    name = flow_run.get_name()
    start = flow_run.get_scheduled_start_time()
    stamp = start.strftime("%Y%m%d-%H%M%S") if start else time.strftime("%Y%m%d-%H%M%S")
    return f"run-{stamp}-{name}" if name else f"run-{stamp}"


def preflight(cfg: GRPOConfig) -> None:
    """What can be checked before the flow starts, checked now (fail in seconds, before the engine starts or
    anything is written under output_dir), each check owned by its module: an existing run of the same name
    has the same config; the device exists; the tracking server answers (and, for an existing run, holds its
    MLflow run); the model directory is complete and
    has the LoRA target modules; a local init_adapter fits it; data.curated yields training and held-out tasks;
    the sandbox has its images when code tasks run on backend docker; stages sent to work pools have a Prefect
    server with those pools; the task's stored gate set shares no question with the eval split. Reward plugins are imported when the config is validated. Each failure is a
    ConfigError, ModelError or InputError naming the field and the fix. Also: output_dir is writable, and no other
    process is running this run now."""
    if cfg.run_name:
        run_steps.check_same_config(cfg, run_dir_of(cfg))
        check_writable(run_dir_of(cfg), "output_dir")
        check_not_running(run_dir_of(cfg))
    models.select_device(cfg.device)
    tracking.check_reachable(cfg)
    if cfg.run_name:            # a resume reopens the MLflow run that run.json names: it is in this store
        tracking.check_run_in_store(cfg, run_dir_of(cfg))
    model_dir = models.check_model(cfg.model, cfg.lora_target_modules if cfg.use_peft else [])
    models.check_router_aux(cfg.router_aux_loss_coef, model_dir)
    if cfg.init_adapter and cfg.init_adapter != "previous" and ":/" not in cfg.init_adapter:
        models.check_adapter(cfg.init_adapter, model_dir)         # MLflow URIs: checked once downloaded
    kinds = {"math"}                                              # the built-in arithmetic task
    if cfg.data.curated:
        kinds = data_iteration.check_curated(cfg.data.curated, run_dir_of(cfg), curated_cache()) or set()
    cfg.sandbox.check_ready((kinds | set(cfg.tools)) & {"python", "rust"})     # code tasks, and the code tools
    remote.check_work_pools(cfg)
    if cfg.run_name:            # the CLI names every run before this; a stored gate set must not hold eval questions
        gate.check_before_run(cfg, run_dir_of(cfg))


def _stopped(cfg: GRPOConfig, run_dir: Path, run_id: str, checkpoint: str | None, evals: dict) -> dict:
    """End a run a monitor stopped: resumable, nothing registered; the summary says why."""
    reasons = suspect_reasons(run_dir)
    mark_stopped(run_dir, reasons)
    tracking.end_run(cfg, run_id, "KILLED")
    return {"run_dir": str(run_dir), "mlflow_run_id": run_id, "final_checkpoint": checkpoint, "evals": evals,
            "tracking_uri": tracking.tracking_uri(cfg), "registered_model": None, "stopped": reasons}


@flow(name="grpo-training-run")
def training_run(config: dict) -> dict:
    """A whole training run. `config` is a GRPOConfig as a dict. Re-running it with the same run_name (or
    `grpo resume`) continues the run: completed stages are skipped, the same MLflow run is reopened."""
    cfg = GRPOConfig.model_validate(config)
    kernel_settings.apply(cfg.kernels)         # this process's kernel choices, before anything reads them
    if not cfg.run_name:
        cfg.run_name = _default_run_name()
        config = cfg.model_dump(mode="json")
    run_dir = run_dir_of(cfg)
    run_steps.check_same_config(cfg, run_dir)
    remote.check_work_pools(cfg)           # stages on work pools: a server with those pools, before any write
    run_dir.mkdir(parents=True, exist_ok=True)
    claim_run(run_dir)                     # refused while another process runs this run
    try:
        return _training_run(cfg, config, run_dir)
    finally:
        release_run(run_dir)


def _training_run(cfg: GRPOConfig, config: dict, run_dir: Path) -> dict:
    atomic_write_text(run_dir / "config.yaml", cfg.to_yaml())
    mark_running(run_dir, flow_run.get_id())
    run_steps.remember_started_config(config, run_dir)
    if (schedule := deployment.get_name()):            # started by a schedule (grpo schedule): `grpo runs` shows it
        update_run_state(run_dir, schedule=schedule)
    try:
        run_id = tracking.start_or_resume_run(cfg, run_dir, flow_run.get_id())
    except BaseException as e:      # e.g. the tracking server is down: say so in `grpo runs`
        update_run_state(run_dir, status="failed", error=f"MLflow: {type(e).__name__}: {e}"[:500])
        raise
    evals, checkpoint, state, registered = {}, None, None, None
    try:
        checkpoint = run_steps.init_checkpoint(cfg, run_dir, run_id)
        gate.prepare_gate_set(cfg, run_dir, run_id)     # the task's gate questions: kept out of training
        fetch_parent_questions(cfg, run_dir, read_json(run_dir / "run.json").get("init_adapter_uri"))
        if cfg.eval.enabled:
            evals[0] = remote.registered_runner("evaluate", cfg)(config, str(run_dir), 0, checkpoint)["metrics"]
        for k in range(1, cfg.pipeline_iterations + 1):
            t0 = time.perf_counter()
            with subflow_settings():
                records = iteration_flow(config, str(run_dir), k, checkpoint, state)
            checkpoint, state = records["update"]["checkpoint"], records["update"]["state"]
            run_steps.prune_trainer_states(cfg, run_dir, k)
            if records.get("evaluate"):
                evals[k] = records["evaluate"]["metrics"]
            metrics = run_steps.iteration_metrics(records.get("curate") or {}, time.perf_counter() - t0)
            tracking.log_metrics(cfg, run_id, metrics, step=k)
            if k == 1:
                tracking.set_tags(cfg, run_id, {"dataset_hash": run_steps.dataset_hash(cfg, run_dir)})
            if monitoring.watch(cfg, run_dir, run_id, k, evals):          # monitors.on_trip: stop
                return _stopped(cfg, run_dir, run_id, checkpoint, evals)
        registered = read_json(run_dir / "run.json").get("registered_model")
        if registered is None:         # once per run: a re-run of a finished run does not add a version
            registered = run_steps.register_best_adapter(cfg, run_id, evals, run_dir)
            update_run_state(run_dir, registered_model=registered)
    except BaseException as e:        # Ctrl-C / SIGTERM: "interrupted"; anything else: "failed"
        tracking.end_run(cfg, run_id, mark_ended_by(run_dir, e))
        raise
    tracking.end_run(cfg, run_id, "FINISHED")
    summary = {"run_dir": str(run_dir), "mlflow_run_id": run_id, "final_checkpoint": checkpoint,
               "evals": evals, "tracking_uri": tracking.tracking_uri(cfg), "registered_model": registered}
    write_json(run_dir / "summary.json", summary)
    update_run_state(run_dir, status="finished", error=None, updated=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    return summary
