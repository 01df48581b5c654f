"""The shared stack (infra/docker-compose.yml, `grpo infra`), for real.

Fast: the env file (secrets generated once, mode 600, ports on 127.0.0.1 unless exposed), the compose file
as compose resolves it with that env file, and the one-line errors.
Slow (marked stack, slow, docker): `grpo infra up --auth` from the locally built images on a fresh compose
project and ports of its own; unauthenticated requests refused and authenticated ones accepted; a
configs/tiny.yaml run sent through the work pool (`grpo schedule --work-pool` in the worker, `prefect deployment
run` from here) lands in the PostgreSQL-backed MLflow server with its metrics and adapter; a second run with
the MLflow container restarted mid-run finishes with exactly the same metric points and artifacts. The
stack is taken down with its volumes at the end. Requests go only to 127.0.0.1 ports this test published.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import socket
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from base64 import b64encode
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from flows import stack as stk

BIN = Path(sys.executable).parent
GRPO, PREFECT = str(BIN / "grpo"), str(BIN / "prefect")
DEPLOYMENT = "grpo-training-run/stack-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _compose_or_skip() -> list[str]:
    try:
        return stk.compose_command()
    except stk.StackError as e:
        pytest.skip(str(e))


# -- fast: settings, compose file, errors -------------------------------------------------------------------

def test_settings_generate_secrets_once_into_a_private_file(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_HOME", str(tmp_path))
    first = stk.stack_settings("p1", prefect_port=4300)
    path = stk.env_path("p1")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert first["GRPO_STACK_BIND"] == "127.0.0.1" and first["GRPO_STACK_AUTH"] == "0"
    assert all(len(first[k]) >= 24 for k in stk.SECRETS)
    again = stk.stack_settings("p1", expose=True, public_host="stack.example")
    assert {k: again[k] for k in stk.SECRETS} == {k: first[k] for k in stk.SECRETS}     # kept, never regenerated
    assert (again["GRPO_STACK_BIND"], again["GRPO_STACK_AUTH"], again["PREFECT_PORT"]) == ("0.0.0.0", "1", "4300")
    assert stk.read_env(path) == again and stat.S_IMODE(path.stat().st_mode) == 0o600
    other = stk.stack_settings("p2")
    assert other["POSTGRES_PASSWORD"] != first["POSTGRES_PASSWORD"]                     # per project
    exports = "\n".join(stk.client_exports("p1", again))
    assert "PREFECT_API_URL=http://stack.example:4300/api" in exports
    assert again["MLFLOW_ADMIN_PASSWORD"] not in exports and str(path) in exports       # by reference, not value
    assert again["MLFLOW_ADMIN_PASSWORD"] in "\n".join(stk.client_exports("p1", again, show_secrets=True))


def _resolved(project: str) -> dict:
    r = subprocess.run([*_compose_or_skip(), "-p", project, "--env-file", str(stk.env_path(project)), "-f",
                        str(stk.COMPOSE_FILE), "config"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return yaml.safe_load(r.stdout)["services"]


def _published(service: dict) -> list[tuple[str, str]]:
    """(host ip, host port) of each published port, in either compose version's long or short syntax."""
    out = []
    for p in service.get("ports", []):
        if isinstance(p, dict):
            out.append((p.get("host_ip", ""), str(p.get("published"))))
        else:
            ip, port, _ = str(p).rsplit(":", 2)
            out.append((ip, port))
    return out


