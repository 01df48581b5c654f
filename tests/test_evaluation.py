"""Evaluation: the pass@k estimator, the metrics, determinism on the tiny model, the evaluation without tools,
and the evaluate stage with real MLflow (metrics per iteration, sample table, plots, tags). The monitors on the
evaluation's answers: tests/test_monitors.py."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from grpo_core.config import ConfigError, EvalConfig, GRPOConfig, load_config
from grpo_core.evaluation.evaluate import summarize
from grpo_core.evaluation.passk import default_ks, mean_pass_at_k, pass_at_k
from conftest import tiny_config


# -- pass@k -------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,c,k,expected", [
    (5, 2, 1, 2 / 5),                 # pass@1 = c/n
    (5, 2, 2, 1 - 3 / 10),            # 1 - C(3,2)/C(5,2)
    (5, 2, 3, 1 - 1 / 10),            # 1 - C(3,3)/C(5,3)
    (5, 2, 4, 1.0),                   # n-c < k: some correct answer is always drawn
    (8, 1, 4, 1 - 35 / 70),           # 1 - C(7,4)/C(8,4)
    (8, 3, 4, 1 - 5 / 70),            # 1 - C(5,4)/C(8,4)
    (10, 0, 8, 0.0),
    (4, 4, 4, 1.0),
    (1, 1, 1, 1.0),
])
def test_pass_at_k_matches_hand_computed_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_pass_at_k_rejects_bad_arguments_and_averages_only_eligible_questions():
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)
    with pytest.raises(ValueError):
        pass_at_k(2, 3, 1)
    # question 3 has only one scored sample: left out of pass@2, counted in pass@1
    counts = [(2, 1), (2, 0), (1, 1)]
    assert mean_pass_at_k(counts, 2) == pytest.approx((1.0 + 0.0) / 2)
    assert mean_pass_at_k(counts, 1) == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    assert mean_pass_at_k([(1, 1)], 2) is None


def test_eval_config_ks_defaults_and_validation():
    assert default_ks(0) == [] and default_ks(1) == [1] and default_ks(2) == [1, 2]
    assert default_ks(8) == [1, 4, 8] and default_ks(10) == [1, 4, 8, 10]
    assert EvalConfig(num_samples=8, pass_k=[8, 1, 4]).ks == [1, 4, 8]
    with pytest.raises(ConfigError, match="eval.pass_k"):
        load_config(None, ["eval.num_samples=4", "eval.pass_k=[1,8]"])


# -- metrics from rows --------------------------------------------------------------------------
def _row(task_id, source, mode, correct, fmt=1.0, length=10, completion="x <answer>1</answer>", kind="math",
         truncated=False):
    acc = None if correct is None else float(correct)
    total = None if acc is None else acc + fmt
    return {"mode": mode, "task_id": task_id, "source": source, "kind": kind, "sample": 0, "prompt": "q",
            "completion": completion, "rewards": {"accuracy": acc, "format": fmt}, "reward_total": total,
            "correct": None if correct is None else bool(correct), "verdict": "", "flags": [],
            "length": length, "truncated": truncated}


def test_summarize_computes_pass_at_k_rewards_and_lengths_per_source():
    rows = [
        _row("a1", "arith", "greedy", True, length=4),
        _row("a2", "arith", "greedy", False, fmt=0.0, length=8, truncated=True),
        _row("g1", "gsm", "greedy", True, length=6),
        # sampled, n = 4: a1 2/4 correct, a2 0/4, g1 4/4 (one unscored: n=3, c=3)
        *[_row("a1", "arith", "sampled", c) for c in (True, False, True, False)],
        *[_row("a2", "arith", "sampled", False) for _ in range(4)],
        *[_row("g1", "gsm", "sampled", c) for c in (True, True, True, None)],
    ]
    m = summarize(rows, ks=[1, 2, 4])
    assert m["eval/greedy/pass_at_1"] == pytest.approx(2 / 3)
    assert m["eval/arith/greedy/pass_at_1"] == pytest.approx(0.5)
    assert m["eval/gsm/greedy/pass_at_1"] == pytest.approx(1.0)
    assert m["eval/greedy/reward/format"] == pytest.approx(2 / 3)
    assert m["eval/greedy/completion_length"] == pytest.approx(6.0)
    assert m["eval/greedy/truncated_frac"] == pytest.approx(1 / 3)
    # a1: pass@1 .5, pass@2 1-C(2,2)/C(4,2)=5/6, pass@4 1; a2: 0; g1 (n=3): 1, 1, left out of pass@4
    assert m["eval/arith/sampled/pass_at_1"] == pytest.approx(0.25)
    assert m["eval/arith/sampled/pass_at_2"] == pytest.approx((5 / 6) / 2)
    assert m["eval/sampled/pass_at_2"] == pytest.approx((5 / 6 + 0 + 1) / 3)
    assert m["eval/sampled/pass_at_4"] == pytest.approx((1 + 0) / 2)
    assert m["eval/sampled/unscored_frac"] == pytest.approx(1 / 12)
    assert m["eval/sampled/reward/accuracy"] == pytest.approx(5 / 11)
    assert m["eval/num_questions"] == 3 and m["eval/gsm/num_questions"] == 1
    assert "eval/kind_math/greedy/pass_at_1" not in m          # a single kind: no per-kind duplicate
    assert m["eval/monitor/empty_answer_frac"] == 0.0


def test_format_rate_and_strict_pass_count_the_shape_whatever_the_reward_funcs():
    rows = [
        _row("a1", "arith", "greedy", True, completion="<answer>1</answer>"),             # correct, formatted
        _row("a2", "arith", "greedy", True, completion="1"),                              # correct, no tags
        _row("a3", "arith", "greedy", False, completion="<answer>2</answer>"),            # wrong, formatted
        _row("a4", "arith", "greedy", None, completion="<answer>2</answer> more"),        # unscored, not formatted
    ]
    for r in rows:
        r["rewards"] = {"unit_match": 0.5}       # `format` is not a reward function here
    m = summarize(rows, ks=[1])
    assert m["eval/greedy/format_rate"] == pytest.approx(2 / 4)
    assert m["eval/greedy/strict_pass_at_1"] == pytest.approx(1 / 3)      # the unscored one is left out
    assert m["eval/greedy/accuracy"] == pytest.approx(2 / 3)
    assert m["eval/arith/greedy/strict_pass_at_1"] == pytest.approx(1 / 3)
    assert m["eval/greedy/reward/unit_match"] == 0.5


def test_score_samples_uses_plugin_rewards_and_marks_the_format(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from grpo_core.rewards import rewards
    from grpo_core.evaluation.evaluate import score_samples
    from grpo_core.task import Task

    def shout(prompts, completions, **kwargs):
        return [float(c.isupper()) for c in completions]
    monkeypatch.setitem(rewards.REWARD_FUNCS, "shout", shout)
    cfg = GRPOConfig(reward_funcs=["shout"])
    task = Task(id="t", kind="math", source="s", prompt="What is 1 + 1?", answer="2")
    samples = [SimpleNamespace(task_id="t", completion=c, completion_ids=[1, 2], truncated=False)
               for c in ("<answer>2</answer>", "<ANSWER>2</ANSWER>")]
    rows = score_samples(samples, {"t": task}, cfg, "greedy")
    assert [r["rewards"] for r in rows] == [{"shout": 0.0, "accuracy": 1.0}, {"shout": 1.0, "accuracy": 0.0}]
    assert [r["formatted"] for r in rows] == [True, False] and [r["correct"] for r in rows] == [True, False]
    assert [r["reward_total"] for r in rows] == [0.0, 1.0]        # accuracy measured, weighted 0


def _evalm(fmt, acc, length=20.0):
    return {"eval/greedy/pass_at_1": acc, "eval/greedy/format_rate": fmt, "eval/greedy/completion_length": length}


def test_eval_table_is_compact_before_after():
    from flows.cli.format import format_eval_table
    m0 = {**_evalm(0.3, 0.5), "eval/a/greedy/pass_at_1": 0.4, "eval/b/greedy/pass_at_1": 0.6,
          "monitor/tripped/length_collapse": 0.0, "eval/a/greedy/completion_length": 3.0}
    m2 = {**_evalm(0.6, 0.7), "eval/a/greedy/pass_at_1": 0.5, "eval/b/greedy/pass_at_1": 0.9}
    table = format_eval_table({0: m0, "2": m2})
    lines = table.splitlines()
    assert "iter 0" in lines[0] and "iter 2" in lines[0] and "change" in lines[0]
    row = next(line for line in lines if line.startswith("eval/greedy/pass_at_1 "))
    assert row.split()[1:] == ["0.500", "0.700", "+0.200"]
    assert any(line.startswith("eval/b/greedy/pass_at_1") for line in lines)
    assert not any("tripped/" in line or "eval/a/greedy/completion_length" in line for line in lines)
    assert format_eval_table({}) == "(evaluation disabled)"


# -- the tiny model: determinism and the stage with real MLflow ------------------------------------
def _tiny_cfg(tmp_path, **over) -> GRPOConfig:
    return GRPOConfig.model_validate(tiny_config(tmp_path, eval=dict(num_samples=3, pass_k=[1, 2, 3]), **over))


def test_evaluation_is_deterministic_given_the_seed(tmp_path, grpo_home):
    from grpo_core.data import arithmetic
    from grpo_core.evaluation.evaluate import evaluate_checkpoint
    cfg = _tiny_cfg(tmp_path)
    tasks = arithmetic.eval_tasks(4, 1, 1, ["+"])
    m1, r1 = evaluate_checkpoint(cfg, tasks, None, progress=False)
    m2, r2 = evaluate_checkpoint(cfg, tasks, None, progress=False)
    assert m1 == m2 and r1 == r2
    assert len(r1) == 2 * 4 * (1 + 3)                    # in the training prompt, and as to an exported model
    assert [r.get("wording", "") for r in r1] == [""] * 16 + ["exported"] * 16
    assert {"eval/greedy/pass_at_1", "eval/sampled/pass_at_3", "eval/sampled/reward/format",
            "eval/sampled/reward/total", "eval/arithmetic/sampled/pass_at_2", "eval/greedy/truncated_frac",
            "eval/sampled/completion_length", "eval/monitor/empty_answer_frac"} <= set(m1)
    _, r3 = evaluate_checkpoint(cfg, tasks, None, seed=999, progress=False)
    assert [r["completion"] for r in r3 if r["mode"] == "sampled"] != \
           [r["completion"] for r in r1 if r["mode"] == "sampled"]


def test_answers_scored_while_sampling_are_scored_as_afterwards_or_afterwards_on_failure(tmp_path, grpo_home,
                                                                                        monkeypatch):
    """sample_rows scores each task's answers on a helper thread as they are sampled: the rows are those of
    sampling every mode first and scoring after; a reward that fails off the main thread is scored after, and
    with stages.score.during_rollout off no helper thread is used."""
    from grpo_core.data import arithmetic
    from grpo_core.evaluation.evaluate import eval_modes, sample_rows, score_samples
    from grpo_core.model.policy import load_policy
    from grpo_core.rollout.samplers import make_backend, rollout
    cfg = _tiny_cfg(tmp_path)
    cfg = cfg.model_copy(update={"generation_batch_size": 2,        # one prompt shape: the calls below count its passes
                                 "eval": cfg.eval.model_copy(update={"exported_shape": False})})
    tasks = arithmetic.eval_tasks(5, 1, 1, ["+"])
    policy = load_policy(cfg, None, need_reference=False)
    overlapped = sample_rows(policy, tasks, cfg, seed=3, progress=False)
    backend, by_id, after = make_backend(cfg, policy, progress=False), {t.id: t for t in tasks}, []
    for mode, n, params in eval_modes(cfg, 3):
        samples = rollout(backend, policy.tokenizer, tasks, n, params, cfg.data.prompt_format, cfg.max_prompt_length)
        after += score_samples(samples, by_id, cfg, mode)
    assert overlapped == after and len(after) == 5 * (1 + 3)
    monkeypatch.setenv("CALLS_LOG", str(tmp_path / "calls.log"))
    main_only = cfg.model_copy(update={"reward_funcs": ["format", "tests.test_score:fails_on_a_helper_thread"],
                                       "reward_weights": [1.0, 1.0]})
    rows = sample_rows(policy, tasks, main_only, seed=3, progress=False)
    assert [r["completion"] for r in rows] == [r["completion"] for r in after]
    assert (tmp_path / "calls.log").read_text().split() == ["eval-scoring", "MainThread", "MainThread"]
    off = main_only.model_copy(update={"stages": main_only.stages.model_copy(update={
        "score": main_only.stages.score.model_copy(update={"during_rollout": False})})})
    assert sample_rows(policy, tasks, off, seed=3, progress=False) == rows     # stages.score.during_rollout: false
    assert (tmp_path / "calls.log").read_text().split()[3:] == ["MainThread", "MainThread"]   # no helper thread


def make_adapter(cfg: GRPOConfig, out: Path, seed: int = 1) -> Path:
    """A LoRA adapter that changes the model (a fresh one has B = 0, i.e. is the base model)."""
    import torch
    from grpo_core.model.policy import load_policy
    policy = load_policy(cfg, None, need_reference=False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return policy.save(out)


@pytest.fixture()
def evaluated_run(tmp_path, grpo_home, mlflow_uri):
    """A run directory with real evaluations at iterations 0 (base) and 1 (an adapter), in MLflow."""
    from tasks import tracking
    from tasks.evaluate import evaluate
    config = _tiny_cfg(tmp_path).model_dump(mode="json")
    cfg = GRPOConfig.model_validate(config)
    run_dir = Path(cfg.output_dir) / cfg.run_name
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    run_id = tracking.start_or_resume_run(cfg, run_dir, None)
    adapter = make_adapter(cfg, tmp_path / "adapter")
    rec0 = evaluate.fn(config, str(run_dir), 0, None)
    rec1 = evaluate.fn(config, str(run_dir), 1, str(adapter))
    return dict(cfg=cfg, config=config, run_dir=run_dir, run_id=run_id, adapter=adapter, rec0=rec0, rec1=rec1)


def test_stage_logs_metrics_per_iteration_table_plots_and_split(evaluated_run):
    from mlflow.tracking import MlflowClient
    from tasks import tracking
    cfg, run_id = evaluated_run["cfg"], evaluated_run["run_id"]
    c = MlflowClient(tracking.tracking_uri(cfg))
    hist = c.get_metric_history(run_id, "eval/sampled/pass_at_3")
    assert sorted(m.step for m in hist) == [0, 1]
    assert {m.step for m in c.get_metric_history(run_id, "eval/monitor/restated_question_frac")} == {0, 1}
    arts = set(tracking.list_artifact_paths(cfg, run_id, "eval_samples")) | \
        set(tracking.list_artifact_paths(cfg, run_id, "plots")) | set(tracking.list_artifact_paths(cfg, run_id, "data"))
    assert {"eval_samples/iter-000.json", "eval_samples/iter-001.json", "plots/accuracy.png", "plots/reward.png",
            "plots/lengths.png", "data/eval.jsonl"} <= arts
    table = json.loads(Path(tracking.download_artifacts(cfg, run_id, "eval_samples/iter-001.json",
                                                       evaluated_run["run_dir"] / "dl")).read_text())
    cols = table["columns"]
    assert {"prompt", "completion", "reward_accuracy", "reward_format", "verdict", "iteration"} <= set(cols)
    assert len(table["data"]) == 2 * 4 * (1 + 3)
    # the record is the resume point: a second call returns it without logging again
    from tasks.evaluate import evaluate
    again = evaluate.fn(evaluated_run["config"], str(evaluated_run["run_dir"]), 1, str(evaluated_run["adapter"]))
    assert again == evaluated_run["rec1"]
    assert len(c.get_metric_history(run_id, "eval/sampled/pass_at_3")) == 2



def test_the_evaluation_without_tools_asks_in_a_prompt_that_names_no_tool():
    """configs/tools.yaml's own prompt tells the model to call the calculator and shows calls; the evaluation
    without tools puts the same questions in the tool-free wording (no tool named, no call shown)."""
    from grpo_core.evaluation.evaluate import _eval_runs
    from grpo_core.rollout.sampling import prompt_messages
    from grpo_core.task import Task
    cfg = load_config("configs/tools.yaml")
    task = Task(id="q", kind="math", source="arithmetic", prompt="What is 123 * 456?", answer="56088")
    runs = _eval_runs(cfg, seed=0)
    with_tools = [json.dumps(prompt_messages(task, fmt)) for *_, toolbox, wording, fmt in runs
                  if toolbox is not None and not wording]
    without = [json.dumps(prompt_messages(task, fmt)) for *_, toolbox, _, fmt in runs if toolbox is None]
    assert len(with_tools) == len(without) == 2                          # greedy and sampled, each way
    assert all("calculator" in text and "<tool_call>" in text for text in with_tools)
    assert all("tool" not in text.lower() and "calculator" not in text and "123 * 456" in text for text in without)
    with pytest.raises(ValueError, match=r"eval.without_tools_system_prompt mentions 'calculator'"):
        load_config("configs/tools.yaml", ["eval.without_tools_system_prompt=Use the calculator."])
    with pytest.raises(ValueError, match=r"eval.without_tools_few_shot\[0\] mentions '<tool_call>'"):
        load_config("configs/tools.yaml", ['eval.without_tools_few_shot=[["What is 2 * 3?", "<tool_call>x</tool_call>"]]'])


def test_an_agent_run_is_evaluated_through_its_agent_only(monkeypatch):
    """An agent loop (here the calculator agent) words its own prompts: each mode runs once, through it, with no
    tool-free, exported or foreign-worded pass that would bypass it."""
    from pathlib import Path
    from grpo_core.evaluation.evaluate import _eval_runs
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "examples" / "agents"))
    cfg = load_config("configs/tools.yaml", ["tools=[]", "warmstart.enabled=false", "rollout_func=calculator_agent:run",
                                              "eval.without_tools=false"])
    runs = _eval_runs(cfg, seed=0)
    assert len(runs) == 2 and all(toolbox.agent == "calculator_agent:run" and not wording
                                  for *_, toolbox, wording, _ in runs)


def test_the_exported_shape_asks_as_a_user_asks_the_exported_model(tmp_path, grpo_home):
    """eval/<mode>/exported/...: the training system prompt (the export's default turn), no worked examples, the
    question in one of the foreign instructions (never plain), the run's tools as the rollout renders them; rows
    marked, metrics of their own, the in-prompt numbers unchanged by it."""
    from grpo_core.data import arithmetic
    from grpo_core.evaluation.evaluate import evaluate_policy, exported_format
    from grpo_core.model.policy import load_policy
    from grpo_core.rollout.sampling import prompt_messages
    words = ["Tell me: {question} (answer in <answer></answer> tags)", "{question} Number only, in tags."]
    cfg = GRPOConfig.model_validate(tiny_config(tmp_path, eval=dict(num_samples=2, foreign_instructions=words)))
    tasks = arithmetic.eval_tasks(6, 1, 1, ["+"])
    for t in tasks:
        messages = prompt_messages(t, exported_format(cfg))
        assert [m["role"] for m in messages] == ["system", "user"]            # no worked examples
        assert messages[0]["content"] == cfg.data.system_prompt
        assert messages[1]["content"] in [w.replace("{question}", t.prompt) for w in words]
    policy = load_policy(cfg, None, need_reference=False)
    metrics, rows = evaluate_policy(policy, tasks, cfg, seed=5, progress=False)
    off = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"exported_shape": False})})
    base_metrics, base_rows = evaluate_policy(policy, tasks, off, seed=5, progress=False)
    exported = [r for r in rows if r.get("wording") == "exported"]
    assert len(exported) == 6 * 3 and [r for r in rows if r.get("wording") != "exported"] == base_rows
    assert metrics["eval/exported/num_questions"] == 6.0
    assert {"eval/greedy/exported/strict_pass_at_1", "eval/sampled/exported/format_rate"} <= metrics.keys()
    assert {k: v for k, v in metrics.items() if "exported" not in k} == base_metrics
