"""Prompt wordings: training draws a system prompt / instruction / bare user turn per question
(data.system_prompts, data.instructions, data.bare_prompt_prob), evaluation also puts the math questions in
wordings training never used (eval.foreign_*), and the config keeps the two apart."""
from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from grpo_core.config import GRPOConfig, load_config
from grpo_core.rollout.sampling import PromptFormat, prompt_messages
from grpo_core.task import Task
from conftest import tiny_config

INSTRUCTIONS = ["Put the answer in <answer></answer> tags. {question}", "{question} Answer as <answer>N</answer>."]
SYSTEMS = ["Answer math questions with <answer>N</answer>."]


def _math(i: int) -> Task:
    return Task(id=f"q{i}", kind="math", source="arithmetic", prompt=f"What is {i} + 1?", answer=str(i + 1))


def _varied(bare_prob=0.3, salt=1) -> PromptFormat:
    return PromptFormat("Solve it. Reply in <answer></answer> tags.", (("What is 2 + 2?", "<answer>4</answer>"),),
                        system_prompts=tuple(SYSTEMS), instructions=tuple(INSTRUCTIONS), bare_prob=bare_prob,
                        salt=salt)


def test_each_question_draws_one_wording_from_its_id_and_salt_alone():
    fmt = _varied()
    tasks = [_math(i) for i in range(3000)]
    drawn = [fmt.for_task(t) for t in tasks]
    assert drawn == [fmt.for_task(t) for t in tasks]                          # a resumed run draws the same
    assert [fmt.for_task(t) for t in tasks[:50]] != [_varied(salt=2).for_task(t) for t in tasks[:50]]
    bare = [d for d in drawn if not d.few_shot and not d.system_prompt]
    assert abs(len(bare) / len(drawn) - 0.3) < 0.04
    assert all(d.instruction in INSTRUCTIONS and not d.system_prompt for d in bare)     # no system, no examples
    examples_alone = [d for d in drawn if d.few_shot and not d.system_prompt]           # the step between
    assert abs(len(examples_alone) / len(drawn) - 0.7 * 0.3) < 0.04
    assert Counter(d.instruction for d in examples_alone).keys() == {"", *INSTRUCTIONS}
    with_system = [d for d in drawn if d.system_prompt]
    assert Counter(d.system_prompt for d in with_system).keys() == {fmt.system_prompt, *SYSTEMS}
    assert Counter(d.instruction for d in with_system).keys() == {"", *INSTRUCTIONS}
    assert all(d.few_shot in (fmt.few_shot, ()) for d in with_system)
    system_alone = [d for d in with_system if not d.few_shot]                           # the format in words
    assert abs(len(system_alone) / len(drawn) - 0.7 * 0.7 * 0.3) < 0.04
    assert Counter(d.instruction for d in system_alone).keys() == {"", *INSTRUCTIONS}
    assert Counter(d.wording for d in drawn).keys() == {"full", "examples", "system", "bare"}
    code = Task(id="c", kind="python", source="x", prompt="def f(): ...", tests={"x": 1}, entry_point="f")
    assert fmt.for_task(code) == PromptFormat()                                         # code: its own prompt
    fixed = PromptFormat("S", (("a", "b"),))
    assert fixed.for_task(tasks[0]) is fixed                                           # no alternatives: as before


