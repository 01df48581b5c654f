"""The `grpo` parser: every command group registers, importing the CLI changes nothing, and
configure_env() sets the offline/quiet defaults without overriding the user's values."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {"train", "config", "model", "eval", "resume", "runs", "schedule", "compare", "adapter", "data", "sandbox", "export", "infra", "gate"}


def test_every_command_group_registers():
    from flows.cli.main import build_parser
    [sub] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(sub.choices) == COMMANDS


def test_importing_the_cli_sets_nothing_and_loads_no_framework():
    from flows.cli.main import ENV_DEFAULTS
    env = {k: v for k, v in os.environ.items() if k not in ENV_DEFAULTS}
    probe = ("import os, sys; import flows.cli.main as m; "
             "print(sorted(k for k in m.ENV_DEFAULTS if k in os.environ)); "
             "print(sorted(p for p in ('prefect', 'transformers', 'huggingface_hub', 'mlflow') if p in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "[]"]


def test_configure_env_sets_defaults_and_keeps_user_values(monkeypatch):
    from flows.cli.main import ENV_DEFAULTS, configure_env
    for name in ENV_DEFAULTS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    configure_env()
    assert os.environ["HF_HUB_OFFLINE"] == "0"
    assert {k: os.environ[k] for k in ENV_DEFAULTS if k != "HF_HUB_OFFLINE"} == \
        {k: v for k, v in ENV_DEFAULTS.items() if k != "HF_HUB_OFFLINE"}


def test_every_option_of_every_command_says_what_it_is():
    """`grpo <command> --help` explains each argument: none is listed bare."""
    from flows.cli.main import build_parser

    def bare(parser, path):
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    yield from bare(sub, f"{path} {name}")
            elif not a.help:
                yield f"{path} {'/'.join(a.option_strings) or a.dest}"
    assert list(bare(build_parser(), "grpo")) == []
