"""The promotion gate: `champion` moves only to an adapter that beats it on the frozen gate set by more than
noise (grpo_core/evaluation/gate.py: the statistics; tasks/gate.py: the gate set and the decision in MLflow).

The unit tests check the tests against values computed by hand and the decision on synthetic per-question
scores; the slow test runs three training runs as a schedule would and reads the registry."""
from __future__ import annotations

import json
import math
from pathlib import Path
from statistics import mean

import pytest

from grpo_core.evaluation import gate
from grpo_core.config import ConfigError, GRPOConfig
from grpo_core.data.curation import canonical_question
from grpo_core.evaluation.evaluate import metric_name, summarize
from tests.conftest import tiny_config


# -- the statistics, against values computed by hand ---------------------------------------------------------

@pytest.mark.parametrize("new, champion, want", [
    ([1, 1, 1, 1, 1, 0, 0], [0] * 7, 1 / 32),          # b=5, c=0: P(X >= 5 | n=5) = 1/32
    ([1] * 6 + [0], [0] * 6 + [1], 8 / 128),            # b=6, c=1: (C(7,6) + C(7,7)) / 2^7
    ([1, 0, 1], [1, 0, 1], 1.0),                        # nothing differs: no evidence
    ([0, 0, 0], [1, 1, 1], 1.0),                        # b=0: P(X >= 0) = 1
])
def test_mcnemar_exact_one_sided(new, champion, want):
    assert gate.mcnemar_exact(new, champion) == pytest.approx(want)


def test_mcnemar_refuses_scores_that_are_not_0_or_1():
    with pytest.raises(ValueError, match="gate.test mcnemar needs 0/1 scores"):
        gate.mcnemar_exact([0.5, 1.0], [0.0, 0.0])


@pytest.mark.parametrize("gains, want_p", [
    ([1, 0], 1 / 4),                # centred [1/2, -1/2]: a mean >= 1/2 needs both picks on the first: (1/2)^2
    ([1, 0, 0], 7 / 27),            # centred [2/3, -1/3, -1/3]: >= 1/3 needs 2 or 3 picks of the first: 7/27
    ([1, 1, 1], 0.0),               # no spread: every centred mean is 0 < 1 (the bootstrap's blind spot)
    ([0, 0, 0, 0], 1.0),            # a tie: every centred mean is 0 >= 0
    ([-1, 1], 3 / 4),               # no mean gain: a centred mean >= 0 unless both picks are -1
])
def test_paired_bootstrap_p_value_resamples_the_centred_gains(gains, want_p):
    p, _ = gate.paired_bootstrap(gains, [0] * len(gains), resamples=200_000, seed=1)
    assert p == pytest.approx(want_p, abs=0.005)


def test_paired_bootstrap_interval_low_end():
    """Gains [1, 0]: the resampled mean is 0 (1/4), 0.5 (1/2) or 1 (1/4); its 10% quantile is 0, its 50% 0.5."""
    assert gate.paired_bootstrap([1, 0], [0, 0], confidence=0.9, resamples=50_000)[1] == 0.0
    assert gate.paired_bootstrap([1, 0], [0, 0], confidence=0.5, resamples=50_000)[1] == 0.5
    assert gate.paired_bootstrap([3, 1], [1, 0], confidence=0.5, resamples=50_000)[1] == 1.5     # gains [2, 1]


def test_paired_bootstrap_is_reproducible_by_seed():
    a, b = [0.5, 1, 0, 0.25, 1], [0, 1, 0.5, 0, 0.25]
    assert gate.paired_bootstrap(a, b, seed=3) == gate.paired_bootstrap(a, b, seed=3)


# -- the decision on synthetic per-question scores -----------------------------------------------------------

def _scores(values):
    return {f"q{i}": float(v) for i, v in enumerate(values)}


