"""Issue 12 data: content keys that ignore wording, eval asked in unseen wordings, the user's own file as
`data.curated` (validated, deduplicated, split and cached on the fly), and the response-prefix warm-up."""
from __future__ import annotations

import argparse
import csv
from pathlib import Path

import pytest

from grpo_core.config import GRPOConfig
from grpo_core.data import arithmetic, curation
from grpo_core.data import iteration as data_iteration
from grpo_core.data.build import BuildConfig, build
from grpo_core.data.curation import canonical_question
from grpo_core.task import Task, read_tasks, write_tasks


def keys(tasks) -> set[str]:
    return {canonical_question(t.prompt) for t in tasks}


# -- one question, many wordings ----------------------------------------------------------------------------


@pytest.mark.parametrize("a, b", [
    ("What is 3 + 5?", "Compute 5 + 3."),
    ("Calculate 3 + 5.", "State the final answer to the following arithmetic problem: 5 + 3 ="),
    ("What is 7 * 4?", "Find the value of 4 × 7."),
    ("What is 3 plus 5?", "Evaluate 3 + 5."),
    ("What is 1,000 - 2.50?", "Work out 1000 - 2.5."),
    ("What is 5 \u2212 3?", "Compute 5 - 3."),                # the minus sign, not the hyphen
    ("What is 6 \u00f7 3?", "Compute 6 / 3."),
    ("Compute $5 \\times 3$.", "What is 3 * 5?"),             # LaTeX
    ("Evaluate $6 \\div 3$", "What is 6 / 3?"),
    ("What is 3 + 5?\u200b", "What is 3 + 5?"),               # an invisible character
    ("What is 007 + 1?", "What is 1 + 7?"),                   # leading zeros
    ("What is 1 + .5?", "What is 0.5 + 1?"),                  # a bare decimal point
])
def test_wordings_of_one_arithmetic_question_share_a_key(a, b):
    assert canonical_question(a) == canonical_question(b)


@pytest.mark.parametrize("a, b", [
    ("What is 5 - 3?", "What is 3 - 5?"),                   # subtraction does not commute
    ("What is 2 + 3 * 4?", "What is 3 + 2 * 4?"),           # the '+' is not alone
    ("What is 5 - 3?", "What is 5 - 3 modulo 2?"),          # a word that changes the question is kept
    ("Tom has 3 + 5 apples. How many?", "Tom has 5 + 3 pears. How many?"),
    ("What is 3 div 4?", "What is 3 / 4?"),                   # 'div' in words may be integer division
    ("Simplify $\\frac{4}{8}$", "Simplify 4/8"),
    ("What is 1 + .5?", "What is 1 + 5?"),                    # '.5' is not 5
    ("let a = (x, y).1;", "let a = (x, y)0.1;"),              # a tuple's field stays a field
])
def test_different_questions_keep_different_keys(a, b):
    assert canonical_question(a) != canonical_question(b)


def test_an_eval_question_written_with_other_symbols_is_not_trained_on():
    """'5 − 3' (U+2212) held out once let '5 - 3' train: decontamination compares content keys."""
    ev = [Task(id="e", kind="math", source="mine", prompt="What is 15 \u2212 3?", answer="12")]
    train = [Task(id="t", kind="math", source="mine", prompt="What is 15 - 3?", answer="12")]
    kept, rejected = curation.decontaminate(train, ev)
    assert kept == [] and [r.reason for r in rejected] == ["contaminated"]


def test_templates_must_be_pure_wording():
    for t in arithmetic.TEMPLATES + arithmetic.EVAL_TEMPLATES:
        assert arithmetic.check_template(t) == t
    with pytest.raises(ValueError, match="TEMPLATE_WORDS"):
        arithmetic.check_template("How many apples is {a} {op} {b}?")
    with pytest.raises(ValueError, match="fields"):
        arithmetic.check_template("What is {x}?")


