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