@pytest.mark.parametrize("test", gate.TESTS)
def test_a_clearly_better_adapter_is_promoted(test):
    d = gate.decide(_scores([1] * 12 + [0] * 8), _scores([0] * 20), test=test)
    assert d.promote and d.reason == "better" and d.questions == 20
    assert (d.new_score, d.champion_score) == (0.6, 0.0) and d.p_value < 0.05


@pytest.mark.parametrize("test", gate.TESTS)
def test_a_tie_is_not_promoted(test):
    """The old rule ("at least as good") moved the champion on a tie; the gate does not."""
    same = _scores([1, 0, 1, 1, 0, 0, 1, 0])
    d = gate.decide(same, dict(same), test=test)
    assert not d.promote and d.p_value == 1.0 and d.reason == "not better"


@pytest.mark.parametrize("test", gate.TESTS)
def test_a_small_gain_within_noise_is_not_promoted(test):
    """Two more right answers out of 20 (b=3, c=1: McNemar p = 5/16) is noise at 95%."""
    new = _scores([1, 1, 1, 0] + [1] * 6 + [0] * 10)
    champion = _scores([0, 0, 0, 1] + [1] * 6 + [0] * 10)
    d = gate.decide(new, champion, test=test)
    assert not d.promote and d.new_score == pytest.approx(0.45) and d.champion_score == pytest.approx(0.35)
    if test == "mcnemar":
        assert d.p_value == pytest.approx(5 / 16)


def test_a_worse_adapter_is_not_promoted_and_confidence_matters():
    worse = gate.decide(_scores([0] * 10), _scores([1] * 10))
    assert not worse.promote and worse.p_value == 1.0
    gain = (_scores([1, 1, 1, 0, 0]), _scores([0, 0, 0, 0, 0]))          # McNemar p = 1/8
    assert not gate.decide(*gain, confidence=0.95, test="mcnemar").promote
    assert gate.decide(*gain, confidence=0.8, test="mcnemar").promote


def test_only_questions_both_answered_are_paired():
    d = gate.decide({"a": 1.0, "b": 1.0, "x": 0.0}, {"a": 0.0, "b": 0.0, "y": 1.0}, test="mcnemar")
    assert d.questions == 2 and d.p_value == 0.25
    with pytest.raises(ValueError, match="no gate question scored in common"):
        gate.decide({"a": 1.0}, {"b": 1.0})


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_score_that_is_not_finite_stops_the_gate(bad):
    """+inf on one question of 40 made its gain NaN and the gate promoted at p = 0: any non-finite score fails."""
    new = {f"q{i}": 1.0 for i in range(40)}
    with pytest.raises(ValueError, match=r"1 gate question\(s\) have a score that is not a finite number"):
        gate.decide({**new, "q7": bad}, {q: 0.0 for q in new})


def test_the_closing_line_has_both_scores_and_the_p_value():
    d = gate.decide(_scores([1, 0, 1, 0]), _scores([1, 0, 1, 0]))
    line = gate.summary_line(d, "eval/greedy/pass_at_1", 0.95, "3")
    assert line.startswith("gate: version 3 NOT promoted") and "new 0.500 vs champion 0.500" in line
    assert "mcnemar p=1.000" in line and "4 gate questions" in line and "low end" not in line
    assert "\n" not in line
    d = gate.decide(_scores([1, 0, 1, 0]), _scores([1, 0, 1, 0]), test="bootstrap")
    assert "bootstrap p=1.000, 95% low end of the gain +0.000" in gate.summary_line(d, "m", 0.95, "3")


# -- per-question scores: their mean is the metric ----------------------------------------------------------

def _row(task_id, mode, correct, formatted=True, fmt_reward=1.0, sample=0):
    return {"mode": mode, "task_id": task_id, "source": "arithmetic", "kind": "math", "sample": sample,
            "completion": "x", "rewards": {"format": fmt_reward, "accuracy": float(bool(correct))},
            "reward_total": fmt_reward + float(bool(correct)), "correct": correct, "formatted": formatted,
            "length": 3, "truncated": False}


