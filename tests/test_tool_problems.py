"""The `tool_problems` source: right answers, clean wordings, and held-out questions training never asks."""
from __future__ import annotations

import contextlib
import io
import re
from collections import Counter
from itertools import combinations
from pathlib import Path

import pytest

from grpo_core.rewards.answers import math_answers_match
from grpo_core.data.build import BuildConfig, build, load_build_config
from grpo_core.data.curation import canonical_question
from grpo_core.data.sources import get_loader, load_source
from grpo_core.data.sources import tool_problems
from grpo_core.data.sources.tool_problems import FAMILIES, KINDS, fill
from grpo_core.rollout.tools import calculate

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "data"
ALL_KINDS = list(KINDS)


def tasks(**options):
    return load_source("tool_problems", **{"kinds": ALL_KINDS, "n": 25, **options})


def run_program(program: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(program, {})   # our own generated program, as a python tool call would run it
    return out.getvalue().strip()


def from_operands(family: str, operands: list[int]) -> int:
    """The answer worked out again from the operands, by a route other than the source's."""
    o = operands
    return {"product": lambda: o[0] * o[1], "multiply": lambda: o[0] * o[1], "divide": lambda: o[0] // o[1],
            "subtract": lambda: o[0] - o[1], "price_sum": lambda: sum(o), "mul_add": lambda: o[0] * o[1] + o[2],
            "mul_add_words": lambda: o[0] * o[1] + o[2], "mul_sub": lambda: o[0] * o[1] - o[2],
            "mul_sub_words": lambda: o[0] * o[1] - o[2], "add_mul": lambda: (o[0] + o[1]) * o[2]}[family]()


def template_pattern(template: str) -> re.Pattern:
    """A filled template as a regex: each field is some text, the first letter either case."""
    parts = re.split(r"\{[a-zA-Z_]+\}", template)
    body = "(.+?)".join(re.escape(p) for p in parts)
    return re.compile(f"(?i:{body[:1]})" + body[1:] + "$" if body[:1].isalpha() else body + "$")


def wording_of(prompt: str, family: str) -> tuple[str, str]:
    """('train' | 'eval', template) of the one template of `family` that worded `prompt`."""
    f = FAMILIES[family]
    found = [("train", t) for t in f.templates if template_pattern(t).fullmatch(prompt)]
    found += [("eval", t) for t in f.eval_templates if template_pattern(t).fullmatch(prompt)]
    assert len(found) == 1, (prompt, found)
    return found[0]


# -- the tasks --------------------------------------------------------------------------------------------


def test_registered_as_a_synthetic_source():
    loader, group = get_loader("tool_problems")
    assert loader is tool_problems.load and group == "synthetic"


def test_the_same_seed_gives_the_same_tasks_and_another_seed_others():
    first, again, other = tasks(seed=3), tasks(seed=3), tasks(seed=4)
    assert [t.to_dict() for t in first] == [t.to_dict() for t in again]
    assert {t.prompt for t in first}.isdisjoint({t.prompt for t in other})


def test_each_kind_and_family_is_present_with_n_each():
    got = tasks(n={"product": 10, "word_problem": 20, "two_step": 15, "python": 10})
    assert Counter(t.meta["kind"] for t in got) == {"product": 10, "word_problem": 20, "two_step": 15, "python": 10}
    assert {t.meta["family"] for t in got} == set(FAMILIES)
    assert all(t.kind == "math" and t.source == f"tool_problems/{t.meta['kind']}" for t in got)
    assert len({t.id for t in got}) == len(got) == len({t.prompt for t in got})
    assert {t.meta["kind"] for t in load_source("tool_problems", n=5)} == {"product", "word_problem", "two_step"}


def test_every_answer_is_right():
    for t in tasks(n=40):
        if t.meta["tool"] == "python":
            assert run_program(t.meta["program"]) == t.answer, t.prompt
            assert t.meta["call"] == {"name": "python", "arguments": {"code": t.meta["program"]}}
        else:
            assert t.meta["call"] == {"name": "calculator", "arguments": {"expression": t.meta["expression"]}}
            assert calculate(t.meta["expression"]) == t.answer, t.meta["expression"]
            assert str(from_operands(t.meta["family"], t.meta["operands"])) == t.answer, t.prompt
            if t.meta["family"] == "divide":
                assert t.meta["operands"][0] % t.meta["operands"][1] == 0, t.prompt
        assert int(t.answer) >= 0


def test_operands_have_the_configured_digits():
    products = load_source("tool_problems", kinds=["product"], n=30, digits=4)
    assert all(len(str(x)) == 4 for t in products for x in t.meta["operands"])
    assert all(len(str(x)) == 3 for t in load_source("tool_problems", kinds=["product"], n=30)
               for x in t.meta["operands"])


def test_no_two_tasks_ask_one_computation_or_share_two_operands():
    made = tasks(n=150)
    steps = [s for t in made for s in t.meta["steps"]]
    pairs = [tuple(sorted(pair)) for t in made for pair in combinations(t.meta["operands"], 2)]
    assert len(steps) == len(set(steps)) and len(pairs) == len(set(pairs))


# -- the wordings -----------------------------------------------------------------------------------------


def test_every_template_fills_cleanly_and_shows_every_operand():
    for problem in tool_problems.draw(ALL_KINDS, n=60):
        f = FAMILIES[problem.family]
        for template in f.templates + f.eval_templates:   # every wording of the family, not only the two picked
            for text in (fill(template, problem.fields), fill(template, problem.fields, thousands_separator=True)):
                assert "{" not in text and "}" not in text, text
                assert text[0].isupper() or text[0].isdigit(), text
                assert text.endswith(("?", ".")) and "  " not in text and " ," not in text and " ." not in text, text
                assert not re.search(r"\ba [aeiou]|\ban [^aeiou\s]", text), text
            shown = fill(template, problem.fields)
            for x in problem.operands:
                assert re.search(rf"(?<!\d){x}(?!\d)", shown), (x, shown)


def test_train_and_eval_wordings_are_disjoint():
    for name, f in FAMILIES.items():
        assert f.templates and f.eval_templates, name
        assert not set(f.templates) & set(f.eval_templates), name
    all_train = {t for f in FAMILIES.values() for t in f.templates}
    assert not all_train & {t for f in FAMILIES.values() for t in f.eval_templates}
    for t in tasks(n=30):
        assert wording_of(t.prompt, t.meta["family"])[0] == "train"
        assert wording_of(t.meta["eval_prompt"], t.meta["family"])[0] == "eval"


def test_the_wordings_of_a_product_are_one_question():
    for t in load_source("tool_problems", kinds=["product"], n=40):
        a, b = sorted(t.meta["operands"])
        assert canonical_question(t.prompt) == canonical_question(t.meta["eval_prompt"]) == f"{a} * {b}"
        for template in FAMILIES["product"].templates + FAMILIES["product"].eval_templates:
            assert canonical_question(fill(template, {"a": b, "b": a})) == f"{a} * {b}", template


def test_thousands_separator_writes_the_stories_numbers_with_commas():
    plain = load_source("tool_problems", kinds=["word_problem", "two_step"], n=20)
    commas = load_source("tool_problems", kinds=["word_problem", "two_step"], n=20, thousands_separator=True)
    assert [t.answer for t in plain] == [t.answer for t in commas]
    assert all(re.search(r"\d,\d{3}", t.prompt) for t in commas if max(t.meta["operands"]) >= 1000)
    assert not any(re.search(r"\d,\d{3}", t.prompt) for t in plain)
    assert [canonical_question(t.prompt) for t in plain] == [canonical_question(t.prompt) for t in commas]


# -- the answer check ----------------------------------------------------------------------------------------


def test_answers_are_judged_right_exactly_and_wrong_as_a_restatement():
    for t in tasks(n=20):
        assert math_answers_match(t.answer, t.answer)
        assert math_answers_match(f"{int(t.answer):,}", t.answer)
        assert not math_answers_match(str(int(t.answer) + 1), t.answer)
        assert not math_answers_match(t.prompt, t.answer)
        restated = t.meta.get("expression") or t.meta["steps"][0]
        assert not math_answers_match(restated, t.answer), restated


def test_bad_options_name_the_fix():
    with pytest.raises(ValueError, match="kinds"):
        load_source("tool_problems", kinds=["division"])
    with pytest.raises(ValueError, match="not in kinds"):
        load_source("tool_problems", kinds=["product"], n={"python": 3})
    with pytest.raises(ValueError, match="raise `digits`"):
        load_source("tool_problems", kinds=["product"], n=200, digits=1)


# -- through the build ----------------------------------------------------------------------------------------


def tool_build(tmp_path: Path, **source) -> BuildConfig:
    return BuildConfig.model_validate({
        "name": "tools", "out_dir": str(tmp_path / "built"), "eval_fraction": 0.3, "validation": {"backend": "none"},
        "sources": [{"name": "tool_problems", "kinds": ALL_KINDS, "n": 60, **source}]})


def test_a_held_out_question_is_asked_in_an_eval_wording_and_its_operands_never_in_training(tmp_path):
    res = build(tool_build(tmp_path), write=False)
    assert not res.rejections
    for split, items in (("train", res.train), ("eval", res.eval)):
        assert {t.meta["kind"] for t in items} == set(KINDS), split
        assert all(wording_of(t.prompt, t.meta["family"])[0] == split for t in items)
        assert not any("eval_prompt" in t.meta for t in items)
    steps = lambda items: {s for t in items for s in t.meta["steps"]}
    operand_pairs = lambda items: {tuple(sorted(pair)) for t in items for pair in combinations(t.meta["operands"], 2)}
    assert not steps(res.train) & steps(res.eval)
    assert not operand_pairs(res.train) & operand_pairs(res.eval)
    assert not {canonical_question(t.prompt) for t in res.train} & {canonical_question(t.prompt) for t in res.eval}


def test_a_product_another_source_asks_in_other_words_is_one_task(tmp_path):
    cfg = tool_build(tmp_path, kinds=["product"], n=30)
    mine = load_source("tool_problems", kinds=["product"], n=30)
    a, b = mine[0].meta["operands"]
    cfg.sources.append({"name": "jsonl", "path": str(_jsonl(tmp_path, f"Compute {b} * {a}.", str(a * b)))})
    res = build(cfg, write=False)
    assert [r.reason for r in res.rejections] == ["duplicate_exact"]


def _jsonl(tmp_path: Path, question: str, answer: str) -> Path:
    path = tmp_path / "one.jsonl"
    path.write_text(f'{{"question": "{question}", "answer": "{answer}"}}\n')
    return path


@pytest.mark.parametrize("name, kinds", [("tools.yaml", {"product", "word_problem", "two_step"}),
                                         ("tools_python.yaml", {"python"})])
def test_the_shipped_configs_ask_for_their_kinds(name, kinds):
    cfg = load_build_config(CONFIGS / name)
    asked = {k for s in cfg.sources if s["name"] == "tool_problems" for k in s["kinds"]}
    assert asked == kinds and 0.1 <= cfg.eval_fraction <= 0.2


def test_the_python_tool_configs_worked_exchanges_print_what_they_show_and_ask_no_question_of_the_data():
    """configs/tools_python.yaml's examples: each call's program, run, prints the tool response shown after it and
    the answer copies it; no example question is one the data can ask (their numbers lie outside its space)."""
    from grpo_core.config import load_config
    from grpo_core.rollout.tools import parse_tool_calls
    shots = load_config(CONFIGS.parent / "tools_python.yaml", []).data.few_shot
    calls = [(q, a, shots[i + 1]) for i, (q, a) in enumerate(shots) if "<tool_call>" in a]
    assert len(calls) == len(tool_problems.families_of("python"))           # one exchange per kind of question
    data = {t.prompt for t in tasks(kinds=["python"], n=300)}
    for question, call, (response, answer) in calls:
        (parsed,) = parse_tool_calls(call)
        assert parsed.error is None and parsed.name == "python", parsed
        printed = run_program(parsed.arguments["code"])
        assert response == f"<tool_response>\n{printed}\n</tool_response>" and answer == f"<answer>{printed}</answer>"
        assert question not in data
