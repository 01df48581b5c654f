"""Evaluation: held-out scoring, pass@k, the promotion gate, fail-closed monitors, plots, which task a run is."""