def arithmetic_build(tmp_path: Path, **source) -> BuildConfig:
    return BuildConfig.model_validate({
        "name": "words", "out_dir": str(tmp_path / "built"), "eval_fraction": 0.25, "validation": {"backend": "none"},
        "sources": [{"name": "arithmetic", "n": 150, "max_digits": 1, "operations": ["+", "-"],
                     "templates": list(arithmetic.TEMPLATES), "eval_templates": list(arithmetic.EVAL_TEMPLATES),
                     **source}]})


def test_eval_is_asked_in_wordings_training_never_uses_and_splits_by_content(tmp_path):
    res = build(arithmetic_build(tmp_path), write=False)
    train_words = {t.prompt.split(" ")[0] for t in res.train}
    eval_words = {" ".join(t.prompt.split(" ")[:-3]) for t in res.eval}
    assert train_words == {"What", "Compute", "Calculate"}
    assert eval_words == {"Work out", "Find the value of", "Evaluate"}
    assert len(res.eval) > 10 and not keys(res.train) & keys(res.eval)
    assert not any("eval_prompt" in t.meta for t in res.train + res.eval)
    # the same numbers never appear on both sides, not even commuted: a + b in eval keeps b + a out of training
    ops = lambda tasks: {(min(t.meta["a"], t.meta["b"]), max(t.meta["a"], t.meta["b"])) if t.meta["op"] == "+"
                         else (t.meta["a"], t.meta["b"], "-") for t in tasks}
    assert not ops(res.train) & ops(res.eval)


def test_eval_templates_must_differ_from_training_templates(tmp_path):
    with pytest.raises(ValueError, match="eval_templates"):
        build(arithmetic_build(tmp_path, eval_templates=[arithmetic.TEMPLATES[0]]), write=False)


