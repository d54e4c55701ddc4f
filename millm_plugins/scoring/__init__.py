"""Scoring: next-token log-probabilities on completions and chat, with no generation."""
