"""Log what a run learns from to MLflow: the training data and the held-out split as run inputs (name, digest,
source, profile: the runs table's Dataset column), the curation reports as artifacts, and the curate stage's
numbers, split in two: what varies per iteration as data/* metrics, the constant bookkeeping (prompts per
iteration, pool size, the sources) as tags, so that no flat line takes a chart. Called by the curate stage
(issues 5 and 16)."""
from __future__ import annotations

import json
from pathlib import Path

from grpo_core.config import GRPOConfig
from grpo_core.io import atomic_write_text
from tasks import registry, tracking

CONSTANT_COUNTS = ("num_prompts", "pool", "new_questions", "gate_excluded")   # the same at every iteration of a run
QUESTIONS_FILE = "questions.txt"    # <run_dir>/data/: the training pool's content hashes, also a run artifact


def numeric(d: dict | None, prefix: str) -> dict[str, float]:
    """The numbers of a stage record as metrics, prefixed unless their name has a '/'."""
    out = {}
    for k, v in (d or {}).items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        out[k if "/" in k else f"{prefix}{k}"] = float(v)
    return out


def curation_metrics(record: dict) -> dict[str, float]:
    """What a curate record says that varies per iteration: the pass-rate band counts and, when several sources
    feed the mix, the prompts drawn from each (one source's count is the number of prompts, every time)."""
    varying = {k: v for k, v in (record.get("metrics") or {}).items() if k not in CONSTANT_COUNTS}
    sources = record.get("sources") or {}
    return {**numeric(varying, "data/"), **(numeric(sources, "data/source/") if len(sources) > 1 else {})}


def curation_tags(record: dict) -> dict[str, str]:
    """The constant bookkeeping of a curate record as tags: data.num_prompts, data.pool, data.sources."""
    tags = {f"data.{k}": str(v) for k, v in {**record, **(record.get("metrics") or {})}.items()
            if k in CONSTANT_COUNTS}
    if record.get("sources"):
        tags["data.sources"] = ", ".join(sorted(record["sources"]))
    return tags


def dataset_hash(cfg: GRPOConfig, run_dir: str | Path) -> str:
    """The run's data by content: its data settings, the seed and the held-out split (run_dir/data/*.jsonl)."""
    files = sorted((Path(run_dir) / "data").glob("*.jsonl"))
    return tracking.file_hash(*files, extra={"data": cfg.data.model_dump(mode="json"), "seed": cfg.seed})


def _input(name: str, digest: str, source_type: str, source: dict, profile: dict, context: str):
    from mlflow.entities import Dataset, DatasetInput, InputTag
    ds = Dataset(name=name, digest=str(digest)[:36], source_type=source_type, source=json.dumps(source),
                 schema=json.dumps({"format": "grpo_core.task.Task"}), profile=json.dumps(profile, default=str))
    return DatasetInput(dataset=ds, tags=[InputTag(key="mlflow.data.context", value=context)])


def dataset_input(path: str | Path, context: str = "training", name: str | None = None):
    """An MLflow `DatasetInput` for a built dataset directory (uses its report) or a task file."""
    p = Path(path)
    report = json.loads((p / "report.json").read_text()) if (p / "report.json").is_file() else {}
    digest = report.get("dataset_hash") or tracking.file_hash(p)
    profile = {"train": report.get("totals", {}).get("train"), "eval": report.get("totals", {}).get("eval"),
               "kinds": report.get("kinds"), "groups": report.get("groups")} if report else \
        {"rows": sum(1 for line in p.open() if line.strip())} if p.is_file() else {}
    return _input(name or report.get("name") or p.stem, digest, "local", {"uri": str(p.resolve())}, profile, context)


def generated_input(cfg: GRPOConfig, run_dir: str | Path):
    """The built-in arithmetic task as a `DatasetInput`: questions a generator draws each iteration, so its
    digest is the run's dataset_hash and its source the generator with its settings."""
    d = cfg.data
    settings = {"min_digits": d.min_digits, "max_digits": d.max_digits, "operations": list(d.operations),
                "prompts_per_iteration": d.prompts_per_iteration, "eval_size": d.eval_size, "seed": cfg.seed}
    source = {"tags": {"generator": "grpo_core.data.arithmetic.train_tasks", "run_dir": str(Path(run_dir).resolve())}}
    return _input("arithmetic", dataset_hash(cfg, run_dir), "code", source, settings, "training")


def run_inputs(cfg: GRPOConfig, record: dict, run_dir: str | Path | None) -> list:
    """The run's inputs, training data first (the runs table shows the first): a built dataset, or the
    generator when `run_dir` is given; then the held-out split, the record's "eval" file."""
    inputs = []
    if record.get("dataset"):
        inputs.append(dataset_input(record["dataset"]))
    elif run_dir is not None:
        inputs.append(generated_input(cfg, run_dir))
    if record.get("eval") and Path(record["eval"]).is_file():
        inputs.append(dataset_input(record["eval"], "evaluation", name="heldout"))
    return inputs


def log_curation(cfg: GRPOConfig, run_id: str, record: dict, iteration: int, run_dir: str | Path | None = None) -> None:
    """For one curate-stage record: the run's inputs (first iteration), the constant bookkeeping as tags, and
    the reports as artifacts. Logging it again (a re-run stage) changes nothing: MLflow keeps one input per
    dataset and run."""
    c = tracking.client(cfg)
    dataset = record.get("dataset")
    if iteration == 1 and (inputs := run_inputs(cfg, record, run_dir)):
        c.log_inputs(run_id, datasets=inputs)
    if iteration == 1 and dataset and (Path(dataset) / "report.json").is_file():
        c.log_artifact(run_id, str(Path(dataset) / "report.json"), "data")
    if (tags := curation_tags(record)):
        tracking.set_tags(cfg, run_id, tags)
    if record.get("report") and Path(record["report"]).is_file():
        c.log_artifact(run_id, record["report"], f"data/iter-{iteration}")
    if iteration == 1 and run_dir is not None and (Path(run_dir) / "data" / QUESTIONS_FILE).is_file():
        c.log_artifact(run_id, str(Path(run_dir) / "data" / QUESTIONS_FILE), "data")


def parent_questions_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "data" / f"parent_{QUESTIONS_FILE}"


def fetch_parent_questions(cfg: GRPOConfig, run_dir: str | Path, init_adapter_uri: str | None) -> Path | None:
    """The training pool (content hashes) of the run whose adapter this run starts from, copied once to
    <run_dir>/data/parent_questions.txt; None when there is no parent or it recorded none (arithmetic)."""
    import tempfile
    from mlflow.exceptions import MlflowException
    dst = parent_questions_path(run_dir)
    if dst.is_file() or not init_adapter_uri or not init_adapter_uri.startswith(("runs:/", "models:/")):
        return dst if dst.is_file() else None
    try:
        parent_run = registry.runs_uri(init_adapter_uri)[0] if init_adapter_uri.startswith("runs:/") \
            else registry.model_version(tracking.client(cfg), init_adapter_uri).run_id
        with tempfile.TemporaryDirectory() as tmp:
            got = tracking.download_artifacts(cfg, parent_run, f"data/{QUESTIONS_FILE}", tmp)
            return atomic_write_text(dst, got.read_text())
    except (MlflowException, OSError):
        return None
