"""Kill anywhere, resume exactly (issue #15): a real `grpo train` (or `grpo data build`) child process is
SIGKILLed at one point of the matrix below, then resumed; the resumed run must equal an uninterrupted run.

Each training case checks, after `training_run(cfg)` (what `grpo resume` calls) on the killed run:
  - stages completed before the kill are not re-run (their records and outputs keep their mtimes);
  - every iteration's adapter equals an uninterrupted run's with the same seed, bit for bit;
  - MLflow: no metric logged twice at a step, and the same metric steps, artifacts and tables (row for row)
    as the uninterrupted run: nothing missing, nothing duplicated (MLflow appends to an existing table);
  - no temp file or half-built directory anywhere under the run directory.
The uninterrupted runs are shared by the cases with the same config (`reference`, module-scoped).
The kill points are tests/faults.py's seams; production code knows nothing of them."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tasks.layout import STAGES
from tests import faults
from tests.conftest import isolated_run_env, tiny_config
from tests.test_data_cli import run as data_cli, write_config as write_data_config
from tests.test_ops_flow import _adapter_tensors, _assert_no_duplicate_steps, _mlflow_run

pytestmark = pytest.mark.faults
SLOW = pytest.mark.slow

# The tiny random model never earns accuracy/format rewards; the DAPO length penalty varies with the
# completion length, so groups carry signal and the update really moves the adapter (see test_ops_flow).
SIGNAL_OPTS = dict(reward_funcs=["accuracy", "format", "overlong"], max_completion_length=12,
                   overlong_buffer_length=10)
# With dynamic sampling no group is informative on raw correctness (the tiny model is never right): every
# iteration runs its max_extra_rollouts refill rounds, then falls back to the first batch.
# With tools: the tiny model taught to call the calculator (conftest.tool_calling_model_dir), whose calls pass
# through a fault point; no evaluation, so the first call is in iteration 1's rollout.
CONFIGS = {"plain": {}, "dynamic": dict(dynamic_sampling=True, max_extra_rollouts=2),
           "tools": dict(tools=["tests.faults:calculator"], max_completion_length=160, max_tool_calling_iterations=1,
                         eval=dict(enabled=False))}


def run_config(tmp: Path, kind: str, model: str | None = None) -> dict:
    opts = {**SIGNAL_OPTS, **CONFIGS[kind], **({"model": model} if model else {})}
    return tiny_config(tmp, run_name="k", output_dir=str(tmp / "runs"), pipeline_iterations=2, **opts)


def model_for(kind: str, request) -> str | None:
    return str(request.getfixturevalue("tool_calling_model_dir")) if kind == "tools" else None


@dataclass
class Case:
    rule: dict                  # where the child hangs and is killed (tests/faults.py)
    pending: str                # the record the kill must have left unwritten
    kind: str = "plain"
    must_exist: list[str] = field(default_factory=list)    # written before the kill (the point is mid-stage)


CASES = {
    "curate": Case({"point": "curate", "iteration": 1}, "iter-1/curate.json"),
    "rollout": Case({"point": "rollout", "iteration": 1}, "iter-1/rollout.json"),
    "score": Case({"point": "score", "iteration": 1}, "iter-1/score.json"),
    # inside update, its checkpoint written into the temp dir, not yet renamed into place
    "update": Case({"point": "checkpoint:write"}, "iter-1/update.json"),
    # outputs written and logged to MLflow (metrics, completion table, adapter), record not yet
    "update-logged": Case({"point": "update:saved", "iteration": 1}, "iter-1/update.json",
                          must_exist=["iter-1/update/checkpoint"]),
    "evaluate": Case({"point": "evaluate", "iteration": 1}, "iter-1/evaluate.json"),
    "evaluate-logged": Case({"point": "evaluate:saved", "iteration": 1}, "iter-1/evaluate.json",
                            must_exist=["iter-1/eval_samples.jsonl"]),
    # inside the DAPO refill: the first extra round's rollout, its curate done
    "dynamic-refill": Case({"point": "rollout", "iteration": 1, "dir": "dynamic-1"},
                           "iter-1/dynamic-1/iter-1/rollout.json", "dynamic",
                           must_exist=["iter-1/dynamic-1/iter-1/curate.json"]),
    # the refill rounds merged: samples.dynamic.jsonl written, scores.dynamic.jsonl and its metrics not
    "dynamic-merge": Case({"point": "dynamic:merge"}, "iter-1/update.json", "dynamic",
                          must_exist=["iter-1/dynamic-2/iter-1/score.json", "iter-1/samples.dynamic.jsonl"]),
    # inside a tool call of the rollout (multi-turn: the model called the calculator)
    "tool-call": Case({"point": "tool:call"}, "iter-1/rollout.json", "tools", must_exist=["iter-1/curate.json"]),
}
FAST = {"score"}                # runs in `make test`; the rest are slow (CI)


@dataclass
class Reference:
    summary: dict
    uri: str


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir, prefect_engine, request):
    """kind -> the uninterrupted run of run_config(kind), made on first use and shared by the module."""
    from flows.train import training_run
    done: dict[str, Reference] = {}

    def get(kind: str) -> Reference:
        if kind not in done:
            tmp = tmp_path_factory.mktemp(f"reference-{kind}")
            with isolated_run_env(tmp, tiny_model_dir) as uri:
                t0 = time.perf_counter()
                done[kind] = Reference(training_run(run_config(tmp, kind, model_for(kind, request))), uri)
                print(f"\nuninterrupted {kind} run: {time.perf_counter() - t0:.1f} s")
        return done[kind]
    return get


# -- what is compared -------------------------------------------------------------------------------------

def done_files(run_dir: Path) -> dict[str, int]:
    """mtime of every stage record under the run (refill rounds included) and of the files it names."""
    out = {}
    for rec in run_dir.rglob("*.json"):
        if rec.stem not in STAGES:
            continue
        out[str(rec.relative_to(run_dir))] = rec.stat().st_mtime_ns
        for v in json.loads(rec.read_text()).values():
            p = Path(v) if isinstance(v, str) and v.startswith(str(run_dir)) else None
            for f in ([p] if p and p.is_file() else sorted(p.rglob("*")) if p and p.is_dir() else []):
                out[str(f.relative_to(run_dir))] = f.stat().st_mtime_ns
    return out


def metric_steps(uri: str, run_id: str) -> dict[str, list[int]]:
    c, run = _mlflow_run(uri, run_id)
    return {k: sorted(m.step for m in c.get_metric_history(run_id, k)) for k in run.data.metrics}


def artifacts(uri: str, run_id: str, path: str | None = None) -> list[str]:
    c, _ = _mlflow_run(uri, run_id)
    out = []
    for f in c.list_artifacts(run_id, path):
        out += artifacts(uri, run_id, f.path) if f.is_dir else [f.path]
    return sorted(out)


def table(uri: str, run_id: str, path: str, dst: Path) -> dict:
    c, _ = _mlflow_run(uri, run_id)
    return json.loads(Path(c.download_artifacts(run_id, path, str(dst))).read_text())


def assert_same_tracking(uri: str, run_id: str, ref: Reference, tmp: Path) -> int:
    """The resumed run's MLflow record equals the uninterrupted one's: steps, artifacts, tables."""
    n = _assert_no_duplicate_steps(uri, run_id)
    assert metric_steps(uri, run_id) == metric_steps(ref.uri, ref.summary["mlflow_run_id"])
    paths = artifacts(uri, run_id)
    assert paths == artifacts(ref.uri, ref.summary["mlflow_run_id"])
    tables = [p for p in paths if p.startswith(("eval_samples/", "completions/"))]
    assert tables, paths
    for p in tables:                # MLflow's log_table appends rows to an existing file: none twice
        got, want = table(uri, run_id, p, tmp / "got"), table(ref.uri, ref.summary["mlflow_run_id"], p, tmp / "want")
        assert got == want, f"table {p}: {len(got['data'])} rows after resume, {len(want['data'])} uninterrupted"
    return n


def assert_same_adapters(run_dir: Path, ref_dir: Path, iterations: int) -> None:
    import torch
    for k in range(1, iterations + 1):
        a = _adapter_tensors(run_dir / f"iter-{k}" / "update" / "checkpoint")
        b = _adapter_tensors(ref_dir / f"iter-{k}" / "update" / "checkpoint")
        assert a.keys() == b.keys()
        assert all(torch.equal(a[n], b[n]) for n in a), f"iter-{k} adapter differs after resume"
        assert any(b[n].abs().sum() > 0 for n in b if "lora_B" in n), "the update did not train (no signal)"
    sa = torch.load(run_dir / f"iter-{iterations}/update/trainer_state.pt", weights_only=False)
    sb = torch.load(ref_dir / f"iter-{iterations}/update/trainer_state.pt", weights_only=False)
    assert sa["global_step"] == sb["global_step"] and torch.equal(sa["rng"]["torch"], sb["rng"]["torch"])


# -- the training matrix ----------------------------------------------------------------------------------

def kill_training(cfg: dict, case: Case, tmp: Path) -> Path:
    """`grpo train` in a child, SIGKILLed at the case's point; checks it died where it was meant to."""
    from prefect.settings import PREFECT_API_URL
    from tasks.run_state import run_status
    cfg_file = tmp / "k.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg))
    faults.kill_at(["train", "--config", str(cfg_file)], case.rule, tmp,
                   env={"PREFECT_API_URL": PREFECT_API_URL.value()})
    run_dir = Path(cfg["output_dir"]) / cfg["run_name"]
    assert run_status(run_dir)["status"] == "killed"
    assert not (run_dir / case.pending).exists(), f"{case.pending} written before the kill"
    missing = [p for p in case.must_exist if not (run_dir / p).exists()]
    assert not missing, f"the kill came before {missing} was written"
    return run_dir


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST else SLOW) for n in CASES])
def test_sigkill_then_resume_equals_uninterrupted(name, prefect_engine, grpo_home, mlflow_uri, tmp_path, reference,
                                                 request):
    from flows.train import training_run
    from grpo_core.io import read_json
    case = CASES[name]
    ref = reference(case.kind)
    cfg = run_config(tmp_path, case.kind, model_for(case.kind, request))
    run_dir = kill_training(cfg, case, tmp_path)
    killed_leftovers = faults.leftovers(run_dir)
    before = done_files(run_dir)
    run_id = read_json(run_dir / "run.json")["mlflow_run_id"]

    t0 = time.perf_counter()
    summary = training_run(cfg)                                        # what `grpo resume k` calls
    resume_s = time.perf_counter() - t0

    assert summary["mlflow_run_id"] == run_id and read_json(run_dir / "run.json")["attempts"] == 2
    assert {p: t for p, t in done_files(run_dir).items() if p in before} == before   # done: not re-run
    assert (run_dir / case.pending).exists()
    ref_dir = Path(ref.summary["run_dir"])
    assert sorted(done_files(run_dir)) == sorted(done_files(ref_dir))                 # nothing missing
    assert_same_adapters(run_dir, ref_dir, cfg["pipeline_iterations"])
    n_points = assert_same_tracking(mlflow_uri, run_id, ref, tmp_path)
    assert _mlflow_run(mlflow_uri, run_id)[1].info.status == "FINISHED"
    assert faults.leftovers(run_dir) == []
    print(f"\nkill at {name} ({case.rule['point']}): resume {resume_s:.1f} s; "
          f"{len(before)} completed files untouched; {n_points} metric points, no duplicates; "
          f"temp left by the kill: {killed_leftovers or 'none'}, after resume: none")


