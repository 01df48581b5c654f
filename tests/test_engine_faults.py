"""Engines that fail (issue #15): the services a run leans on break under it, for real.

1. The Docker engine stops in the middle of a scoring batch: the jobs come back `infra_error` (never a
   fail or error that would become a reward), the score stage is retried (bounded, with backoff) until the
   engine is back, and no container is left behind; an engine gone for good fails the run with one line.
2. The MLflow server is killed and restarted mid-run: the tracking calls wait for it (bounded exponential
   backoff; one call is made while it is down, and the restarted server answers it) and every metric of the
   run is there exactly once.
3. The disk fills up while a checkpoint is written: the previous checkpoint is untouched, nothing
   half-written remains, the CLI says what is full in one line, and the run resumes once there is space.
4. The sandbox under load: 500 jobs of every kind on more workers than cores, one right verdict each.

The engine tests stop and start the machine's own dockerd (as infra/setup_docker.sh starts it); they skip
where that is not ours to do (not root, no dockerd process here, or containers of others running on it).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import tiny_config
from tests.sandbox_support import need_docker, py_job

pytestmark = pytest.mark.faults
REPO = Path(__file__).resolve().parent.parent


# -- the Docker engine, stopped and started by the test ---------------------------------------------------

def engine_answers() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode == 0


def dockerd_pids() -> list[int]:
    out = subprocess.run(["pgrep", "-x", "dockerd"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def sandbox_containers(*labels: str) -> list[str]:
    """`docker ps -a` for the sandbox's containers (label grpo.sandbox=1, and `labels`): their ids."""
    filters = [a for label in ("grpo.sandbox=1", *labels) for a in ("--filter", f"label={label}")]
    out = subprocess.run(["docker", "ps", "-a", "-q", *filters], capture_output=True, text=True, check=True)
    return out.stdout.split()


def need_engine_control() -> None:
    """Skip unless this test may stop the machine's Docker engine and start it again."""
    need_docker()
    if os.geteuid() != 0:
        pytest.skip("stopping and starting the Docker engine needs root")
    if not dockerd_pids():
        pytest.skip("no dockerd process on this machine to stop (the engine is managed elsewhere)")
    me = f"{socket.gethostname()}:{os.getpid()}"
    out = subprocess.run(["docker", "ps", "--format", '{{.ID}} {{.Label "grpo.sandbox.owner"}}'],
                         capture_output=True, text=True, check=True).stdout
    others = [line.split()[0] for line in out.splitlines() if line.split()[1:] != [me]]
    if others:
        pytest.skip(f"the Docker engine runs containers of others ({len(others)}): stopping it would stop them")


def stop_engine(timeout: float = 90) -> float:
    """SIGTERM dockerd (it stops its containers and containerd) and wait until it is gone. -> seconds."""
    t0 = time.perf_counter()
    pids = dockerd_pids()
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    while any(Path(f"/proc/{pid}").exists() for pid in pids):
        assert time.perf_counter() - t0 < timeout, "dockerd did not stop"
        time.sleep(0.2)
    assert not engine_answers()
    return time.perf_counter() - t0