ROWS = ([_row("a", "greedy", True), _row("b", "greedy", False, False, 0.0), _row("c", "greedy", True, False, 0.0)]
        + [_row(q, "sampled", c, f, r, s) for q, outcomes in
           {"a": [(True, True, 1.0), (False, True, 1.0), (True, False, 0.0)],
            "b": [(False, False, 0.0), (False, True, 1.0), (None, True, 1.0)],
            "c": [(True, True, 1.0), (True, True, 1.0), (True, True, 1.0)]}.items()
           for s, (c, f, r) in enumerate(outcomes)])


@pytest.mark.parametrize("metric", ["eval/greedy/pass_at_1", "eval/greedy/strict_pass_at_1",
                                    "eval/sampled/pass_at_1", "eval/sampled/pass_at_2",
                                    "eval/sampled/reward/format", "eval/greedy/format_rate",
                                    "eval/arithmetic/sampled/pass_at_1", "eval/greedy/reward/total"])
def test_per_question_scores_average_to_the_metric(metric):
    scores = gate.per_question_scores(ROWS, metric, metric_name)
    assert set(scores) == {"a", "b", "c"}
    assert mean(scores.values()) == pytest.approx(summarize(ROWS, [1, 2])[metric])


def test_per_question_scores_by_hand():
    assert gate.per_question_scores(ROWS, "eval/sampled/pass_at_1") == pytest.approx({"a": 2 / 3, "b": 0.0, "c": 1.0})
    assert gate.per_question_scores(ROWS, "eval/sampled/pass_at_2") == pytest.approx({"a": 1.0, "b": 0.0, "c": 1.0})


def test_a_metric_that_is_not_per_question_names_the_field_and_the_fix():
    with pytest.raises(ValueError, match=r"tracking.best_metric 'eval/num_questions'.*gate.enabled: false"):
        gate.per_question_scores(ROWS, "eval/num_questions")


# -- three runs as a schedule makes them ---------------------------------------------------------------------

def digit_reward(prompts, completions, **_):
    """The share of an answer's first 4 characters that are digits: a skill the tiny random model can learn."""
    return [sum(ch.isdigit() for ch in c[:4]) / 4 for c in completions]


METRIC = "eval/greedy/reward/digit_reward"


def _run(tmp_path, name: str, **overrides) -> dict:
    """One scheduled run's config: the digit reward judged greedily on 16 gate questions, no per-iteration eval
    (the gate evaluates), LoRA on every linear (on a 2-layer random model the head is where it can learn)."""
    import time
    from flows.train import training_run
    config = dict(
        run_name=name, reward_funcs=["tests.test_gate:digit_reward"], num_generations=8, max_completion_length=4,
        loss_type="dapo", beta=0.01, epsilon_high=0.28, use_peft=True,
        lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        steps_per_iteration=4, data={"prompts_per_iteration": 8, "eval_size": 16},
        eval={"enabled": False, "num_samples": 0}, gate={"questions": 16},
        tracking={"best_metric": METRIC, "register_adapter": "final"},
        # the CPU fast paths are not under test: no C++ build in this fresh $GRPO_HOME, no per-process kernel
        # probes (together over a minute on 2 busy cores)
        kernels={"native": False, "decode_linear": "plain", "update_linear": "torch"})
    for key, value in overrides.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) and key in config else value
    t0 = time.perf_counter()
    try:
        return training_run(tiny_config(tmp_path, **config))
    finally:
        print(f"\n{name}: {time.perf_counter() - t0:.1f} s")


