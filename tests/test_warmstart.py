"""Warm start (grpo_core/update/warmstart.py, tasks/warmstart.py): the run's correct answers in the full prompt become
demonstrations of the same questions without the worked examples; supervised fine-tuning moves them into the
adapter; as a stage it runs first in iteration 1 only when asked, and the iteration goes on from its adapter."""
from __future__ import annotations

import pytest
import torch

from grpo_core.config import GRPOConfig
from grpo_core.model.policy import load_policy
from grpo_core.rollout.sampling import Sample, chat_prompt_ids
from grpo_core.task import Task
from grpo_core.update.warmstart import (as_demonstrations, correct_answers, demonstration_format, sft_loss,
                                 supervised_finetune)
from tests.conftest import tiny_config

TASKS = [Task(id="q1", kind="math", source="arithmetic", prompt="What is 3 + 4?", answer="7"),
         Task(id="q2", kind="math", source="arithmetic", prompt="What is 9 - 5?", answer="4")]


def _cfg(tmp_path, **overrides) -> GRPOConfig:
    return GRPOConfig.model_validate(tiny_config(tmp_path, warmstart={"enabled": True}, **overrides))


def _sample(tok, task: Task, text: str) -> Sample:
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return Sample(task_id=task.id, group=0, prompt_ids=[], completion_ids=ids, completion=text, truncated=False)


def test_only_correct_well_formed_answers_are_kept_at_most_so_many_per_question(grpo_home, tmp_path):
    cfg = _cfg(tmp_path)
    tok = load_policy(cfg, need_reference=False).tokenizer
    texts = [(TASKS[0], "<answer>7</answer>"), (TASKS[0], "<answer>8</answer>"), (TASKS[0], "7"),
             (TASKS[0], "<answer>7</answer>"), (TASKS[0], "<answer>7</answer>"), (TASKS[1], "<answer>3 + 1</answer>"),
             (TASKS[1], "<answer>4</answer>")]
    samples = [_sample(tok, t, x) for t, x in texts]
    assert correct_answers(samples, TASKS, cfg, per_question=2) == [0, 3, 6]
    assert correct_answers(samples, TASKS, cfg, per_question=1) == [0, 6]


def test_demonstrations_are_the_sampled_tokens_answering_the_question_without_the_examples(grpo_home, tmp_path):
    cfg = _cfg(tmp_path, data={"instructions": ["{question} Reply in tags."]})
    assert cfg.data.few_shot, "the default task shows worked examples: the warm start removes them"
    tok = load_policy(cfg, need_reference=False).tokenizer
    kept = [_sample(tok, TASKS[0], "<answer>7</answer>"), _sample(tok, TASKS[1], "<answer>4</answer>")]
    demos = as_demonstrations(tok, kept, TASKS, cfg, toolbox=None)
    example_question = cfg.data.few_shot[0][0]
    for demo, sample, task in zip(demos, kept, TASKS):
        prompt = tok.decode(demo.prompt_ids)
        assert demo.completion_ids == sample.completion_ids and demo.reward == 1.0
        assert demo.prompt_ids == chat_prompt_ids(tok, task, demonstration_format(cfg), cfg.max_prompt_length)
        assert task.prompt in prompt and cfg.data.system_prompt in prompt and example_question not in prompt
        full = tok.decode(chat_prompt_ids(tok, task, cfg.data.prompt_format, cfg.max_prompt_length))
        assert example_question in full


