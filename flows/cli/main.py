"""`grpo`: the parser, the environment defaults, and running one command.

Each command group registers itself (`register(subparsers)` in train, eval, export, ops, data, sandbox, infra);
this module only assembles them, sets the offline/quiet environment defaults and maps the errors a
user can fix (USER_ERRORS, RESUMABLE_ERRORS, and an exception raised inside a reward plugin) to one line on
stderr, `error: <what and how to fix it>` (and the resume command, for what a run lacked mid-way), and exit status 2;
`grpo --debug ...` re-raises them with their traceback instead. Nothing here runs at import time.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from flows.cli import data, export, infra, ops, sandbox, train
from flows.cli import eval as evaluate
from grpo_core.config import ConfigError
from grpo_core.io import DiskFullError, InputError
from grpo_core.model.loading import ModelError
from grpo_core.plugins import PluginError
from grpo_core.rewards.rewards import RewardOutputError, plugin_failure
from sandbox.backends import EngineUnavailable, NoIsolation
from sandbox.types import TaskFormatError
from tasks.run_state import stop_signal

COMMAND_GROUPS = (train, evaluate, export, ops, data, sandbox, infra)  # the order `grpo --help` lists them in
# Errors in what the user gave (config, model, data, plugins) or chose (a sandbox that cannot isolate code here):
# their messages name the field or file and the fix.
USER_ERRORS = (ConfigError, ModelError, InputError, PluginError, RewardOutputError, TaskFormatError, NoIsolation)
# What the machine lacked mid-run (the Docker engine, still down after the stage's retries; disk space): one line
# too, with the fix and the resume command.
RESUMABLE_ERRORS = (EngineUnavailable, DiskFullError)

# Offline, quiet, robust defaults. A value already in the environment wins.
ENV_DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    "TOKENIZERS_PARALLELISM": "false",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
}


def configure_env() -> None:
    """Set ENV_DEFAULTS where unset. Call before Prefect, transformers or huggingface_hub are
    imported: they read these variables once, at import."""
    for name, value in ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="grpo", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="GRPO training pipeline for small language models: Prefect flows (curate, rollout, "
                    "score, update, evaluate), rewards checked by programs, everything tracked in MLflow.",
        epilog="Run `grpo <command> --help` for the options of a command.")
    p.add_argument("--debug", action="store_true",
                   help="on an error, show the full traceback (and Prefect's) instead of the one-line message")
    subparsers = p.add_subparsers(dest="command", metavar="<command>", required=True)
    for group in COMMAND_GROUPS:
        group.register(subparsers)
    return p


def _quiet_libraries() -> None:
    """Keep the terminal for our progress bars and results: no per-load bars or deprecation chatter."""
    import warnings
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def user_error_message(e: BaseException) -> str | None:
    """The one-line message of an error the user can fix (None for anything else: a bug keeps its traceback)."""
    text = str(e) if isinstance(e, (*USER_ERRORS, *RESUMABLE_ERRORS)) else plugin_failure(e)
    if text is None:
        return None
    return "; ".join(line.strip() for line in text.splitlines() if line.strip()) or type(e).__name__


def _sigterm_stops_like_ctrl_c() -> None:
    """SIGTERM raises KeyboardInterrupt("SIGTERM") (inside a flow Prefect raises TerminationSignal instead)."""
    def stop(signum, frame):
        raise KeyboardInterrupt("SIGTERM")
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stop)


def _resume_hint(args) -> str:
    name = getattr(args, "run_name", None) or getattr(args, "run", None)
    if not name:
        return "re-run the same command to continue"
    out = getattr(args, "output_dir", None)
    return f"resume with `grpo resume {name}" + (f" --output-dir {out}`" if out and out != "runs" else "`")


def main(argv: list[str] | None = None) -> int:
    configure_env()
    args = build_parser().parse_args(argv)
    _quiet_libraries()
    _sigterm_stops_like_ctrl_c()
    try:
        from tasks import distributed
        if distributed.join_launch() > 0:       # under `accelerate launch`/torchrun, the processes after the first
            return distributed.serve_jobs()     # only run the calls it sends them (their share of the update)
        return args.func(args)
    except BaseException as e:      # a stop request, or a user error: one line; anything else: the traceback
        how = stop_signal(e)
        if how is not None and not args.debug:
            print(f"stopped by {how}; finished stages are kept, {_resume_hint(args)}", file=sys.stderr)
            return 143 if how == "SIGTERM" else 130
        message = None if args.debug or not isinstance(e, Exception) else user_error_message(e)
        if message is None:
            raise
        if isinstance(e, RESUMABLE_ERRORS):
            message += f"; then {_resume_hint(args)}"
        print(f"error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
