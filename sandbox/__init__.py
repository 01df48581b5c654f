"""Run untrusted Python and Rust code against hidden tests and return verdicts, or run a whole program
and return what it printed.

Public API: :mod:`sandbox.api` (``Job``, ``Limits``, ``Verdict``, ``score_batch``, ``score``,
``validate_tests``; ``Program``, ``RunOutput``, ``run_programs``, ``run_program``). Backends: Docker
(default) and local (weaker fallback).
"""
from sandbox.types import (Job, Limits, Program, RunOutput, StageResult, TaskFormatError, TestResult,
                           Verdict)
from sandbox.api import get_backend, run_program, run_programs, score, score_batch, validate_tests

__all__ = ["Job", "Limits", "Program", "RunOutput", "StageResult", "TaskFormatError", "TestResult",
           "Verdict", "get_backend", "run_program", "run_programs", "score", "score_batch",
           "validate_tests"]