def test_fine_tuning_puts_the_demonstrated_answer_into_the_adapter(grpo_home, tmp_path):
    """Before: the tiny random model does not answer the bare-of-examples prompt with the demonstration; after
    a few epochs of warm start its greedy answer is the demonstration, token for token, and the loss fell."""
    cfg = _cfg(tmp_path, lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                              "down_proj", "lm_head"])   # the tiny model's head is near uniform
    torch.manual_seed(0)
    policy = load_policy(cfg, need_reference=False)
    tok = policy.tokenizer
    kept = [_sample(tok, TASKS[0], "<answer>7</answer>"), _sample(tok, TASKS[1], "<answer>4</answer>")]
    demos = as_demonstrations(tok, kept, TASKS, cfg, toolbox=None)

    def greedy(demo):
        ids = torch.tensor([demo.prompt_ids])
        with torch.no_grad():
            out = policy.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                        max_new_tokens=len(demo.completion_ids), pad_token_id=tok.eos_token_id)
        return out[0, ids.shape[1]:].tolist()

    policy.model.eval()
    assert [greedy(d) for d in demos] != [d.completion_ids for d in demos]
    before = sft_loss(policy, demos).item()
    losses = supervised_finetune(policy, demos, epochs=120, batch_size=2, learning_rate=3e-3, max_grad_norm=1.0,
                                 seed=0)
    policy.model.eval()
    assert len(losses) == 120 and sum(losses[-10:]) / 10 < 0.1 * before
    assert [greedy(d) for d in demos] == [d.completion_ids for d in demos]


def test_the_config_refuses_a_warm_start_with_nothing_to_move(tmp_path):
    with pytest.raises(ValueError, match="warmstart.enabled needs data.few_shot"):
        GRPOConfig.model_validate(tiny_config(tmp_path, data={"few_shot": []}, warmstart={"enabled": False}) |
                                  {"warmstart": {"enabled": True}})


def test_the_stage_runs_first_in_iteration_one_and_the_iteration_goes_on_from_its_adapter(
        tmp_path, grpo_home, prefect_engine, mlflow_uri):
    from grpo_core import stages
    from grpo_core.io import read_jsonl
    from flows.train import iteration_flow
    from tasks import tracking
    config = tiny_config(tmp_path, pipeline_iterations=2, warmstart={"enabled": True, "prompts": 2, "epochs": 1})
    cfg = GRPOConfig.model_validate(config)
    assert [s.name for s in stages.STAGES if s.when is None or s.when(cfg, 1)][0] == "warmstart"
    assert "warmstart" not in [s.name for s in stages.STAGES if s.when is None or s.when(cfg, 2)]
    run_dir = tmp_path / "runs" / "t"
    run_dir.mkdir(parents=True)
    run_id = tracking.start_or_resume_run(cfg, run_dir, None)
    records = iteration_flow(config, str(run_dir), 1, None, None)
    warm = records["warmstart"]
    assert warm["checkpoint"] == str(run_dir / "iter-1" / "warmstart" / "checkpoint")
    assert (run_dir / "iter-1" / "warmstart" / "checkpoint" / "adapter_config.json").is_file()
    assert warm["metrics"]["warmstart/answers"] == 2 * cfg.num_generations
    assert len(list(read_jsonl(run_dir / "iter-1" / "warmstart" / "demonstrations.jsonl"))) == \
        warm["metrics"]["warmstart/demonstrations"]
    # the rollout sampled from the warm start's adapter, and its record says so
    from tasks.rollout import rollout
    assert rollout.fn.completed(dict(config=config, run_dir=str(run_dir), iteration=1,
                                     prompts=records["curate"]["prompts"], checkpoint=warm["checkpoint"])) \
        == records["rollout"]
    import mlflow
    logged = mlflow.MlflowClient(mlflow_uri).get_run(run_id).data.metrics
    assert logged["warmstart/answers"] == 2 * cfg.num_generations



def test_the_stage_says_in_one_line_what_it_demonstrated_and_how_far_the_loss_went():
    from tasks.warmstart import warmstart_summary
    policy = {"questions": 64.0, "answers": 512.0, "demonstrations": 40.0, "questions_demonstrated": 30.0}
    assert warmstart_summary(policy, [1.25, 0.5, 0.0312]) == (
        "warm start: 40 demonstrations on 30 of 64 questions (512 answers sampled); "
        "SFT loss 1.250 -> 0.031 over 3 steps")
    reference = {"questions": 128.0, "answers": 0.0, "demonstrations": 120.0, "questions_demonstrated": 120.0,
                 "references": 128.0, "references_kept": 120.0}
    assert "reference exchanges kept 120 of 128" in warmstart_summary(reference, [1.0])
    assert "sampled" not in warmstart_summary(reference, [1.0])
    assert "no correct answer" in warmstart_summary({**policy, "demonstrations": 0.0}, [])