def test_fixed_shape_chances_draw_the_system_prompt_alone_and_never_the_examples_alone():
    legacy = _varied(bare_prob=0.5)
    fmt = dataclasses.replace(legacy, system_alone_prob=0.3)
    tasks = [_math(i) for i in range(3000)]
    kinds = Counter(fmt.for_task(t).wording for t in tasks)
    assert kinds.keys() == {"bare", "system", "full"}
    for kind, chance in (("bare", 0.5), ("system", 0.3), ("full", 0.2)):
        assert abs(kinds[kind] / len(tasks) - chance) < 0.04
    alone = [fmt.for_task(t) for t in tasks if fmt.for_task(t).wording == "system"]
    assert Counter(d.system_prompt for d in alone).keys() == {legacy.system_prompt, *SYSTEMS}
    assert Counter(d.instruction for d in alone).keys() == {"", *INSTRUCTIONS}
    assert all(fmt.guide(t) is None for t in tasks)                          # no guidance asked
    guided = dataclasses.replace(fmt, guided=2)
    assert all((guided.guide(t) is None) == (fmt.for_task(t).wording == "full") for t in tasks[:200])
    zero = dataclasses.replace(legacy, system_alone_prob=0.0)           # set to 0: no partial shape at all
    assert Counter(zero.for_task(t).wording for t in tasks).keys() == {"bare", "full"}
    unset = Counter(legacy.for_task(t).wording for t in tasks)          # null: the nested draws, as before
    assert unset.keys() == {"bare", "examples", "system", "full"}


def test_a_bare_wording_is_one_user_turn_with_the_question_in_place():
    fmt = _varied(bare_prob=1.0)
    t = _math(7)
    messages = prompt_messages(t, fmt)
    assert len(messages) == 1 and messages[0]["role"] == "user"
    assert messages[0]["content"] in [i.replace("{question}", t.prompt) for i in INSTRUCTIONS]
    braces = Task(id="b", kind="math", source="s", prompt="Is {x} = {question}?", answer="1")
    assert "Is {x} = {question}?" in prompt_messages(braces, fmt)[0]["content"]        # no str.format on questions


def test_training_draws_afresh_each_iteration_and_evaluation_keeps_one_wording():
    cfg = GRPOConfig(data=dict(system_prompts=SYSTEMS, instructions=INSTRUCTIONS, bare_prompt_prob=0.5))
    tasks = [_math(i) for i in range(40)]
    it1, it2 = cfg.data.prompt_format_at(1), cfg.data.prompt_format_at(2)
    assert [prompt_messages(t, it1) for t in tasks] != [prompt_messages(t, it2) for t in tasks]
    assert len({str(prompt_messages(t, it1)[0]) for t in tasks}) > 2
    assert all(prompt_messages(t, cfg.data.prompt_format)[0]["content"] == cfg.data.system_prompt for t in tasks)
    warm = GRPOConfig(data=dict(instructions=INSTRUCTIONS, bare_prompt_prob=0.5, response_prefix="<answer>",
                                response_prefix_iterations=2))
    assert warm.data.prompt_format_at(1).response_prefix == "<answer>" and warm.data.prompt_format_at(1).varies
    assert warm.data.prompt_format_at(3).response_prefix == "" and warm.data.prompt_format_at(3).varies


def test_wordings_start_at_their_iteration_after_the_main_wording_alone():
    cfg = GRPOConfig(data=dict(system_prompts=SYSTEMS, instructions=INSTRUCTIONS, bare_prompt_prob=0.5,
                               guided_completions=2, wordings_from_iteration=3))
    tasks = [_math(i) for i in range(40)]
    main = [prompt_messages(t, cfg.data.prompt_format) for t in tasks]
    for iteration in (1, 2):
        fmt = cfg.data.prompt_format_at(iteration)
        assert [prompt_messages(t, fmt) for t in tasks] == main and not any(fmt.guide(t) for t in tasks)
    fmt = cfg.data.prompt_format_at(3)
    assert [prompt_messages(t, fmt) for t in tasks] != main and any(fmt.guide(t) for t in tasks)


