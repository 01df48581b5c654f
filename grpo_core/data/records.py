"""What a source or a curation step yields besides tasks: a rejection with a per-item reason."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# Every reason a task can be dropped, with the sentence a report reader sees.
REASONS: dict[str, str] = {
    "invalid_schema": "the record does not fit the task schema (see detail for the field)",
    "answer_unparseable": "the gold math answer does not parse as a number or expression",
    "checker_rejects_gold": "the source's own answer checker does not accept its gold answer",
    "reference_missing": "a code task without a reference solution cannot be validated",
    "reference_failed": "the reference solution does not pass its own tests",
    "empty_tests": "the hidden tests are empty, so nothing would be checked",
    "sandbox_unavailable": "no sandbox or local runner could execute the tests",
    "tests_unsupported": "the sandbox cannot run these tests in its format (malformed for it)",
    "not_verifiable": "not automatically verifiable: GRPO needs a rule-based check (see detail)",
    "no_accepted_answer": "community question without an accepted answer",
    "low_score": "community question below the configured minimum score",
    "example_not_broken": "the 'broken' example compiles (or lacks the expected error), so there is nothing to fix",
    "no_compiling_fix": "no corrected example compiles, so there is no reference",
    "needs_nightly": "the example needs nightly-only features",
    "duplicate_exact": "same content as an earlier task",
    "duplicate_near": "near-duplicate (MinHash/shingle Jaccard above threshold) of an earlier task",
    "contaminated": "training prompt overlaps an evaluation prompt (n-gram overlap above threshold)",
    "out_of_band": "measured pass rate outside the calibration band (too easy or too hard)",
    "not_selected": "valid, but not drawn by the per-source mix",
}


@dataclass
class Rejection:
    id: str
    source: str
    reason: str
    detail: str = ""

    def __post_init__(self):
        if self.reason not in REASONS:
            raise ValueError(f"unknown rejection reason {self.reason!r}; add it to records.REASONS")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