# -- reference demonstrations: a question's reference call, the tool's real result, that result as the answer --

def _tool_task(task_id: str, question: str, answer: str, call: dict | None) -> Task:
    return Task(id=task_id, kind="math", source="tool_problems/product", prompt=question, answer=answer,
                meta={"call": call} if call else {})


CALC_TASKS = [_tool_task("c1", "What is 214 * 375?", "80250",
                         {"name": "calculator", "arguments": {"expression": "214 * 375"}}),
              _tool_task("c2", "What is 512 * 333?", "170496",
                         {"name": "calculator", "arguments": {"expression": "512 * 334"}}),     # computes another
              _tool_task("c3", "What is 101 * 202?", "20402", None),                              # has no reference
              _tool_task("c4", "What is 9 * 9?", "81", {"name": "python", "arguments": {"code": "print(81)"}})]


def _tools_cfg(tmp_path, demonstrations="reference", tools=("calculator",), **overrides) -> GRPOConfig:
    """SmolLM2's config and tokenizer (the tiny model's character tokenizer has <answer> as a special token, which
    a decoded turn drops); reference demonstrations sample nothing, so its weights only load."""
    return GRPOConfig.model_validate(tiny_config(
        tmp_path, model="smollm2-135m-instruct", tools=list(tools), max_prompt_length=512,
        warmstart={"enabled": True, "demonstrations": demonstrations}, **overrides))


@pytest.fixture()
def real_home(monkeypatch):
    from tests.conftest import REAL_GRPO_HOME
    monkeypatch.setenv("GRPO_HOME", str(REAL_GRPO_HOME))       # the converted default model, fetched once


def _tokenizer(cfg):
    from grpo_core.model.loading import load_tokenizer, resolve_model
    return load_tokenizer(resolve_model(cfg.model))


@pytest.mark.smoke
def test_a_reference_exchange_is_the_call_the_tools_own_result_and_that_result_as_the_answer(real_home, tmp_path):
    from grpo_core.rollout.multiturn import Toolbox
    from grpo_core.update.warmstart import reference_samples
    cfg = _tools_cfg(tmp_path)
    tok = _tokenizer(cfg)
    toolbox = Toolbox.from_config(cfg)
    samples = reference_samples(tok, CALC_TASKS, cfg, toolbox)
    # c3 has no reference call and c4's names a tool this run does not have: neither is replayed
    assert [s.task_id for s in samples] == ["c1", "c2"]
    right, wrong = samples
    assert right.completion == "<answer>80250</answer>" and wrong.completion == "<answer>171008</answer>"
    assert [m["role"] for m in right.extra["conversation"]] == ["assistant", "tool", "assistant"]
    assert right.extra["conversation"][1]["content"] == "80250" and right.extra["reference"]
    call_text = right.extra["conversation"][0]["content"]
    assert call_text.startswith("<tool_call>") and '"expression": "214 * 375"' in call_text
    # the model's two turns are trained on (each ends with EOS), the tool's turn between them is context
    mask, ids = right.completion_mask, right.completion_ids
    assert len(mask) == len(ids) and 0 in mask and mask[0] == 1 and mask[-1] == 1 and ids[-1] == tok.eos_token_id
    model_text = tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=True)
    assert model_text == call_text + "<answer>80250</answer>"
    assert "80250" in tok.decode([t for t, m in zip(ids, mask) if not m])
    # the rewards judge the replays: the reference that computes another number is not a demonstration
    assert correct_answers(samples, CALC_TASKS, cfg, per_question=1) == [0]


