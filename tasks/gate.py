"""The promotion gate's MLflow side: where the frozen gate set lives, the champion and the new adapter answering
it, and the decision that gives (or does not give) the new version the `champion` alias.

The gate set is a JSONL file of held-out tasks, stored once per registered model: as an artifact of the run
that stored it (`gate/<name>-<hash>.jsonl`), copied under $GRPO_HOME/gates/, and named by the registered
model's tags gate_set_uri / gate_set_hash. The first run that registers a champion stores its held-out split
(or `grpo gate init --run RUN` stores a finished run's); every later run copies it to
<run_dir>/data/gate.jsonl at its start (curation keeps those questions out of training) and, at its end,
evaluates its new adapter and the champion on it with its own eval seeds and sampling. The statistics are
grpo_core/gate.py's."""
from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from grpo_core import gate as stats
from grpo_core.config import ConfigError, GRPOConfig
from grpo_core.io import atomic_write_text, grpo_home, read_json, write_json, write_jsonl
from tasks import tracking
from tasks.layout import eval_split_path
from tasks.run_state import update_run_state

GATE_URI_TAG, GATE_HASH_TAG, GATE_SIZE_TAG = "gate_set_uri", "gate_set_hash", "gate_set_questions"


def gate_set_path(run_dir: str | Path) -> Path:
    """The run's copy of the gate set (absent before a first champion exists)."""
    return Path(run_dir) / "data" / "gate.jsonl"


