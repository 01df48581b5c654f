"""Which failures a stage retries: transient ones only (an engine, container or IO hiccup), never bad
input. `retry_transient_only` is the Prefect `retry_condition_fn` every stage task carries; the
decision is `is_transient`, which classifies by exception type and follows the cause chain."""
from __future__ import annotations

import errno
import subprocess


class TransientError(RuntimeError):
    """Raise (or wrap with `raise TransientError(...) from e`) for a failure worth retrying."""


# Subclasses of OSError that mean bad input, not a hiccup: retrying cannot make them pass.
_PERMANENT_OS_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError, FileExistsError)
_TRANSIENT_NAMES = ("InfraError", "EngineUnavailable", "BoxDied",     # sandbox/ (engine down: retried, bounded)
                    "OutOfMemoryError", "OperationalError")           # torch.cuda, sqlite
# How requests/MLflow word an answer cut off mid-body (the server stopped while it answered).
CUT_OFF_MESSAGES = ("connection broken", "connection aborted", "remotedisconnected", "incompleteread")
_TRANSIENT_MESSAGES = ("cuda out of memory", "out of memory", "database is locked", "temporarily unavailable",
                       "connection reset", "connection refused", "timed out", "cudnn_status_internal_error",
                       "nccl error", "resource temporarily unavailable", *CUT_OFF_MESSAGES)


def _transient_one(exc: BaseException) -> bool | None:
    """True/False when this exception alone decides; None when its cause should decide."""
    if isinstance(exc, TransientError):
        return True
    if isinstance(exc, ValueError):          # ConfigError, TaskValidationError, ModelError, pydantic ...
        return False
    if isinstance(exc, (TypeError, KeyError, IndexError, AttributeError, NotImplementedError, AssertionError)):
        return False
    name = type(exc).__name__
    module = type(exc).__module__ or ""
    if module.startswith("docker"):        # docker.errors.*: engine hiccups yes, a missing image no
        if name in ("ImageNotFound", "NotFound", "InvalidArgument", "BuildError"):
            return False
        status = getattr(getattr(exc, "response", None), "status_code", None)
        return status is None or status >= 500
    if isinstance(exc, (TimeoutError, ConnectionError, subprocess.TimeoutExpired)):
        return True
    if isinstance(exc, OSError):            # a full disk stays full until someone frees space: not retried
        return not isinstance(exc, _PERMANENT_OS_ERRORS) and exc.errno != errno.ENOSPC
    if name in _TRANSIENT_NAMES:
        return True
    msg = str(exc).lower()
    if name in ("MlflowException", "RestException", "RuntimeError") and any(m in msg for m in _TRANSIENT_MESSAGES):
        return True
    return None


def is_transient(exc: BaseException | None) -> bool:
    """Is this failure an engine/container/IO hiccup worth retrying? Bad input never is."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        verdict = _transient_one(exc)
        if verdict is not None:
            return verdict
        exc = exc.__cause__ or exc.__context__
    return False


def retry_transient_only(task, task_run, state) -> bool:
    """Prefect `retry_condition_fn`: retry a failed stage only for a transient error."""
    exc = state.data if isinstance(getattr(state, "data", None), BaseException) else None
    if exc is None:
        try:
            exc = state.result(raise_on_failure=False)
        except Exception as e:  # noqa: BLE001 - the result itself may be the raised error
            exc = e
    ok = is_transient(exc) if isinstance(exc, BaseException) else False
    try:
        from prefect.logging import get_run_logger
        get_run_logger().warning("%s: %s error %r", task.name, "transient, retrying" if ok else "permanent, not retrying",
                                 exc)
    except Exception:  # noqa: BLE001 - logging must not decide retries
        pass
    return ok
