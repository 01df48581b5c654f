"""Rewards: answers judged as values, reward functions, code rewards from the sandbox, scoring groups as they are sampled."""
