"""The console when a command runs the training flow: the log lines of Prefect and MLflow (and library
warnings, as log lines) go to stdout, so that stderr carries only progress bars and, on failure, the one
`error: ...` line `grpo` prints; without --debug those log lines carry no traceback (the error line says
what failed and how to fix it; `grpo --debug ...` shows every traceback)."""
from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any, Iterator


class _Stdout:
    """sys.stdout as it is at each write: a handler keeps its stream for the life of the process (Prefect
    logs again when its temporary server stops at exit), and sys.stdout may be swapped meanwhile."""

    def write(self, text: str) -> int:
        return sys.stdout.write(text)

    def flush(self) -> None:
        sys.stdout.flush()

    def __getattr__(self, name: str) -> Any:        # isatty, encoding, ... as the current stdout has them
        return getattr(sys.stdout, name)


STDOUT = _Stdout()


class _NoTraceback(logging.Filter):
    """Drop the traceback from a record (the console handler runs last: Prefect's API handler keeps it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


def _console_handlers() -> list[logging.StreamHandler]:
    """The console handlers of Prefect (on the root logger) and of MLflow (logger "mlflow"), set up now."""
    import mlflow  # noqa: F401 - the run imports it anyway; importing it configures its "mlflow" logger
    from mlflow.utils.logging_utils import MlflowLoggingStream
    from prefect.logging.configuration import ensure_logging_setup
    from prefect.logging.handlers import PrefectConsoleHandler
    ensure_logging_setup()
    return ([h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]   # not others'
            + [h for h in logging.getLogger("mlflow").handlers
               if isinstance(getattr(h, "stream", None), (MlflowLoggingStream, _Stdout))])


@contextlib.contextmanager
def run_console(debug: bool) -> Iterator[None]:
    """Point the console handlers at stdout (for good: see _Stdout), drop tracebacks from their lines
    unless `debug`, and send `warnings` through logging, for the block."""
    from prefect.logging.handlers import PrefectConsoleHandler
    handlers = _console_handlers()
    quiet = _NoTraceback()
    for h in handlers:
        h.stream = STDOUT               # not setStream(): it flushes the old stream, which may be closed
        if isinstance(h, PrefectConsoleHandler):
            h.console.file = STDOUT
        if not debug:
            h.addFilter(quiet)
    logging.captureWarnings(True)
    try:
        yield
    finally:
        logging.captureWarnings(False)
        for h in handlers:
            h.removeFilter(quiet)
