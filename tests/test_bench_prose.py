"""bench/prose_baseline.py: the three readings of a base model's prose answer, and --rescore of a saved record."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.prose_baseline import readings

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("question, gold, completion, first, last, any_", [
    ("What is 6 - 4?", "2", "6 - 4 equals 2.", True, True, True),
    ("What is 8 - 3?", "5", "To work out 8 - 3, subtract 3 from 8, which is 1. So, 8 - 3 = 5.", False, True, True),
    ("What is 9 - 4?", "5", "9 - 4 = 5. Adding 1 gives 9, so the answer is 9.", True, False, True),
    ("What is 9 - 4?", "5", "1. 9 - 4 = 6\n2. The answer is 7.", False, False, False),
    ("What is 2 - 7?", "-5", "The difference is 5, no: \u22125.", False, True, True),
    ("What is 1 + 1?", "2", "I cannot say.", False, False, False),
])
def test_each_reading_takes_the_number_it_says(question, gold, completion, first, last, any_):
    assert readings(completion, question, gold) == {"first": first, "last": last, "any": any_}


def test_rescore_rewrites_a_saved_record_with_every_reading(tmp_path):
    rows = [{"prompt": "What is 2 + 3?", "answer": "5", "completion": "2 + 3 = 5."},
            {"prompt": "What is 7 - 1?", "answer": "6", "completion": "It is 5, no, 6. Or 7."},
            {"prompt": "What is 1 + 1?", "answer": "2", "completion": "Three."}]
    saved = tmp_path / "baseline.json"
    saved.write_text(json.dumps({"model": "m", "questions": 3, "rows": rows}))
    out = subprocess.run([sys.executable, "bench/prose_baseline.py", "--rescore", str(saved)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    record = json.loads(saved.read_text())
    assert record["readings"] == pytest.approx({"first": 1 / 3, "last": 1 / 3, "any": 2 / 3})
    assert record["lenient_pass_at_1"] == record["readings"]["any"] and "any number 0.667" in out.stdout
