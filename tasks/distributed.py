"""A stage's work on several processes (data parallel): the process group, and where the processes come from.

`run_on_processes(function, kwargs, ...)` calls `function(data_parallel, **kwargs)` once per process and
returns the first process's result (JSON-able). The processes are, in order of precedence:
1) those of an `accelerate launch` (or `torchrun`) of `grpo train` itself, world size > 1: the first runs
   the flow as usual; the others wait in `serve_jobs` and are sent each call over the process group;
2) `num_processes` > 1 started for this one call with `accelerate launch -m tasks.distributed JOB` on this
   machine, which exit when it is done (the call's arguments and result travel as JSON files);
3) this process alone.
`data_parallel` (grpo_core.parallel.DataParallel) sums tensors over the processes with torch.distributed:
gloo on the CPU, NCCL on GPUs. Calls are sent over a second, gloo group with a long timeout, since the
first process spends most of an iteration outside the update. Any failure inside a call ends every
process of the launch (torchrun's rule): the run resumes from its records with the same command.
The rollout and evaluate stages use it the same way: each process samples its share of the prompts
(`DataParallel.shard`) and the first one gathers and writes the whole result.
"""
from __future__ import annotations

import atexit
import functools
import gc
import importlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch

from grpo_core.config import ConfigError
from grpo_core.io import DiskFullError, InputError, pid_alive, read_json, stop_process_group, write_json
from grpo_core.model.loading import ModelError, select_device
from grpo_core.parallel import DataParallel
from tasks.retry import TransientError, is_transient

REPO_ROOT = Path(__file__).resolve().parent.parent
STEP_TIMEOUT = timedelta(minutes=30)      # one collective sum inside a call (torch's default)
CONTROL_TIMEOUT = timedelta(hours=24)     # a waiting process waits this long for the first one's next call
STOP_GRACE_SECONDS = 30                   # after SIGTERM, how long launched processes get before SIGKILL
# Errors a user can fix, raised again as themselves when a launched process reports one (the CLI prints one line).
USER_ERRORS = {cls.__name__: cls for cls in (ConfigError, ModelError, InputError, DiskFullError)}


@dataclass
class _Launch:
    """This process's membership of the process group of an external launch."""
    data_parallel: DataParallel
    control: object                      # the gloo group calls are sent over
    broken: bool = False                 # a call failed part-way: the others may wait in a sum forever


_launch: _Launch | None = None


# -- the process group --------------------------------------------------------------------------------------

def _sum_across(device: torch.device, tensors: list[torch.Tensor]) -> None:
    """Sum each tensor over the processes, in place: one all-reduce per dtype, on the group's device,
    low-precision floats summed in float32."""
    import torch.distributed as dist
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype, same in by_dtype.items():
        flat = torch.cat([t.detach().reshape(-1) for t in same]).to(device, torch.promote_types(dtype, torch.float32))
        dist.all_reduce(flat)
        offset = 0
        for t in same:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def _gather(item: object) -> list:
    """Every process's `item`, in rank order, on every process (pickled over the default group)."""
    import torch.distributed as dist
    items = [None] * dist.get_world_size()
    dist.all_gather_object(items, item)
    return items


def _exit_with_launcher(owner_pid: int | None = None) -> None:
    """Die once this process's launcher is gone: its parent (torchrun's agent), and `owner_pid` (the stage that
    started the launch) when given. torchrun starts its processes in sessions of their own, so a SIGKILL of the
    launcher's process group would otherwise leave them (and their children: the first process's temporary
    Prefect server) running; this SIGKILLs the process group this process leads, itself included."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent and (owner_pid is None or pid_alive(owner_pid)):
            time.sleep(1.0)
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)
        os._exit(1)
    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def _join(on_cpu: bool, owner_pid: int | None = None) -> _Launch:
    """Join the process group the launcher's environment describes (RANK, WORLD_SIZE, MASTER_ADDR, ...):
    NCCL with one GPU per process, or gloo `on_cpu`; exit with the launcher (`_exit_with_launcher`)."""
    import torch.distributed as dist
    from accelerate import PartialState
    _exit_with_launcher(owner_pid)
    state = PartialState(cpu=on_cpu, timeout=STEP_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    data_parallel = DataParallel(state.process_index, state.num_processes, functools.partial(_sum_across, state.device),
                                 _gather)
    return _Launch(data_parallel, control)


def _check_not_a_single_cpu_launch() -> None:
    """`accelerate launch --cpu --num_processes N` starts one process (accelerate's several-CPU-processes launch
    is mpirun): say so rather than train on one process while N were asked for."""
    env = os.environ
    if env.get("ACCELERATE_USE_CPU", "").lower() == "true" and "MASTER_PORT" in env and not any(
            k in env for k in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")):
        raise ConfigError("`accelerate launch --cpu --num_processes N` started a single process (accelerate runs "
                          "several CPU processes only through mpirun). Fix: launch with `accelerate launch --multi_gpu "
                          "--num_processes N ...` (torchrun; the processes use gloo on the CPU when device is cpu or "
                          "no GPU is visible), or set stages.update.num_processes: N and run `grpo train` directly")


def join_launch() -> int:
    """In a process of an `accelerate launch`/`torchrun` with world size > 1, join its process group (NCCL when
    GPUs are visible, else gloo) and return this process's rank (the first process releases the others when
    it exits); else 0, nothing joined."""
    global _launch
    _check_not_a_single_cpu_launch()
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0
    _launch = _join(on_cpu=not torch.cuda.is_available())
    if _launch.data_parallel.rank == 0:
        atexit.register(_release_waiting_processes)
    return _launch.data_parallel.rank


# -- calls over the process group of a launch ---------------------------------------------------------------

def _name_of(function: Callable) -> str:
    if function.__module__ == "__main__":
        raise ValueError(f"{function.__qualname__} must live in an importable module to run on other processes")
    return f"{function.__module__}:{function.__qualname__}"


def _call(job: dict, data_parallel: DataParallel):
    module, _, name = job["function"].partition(":")
    return getattr(importlib.import_module(module), name)(data_parallel, **job["kwargs"])


def _broadcast(job: dict | None) -> dict | None:
    import torch.distributed as dist
    box = [job]
    dist.broadcast_object_list(box, src=0, group=_launch.control)
    return box[0]


def serve_jobs() -> int:
    """The processes of a launch other than the first: run each call it sends, until it exits. -> exit status."""
    while (job := _broadcast(None)) is not None:
        _call(job, _launch.data_parallel)
    _leave_process_group()
    return 0


def _release_waiting_processes() -> None:
    """At the first process's exit: tell the others to stop (unless a call broke off, and they are gone)."""
    import torch.distributed as dist
    if _launch is not None and not _launch.broken and dist.is_initialized():
        _broadcast(None)
        _leave_process_group()


