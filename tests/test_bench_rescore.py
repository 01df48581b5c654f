"""bench/rescore_eval.py: saved evaluation answers scored again with today's answer check."""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import rescore_eval  # noqa: E402


def test_a_restated_question_counted_right_then_is_wrong_now(tmp_path):
    base = dict(kind="math", source="arithmetic", prompt="Work out 45 - 98.", answer="-53", formatted=True)
    rows = [dict(base, mode="sampled", completion=" <answer>45 - 98</answer>", correct=True),      # the hack
            dict(base, mode="sampled", completion=" <answer>-53</answer>", correct=True),
            dict(base, mode="sampled", completion=" <answer>-53</answer>", correct=True, wording="foreign"),
            dict(base, mode="greedy", completion="-53", correct=False, formatted=False),          # no tags
            dict(base, mode="sampled", source="reasoning_gym/chain_sum", completion=" <answer>1 + 2</answer>",
                 correct=False),                       # a numeric gold answer: judged again, wrong then and now
            dict(base, kind="python", mode="sampled", completion="", correct=True)]               # not math
    path = tmp_path / "eval_samples.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cells = rescore_eval.rescore(path)
    assert cells["sampled/in"] == {"answers": 3, "strict_then": round(2 / 3, 3), "strict_now": round(1 / 3, 3)}
    assert cells["sampled/foreign"] == {"answers": 1, "strict_then": 1.0, "strict_now": 1.0}
    assert cells["greedy/in"] == {"answers": 1, "strict_then": 0.0, "strict_now": 0.0}


def test_reasoning_gym_rows_with_a_numeric_gold_answer_are_judged_again(tmp_path):
    base = dict(kind="math", mode="sampled", formatted=True)
    rows = [dict(base, source="reasoning_gym/gsm_symbolic", answer="28080", completion="<answer>-28080</answer>",
                 correct=True),                        # its checker gave full credit to the wrong sign
            dict(base, source="reasoning_gym/chain_sum", answer="-4", completion="<answer>\u22124</answer>",
                 correct=False),                       # its checker gave 0 to a Unicode minus
            dict(base, source="reasoning_gym/fraction_simplification", answer="$\\dfrac{79}{173}$",
                 completion="<answer>158/346</answer>", correct=False)]   # a fraction gold: the verdict stands
                                                                          # (lowest terms, which its checker knows)
    path = tmp_path / "eval_samples.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [rescore_eval.judged_right_now(r) for r in rows] == [False, True, False]
    assert rescore_eval.rescore(path)["sampled/in"] == {"answers": 3, "strict_then": round(1 / 3, 3),
                                                       "strict_now": round(1 / 3, 3)}
