"""The UI a training run leaves behind, seen in headless Chromium: MLflow's experiment page (Model training
view, with the runs' dataset and source), a run's metric charts, its artifacts, two runs in Compare, and the
Prefect flow run page with its stage task runs. Each page is screenshotted and what it showed is returned as
plain data; tests/test_browser.py asserts on that data. As a script it trains two runs (the second at twice
the learning rate) against a fresh `prefect server`, serves their store with `mlflow server`, and saves the
screenshots; the README's were made with

    .venv/bin/python bench/ui_screenshots.py --out runs/screenshots --config configs/default.yaml \
        --set pipeline_iterations=6 --set eval.every=2

Needs Playwright (`pip install -e .[test]`) and a Chromium (Debian: `apt-get install chromium`; browsers are
never downloaded). Every server it starts listens on 127.0.0.1 and is stopped on the way out; the browser
may reach only 127.0.0.1, every other request is aborted (and recorded), and every wait is bounded.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))                             # run as a script from anywhere
from grpo_core.io import stop_process_group  # noqa: E402
from tasks.tracking import TRAINING_VIEW, experiment_url  # noqa: E402
BIN = Path(sys.executable).parent
CHROMIUM = os.environ.get("GRPO_CHROMIUM", "/usr/bin/chromium")
PAGE_TIMEOUT_MS = 60_000                                  # one page or element, on a busy 2-core machine


# -- servers ------------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> float:
    """Poll `url` (1 s apart, 2 s per request) until it answers 200, the process exits, or `timeout` s pass.
    Returns the seconds it took."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f} s; log: {log}")


@contextlib.contextmanager
def serve(cmd: list[str], health_url: str, log: Path, env: dict | None = None, timeout: float = 240):
    """Run a server in its own process group until the block ends (SIGTERM, then SIGKILL after 20 s)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_healthy(health_url, proc, timeout, log)
        yield proc
    finally:
        stop_process_group(proc, grace=20, kill_wait=20)


@contextlib.contextmanager
def mlflow_ui(store: Path, log_dir: Path):
    """`mlflow server` on the SQLite store `store` (runs/mlflow.db). Yields its base URL."""
    port = free_port()
    cmd = [str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{store.resolve()}",
           "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    with serve(cmd, f"http://127.0.0.1:{port}/health", log_dir / "mlflow-server.log"):
        yield f"http://127.0.0.1:{port}"


def prefect_env(home: Path, port: int) -> dict[str, str]:
    return {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_URL": f"http://127.0.0.1:{port}"}


@contextlib.contextmanager
def prefect_ui(home: Path, log_dir: Path):
    """`prefect server start` with its database under `home`. Yields (base URL, the env that points clients at it)."""
    port = free_port()
    env = prefect_env(home, port)
    cmd = [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    with serve(cmd, f"http://127.0.0.1:{port}/api/health", log_dir / "prefect-server.log", env):
        yield f"http://127.0.0.1:{port}", env


def train(output_dir: Path, name: str, env: dict, config: str, *overrides: str, timeout: float = 3600) -> dict:
    """`grpo train --config CONFIG` as a user runs it, unless that run already finished in `output_dir`.
    -> its run.json (mlflow_run_id, flow_run_id)."""
    if (output_dir / name / "summary.json").exists():
        return json.loads((output_dir / name / "run.json").read_text())
    cmd = [str(BIN / "grpo"), "train", "--config", config, "--output-dir", str(output_dir), "--run-name", name,
           *[a for o in overrides for a in ("--set", o)]]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{(r.stdout + r.stderr)[-4000:]}")
    return json.loads((output_dir / name / "run.json").read_text())


# -- the browser --------------------------------------------------------------------------------------------

@contextlib.contextmanager
def browser(blocked: list[str]):
    """A headless Chromium page that may reach only 127.0.0.1; every other URL is aborted and appended to
    `blocked`. 1600 x 1000, waits bounded by PAGE_TIMEOUT_MS."""
    from playwright.sync_api import sync_playwright

    def only_local(route):
        url = route.request.url
        if re.match(r"(https?|wss?)://127\.0\.0\.1(:\d+)?/", url) or url.startswith(("data:", "blob:")):
            return route.continue_()
        blocked.append(url)
        return route.abort()

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            context = chromium.new_context(viewport={"width": 1600, "height": 1000})
            context.set_default_timeout(PAGE_TIMEOUT_MS)
            context.route("**/*", only_local)
            yield context.new_page()
        finally:
            chromium.close()


def shoot(page, shots: Path, name: str) -> Path:
    path = shots / f"{name}.png"
    page.screenshot(path=str(path))
    return path


def open_page(page, url: str, ready: str) -> None:
    """Go to `url` and wait until the Playwright selector `ready` is visible (bounded by PAGE_TIMEOUT_MS)."""
    page.goto(url, wait_until="domcontentloaded")
    page.locator(ready).first.wait_for(state="visible")


def scrolled_text(page, over: str, max_steps: int = 40) -> str:
    """The page's text while the list under selector `over` is scrolled from top to bottom: MLflow's tables render
    only the rows near the viewport (the Traces tab some 30 rows), so a row far down the order is not in the page's
    text until scrolled to. Stops when a scroll shows nothing new (or after `max_steps` scrolls)."""
    box = page.locator(over).first.bounding_box()
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + min(box["height"] / 2, 300))
    seen: list[str] = []
    for _ in range(max_steps):
        text = page.inner_text("body")
        if seen and text == seen[-1]:
            break
        seen.append(text)
        page.mouse.wheel(0, 600)
        page.wait_for_timeout(250)
    return "\n".join(seen)


def close_assistant(page) -> None:
    """MLflow 3.17 opens its assistant beside every page, over a third of it; close it once (it stays closed)."""
    close = page.locator('[data-component-id="mlflow.assistant.chat_panel.close"]')
    with contextlib.suppress(Exception):
        close.first.click(timeout=5000)


# -- MLflow pages -------------------------------------------------------------------------------------------

def column(page, col_id: str) -> list[str]:
    """The texts of one column of the runs table (ag-grid cells with this col-id), top to bottom."""
    cells = page.locator(f'.ag-center-cols-container .ag-row [col-id="{col_id}"], '
                         f'.ag-pinned-left-cols-container .ag-row [col-id="{col_id}"]')
    return [c.inner_text().strip() for c in cells.all()]


def experiment_page(page, url: str, shots: Path) -> dict:
    """The experiment at `url` (the link `grpo train` prints): where it landed, the sidebar of its view, the
    runs table's Run Name, Dataset and Source cells."""
    open_page(page, url, ".ag-center-cols-container .ag-row")
    close_assistant(page)
    return {"url": page.url, "screenshot": str(shoot(page, shots, "mlflow-experiment")),
            "sidebar": page.locator("nav").first.inner_text(), "runs": column(page, "attributes.`Run Name`"),
            "datasets": column(page, "attributes.`Dataset`"), "sources": column(page, "attributes.`Source`")}


