"""Shared fixtures: an isolated GRPO_HOME with a tiny random model, a real Prefect engine, and real
MLflow on SQLite in a temp dir."""
from __future__ import annotations

import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

# Before Prefect/transformers are imported anywhere.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
# The tests' pin of kernels.cpu_bf16: auto (docs/operations.md, "Environment variables"): dtype auto = float32 on
# every CPU, in this process and the ones it starts, so results do not depend on the machine.
os.environ.setdefault("GRPO_CPU_BF16", "0")

import pytest  # noqa: E402

REAL_GRPO_HOME = Path(os.environ.get("GRPO_HOME", Path.home() / ".cache" / "grpo-pipeline")).expanduser()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama-style model with a char tokenizer, built once per session."""
    from grpo_core.model.loading import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session", autouse=True)
def _shared_kernel_builds(tmp_path_factory):
    """One build of the compiled kernels for the session, this process's and its children's: each test's fresh
    $GRPO_HOME would otherwise compile them again (10-25 s on 2 cores), in every `grpo` process a test starts."""
    if "GRPO_KERNEL_CACHE" in os.environ:
        yield
        return
    os.environ["GRPO_KERNEL_CACHE"] = str(tmp_path_factory.mktemp("kernels"))
    yield
    os.environ.pop("GRPO_KERNEL_CACHE", None)


@pytest.fixture()
def grpo_home(tmp_path, monkeypatch, tiny_model_dir) -> Path:
    """An isolated $GRPO_HOME whose 'tiny-random' model is the session's tiny model."""
    home = tmp_path / "grpo_home"
    (home / "models").mkdir(parents=True)
    shutil.copytree(tiny_model_dir, home / "models" / "tiny-random")
    monkeypatch.setenv("GRPO_HOME", str(home))
    return home


@pytest.fixture(scope="session")
def prefect_engine():
    """One real Prefect API (temporary local server, SQLite) for the whole session."""
    from prefect.testing.utilities import prefect_test_harness
    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.fixture(autouse=True)
def _kernel_settings_restored():
    """The kernel choices a test makes (`use_kernels`, or a config's `kernels:` applied by load_policy or a run)
    end with it."""
    from grpo_core.kernels import settings
    before = settings.current()
    yield
    settings.apply(before)


def use_kernels(**choices) -> None:
    """Make these kernel choices (fields of the config's `kernels:`, e.g. decode_linear="native") this process's
    for the rest of the test."""
    from dataclasses import replace
    from grpo_core.kernels import settings
    settings.apply(replace(settings.current(), **choices))


@pytest.fixture()
def mlflow_uri(tmp_path, monkeypatch) -> str:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


@contextmanager
def isolated_run_env(tmp: Path, tiny_model_dir: Path):
    """For module-scoped run fixtures: $GRPO_HOME with the tiny model and MLflow on SQLite, both in
    ``tmp``, set for the duration. -> the tracking URI."""
    shutil.copytree(tiny_model_dir, tmp / "grpo_home" / "models" / "tiny-random")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GRPO_HOME", str(tmp / "grpo_home"))
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        yield uri


def tiny_config(tmp_path: Path, **overrides) -> dict:
    """A seconds-long config on the tiny model (a plain dict, as the flow receives it)."""
    from grpo_core import stages
    from grpo_core.config import GRPOConfig
    base = dict(model="tiny-random", run_name="t", output_dir=str(tmp_path / "runs"), pipeline_iterations=2,
                num_generations=4, max_completion_length=8, steps_per_iteration=1, learning_rate=1e-2,
                data=dict(prompts_per_iteration=2, eval_size=4), eval=dict(num_samples=1),
                stages={name: dict(retries=0) for name in stages.names()})
    for k, v in overrides.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            base[k] = {**base[k], **v}
        else:
            base[k] = v
    return GRPOConfig.model_validate(base).model_dump(mode="json")


def one_iteration(tmp_path: Path, config: dict) -> tuple[dict, list[dict]]:
    """Iteration 1 of `config` (tiny_config's dict) through the real Prefect engine, in a fresh run under tmp_path
    -> (the flow's stage records, the rollout's sample rows). Needs the grpo_home, prefect_engine and mlflow_uri
    fixtures."""
    from flows.train import iteration_flow
    from grpo_core.config import GRPOConfig
    from grpo_core.io import read_jsonl
    from tasks import tracking
    run_dir = tmp_path / "runs" / "t"
    run_dir.mkdir(parents=True)
    tracking.start_or_resume_run(GRPOConfig.model_validate(config), run_dir, None)
    res = iteration_flow(config, str(run_dir), 1, None, None)
    return res, list(read_jsonl(res["rollout"]["samples"]))