@pytest.mark.slow
def test_the_gate_holds_back_a_worse_run_and_promotes_a_better_one(prefect_engine, grpo_home, mlflow_uri, tmp_path,
                                                                    capsys):
    """Run 1 (barely trained) becomes the task's first champion and stores its gate set (questions of its own,
    disjoint from the eval split); run 2 starts from it and is destroyed by a huge learning rate: not promoted (on
    this metric it ties the champion, which scores 0 too: the old "at least as good" rule would have handed it
    `champion`); run 3 starts from the champion and learns the digit reward: the sign-flip permutation test on
    the gate questions says it is better, and it is promoted."""
    from mlflow.tracking import MlflowClient
    from grpo_core.task import read_tasks
    from grpo_core.evaluation.task_identity import registered_model_name
    from tasks import gate as gate_steps
    c = MlflowClient(tracking_uri=mlflow_uri, registry_uri=mlflow_uri)
    first = _run(tmp_path, "day-1", pipeline_iterations=1, learning_rate=1e-6)
    cfg = GRPOConfig.model_validate(tiny_config(tmp_path, gate={"questions": 16}))
    name = registered_model_name(cfg)
    assert name == "grpo-arithmetic-1d-add-sub" and first["registered_model"]["name"] == name
    assert first["registered_model"]["aliases"] == ["run-day-1", "champion"]
    gate_set = gate_steps.current_gate_set(cfg)
    assert gate_set and gate_set["questions"] == "16"
    assert first["registered_model"]["gate_summary"] == ("gate: version 1 is the task's first champion (there was "
                                                         "none to beat)")

    worse = _run(tmp_path, "day-2", pipeline_iterations=1, learning_rate=50.0, init_adapter="previous")
    assert worse["registered_model"]["aliases"] == ["run-day-2"]
    v2 = c.get_model_version(name, worse["registered_model"]["version"])
    assert v2.tags["gate_decision"] == "not promoted" and float(v2.tags["gate_p_value"]) >= 0.05
    assert v2.tags["parent_version"] == "1" and v2.tags["gate_set_hash"] == gate_set["hash"]
    assert v2.tags["gate_test"] == "permutation"                  # a reward metric: continuous scores

    better = _run(tmp_path, "day-3", pipeline_iterations=3, learning_rate=3e-2, init_adapter="previous")
    v3 = c.get_model_version(name, better["registered_model"]["version"])
    assert better["registered_model"]["aliases"] == ["run-day-3", "champion"]
    assert v3.tags["gate_decision"] == "promoted" and float(v3.tags["gate_p_value"]) < 0.05
    assert float(v3.tags["gate_new_score"]) > float(v3.tags["gate_champion_score"])
    assert v3.tags["parent_version"] == "1"                   # from the champion, not from day-2
    assert {"data_hash", "config_hash", "git_commit", "task_signature"} <= v3.tags.keys()
    assert c.get_model_version_by_alias(name, "champion").version == v3.version
    assert better["registered_model"]["gate_summary"].startswith("gate: version 3 promoted to `champion`: new ")
    # every run compared on the same frozen questions, none of which is in its eval split or its training prompts
    for run in (first, worse, better):
        run_dir = Path(run["run_dir"])
        gate_tasks = read_tasks(run_dir / "data" / "gate.jsonl")
        assert (run_dir / "data" / "gate.jsonl").read_bytes() == (Path(first["run_dir"]) / "data" / "gate.jsonl").read_bytes()
        asked = {canonical_question(t.prompt) for t in read_tasks(run_dir / "data" / "eval.jsonl")}
        asked |= {canonical_question(t.prompt) for p in run_dir.glob("iter-*/**/prompts.jsonl") for t in read_tasks(p)}
        assert not asked & {canonical_question(t.prompt) for t in gate_tasks}
    from flows.cli.main import main
    capsys.readouterr()
    assert main(["gate", "show", "--set", "gate.questions=16"]) == 0
    shown = capsys.readouterr().out
    assert f"{name} gate set: 16 questions, hash {gate_set['hash']}" in shown
    held = float(v3.tags["gate_new_score"])                    # what the gate can still see above the champion
    room = math.isfinite(gate.detectable_gain(16, min(max(held, 0.01), 0.99), 0.05, power=0.8))
    assert f"the champion at {held:.0%}: " + ("the gate detects a gain of" if room else "too little room above it") \
        in shown


