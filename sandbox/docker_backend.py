"""Docker backend: warm, locked-down containers, one job at a time each, fresh state per job.

Each container ("box") runs ``python_runner.py serve`` as a non-root user under ``--init``, with
no network, a read-only root, a size-capped tmpfs, memory == memory+swap, a pids limit, a CPU
quota, all capabilities dropped and no-new-privileges. The host talks to the supervisor over the
container's attached stdin/stdout: one JSON job in, one ``<nonce> <json>`` reply out. Between
jobs the supervisor kills every other process in the box and wipes the scratch dirs, so a
completion finds nothing of the previous one; if anything looks wrong (deadline passed, stream
closed, garbled reply) the host kills and removes the whole container instead of reusing it.

Containers carry the label ``grpo.sandbox=1`` and ``grpo.sandbox.owner=<host>:<pid>``; boxes
left behind by a dead process are reaped when a backend starts, and all of ours at exit.

An engine that stops answering (stopped, restarted, crashed) makes the jobs it was running and those
after it ``infra_error`` verdicts whose error is :class:`~sandbox.backends.EngineUnavailable`;
``check_engine()`` raises it while the engine is away. Boxes that could not be removed meanwhile are
removed once it answers again (the next box started, or ``close``); a warm box that died with the engine
is replaced by a fresh one, so the backend keeps working after a restart.
"""
from __future__ import annotations

import atexit
import logging
import os
import queue
import secrets
import select
import shutil
import socket
import struct
import tempfile
import threading
import time
import uuid
from typing import Any, Callable

from sandbox.types import Limits
from sandbox.backends import RUNNER_PATH, Backend, BoxDied, EngineUnavailable, InfraError, NonceChannel
from sandbox.images import IMAGES

log = logging.getLogger("sandbox.docker")

LABEL = "grpo.sandbox"
OWNER_LABEL = "grpo.sandbox.owner"
BOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
USER = "65534:65534"   # nobody:nogroup; images from `docker import` have no user of their own
_OWNER = f"{socket.gethostname()}:{os.getpid()}"


def _client(timeout: int = 30):
    import docker  # imported lazily: the local backend must work without the SDK
    return docker.from_env(timeout=timeout)


def engine_down(why: BaseException) -> EngineUnavailable:
    """The error for an engine that does not answer: where, the innermost reason, and the fix."""
    chain = []
    while why is not None and all(why is not e for e in chain):     # the SDK nests the OSError in its args
        chain.append(why)
        why = why.__cause__ or next((a for a in why.args if isinstance(a, BaseException)), None)
    root = chain[-1]
    reason = getattr(root, "strerror", None) or " ".join(str(root).split())[:160]
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    return EngineUnavailable(f"the Docker engine ({host}) does not answer ({type(root).__name__}: {reason}); start "
                             "it (sudo bash infra/setup_docker.sh) or use the local sandbox backend")


_available: dict[str, bool] = {}


def engine_answers() -> bool:
    """True when a Docker engine answers a ping (cached per process)."""
    if "engine" not in _available:
        try:
            _available["engine"] = bool(_client(timeout=5).ping())
        except Exception:  # noqa: BLE001 - no SDK, no socket, no engine: all mean "no"
            _available["engine"] = False
    return _available["engine"]


def docker_available(images: dict[str, str] | None = None) -> bool:
    """An engine answers and the sandbox images exist (`images`: language -> image, default IMAGES)."""
    try:
        return missing_images(list({**IMAGES, **(images or {})}.values())) == []
    except Exception:  # noqa: BLE001
        return False


def missing_images(refs: list[str]) -> list[str] | None:
    """The image references among `refs` that the Docker engine does not have; None when no engine answers."""
    if not engine_answers():
        return None
    c = _client(timeout=10)
    return [ref for ref in refs if not _image_exists(c, ref)]


def _image_exists(client, ref: str) -> bool:
    import docker
    try:
        client.images.get(ref)
        return True
    except docker.errors.ImageNotFound:
        return False


