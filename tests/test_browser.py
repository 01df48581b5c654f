"""The UI, seen in a real browser (issue 16): two tiny runs trained with `grpo train` against a real `prefect
server`, then `mlflow server` on their SQLite store, both opened in headless Chromium (Playwright driving the
system's Chromium; bench/ui_screenshots.py holds the page code). What a user sees is checked: the link
`grpo train` prints opens the experiment in the Model training view, the runs table shows each run's dataset
and source, a run's metrics page starts with the key curves (no flat bookkeeping charts), the adapter files
and the evaluation plots are listed, two runs open in Compare, the Prefect flow run page lists the stage
task runs, and a run's Traces tab lists its rollouts, where a tool run's trace shows the model's call and the
tool's answer (tasks/traces.py). Screenshots go to $GRPO_SCREENSHOTS when set, else to the test's temp dir.

The browser may reach only 127.0.0.1 (anything else is aborted); servers listen on free 127.0.0.1 ports and
are stopped at the end; every wait is bounded. Skipped without Playwright or Chromium unless REQUIRE_BROWSER=1
(CI sets it), which turns the skip into a failure."""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import ui_screenshots as ui
from tasks import tracking

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def need_browser() -> None:
    why = None
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        why = "Playwright is not installed (pip install -e .[test])"
    if why is None and not Path(ui.CHROMIUM).exists():
        why = f"no Chromium at {ui.CHROMIUM} (apt-get install chromium, or set GRPO_CHROMIUM)"
    if why and os.environ.get("REQUIRE_BROWSER") == "1":
        pytest.fail(f"REQUIRE_BROWSER=1 but {why}")
    if why:
        pytest.skip(why)


@pytest.fixture(scope="module")
def page():
    """The module's one browser page (Playwright's sync API runs one browser per thread at a time)."""
    need_browser()
    blocked: list[str] = []
    with ui.browser(blocked) as page:
        yield page
    print(f"\nrequests aborted (not 127.0.0.1): {len(blocked)} {blocked[:3]}")