@pytest.mark.slow
def test_two_tasks_in_one_tracking_store_keep_two_champions(prefect_engine, grpo_home, mlflow_uri, tmp_path):
    """Addition/subtraction and multiplication are two tasks: two registered models, two champions, two gate sets.
    Forced into one registered model by name, the second task is not compared and the first keeps `champion`."""
    from mlflow.tracking import MlflowClient
    c = MlflowClient(tracking_uri=mlflow_uri, registry_uri=mlflow_uri)
    add = _run(tmp_path, "add", pipeline_iterations=1)
    mul = _run(tmp_path, "mul", pipeline_iterations=1, data={"operations": ["*"]})
    assert add["registered_model"]["name"] == "grpo-arithmetic-1d-add-sub"
    assert mul["registered_model"]["name"] == "grpo-arithmetic-1d-mul"
    for run in (add, mul):
        assert run["registered_model"]["aliases"][-1] == "champion"
        champion = c.get_model_version_by_alias(run["registered_model"]["name"], "champion")
        assert champion.run_id == run["mlflow_run_id"]
    shared = {"tracking": {"best_metric": METRIC, "register_adapter": "final", "registered_model_name": "one-name"}}
    _run(tmp_path, "add-2", pipeline_iterations=1, **shared)
    other = _run(tmp_path, "mul-2", pipeline_iterations=1, data={"operations": ["*"]}, **shared)
    assert other["registered_model"]["aliases"] == ["run-mul-2"]
    assert "not compared: one-name holds another task's champion" in other["registered_model"]["gate_summary"]
    assert "differs in its source)" in other["registered_model"]["gate_summary"]
    assert c.get_model_version_by_alias("one-name", "champion").tags["run_name"] == "add-2"


# -- the command line ----------------------------------------------------------------------------------------

def test_force_promote_and_the_gate_commands(tmp_path, mlflow_uri, grpo_home, capsys):
    from flows.cli.main import build_parser, main
    from flows.cli.train import _load
    p = build_parser()
    assert _load(p.parse_args(["train", "--force-promote"])).gate.force_promote
    assert not _load(p.parse_args(["train"])).gate.force_promote
    assert p.parse_args(["schedule", "--interval", "1h", "--config", "x.yaml", "--force-promote"]).force_promote
    assert main(["gate", "show"]) == 0
    assert "grpo-arithmetic-1d-add-sub: no gate set yet" in capsys.readouterr().out
    assert main(["gate", "init", "--set", "gate.questions=24", "--set", f"output_dir={tmp_path / 'runs'}"]) == 0
    out = capsys.readouterr().out
    assert "grpo-arithmetic-1d-add-sub gate set: 24 questions" in out
    assert "champion at 50%: the gate detects a gain of" in out
    assert main(["gate", "init", "--run", "day-1"]) == 2
    assert "grpo gate init --run is gone" in capsys.readouterr().err


def test_the_gate_set_is_its_own_draw_disjoint_from_the_eval_split():
    """For every arithmetic curriculum the configs use, the gate set shares no question with the eval split, and
    training (which excludes both) still has questions to draw."""
    from grpo_core.data import arithmetic
    for digits, ops, n_eval in ((1, ["+", "-"], 40), (3, ["*"], 24), (2, ["+", "-", "*"], 72)):
        held_out = arithmetic.eval_tasks(n_eval, digits, digits, ops)
        gate_set = arithmetic.gate_tasks(40, digits, digits, ops, 20_011, held_out)
        assert len(gate_set) == 40
        assert not {canonical_question(t.prompt) for t in gate_set} & {canonical_question(t.prompt) for t in held_out}
        train = arithmetic.train_tasks(8, digits, digits, ops, seed=3, exclude=held_out + gate_set)
        assert not {canonical_question(t.prompt) for t in train} & {canonical_question(t.prompt) for t in gate_set}
    with pytest.raises(ValueError, match="gate.questions=100 with data.eval_size=40 leaves too few"):
        arithmetic.gate_tasks(100, 1, 1, ["+", "-"], 20_011, arithmetic.eval_tasks(40, 1, 1, ["+", "-"]))