def start_engine() -> float:
    """infra/setup_docker.sh: starts dockerd in the background, returns once `docker info` answers. -> seconds."""
    t0 = time.perf_counter()
    done = subprocess.run(["bash", str(REPO / "infra" / "setup_docker.sh")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return time.perf_counter() - t0


@contextlib.contextmanager
def engine_restored():
    """Whatever happens in the block, the engine answers again after it."""
    try:
        yield
    finally:
        if not engine_answers():
            start_engine()


def assert_fails_with_one_line(code: int, err: str, says: list[str]) -> str:
    """`grpo` stopped with exit status 2 and one `error:` line, the last thing on stderr, saying `says`; no
    traceback. (A run that failed mid-way has drawn progress bars and warned before it.)"""
    from tests.test_bad_inputs import visible_lines
    lines = visible_lines(err)
    assert code == 2, (code, err)
    assert [x for x in lines if x.startswith("error:")] == lines[-1:], err
    assert "Traceback" not in err
    for part in says:
        assert part in lines[-1], (part, lines[-1])
    return lines[-1]


def wait_until(cond, timeout: float, what: str, step: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(step)


SLOW_ADD = "import time\ntime.sleep({s})\n\ndef f(a, b):\n    return a + b\n"     # the sleep keeps the job in its box


# -- what the failures are: retried or not, one line or a traceback ----------------------------------------

def test_engine_down_is_retried_a_full_disk_is_not_and_both_get_one_line():
    import errno
    from flows.cli.main import user_error_message
    from grpo_core.io import DiskFullError
    from sandbox.backends import EngineUnavailable
    from sandbox.docker_backend import engine_down
    from tasks.retry import is_transient
    down = engine_down(ConnectionError("('Connection aborted.', FileNotFoundError(2, 'No such file or directory'))"))
    assert isinstance(down, EngineUnavailable) and is_transient(down)          # the stage retries it (bounded)
    full = DiskFullError("no space left on device writing x")
    assert full.errno == errno.ENOSPC and not is_transient(full)              # a full disk stays full
    assert not is_transient(OSError(errno.ENOSPC, "No space left on device"))
    assert user_error_message(down).startswith("the Docker engine") and user_error_message(full) == str(full)


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"),
                                   RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")])
def test_a_write_that_fills_the_disk_says_so_and_leaves_nothing(tmp_path, error):
    """grpo_core.io names a full disk whatever the writer raised (safetensors says it in words), and removes
    its temp; any other error passes through as it was."""
    from grpo_core.io import DiskFullError, atomic_dir, atomic_write_text
    from tests.faults import leftovers

    def build(tmp: Path) -> None:
        (tmp / "half").write_text("x")
        raise error
    with pytest.raises(DiskFullError, match=f"no space left on device writing {tmp_path / 'ckpt'}: the filesystem at "):
        atomic_dir(tmp_path / "ckpt", build)
    def bug(tmp: Path) -> None:
        raise ValueError("not a disk problem")
    with pytest.raises(ValueError, match="not a disk"):
        atomic_dir(tmp_path / "ckpt", bug)
    atomic_write_text(tmp_path / "ok.txt", "fine")
    assert not (tmp_path / "ckpt").exists() and leftovers(tmp_path) == []


# -- 1. the Docker engine stops mid-batch -------------------------------------------------------------------

@pytest.mark.docker
@pytest.mark.slow
def test_engine_stopped_mid_batch_gives_infra_errors_then_recovers():
    """Sandbox level: the jobs running when dockerd stops, and those after, are `infra_error` naming the
    engine (not fail/error: no reward may come of them); `check_engine` says it is down; once it is back
    the same backend scores the same jobs right, and closing it leaves no container behind."""
    need_engine_control()
    from sandbox.backends import EngineUnavailable
    from sandbox.docker_backend import DockerBackend
    jobs = [py_job(SLOW_ADD.format(s=3), [((1, 2), 3)], timeout_s=30) for _ in range(12)]
    be = DockerBackend()
    mine = f"grpo.sandbox.instance={be.instance}"
    verdicts: list = []
    with engine_restored():
        batch = threading.Thread(target=lambda: verdicts.extend(be.score_batch(jobs, workers=4)))
        t0 = time.perf_counter()
        batch.start()
        wait_until(lambda: len(sandbox_containers(mine)) >= 2, 60, "the batch's first containers")
        time.sleep(1.0)                                   # the jobs are in their boxes now
        stop_s = stop_engine()
        batch.join(120)
        batch_s = time.perf_counter() - t0
        statuses = [v.status for v in verdicts]
        assert len(verdicts) == len(jobs)
        assert set(statuses) == {"infra_error"}, statuses     # in flight and after: never fail/error/timeout
        assert all("the Docker engine" in v.detail and "does not answer" in v.detail for v in verdicts), \
            {v.detail for v in verdicts}
        with pytest.raises(EngineUnavailable, match="infra/setup_docker.sh"):
            be.check_engine()
        start_s = start_engine()
        t1 = time.perf_counter()
        again = be.score_batch(jobs, workers=4)
        again_s = time.perf_counter() - t1
    assert [v.status for v in again] == ["pass"] * len(jobs), [(v.status, v.detail) for v in again]
    be.close()
    assert sandbox_containers(mine) == []
    print(f"\nengine stopped mid-batch: stop {stop_s:.1f} s, batch returned {batch_s:.1f} s after its start, all "
          f"{len(jobs)} infra_error; engine back in {start_s:.1f} s; the same jobs re-scored in {again_s:.1f} s; "
          f"no container left")


def code_run_files(tmp: Path, n_tasks: int = 4, sleep_s: float = 2.0) -> tuple[list, Path, Path, list[float]]:
    """Python tasks, and per task a right and a wrong completion (each sleeps `sleep_s` at import, so that a
    batch is long enough to stop the engine in). -> (tasks, prompts file, samples file, expected rewards)."""
    from grpo_core.data.sources import gen_python
    from grpo_core.io import write_jsonl
    from grpo_core.task import write_tasks
    tasks = list(gen_python.load(n=n_tasks, seed=0))
    rows, expected = [], []
    for g, t in enumerate(tasks):
        right = f"import time\ntime.sleep({sleep_s})\n{t.reference_solution}"
        wrong = f"import time\ntime.sleep({sleep_s})\ndef {t.entry_point}(*args):\n    return None\n"
        for code, reward in ((right, 1.0), (wrong, 0.0)):
            text = f"```python\n{code}```"
            rows.append({"task_id": t.id, "group": g, "completion": text, "completion_ids": [1] * 8})
            expected.append(reward)
    it = tmp / "runs" / "t" / "iter-1"
    return tasks, write_tasks(it / "prompts.jsonl", tasks), write_jsonl(it / "samples.jsonl", rows), expected


@pytest.mark.docker
@pytest.mark.slow
def test_score_stage_is_retried_until_the_engine_is_back(tmp_path, grpo_home, prefect_engine, monkeypatch):
    """The real score stage (tasks/score.py, a Prefect task with the flow's retry policy) on code completions:
    dockerd is stopped mid-batch, so the batch and score_code's own retry come back infra_error, score_code
    raises EngineUnavailable (not rewards of 0, not dropped samples), the stage is retried with backoff,
    the engine is started again meanwhile, and a later attempt scores every sample right."""
    need_engine_control()
    from prefect import flow
    import sandbox.api
    from tasks.stage import with_policy
    from grpo_core.rewards import code_rewards
    from grpo_core.io import read_jsonl
    from sandbox.backends import EngineUnavailable
    from tasks.layout import cfg_of
    from tasks.score import score
    _, prompts, samples, expected = code_run_files(tmp_path)
    config = tiny_config(tmp_path, run_name="t", reward_funcs=["accuracy"], sandbox=dict(backend="docker"),
                         stages=dict(score=dict(retries=4, retry_delay_seconds=2, backoff_factor=2)))
    batches, attempts = [], []
    real_batch, real_score_code = sandbox.api.score_batch, code_rewards.score_code

    def spy_batch(jobs, *a, **kw):
        verdicts = real_batch(jobs, *a, **kw)
        batches.append([v.status for v in verdicts])
        return verdicts

    def spy_score_code(*a, **kw):
        try:
            out = real_score_code(*a, **kw)
        except EngineUnavailable as e:
            attempts.append(f"EngineUnavailable: {e}")
            raise
        attempts.append("scored")
        return out
    monkeypatch.setattr(sandbox.api, "score_batch", spy_batch)
    monkeypatch.setattr(code_rewards, "score_code", spy_score_code)

    @flow(name="score-only")
    def score_only() -> dict:
        stage = with_policy(score, cfg_of(config), "score")      # the flow's retry policy: transient errors only
        return stage(config, str(tmp_path / "runs" / "t"), 1, str(prompts), str(samples))

    me = f"grpo.sandbox.owner={socket.gethostname()}:{os.getpid()}"
    timings = {}

    def break_the_engine():
        wait_until(lambda: len(sandbox_containers(me)) >= 2, 120, "the batch's first containers")
        time.sleep(1.0)
        timings["stop"] = stop_engine()
        wait_until(lambda: attempts, 120, "the first attempt to fail")
        timings["down_at_failure"] = time.perf_counter()
        timings["start"] = start_engine()

    with engine_restored():
        breaker = threading.Thread(target=break_the_engine, daemon=True)
        breaker.start()
        t0 = time.perf_counter()
        record = score_only()
        took = time.perf_counter() - t0
        breaker.join(300)
    assert set(batches[0]) <= {"infra_error", "pass", "fail"} and "infra_error" in batches[0], batches[0]
    assert attempts[0].startswith("EngineUnavailable: the Docker engine"), attempts
    assert attempts[-1] == "scored" and len(attempts) >= 2, attempts
    scored = list(read_jsonl(record["scores"]))
    assert [s["reward"] for s in scored] == expected                      # every sample, rightly; none dropped
    assert record["metrics"]["reward/unscorable_frac"] == 0.0
    be = sandbox.api.get_backend("docker")
    assert set(sandbox_containers(me)) == {b.ct.id[:12] for b in be._all}  # the dead boxes removed once it was back
    be.close()
    assert sandbox_containers(me) == []
    print(f"\nscore stage across an engine restart: {len(attempts)} attempts ({', '.join(a.split(':')[0] for a in attempts)}), "
          f"first batch {batches[0].count('infra_error')}/{len(batches[0])} infra_error; engine stop {timings['stop']:.1f} s, "
          f"start {timings['start']:.1f} s; stage done in {took:.1f} s, all {len(scored)} rewards right, no container left")


@pytest.mark.docker
@pytest.mark.slow
def test_engine_gone_for_good_fails_the_run_with_one_line(tmp_path, grpo_home, prefect_engine, mlflow_uri, capsys,
                                                          monkeypatch):
    """`grpo train` on code tasks with sandbox.backend docker; the engine answers at preflight, then stops for
    good: the first stage that scores code is retried (stages.*.retries, bounded), then the run fails with
    one `error:` line naming the engine, the fix and the resume command; once the engine is back, `grpo
    resume` finishes the run."""
    need_engine_control()
    import yaml
    import flows.train
    import sandbox.api
    from flows.cli.main import main
    from grpo_core.task import write_tasks
    from grpo_core.data.sources import gen_python
    from tasks.run_state import run_status
    data = write_tasks(tmp_path / "code.jsonl", gen_python.load(n=8, seed=0))
    retry = dict(retries=2, retry_delay_seconds=0.5, backoff_factor=2)
    cfg = tiny_config(tmp_path, run_name="t", pipeline_iterations=1, sandbox=dict(backend="docker"),
                      data=dict(curated=str(data), prompts_per_iteration=2, eval_size=2),
                      stages={s: retry for s in ("curate", "rollout", "score", "update", "evaluate")})
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(cfg))
    monkeypatch.setattr(sandbox.api, "_BACKENDS", {})              # none of the session's backends
    tries, made = [], []
    real_get_backend, real_preflight = sandbox.api.get_backend, flows.train.preflight

    def counting_get_backend(*a, **kw):
        if threading.current_thread().name not in ("score-during-rollout", "eval-scoring"):
            tries.append(time.perf_counter())           # the stage's own attempts (a helper's is redone by it)
        return real_get_backend(*a, **kw)

    def preflight_then_stop(c):
        real_preflight(c)                                          # the engine and the images are there ...
        stop_engine()                                              # ... and then the engine is gone
        made.extend(sandbox.api._BACKENDS.values())     # preflight's reference check made one: the stages make
        sandbox.api._BACKENDS.clear()                   # theirs anew, as a Prefect worker or a resumed process does
        tries.clear()
    monkeypatch.setattr(sandbox.api, "get_backend", counting_get_backend)
    monkeypatch.setattr(flows.train, "preflight", preflight_then_stop)
    with engine_restored():
        capsys.readouterr()
        t0 = time.perf_counter()
        code = main(["train", "--config", str(tmp_path / "t.yaml")])
        took = time.perf_counter() - t0
        _, err = capsys.readouterr()
        line = assert_fails_with_one_line(code, err, ["the Docker engine", "does not answer", "infra/setup_docker.sh",
                                                  "local sandbox backend", "grpo resume t"])
        attempts = len(tries)
        assert attempts == retry["retries"] + 1, tries                  # retried, a bounded number of times
        assert run_status(tmp_path / "runs" / "t")["status"] == "failed"
        start_engine()
    monkeypatch.setattr(flows.train, "preflight", real_preflight)
    capsys.readouterr()
    assert main(["resume", "t", "--output-dir", str(tmp_path / "runs")]) == 0, capsys.readouterr().err
    assert run_status(tmp_path / "runs" / "t")["status"] == "finished"
    for be in [*made, sandbox.api.get_backend("docker")]:
        be.close()
    assert sandbox_containers(f"grpo.sandbox.owner={socket.gethostname()}:{os.getpid()}") == []
    print(f"\nengine gone for good: {attempts} attempts, failed after {took:.1f} s with\n  {line}\n"
          f"resumed to the end once the engine was back")



# -- 2. the MLflow server restarts mid-run ------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """`mlflow server` on SQLite in a child process group, on a fixed port, that can be killed and started again."""

    def __init__(self, root: Path):
        self.root, self.port, self.proc = root, free_port(), None
        self.uri = f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180) -> float:
        t0 = time.perf_counter()
        log = open(self.root / "mlflow-server.log", "a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
             "--artifacts-destination", str(self.root / "artifacts"), "--host", "127.0.0.1",
             "--port", str(self.port), "--workers", "1"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_until(self.healthy, timeout, "the MLflow server", step=0.25)
        return time.perf_counter() - t0

    def healthy(self) -> bool:
        import urllib.request
        assert self.proc.poll() is None, (self.root / "mlflow-server.log").read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL the whole server (no goodbye to requests in flight)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


def metric_points(uri: str, run_id: str) -> list[tuple[str, int]]:
    """Every (metric, step) the run holds, duplicates included."""
    from mlflow.tracking import MlflowClient
    c = MlflowClient(tracking_uri=uri)
    return sorted((k, m.step) for k in c.get_run(run_id).data.metrics for m in c.get_metric_history(run_id, k))


class RestCalls:
    """Every MLflow REST call this process makes (mlflow.utils.rest_utils.http_request, which each client call
    goes through): when it started, when it returned, whether the server answered 200, and how many are in
    flight now. Watches, changes nothing."""

    def __init__(self, monkeypatch):
        from mlflow.utils import rest_utils
        self.started: list[float] = []
        self.done: list[tuple[float, float, str, bool]] = []
        self.in_flight = 0
        lock = threading.Lock()
        real = rest_utils.http_request

        def recorded(*args, **kwargs):
            t0 = time.perf_counter()
            with lock:
                self.started.append(t0)
                self.in_flight += 1
            ok = False
            try:
                response = real(*args, **kwargs)
                ok = response.status_code == 200
                return response
            finally:
                with lock:
                    self.in_flight -= 1
                    self.done.append((t0, time.perf_counter(), str(kwargs.get("endpoint", "")), ok))
        monkeypatch.setattr(rest_utils, "http_request", recorded)

    def made_since(self, t: float) -> bool:
        """A call started after `t`, or one is in flight now (after a kill at `t`: waiting on the dead server)."""
        return self.in_flight > 0 or any(s > t for s in self.started)


@pytest.mark.slow
def test_mlflow_server_restarted_mid_run_loses_and_doubles_nothing(tmp_path, grpo_home, prefect_engine, mlflow_uri,
                                                                   monkeypatch):
    """A tiny run logs to a real `mlflow server`; when iteration 1's update record appears the server is
    SIGKILLed, and started again on the same port and store once a tracking call is waiting on the dead
    server (made after the kill, or in flight at it; and 2 s more). That call waits and is answered by the
    restarted server; the run completes; its
    MLflow record holds every (metric, step) of an uninterrupted run (same config, local store) exactly once,
    and its artifacts."""
    from flows.train import training_run
    from tests.test_kill_matrix import artifacts
    (tmp_path / "server").mkdir()
    server = MlflowServer(tmp_path / "server")
    first_start = server.start()
    opts = dict(pipeline_iterations=2, reward_funcs=["accuracy", "format", "overlong"], max_completion_length=12,
                overlong_buffer_length=10)
    cfg = tiny_config(tmp_path, run_name="m", output_dir=str(tmp_path / "runs"),
                      tracking=dict(tracking_uri=server.uri), **opts)
    calls = RestCalls(monkeypatch)
    timings = {}

    def restart_mid_run():
        wait_until((tmp_path / "runs" / "m" / "iter-1" / "update.json").exists, 600, "iteration 1's update")
        server.kill()
        timings["killed"] = t0 = time.perf_counter()
        wait_until(lambda: calls.made_since(t0), 300, "a tracking call to the dead server")
        time.sleep(2.0)                                  # the call is in its retries now
        timings["restart"] = server.start()
        timings["back"] = time.perf_counter()
        timings["down"] = timings["back"] - t0

    try:
        restarter = threading.Thread(target=restart_mid_run, daemon=True)
        restarter.start()
        t0 = time.perf_counter()
        summary = training_run(cfg)
        took = time.perf_counter() - t0
        restarter.join(300)
        assert "down" in timings, "the server was not restarted during the run"
        got = metric_points(server.uri, summary["mlflow_run_id"])
        got_artifacts = artifacts(server.uri, summary["mlflow_run_id"])
    finally:
        server.kill()
    # a call made while the server was dead (or in flight when it was killed) waited for it and got its answer
    # from the restarted server
    waited = [c for c in calls.done if c[0] < timings["back"] - 2.0 and c[1] > timings["back"]]
    assert any(ok for *_, ok in waited), (waited, timings)
    ref = training_run(tiny_config(tmp_path, run_name="m", output_dir=str(tmp_path / "ref"), **opts))
    want = metric_points(mlflow_uri, ref["mlflow_run_id"])
    assert len(got) == len(set(got)), sorted({p for p in got if got.count(p) > 1})    # no step twice
    assert got == want                                                               # nothing missing
    assert got_artifacts == artifacts(mlflow_uri, ref["mlflow_run_id"])
    print(f"\nMLflow server killed after iteration 1's update, down {timings['down']:.1f} s (restart "
          f"{timings['restart']:.1f} s; first start {first_start:.1f} s); {len(waited)} call(s) made while it was "
          f"down waited for it ({', '.join(sorted({e for _, _, e, _ in waited}))}); the run took {took:.1f} s; "
          f"{len(got)} metric points over {len({k for k, _ in got})} metrics, each exactly once, as uninterrupted")


# -- 3. the disk fills up while a checkpoint is written ----------------------------------------------------

@contextlib.contextmanager
def small_tmpfs(where: Path, size_mb: int):
    """A tmpfs of `size_mb` MiB mounted at `where` for the block (skips where mounting is not permitted)."""
    where.mkdir(parents=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode}): needs root and "
                    "CAP_SYS_ADMIN")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], check=True)      # something still holds a file open


