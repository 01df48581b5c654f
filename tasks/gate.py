"""The promotion gate's MLflow side: each task's frozen gate set, the champion and the new adapter answering it,
and the decision that gives (or does not give) the new version the `champion` alias.

One registered model per task (tracking.registered_model_name with `{task}`, grpo_core/evaluation/task_identity.py) holds
one champion and one gate set. The gate set is a split of its own: drawn with gate.split_seed from the task's
questions, disjoint by content from the eval split (on which a run picks the iteration it registers, so the
gate never judges on the questions that selected the adapter) and kept out of every run's training. The first
run of a task stores it (an artifact of that run, `gate/<name>-<hash>.jsonl`, copied under $GRPO_HOME/gates/,
named by the registered model's tags); every run copies it to <run_dir>/data/gate.jsonl at its start and, at its
end, evaluates its new adapter and the champion on it with its own eval seeds and sampling, both in the task's
prompt format (one task, one format). A run the monitors flagged suspect is refused. The statistics are
grpo_core/evaluation/gate.py's."""
from __future__ import annotations

import dataclasses
import hashlib
import re
import tempfile
from pathlib import Path

from grpo_core.evaluation import gate as stats
from grpo_core.config import ConfigError, GRPOConfig
from grpo_core.data import arithmetic
from grpo_core.data import iteration as data_iteration
from grpo_core.io import atomic_write_text, grpo_home, read_json, write_json, write_jsonl
from grpo_core.task import Task, read_tasks, write_tasks
from grpo_core.evaluation.task_identity import (parse_signature_tag, registered_model_name, signature_differences,
                                     signature_tag, task_signature)
from tasks import registry, tracking
from tasks.splits import curated_cache, ensure_eval_split, held_out_preview
from tasks.layout import gate_set_path
from tasks.run_state import read_run_state, suspect_reasons, update_run_state

GATE_URI_TAG, GATE_HASH_TAG, GATE_SIZE_TAG = "gate_set_uri", "gate_set_hash", "gate_set_questions"
TASK_TAG = "task_signature"