def reap_leftovers(client=None, everything_of_ours: bool = False) -> int:
    """Remove sandbox containers whose owning process is gone (or all of ours). Returns count."""
    client = client or _client()
    host = socket.gethostname()
    n = 0
    for ct in client.containers.list(all=True, filters={"label": f"{LABEL}=1"}):
        owner = ct.labels.get(OWNER_LABEL, "")
        o_host, _, o_pid = owner.rpartition(":")
        mine = owner == f"{host}:{os.getpid()}"
        dead = o_host == host and o_pid.isdigit() and not _pid_alive(int(o_pid))
        if (mine and everything_of_ours) or dead or (o_host == host and not o_pid.isdigit()):
            try:
                ct.remove(force=True, v=True)
                n += 1
            except Exception:  # noqa: BLE001 - already gone
                pass
    return n


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class _Box(NonceChannel):
    """One container with its supervisor and the attached stdin/stdout stream."""

    def __init__(self, client, image: str, language: str, lim: Limits, runner_dir: str,
                 instance: str = "", owner: str = _OWNER, left_behind: Callable[[str], None] | None = None):
        import docker
        self.nonce = secrets.token_hex(16)
        self.jobs_done = 0
        self._buf = b""
        self._pending = b""
        self._lines: list[bytes] = []
        self.stderr_tail = b""
        self.name = f"grpo-sbx-{instance or 'box'}-{secrets.token_hex(6)}"   # known before the engine answers
        exec_opt = "exec" if language == "rust" else "noexec"
        try:
            self.ct = client.containers.create(
                image, ["python3", "-I", "-S", "/opt/sbx/python_runner.py", "serve"],
                user=USER, working_dir="/tmp", stdin_open=True, detach=True, init=True,
                environment={"PATH": BOX_PATH, "LANG": "C.UTF-8", "HOME": "/tmp/home",
                             "SBX_ISOLATED": "1"},
                network_mode="none", read_only=True,
                tmpfs={"/tmp": f"rw,{exec_opt},nosuid,nodev,size={lim.tmpfs_mb}m,mode=1777"},
                shm_size="4m", mem_limit=f"{lim.memory_mb}m", memswap_limit=f"{lim.memory_mb}m",
                pids_limit=lim.pids, nano_cpus=int(lim.cpus * 1e9), cap_drop=["ALL"],
                security_opt=["no-new-privileges"], ipc_mode="private",
                ulimits=[docker.types.Ulimit(name="core", soft=0, hard=0)],
                volumes={runner_dir: {"bind": "/opt/sbx", "mode": "ro"}},
                log_config=docker.types.LogConfig(type="none"),
                labels={LABEL: "1", OWNER_LABEL: owner, "grpo.sandbox.language": language,
                        "grpo.sandbox.instance": instance}, name=self.name)
        except docker.errors.ImageNotFound as e:
            raise InfraError(f"sandbox image {image!r} is missing; build it with "
                             "`python -m sandbox.images build` (or `grpo sandbox build-images`)") from e
        except Exception:
            if left_behind is not None:     # created, maybe, before the engine went away: remove it later
                left_behind(self.name)
            raise
        try:
            s = client.api.attach_socket(self.ct.id, params={"stdin": 1, "stdout": 1, "stderr": 1,
                                                             "stream": 1})
            self._sockobj = s
            self.sock = getattr(s, "_sock", s)
            self.ct.start()
            self.sock.sendall((self.nonce + "\n").encode())
        except Exception:
            if not self.destroy() and left_behind is not None:   # the engine went away mid-start
                left_behind(self.name)
            raise

    def _send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _next_line(self, end: float) -> bytes:
        while not self._lines:
            left = end - time.monotonic()
            if left <= 0:
                raise BoxDied("wall-clock deadline passed; container killed", timed_out=True)
            r, _, _ = select.select([self.sock], [], [], left)
            if not r:
                continue
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise BoxDied("the box's supervisor died mid-job (killed by the code, or out of "
                              "memory)")
            self._buf += chunk
            self._parse_frames()
        return self._lines.pop(0)

    def _parse_frames(self) -> None:
        out = b""
        while len(self._buf) >= 8:
            stream, size = self._buf[0], struct.unpack(">I", self._buf[4:8])[0]
            if len(self._buf) < 8 + size:
                break
            payload, self._buf = self._buf[8:8 + size], self._buf[8 + size:]
            if stream == 1:
                out += payload
            else:
                self.stderr_tail = (self.stderr_tail + payload)[-4096:]
        if out:
            self._pending += out
            *complete, self._pending = self._pending.split(b"\n")
            self._lines.extend(complete)
            if len(self._pending) > 64 << 20:
                raise BoxDied("unterminated output line from the box exceeds 64 MiB")

    def post_mortem(self) -> str:
        """Why did the box stop answering? "oom", "gone" (removed from outside, or engine trouble: infra), or
        "died". The engine must first record the container's exit: one that is shutting down (and killing
        its containers) never does, so that death is the engine's, not the code's."""
        import docker
        import requests
        try:
            self.ct.wait(timeout=10)
        except requests.exceptions.ReadTimeout:
            pass                    # still running, the engine answering: the checks below decide
        except Exception:  # noqa: BLE001 - removed (NotFound), engine stopping or gone
            return "gone"
        try:
            self.ct.reload()
        except Exception:  # noqa: BLE001 - removed (NotFound), engine trouble
            return "gone"
        return "oom" if self.ct.attrs.get("State", {}).get("OOMKilled") else "died"

    def destroy(self) -> bool:
        """Close the stream first (dockerd stalls otherwise), then kill and remove. -> whether it is gone."""
        for closer in (getattr(self, "_sockobj", None), getattr(self, "sock", None)):
            try:
                if closer is not None:
                    closer.close()
            except Exception:  # noqa: BLE001
                pass
        import docker
        try:
            self.ct.remove(force=True, v=True)
        except docker.errors.NotFound:
            pass
        except Exception:  # noqa: BLE001 - engine away: removed once it is back (DockerBackend._left_behind)
            return False
        return True