def metrics_page(page, base: str, experiment_id: str, run_id: str, shots: Path) -> dict:
    """A run's Model metrics tab once its first chart has drawn: the chart sections in the order shown, the
    metric keys of the charts rendered so far (the UI renders what is in view), and how many curves are drawn."""
    open_page(page, f"{base}/#/experiments/{experiment_id}/runs/{run_id}/model-metrics?{TRAINING_VIEW}",
              '[placeholder="Search metric charts"]')
    cards = page.locator('[data-testid="experiment-view-compare-runs-card"]')
    cards.first.locator("svg.main-svg path.js-line").first.wait_for(state="attached")  # plotly drew a curve
    headers = page.locator('[data-testid="experiment-view-compare-runs-section-header"]').all_inner_texts()
    return {"screenshot": str(shoot(page, shots, "mlflow-run-metrics")),
            "sections": [h.strip().splitlines()[0] for h in headers],
            "charts": cards.locator("h4[title]").evaluate_all("hs => hs.map(h => h.title)"),
            "drawn": cards.locator("svg.main-svg path.js-line").count()}


def artifacts_page(page, base: str, experiment_id: str, run_id: str, shots: Path,
                   folders=("adapters", "iter-2", "plots")) -> dict:
    """A run's Artifacts tab with `folders` expanded in turn (a folder shows once its parent is open):
    the tree's text, every file and folder name it lists."""
    open_page(page, f"{base}/#/experiments/{experiment_id}/runs/{run_id}/artifacts?{TRAINING_VIEW}", "text=adapters")
    for folder in folders:
        page.get_by_text(folder, exact=True).first.click()
        page.get_by_text("Path:", exact=False).first.wait_for()
    page.get_by_text("accuracy.png", exact=True).first.click()                   # preview one eval plot
    page.locator('img[alt="plots/accuracy.png"]').first.wait_for()
    return {"screenshot": str(shoot(page, shots, "mlflow-run-artifacts")), "text": page.inner_text("body")}


def compare_runs(page, base: str, experiment_id: str, run_ids: list[str], shots: Path) -> dict:
    """Tick the runs in the experiment's table, press Compare, and read the page it opens."""
    open_page(page, f"{base}/#/experiments/{experiment_id}?{TRAINING_VIEW}", ".ag-center-cols-container .ag-row")
    for run_id in run_ids:
        page.locator(f'.ag-pinned-left-cols-container .ag-row[row-id="{run_id}"] .ag-checkbox-input-wrapper').click()
    page.get_by_role("button", name="Compare").first.click()
    page.wait_for_url(re.compile(r"compare-runs"))
    page.get_by_text("Run ID:", exact=False).first.wait_for()
    return {"url": page.url, "screenshot": str(shoot(page, shots, "mlflow-compare")), "text": page.inner_text("body")}