@contextmanager
def on_sys_path(*folders: Path) -> Iterator[None]:
    """`folders` importable for the block (a module-scoped fixture's monkeypatch.syspath_prepend)."""
    added = [str(f) for f in folders]
    sys.path[:0] = added
    try:
        yield
    finally:
        for f in added:
            sys.path.remove(f)


def cpu_declines(path: str, dtype=None) -> str | None:
    """Why this CPU cannot run the fast path `path` for `dtype` (fp32 by default), as the code itself decides
    (`grpo_core.kernels.cpu_features.declines`, capped by kernels.max_cpu_isa and $GRPO_MAX_CPU_ISA), with the
    skip's wording; None where it can."""
    import torch
    from grpo_core.kernels import cpu_features
    dtype = dtype or torch.float32
    reason = cpu_features.declines(path, dtype)
    return None if reason is None else f"{path} ({str(dtype).removeprefix('torch.')}) not on this CPU: {reason}"


def needs_cpu(path: str, dtype=None) -> pytest.MarkDecorator:
    """Skip mark for a test of a fast path this CPU cannot run (`cpu_declines`)."""
    reason = cpu_declines(path, dtype)
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def skip_unless_cpu(path: str, dtype=None) -> None:
    """In a test: skip it where this CPU cannot run the fast path (`cpu_declines`)."""
    reason = cpu_declines(path, dtype)
    if reason is not None:
        pytest.skip(reason)


TAUGHT_CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'


@pytest.fixture(scope="session")
def tool_calling_model_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """The tiny model taught (a few seconds of plain fine-tuning) to call the calculator in its first turn
    and to answer after the tool's response: a real model that acts, for the multi-turn pipeline tests (a
    random model never writes a tool call). Taught on the default math prompts rendered with the calculator."""
    import torch
    from transformers import AutoModelForCausalLM
    from grpo_core.config import DataConfig
    from grpo_core.data.arithmetic import train_tasks
    from grpo_core.model.loading import load_tokenizer
    from grpo_core.rollout.multiturn import tool_prompt_ids, tool_turn_ids
    from grpo_core.rollout.tools import ToolResult, resolve_tools
    tok = load_tokenizer(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tools, fmt = resolve_tools(["calculator"]), DataConfig().prompt_format
    call = tok(TAUGHT_CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    tool_turn = tool_turn_ids(tok, [ToolResult("calculator", "42", False, 0.0)])
    answer = tok("<answer>42</answer>", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    rows = []
    for task in train_tasks(16, 1, 1, ["+", "-"], seed=5):
        prompt = tool_prompt_ids(tok, task, fmt, 256, tools)
        rows += [(prompt, call), (prompt + call + tool_turn, answer)]
    return teach_and_save(model, tok, rows, tmp_path_factory.mktemp("models") / "tiny-tool-caller", lr=3e-3,
                          steps=300, batch=8)


def teach_and_save(model, tok, rows: list[tuple[list[int], list[int]]], out: Path, lr: float, steps: int,
                   batch: int | None = None) -> Path:
    """Plain fine-tuning of `model` on (context, target) rows (`batch` rows drawn per step, all of them when
    None), saved with its tokenizer to `out`: a tiny model taught a behaviour in seconds."""
    import torch
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    torch.manual_seed(0)
    for _ in range(steps):
        drawn = rows if batch is None else [rows[i] for i in torch.randint(len(rows), (batch,)).tolist()]
        opt.zero_grad()
        _target_loss(model, drawn).backward()
        opt.step()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _target_loss(model, rows: list[tuple[list[int], list[int]]]):
    """Cross-entropy of each row's target given its context, the rows right-padded into one batch."""
    import torch
    width = max(len(c) + len(t) for c, t in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100)
    for r, (context, target) in enumerate(rows):
        ids[r, :len(context) + len(target)] = torch.tensor(context + target)
        labels[r, len(context):len(context) + len(target)] = torch.tensor(target)
    logits = model(input_ids=ids).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))
