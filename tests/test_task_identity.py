"""Which task a config trains for (grpo_core/evaluation/task_identity.py): the name that keeps one champion per task, and the
signature that tells two tasks apart when they share a name."""
from __future__ import annotations

import pytest

from grpo_core.config import load_config
from grpo_core.evaluation.task_identity import (_slug_words, parse_signature_tag, registered_model_name, signature_differences,
                                     signature_tag, task_signature, task_slug)


@pytest.mark.parametrize("path, name", [
    ("configs/default.yaml", "grpo-arithmetic-1d-add-sub"), ("configs/tools.yaml", "grpo-arithmetic-3d-mul-calculator"),
    ("configs/math.yaml", "grpo-math"), ("configs/rust_fix.yaml", "grpo-rust-fix"),
])
def test_each_shipped_config_registers_under_its_own_task(path, name):
    assert registered_model_name(load_config(path)) == name


@pytest.mark.parametrize("entry, slug", [
    ("openenv:calculator_env:app", "openenv-calculator-env"), ("openenv:med_safety_gym.app:app", "openenv-med-safety-gym"),
    ("openenv:echo_env.server.app:app", "openenv-echo-env"), ("openenv:http://127.0.0.1:8000", "openenv-127-0-0-1"),
    ("verifiers:calc_taskset", "verifiers-calc-taskset"), ("rust_fix", "rust-fix"),
])
def test_an_environment_of_another_standard_names_its_task(entry, slug):
    from grpo_core.evaluation.task_identity import _environment_name
    assert _slug_words(_environment_name(entry)) == slug


def test_a_name_without_the_placeholder_is_kept_and_none_turns_registration_off():
    cfg = load_config("configs/default.yaml", ["tracking.registered_model_name=my-model"])
    assert registered_model_name(cfg) == "my-model"
    assert registered_model_name(load_config("configs/default.yaml", ["tracking.registered_model_name=null"])) is None
    assert task_slug(load_config("configs/default.yaml", ["data.min_digits=1", "data.max_digits=2"])) == \
        "arithmetic-1-2d-add-sub"


def _signature(*overrides: str) -> dict[str, str]:
    return task_signature(load_config("configs/default.yaml", list(overrides)))


def test_the_signature_changes_with_the_task_and_not_with_how_it_is_trained():
    base = _signature()
    assert signature_differences(_signature("learning_rate=1e-3", "data.bare_prompt_prob=0.5"), base) == []
    assert signature_differences(_signature("data.system_prompt=Add them."), base) == ["prompt"]
    assert signature_differences(_signature("data.eval_size=30"), base) == []       # the same questions, fewer held out
    assert signature_differences(_signature("data.curated=inbox/"), base) == ["source"]
    assert signature_differences(_signature("correctness_func=format"), base) == ["check"]
    assert signature_differences(_signature("tools=[calculator]", "data.guided_completions=0"), base) == ["tools"]
    assert signature_differences(_signature('data.operations=["+", "-", "*"]'), base) == ["source"]
    assert parse_signature_tag(signature_tag(base)) == base
    assert signature_differences(base, {}) == list(base)          # an unknown signature differs in every part