def test_compose_file_binds_loopback_and_takes_every_secret_from_the_env_file(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_HOME", str(tmp_path))
    values = stk.stack_settings("local", prefect_port=4301, mlflow_port=5001)
    services = _resolved("local")
    assert _published(services["prefect-server"]) == [("127.0.0.1", "4301")]
    assert _published(services["mlflow"]) == [("127.0.0.1", "5001")]
    assert not services["postgres"].get("ports") and not services["worker"].get("ports")
    text = json.dumps(services)
    assert values["POSTGRES_PASSWORD"] in text and ":grpo@" not in text     # no default password left anywhere
    assert services["worker"]["environment"]["PREFECT_API_AUTH_STRING"] == values["PREFECT_AUTH_STRING"]
    stk.stack_settings("local", expose=True, public_host="stack.example")
    exposed = _resolved("local")
    assert _published(exposed["mlflow"]) == [("0.0.0.0", "5001")]
    assert exposed["mlflow"]["environment"]["GRPO_STACK_AUTH"] == "1"
    allowed = " ".join(exposed["mlflow"]["command"]).split("--allowed-hosts ")[1].split()[0].strip('"').split(",")
    for host in ["stack.example", *stk._host_addresses(), "127.0.0.1"]:    # by name or by address, not others
        assert host in allowed and f"{host}:*" in allowed, (host, allowed)
    assert "*" not in allowed and "0.0.0.0" not in allowed


def test_compose_refuses_to_start_without_generated_passwords(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "POSTGRES_PASSWORD"}
    r = subprocess.run([*_compose_or_skip(), "-p", "nopass", "--project-directory", str(tmp_path), "-f",
                        str(stk.COMPOSE_FILE), "config"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode != 0 and "grpo infra up" in r.stderr


def test_missing_compose_is_one_line_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))           # neither docker nor docker-compose on it
    with pytest.raises(stk.StackError, match="apt-get install docker-compose"):
        stk.compose_command()
    r = subprocess.run([sys.executable, "-m", "flows.cli", "infra", "status"], capture_output=True, text=True,
                       env={**os.environ, "PATH": str(tmp_path)}, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: neither `docker compose`"), r.stderr


# -- slow: the stack, up for real ---------------------------------------------------------------------------

@dataclass
class Stack:
    project: str
    env: dict               # the environment `grpo infra` ran with (GRPO_HOME holds the env file)
    values: dict            # the env file
    prefect: str            # http://127.0.0.1:port
    mlflow: str
    up_seconds: float

    @property
    def mlflow_auth(self) -> tuple[str, str]:
        return self.values["MLFLOW_ADMIN_USERNAME"], self.values["MLFLOW_ADMIN_PASSWORD"]

    @property
    def prefect_auth(self) -> tuple[str, str]:
        user, _, password = self.values["PREFECT_AUTH_STRING"].partition(":")
        return user, password

    def container(self, service: str) -> str:
        out = subprocess.run(["docker", "ps", "-q", "--filter", f"label=com.docker.compose.project={self.project}",
                              "--filter", f"label=com.docker.compose.service={service}"],
                             capture_output=True, text=True, timeout=30).stdout.split()
        assert len(out) == 1, f"{service}: {out}"
        return out[0]

    def logs(self, service: str, lines: int = 60) -> str:
        r = subprocess.run(["docker", "logs", "--tail", str(lines), self.container(service)], capture_output=True,
                           text=True, timeout=30)
        return f"--- {service} logs ---\n{r.stdout}{r.stderr}"


def http(method: str, url: str, auth: tuple[str, str] | None = None, body: dict | None = None,
         timeout: float = 30) -> tuple[int, dict | None]:
    """One request (no retry): (status, JSON body or None); status 0 when nothing answered in time."""
    req = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    if auth:
        req.add_header("Authorization", "Basic " + b64encode(":".join(auth).encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw.startswith((b"{", b"[")) else None     # /health: "OK"
    except urllib.error.HTTPError as e:
        return e.code, None
    except OSError:
        return 0, None


def poll(what: str, check, timeout: float, every: float = 3.0):
    """Call check() every `every` s until it returns something truthy; at most `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def _need_engine() -> None:
    if subprocess.run(["docker", "info"], capture_output=True).returncode == 0:
        return
    if os.environ.get("REQUIRE_DOCKER") == "1":
        pytest.fail("REQUIRE_DOCKER=1 but no Docker engine answers")
    pytest.skip("no Docker engine answers")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """`grpo infra up --auth` on a project and ports of its own (images built first if missing); down with
    its volumes afterwards, whatever happened."""
    _need_engine()
    if os.environ.get("REQUIRE_DOCKER") != "1":
        _compose_or_skip()
    project = f"grpo-test-{secrets.token_hex(4)}"
    env = {**os.environ, "GRPO_HOME": str(tmp_path_factory.mktemp("stack_home"))}
    prefect_port, mlflow_port = _free_port(), _free_port()
    infra = [GRPO, "infra", "--project-name", project]
    t0 = time.perf_counter()
    try:
        r = subprocess.run([*infra, "up", "--auth", "--prefect-port", str(prefect_port), "--mlflow-port",
                            str(mlflow_port), "--timeout", "600"], env=env, capture_output=True, text=True,
                           timeout=3300)
        up_seconds = time.perf_counter() - t0
        assert r.returncode == 0, r.stdout + r.stderr[-5000:]
        print(f"\n`grpo infra up` ({project}): {up_seconds:.0f}s\n{r.stdout}")
        yield Stack(project, env, stk.read_env(Path(env["GRPO_HOME"]) / "stack" / f"{project}.env"),
                    f"http://127.0.0.1:{prefect_port}", f"http://127.0.0.1:{mlflow_port}", up_seconds)
    finally:
        subprocess.run([*infra, "down", "--volumes"], env=env, capture_output=True, timeout=300)


@pytest.mark.stack
@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.timeout(3600)
def test_stack_is_up_private_and_refuses_unauthenticated_requests(stack):
    r = subprocess.run([GRPO, "infra", "--project-name", stack.project, "status"], env=stack.env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert all(f"{s} " in r.stdout for s in stk.SERVICES) and "FAIL" not in r.stdout
    assert f"PREFECT_API_URL={stack.prefect}/api" in r.stdout and "credentials accepted" in r.stdout
    env_file = Path(stack.env["GRPO_HOME"]) / "stack" / f"{stack.project}.env"
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600

    # Ports: the servers on 127.0.0.1 only, PostgreSQL not published at all.
    for service in ("prefect-server", "mlflow", "postgres"):
        bindings = json.loads(subprocess.run(["docker", "inspect", "-f", "{{json .HostConfig.PortBindings}}",
                                              stack.container(service)], capture_output=True, text=True).stdout)
        assert all(b["HostIp"] == "127.0.0.1" for bs in (bindings or {}).values() for b in bs), (service, bindings)
        assert bool(bindings) == (service != "postgres"), (service, bindings)

    # MLflow's basic-auth app: no credentials or wrong ones are refused, the generated ones accepted.
    api = f"{stack.mlflow}/api/2.0/mlflow/experiments/search?max_results=1"
    assert http("GET", api)[0] == 401
    assert http("GET", api, auth=(stack.mlflow_auth[0], "wrong"))[0] == 401
    assert http("GET", api, auth=stack.mlflow_auth)[0] == 200
    # the server remembers verified logins for a while (mlflow-auth.ini): a wrong password stays refused after a
    # right one, on each of its workers
    for _ in range(4):
        assert http("GET", api, auth=stack.mlflow_auth)[0] == 200
        assert http("GET", api, auth=(stack.mlflow_auth[0], stack.mlflow_auth[1] + "x"))[0] == 401
    assert http("GET", f"{stack.mlflow}/health")[0] == 200                    # open for health probes
    # Prefect's auth string: the same.
    api = f"{stack.prefect}/api/flows/filter"
    assert http("POST", api, body={})[0] == 401
    assert http("POST", api, auth=(stack.prefect_auth[0], "wrong"), body={})[0] == 401
    assert http("POST", api, auth=stack.prefect_auth, body={})[0] == 200
    assert http("GET", f"{stack.prefect}/api/health")[0] == 200


# -- the training run through the work pool ------------------------------------------------------------------

def trigger_run(stack: Stack) -> str:
    """`prefect deployment run` from this machine, as a client with the stack's exports -> flow run id."""
    env = {**stack.env, "PREFECT_API_URL": f"{stack.prefect}/api", "PREFECT_API_AUTH_STRING":
           stack.values["PREFECT_AUTH_STRING"], "PREFECT_HOME": str(Path(stack.env["GRPO_HOME"]) / "prefect")}
    r = subprocess.run([PREFECT, "deployment", "run", DEPLOYMENT], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return re.search(r"UUID:\s*([0-9a-f-]{36})", r.stdout).group(1)


def wait_flow_run(stack: Stack, flow_run_id: str, timeout: float = 1200) -> dict:
    def finished():
        code, fr = http("GET", f"{stack.prefect}/api/flow_runs/{flow_run_id}", auth=stack.prefect_auth)
        assert code == 200, code
        if fr["state_type"] in ("FAILED", "CRASHED", "CANCELLED"):
            raise AssertionError(f"flow run {fr['state_type']}: {fr['state']}\n{stack.logs('worker')}")
        return fr if fr["state_type"] == "COMPLETED" else None
    return poll(f"flow run {flow_run_id}", finished, timeout)


def mlflow_run(stack: Stack, flow_run_id: str) -> dict | None:
    code, exp = http("GET", f"{stack.mlflow}/api/2.0/mlflow/experiments/get-by-name?experiment_name=grpo-pipeline",
                     auth=stack.mlflow_auth)
    if code != 200:
        return None
    code, found = http("POST", f"{stack.mlflow}/api/2.0/mlflow/runs/search", auth=stack.mlflow_auth,
                       body={"experiment_ids": [exp["experiment"]["experiment_id"]],
                             "filter": f"tags.prefect_flow_run_id = '{flow_run_id}'"})
    runs = (found or {}).get("runs", [])
    return runs[0] if code == 200 and runs else None


def metric_points(stack: Stack, run: dict) -> list[tuple[str, int]]:
    """Every (metric, step) the run holds, duplicates included, through the REST API."""
    run_id, points = run["info"]["run_id"], []
    for key in sorted({m["key"] for m in run["data"].get("metrics", [])}):
        code, hist = http("GET", f"{stack.mlflow}/api/2.0/mlflow/metrics/get-history?run_id={run_id}&metric_key="
                          + urllib.request.quote(key, safe=""), auth=stack.mlflow_auth)
        assert code == 200, (key, code)
        points += [(key, int(m.get("step", 0))) for m in hist["metrics"]]
    return sorted(points)


def artifact_files(stack: Stack, run_id: str, path: str = "") -> dict[str, int]:
    """{artifact path: size} of every file under `path`, walking the listing endpoint."""
    code, listing = http("GET", f"{stack.mlflow}/api/2.0/mlflow/artifacts/list?run_id={run_id}&path={path}",
                         auth=stack.mlflow_auth)
    assert code == 200, code
    files = {}
    for f in (listing or {}).get("files", []):
        if f["is_dir"]:
            files.update(artifact_files(stack, run_id, f["path"]))
        else:
            files[f["path"]] = int(f.get("file_size", 0))
    return files


def rows_in_postgres(stack: Stack, run_id: str) -> int:
    """Metric rows of the run in the `mlflow` database, read with psql inside the postgres container."""
    r = subprocess.run(["docker", "exec", stack.container("postgres"), "psql", "-U", "grpo", "-d", "mlflow", "-tAc",
                        f"SELECT count(*) FROM metrics WHERE run_uuid = '{run_id}'"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return int(r.stdout.strip())


@pytest.mark.stack
@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.timeout(3600)
def test_training_run_through_the_work_pool_lands_in_mlflow_and_survives_its_restart(stack):
    # 1) the deployment, registered from the worker (its flow code and paths are the image's)
    r = subprocess.run(["docker", "exec", stack.container("worker"), "grpo", "schedule", "--cron", "0 3 * * *",
                        "--config", "/opt/grpo-pipeline/configs/tiny.yaml", "--work-pool", "gpu-pool",
                        "--name", "stack-test"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr

    # 2) run A, uninterrupted: its run, metrics and adapter are in the PostgreSQL-backed server
    t0 = time.perf_counter()
    run_a_id = trigger_run(stack)
    wait_flow_run(stack, run_a_id)
    took_a = time.perf_counter() - t0
    run_a = mlflow_run(stack, run_a_id)
    assert run_a and run_a["info"]["status"] == "FINISHED"
    points_a = metric_points(stack, run_a)
    keys = {k for k, _ in points_a}
    assert {"train/loss", "reward/mean", "eval/greedy/pass_at_1"} <= keys, sorted(keys)
    assert len(points_a) == len(set(points_a))
    assert rows_in_postgres(stack, run_a["info"]["run_id"]) == len(points_a)
    files_a = artifact_files(stack, run_a["info"]["run_id"])
    last = max(int(p.split("/")[1].split("-")[1]) for p in files_a if p.startswith("adapters/iter-"))
    assert files_a.get(f"adapters/iter-{last}/adapter_config.json", 0) > 0, sorted(files_a)
    assert files_a.get(f"adapters/iter-{last}/adapter_model.safetensors", 0) > 0, sorted(files_a)

    # 3) run B: the MLflow container restarted once the first update is logged; nothing lost, nothing twice
    t0 = time.perf_counter()
    run_b_id = trigger_run(stack)

    def first_update_logged():
        run = mlflow_run(stack, run_b_id)
        return run if run and any(m["key"] == "train/loss" for m in run["data"].get("metrics", [])) else None
    running = poll("run B's first update in MLflow", first_update_logged, 900, every=1.0)
    assert running["info"]["status"] == "RUNNING"
    t_restart = time.perf_counter()
    subprocess.run(["docker", "restart", "-t", "10", stack.container("mlflow")], check=True, timeout=120)
    poll("MLflow back", lambda: http("GET", f"{stack.mlflow}/health", timeout=5)[0] == 200, 300, every=1.0)
    down_s = time.perf_counter() - t_restart
    wait_flow_run(stack, run_b_id)
    took_b = time.perf_counter() - t0
    run_b = mlflow_run(stack, run_b_id)
    assert run_b["info"]["status"] == "FINISHED"
    points_b = metric_points(stack, run_b)
    assert len(points_b) == len(set(points_b)), sorted({p for p in points_b if points_b.count(p) > 1})
    assert points_b == points_a                                          # every (metric, step), exactly once
    assert rows_in_postgres(stack, run_b["info"]["run_id"]) == len(points_b)
    # run A, the first champion, also stored the promotion gate's frozen set (gate/<model>-<hash>.jsonl)
    assert len([f for f in files_a if f.startswith("gate/")]) == 1, sorted(files_a)
    assert sorted(artifact_files(stack, run_b["info"]["run_id"])) == sorted(f for f in files_a if not f.startswith("gate/"))
    print(f"\nrun A through the work pool: {took_a:.0f}s; run B {took_b:.0f}s with MLflow restarted mid-run "
          f"(restart until healthy {down_s:.0f}s); {len(points_b)} metric points over {len(keys)} metrics, "
          f"{len(files_a)} artifact files, in PostgreSQL")