@pytest.mark.smoke
def test_reference_calls_run_a_batch_at_a_time_and_keep_the_questions_order(real_home, tmp_path):
    from grpo_core.rollout.multiturn import Toolbox
    from grpo_core.update import warmstart
    cfg = _tools_cfg(tmp_path)
    n = 2 * warmstart.REFERENCE_CALLS_AT_ONCE + 3
    questions = [_tool_task(f"p{a}", f"What is {a} * 7?", str(a * 7),
                            {"name": "calculator", "arguments": {"expression": f"{a} * 7"}}) for a in range(n)]
    samples = warmstart.reference_samples(_tokenizer(cfg), questions, cfg, Toolbox.from_config(cfg))
    assert [s.completion for s in samples] == [f"<answer>{a * 7}</answer>" for a in range(n)]


@pytest.mark.smoke
def test_reference_demonstrations_need_no_sampling_and_are_asked_without_the_examples(real_home, tmp_path):
    from grpo_core.update.warmstart import collect_demonstrations
    cfg = _tools_cfg(tmp_path, data={"few_shot": []})       # nothing shown in the prompt: the references teach it
    policy = load_policy(cfg, need_reference=False)
    demos, kept, stats = collect_demonstrations(policy, CALC_TASKS, cfg, seed=0, progress=False)
    assert stats == {"questions": 4.0, "answers": 0.0, "demonstrations": 1.0, "questions_demonstrated": 1.0,
                     "references": 2.0, "references_kept": 1.0}
    assert [s.task_id for s in kept] == ["c1"] and demos[0].completion_ids == kept[0].completion_ids
    prompt = policy.tokenizer.decode(demos[0].prompt_ids)
    assert "What is 214 * 375?" in prompt and "calculator" in prompt       # the question, and the tools listed
    with pytest.raises(ValueError, match="none of the 1 warm-start questions has a reference call"):
        collect_demonstrations(policy, CALC_TASKS[2:3], cfg, seed=0, progress=False)


@pytest.mark.smoke
def test_both_adds_the_references_to_the_policys_own_right_answers(real_home, tmp_path):
    from grpo_core.update.warmstart import collect_demonstrations
    cfg = _tools_cfg(tmp_path, demonstrations="both")
    policy = load_policy(cfg, need_reference=False)
    _, kept, stats = collect_demonstrations(policy, CALC_TASKS[:2], cfg, seed=0, progress=False)
    assert stats["answers"] == 2 * cfg.num_generations and stats["references_kept"] == 1.0
    assert [s.task_id for s in kept if s.extra.get("reference")] == ["c1"]


@pytest.mark.smoke
@pytest.mark.parametrize("backend", ["docker", "local"])
def test_a_python_reference_program_runs_in_the_sandbox_and_its_output_is_the_answer(real_home, tmp_path, backend):
    from sandbox_support import need_bwrap, need_docker
    from grpo_core.data.sources import load_source
    from grpo_core.rollout.multiturn import Toolbox
    from grpo_core.update.warmstart import reference_samples
    need_docker() if backend == "docker" else need_bwrap()
    cfg = _tools_cfg(tmp_path, tools=("python",), sandbox={"backend": backend})
    questions = list(load_source("tool_problems", kinds=["python"], n=5))
    tok = _tokenizer(cfg)
    samples = reference_samples(tok, questions, cfg, Toolbox.from_config(cfg))
    assert [s.completion for s in samples] == [f"<answer>{t.answer}</answer>" for t in questions]
    assert correct_answers(samples, questions, cfg, per_question=1) == list(range(len(questions)))


def test_the_config_refuses_reference_demonstrations_without_tools(tmp_path):
    with pytest.raises(ValueError, match="warmstart.demonstrations: reference replays each question's reference"):
        GRPOConfig.model_validate(tiny_config(tmp_path) | {"warmstart": {"enabled": True,
                                                                         "demonstrations": "reference"}})
