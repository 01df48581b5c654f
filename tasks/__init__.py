"""Prefect tasks, one per pipeline stage. They move paths and small records, never tensors."""