class DockerBackend(Backend):
    """Warm pool of boxes per (language, limits); each box runs one job at a time."""
    name = "docker"

    def __init__(self, images: dict[str, str] | None = None, max_jobs_per_box: int = 500):
        self.images = dict(images or IMAGES)
        self.max_jobs_per_box = max_jobs_per_box
        try:
            self.client = _client(timeout=60)
            self.client.ping()
        except Exception as e:  # noqa: BLE001
            raise engine_down(e) from e
        self._pools: dict[tuple, queue.SimpleQueue] = {}
        self._all: set[_Box] = set()
        self._strays: set[str] = set()   # names of containers a lost engine left: removed once it is back
        self._lock = threading.Lock()
        self.instance = uuid.uuid4().hex[:12]
        self.owner = f"{socket.gethostname()}:{os.getpid()}"  # not _OWNER: we may be a forked child
        self._runner_dir = tempfile.mkdtemp(prefix="grpo-sbx-runner-")
        shutil.copy(RUNNER_PATH, os.path.join(self._runner_dir, "python_runner.py"))
        os.chmod(self._runner_dir, 0o755)
        os.chmod(os.path.join(self._runner_dir, "python_runner.py"), 0o644)
        n = reap_leftovers(self.client)
        if n:
            log.warning("reaped %d leftover sandbox container(s) of dead processes", n)
        atexit.register(shutil.rmtree, self._runner_dir, True)
        atexit.register(self.close)  # runs first (atexit is LIFO)

    def default_workers(self) -> int:
        return max(2, (os.cpu_count() or 2) + 1)

    def _limits_dict(self, lim: Limits) -> dict[str, Any]:
        d = super()._limits_dict(lim)
        d["rlimit_as"] = False  # the container's cgroup caps memory
        return d

    def check_engine(self) -> None:
        try:
            _client(timeout=10).ping()
        except Exception as e:  # noqa: BLE001 - no socket, refused, hung, 5xx: all mean "not answering"
            raise engine_down(e) from e

    def _exchange(self, message: dict, limits: Limits, deadline_s: float) -> dict:
        try:
            return self._exchange_on_a_box(message, limits, deadline_s)
        except (BoxDied, EngineUnavailable):
            raise                   # BoxDied: the code's doing (the engine answered the post-mortem)
        except Exception:
            self.check_engine()     # the engine went away: say so (EngineUnavailable), not the symptom
            raise

    def _exchange_on_a_box(self, message: dict, limits: Limits, deadline_s: float) -> dict:
        language = message.get("language") or message["kind"]   # run jobs name it; scoring jobs' kind is it
        # Containers differ only by their container-level limits; time limits are per job.
        key = (language, limits.memory_mb, limits.pids, limits.tmpfs_mb, limits.cpus)
        for attempt in range(2):
            box, reused = self._acquire(key, language, limits, fresh=attempt > 0)
            try:
                reply = box.exchange(message, deadline_s)
            except (BoxDied, OSError) as e:
                cause = "timeout" if getattr(e, "timed_out", False) else box.post_mortem()
                self._discard(box)
                if reused and cause in ("died", "gone") and attempt == 0:
                    continue  # the box may have died while idle (or with an engine restart): a fresh one
                if isinstance(e, OSError):
                    raise InfraError(f"lost the connection to the sandbox container: {e}") from e
                if cause == "gone":
                    raise InfraError("the sandbox container disappeared mid-job (removed from "
                                     "outside or engine trouble)") from e
                if cause == "oom":
                    raise BoxDied("out of memory (the container was OOM-killed)") from e
                raise
            self._release(key, box)
            return reply
        raise AssertionError("unreachable")

    def _acquire(self, key: tuple, language: str, limits: Limits, fresh: bool = False) -> tuple[_Box, bool]:
        with self._lock:
            pool = self._pools.setdefault(key, queue.SimpleQueue())
        if not fresh:
            try:
                return pool.get_nowait(), True
            except queue.Empty:
                pass
        image = self.images[language]
        box = _Box(self.client, image, language, limits, self._runner_dir, self.instance, self.owner,
                   self._left_behind)
        with self._lock:
            self._all.add(box)
            strays, self._strays = self._strays, set()
        for name in strays:         # the engine answers again: remove what it could not remove before
            self._remove_container(name)
        return box, False

    def _release(self, key: tuple, box: _Box) -> None:
        if box.jobs_done >= self.max_jobs_per_box:
            self._discard(box)
        else:
            with self._lock:
                pool = self._pools.setdefault(key, queue.SimpleQueue())
            pool.put(box)

    def _discard(self, box: _Box) -> None:
        with self._lock:
            self._all.discard(box)
        if not box.destroy():
            self._left_behind(box.name)

    def _left_behind(self, name: str) -> None:
        """A container the engine could not remove (it is away): removed at the next box started, or close."""
        with self._lock:
            self._strays.add(name)

    def _remove_container(self, name: str) -> None:
        import docker
        try:
            self.client.api.remove_container(name, force=True, v=True)
        except docker.errors.NotFound:
            pass
        except Exception:  # noqa: BLE001 - the engine is away again: next time
            self._left_behind(name)

    def close(self) -> None:
        """Remove every container of this backend (idle boxes, and those a lost engine left behind)."""
        with self._lock:
            boxes, self._all = list(self._all), set()
            self._pools = {}
        for b in boxes:
            b.destroy()
        try:                        # and any container of ours a lost engine left behind
            left = self.client.containers.list(all=True, filters={
                "label": [f"{LABEL}=1", f"grpo.sandbox.instance={self.instance}"]})
        except Exception:  # noqa: BLE001 - no engine: the next backend's reap_leftovers removes them
            left = []
        for ct in left:
            self._remove_container(ct.id)