def test_a_gate_set_that_overlaps_the_eval_split_is_refused():
    from grpo_core.data import arithmetic
    from tasks.gate import check_disjoint
    held_out = arithmetic.eval_tasks(8, 1, 1, ["+"])
    with pytest.raises(ConfigError, match=r"shares 8 of its 8 questions with this run's eval split.*grpo gate init"):
        check_disjoint(held_out, held_out, "grpo-x")


# -- fresh questions: a folder read whole at curation time, gate questions kept out ---------------------------

def _folder(tmp_path, files: dict[str, str]):
    folder = tmp_path / "inbox"
    folder.mkdir(exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


def _questions(a: int, b: int) -> str:
    import json
    return "".join(json.dumps({"question": f"What is {i} plus {i + 100}?", "answer": str(2 * i + 100)}) + "\n"
                   for i in range(a, b))


def test_a_folder_source_reads_every_file_it_holds(tmp_path):
    from grpo_core.data.iteration import file_source
    from grpo_core.data.sources import load_source
    folder = _folder(tmp_path, {"a.jsonl": _questions(0, 3), "b.csv": "question,answer\nWhat is 7 times 6?,42\n",
                                ".hidden.jsonl": _questions(50, 60), "notes.txt": "ignored"})
    assert file_source(folder) == {"name": "folder", "path": str(folder)}
    tasks = load_source("folder", path=str(folder))
    assert sorted(t.answer for t in tasks) == ["100", "102", "104", "42"]


def test_an_empty_folder_says_what_to_put_in_it(tmp_path):
    from grpo_core.data.sources import load_source
    with pytest.raises(FileNotFoundError, match="holds no .jsonl, .csv, .parquet or Posts.xml"):
        load_source("folder", path=str(_folder(tmp_path, {"readme.md": "x"})))


def test_curation_counts_new_questions_and_never_trains_on_gate_questions(tmp_path):
    """A second run on the folder after more files arrived: the new questions are counted against the parent
    run's pool (content hashes), and the questions of the gate set are dropped from training."""
    from grpo_core.data import iteration
    from grpo_core.data.sources import load_source
    folder = _folder(tmp_path, {"day1.jsonl": _questions(0, 40)})
    first = iteration.curate_iteration(str(folder), tmp_path / "run1", 1, 4, {}, (0.0, 1.0), False, 0,
                                       tmp_path / "run1" / "iter-1", tmp_path / "cache")
    parent = set((tmp_path / "run1" / "data" / "questions.txt").read_text().split())
    assert len(parent) == first["metrics"]["pool"] and "new_questions" not in first["metrics"]
    _folder(tmp_path, {"day2.jsonl": _questions(40, 60)})                        # 20 more arrive
    gate_set = [t for t in load_source("folder", path=str(folder))][:5]
    second = iteration.curate_iteration(str(folder), tmp_path / "run2", 1, 4, {}, (0.0, 1.0), False, 0,
                                        tmp_path / "run2" / "iter-1", tmp_path / "cache", gate_set, parent)
    pool = set((tmp_path / "run2" / "data" / "questions.txt").read_text().split())
    assert not pool & {t.content_hash() for t in gate_set}
    assert second["metrics"]["new_questions"] == len(pool - parent) > 0
    assert second["metrics"]["gate_excluded"] > 0
    report = json.loads((tmp_path / "run2" / "iter-1" / "curation.json").read_text())
    assert report["new_questions"] == second["metrics"]["new_questions"]


def test_the_config_refuses_a_gate_metric_the_evaluation_does_not_produce():
    with pytest.raises(ValueError, match=r"needs sampled answers.*eval.num_samples > 0"):
        GRPOConfig(tracking={"best_metric": "eval/sampled/pass_at_1"}, eval={"num_samples": 0})
    with pytest.raises(ValueError, match=r"tracking.best_metric 'eval/num_questions' cannot be compared"):
        GRPOConfig(tracking={"best_metric": "eval/num_questions"})
    assert GRPOConfig(tracking={"best_metric": "eval/num_questions"}, gate={"enabled": False}).gate.enabled is False


@pytest.mark.parametrize("metric, evaluation", [
    ("eval/sampled/pass_at_2", {"num_samples": 8}),                 # ks 1, 4, 8
    ("eval/sampled/pass_at_1", {"num_samples": 8, "pass_k": [4, 8]}),
    ("eval/greedy/pass_at_4", {"num_samples": 8}),                  # greedy logs pass@1 only
])
def test_the_config_refuses_a_pass_at_k_the_evaluation_does_not_log(metric, evaluation):
    """Missing from every evaluation, it would leave 'best' the final iteration and the registry without a value."""
    for gate_cfg in ({}, {"enabled": False}):
        with pytest.raises(ValueError, match=r"is not logged.*eval.pass_k"):
            GRPOConfig(tracking={"best_metric": metric}, eval=evaluation, gate=gate_cfg)
    cfg = GRPOConfig(tracking={"best_metric": "eval/sampled/pass_at_4"}, eval={"num_samples": 8})
    assert 4 in cfg.eval.ks


# -- a resumed run: the kept decision, MLflow out of reach, a refusal fixed ----------------------------------

def _update_record(run_dir: Path, iteration: int) -> None:
    from grpo_core.io import write_json
    write_json(run_dir / f"iter-{iteration}" / "update.json", {"checkpoint": f"iter-{iteration}/adapter"})


def test_a_kept_decision_holds_only_while_what_it_was_made_on_holds(tmp_path, mlflow_uri, grpo_home):
    """A run whose registration failed after the gate decided is resumed: the decision in gate/decision.json is
    reused only against the same champion, suspect marks and gate settings. Another run's adapter took
    `champion` meanwhile: compared (here: not comparable) instead of taking `champion` as the task's first; a
    resume's monitors flag the run: refused; `--force-promote` on the resume: forced."""
    from grpo_core.evaluation.monitors import Alert
    from tasks import gate as gate_steps, tracking
    from tasks.registry import CHAMPION, registered_model_name
    from tasks.run_state import flag_suspect
    cfg, run_dir = GRPOConfig(output_dir=str(tmp_path / "runs")), tmp_path / "run"
    _update_record(run_dir, 3)
    first = gate_steps.decision(cfg, run_dir, "r", 3)
    assert (first.promote, first.reason) == (True, "first champion")
    kept = run_dir / "gate" / "decision.json"
    made = kept.read_text()
    assert gate_steps.decision(cfg, run_dir, "r", 3) == first and kept.read_text() == made
    c, name = tracking.client(cfg), registered_model_name(cfg)
    c.create_registered_model(name)
    mv = c.create_model_version(name, str(tmp_path / "other"), tags={"base_model": "someone/else"})
    c.set_registered_model_alias(name, CHAMPION, mv.version)
    again = gate_steps.decision(cfg, run_dir, "r", 3)
    assert not again.promote and again.reason.startswith("not compared: the champion (version 1) is an adapter of")
    flag_suspect(run_dir, 3, [Alert("restated_answers", "30% of held-out answers restate the question")])
    refused = gate_steps.decision(cfg, run_dir, "r", 3)
    assert not refused.promote and refused.reason.startswith("refused: the run is suspect (restated_answers")
    forced = gate_steps.decision(cfg.model_copy(update={"gate": cfg.gate.model_copy(update={"force_promote": True})}),
                                 run_dir, "r", 3)
    assert (forced.promote, forced.reason) == (True, "forced")


@pytest.mark.parametrize("read", ["gate", "rule without the gate", "init_adapter previous"])
def test_mlflow_out_of_reach_is_not_read_as_no_champion(read, tmp_path, monkeypatch, grpo_home):
    """Only "no such model / alias" means the task has no champion yet. A server that does not answer fails the
    step (the run is resumable) instead of handing `champion` on as to the task's first adapter."""
    from mlflow.exceptions import MlflowException
    from tasks import gate as gate_steps, registry, tracking
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    cfg = GRPOConfig(output_dir=str(tmp_path / "runs"), tracking={"tracking_uri": "http://127.0.0.1:9"})
    calls = {"gate": lambda: gate_steps.compare_with_champion(cfg, tmp_path, "r", "iter-1/adapter"),
             "rule without the gate": lambda: registry._beats_champion(
                 tracking.client(cfg), registry.registered_model_name(cfg), METRIC, 0.5),
             "init_adapter previous": lambda: registry.previous_best_adapter(cfg)}
    with pytest.raises(MlflowException) as e:
        calls[read]()
    assert e.value.error_code == "INTERNAL_ERROR"
    assert "once MLflow answers" in "".join(getattr(e.value, "__notes__", []))


def test_a_refusal_does_not_outlive_the_fix_it_names(tmp_path, mlflow_uri, grpo_home):
    """Refused at the start (the registered model holds another task's champion), the run is resumed with its own
    tracking.registered_model_name, as the refusal says to: its gate set is prepared and it is compared."""
    from tasks import gate as gate_steps, tracking
    from tasks.run_state import read_run_state
    shared = {"registered_model_name": "one-name"}
    add = GRPOConfig(output_dir=str(tmp_path / "runs"), tracking=shared)
    c = tracking.client(add)
    add_run, wide_run = (c.create_run(tracking.experiment_id(add)).info.run_id for _ in range(2))
    assert gate_steps.prepare_gate_set(add, tmp_path / "add", add_run).is_file()
    two_digit = GRPOConfig(output_dir=str(tmp_path / "runs"), tracking=shared, data={"max_digits": 2})
    run_dir = tmp_path / "two-digit"
    assert gate_steps.prepare_gate_set(two_digit, run_dir, wide_run) is None
    assert "one-name holds another task's champion" in read_run_state(run_dir)["gate_refusal"]
    _update_record(run_dir, 1)
    assert gate_steps.decision(two_digit, run_dir, wide_run, 1).reason.startswith("not compared: one-name holds")
    own = GRPOConfig(output_dir=str(tmp_path / "runs"), data={"max_digits": 2})
    assert gate_steps.prepare_gate_set(own, run_dir, wide_run).is_file()
    assert read_run_state(run_dir)["gate_refusal"] is None
    assert gate_steps.decision(own, run_dir, wide_run, 1).reason == "first champion"


def test_a_registration_cut_off_after_its_version_was_made_is_finished_not_repeated(tmp_path, mlflow_uri, grpo_home,
                                                                                    monkeypatch):
    """Killed (here: MLflow gone) after the run's version was created and aliased, before the run recorded it: the
    resume does not register a second version of the same adapter, nor judge the adapter against itself (it would
    then read "not better" and split `champion` and run-<name> over two copies)."""
    from tasks import gate as gate_steps, registry, tracking
    from tasks.registry import CHAMPION, registered_model_name
    cfg = GRPOConfig(output_dir=str(tmp_path / "runs"), run_name="r")
    c, name = tracking.client(cfg), registered_model_name(cfg)
    run_id, run_dir = c.create_run(tracking.experiment_id(cfg)).info.run_id, tmp_path / "r"
    _update_record(run_dir, 2)
    real = registry.set_tags

    def gone(*args):
        raise ConnectionError("MLflow went away")
    monkeypatch.setattr(registry, "set_tags", gone)
    with pytest.raises(ConnectionError):
        gate_steps.register_with_gate(cfg, run_dir, run_id, 2, {METRIC: 0.5})
    monkeypatch.setattr(registry, "set_tags", real)
    again = gate_steps.register_with_gate(cfg, run_dir, run_id, 2, {METRIC: 0.5})
    assert [v.version for v in c.search_model_versions(f"name='{name}'")] == [again["version"]]
    assert again["gate"]["reason"] == "first champion" and again["aliases"] == ["run-r", CHAMPION]
    assert c.get_model_version_by_alias(name, CHAMPION).version == again["version"]
