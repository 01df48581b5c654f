"""The shared stack of infra/docker-compose.yml (PostgreSQL, Prefect server, MLflow server, a worker):
build its images, bring it up, check it, take it down. `grpo infra up|status|down` is the command line.

Images: where none are here and a registry answers, the upstream `postgres` and `prefecthq/prefect` images
are pulled and the project image is built from `python:3.11-slim` with PyPI. Where no registry answers,
everything is built here, offline: a Debian bookworm base by debootstrap (sandbox.images), PostgreSQL
from Debian's package on top of it (infra/postgres), and the project image (infra/worker/Dockerfile) installing
from a wheelhouse that `pip wheel` builds on the host from this machine's package index.

Settings and secrets live in one env file per compose project (mode 600, written atomically), passed to
compose with --env-file: passwords are generated on the first `up` and kept; ports, bind address, auth
and image names are what the last `up` chose. What this does not do: TLS (put a reverse proxy in front
when exposing the stack beyond a trusted network), or user management beyond MLflow's admin.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import json
import secrets
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from base64 import b64encode
from dataclasses import dataclass
from pathlib import Path

from grpo_core.io import atomic_write_text
from sandbox.images import ImageBuildError, debootstrap_import, image_exists, registry_reachable

REPO_ROOT = Path(__file__).resolve().parent.parent
INFRA = REPO_ROOT / "infra"
COMPOSE_FILE = INFRA / "docker-compose.yml"
WHEELHOUSE = INFRA / "wheelhouse"
DEFAULT_PROJECT = "grpo-stack"
SERVICES = ("postgres", "prefect-server", "mlflow", "worker")

# The images built here when no registry answers; the offline base carries Python 3.11 and PostgreSQL 15.
LOCAL_IMAGES = {"GRPO_BASE_IMAGE": "grpo-stack-base:1", "POSTGRES_IMAGE": "grpo-stack-postgres:1",
                "GRPO_IMAGE": "grpo-pipeline-worker:latest", "PREFECT_IMAGE": "grpo-pipeline-worker:latest"}
UPSTREAM_IMAGES = {"GRPO_BASE_IMAGE": "python:3.11-slim", "POSTGRES_IMAGE": "postgres:16",
                   "GRPO_IMAGE": "grpo-pipeline-worker:latest", "PREFECT_IMAGE": "prefecthq/prefect:3-python3.11"}
BASE_PACKAGES = ["python3", "python3-venv", "postgresql"]
BASE_CHANGES = ["ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "ENV LANG=C.UTF-8"]
# Generated on the first `up`, never changed afterwards (the databases hold them).
SECRETS = ("POSTGRES_PASSWORD", "MLFLOW_ADMIN_PASSWORD", "MLFLOW_FLASK_SECRET_KEY", "PREFECT_AUTH_STRING")


class StackError(RuntimeError):
    """Something the user can fix: the message says what and how."""


def _log(msg: str) -> None:
    print(f"[grpo infra] {msg}", file=sys.stderr, flush=True)


# -- the env file: settings and secrets ---------------------------------------------------------------------

def env_path(project: str) -> Path:
    from grpo_core.io import grpo_home
    return grpo_home() / "stack" / f"{project}.env"


def read_env(path: Path) -> dict[str, str]:
    if not path.exists():
        return {}
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if "=" in line and not line.startswith("#"))
    return {k.strip(): v.strip() for k, v in pairs}


def write_env(path: Path, values: dict[str, str]) -> None:
    """Atomically, mode 600 (the temp file is created 600 and renamed into place)."""
    lines = ["# The shared stack's settings and secrets (grpo infra up). Keep it private: mode 600."]
    lines += [f"{k}={v}" for k, v in values.items()]
    atomic_write_text(path, "\n".join(lines) + "\n")
    path.chmod(0o600)


def stack_settings(project: str, *, expose: bool = False, auth: bool = False, prefect_port: int | None = None,
                   mlflow_port: int | None = None, public_host: str | None = None,
                   images: dict[str, str] | None = None) -> dict[str, str]:
    """The project's env file, created (secrets generated) or updated with this `up`'s choices; returns it."""
    path = env_path(project)
    values = read_env(path)
    for name in SECRETS:
        if not values.get(name):
            values[name] = ("admin:" if name == "PREFECT_AUTH_STRING" else "") + secrets.token_urlsafe(24)
    values.setdefault("MLFLOW_ADMIN_USERNAME", "admin")
    values["GRPO_STACK_BIND"] = "0.0.0.0" if expose else "127.0.0.1"
    values["GRPO_STACK_AUTH"] = "1" if (expose or auth) else "0"      # exposed means authenticated
    values["GRPO_STACK_HOST"] = (public_host or _public_name()) if expose else "127.0.0.1"
    values["MLFLOW_ALLOWED_HOSTS"] = mlflow_allowed_hosts(values["GRPO_STACK_HOST"], expose)
    values["PREFECT_PORT"] = str(prefect_port or values.get("PREFECT_PORT") or 4200)
    values["MLFLOW_PORT"] = str(mlflow_port or values.get("MLFLOW_PORT") or 5000)
    values.update(images or {})
    write_env(path, values)
    return values


def _host_addresses() -> list[str]:
    """This machine's non-loopback IPv4 addresses: what a remote client may type instead of its name."""
    import socket
    found: set[str] = set()
    with contextlib.suppress(OSError):
        found.update(a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET))
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))            # picks the default route's address; a UDP connect sends nothing
        found.add(probe.getsockname()[0])
    return sorted(a for a in found if not a.startswith("127.") and a != "0.0.0.0")


