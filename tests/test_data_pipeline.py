"""Curation steps: every rejection reason, dedupe, decontamination, deterministic split and hash,
calibration band (fake policy and a tiny torch model), recalibration from rollouts, mix, dataset files."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from grpo_core.data import curation, formats
from grpo_core.data import validate as V
from grpo_core.data.build import (BuildConfig, build, dataset_metadata, read_dataset, stats, load_build_config)
from grpo_core.data.records import REASONS, Rejection
from grpo_core.task import Task
from grpo_core.io import write_jsonl


def math_task(i: int, prompt: str | None = None, answer: str = "4", source: str = "s", **meta) -> Task:
    return Task(id=f"m{i}", kind="math", source=source, prompt=prompt or f"What is {i} plus {i}?", answer=answer,
                meta=meta)


def py_task(i: int, body: str = "return x + 1", cases=None) -> Task:
    cases = [{"args": [1], "expected": 2}] if cases is None else cases
    return Task(id=f"p{i}", kind="python", source="code", prompt=f"Write inc number {i}", entry_point="inc",
                tests=formats.python_io(cases) if cases else {"format": "io", "cases": []},
                reference_solution=f"def inc(x):\n    {body}\n")


# -- validation reasons ----------------------------------------------------------------------------------


def test_validation_rejection_reasons():
    good_math, bad_math = math_task(1, answer="12"), math_task(2, answer="twelve-ish ??")
    good_py, failing = py_task(1), py_task(2, body="return x")
    empty = py_task(3, cases=[])
    no_ref = py_task(4)
    no_ref.reference_solution = None
    bad_schema = Task(id="x", kind="poetry", source="s", prompt="Write a poem")
    kept, rejected = V.validate([good_math, bad_math, good_py, failing, empty, no_ref, bad_schema], backend="local")
    assert [t.id for t in kept] == ["m1", "p1"]
    assert {r.id: r.reason for r in rejected} == {
        "m2": "answer_unparseable", "p2": "reference_failed", "p3": "empty_tests", "p4": "reference_missing",
        "x": "invalid_schema"}
    assert "kind" in next(r for r in rejected if r.id == "x").detail


def test_math_answers_that_parse():
    assert all(V.math_answer_parses(a) for a in ["42", "-3.5", "1,000", "3/4", "\\frac{1}{2}", "2\\sqrt{2}"])
    assert not V.math_answer_parses("the blue one")


def test_sandbox_backend_required_but_absent(monkeypatch):
    monkeypatch.setattr(V, "_sandbox_checker", lambda workers: None)
    kept, rejected = V.validate([py_task(1), math_task(1)], backend="sandbox")
    assert [t.id for t in kept] == ["m1"] and [r.reason for r in rejected] == ["sandbox_unavailable"]
    with pytest.raises(ValueError, match="one of"):
        V.validate([py_task(1)], backend="docker-please")


def test_sandbox_malformed_tests_are_unsupported_not_infra(monkeypatch):
    verdict = {"p1": (False, "malformed task: tests['check'] raised NameError", None, True),
               "p2": (False, "engine down", None, True)}
    monkeypatch.setattr(V, "_sandbox_checker", lambda workers: (lambda tasks: [verdict[t.id] for t in tasks]))
    kept, rejected = V.validate([py_task(1), py_task(2)], backend="sandbox")
    assert [r.reason for r in rejected] == ["tests_unsupported", "sandbox_unavailable"]   # after one retry


def test_reasoning_gym_checker_rejecting_gold(monkeypatch):
    pytest.importorskip("reasoning_gym")
    from grpo_core.data.sources import rgym
    monkeypatch.setattr(rgym, "reasoning_gym_dataset", lambda *a: _Broken())
    records = list(rgym.load(datasets={"chain_sum": {"size": 2}}))
    assert [r.reason for r in records] == ["checker_rejects_gold"] * 2


class _Broken:
    def __getitem__(self, i):
        return {"question": "q", "answer": "1", "metadata": {}}

    def score_answer(self, answer, entry):
        return 0.0


def test_every_reason_has_a_description_and_unknown_reasons_fail():
    assert all(REASONS.values())
    with pytest.raises(ValueError, match="REASONS"):
        Rejection("a", "s", "because")


# -- dedupe / decontaminate / split -------------------------------------------------------------------------
LONG = ("A farmer has {n} cows and buys {m} more at the market on Tuesday; each cow gives twelve litres of milk "
        "every single morning, and the farmer sells all of it at the village shop. How many litres a day?")


def test_dedupe_exact_and_near():
    a = math_task(1, LONG.format(n=3, m=4), "84")
    same = math_task(2, LONG.format(n=3, m=4), "84")
    same_prompt_other_case = math_task(3, LONG.format(n=3, m=4).upper(), "84")
    near = math_task(4, LONG.format(n=3, m=4).replace("Tuesday", "Friday"), "84")
    different = math_task(5, "Compute the area of a circle of radius 2, rounded down.", "12")
    kept, rejected = curation.dedupe([a, same, same_prompt_other_case, near, different], near_threshold=0.7)
    assert [t.id for t in kept] == ["m1", "m5"]
    assert [(r.id, r.reason) for r in rejected] == [("m2", "duplicate_exact"), ("m3", "duplicate_exact"),
                                                    ("m4", "duplicate_near")]
    kept, _ = curation.dedupe([a, near], near_threshold=1.0)   # near-dup detection off
    assert len(kept) == 2


def test_decontamination_ngram_overlap_ignores_boilerplate():
    instr = "Reply with the complete function in one python code block please and thank you"
    topics = ["sorting a list of names", "parsing a date string", "merging two dictionaries", "counting words"]
    ev = [Task(id="e0", kind="math", source="s", answer="1", prompt=LONG.format(n=1, m=2))]
    ev += [Task(id=f"e{i + 1}", kind="math", source="s", answer="1", prompt=f"{instr}. Explain {t} step by step now.")
           for i, t in enumerate(topics)]
    train_overlap = Task(id="t1", kind="math", source="s", answer="1", prompt=LONG.format(n=9, m=9))
    train_clean = Task(id="t2", kind="math", source="s", answer="1",
                       prompt=f"{instr}. How many prime numbers are smaller than fifty in total?")
    kept, rejected = curation.decontaminate([train_overlap, train_clean], ev, n=8, threshold=0.5, boilerplate_df=5)
    assert [t.id for t in kept] == ["t2"] and [(r.id, r.reason) for r in rejected] == [("t1", "contaminated")]
    # counting the shared instruction as content, the clean prompt would look contaminated
    kept, rejected = curation.decontaminate([train_clean], ev, n=8, threshold=0.4, boilerplate_df=100)
    assert [r.id for r in rejected] == ["t2"]


def test_split_is_a_pure_function_of_content():
    tasks = [math_task(i, answer=str(2 * i)) for i in range(400)]
    train, ev = curation.split(tasks, 0.2)
    assert 40 < len(ev) < 120
    shuffled = tasks[:]
    random.Random(1).shuffle(shuffled)
    train2, ev2 = curation.split(shuffled, 0.2)
    assert {t.id for t in ev2} == {t.id for t in ev}
    renamed = [Task(**{**t.to_dict(), "id": "other-" + t.id, "provenance": "elsewhere"}) for t in tasks]
    assert {t.id[6:] for t in curation.split(renamed, 0.2)[1]} == {t.id for t in ev}


# -- calibration ------------------------------------------------------------------------------------------


def test_calibration_band_with_a_deterministic_fake_policy():
    tasks = [math_task(i) for i in range(10)]
    rate = {f"m{i}": i / 9 for i in range(10)}          # task i is solved with probability i/9

    def policy(batch, k):
        return [[1.0 if j < round(rate[t.id] * k) else 0.0 for j in range(k)] for t in batch]
    kept, rejected = curation.calibrate(tasks, policy, k=9, band=(0.1, 0.9), batch_size=4)
    assert [t.id for t in kept] == [f"m{i}" for i in range(1, 9)]
    assert {r.id for r in rejected} == {"m0", "m9"} and all(r.reason == "out_of_band" for r in rejected)
    assert kept[0].meta["pass_rate"] == pytest.approx(1 / 9, abs=1e-3) and kept[0].difficulty == pytest.approx(8 / 9, abs=1e-3)
    assert "too hard" in next(r for r in rejected if r.id == "m0").detail


def test_calibration_band_with_a_tiny_torch_model():
    torch = pytest.importorskip("torch")

    class TinyPolicy(torch.nn.Module):
        """A per-task logit of answering correctly; sampling is seeded, so the test is deterministic."""
        def __init__(self, n):
            super().__init__()
            self.logit = torch.nn.Embedding(n, 1)
            with torch.no_grad():
                self.logit.weight[:, 0] = torch.tensor([-6.0, -4.0, -1.0, 0.0, 1.0, 4.0, 6.0])

        def forward(self, idx, k, gen):
            p = torch.sigmoid(self.logit(idx))            # (B, 1)
            return torch.bernoulli(p.expand(-1, k), generator=gen)

    tasks = [math_task(i) for i in range(7)]
    model, gen = TinyPolicy(len(tasks)), torch.Generator().manual_seed(0)

    def policy(batch, k):
        idx = torch.tensor([int(t.id[1:]) for t in batch])
        with torch.no_grad():
            return model(idx, k, gen).tolist()
    kept, rejected = curation.calibrate(tasks, policy, k=64, band=(0.1, 0.9))
    assert {t.id for t in kept} == {"m2", "m3", "m4"}     # sigmoid(+-1) = 0.73 / 0.27 in, sigmoid(+-4) out
    assert all(0.1 <= t.meta["pass_rate"] <= 0.9 for t in kept)
    hist = curation.pass_rate_histogram(tasks)
    assert sum(hist.values()) == 7 and hist["0.0-0.1"] == 2 and hist["0.9-1.0"] == 2


def test_recalibrate_from_previous_rollouts(tmp_path):
    tasks = [math_task(i) for i in range(4)]
    rows = ([{"task_id": "m0", "correct": 1.0}] * 4 + [{"task_id": "m1", "correct": 0.0}] * 4 +
            [{"task_id": "m2", "correct": c} for c in (1.0, 0.0, None, 1.0)] + [{"task_id": "m3", "correct": 1.0}])
    write_jsonl(tmp_path / "scores.jsonl", rows)
    rates = curation.pass_rates_from_rollouts(tmp_path / "scores.jsonl")
    assert rates == {"m0": (1.0, 4), "m1": (0.0, 4), "m2": (pytest.approx(2 / 3), 3), "m3": (1.0, 1)}
    kept, rejected = curation.recalibrate(tasks, tmp_path / "scores.jsonl", band=(0.1, 0.9), min_samples=2)
    assert [t.id for t in kept] == ["m2", "m3"]        # m3 has too few samples: kept, unmeasured
    assert sorted(r.id for r in rejected) == ["m0", "m1"] and kept[0].meta["pass_rate_from"] == "rollouts"
    with pytest.raises(ValueError, match="id_field"):
        curation.pass_rates_from_rollouts(tmp_path / "scores.jsonl", id_field="prompt_id")


def test_calibration_edge_cases_are_errors_not_silently_empty_sets():
    """k=1 gives pass rates 0 and 1 only: with the band [0.1, 0.9] every task was dropped as out_of_band; a policy
    answering nothing for a task made it 'too hard over 0 samples'."""
    tasks = [math_task(i) for i in range(3)]
    with pytest.raises(ValueError, match=r"calibration.k=1 gives pass rates \[0.0, 1.0\], none inside band"):
        curation.calibrate(tasks, lambda batch, k: [[1.0] * k for _ in batch], k=1)
    with pytest.raises(ValueError, match="policy returned no rewards for task 'm0'"):
        curation.calibrate(tasks, lambda batch, k: [[] for _ in batch], k=4)
    kept, _ = curation.calibrate(tasks, lambda batch, k: [[1.0] for _ in batch], k=1, band=(0.0, 1.0))
    assert len(kept) == 3 and kept[0].meta["pass_rate"] == 1.0         # a band that holds 0 or 1 takes k=1
    with pytest.raises(ValueError, match="calibration.k=1"):
        BuildConfig.model_validate({"calibration": {"k": 1, "model": "tiny-random"}})
    BuildConfig.model_validate({"calibration": {"k": 1}})               # k unused without a model


def test_recalibration_rows_with_a_nan_score_are_unscored_and_a_text_score_names_its_line(tmp_path):
    p = tmp_path / "scores.jsonl"
    p.write_text('{"task_id": "m0", "correct": 1.0}\n{"task_id": "m0", "correct": NaN}\n{"task_id": "m0", "correct": 0}\n')
    assert curation.pass_rates_from_rollouts(p) == {"m0": (0.5, 2)}   # NaN was counted as a failure
    p.write_text('{"task_id": "m0", "correct": 1.0}\n{"task_id": "m0", "correct": "yes"}\n')
    with pytest.raises(ValueError, match=r"scores.jsonl:2: 'correct' is 'yes', not a number"):
        curation.pass_rates_from_rollouts(p)


def test_old_pass_rates_expire_so_a_long_run_tries_its_too_hard_prompts_again(tmp_path):
    from grpo_core.data.iteration import draw_prompts, previous_pass_rates
    pool = [math_task(i) for i in range(4)]
    # m0-m2 all wrong at iteration 1 (too hard for the policy then); m3 half right at iteration 5
    write_jsonl(tmp_path / "iter-1" / "scores.jsonl", [{"task_id": f"m{i}", "correct": 0.0} for i in range(3)] * 4)
    write_jsonl(tmp_path / "iter-5" / "scores.jsonl", [{"task_id": "m3", "correct": c} for c in (1.0, 0.0) * 2])
    forever = previous_pass_rates(tmp_path, 6)
    assert set(forever) == {"m0", "m1", "m2", "m3"} and forever["m0"] == (0.0, 4)
    recent = previous_pass_rates(tmp_path, 6, max_age=3)      # iterations 3-5 only
    assert recent == {"m3": (0.5, 4)}
    assert set(previous_pass_rates(tmp_path, 5, max_age=4)) == {"m0", "m1", "m2"}     # iterations 1-4
    for rates, drawable in ((forever, {"m3"}), (recent, {"m0", "m1", "m2", "m3"})):
        chosen, info = draw_prompts(pool, 4, {}, seed=0, band=(0.1, 0.9), rates=rates)
        assert info["in_band"] == len(drawable) and {t.id for t in chosen[:len(drawable)]} == drawable


# -- mix --------------------------------------------------------------------------------------------------


def test_mix_weights_per_group_and_source():
    syn = [math_task(i, source="gen", group="synthetic") for i in range(100)]
    com = [math_task(100 + i, source="he", group="community") for i in range(20)]
    picked, rest = curation.mix(syn + com, {"synthetic": 0.7, "community": 0.3}, 50, seed=1)
    groups = [t.meta["group"] for t in picked]
    assert len(picked) == 50 and groups.count("synthetic") == 35 and groups.count("community") == 15
    assert len(rest) == 70 and all(r.reason == "not_selected" for r in rest)
    again, _ = curation.mix(list(reversed(syn + com)), {"synthetic": 0.7, "community": 0.3}, 50, seed=1)
    assert [t.id for t in again] == [t.id for t in picked]
    # a short pool hands its quota to the others
    picked, _ = curation.mix(syn + com[:5], {"synthetic": 0.5, "community": 0.5}, 40, seed=1)
    assert [t.meta["group"] for t in picked].count("community") == 5 and len(picked) == 40
    picked, _ = curation.mix(syn + com, {"he": 1.0}, None)
    assert len(picked) == 20
    with pytest.raises(ValueError, match="weights"):
        curation.mix(syn, {"synthetic": -1}, 5)


# -- whole build, files, hash ---------------------------------------------------------------------------


def small_config(tmp_path: Path, **kw) -> BuildConfig:
    data = tmp_path / "user.jsonl"
    write_jsonl(data, [{"question": f"What is {i} times 3?", "answer": str(3 * i)} for i in range(30)]
                + [{"question": "Describe your feelings."}])
    return BuildConfig.model_validate({
        "name": "t", "out_dir": str(tmp_path / "out"), "eval_fraction": 0.2,
        "sources": [{"name": "arithmetic", "n": 40, "max_digits": 2}, {"name": "gen_python", "n": 10},
                    {"name": "jsonl", "path": str(data)}],
        "weights": {"synthetic": 0.8, "user": 0.2}, "validation": {"backend": "local"}, **kw})


def test_build_writes_versioned_dataset_and_report(tmp_path):
    res = build(small_config(tmp_path))
    rep = json.loads((res.path / "report.json").read_text())
    assert res.path.name == f"t-{rep['dataset_hash'][:12]}"
    assert dataset_metadata(res.path)["grpo.dataset_hash"] == rep["dataset_hash"]
    assert rep["sources"]["jsonl"]["rejected"] == {"not_verifiable": 1}
    assert rep["sources"]["gen_python"]["valid"] == 10 and rep["totals"]["train"] == len(res.train)
    assert set(rep["rejections"]) <= set(REASONS) and "pass_rate_histogram" in rep
    back = read_dataset(res.path)
    assert [t.to_dict() for t in back] == [t.to_dict() for t in res.train]
    assert {t.id for t in read_dataset(res.path, "eval")} == {t.id for t in res.eval}
    assert not {t.id for t in res.train} & {t.id for t in res.eval}
    rejections = [json.loads(l) for l in (res.path / "rejections.jsonl").read_text().splitlines()]
    assert any(r["reason"] == "not_verifiable" and r["detail"] for r in rejections)
    st = stats(res.path)
    assert st["train"]["tasks"] == len(res.train) and st["metadata"]["grpo.name"] == "t"


def test_build_is_deterministic(tmp_path):
    a = build(small_config(tmp_path), write=False)
    b = build(small_config(tmp_path), write=False)
    assert a.report["dataset_hash"] == b.report["dataset_hash"]
    assert [t.id for t in a.train] == [t.id for t in b.train]
    c = build(small_config(tmp_path, seed=7), write=False)     # the seed changes generated tasks only
    user = lambda res: {t.id for t in res.eval if t.source == "jsonl"}
    assert user(c) == user(a) and user(a)                          # the split does not depend on the seed


def test_build_with_policy_and_rollouts(tmp_path):
    cfg = small_config(tmp_path, weights={})
    first = build(cfg, write=False)
    ids = [t.id for t in first.train]
    write_jsonl(tmp_path / "scores.jsonl", [{"task_id": ids[0], "correct": 1.0}] * 4)
    cfg2 = small_config(tmp_path, weights={}, calibration={"band": [0.1, 0.9], "rollouts": str(tmp_path / "scores.jsonl")})
    res = build(cfg2, policy=lambda batch, k: [[0.0, 1.0] * (k // 2) for _ in batch], write=False)
    assert ids[0] not in {t.id for t in res.train}
    assert res.report["rejections"]["out_of_band"] == 1
    assert res.report["pass_rate_histogram"]["0.5-0.6"] == len(res.train)


def test_config_errors_name_the_field(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("sources: [{name: nosuch}]\n")
    with pytest.raises(ValueError, match="sources"):
        load_build_config(p)
    p.write_text("curation:\n  calibration: {band: [0.9, 0.1]}\n")
    with pytest.raises(ValueError, match="band"):
        load_build_config(p)
    with pytest.raises(FileNotFoundError, match="--config"):
        load_build_config(tmp_path / "absent.yaml")


def test_calibration_on_a_real_tiny_model(tmp_path):
    """The tiny random Llama cannot do arithmetic: every prompt measures 0 and falls below the band."""
    pytest.importorskip("transformers")
    cfg = BuildConfig.model_validate({
        "name": "cal", "out_dir": str(tmp_path), "eval_fraction": 0.0,
        "sources": [{"name": "arithmetic", "n": 3, "max_digits": 3}],
        "calibration": {"model": "tiny-random", "k": 2, "max_new_tokens": 4, "band": [0.1, 0.9]}})
    res = build(cfg, write=False)
    assert res.train == [] and res.report["rejections"] == {"out_of_band": 3}
    assert res.report["pass_rate_histogram"]["0.0-0.1"] == 3


def test_infrastructure_failures_are_retried_once(monkeypatch):
    calls = []

    def checker(tasks):
        calls.append([t.id for t in tasks])
        first = len(calls) == 1
        return [(not first, "engine restarted" if first else "ok", None, first) for _ in tasks]
    monkeypatch.setattr(V, "_sandbox_checker", lambda workers: checker)
    kept, rejected = V.validate([py_task(1), py_task(2)], backend="sandbox")
    assert [t.id for t in kept] == ["p1", "p2"] and not rejected and calls == [["p1", "p2"], ["p1", "p2"]]


def test_a_different_task_reusing_an_id_is_rejected_not_kept_beside_the_first():
    """Rewards, pass rates and scores are looked up by task id: two tasks 'q1' would mix."""
    a = Task(id="q1", kind="math", source="mine", prompt="What is 2 + 3?", answer="5")
    b = Task(id="q1", kind="math", source="mine", prompt="How many legs do 3 spiders have?", answer="24")
    kept, rejected = curation.dedupe([a, b])
    assert kept == [a] and [(r.reason, r.id) for r in rejected] == [("invalid_schema", "q1")]
    assert "field 'id'" in rejected[0].detail