# -- `grpo data build` ------------------------------------------------------------------------------------

def dataset_files(d: Path) -> dict[str, object]:
    """A built dataset's content: the files' bytes, the report without its time and place."""
    out: dict[str, object] = {p.name: p.read_bytes() for p in d.iterdir() if p.name != "report.json"}
    report = json.loads((d / "report.json").read_text())
    del report["config"]["out_dir"]
    out["report.json"] = {k: v for k, v in report.items() if k not in ("created", "timings_s", "path")}
    return out


@SLOW
def test_sigkill_inside_data_build_then_rebuild(grpo_home, tmp_path):
    """Killed while writing its dataset (the files in the temp dir, not renamed yet): nothing half-written
    is published; the re-run builds the same dataset as an uninterrupted build and clears the temp dir."""
    cfg = write_data_config(tmp_path)
    args = ["data", "build", "--config", str(cfg), "--backend", "local", "--no-progress"]
    faults.kill_at(args, {"point": "data:write"}, tmp_path, timeout=120)
    out = tmp_path / "built"
    assert [p.name for p in out.iterdir() if not p.name.startswith(".")] == []      # nothing published
    left = faults.leftovers(out)
    assert left                                                  # the kill really was mid-write

    t0 = time.perf_counter()
    assert data_cli(args) == 0
    rebuild_s = time.perf_counter() - t0
    assert data_cli([*args, "--out-dir", str(tmp_path / "uninterrupted")]) == 0
    (built,), (ref,) = list(out.iterdir()), list((tmp_path / "uninterrupted").iterdir())
    assert built.name == ref.name and dataset_files(built) == dataset_files(ref)
    assert faults.leftovers(out) == []
    print(f"\nkill inside data build (left {left}): rebuild {rebuild_s:.1f} s")
