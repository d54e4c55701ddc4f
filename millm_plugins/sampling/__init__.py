"""Sampling: temperature, top_p, top_k, seed, stop sequences and penalties."""