def tree_digest(root: Path) -> dict[str, str]:
    import hashlib
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file()}


@pytest.mark.slow
def test_disk_full_while_writing_a_checkpoint(tmp_path, grpo_home, prefect_engine, mlflow_uri, capsys, monkeypatch):
    """The run's output_dir is a small tmpfs; just before iteration 2's checkpoint is written, the disk is
    filled to within half a checkpoint. The write fails: `grpo train` prints one line naming the path, the
    full filesystem and the fix (no retry: a full disk stays full); iteration 1's checkpoint is unchanged and
    loads; no temp or half-written checkpoint remains. Space freed, `grpo resume` finishes the run."""
    import yaml
    from safetensors.torch import load_file
    import torch
    from flows.cli.main import main
    from tasks import update as update_stage
    from tasks.run_state import run_status
    from tests.faults import leftovers
    with small_tmpfs(tmp_path / "small-disk", 64) as disk:
        cfg = tiny_config(tmp_path, run_name="t", output_dir=str(disk), pipeline_iterations=2, eval=dict(enabled=False),
                          stages=dict(update=dict(retries=2, retry_delay_seconds=0)))
        (tmp_path / "t.yaml").write_text(yaml.safe_dump(cfg))
        run_dir, filler = disk / "t", disk / "filler"
        real_save, writes = update_stage.save_checkpoint, []

        def fill_then_save(policy, optimizer, scheduler, global_step, out):
            writes.append(Path(out).parent.name)
            if writes == ["iter-1", "iter-2"]:                    # iteration 2's first write: fill the disk
                ckpt = sum(p.stat().st_size for p in (run_dir / "iter-1" / "update").rglob("*") if p.is_file())
                left = max(4096, ckpt // 2)              # room for less than half a checkpoint
                filler.write_bytes(b"\0" * max(0, shutil.disk_usage(disk).free - left))
            return real_save(policy, optimizer, scheduler, global_step, out)
        monkeypatch.setattr(update_stage, "save_checkpoint", fill_then_save)
        capsys.readouterr()
        code = main(["train", "--config", str(tmp_path / "t.yaml")])
        _, err = capsys.readouterr()
        line = assert_fails_with_one_line(code, err, ["no space left on device", str(run_dir / "iter-2" / "update"),
                                                  f"the filesystem at {disk} is full", f"Fix: free space on {disk}",
                                                  "grpo resume t"])
        assert writes == ["iter-1", "iter-2"]                                  # not retried: still full
        prev = run_dir / "iter-1" / "update"
        before = tree_digest(prev)
        assert not (run_dir / "iter-2" / "update").exists() and not (run_dir / "iter-2" / "update.json").exists()
        assert leftovers(run_dir) == []                                        # no temp, nothing half-written
        assert run_status(run_dir)["status"] == "failed"
        assert load_file(prev / "checkpoint" / "adapter_model.safetensors")    # the previous checkpoint loads
        assert torch.load(prev / "trainer_state.pt", weights_only=False)["global_step"] == 1

        filler.unlink()                                                        # space freed: resume
        capsys.readouterr()
        t0 = time.perf_counter()
        assert main(["resume", "t", "--output-dir", str(disk)]) == 0, capsys.readouterr().err
        resume_s = time.perf_counter() - t0
        assert tree_digest(prev) == before                                     # untouched by the resume too
        assert (run_dir / "iter-2" / "update" / "checkpoint" / "adapter_model.safetensors").exists()
        assert run_status(run_dir)["status"] == "finished" and leftovers(run_dir) == []
    print(f"\ndisk full at iteration 2's checkpoint:\n  {line}\nresumed in {resume_s:.1f} s once space was freed")


# -- 4. the sandbox under load ------------------------------------------------------------------------------

LOAD_KINDS = {          # kind -> (code, limits, the verdict it must get)
    "pass": ("def f(a, b):\n    return a + b\n", {}, "pass"),
    "fail": ("def f(a, b):\n    return a - b\n", {}, "fail"),
    "timeout": ("def f(a, b):\n    while True:\n        pass\n", {"timeout_s": 1}, "timeout"),
    "memory-bomb": ("def f(a, b):\n    x = []\n    while True:\n        x.append(bytearray(16 << 20))\n",
                    {"memory_mb": 128}, "error"),
}
LOAD_MIX = {"pass": 200, "fail": 150, "timeout": 75, "memory-bomb": 75}


@pytest.mark.docker
@pytest.mark.slow
def test_sandbox_under_load_gives_every_job_one_right_verdict():
    """500 jobs (pass, fail, timeout, memory bomb; shuffled) on 4x as many workers as cores: one verdict per
    job, in order, each with the status of its kind; the throughput is printed; no container survives."""
    import random
    from collections import Counter
    from dataclasses import replace
    need_docker()
    from sandbox.docker_backend import DockerBackend
    kinds = [k for k, n in LOAD_MIX.items() for _ in range(n)]
    random.Random(0).shuffle(kinds)
    jobs = []
    for i, kind in enumerate(kinds):
        code, limits, _ = LOAD_KINDS[kind]
        jobs.append(replace(py_job(code, [((1, 2), 3), ((2, 2), 4)], **limits), id=f"{kind}/{i}"))
    workers = 4 * (os.cpu_count() or 1)
    be = DockerBackend()
    try:
        t0 = time.perf_counter()
        verdicts = be.score_batch(jobs, workers=workers)
        took = time.perf_counter() - t0
    finally:
        be.close()
    assert [v.job_id for v in verdicts] == [j.id for j in jobs]          # exactly one verdict per job, in order
    wrong = [(j.id, v.status, v.detail) for j, v in zip(jobs, verdicts) if v.status != LOAD_KINDS[j.id.split("/")[0]][2]]
    assert not wrong, f"{len(wrong)} wrong verdicts, e.g. {wrong[:5]}"
    assert sandbox_containers(f"grpo.sandbox.instance={be.instance}") == []
    by_kind = {k: [v.duration_s for j, v in zip(jobs, verdicts) if j.id.startswith(k + "/")] for k in LOAD_MIX}
    print(f"\nsandbox under load: {len(jobs)} jobs {dict(Counter(v.status for v in verdicts))} on {workers} workers "
          f"({os.cpu_count()} cores) in {took:.1f} s = {len(jobs) / took:.1f} jobs/s; mean seconds per job: "
          + ", ".join(f"{k} {sum(d) / len(d):.2f}" for k, d in by_kind.items()) + "; no container left")