def _public_name() -> str:
    """The name clients use for this machine when exposed: its FQDN, or its address when it has no real name."""
    import socket
    name = socket.getfqdn()
    if name.split(".")[0] in ("localhost", "") or name.startswith("127."):
        return next(iter(_host_addresses()), name)
    return name


def mlflow_allowed_hosts(public_host: str, expose: bool) -> str:
    """MLflow's --allowed-hosts (it refuses other Host headers, against DNS rebinding): the compose network
    name and loopback, and when exposed the public name and every address of this machine."""
    names = ["mlflow", "localhost", "127.0.0.1"]
    if expose:
        names += [public_host, *_host_addresses()]
    names = list(dict.fromkeys(names))
    return ",".join(f"{n},{n}:*" for n in names)


def client_exports(project: str, values: dict[str, str], show_secrets: bool = False) -> list[str]:
    """The `export` lines a client (grpo train, prefect, mlflow) needs; secrets are read from the env file
    by the shell unless show_secrets."""
    host = "127.0.0.1" if values.get("GRPO_STACK_BIND", "127.0.0.1") == "127.0.0.1" else values["GRPO_STACK_HOST"]
    lines = [f"export PREFECT_API_URL=http://{host}:{values['PREFECT_PORT']}/api",
             f"export MLFLOW_TRACKING_URI=http://{host}:{values['MLFLOW_PORT']}"]
    if values.get("GRPO_STACK_AUTH") == "1":
        def secret(name: str) -> str:
            return values[name] if show_secrets else f"\"$(sed -n 's/^{name}=//p' '{env_path(project)}')\""
        lines += [f"export PREFECT_API_AUTH_STRING={secret('PREFECT_AUTH_STRING')}",
                  f"export MLFLOW_TRACKING_USERNAME={values['MLFLOW_ADMIN_USERNAME']}",
                  f"export MLFLOW_TRACKING_PASSWORD={secret('MLFLOW_ADMIN_PASSWORD')}"]
    return lines


# -- compose ------------------------------------------------------------------------------------------------

def compose_command() -> list[str]:
    """`docker compose` (v2 plugin) or Debian's `docker-compose` (v1 or v2), whichever is installed."""
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]) and subprocess.run([*cmd, "version"], stdout=subprocess.DEVNULL,
                                                   stderr=subprocess.DEVNULL).returncode == 0:
            return cmd
    raise StackError("neither `docker compose` nor `docker-compose` is installed; install one (Debian: "
                     "`apt-get install docker-compose`; or Docker's compose plugin) and run this again")


def compose(project: str, *args: str, capture: bool = False) -> subprocess.CompletedProcess:
    if not COMPOSE_FILE.exists():
        raise StackError(f"{COMPOSE_FILE} not found: run `grpo infra` from a checkout of grpo-pipeline")
    cmd = [*compose_command(), "-p", project, "--env-file", str(env_path(project)), "-f", str(COMPOSE_FILE), *args]
    r = subprocess.run(cmd, text=True, capture_output=capture)
    if r.returncode != 0:
        detail = (r.stderr or r.stdout or "").strip()[-2000:] if capture else "see the output above"
        raise StackError(f"`{' '.join(cmd)}` failed (exit {r.returncode}): {detail}")
    return r


