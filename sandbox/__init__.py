"""Run untrusted Python and Rust code against hidden tests; return verdicts.

Public API: :mod:`sandbox.api` (``Job``, ``Limits``, ``Verdict``, ``score_batch``, ``score``,
``validate_tests``). Backends: Docker (default) and local (weaker fallback).
"""
from sandbox.types import Job, Limits, StageResult, TaskFormatError, TestResult, Verdict
from sandbox.api import get_backend, score, score_batch, validate_tests

__all__ = ["Job", "Limits", "StageResult", "TaskFormatError", "TestResult", "Verdict",
           "get_backend", "score", "score_batch", "validate_tests"]