def test_the_same_question_from_two_sources_is_one_task(tmp_path):
    pytest.importorskip("reasoning_gym")
    cfg = arithmetic_build(tmp_path)
    cfg.sources.append({"name": "reasoning_gym", "datasets": {"chain_sum": {"size": 60, "config": {
        "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}}})
    res = build(cfg, write=False)
    assert any(r.reason == "duplicate_exact" and r.source.startswith("reasoning_gym") for r in res.rejections)
    assert not keys(res.train) & keys(res.eval)


# -- the user's own file ------------------------------------------------------------------------------------


def write_user_csv(path: Path) -> Path:
    """Every 1-digit sum in both orders (so commuted twins), plus rows that cannot be used."""
    rows = [{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(10) for b in range(10)]
    rows += [{"question": "Write a poem about the sea.", "answer": ""},          # nothing to check
             {"question": "", "answer": "3"}]                                      # no prompt
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["question", "answer"])
        w.writeheader()
        w.writerows(rows)
    return path


@pytest.fixture()
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("GRPO_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_user_csv_is_curated_on_the_fly_with_reasons_and_cached(tmp_path, home, capsys, monkeypatch):
    pytest.importorskip("prefect")
    from tasks.curate import curate
    data = write_user_csv(tmp_path / "mine.csv")
    cfg = GRPOConfig.model_validate({"data": {"curated": str(data), "prompts_per_iteration": 6, "eval_size": 50}})
    rec = curate.fn(cfg.model_dump(mode="json"), str(tmp_path / "run1"), 1)
    out = capsys.readouterr().out
    assert rec["rejections"] == {"duplicate_exact": 45, "invalid_schema": 1, "not_verifiable": 1}
    assert "not_verifiable" in out and "duplicate_exact" in out and "rejections.jsonl" in out
    assert Path(rec["dataset"]).is_relative_to(home / "data" / "curated")
    ev, prompts = read_tasks(rec["eval"]), read_tasks(rec["prompts"])
    assert len(prompts) == 6 and 0 < len(ev) < 55 and not keys(prompts) & keys(ev)
    train, _ = data_iteration.splits_of(Path(rec["dataset"]))
    assert len(train) + len(ev) == 55 and not keys(train) & keys(ev)      # 55 sums by content
    # a second run with the same bytes reuses the cached dataset: nothing is built again
    monkeypatch.setattr(data_iteration, "build", lambda *a, **k: pytest.fail("rebuilt a cached file"))
    rec2 = curate.fn(cfg.model_dump(mode="json"), str(tmp_path / "run2"), 1)
    assert rec2["dataset"] == rec["dataset"]


def test_task_schema_and_hf_disk_files_go_through_the_same_pipeline(tmp_path, home):
    tasks = [Task(id=f"q{i}", kind="math", source=f"src{i % 2}", prompt=f"Compute {i} * 7.", answer=str(7 * i))
             for i in range(40)]
    path = data_iteration.resolve_curated(str(write_tasks(tmp_path / "tasks.jsonl", tasks)), tmp_path / "run",
                                          home / "cache")
    train, ev = data_iteration.splits_of(path)
    assert {t.source for t in train + ev} == {"src0", "src1"} and len(train) + len(ev) == 40
    datasets = pytest.importorskip("datasets")
    d = tmp_path / "hf"
    datasets.Dataset.from_list([{"problem": t.prompt, "final_answer": t.answer} for t in tasks]).save_to_disk(str(d))
    train, ev = data_iteration.splits_of(data_iteration.resolve_curated(str(d), tmp_path / "run-hf", home / "cache"))
    assert len(train) + len(ev) == 40


def test_a_file_without_usable_rows_fails_with_its_reasons(tmp_path):
    (tmp_path / "bad.csv").write_text("question,answer\nWrite a poem.,\n")
    with pytest.raises(ValueError, match="no usable rows(.|\n)*not_verifiable"):
        data_iteration.resolve_curated(str(tmp_path / "bad.csv"), tmp_path / "run", tmp_path / "cache")


def test_unknown_file_types_are_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match=".jsonl, .csv or .parquet"):
        data_iteration.resolve_curated(str(tmp_path / "notes.txt"), tmp_path / "run")
    with pytest.raises(FileNotFoundError):
        data_iteration.resolve_curated(str(tmp_path / "missing.csv"), tmp_path / "run")


def test_train_data_option_is_data_curated(tmp_path):
    from flows.cli.train import _load, register
    p = argparse.ArgumentParser()
    register(p.add_subparsers(dest="command"))
    args = p.parse_args(["train", "--data", str(tmp_path / "q.csv"), "--set", "eval.every=2"])
    cfg = _load(args)
    assert cfg.data.curated == str(tmp_path / "q.csv") and cfg.eval.every == 2


# -- the prompt format ---------------------------------------------------------------------------------------


def test_default_format_has_no_prefix_and_shows_tags_in_two_examples():
    d = GRPOConfig().data
    assert d.response_prefix == "" and d.prompt_format.response_prefix == ""
    assert len(d.few_shot) == 2 and all(a.startswith("<answer>") for _, a in d.few_shot)
    assert any("-" in q for q, _ in d.few_shot) and "<answer>" in d.system_prompt


def test_prefix_warm_up_anneals_away_and_evaluation_never_sees_it():
    d = GRPOConfig.model_validate({"data": {"response_prefix": "<answer>", "response_prefix_iterations": 3}}).data
    assert [d.prompt_format_at(k).response_prefix for k in (1, 2, 3, 4, 20)] == ["<answer>"] * 3 + [""] * 2
    assert d.prompt_format.response_prefix == ""                 # evaluation: the final format
    always = GRPOConfig.model_validate({"data": {"response_prefix": "<answer>"}}).data
    assert always.prompt_format_at(50).response_prefix == always.prompt_format.response_prefix == "<answer>"
    with pytest.raises(Exception, match="response_prefix_iterations"):
        GRPOConfig.model_validate({"data": {"response_prefix_iterations": 2}})