def check_engine() -> None:
    if subprocess.run(["docker", "info"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode != 0:
        raise StackError("no Docker engine answers; start one (as root: `bash infra/setup_docker.sh`)")


# -- images -------------------------------------------------------------------------------------------------

def choose_images(how: str = "auto") -> dict[str, str]:
    """local: built here; upstream: pulled/built with a registry; auto: local images when present, else
    upstream when a registry answers, else local."""
    if how == "auto":
        present = all(image_exists(LOCAL_IMAGES[k]) for k in ("POSTGRES_IMAGE", "GRPO_IMAGE"))
        how = "local" if present or not registry_reachable() else "upstream"
    if how not in ("local", "upstream"):
        raise StackError(f"--images: expected auto, local or upstream, got {how!r}")
    return dict(LOCAL_IMAGES if how == "local" else UPSTREAM_IMAGES)


def build_wheelhouse(force: bool = False) -> Path:
    """Wheels of everything the project image installs, from this machine's package index (the torch
    wheel: the version installed here, i.e. the CPU wheel on local disk)."""
    stamp = WHEELHOUSE / ".complete"
    torch_spec = f"torch=={importlib.metadata.version('torch')}"
    # async-timeout: redis wants it below Python 3.11.3 only; bookworm's Python is 3.11.2, this one may be newer.
    wanted = [torch_spec, f"{REPO_ROOT}[data]", "mlflow[auth]", "psycopg2-binary", "async-timeout>=4.0.3",
              "setuptools>=68", "wheel"]
    if stamp.exists() and not force and json.loads(stamp.read_text()) == wanted:
        return WHEELHOUSE
    _log(f"wheelhouse: pip wheel {' '.join(wanted)} into {WHEELHOUSE} (~2 min)")
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--wheel-dir", str(WHEELHOUSE), *wanted],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        raise StackError(f"building the wheelhouse failed: {r.stdout.strip()[-2000:]}; the package index pip is "
                         f"configured with must serve the project's dependencies for Python 3.11")
    for own in WHEELHOUSE.glob("grpo_pipeline-*.whl"):      # the image installs the project from its source
        own.unlink()
    atomic_write_text(stamp, json.dumps(wanted))
    _log(f"wheelhouse ready in {time.time() - t0:.0f}s")
    return WHEELHOUSE


def docker_build(ref: str, context: Path, dockerfile: Path, build_args: dict[str, str]) -> None:
    """`docker build`, showing its steps as progress; on failure, the end of its output."""
    cmd = ["docker", "build", "-t", ref, "-f", str(dockerfile), *[a for k, v in build_args.items()
                                                               for a in ("--build-arg", f"{k}={v}")], str(context)]
    _log(f"docker build {ref} ({dockerfile.relative_to(REPO_ROOT)})")
    t0, tail = time.time(), []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
        for line in p.stdout:
            tail = (tail + [line.rstrip()])[-60:]
            if line.startswith("Step "):
                _log(f"  {ref}: {line.strip()[:150]}")
    if p.returncode != 0:
        raise StackError(f"docker build {ref} failed (exit {p.returncode}):\n" + "\n".join(tail))
    _log(f"{ref} built in {time.time() - t0:.0f}s")


def build_local_images(force: bool = False) -> list[str]:
    """Build the offline images that are missing (with force: PostgreSQL's and the project's again, on the
    Debian base, which is built only when missing); returns the refs built."""
    built = []
    base, pg, app = (LOCAL_IMAGES[k] for k in ("GRPO_BASE_IMAGE", "POSTGRES_IMAGE", "GRPO_IMAGE"))
    need_pg, need_app = force or not image_exists(pg), force or not image_exists(app)
    if (need_pg or need_app) and not image_exists(base):
        _log(f"building {base} with debootstrap ({', '.join(BASE_PACKAGES)}; ~2 min)")
        try:
            debootstrap_import(base, BASE_PACKAGES, BASE_CHANGES)
        except ImageBuildError as e:
            raise StackError(f"building {base}: {e}") from e
        built.append(base)
    if need_pg:
        docker_build(pg, INFRA / "postgres", INFRA / "postgres" / "Dockerfile", {"BASE_IMAGE": base})
        built.append(pg)
    if need_app:
        build_wheelhouse()
        docker_build(app, REPO_ROOT, INFRA / "worker" / "Dockerfile",
                     {"BASE_IMAGE": base, "PIP_SOURCE": "--no-index --find-links /wheels",
                      "TORCH_SPEC": f"torch=={importlib.metadata.version('torch')}"})
        built.append(app)
    return built


# -- health -------------------------------------------------------------------------------------------------

@dataclass
class ServiceStatus:
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{self.name:15s} {'ok  ' if self.ok else 'FAIL'}  {self.detail}"


def _containers(project: str) -> dict[str, dict]:
    """{service: docker inspect record} of the project's containers."""
    ids = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={project}"],
                         capture_output=True, text=True).stdout.split()
    if not ids:
        return {}
    records = json.loads(subprocess.run(["docker", "inspect", *ids], capture_output=True, text=True).stdout or "[]")
    return {r["Config"]["Labels"].get("com.docker.compose.service"): r for r in records}