@pytest.fixture(scope="module")
def seen(tmp_path_factory, tiny_model_dir, page):
    """Both servers up, two finished runs, the browser page; yields what the tests look at."""
    work = tmp_path_factory.mktemp("ui")
    shutil.copytree(tiny_model_dir, work / "grpo_home" / "models" / "tiny-random")
    shots = Path(os.environ.get("GRPO_SCREENSHOTS") or work / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    with ui.prefect_ui(work / "prefect", work) as (prefect_base, env):
        runs = ui.make_runs(work, env)
        with ui.mlflow_ui(work / "runs" / "mlflow.db", work) as mlflow_base:
            from mlflow.tracking import MlflowClient
            c = MlflowClient(tracking_uri=mlflow_base)
            mlflow_runs = [c.get_run(r["mlflow_run_id"]) for r in runs]
            yield SimpleNamespace(page=page, mlflow=mlflow_base, prefect=prefect_base, work=work, shots=shots,
                                  runs=runs, mlflow_runs=mlflow_runs, exp=mlflow_runs[0].info.experiment_id)
    print(f"\nscreenshots in {shots}")


def printed_link(s) -> str:
    """The experiment URL `grpo train` printed for the first run, pointed at this test's server."""
    from grpo_core.config import load_config
    cfg = load_config(s.work / "runs" / "run-a" / "config.yaml", [])
    cfg.tracking.tracking_uri = f"sqlite:///{s.work / 'runs' / 'mlflow.db'}"           # what the run logged to
    url = re.search(r"http://127\.0\.0\.1:5000/\S+", tracking.ui_command(cfg)).group(0)
    return url.replace("http://127.0.0.1:5000", s.mlflow)


def test_printed_link_opens_the_runs_in_the_training_view_with_dataset_and_source(seen):
    got = ui.experiment_page(seen.page, printed_link(seen), seen.shots)
    assert "/runs?" in got["url"] and tracking.TRAINING_VIEW in got["url"]
    assert "Model registry" in got["sidebar"] and "Evaluation runs" not in got["sidebar"], got["sidebar"]
    assert [cell.splitlines()[-1] for cell in got["runs"]] == ["run-b", "run-a"]        # newest first
    # each run its own digest: the second run's data also holds the gate set the first one stored (data/gate.jsonl)
    for cell, run in zip(got["datasets"], reversed(seen.mlflow_runs), strict=True):
        digest = run.data.tags["dataset_hash"]
        assert cell.startswith(f"arithmetic ({digest})\nTraining"), cell                   # the training data first
        assert "heldout (" in cell and "Evaluation" in cell
    assert got["sources"] == ["grpo train", "grpo train"]


def test_run_page_starts_with_the_key_curves_and_has_no_bookkeeping_charts(seen):
    got = ui.metrics_page(seen.page, seen.mlflow, seen.exp, seen.runs[0]["mlflow_run_id"], seen.shots)
    section = tracking.KEY_CURVES_SECTION
    assert got["sections"][0] == section, got["sections"]
    assert got["charts"][:5] == [f"{section}/{tracking.KEY_CURVES[key]}" for key in (
        "eval/greedy/pass_at_1", "eval/sampled/pass_at_1", "reward/mean", "train/kl", "train/loss")]
    assert got["drawn"] >= 5                                              # plotly drew the curves
    assert not [s for s in got["sections"] if s.startswith("data")], got["sections"]
    tags = seen.mlflow_runs[0].data.tags
    assert (tags["data.num_prompts"], tags["data.sources"], tags["eval.num_questions"]) == ("2", "arithmetic", "4")


def test_artifacts_list_the_adapter_files_and_the_eval_plots(seen):
    got = ui.artifacts_page(seen.page, seen.mlflow, seen.exp, seen.runs[0]["mlflow_run_id"], seen.shots)
    listed = set(got["text"].splitlines())
    assert {"iter-1", "iter-2", "adapter_model.safetensors", "adapter_config.json"} <= listed
    assert {"accuracy.png", "reward.png", "lengths.png"} <= listed


def test_two_runs_open_in_the_compare_view(seen):
    ids = [r["mlflow_run_id"] for r in seen.runs]
    got = ui.compare_runs(seen.page, seen.mlflow, seen.exp, ids, seen.shots)
    assert all(i in got["url"] for i in ids)
    assert "Comparing 2 Runs" in got["text"] and all(i in got["text"] for i in ids)
    rates = [r.data.params["learning_rate"] for r in seen.mlflow_runs]
    assert f"learning_rate\t{rates[0]}\t{rates[1]}" in got["text"], "the parameter that differs, side by side"


def test_each_registered_version_shows_its_lineage(seen):
    """The model registry's version pages show where each adapter came from: the champion it started from, the
    training data's and the config's hashes, the commit; the second run's page shows the gate's decision."""
    from mlflow.tracking import MlflowClient
    from grpo_core.config import load_config
    from grpo_core.evaluation.task_identity import registered_model_name
    name = registered_model_name(load_config(seen.work / "runs" / "run-a" / "config.yaml", []))
    versions = MlflowClient(tracking_uri=seen.mlflow).search_model_versions(f"name='{name}'")
    assert sorted(v.version for v in versions) == ["1", "2"]
    for v in versions:
        got = ui.model_version_page(seen.page, seen.mlflow, v.name, v.version, seen.shots)
        for key in ("data_hash", "config_hash", "git_commit"):
            shown = re.search(rf"\b{key}\s+{re.escape(v.tags[key])}\s", got["text"])    # the tags table: key, value
            assert v.tags[key] and shown, (v.version, key, got["text"][-2000:])
        assert ("first champion" if v.version == "1" else "gate_p_value") in got["text"]   # 2 was gated against 1


def test_prefect_flow_run_page_lists_the_stage_task_runs(seen):
    got = ui.flow_run_page(seen.page, seen.prefect, seen.runs[0]["flow_run_id"], seen.shots)
    assert "grpo-training-run" in got["text"] and "Completed" in got["text"]
    assert got["text"].count("grpo-iteration") == 2, got["text"][-1500:]            # one subflow per iteration
    assert "5 Task runs" in got["task_runs"] and "(5 Completed)" in got["task_runs"], got["task_runs"][-1500:]
    from grpo_core import stages
    from grpo_core.config import load_config
    cfg = load_config(seen.work / "runs" / "run-a" / "config.yaml", [])
    for stage in [s.name for s in stages.STAGES if s.when is None or s.when(cfg, 1) or s.when(cfg, 2)]:
        assert re.search(rf"^{stage}-\w+$", got["task_runs"], re.M), (stage, got["task_runs"][-1500:])


# -- rollouts as traces (tasks/traces.py) -------------------------------------------------------------------------

def traces_tab(page, base: str, experiment_id: str, run_id: str, ready: str, shots: Path, name: str) -> dict:
    """A run's Traces tab once the text `ready` shows: its text with the list scrolled through (a row per trace, or
    per session while grouped; the table renders only the rows near the viewport, in an order that depends on when
    each trace was logged)."""
    ui.open_page(page, f"{base}/#/experiments/{experiment_id}/runs/{run_id}/traces?{tracking.TRAINING_VIEW}",
                 f"text={ready}")
    ui.close_assistant(page)
    shot = str(ui.shoot(page, shots, name))
    return {"screenshot": shot, "text": ui.scrolled_text(page, f"text={ready}")}


def trace_span(page, trace_id: str, span: str, expected: str, shots: Path) -> str:
    """On a Traces tab: one row per trace (not per session), open trace `trace_id`, select its span `span`, and
    return the drawer's text once it shows `expected`."""
    from playwright.sync_api import expect
    page.get_by_text("Group by session", exact=True).first.click()
    page.get_by_text(trace_id, exact=True).first.click()
    drawer = page.get_by_role("dialog").first
    drawer.get_by_text(span, exact=True).first.click()
    expect(drawer).to_contain_text(expected, timeout=ui.PAGE_TIMEOUT_MS)
    ui.shoot(page, shots, "mlflow-trace-tool-span")
    return drawer.inner_text()


@pytest.fixture(scope="module")
def tool_run(tmp_path_factory, tiny_model_dir, page):
    """A run whose rollouts called the calculator (scripted, tests/test_traces.py), scored by the score stage, which
    logged them as traces; `mlflow server` on its store, and the browser page."""
    from grpo_core.model.loading import load_tokenizer
    from tests.conftest import isolated_run_env
    from tests.test_traces import scored_run
    work = tmp_path_factory.mktemp("traces-ui")
    shots = Path(os.environ.get("GRPO_SCREENSHOTS") or work / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    with isolated_run_env(work, tiny_model_dir):
        _, _, run_id = scored_run((work, load_tokenizer(tiny_model_dir)), "tool-run", n_questions=2)
    with ui.mlflow_ui(work / "mlflow.db", work) as base:
        from mlflow.tracking import MlflowClient
        c = MlflowClient(tracking_uri=base)
        exp = c.get_run(run_id).info.experiment_id
        yield SimpleNamespace(page=page, mlflow=base, exp=exp, run_id=run_id, shots=shots,
                              traces=c.search_traces(locations=[exp], run_id=run_id))


def test_a_tool_runs_trace_shows_the_call_and_the_tools_answer(tool_run):
    s = tool_run
    got = traces_tab(s.page, s.mlflow, s.exp, s.run_id, "What is 214*37?", s.shots, "mlflow-run-traces")
    assert "tool-run-" in got["text"] and "-iter-1-group-0" in got["text"]            # grouped: a session per group
    assert "reward_answered" in got["text"]                                            # the rewards, as feedback
    right = next(t for t in s.traces if t.info.tags["group"] == "0" and t.info.tags["sample"] == "0")
    drawer = trace_span(s.page, right.info.trace_id, "tool calculator", "7918", s.shots)
    spans = drawer.split("Spans", 1)[1]
    assert spans.index("model turn 1") < spans.index("tool calculator") < spans.index("model turn 2")
    shown = drawer.split("Inputs", 1)[1]
    assert re.search(r"expression\s+214\*37\s+Outputs", shown) and re.search(r"result\s+7918", shown), shown


def test_a_training_runs_traces_tab_lists_its_rollouts_and_evaluation_answers(seen):
    run_id = seen.runs[0]["mlflow_run_id"]
    from mlflow.tracking import MlflowClient
    from tasks.traces import SESSION_METADATA
    logged = MlflowClient(tracking_uri=seen.mlflow).search_traces(locations=[seen.exp], run_id=run_id,
                                                                  include_spans=False)
    sessions = {t.info.trace_metadata[SESSION_METADATA] for t in logged}
    for part in ("-iter-1-group-0", "-iter-2-group-1", "-eval-0-greedy-", "-eval-2-sampled-"):
        assert any(part in s for s in sessions), (part, sorted(sessions))
    got = traces_tab(seen.page, seen.mlflow, seen.exp, run_id, "run-a-", seen.shots, "mlflow-training-run-traces")
    missing = sorted(s for s in sessions if s not in got["text"])        # more sessions than the table renders
    assert not missing, (missing, got["text"][-2000:])
    assert "reward" in got["text"]