def content_hash(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def _home_copy(name: str, digest: str) -> Path:
    return grpo_home() / "gates" / f"{name}-{digest}.jsonl"


def _model_tags(cfg: GRPOConfig) -> dict[str, str] | None:
    """The registered model's tags, or None when it does not exist yet (nor its store: reading would create it)."""
    if not tracking.store_exists(cfg):
        return None
    name = registered_model_name(cfg)
    model = registry.read_or_none(lambda: tracking.client(cfg).get_registered_model(name),
                                  f"the registered model {name}")
    return None if model is None else model.tags


def current_gate_set(cfg: GRPOConfig) -> dict | None:
    """{"uri", "hash", "questions"} of the task's gate set, or None (no registered model, or none stored)."""
    tags = _model_tags(cfg) or {}
    if not tags.get(GATE_URI_TAG):
        return None
    return {"uri": tags[GATE_URI_TAG], "hash": tags.get(GATE_HASH_TAG), "questions": tags.get(GATE_SIZE_TAG)}


def gate_enabled(cfg: GRPOConfig) -> bool:
    t = cfg.tracking
    return cfg.gate.enabled and bool(t.registered_model_name) and t.register_adapter != "none"


# -- the gate set -------------------------------------------------------------------------------------------

def build_gate_split(cfg: GRPOConfig, run_dir: str | Path, held_out: list[Task]) -> list[Task]:
    """gate.questions questions of the config's task, drawn with gate.split_seed, none asking what a task in
    `held_out` (the eval split) asks."""
    g, d = cfg.gate, cfg.data
    try:
        if d.curated:
            return data_iteration.gate_tasks(d.curated, run_dir, g.questions, g.split_seed, curated_cache())
        return arithmetic.gate_tasks(g.questions, d.min_digits, d.max_digits, d.operations, g.split_seed, held_out)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_disjoint(gate_tasks: list[Task], held_out: list[Task], name: str) -> None:
    """ConfigError when the gate set asks a question of the eval split (by content): an adapter picked on those
    questions would be judged on them again."""
    from grpo_core.data.curation import canonical_question
    asked = {canonical_question(t.prompt) for t in held_out} | {t.content_hash() for t in held_out}
    shared = [t for t in gate_tasks if canonical_question(t.prompt) in asked or t.content_hash() in asked]
    if shared:
        raise ConfigError(f"the gate set of {name} shares {len(shared)} of its {len(gate_tasks)} questions with this "
                          f"run's eval split (e.g. {shared[0].prompt!r}), so the gate would judge on the questions "
                          f"that pick the registered iteration; store a new one with `grpo gate init`")


def store_gate_set(cfg: GRPOConfig, run_id: str, tasks_file: str | Path, signature: dict[str, str]) -> dict:
    """Make `tasks_file` the task's gate set: a copy under $GRPO_HOME, an artifact of `run_id`, and the registered
    model's tags (with the task's signature). Returns current_gate_set's record."""
    name = registered_model_name(cfg)
    digest = content_hash(tasks_file)
    local = _home_copy(name, digest)
    atomic_write_text(local, Path(tasks_file).read_text())
    tracking.log_artifact(cfg, run_id, local, "gate")
    c = tracking.client(cfg)
    registry.ensure_registered_model(c, name, registry.REGISTERED_MODEL_DESCRIPTION)
    questions = sum(1 for line in local.read_text().splitlines() if line.strip())
    record = {"uri": f"runs:/{run_id}/gate/{local.name}", "hash": digest, "questions": str(questions)}
    tags = {GATE_URI_TAG: record["uri"], GATE_HASH_TAG: digest, GATE_SIZE_TAG: record["questions"],
            TASK_TAG: signature_tag(signature)}
    for key, value in tags.items():
        c.set_registered_model_tag(name, key, value)
    return record


def fetch_gate_set(cfg: GRPOConfig, gate_set: dict) -> Path:
    """A local copy of the gate set, checked against its hash: the $GRPO_HOME copy, else downloaded."""
    name = registered_model_name(cfg)
    local = _home_copy(name, gate_set["hash"])
    if not local.is_file() or content_hash(local) != gate_set["hash"]:
        run_id, path = registry.runs_uri(gate_set["uri"])
        with tempfile.TemporaryDirectory() as tmp:
            got = tracking.download_artifacts(cfg, run_id, path, tmp)
            atomic_write_text(local, got.read_text())
    if content_hash(local) != gate_set["hash"]:
        raise ConfigError(f"the gate set {gate_set['uri']} does not match its hash {gate_set['hash']} (tag "
                          f"{GATE_HASH_TAG} of {name}); store a new one with `grpo gate init`")
    return local


def task_mismatch(cfg: GRPOConfig, signature: dict[str, str]) -> str | None:
    """Why this run's task is not the registered model's (None: it is, or the model records none yet)."""
    stored = (_model_tags(cfg) or {}).get(TASK_TAG)
    if not stored or not (differ := signature_differences(signature, parse_signature_tag(stored))):
        return None
    return (f"{registered_model_name(cfg)} holds another task's champion (this run differs in its "
            f"{', '.join(differ)}); give this task its own tracking.registered_model_name (the default "
            f"grpo-{{task}} names one per task)")


def prepare_gate_set(cfg: GRPOConfig, run_dir: str | Path, run_id: str) -> Path | None:
    """At a run's start: the task's gate set in <run_dir>/data/gate.jsonl (stored now when the task has none),
    checked disjoint from the eval split. None with the gate off, or when the registered model belongs to another
    task (the run is then not compared at its end, and says so now)."""
    dst = gate_set_path(run_dir)
    if dst.is_file() or not gate_enabled(cfg):
        return dst if dst.is_file() else None
    held_out = read_tasks(ensure_eval_split(cfg, run_dir))
    signature = task_signature(cfg)
    update_run_state(run_dir, task_signature=signature, gate_refusal=None)    # a resume may have fixed the name
    if (why := task_mismatch(cfg, signature)):
        update_run_state(run_dir, gate_refusal=why)
        tracking.console(f"gate: this run will not be compared for `champion`: {why}")
        return None
    gate_set = current_gate_set(cfg)
    if gate_set is None:                        # the task's first run: draw its gate set now
        tasks = build_gate_split(cfg, run_dir, held_out)
        if len(tasks) < cfg.gate.questions:
            tracking.console(f"gate: the task has few questions, so its gate set takes {len(tasks)} (a quarter of "
                             f"the training split; gate.questions {cfg.gate.questions}): the gate can only tell "
                             f"large gains apart (`grpo gate show` says how large)")
        with tempfile.TemporaryDirectory() as tmp:
            gate_set = store_gate_set(cfg, run_id, write_tasks(Path(tmp) / "gate.jsonl", tasks), signature)
    local = fetch_gate_set(cfg, gate_set)
    check_disjoint(read_tasks(local), held_out, registered_model_name(cfg))
    atomic_write_text(dst, local.read_text())
    update_run_state(run_dir, gate_set_hash=gate_set["hash"])
    return dst


def check_before_run(cfg: GRPOConfig, run_dir: str | Path) -> None:
    """Before a run starts (flows.train.preflight), nothing written yet: ConfigError when the task's stored gate set
    shares a question with the run's eval split (check_disjoint)."""
    if not gate_enabled(cfg) or gate_set_path(run_dir).is_file() or not tracking.store_exists(cfg):
        return
    if (gate_set := current_gate_set(cfg)) is None:
        return
    held_out = held_out_preview(cfg, run_dir)
    if held_out is None or task_mismatch(cfg, task_signature(cfg)):
        return                                  # checked when the run has built its data / not compared at all
    check_disjoint(read_tasks(fetch_gate_set(cfg, gate_set)), held_out, registered_model_name(cfg))


def init_gate_set(cfg: GRPOConfig) -> dict:
    """`grpo gate init`: draw the config's task's gate set afresh and store it (replacing any other), as an
    artifact of a small MLflow run of its own."""
    c = tracking.client(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        held_out = read_tasks(ensure_eval_split(cfg, tmp))
        path = write_tasks(Path(tmp) / "gate.jsonl", build_gate_split(cfg, tmp, held_out))
        run = c.create_run(tracking.experiment_id(cfg), run_name=f"gate-set-{registered_model_name(cfg)}",
                           tags={"grpo.kind": "gate-set"})
        record = store_gate_set(cfg, run.info.run_id, path, task_signature(cfg))
        c.set_terminated(run.info.run_id)
    return record


# -- the decision -------------------------------------------------------------------------------------------

def champion_score(cfg: GRPOConfig) -> float | None:
    """The champion's tracking.best_metric: on the gate set when a gate promoted it, else on its run's eval split
    (None without a champion)."""
    c = tracking.client(cfg)
    champion = registry.champion_version(c, registered_model_name(cfg)) if current_gate_set(cfg) else None
    if champion is None:
        return None
    value = champion.tags.get("gate_new_score", champion.tags.get(cfg.tracking.best_metric))
    return None if value is None else float(value)


def _scores_on_gate(cfg: GRPOConfig, tasks: list, checkpoint: str, rows_path: Path) -> dict[str, float]:
    """Per-question tracking.best_metric of `checkpoint` on the gate tasks, with the run's eval seed and
    sampling; the rows are kept in `rows_path`."""
    from grpo_core.evaluation.evaluate import eval_seed, evaluate_checkpoint, metric_name
    _, rows = evaluate_checkpoint(cfg, tasks, checkpoint, eval_seed(cfg), progress=False)
    write_jsonl(rows_path, rows)
    return stats.per_question_scores(rows, cfg.tracking.best_metric, metric_name)


def _not_compared(cfg: GRPOConfig, run_dir: Path, champion) -> str | None:
    """Why the new adapter cannot be compared with `champion` (None: it can)."""
    if champion.tags.get("base_model", cfg.model) != cfg.model:
        return (f"the champion (version {champion.version}) is an adapter of {champion.tags['base_model']}, not "
                f"{cfg.model}")
    theirs = parse_signature_tag(champion.tags.get(TASK_TAG, ""))
    ours = read_run_state(run_dir).get("task_signature") or {}
    if theirs and (differ := signature_differences(ours, theirs)):
        return (f"the champion (version {champion.version}) was trained for another task (it differs in its "
                f"{', '.join(differ)})")
    if not gate_set_path(run_dir).is_file():
        return "this run has no copy of the gate set (it started before the task had one)"
    return None


def compare_with_champion(cfg: GRPOConfig, run_dir: Path, run_id: str, checkpoint: str) -> stats.GateDecision:
    """Whether the adapter at `checkpoint` should take `champion` (gate.force_promote: yes, tagged forced). A run
    flagged suspect by a monitor is refused; the task's first adapter is its first champion."""
    c, name = tracking.client(cfg), registered_model_name(cfg)
    forced = (lambda d: dataclasses.replace(d, promote=True, reason="forced") if cfg.gate.force_promote else d)
    state = read_run_state(run_dir)
    if (suspect := suspect_reasons(run_dir)):
        return forced(stats.GateDecision(False, reason="refused: the run is suspect (" + "; ".join(suspect) + ")"))
    if state.get("gate_refusal"):
        return forced(stats.GateDecision(False, reason=f"not compared: {state['gate_refusal']}"))
    if current_gate_set(cfg) is None and gate_set_path(run_dir).is_file():     # stored at the start, unless it crashed
        store_gate_set(cfg, run_id, gate_set_path(run_dir), state.get("task_signature") or {})
    champion = registry.champion_version(c, name)
    if champion is None:
        return stats.GateDecision(True, reason="first champion")
    if (why := _not_compared(cfg, run_dir, champion)):
        return forced(stats.GateDecision(False, reason=f"not compared: {why}"))
    out = run_dir / "gate"
    champion_dir = registry.download_adapter(f"models:/{name}/{champion.version}", out / "champion",
                                             tracking.tracking_uri(cfg))
    tasks = read_tasks(gate_set_path(run_dir))
    new = _scores_on_gate(cfg, tasks, checkpoint, out / "new_rows.jsonl")
    held = _scores_on_gate(cfg, tasks, str(champion_dir), out / "champion_rows.jsonl")
    g = cfg.gate
    test = stats.resolve_test(g.test, cfg.tracking.best_metric, cfg.eval.num_samples)
    return forced(stats.decide(new, held, g.confidence, test, g.resamples, g.seed))


def gate_tags(d: stats.GateDecision, gate_set_hash: str | None) -> dict[str, str]:
    """The decision's figures as MLflow tags (on the run and on the registered version); `gate_set_hash`: the
    content hash of the set the adapters were compared on."""
    tags = {"gate_decision": "promoted" if d.promote else "not promoted", "gate_reason": d.reason}
    figures = {"gate_new_score": d.new_score, "gate_champion_score": d.champion_score, "gate_p_value": d.p_value,
               "gate_gain_low": d.gain_low, "gate_questions": d.questions or None, "gate_test": d.test or None}
    tags.update({k: f"{v:.6g}" if isinstance(v, float) else str(v) for k, v in figures.items() if v is not None})
    if gate_set_hash:
        tags[GATE_HASH_TAG] = gate_set_hash
    return tags


def _decision_inputs(cfg: GRPOConfig, run_dir: Path, iteration: int) -> dict:
    """What a decision is made on besides the answers: the iteration, the registered model and the champion it
    faces, the run's suspect marks and gate refusal, and the gate's settings (a resume may change any of them:
    another run takes `champion`, `--set monitors...` judges again, gate and tracking names are operational)."""
    name = registered_model_name(cfg)
    champion = registry.champion_version(tracking.client(cfg), name)
    return {"iteration": iteration, "registered_model": name, "champion": champion.version if champion else None,
            "suspect": suspect_reasons(run_dir), "refusal": read_run_state(run_dir).get("gate_refusal"),
            "gate": cfg.gate.model_dump(mode="json")}


def decision(cfg: GRPOConfig, run_dir: Path, run_id: str, iteration: int) -> stats.GateDecision | None:
    """The gate's decision for the adapter of `iteration`, made once per run (kept in <run_dir>/gate/
    decision.json, so a re-run of the bookkeeping does not evaluate again while nothing it was made on changed:
    another champion, a suspect mark or other gate settings decide again); None with the gate off."""
    if not gate_enabled(cfg):
        return None
    path = run_dir / "gate" / "decision.json"
    inputs = _decision_inputs(cfg, run_dir, iteration)
    if path.is_file() and ((done := read_json(path)).get("inputs") == inputs or (
            done.get("iteration") == iteration and registry.registered_version(
                tracking.client(cfg), registered_model_name(cfg), run_id, iteration, cfg.run_name) is not None)):
        return stats.GateDecision(**done["decision"])     # same inputs, or already acted on: its version exists
    checkpoint = read_json(run_dir / f"iter-{iteration}" / "update.json")["checkpoint"]
    d = compare_with_champion(cfg, run_dir, run_id, checkpoint)
    write_json(path, {"iteration": iteration, "inputs": inputs, "decision": d.as_dict()})
    return d


def _in_order(path: Path) -> list:
    """A path as a key that puts iter-2 before iter-10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def lineage_tags(cfg: GRPOConfig, run_dir: Path) -> dict[str, str]:
    """Where a registered version comes from: the champion version it started from, the content hash of every
    prompt it trained on (each iteration's prompts.jsonl and those of its dynamic-sampling refill rounds), the
    task's signature, the config hash and the git commit."""
    prompts = sorted((p.relative_to(run_dir) for p in run_dir.glob("iter-*/**/prompts.jsonl")), key=_in_order)
    state = read_run_state(run_dir)
    tags = {"parent_version": str(state.get("parent_version") or ""),
            "data_hash": tracking.file_hash(*(run_dir / p for p in prompts)) if prompts else "",
            "config_hash": cfg.config_hash(), "git_commit": tracking.git_commit()}
    if state.get("task_signature"):
        tags[TASK_TAG] = signature_tag(state["task_signature"])
    return tags


def register_with_gate(cfg: GRPOConfig, run_dir: Path, run_id: str, iteration: int, metrics: dict | None) -> dict:
    """Register the adapter of `iteration` with its lineage; it takes `champion` when the gate says so (never
    when the run is suspect, gate or no gate). Prints the gate's one line and returns register_adapter's record
    with "gate" (the decision) added."""
    d = decision(cfg, run_dir, run_id, iteration)
    tags = lineage_tags(cfg, run_dir)
    if (suspect := suspect_reasons(run_dir)):
        tags.update(suspect="true", suspect_reasons="; ".join(suspect)[:4000])
    if d is not None:
        compared_on = gate_set_path(run_dir)
        tags.update(gate_tags(d, content_hash(compared_on) if compared_on.is_file() else None))
    promote = d.promote if d is not None else (False if suspect else None)
    registered = registry.register_adapter(cfg, run_id, iteration, metrics, promote, tags)
    if d is not None:
        line = stats.summary_line(d, cfg.tracking.best_metric, cfg.gate.confidence, registered["version"])
        tracking.set_tags(cfg, run_id, {**gate_tags(d, None), "gate_summary": line})
        tracking.console(line)
        registered.update(gate=d.as_dict(), gate_summary=line)
    return registered