def content_hash(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def _home_copy(name: str, digest: str) -> Path:
    return grpo_home() / "gates" / f"{name}-{digest}.jsonl"


def current_gate_set(cfg: GRPOConfig) -> dict | None:
    """{"uri", "hash", "questions"} of the registered model's gate set, or None (no model or none stored)."""
    from mlflow.exceptions import MlflowException
    try:
        tags = tracking.client(cfg).get_registered_model(cfg.tracking.registered_model_name).tags
    except MlflowException:
        return None
    if not tags.get(GATE_URI_TAG):
        return None
    return {"uri": tags[GATE_URI_TAG], "hash": tags.get(GATE_HASH_TAG), "questions": tags.get(GATE_SIZE_TAG)}


def store_gate_set(cfg: GRPOConfig, run_id: str, tasks_file: str | Path) -> dict:
    """Make `tasks_file` (a run's held-out split) the registered model's gate set: a copy under $GRPO_HOME, an
    artifact of `run_id`, and the model's tags. Returns current_gate_set's record."""
    name = cfg.tracking.registered_model_name
    digest = content_hash(tasks_file)
    local = _home_copy(name, digest)
    atomic_write_text(local, Path(tasks_file).read_text())
    tracking.log_artifact(cfg, run_id, local, "gate")
    c = tracking.client(cfg)
    tracking.ensure_registered_model(c, name, tracking.REGISTERED_MODEL_DESCRIPTION)
    questions = sum(1 for line in local.read_text().splitlines() if line.strip())
    record = {"uri": f"runs:/{run_id}/gate/{local.name}", "hash": digest, "questions": str(questions)}
    for key, value in zip((GATE_URI_TAG, GATE_HASH_TAG, GATE_SIZE_TAG), record.values()):
        c.set_registered_model_tag(name, key, value)
    return record


def fetch_gate_set(cfg: GRPOConfig, gate_set: dict) -> Path:
    """A local copy of the gate set, checked against its hash: the $GRPO_HOME copy, else downloaded."""
    local = _home_copy(cfg.tracking.registered_model_name, gate_set["hash"])
    if not local.is_file() or content_hash(local) != gate_set["hash"]:
        import tempfile
        run_id, path = tracking.runs_uri(gate_set["uri"])
        with tempfile.TemporaryDirectory() as tmp:
            got = tracking.download_artifacts(cfg, run_id, path, tmp)
            atomic_write_text(local, got.read_text())
    if content_hash(local) != gate_set["hash"]:
        raise ConfigError(f"the gate set {gate_set['uri']} does not match its hash {gate_set['hash']} (tag "
                          f"{GATE_HASH_TAG} of {cfg.tracking.registered_model_name}); store it again with "
                          f"`grpo gate init --run RUN`")
    return local


def gate_enabled(cfg: GRPOConfig) -> bool:
    t = cfg.tracking
    return cfg.gate.enabled and bool(t.registered_model_name) and t.register_adapter != "none"


def prepare_gate_set(cfg: GRPOConfig, run_dir: str | Path) -> Path | None:
    """At a run's start: copy the gate set, if there is one, to <run_dir>/data/gate.jsonl (once per run)."""
    dst = gate_set_path(run_dir)
    if dst.is_file() or not gate_enabled(cfg) or (gate_set := current_gate_set(cfg)) is None:
        return dst if dst.is_file() else None
    atomic_write_text(dst, fetch_gate_set(cfg, gate_set).read_text())
    update_run_state(run_dir, gate_set_hash=gate_set["hash"])
    return dst


# -- the decision -------------------------------------------------------------------------------------------

def _champion(c, name: str):
    from mlflow.exceptions import MlflowException
    try:
        return c.get_model_version_by_alias(name, tracking.CHAMPION)
    except MlflowException:
        return None


def _scores_on_gate(cfg: GRPOConfig, tasks: list, checkpoint: str, rows_path: Path) -> dict[str, float]:
    """Per-question tracking.best_metric of `checkpoint` on the gate tasks, with the run's eval seed and
    sampling; the rows are kept in `rows_path`."""
    from grpo_core.evaluation import eval_seed, evaluate_checkpoint, metric_name
    _, rows = evaluate_checkpoint(cfg, tasks, checkpoint, eval_seed(cfg), progress=False)
    write_jsonl(rows_path, rows)
    return stats.per_question_scores(rows, cfg.tracking.best_metric, metric_name)


def compare_with_champion(cfg: GRPOConfig, run_dir: Path, run_id: str, checkpoint: str) -> stats.GateDecision:
    """Whether the adapter at `checkpoint` should take `champion` (gate.force_promote: yes, tagged forced)."""
    from grpo_core.task import read_tasks
    c, name = tracking.client(cfg), cfg.tracking.registered_model_name
    forced = (lambda d: dataclasses.replace(d, promote=True, reason="forced") if cfg.gate.force_promote else d)
    champion = _champion(c, name)
    if current_gate_set(cfg) is None:           # the first champion, or one from before the gate existed
        store_gate_set(cfg, run_id, eval_split_path(run_dir))
        prepare_gate_set(cfg, run_dir)
    if champion is None:
        return stats.GateDecision(True, reason="first champion")
    if champion.tags.get("base_model", cfg.model) != cfg.model:
        return forced(stats.GateDecision(False, reason=f"not compared: the champion (version {champion.version}) "
                                         f"is an adapter of {champion.tags['base_model']}, not {cfg.model}"))
    out = run_dir / "gate"
    champion_dir = tracking.download_adapter(f"models:/{name}/{champion.version}", out / "champion",
                                             tracking.tracking_uri(cfg))
    tasks = read_tasks(gate_set_path(run_dir))
    new = _scores_on_gate(cfg, tasks, checkpoint, out / "new_rows.jsonl")
    held = _scores_on_gate(cfg, tasks, str(champion_dir), out / "champion_rows.jsonl")
    g = cfg.gate
    return forced(stats.decide(new, held, g.confidence, g.test, g.resamples, g.seed))


def gate_tags(d: stats.GateDecision, gate_set: dict | None) -> dict[str, str]:
    """The decision's figures as MLflow tags (on the run and on the registered version)."""
    tags = {"gate_decision": "promoted" if d.promote else "not promoted", "gate_reason": d.reason}
    figures = {"gate_new_score": d.new_score, "gate_champion_score": d.champion_score, "gate_p_value": d.p_value,
               "gate_gain_low": d.gain_low, "gate_questions": d.questions or None, "gate_test": d.test or None}
    tags.update({k: f"{v:.6g}" if isinstance(v, float) else str(v) for k, v in figures.items() if v is not None})
    if gate_set:
        tags[GATE_HASH_TAG] = str(gate_set["hash"])
    return tags


def decision(cfg: GRPOConfig, run_dir: Path, run_id: str, iteration: int) -> stats.GateDecision | None:
    """The gate's decision for the adapter of `iteration`, made once per run (kept in <run_dir>/gate/
    decision.json, so a re-run of the bookkeeping does not evaluate again); None with the gate off."""
    if not gate_enabled(cfg):
        return None
    path = run_dir / "gate" / "decision.json"
    if path.is_file() and (done := read_json(path)).get("iteration") == iteration:
        return stats.GateDecision(**done["decision"])
    checkpoint = read_json(run_dir / f"iter-{iteration}" / "update.json")["checkpoint"]
    d = compare_with_champion(cfg, run_dir, run_id, checkpoint)
    write_json(path, {"iteration": iteration, "decision": d.as_dict()})
    return d


def lineage_tags(cfg: GRPOConfig, run_dir: Path) -> dict[str, str]:
    """Where a registered version comes from: the champion version it started from, the content hash of its
    training prompts (every iteration's prompts.jsonl), the config hash and the git commit."""
    prompts = sorted(run_dir.glob("iter-*/prompts.jsonl"), key=lambda p: int(p.parent.name.split("-")[1]))
    state = read_json(run_dir / "run.json") if (run_dir / "run.json").is_file() else {}
    return {"parent_version": str(state.get("parent_version") or ""),
            "data_hash": tracking.file_hash(*prompts) if prompts else "",
            "config_hash": cfg.config_hash(), "git_commit": tracking.git_commit()}


def register_with_gate(cfg: GRPOConfig, run_dir: Path, run_id: str, iteration: int, metrics: dict | None) -> dict:
    """Register the adapter of `iteration` with its lineage; it takes `champion` when the gate says so. Prints
    the gate's one line and returns register_adapter's record with "gate" (the decision) added."""
    d = decision(cfg, run_dir, run_id, iteration)
    tags = lineage_tags(cfg, run_dir)
    if d is not None:
        tags.update(gate_tags(d, current_gate_set(cfg)))
    registered = tracking.register_adapter(cfg, run_id, iteration, metrics, None if d is None else d.promote, tags)
    if d is not None:
        line = stats.summary_line(d, cfg.tracking.best_metric, cfg.gate.confidence, registered["version"])
        tracking.set_tags(cfg, run_id, {**gate_tags(d, None), "gate_summary": line})
        tracking.console(line)
        registered.update(gate=d.as_dict(), gate_summary=line)
    return registered


def init_from_run(cfg: GRPOConfig, run_dir: Path) -> dict:
    """`grpo gate init --run RUN`: make a finished run's held-out split the gate set (replacing any other)."""
    split = eval_split_path(run_dir)
    if not split.is_file() or not (run_id := (read_json(run_dir / "run.json") if (run_dir / "run.json").is_file()
                                              else {}).get("mlflow_run_id")):
        raise ConfigError(f"--run {run_dir.name}: {run_dir} has no held-out split with an MLflow run (data/eval.jsonl "
                          "and run.json); give the name of a run under output_dir that has evaluated")
    return store_gate_set(cfg, run_id, split)