def test_the_score_stage_reports_rewards_per_kind_of_training_wording(tmp_path):
    """wording/<kind>/...: each answer counted under the wording its question drew that iteration; a
    run on one wording logs none."""
    from grpo_core.io import write_jsonl
    from grpo_core.task import write_tasks
    from tasks.score import score
    tasks = [_math(i) for i in range(30)]
    prompts = write_tasks(tmp_path / "prompts.jsonl", tasks)
    samples = write_jsonl(tmp_path / "samples.jsonl", [      # one right and tagged, one neither: 0.5 each
        {"task_id": t.id, "group": g, "completion": answer, "completion_ids": [1, 2]}
        for g, t in enumerate(tasks) for answer in (f"<answer>{t.answer}</answer>", "no tags")])
    varied = GRPOConfig(output_dir=str(tmp_path), reward_funcs=["accuracy", "format"], data=dict(
        system_prompts=SYSTEMS, instructions=INSTRUCTIONS, bare_prompt_prob=0.4, wordings_from_iteration=2))
    kinds = Counter(varied.data.prompt_format_at(2).for_task(t).wording for t in tasks)
    assert {"full", "bare"} <= set(kinds)
    config = varied.model_dump(mode="json")
    m = score.fn(config, str(tmp_path / "run"), 2, str(prompts), str(samples))["metrics"]
    assert {k.split("/")[1] for k in m if k.startswith("wording/")} == set(kinds)
    for kind, n in kinds.items():
        assert m[f"wording/{kind}/share"] == pytest.approx(n / len(tasks))
        assert m[f"wording/{kind}/reward/accuracy"] == 0.5 and m[f"wording/{kind}/reward/format"] == 0.5
    warm = score.fn(config, str(tmp_path / "run"), 1, str(prompts), str(samples))["metrics"]
    assert not [k for k in warm if k.startswith("wording/")] and warm["reward/accuracy"] == 0.5


@pytest.mark.parametrize("over,field,says", [
    (dict(data=dict(instructions=["Answer: question"])), "data.instructions[0]", "{question} exactly once"),
    (dict(data=dict(bare_prompt_prob=0.2)), "data.bare_prompt_prob", "data.instructions is empty"),
    (dict(data=dict(wordings_from_iteration=3)), "data.wordings_from_iteration", "no wordings to draw"),
    (dict(data=dict(instructions=INSTRUCTIONS, bare_prompt_prob=0.7, system_alone_prob=0.4)),
     "data.system_alone_prob", "above 1"),
    (dict(data=dict(system_alone_prob=0.3, few_shot=[])), "data.system_alone_prob", "few_shot is empty"),
    (dict(eval=dict(foreign_instructions=["{question} and {question}"])), "eval.foreign_instructions[0]",
     "exactly once"),
    (dict(data=dict(instructions=INSTRUCTIONS), eval=dict(foreign_instructions=["  put the ANSWER in "
                                                                                "<answer></answer> tags. {question}"])),
     "eval.foreign_instructions[0]", "training never sees"),
    (dict(data=dict(system_prompts=SYSTEMS), eval=dict(foreign_system_prompts=[SYSTEMS[0]])),
     "eval.foreign_system_prompts[0]", "training never sees"),
])
def test_bad_wordings_are_refused_naming_the_field(tmp_path, over, field, says):
    import yaml
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(over))
    with pytest.raises(ValueError) as e:
        load_config(path)
    assert field in str(e.value) and says in str(e.value)