def model_version_page(page, base: str, name: str, version: str, shots: Path) -> dict:
    """A registered model version's page (where its lineage tags are shown): the page's text."""
    open_page(page, f"{base}/#/models/{name}/versions/{version}", f"text=Version {version}")
    page.get_by_text("data_hash", exact=True).first.wait_for()
    return {"screenshot": str(shoot(page, shots, f"mlflow-model-version-{version}")), "text": page.inner_text("body")}


# -- Prefect ------------------------------------------------------------------------------------------------

def flow_run_page(page, base: str, flow_run_id: str, shots: Path) -> dict:
    """The Prefect UI's page of a training run: its subflow runs (one "grpo-iteration" per iteration), then the
    first iteration's page with its stage task runs (curate-..., rollout-..., ...)."""
    open_page(page, f"{base}/runs/flow-run/{flow_run_id}", "text=Subflow Runs")
    page.get_by_text("Subflow Runs", exact=True).first.click()
    iterations = page.locator(f'a[href^="/runs/flow-run/"]:not([href$="{flow_run_id}"])')
    iterations.first.wait_for()
    seen = {"screenshot": str(shoot(page, shots, "prefect-flow-run")), "text": page.inner_text("body")}
    iterations.last.click()                                   # newest first: the last one is iteration 1
    page.get_by_text("Task Runs", exact=True).first.click()
    page.get_by_text(re.compile(r"^curate-\w+$")).first.wait_for()
    return {**seen, "iteration_url": page.url, "task_runs": page.inner_text("body"),
            "iteration_screenshot": str(shoot(page, shots, "prefect-iteration-task-runs"))}


# -- the whole tour, for the README ---------------------------------------------------------------------

def make_runs(work: Path, env: dict, config: str = "configs/tiny.yaml", overrides: tuple[str, ...] = ()) -> list[dict]:
    """Two finished runs of `config` in work/runs, the second at twice the learning rate, against the Prefect
    server that `env` points at. The tiny random model is looked for in work/grpo_home, any other in $GRPO_HOME."""
    from grpo_core.config import load_config
    cfg = load_config(REPO / config, list(overrides))
    env = {k: v for k, v in env.items() if k != "MLFLOW_TRACKING_URI"}     # the runs' own SQLite store
    if cfg.model == "tiny-random":
        env["GRPO_HOME"] = str(work / "grpo_home")
    faster = f"learning_rate={2 * cfg.learning_rate:g}"
    return [train(work / "runs", "run-a", env, config, *overrides),
            train(work / "runs", "run-b", env, config, *overrides, faster)]


def tour(page, mlflow_base: str, prefect_base: str, runs: list[dict], shots: Path) -> dict[str, dict]:
    """Every page of this module for `runs` (run.json records of finished runs, the first one shown)."""
    from mlflow.tracking import MlflowClient
    c = MlflowClient(tracking_uri=mlflow_base)
    first = c.get_run(runs[0]["mlflow_run_id"])
    exp = first.info.experiment_id
    return {
        "experiment": experiment_page(page, experiment_url(mlflow_base, exp), shots),
        "metrics": metrics_page(page, mlflow_base, exp, first.info.run_id, shots),
        "artifacts": artifacts_page(page, mlflow_base, exp, first.info.run_id, shots),
        "compare": compare_runs(page, mlflow_base, exp, [r["mlflow_run_id"] for r in runs], shots),
        "flow_run": flow_run_page(page, prefect_base, runs[0]["flow_run_id"], shots),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "runs" / "screenshots",
                   help="where the PNGs go (default: runs/screenshots)")
    p.add_argument("--work", type=Path, default=None,
                   help="working directory for the runs and servers, kept, and runs finished there are reused "
                        "(default: a fresh temporary one, removed after)")
    p.add_argument("--config", default="configs/tiny.yaml",
                   help="config of both runs (default: the tiny random model, a minute each, flat curves; "
                        "configs/default.yaml with --set pipeline_iterations=6 for curves that move)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="config overrides for both runs, as for grpo train")
    args = p.parse_args(argv)
    from grpo_core.config import load_config
    from grpo_core.model.loading import build_tiny_model
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="grpo-ui-"))
    work.mkdir(parents=True, exist_ok=True)
    tiny = work / "grpo_home" / "models" / "tiny-random"
    if load_config(REPO / args.config, args.set).model == "tiny-random" and not tiny.exists():
        build_tiny_model(tiny)
    blocked: list[str] = []
    try:
        with prefect_ui(work / "prefect", work) as (prefect_base, env):
            runs = make_runs(work, env, args.config, tuple(args.set))
            with mlflow_ui(work / "runs" / "mlflow.db", work) as mlflow_base, browser(blocked) as page:
                seen = tour(page, mlflow_base, prefect_base, runs, args.out)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    for what, result in seen.items():
        print(f"{what:12s} {result['screenshot']}")
    print(f"{'iteration':12s} {seen['flow_run']['iteration_screenshot']}")
    print(f"requests blocked (not 127.0.0.1): {len(blocked)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
