"""Log curated data to MLflow: the dataset as a run input (name, content hash, source, profile) and the
curation reports as artifacts. Called by the training flow after the curate stage (issue 5)."""
from __future__ import annotations

import json
from pathlib import Path

from grpo_core.config import GRPOConfig
from tasks import tracking


def dataset_input(path: str | Path, context: str = "training"):
    """An MLflow `DatasetInput` for a built dataset directory (uses its report) or a task file."""
    from mlflow.entities import Dataset, DatasetInput, InputTag
    p = Path(path)
    report = json.loads((p / "report.json").read_text()) if (p / "report.json").is_file() else {}
    digest = report.get("dataset_hash") or tracking.file_hash(p)
    profile = {"train": report.get("totals", {}).get("train"), "eval": report.get("totals", {}).get("eval"),
               "kinds": report.get("kinds"), "groups": report.get("groups")}
    ds = Dataset(name=report.get("name") or p.stem, digest=str(digest)[:36], source_type="local",
                 source=json.dumps({"uri": str(p.resolve())}),
                 schema=json.dumps({"format": "grpo_core.task.Task", "files": ["train.parquet", "eval.parquet"]}),
                 profile=json.dumps(profile, default=str))
    return DatasetInput(dataset=ds, tags=[InputTag(key="mlflow.data.context", value=context)])


def log_curation(cfg: GRPOConfig, run_id: str, record: dict, iteration: int) -> None:
    """For one curate-stage record: the dataset as an input (first iteration) and its reports as artifacts."""
    c = tracking.client(cfg)
    dataset = record.get("dataset")
    if dataset and iteration == 1:
        c.log_inputs(run_id, datasets=[dataset_input(dataset)])
        if (Path(dataset) / "report.json").is_file():
            c.log_artifact(run_id, str(Path(dataset) / "report.json"), "data")
    if record.get("report") and Path(record["report"]).is_file():
        c.log_artifact(run_id, record["report"], f"data/iter-{iteration}")
