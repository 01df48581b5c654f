"""Prefect flows that compose the stage tasks, and the `grpo` command line."""