def _leave_process_group() -> None:
    """Destroy the process group and drop this module's hold on it, so that gloo's worker threads are joined
    now. A worker that frees the last call's buffers only once the interpreter is shutting down cannot take
    the GIL any more, and aborts the process ("terminate called without an active exception", SIGABRT)."""
    import torch.distributed as dist
    global _launch
    dist.destroy_process_group()
    _launch = None
    gc.collect()


def _run_on_launch(function: Callable, kwargs: dict):
    if _launch.broken:
        raise RuntimeError("an earlier call failed part-way on the launched processes, which cannot continue "
                           "together; stop this launch and resume the run with the same command")
    _broadcast({"function": _name_of(function), "kwargs": kwargs})
    try:
        return function(_launch.data_parallel, **kwargs)
    except BaseException:
        _launch.broken = True
        raise


# -- processes started for one call ---------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_launch(num_processes: int, threads_per_process: int = 1) -> list[str]:
    """`accelerate launch` of `num_processes` processes on this machine, up to the module to run. --multi_gpu
    means torchrun, on the CPU too (the processes pick gloo themselves; `--cpu` would start only one)."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(num_processes),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_ip", "127.0.0.1", "--main_process_port", str(_free_port()),
            "--num_cpu_threads_per_process", str(threads_per_process)]


def _failure(outcome: dict | None, code: int, log: Path, num_processes: int, what: str) -> Exception:
    """The error to raise for launched processes that failed: the first process's own error when it recorded
    one (transient or not, as it judged), else the end of their log."""
    if outcome and "error" in outcome:
        if outcome["type"] in USER_ERRORS:
            return USER_ERRORS[outcome["type"]](outcome["message"])
        message = f"{what} on {num_processes} processes failed: {outcome['type']}: {outcome['message']} " \
                  f"(log: {log})"
        return TransientError(message) if outcome["transient"] else RuntimeError(message)
    tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
    return RuntimeError(f"{what} on {num_processes} processes exited with status {code} (log: {log}):\n{tail}")


def _launch_processes(function: Callable, kwargs: dict, num_processes: int, device: str, workdir: Path, stage: str):
    on_cpu = select_device(device).type == "cpu"
    if not on_cpu and torch.cuda.device_count() < num_processes:
        raise ConfigError(f"stages.{stage}.num_processes: {num_processes} processes need {num_processes} GPUs, "
                          f"this machine has {torch.cuda.device_count()}. Fix: lower it, or set device: cpu")
    workdir.mkdir(parents=True, exist_ok=True)
    job_file, result_file, log = workdir / "job.json", workdir / "result.json", workdir / "processes.log"
    result_file.unlink(missing_ok=True)
    write_json(job_file, {"function": _name_of(function), "kwargs": kwargs, "device": device,
                          "result_file": str(result_file), "owner_pid": os.getpid()})
    threads = max(1, torch.get_num_threads() // num_processes) if on_cpu else 1
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    with open(log, "w") as out:
        proc = subprocess.Popen([*accelerate_launch(num_processes, threads), "-m", "tasks.distributed", str(job_file)],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait()
        except BaseException:
            stop_process_group(proc, grace=STOP_GRACE_SECONDS)
            raise
    outcome = read_json(result_file) if result_file.exists() else None
    if code != 0 or outcome is None or "error" in outcome:
        raise _failure(outcome, code, log, num_processes, _name_of(function))
    return outcome["result"]


def run_on_processes(function: Callable, kwargs: dict, num_processes: int, device: str, workdir: Path,
                     stage: str = "update"):
    """`function(data_parallel, **kwargs)` on every process (see the module docstring for which); returns the
    first process's result (the others' results are dropped). `workdir` holds the job, result and log files
    when processes are started; `stage` names the setting in errors (stages.<stage>.num_processes)."""
    if _launch is not None:
        return _run_on_launch(function, kwargs)
    if num_processes > 1:
        return _launch_processes(function, kwargs, num_processes, device, Path(workdir), stage)
    return function(DataParallel(), **kwargs)


# -- `python -m tasks.distributed JOB`: one of the processes a stage started with `accelerate launch` -----

def main(job_file: str) -> int:
    job = read_json(job_file)
    data_parallel = _join(select_device(job["device"]).type == "cpu", owner_pid=job["owner_pid"]).data_parallel
    first = data_parallel.rank == 0
    try:
        result = _call(job, data_parallel)
    except BaseException as e:
        if first:
            write_json(job["result_file"], {"error": True, "type": type(e).__name__, "message": str(e),
                                            "transient": is_transient(e)})
        raise
    if first:
        write_json(job["result_file"], {"result": result})
    _leave_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