def test_the_shipped_configs_train_on_varied_wordings_and_evaluate_foreign_ones():
    """default.yaml and math.yaml both draw training wordings with guidance (math.yaml after its main-wording
    iterations) and evaluate in foreign wordings."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    for name in ("default.yaml", "math.yaml"):
        cfg = load_config(root / "configs" / name)
        start = cfg.data.wordings_from_iteration
        assert 1 <= start <= cfg.pipeline_iterations // 2 + 1, name      # at least half the run in varied wordings
        assert cfg.data.prompt_format_at(start).varies and not cfg.data.prompt_format_at(start - 1).varies
        assert cfg.data.bare_prompt_prob > 0 and cfg.data.guided_completions and len(cfg.data.instructions) >= 4
        assert cfg.eval.foreign_format is not None and cfg.eval.foreign_instructions


def test_foreign_evaluation_logs_its_own_metrics_on_the_math_questions(tmp_path, grpo_home):
    """The math questions again, in the foreign wordings: eval/<mode>/foreign/..., rows marked, the same
    numbers from overlapped and after-the-fact scoring, in-wording metrics unchanged by it."""
    from grpo_core.data import arithmetic
    from grpo_core.evaluation.evaluate import evaluate_policy, merge_rows, sample_rows
    from grpo_core.model.policy import load_policy
    from flows.cli.format import format_eval_table
    foreign = dict(foreign_system_prompts=["Compute. Final number in <answer></answer>."],
                   foreign_instructions=["Tell me: {question} (answer in <answer></answer> tags)"])
    plain = GRPOConfig.model_validate(tiny_config(tmp_path, eval=dict(num_samples=2, exported_shape=False)))
    cfg = GRPOConfig.model_validate(tiny_config(tmp_path, eval=dict(num_samples=2, exported_shape=False, **foreign)))
    tasks = arithmetic.eval_tasks(6, 1, 1, ["+"])
    policy = load_policy(cfg, None, need_reference=False)
    metrics, rows = evaluate_policy(policy, tasks, cfg, seed=5, progress=False)
    base_metrics, base_rows = evaluate_policy(policy, tasks, plain, seed=5, progress=False)
    foreign_rows = [r for r in rows if r.get("wording") == "foreign"]
    assert [r for r in rows if "wording" not in r] == base_rows and len(foreign_rows) == 6 * 3
    for mode in ("greedy", "sampled"):
        for k in ("strict_pass_at_1", "format_rate", "pass_at_1"):
            assert f"eval/{mode}/foreign/{k}" in metrics
    assert metrics["eval/foreign/num_questions"] == 6.0
    assert {k: v for k, v in metrics.items() if "foreign" not in k} == base_metrics
    assert merge_rows(tasks, [rows[1::2], rows[::2]]) == rows
    off = cfg.model_copy(update={"stages": cfg.stages.model_copy(update={
        "score": cfg.stages.score.model_copy(update={"during_rollout": False})})})
    assert sample_rows(policy, tasks, off, seed=5, progress=False) == rows
    table = format_eval_table({0: metrics})
    assert "eval/greedy/foreign/strict_pass_at_1" in table and "eval/sampled/foreign/reward/total" not in table


def test_a_wording_without_system_prompt_or_examples_is_guided_by_the_full_prompt():
    fmt = PromptFormat("Solve it. Reply in <answer></answer> tags.", (("What is 2 + 2?", "<answer>4</answer>"),),
                       system_prompts=tuple(SYSTEMS), instructions=tuple(INSTRUCTIONS), bare_prob=0.4, salt=3,
                       guided=2)
    tasks = [_math(i) for i in range(400)]
    for t in tasks:
        drawn, guide = fmt.for_task(t), fmt.guide(t)
        if drawn.system_prompt and drawn.few_shot:
            assert guide is None                                            # a full wording needs no guide
        else:
            assert guide == PromptFormat(fmt.system_prompt, fmt.few_shot, "", drawn.instruction)
    assert sum(fmt.guide(t) is not None for t in tasks) > 100
    assert all(dataclasses.replace(fmt, guided=0).guide(t) is None for t in tasks)


def test_guided_answers_are_sampled_after_the_guide_and_trained_on_the_drawn_wording(tmp_path, grpo_home):
    """The first `guided` answers of a guided group come from the full prompt (the sampler saw it), carry the
    drawn wording's prompt ids (what the update trains), are marked and have no sampler log-probs; the other
    groups are sampled as without guidance."""
    from grpo_core.model.policy import load_policy
    from grpo_core.rollout.samplers import make_backend, rollout
    from grpo_core.rollout.sampling import SamplingParams, chat_prompt_ids
    cfg = GRPOConfig.model_validate(tiny_config(tmp_path, num_generations=4, data=dict(
        instructions=INSTRUCTIONS, bare_prompt_prob=0.3, guided_completions=2)))
    fmt = cfg.data.prompt_format_at(1)
    policy = load_policy(cfg, None, need_reference=False)
    tok, backend = policy.tokenizer, make_backend(cfg, policy, progress=False)
    seen = []
    generate = backend.generate
    backend.generate = lambda rows, n, params, **kw: seen.extend(rows) or generate(rows, n, params, **kw)
    tasks = [_math(i) for i in range(8)]
    params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=1, logprobs=True)
    groups = []
    samples = rollout(backend, tok, tasks, 4, params, fmt, 512, on_group=groups.append)
    guided = [t for t in tasks if fmt.guide(t)]
    assert 0 < len(guided) < len(tasks)
    assert [s.task_id for s in samples] == [t.id for t in tasks for _ in range(4)] and len(groups) == len(tasks)
    for g, t in enumerate(tasks):
        own = chat_prompt_ids(tok, t, fmt, 512)
        group = samples[4 * g:4 * g + 4]
        assert all(s.prompt_ids == own and s.group == g for s in group)
        marks = [s.extra.get("guided", False) for s in group]
        assert marks == ([True, True, False, False] if fmt.guide(t) else [False] * 4)
        assert [s.sampler_logprobs is None for s in group] == marks
        want = [chat_prompt_ids(tok, t, fmt.guide(t), 512)] * 2 + [own] * 2 if fmt.guide(t) else [own] * 4
        assert seen[4 * g:4 * g + 4] == want


@pytest.mark.parametrize("over,says", [
    (dict(num_generations=2, data=dict(instructions=INSTRUCTIONS, bare_prompt_prob=0.5, guided_completions=2)),
     "below num_generations"),
    (dict(data=dict(guided_completions=1)), "bare_prompt_prob or data.system_alone_prob > 0"),
    (dict(data=dict(instructions=INSTRUCTIONS, bare_prompt_prob=0.5, guided_completions=1, few_shot=[])),
     "data.few_shot"),
    (dict(off_policy_mask_threshold=0.5, data=dict(instructions=INSTRUCTIONS, bare_prompt_prob=0.5,
                                                   guided_completions=1)), "off_policy_mask_threshold"),
])
def test_guidance_that_cannot_work_is_refused(over, says):
    with pytest.raises(ValueError) as e:
        GRPOConfig.model_validate(over)
    assert "data.guided_completions" in str(e.value) and says in str(e.value)


def test_chat_template_kwargs_reach_every_rendered_prompt(tiny_model_dir):
    """data.chat_template_kwargs (TRL's chat_template_kwargs) go to apply_chat_template for training's drawn
    wordings, guides, code tasks and evaluation's formats; the pipeline's own arguments are refused."""
    from grpo_core.model.loading import load_tokenizer
    from grpo_core.rollout.sampling import chat_prompt_ids
    tok = load_tokenizer(tiny_model_dir)
    tok.chat_template = ("{% if enable_thinking is defined and not enable_thinking %}NOTHINK {% endif %}"
                         "{% for m in messages %}{{ m['content'] }} {% endfor %}")
    cfg = GRPOConfig(data=dict(instructions=INSTRUCTIONS, bare_prompt_prob=0.5, guided_completions=1,
                               chat_template_kwargs={"enable_thinking": False}))
    plain = GRPOConfig(data=dict(instructions=INSTRUCTIONS, bare_prompt_prob=0.5, guided_completions=1))
    code = Task(id="c", kind="python", source="x", prompt="def f(): ...", tests={"x": 1}, entry_point="f")
    tasks = [_math(i) for i in range(12)] + [code]
    for fmt, plain_fmt in ((cfg.data.prompt_format_at(1), plain.data.prompt_format_at(1)),
                           (cfg.data.prompt_format, plain.data.prompt_format)):
        for t in tasks:
            text = tok.decode(chat_prompt_ids(tok, t, fmt, 4096))
            assert text.startswith("NOTHINK ") and text[len("NOTHINK "):] == tok.decode(
                chat_prompt_ids(tok, t, plain_fmt, 4096))
            if fmt.guide(t):
                assert tok.decode(chat_prompt_ids(tok, t, fmt.guide(t), 4096)).startswith("NOTHINK ")
    with pytest.raises(ValueError, match="data.chat_template_kwargs: 'tools'"):
        GRPOConfig(data=dict(chat_template_kwargs={"tools": []}))
