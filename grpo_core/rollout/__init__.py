"""Rollout: sampling a group of answers per prompt (samplers and their engines, prompt formats, multi-turn turns and tools)."""