def _http_status(url: str, auth: tuple[str, str] | None = None, timeout: float = 5.0) -> int | str:
    """The HTTP status of a GET (an int), or why there was none (a str)."""
    req = urllib.request.Request(url)
    if auth:
        req.add_header("Authorization", "Basic " + b64encode(f"{auth[0]}:{auth[1]}".encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError as e:
        return str(getattr(e, "reason", None) or e)


def status(project: str) -> list[ServiceStatus]:
    """One line per service: its container's state and health, and for the servers their HTTP endpoints
    as a client on this machine reaches them (with the credentials, when auth is on)."""
    values = read_env(env_path(project))
    containers = _containers(project)
    out = []
    for name in SERVICES:
        c = containers.get(name)
        if c is None:
            out.append(ServiceStatus(name, False, "no container (run `grpo infra up`)"))
            continue
        state = c["State"]
        health = (state.get("Health") or {}).get("Status")
        if state["Status"] != "running":
            out.append(ServiceStatus(name, False, f"container {state['Status']} (exit {state.get('ExitCode')}); "
                                                  f"see `docker logs {c['Name'].lstrip('/')}`"))
        elif health not in (None, "healthy"):
            out.append(ServiceStatus(name, False, f"container running, health {health}; see `docker logs "
                                                  f"{c['Name'].lstrip('/')}`"))
        else:
            out.append(ServiceStatus(name, True, "container running" + (", healthy" if health else "")))
    if values:
        out = [_check_endpoint(s, values) for s in out]
    return out


def _check_endpoint(s: ServiceStatus, values: dict[str, str]) -> ServiceStatus:
    """Add the HTTP check of the Prefect and MLflow servers to their container's status."""
    base = {"prefect-server": f"http://127.0.0.1:{values['PREFECT_PORT']}",
            "mlflow": f"http://127.0.0.1:{values['MLFLOW_PORT']}"}.get(s.name)
    if base is None or not s.ok:
        return s
    auth_on = values.get("GRPO_STACK_AUTH") == "1"
    health = "/api/health" if s.name == "prefect-server" else "/health"
    code = _http_status(base + health)
    if code != 200:
        return ServiceStatus(s.name, False, f"{base}{health} answered {code}")
    if not auth_on:
        return ServiceStatus(s.name, True, f"{base}{health} 200")
    # An API call with the credentials: proves the auth setup, not only that the process is up.
    if s.name == "prefect-server":
        user, _, password = values["PREFECT_AUTH_STRING"].partition(":")
        api = base + "/api/admin/version"
    else:
        user, password = values["MLFLOW_ADMIN_USERNAME"], values["MLFLOW_ADMIN_PASSWORD"]
        api = base + "/api/2.0/mlflow/experiments/search?max_results=1"
    code = _http_status(api, (user, password))
    return ServiceStatus(s.name, code == 200, f"{base}{health} 200; auth on, credentials "
                                                 + ("accepted" if code == 200 else f"refused ({code})"))


def wait_healthy(project: str, timeout: float) -> list[ServiceStatus]:
    """Poll status() every 2 s until every service is ok or `timeout` seconds passed (then StackError)."""
    deadline = time.monotonic() + timeout
    while True:
        now = status(project)
        if all(s.ok for s in now):
            return now
        if time.monotonic() > deadline:
            raise StackError(f"the stack was not healthy after {timeout:.0f}s:\n  "
                             + "\n  ".join(s.line() for s in now if not s.ok))
        time.sleep(2)


# -- up / down ----------------------------------------------------------------------------------------------

def up(project: str = DEFAULT_PROJECT, *, images: str = "auto", rebuild: bool = False, expose: bool = False,
       auth: bool = False, prefect_port: int | None = None, mlflow_port: int | None = None,
       public_host: str | None = None, timeout: float = 600) -> list[ServiceStatus]:
    """1) check compose and the engine, 2) images, 3) settings and secrets, 4) compose up, 5) wait for health."""
    compose_command()
    check_engine()
    chosen = choose_images(images)
    offline = chosen == LOCAL_IMAGES
    if offline:
        build_local_images(force=rebuild)
    values = stack_settings(project, expose=expose, auth=auth, prefect_port=prefect_port, mlflow_port=mlflow_port,
                            public_host=public_host, images=chosen)
    if expose:
        _log(f"exposed: ports {values['PREFECT_PORT']} and {values['MLFLOW_PORT']} listen on all addresses, "
             f"with auth; use TLS (a reverse proxy) beyond a trusted network")
    _log(f"compose up ({project}; env file {env_path(project)})")
    try:
        compose(project, "up", "-d", "--no-build" if offline else "--build")
    except StackError as e:
        raise StackError(f"{e}\n  " + "\n  ".join(s.line() for s in status(project))) from e
    return wait_healthy(project, timeout)


def down(project: str = DEFAULT_PROJECT, volumes: bool = False) -> None:
    """Stop and remove the containers (and, with volumes, the databases, artifacts and runs)."""
    compose_command()
    if not env_path(project).exists():
        raise StackError(f"no stack {project!r} here (no {env_path(project)}); `grpo infra up` creates it")
    compose(project, "down", "--remove-orphans", *(["--volumes"] if volumes else []))
